"""The FastAPI application factory: routers + error handlers over one `ServerCore`."""

from __future__ import annotations

from fastapi import FastAPI

from server.core import ServerCore

from .errors import install_error_handlers
from .routers import ALL


def create_app(core: ServerCore) -> FastAPI:
    """The HTTP/REST frontend (KServe v2 + Triton extensions) for `core`; the caller owns the core's lifecycle."""
    import engine_core as kiln

    app = FastAPI(title="Kiln inference server", version=kiln.__version__,
                  description="KServe v2 inference protocol with Triton's extensions")
    app.state.core = core
    for router in ALL:
        app.include_router(router)
    install_error_handlers(app)
    return app
