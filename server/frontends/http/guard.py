"""ASGI middleware in front of every route: restricted APIs (401), body size (413, only with
`--http-max-body-bytes`), inference admission (429).

It runs before FastAPI reads a byte of the body: a declared Content-Length over the limit is refused at once,
and a chunked body is counted as it arrives and cut off at the limit, so an oversize upload never sits in memory.
Only inference requests count against `--max-inflight-requests`; health and metadata stay answerable under
overload (load balancers must still see the server).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from server.auth import RestrictedApi, http_group
from server.core.errors import ServerError
from server.core.limits import InflightLimiter, PayloadTooLarge, RequestLimits

from ..restricted import restricted_refusal
from .errors import http_status

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def _refuse(send: Send, error: ServerError) -> None:
    body = json.dumps({"error": error.message}).encode()
    await send({"type": "http.response.start", "status": http_status(error),
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


class GuardMiddleware:
    """Auth, size and admission checks for one FastAPI app (installed by `create_app`)."""

    def __init__(self, app: ASGIApp, limits: RequestLimits, limiter: InflightLimiter,
                 restricted: RestrictedApi) -> None:
        self.app = app
        self.limits = limits
        self.limiter = limiter
        self.restricted = restricted

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        group = http_group(scope.get("path", ""))
        refusal = self.refusal(group, _headers(scope))
        if refusal is not None:
            await _refuse(send, refusal)
            return
        if self.limits.max_body_bytes is not None:
            receive = self._counting(receive, self.limits.max_body_bytes)
        if group != "inference":
            await self.app(scope, receive, send)
            return
        try:
            self.limiter.acquire()
        except ServerError as error:
            await _refuse(send, error)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.limiter.release()

    def refusal(self, group: str, headers: dict[str, str]) -> ServerError | None:
        """What is refused before a byte of the body is read: a restricted API group without its credential
        (`headers` has lower-case names), a declared Content-Length over the limit. The HTTP protocol's own
        inference road (`protocol.py`) asks this too."""
        try:
            self.restricted.check(group, headers)
        except ServerError as error:
            return restricted_refusal(self.restricted, group, error, "API")
        try:
            self._check_declared_length(headers)
        except ServerError as error:
            return error
        return None

    def _check_declared_length(self, headers: dict[str, str]) -> None:
        declared = headers.get("content-length")
        if declared is not None and declared.strip().isdigit():
            self.limits.check_body_size(int(declared))

    def _counting(self, receive: Receive, limit: int) -> Receive:
        """`receive` that raises 413 once the body passes `limit` (chunked bodies declare no length)."""
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
            return message

        return counted
