"""ASGI fast path for `POST /v2/models/<name>[/versions/<v>]/infer`: the one route that carries the load.

Profiling the trivial model showed FastAPI's router (27 routes), dependency solving, `Request` objects and
exception middleware at ~10-15 % of the server's CPU per inference. This middleware answers exactly the two
inference paths itself with `routers.inference.run_infer`, the code the FastAPI route runs too, and turns
errors into the same `{"error": ...}` bodies and statuses as `errors.py`. Every other request (other paths,
other methods, trailing slashes) goes on to FastAPI unchanged. It sits inside `GuardMiddleware`, so auth, size
limits and admission still apply first.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from server.core import ErrorKind, ServerCore, ServerError
from server.core.limits import RequestLimits

from .errors import http_status
from .routers.inference import run_infer, wait_for_disconnect

log = logging.getLogger("kiln.server.http")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# The routes' `{model_name}` / `{model_version}` path parameters match [^/]+ (Starlette's default).
INFER_PATH = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")


class _Disconnected(Exception):
    """The client went away while the body was arriving: nobody to answer."""


async def read_body(receive: Receive) -> bytes:
    """The whole request body (what Starlette's `Request.body()` does)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Disconnected
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


async def _respond(send: Send, status: int, content: bytes, media_type: str | None,
                   headers: dict[str, str] | None = None) -> None:
    raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    raw.append((b"content-length", str(len(content)).encode()))
    if media_type is not None:
        raw.append((b"content-type", media_type.encode()))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": content})


def _error_body(message: str) -> bytes:
    """Byte for byte what `JSONResponse({"error": message})` renders."""
    return json.dumps({"error": message}, ensure_ascii=False, allow_nan=False, indent=None,
                      separators=(",", ":")).encode("utf-8")


class InferFastPath:
    """Answers POST .../infer without the router; passes everything else to `app`."""

    def __init__(self, app: ASGIApp, core: ServerCore, limits: RequestLimits) -> None:
        self.app = app
        self.core = core
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = INFER_PATH.fullmatch(scope.get("path", "")) if scope["type"] == "http" else None
        if match is None or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        try:
            await self._infer(scope, receive, send, match.group(1), match.group(2) or "")
        except _Disconnected:
            return
        except ServerError as error:
            if error.kind == ErrorKind.INTERNAL:
                log.error("internal error on POST %s: %s", scope.get("path"), error.message)
            await _respond(send, http_status(error), _error_body(error.message), "application/json")
        except Exception as error:  # noqa: BLE001 - as errors._unexpected: logged, never a stack trace to clients
            log.error("unexpected error on POST %s", scope.get("path"), exc_info=error)
            await _respond(send, 500, _error_body("internal error"), "application/json")

    async def _infer(self, scope: Scope, receive: Receive, send: Send, model_name: str, model_version: str) -> None:
        headers = _headers(scope)
        raw = await read_body(receive)
        outcome = await run_infer(self.core, self.limits, raw, lambda name: headers.get(name.lower()), model_name,
                                  model_version, lambda: wait_for_disconnect(receive))
        if outcome is None:  # nobody is listening any more (the route answers 499 the same way)
            await _respond(send, 499, b"", None)
            return
        await _respond(send, 200, outcome.content, outcome.media_type, outcome.headers)
