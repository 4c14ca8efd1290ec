"""Starting the grpcio aio server: inference service, standard health service and server reflection."""

from __future__ import annotations

import logging

import grpc

from server.auth import RestrictedApi
from server.core.limits import InflightLimiter
from server.protos import grpc_service_pb2, health_pb2, health_pb2_grpc
from server.protos._pool import POOL

from .guard import GuardInterceptor
from .health import HealthServicer
from .options import GrpcOptions
from .servicer import add_to_server

log = logging.getLogger("kiln.server.grpc")


def _enable_reflection(server: grpc.aio.Server, names: list[str]) -> bool:
    """Server reflection (grpcurl, grpcui, Postman) over Kiln's descriptor pool; skipped if grpcio-reflection is absent."""
    try:
        from grpc_reflection.v1alpha import reflection
    except ImportError:
        log.warning("grpcio-reflection is not installed: gRPC server reflection is off")
        return False
    reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], server, pool=POOL)
    return True


async def start_grpc_server(core, host: str, port: int, *, limiter: InflightLimiter | None = None,
                            restricted: RestrictedApi | None = None, **options) -> grpc.aio.Server:
    """Serve Triton's GRPCInferenceService for `core` on host:port and return the started server.

    `options` are the fields of `GrpcOptions` (max_message_size, keepalive_*, http2_*, compression, ...);
    `limiter` (shared with HTTP) bounds ModelInfer calls in flight, `restricted` names API groups that need a
    metadata credential. Stop it with `await server.stop(grace)`.
    """
    settings = GrpcOptions.from_kwargs(**options)
    guard = GuardInterceptor(limiter or InflightLimiter(), restricted or RestrictedApi())
    server = grpc.aio.server(options=settings.channel_args(), compression=settings.grpc_compression,
                             maximum_concurrent_rpcs=settings.max_concurrent_rpcs, interceptors=[guard])
    add_to_server(core, settings, server)
    services = [grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name]
    if settings.health:
        health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(core.ready), server)
        services.append(health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
    if settings.reflection:
        _enable_reflection(server, services)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as e:  # grpcio's way of saying "bind failed"; callers handle OSError for all listeners
        raise OSError(f"gRPC: cannot listen on {address}: {e}") from None
    if bound == 0:
        raise OSError(f"gRPC: cannot listen on {address}")
    await server.start()
    log.info("gRPC inference service listening on %s", address if port else f"{host}:{bound}")
    return server
