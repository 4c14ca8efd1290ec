"""The one error type the core raises; each frontend maps its kind to a status (HTTP code, gRPC code)."""

from __future__ import annotations

import enum


class ErrorKind(enum.Enum):
    """What went wrong, in protocol-neutral terms (names follow gRPC status codes)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    UNAVAILABLE = "UNAVAILABLE"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    INTERNAL = "INTERNAL"
    UNIMPLEMENTED = "UNIMPLEMENTED"  # Triton's UNSUPPORTED: a feature this server was started without (HTTP 501)


class ServerError(Exception):
    """A failure the client should see: `kind` picks the status, `message` is safe to send as is."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message

    def __repr__(self) -> str:
        return f"ServerError({self.kind.name}, {self.message!r})"

    def __reduce__(self):
        """Pickled whole (subclasses and attributes too): errors cross from the core process to frontends."""
        return _rebuild, (type(self), self.kind, self.message, dict(self.__dict__))


def _rebuild(cls: type[ServerError], kind: ErrorKind, message: str, state: dict) -> ServerError:
    error = Exception.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    error.kind, error.message = kind, message
    return error


def invalid(message: str) -> ServerError:
    return ServerError(ErrorKind.INVALID_ARGUMENT, message)


def not_found(message: str) -> ServerError:
    return ServerError(ErrorKind.NOT_FOUND, message)


def unavailable(message: str) -> ServerError:
    return ServerError(ErrorKind.UNAVAILABLE, message)


def unimplemented(message: str) -> ServerError:
    return ServerError(ErrorKind.UNIMPLEMENTED, message)


def unknown_model(name: str) -> str:
    """Triton's text for a model the server does not know (model_repository_manager.cc FindModelIdentifier)."""
    return f"Request for unknown model: '{name}' is not found"
