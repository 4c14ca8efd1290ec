"""A server interceptor in front of every RPC: restricted APIs, malformed messages, inference admission.

* Restricted API groups (`--grpc-restricted-protocol`) need their metadata entry: UNAVAILABLE otherwise (Triton's).
* A message whose bytes do not parse as the RPC's request type is INVALID_ARGUMENT (grpcio's own answer
  would be an INTERNAL error, which reads as a server fault).
* ModelInfer counts against the inflight limit shared with HTTP: RESOURCE_EXHAUSTED beyond it.
Oversize messages never reach here: grpcio refuses them with RESOURCE_EXHAUSTED (`max_message_size`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from server.auth import RestrictedApi, grpc_group
from server.core.errors import ServerError
from server.core.limits import InflightLimiter

from ..restricted import restricted_refusal
from .errors import STATUS_CODES


class _Malformed:
    """Stands in for a request whose bytes did not parse, so the behavior can answer INVALID_ARGUMENT."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _lenient(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as error:  # noqa: BLE001 - any parse failure is the client's malformed message
            return _Malformed(error)

    return parse


async def _abort_malformed(context: grpc.aio.ServicerContext, request: _Malformed) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"the request message does not parse: {type(request.error).__name__}: "
                        f"{str(request.error)[:200]}")


def _code(error: ServerError) -> grpc.StatusCode:
    return STATUS_CODES.get(error.kind.name, grpc.StatusCode.UNKNOWN)


class GuardInterceptor(grpc.aio.ServerInterceptor):
    """Wraps each method handler; the servicer itself never sees a malformed or unauthorized request."""

    def __init__(self, limiter: InflightLimiter, restricted: RestrictedApi) -> None:
        self.limiter = limiter
        self.restricted = restricted

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        group = grpc_group(details.method)
        metadata = {k.lower(): v for k, v in (details.invocation_metadata or ()) if isinstance(v, str)}
        try:
            self.restricted.check(group, metadata)
        except ServerError as error:
            return self._refusing(handler, restricted_refusal(self.restricted, group, error, "protocol"))
        return self._wrapped(handler, limited=details.method.endswith("/ModelInfer"))

    @staticmethod
    def _refusing(handler: Any, error: ServerError) -> Any:
        """A handler of the same shape that ends the call with `error`'s status."""

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(_code(error), error.message)

        async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await context.abort(_code(error), error.message)
            yield  # pragma: no cover - abort raises

        return _rebuild(handler, refuse, refuse_stream)

    def _wrapped(self, handler: Any, limited: bool) -> Any:
        limiter = self.limiter

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                await _abort_malformed(context, request)
            inner = handler.unary_unary or handler.stream_unary
            if not limited:
                return await inner(request, context)
            try:
                limiter.acquire()
            except ServerError as error:
                await context.abort(_code(error), error.message)
            try:
                return await inner(request, context)
            finally:
                limiter.release()

        async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if handler.request_streaming:
                request = _checked_stream(request)
            elif isinstance(request, _Malformed):
                await _abort_malformed(context, request)
            inner = handler.stream_stream or handler.unary_stream
            try:
                async for message in inner(request, context):
                    yield message
            except _MalformedInStream as error:  # aborted here, in the handler's task (not the stream reader's)
                await _abort_malformed(context, error.request)

        return _rebuild(handler, unary, streaming)


class _MalformedInStream(Exception):
    def __init__(self, request: _Malformed) -> None:
        super().__init__("malformed message in a request stream")
        self.request = request


async def _checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """A request stream that fails at its first malformed message; the handler wrapper turns that into
    INVALID_ARGUMENT. (Aborting from inside the iterator would run in whatever task reads the stream, and an
    abort from a task other than the handler's can leave the call hanging.)"""
    async for request in requests:
        if isinstance(request, _Malformed):
            raise _MalformedInStream(request)
        yield request


def _rebuild(handler: Any, unary: Callable, streaming: Callable) -> Any:
    """A method handler like `handler` (same streaming shape and serializers) running the given behaviors."""
    deserialize = _lenient(handler.request_deserializer)
    serialize = handler.response_serializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary, deserialize, serialize)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(streaming, deserialize, serialize)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary, deserialize, serialize)
    return grpc.stream_stream_rpc_method_handler(streaming, deserialize, serialize)
