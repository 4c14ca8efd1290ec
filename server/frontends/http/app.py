"""The FastAPI application factory: routers + error handlers over one `ServerCore`."""

from __future__ import annotations

from fastapi import FastAPI

from server.auth import RestrictedApi
from server.core import ServerCore
from server.core.limits import InflightLimiter, RequestLimits

from .errors import install_error_handlers
from .fastpath import InferFastPath
from .guard import GuardMiddleware
from .routers import ALL


def create_app(core: ServerCore, limits: RequestLimits | None = None, limiter: InflightLimiter | None = None,
               restricted: RestrictedApi | None = None) -> FastAPI:
    """The HTTP/REST frontend (KServe v2 + Triton extensions) for `core`; the caller owns the core's lifecycle.

    `limiter` is shared with the gRPC frontend so `--max-inflight-requests` bounds both together.
    """
    import engine_core as kiln

    app = FastAPI(title="Kiln inference server", version=kiln.__version__,
                  description="KServe v2 inference protocol with Triton's extensions")
    app.state.core = core
    app.state.limits = limits = limits or RequestLimits()
    limiter = limiter or InflightLimiter(limits.max_inflight_requests)
    for router in ALL:
        app.include_router(router)
    install_error_handlers(app)
    # Starlette runs the middleware added last first: Guard (auth, size, admission), then the inference fast path.
    app.add_middleware(InferFastPath, core=core, limits=limits)
    app.add_middleware(GuardMiddleware, limits=limits, limiter=limiter, restricted=restricted or RestrictedApi())
    return app
