"""The core's error kinds as HTTP status codes, and the handlers that turn every failure into `{"error": ...}`.

Clients never see stack traces: anything that is not a `ServerError` (or a request the schema refuses) is
logged with its traceback and answered with 500 "internal error".
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.core import ErrorKind, ServerError

log = logging.getLogger("kiln.server.http")

STATUS_OF_KIND: dict[ErrorKind, int] = {
    ErrorKind.INVALID_ARGUMENT: 400,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.RESOURCE_EXHAUSTED: 429,
    ErrorKind.ALREADY_EXISTS: 409,
    ErrorKind.INTERNAL: 500,
    ErrorKind.UNIMPLEMENTED: 501,  # as Triton answers TRITONSERVER_ERROR_UNSUPPORTED
}


def http_status(error: ServerError) -> int:
    """The status for `error`: its own when it has one (413 for oversize bodies), else by kind."""
    return getattr(error, "http_status", None) or STATUS_OF_KIND.get(error.kind, 500)


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _describe_validation(error: RequestValidationError) -> str:
    """One line per schema problem, e.g. "inputs.0.shape: Input should be a valid list"."""
    parts = []
    for problem in error.errors():
        where = ".".join(str(p) for p in problem.get("loc", ()) if p != "body")
        parts.append(f"{where}: {problem.get('msg', 'invalid')}" if where else str(problem.get("msg", "invalid")))
    return "invalid request: " + "; ".join(parts)


async def _server_error(request: Request, error: ServerError) -> JSONResponse:
    if error.kind == ErrorKind.INTERNAL:
        log.error("internal error on %s %s: %s", request.method, request.url.path, error.message)
    return error_response(http_status(error), error.message)


async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    return error_response(400, _describe_validation(error))


async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    return JSONResponse({"error": str(error.detail)}, status_code=error.status_code, headers=error.headers)


async def _unexpected(request: Request, error: Exception) -> JSONResponse:
    log.error("unexpected error on %s %s", request.method, request.url.path, exc_info=error)
    return error_response(500, "internal error")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ServerError, _server_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
