"""HTTP/1.1 connections: uvicorn's httptools protocol, with `POST /v2/models/<m>[/versions/<v>]/infer` answered
without ASGI.

Why: per JSON inference on the CPU, the ASGI machinery around the inference code (uvicorn's scope and cycle
objects, an `asyncio.Event` and a task per request, three middlewares, a dict per message, uvicorn's `send`) was
about a third of the event loop's time (docs/performance.md). This protocol recognises an inference request once
its headers are parsed, collects its body, runs the checks of `GuardMiddleware` and `DrainMiddleware` as plain
calls, starts the request with the core's `submit_infer` (answered from a callback, no task) and writes the
response bytes itself. Everything else goes through uvicorn's ASGI cycle to FastAPI, unchanged: other routes,
`Expect: 100-continue`, a request pipelined behind one still in flight, paths with a query or percent-escapes.

Both roads run the same request code (`routers.inference.read_infer_request` / `infer_outcome`), so answers,
statuses and error bodies are the same. This leans on `HttpToolsProtocol`'s per-connection state (`cycle`,
`pipeline`, `flow`, `on_response_complete`); pyproject.toml bounds the uvicorn versions it was checked against.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from server.core import hop_stats
from server.core.errors import ErrorKind, ServerError
from server.core.limits import PayloadTooLarge
from server.lifecycle import Lifecycle

from .errors import http_status
from .guard import GuardMiddleware
from .routers.inference import UnparsedBody, infer_outcome, read_infer_request

log = logging.getLogger("kiln.server.http")

# The route's `{model_name}` / `{model_version}` match [^/]+; a query or an escape takes the ASGI road.
_INFER_URL = re.compile(rb"/v2/models/([^/?%]+)(?:/versions/([^/?%]+))?/infer")
# Responses this small leave in one write with their headers (one send call instead of two).
_JOIN_BELOW = 64 * 1024


class _NoEvent:
    """What the base protocol calls `message_event.set()` on when the connection goes: nothing waits here."""

    @staticmethod
    def set() -> None:
        pass


_NO_EVENT = _NoEvent()


class InferRoute:
    """What the inference road needs from the server: the core, the guard's checks and the drain state."""

    def __init__(self, core: Any, guard: GuardMiddleware, lifecycle: Lifecycle) -> None:
        self.core = core
        self.guard = guard
        self.lifecycle = lifecycle


class _Exchange:
    """One inference request on the protocol's own road. It stands in for uvicorn's `RequestResponseCycle` as the
    connection's `cycle`, with the attributes the base protocol reads (`response_complete`, `keep_alive`,
    `disconnected`, `message_event`)."""

    __slots__ = ("protocol", "route", "model", "version", "headers", "chunks", "size", "keep_alive",
                 "response_complete", "disconnected", "message_event", "job", "admitted", "request", "hop_started_ns")

    def __init__(self, protocol: KilnHttpProtocol, route: InferRoute, model: str, version: str,
                 headers: dict[str, str], keep_alive: bool) -> None:
        self.protocol = protocol
        self.route = route
        self.model = model
        self.version = version
        self.headers = headers
        self.chunks: list[bytes] = []
        self.size = 0
        self.keep_alive = keep_alive
        self.response_complete = False
        self.disconnected = False
        self.message_event = _NO_EVENT
        self.job: asyncio.Future | None = None
        self.admitted = False  # holds an in-flight slot (--max-inflight-requests) and the drain tracker's count
        self.request: Any = None
        self.hop_started_ns = 0  # when its body was complete, if hops are timed (server/core/hop_stats.py)

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())

    def admit(self) -> bool:
        """The guard's checks before the body: False when refused (and answered)."""
        guard = self.route.guard
        refusal = guard.refusal("inference", self.headers)
        if refusal is None:
            try:
                guard.limiter.acquire()
            except ServerError as error:
                refusal = error
        if refusal is not None:
            self.fail(refusal)
            return False
        self.admitted = True
        self.route.lifecycle.tracker.enter()
        return True

    def add(self, data: bytes) -> None:
        """A piece of the body; past `--http-max-body-bytes` the request is refused (413) at once."""
        if self.response_complete:
            return
        self.chunks.append(data)
        self.size += len(data)
        limit = self.route.guard.limits.max_body_bytes
        if limit is not None and self.size > limit:
            self.chunks = []
            self.fail(PayloadTooLarge(f"request body exceeds the limit of {limit} bytes"))

    def start(self) -> None:
        """The body is complete: decode it and submit the request (answered in `answered`)."""
        if self.response_complete:
            return
        if hop_stats.ON:
            self.hop_started_ns = time.monotonic_ns()
        raw = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks = []
        core = self.route.core
        try:
            self.request = read_infer_request(self.route.guard.limits, raw, self.header, self.model, self.version)
        except UnparsedBody as unparsed:  # an unknown model is 404 first, as Triton answers
            error = unparsed.error
            self.job = asyncio.ensure_future(core.model_metadata(self.model, self.version))
            self.job.add_done_callback(lambda done: self._unparsed(done, error))
            return
        except ServerError as error:
            self.fail(error)
            return
        except Exception as error:  # noqa: BLE001 - logged; the client gets a 500 without the details
            self.crash(error)
            return
        self.job = core.submit_infer(self.request, self.answered)

    def _unparsed(self, lookup: asyncio.Future, error: ServerError) -> None:
        if lookup.cancelled():
            return
        self.fail(lookup.exception() or error)  # type: ignore[arg-type]

    def answered(self, response: Any, error: BaseException | None) -> None:
        """The core's answer (on the event loop): the response, or the error as the route would answer it."""
        if self.response_complete:
            return
        if error is None:
            try:
                outcome = infer_outcome(self.request, response, self.header)
            except ServerError as e:
                self.fail(e)
                return
            except Exception as e:  # noqa: BLE001
                self.crash(e)
                return
            self.respond(200, outcome.content, outcome.media_type, outcome.headers)
            if self.hop_started_ns:
                hop_stats.stats("frontend").add("HTTP request in -> response out", self.hop_started_ns)
        elif isinstance(error, ServerError):
            self.fail(error)
        elif isinstance(error, asyncio.CancelledError):
            self.finish()  # withdrawn: the client went away
        else:
            self.crash(error)

    def fail(self, error: BaseException) -> None:
        if not isinstance(error, ServerError):
            self.crash(error)
            return
        if error.kind == ErrorKind.INTERNAL:
            log.error("internal error on POST /v2/models/%s/infer: %s", self.model, error.message)
        self.respond(http_status(error), _error_body(error.message), "application/json")

    def crash(self, error: BaseException) -> None:
        log.error("unexpected error on POST /v2/models/%s/infer", self.model, exc_info=error)
        self.respond(500, _error_body("internal error"), "application/json")

    def respond(self, status: int, content: bytes, media_type: str, headers: dict[str, str] | None = None) -> None:
        """Write the whole response; then the connection goes on (keep-alive, a pipelined request) or closes."""
        if self.response_complete:
            return
        protocol = self.protocol
        keep_alive = self.keep_alive and not self.route.lifecycle.draining
        lines = [STATUS_LINE[status]]
        for name, value in protocol.server_state.default_headers:
            lines += [name, b": ", value, b"\r\n"]
        lines.append(b"content-type: %s\r\ncontent-length: %d\r\n" % (media_type.encode("latin-1"), len(content)))
        for name, value in (headers or {}).items():
            lines.append(b"%s: %s\r\n" % (name.lower().encode("latin-1"), value.encode("latin-1")))
        if not keep_alive:
            lines.append(b"connection: close\r\n")
        lines.append(b"\r\n")
        transport = protocol.transport
        if len(content) < _JOIN_BELOW:
            lines.append(content)
            transport.write(b"".join(lines))
        else:
            transport.write(b"".join(lines))
            transport.write(content)
        self.finish()
        if not keep_alive:
            transport.close()
        protocol.exchange_done(self)

    def finish(self) -> None:
        """Done with this request (answered or abandoned): its in-flight slot and drain count are given back."""
        self.response_complete = True
        if self.admitted:
            self.admitted = False
            self.route.guard.limiter.release()
            self.route.lifecycle.tracker.leave()

    def abandon(self) -> None:
        """The client went away before the answer: the request leaves the core's queue, its slot is freed."""
        self.disconnected = True
        if self.job is not None and not self.job.done():
            self.job.cancel()
        self.finish()


