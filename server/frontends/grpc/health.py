"""Standard `grpc.health.v1.Health`, answered from the core's readiness.

Load balancers and Kubernetes gRPC probes call this instead of Triton's ServerReady; the empty service name
and the inference service's name both mean "can this server take inference requests now".
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from server.protos import health_pb2, health_pb2_grpc

ServingStatus = health_pb2.HealthCheckResponse.ServingStatus
INFERENCE_SERVICE = "inference.GRPCInferenceService"


class HealthServicer(health_pb2_grpc.HealthServicer):
    """Check and Watch over a readiness callable; Watch polls it, since the core has no change events."""

    def __init__(self, is_ready: Callable[[], Awaitable[bool]], poll_interval_s: float = 1.0) -> None:
        self._is_ready = is_ready
        self._poll_interval_s = poll_interval_s
        self._services = {"", INFERENCE_SERVICE, "grpc.health.v1.Health"}

    async def _status(self, service: str) -> int:
        if service not in self._services:
            return ServingStatus.SERVICE_UNKNOWN
        if service == "grpc.health.v1.Health":
            return ServingStatus.SERVING
        return ServingStatus.SERVING if await self._is_ready() else ServingStatus.NOT_SERVING

    async def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext):
        status = await self._status(request.service)
        if status == ServingStatus.SERVICE_UNKNOWN:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service '{request.service}'")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest,
                    context: grpc.aio.ServicerContext) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        last = None
        while True:
            status = await self._status(request.service)
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            await asyncio.sleep(self._poll_interval_s)
