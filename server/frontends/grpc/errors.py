"""The core's error kinds as gRPC status codes, and the one place handlers turn exceptions into statuses."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from server.core.errors import ServerError

log = logging.getLogger("kiln.server.grpc")

# Keyed by the kind's name so the table reads like the protocol docs.
STATUS_CODES: dict[str, grpc.StatusCode] = {
    "INVALID_ARGUMENT": grpc.StatusCode.INVALID_ARGUMENT,
    "NOT_FOUND": grpc.StatusCode.NOT_FOUND,
    "UNAVAILABLE": grpc.StatusCode.UNAVAILABLE,
    "RESOURCE_EXHAUSTED": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "ALREADY_EXISTS": grpc.StatusCode.ALREADY_EXISTS,
    "INTERNAL": grpc.StatusCode.INTERNAL,
    "UNIMPLEMENTED": grpc.StatusCode.UNIMPLEMENTED,
}


def status_of(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and client-facing message for an exception raised while serving a request.

    Anything that is not a ServerError is a bug: the client gets INTERNAL without details
    (no stack traces over the wire) and the traceback goes to the log.
    """
    if isinstance(error, ServerError):
        return STATUS_CODES.get(error.kind.name, grpc.StatusCode.UNKNOWN), error.message
    log.error("unexpected error while serving a gRPC request", exc_info=error)
    return grpc.StatusCode.INTERNAL, "internal error"


Handler = TypeVar("Handler", bound=Callable[..., Awaitable])


def translate_errors(handler: Handler) -> Handler:
    """Wrap a unary servicer method so every failure ends the call with its mapped status."""

    @functools.wraps(handler)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        try:
            return await handler(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as error:  # noqa: BLE001 - mapped to a status, bugs are logged
            code, message = status_of(error)
            await context.abort(code, message)

    return wrapper