def _error_body(message: str) -> bytes:
    """Byte for byte what `JSONResponse({"error": message})` renders (the ASGI road's error bodies)."""
    return json.dumps({"error": message}, ensure_ascii=False, allow_nan=False, indent=None,
                      separators=(",", ":")).encode("utf-8")


class KilnHttpProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol with the inference road; `route` is set on the subclass `protocol_for` makes."""

    route: InferRoute

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.exchange: _Exchange | None = None  # the request on the inference road, while it is in flight

    def on_message_begin(self) -> None:
        """uvicorn's, less the ASGI scope (a dict and a copy of the app state per request): only a request that
        takes the ASGI road needs one, and `on_headers_complete` makes it then."""
        self.url = b""
        self.expect_100_continue = False
        self.headers = []

    def _asgi_scope(self) -> None:
        """The scope uvicorn's `on_message_begin` makes, over the URL and headers parsed so far."""
        url, headers, expect = self.url, self.headers, self.expect_100_continue
        super().on_message_begin()
        self.url, self.headers, self.expect_100_continue = url, headers, expect
        self.scope["headers"] = headers

    def on_headers_complete(self) -> None:
        if self.parser.get_method() == b"POST" and not self.expect_100_continue and (
                self.cycle is None or self.cycle.response_complete):
            match = _INFER_URL.fullmatch(self.url)
            if match is not None and self.url.isascii() and not self.parser.should_upgrade():
                self._start_exchange(match)
                return
        self._asgi_scope()
        super().on_headers_complete()

    def _start_exchange(self, match: re.Match) -> None:
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in self.headers}
        keep_alive = self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()
        model, version = match.group(1).decode("ascii"), (match.group(2) or b"").decode("ascii")
        self.exchange = self.cycle = _Exchange(self, self.route, model, version, headers, keep_alive)  # type: ignore[assignment]
        self.exchange.admit()

    def on_body(self, body: bytes) -> None:
        if self.cycle is self.exchange and self.exchange is not None:
            self.exchange.add(body)
            return
        super().on_body(body)

    def on_message_complete(self) -> None:
        if self.cycle is self.exchange and self.exchange is not None:
            self.exchange.start()
            return
        super().on_message_complete()

    def exchange_done(self, exchange: _Exchange) -> None:
        """The exchange wrote its response: the next request on this connection may start."""
        if self.exchange is exchange:
            self.exchange = None
        if self.transport is not None and not self.transport.is_closing():
            self.on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        exchange = self.exchange
        if exchange is not None and not exchange.response_complete:
            exchange.abandon()
        self.exchange = None
        super().connection_lost(exc)


def protocol_for(route: InferRoute) -> type[KilnHttpProtocol]:
    """The protocol class uvicorn instantiates per connection (its `http` setting), bound to `route`."""
    return type("KilnHttpProtocol", (KilnHttpProtocol,), {"route": route})
