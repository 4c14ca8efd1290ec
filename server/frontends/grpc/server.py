"""Kiln's gRPC server: the inference service, standard health service and server reflection over `http2`.

`GrpcServer` takes grpcio's method handlers (the generated `add_*Servicer_to_server` functions register into it as
into a `grpc.aio.Server`) and guards every call before its handler sees it:

* restricted API groups (`--grpc-restricted-protocol`) need their metadata entry: UNAVAILABLE otherwise (Triton's);
* a message whose bytes do not parse as the RPC's request type is INVALID_ARGUMENT (not a server fault);
* ModelInfer counts against the inflight limit shared with HTTP: RESOURCE_EXHAUSTED beyond it;
* messages above `max_message_size` are RESOURCE_EXHAUSTED, `max_concurrent_rpcs` likewise.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from collections import namedtuple
from collections.abc import Callable
from typing import Any

import grpc

from server.auth import RestrictedApi, grpc_group
from server.connection_handoff import Receiver
from server.core import hop_stats
from server.core.errors import ServerError
from server.core.limits import InflightLimiter
from server.protos import grpc_service_pb2, health_pb2, health_pb2_grpc
from server.protos._pool import POOL

from ..restricted import restricted_refusal
from .calls import (
    DECOMPRESSORS,
    Call,
    MessageReader,
    RequestStream,
    Submitter,
    call_metadata,
    malformed_message,
    parse_timeout,
)
from .errors import STATUS_CODES
from .health import HealthServicer
from .http2 import Http2Connection, Stream
from .options import GrpcOptions
from .servicer import add_to_server

log = logging.getLogger("kiln.server.grpc")

_HandlerCallDetails = namedtuple("_HandlerCallDetails", ("method", "invocation_metadata"))


def _http_error(stream: Stream, status: int, message: str) -> None:
    stream.send_headers([(":status", str(status)), ("content-type", "text/plain")])
    stream.send_data(message.encode(), end_stream=True)


class GrpcServer:
    """Method handlers, the calls in flight and the listening sockets of one gRPC endpoint."""

    def __init__(self, options: GrpcOptions, limiter: InflightLimiter, restricted: RestrictedApi) -> None:
        self.options = options
        self.limiter = limiter
        self.restricted = restricted
        self._http2 = options.http2_settings()
        self._registered: dict[str, grpc.RpcMethodHandler] = {}
        self._generic: list[Any] = []
        self._submitters: dict[str, tuple[Submitter, Callable[[Any], Any] | None]] = {}
        self._connections: set[Http2Connection] = set()
        self._servers: list[asyncio.AbstractServer] = []
        self._active = 0
        self._idle = asyncio.Event()
        self._ssl: ssl.SSLContext | None = None
        self._receiver: Receiver | None = None  # connections handed over by the server process
        self.port = 0

    # -- the grpc.aio.Server registration API that generated code calls ------------------------------------------
    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self._generic.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        for name, handler in handlers.items():
            self._registered[f"/{service}/{name}"] = handler

    def add_submitter(self, path: str, submit: Submitter, deserialize: Callable[[Any], Any] | None = None) -> None:
        """Run the unary method `path` through `submit` instead of its handler's coroutine (ModelInfer: a task and
        three coroutine frames less per call). The registered handler still supplies the (de)serializers, unless
        `deserialize` reads the request instead (ModelInfer: tensor bytes left in place, wire.py)."""
        self._submitters[path] = (submit, deserialize)

    def _handler(self, path: str, stream: Stream) -> grpc.RpcMethodHandler | None:
        handler = self._registered.get(path)
        if handler is None:
            details = _HandlerCallDetails(path, call_metadata(stream.headers))
            for generic in self._generic:
                handler = generic.service(details)
                if handler is not None:
                    break
        return handler

    # -- serving -----------------------------------------------------------------------------------------------------
    async def start(self, host: str, port: int, reuse_port: bool) -> int:
        loop = asyncio.get_running_loop()
        tls = self.options.tls
        self._ssl = tls.context(alpn=["h2"]) if tls is not None else None  # gRPC clients require ALPN h2
        try:
            server = await loop.create_server(self._connection, host, port, reuse_port=reuse_port or None,
                                              backlog=2048, ssl=self._ssl)
        except OSError as e:
            raise OSError(f"gRPC: cannot listen on {host}:{port}: {e}") from None
        self._servers.append(server)
        self.port = server.sockets[0].getsockname()[1]
        return self.port

    def serve_handed(self, channel: socket.socket) -> None:
        """Serve the connections the server process accepts and hands over `channel` (frontend processes:
        server/connection_handoff.py) instead of listening."""
        tls = self.options.tls
        self._ssl = tls.context(alpn=["h2"]) if tls is not None else None
        self._receiver = Receiver(channel, self._adopt)

    async def _adopt(self, connection: socket.socket) -> None:
        await asyncio.get_running_loop().connect_accepted_socket(self._connection, connection, ssl=self._ssl)

    def reload_certificates(self) -> None:
        """SIGHUP: re-read the certificate and key; handshakes from now on use them, open connections stay."""
        if self.options.tls is not None and self._ssl is not None:
            self.options.tls.reload(self._ssl, "gRPC")

    def _connection(self) -> Http2Connection:
        connection = Http2Connection(self, self._http2, on_close=self._connections.discard)
        self._connections.add(connection)
        return connection

    async def stop(self, grace: float | None) -> None:
        """Refuse new connections and calls (GOAWAY), let calls in flight finish for `grace` seconds, then close."""
        for server in self._servers:
            server.close()
        if self._receiver is not None:
            self._receiver.close()
        for connection in list(self._connections):
            connection.go_away()
        if self._active and grace:
            self._idle.clear()
            try:
                await asyncio.wait_for(self._idle.wait(), grace)
            except TimeoutError:
                log.warning("gRPC: %d call(s) still running after the %.1f s grace period", self._active, grace)
        for connection in list(self._connections):
            connection.abort()
        await asyncio.sleep(0)  # let the transports report their connections lost

    # -- calls ---------------------------------------------------------------------------------------------------------
    def stream_opened(self, stream: Stream, end_stream: bool) -> None:
        """A new request's headers: find its handler, check what can be checked before the message arrives."""
        headers = dict(stream.headers)  # a repeated name: its last value, as before
        path, content_type = headers.get(":path"), headers.get("content-type")
        timeout, encoding, accept = (headers.get("grpc-timeout"), headers.get("grpc-encoding"),
                                     headers.get("grpc-accept-encoding"))
        if headers.get(":method") != "POST":
            _http_error(stream, 405, "gRPC calls are POST requests")
            return
        if content_type is None or not content_type.startswith("application/grpc"):
            _http_error(stream, 415, f"not a gRPC request (content-type {content_type!r})")
            return
        options = self.options
        response_encoding = None
        if options.compression != "none" and accept and options.compression in (name.strip() for name in accept.split(",")):
            response_encoding = options.compression
        handler = self._handler(path or "", stream)
        call = Call(stream, path or "", handler, MessageReader(encoding, options.max_message_size),
                    response_encoding, options.max_message_size)
        stream.on_reset = call.reset_by_peer
        refusal = self._refusal(call, handler, encoding)
        if refusal is not None:
            call.finish(*refusal)
            return
        self._active += 1
        call.on_finish = self._finished
        if timeout is not None and (seconds := parse_timeout(timeout)) is not None:
            call.set_deadline(seconds)
        if handler.request_streaming:
            requests = RequestStream(call, call.deserialize)
            stream.on_data = lambda data: self._stream_data(call, requests, data)
            stream.on_end = requests.end
            call.start_streaming(requests)
        else:
            messages: list[bytes] = []
            stream.on_data = lambda data: self._unary_data(call, messages, data)
            stream.on_end = lambda: self._unary_request(call, messages)

    def _refusal(self, call: Call, handler: grpc.RpcMethodHandler | None,
                 encoding: str | None) -> tuple[grpc.StatusCode, str] | None:
        if handler is None:
            return grpc.StatusCode.UNIMPLEMENTED, "Method not found!"
        if self.restricted.restrictions:
            group = grpc_group(call.method)
            metadata = {k: v for k, v in call.invocation_metadata() if isinstance(v, str)}
            try:
                self.restricted.check(group, metadata)
            except ServerError as error:
                return _status(restricted_refusal(self.restricted, group, error, "protocol"))
        if encoding not in (None, "identity") and encoding not in DECOMPRESSORS:
            return grpc.StatusCode.UNIMPLEMENTED, f"grpc-encoding '{encoding}' is not supported"
        limit = self.options.max_concurrent_rpcs
        if limit is not None and self._active >= limit:
            return grpc.StatusCode.RESOURCE_EXHAUSTED, "Concurrent RPC limit exceeded!"
        return None

    def _finished(self, call: Call) -> None:
        self._active -= 1
        if call.limited:
            self.limiter.release()
        if not self._active:
            self._idle.set()

    def _read(self, call: Call, data: bytes | memoryview) -> list[bytes | memoryview] | None:
        """Messages out of `data`; None (and the call ended) when the bytes break the framing or a limit."""
        try:
            return call.reader.feed(data)
        except OverflowError as error:
            call.finish(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
        except ValueError as error:
            call.finish(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        return None

    def _unary_data(self, call: Call, messages: list[bytes], data: bytes) -> None:
        if call.done():
            return
        call.stream.consumed(len(data))
        received = self._read(call, data)
        if received:
            messages.extend(received)

    def _unary_request(self, call: Call, messages: list[bytes]) -> None:
        if call.done():
            return
        if len(messages) != 1 or call.reader.pending:
            call.finish(grpc.StatusCode.INVALID_ARGUMENT,
                        f"expected one request message, got {len(messages)}"
                        + (" and a partial one" if call.reader.pending else ""))
            return
        if hop_stats.ON:
            call.hop_started_ns = time.monotonic_ns()
        submitter, deserialize = self._submitters.get(call.method, (None, None))
        try:
            request = (deserialize or call.deserialize)(messages[0])
        except Exception as error:  # noqa: BLE001 - any parse failure is the client's malformed message
            call.finish(grpc.StatusCode.INVALID_ARGUMENT, malformed_message(error))
            return
        if call.method.endswith("/ModelInfer"):
            try:
                self.limiter.acquire()
            except ServerError as error:
                call.finish(*_status(error))
                return
            call.limited = True
        if submitter is not None:
            call.start_submitted(submitter, request)
        elif call.handler.response_streaming:
            call.start_streaming(request)
        else:
            call.start_unary(request)

    def _stream_data(self, call: Call, requests: RequestStream, data: bytes) -> None:
        if call.done():
            return
        received = self._read(call, data)
        if received is not None:
            requests.received(len(data), received)


def _status(error: ServerError) -> tuple[grpc.StatusCode, str]:
    return STATUS_CODES.get(error.kind.name, grpc.StatusCode.UNKNOWN), error.message


def _enable_reflection(server: GrpcServer, names: list[str]) -> bool:
    """Server reflection (grpcurl, grpcui, Postman) over Kiln's descriptor pool; skipped if grpcio-reflection is absent."""
    try:
        from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc
        from grpc_reflection.v1alpha._async import ReflectionServicer
    except ImportError:
        log.warning("grpcio-reflection is not installed: gRPC server reflection is off")
        return False
    servicer = ReflectionServicer([*names, reflection.SERVICE_NAME], pool=POOL)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    return True


async def start_grpc_server(core, host: str, port: int, *, limiter: InflightLimiter | None = None,
                            restricted: RestrictedApi | None = None, **options) -> GrpcServer:
    """Serve Triton's GRPCInferenceService for `core` on host:port and return the started server.

    `options` are the fields of `GrpcOptions` (max_message_size, keepalive_*, http2_*, compression, ...);
    `limiter` (shared with HTTP) bounds ModelInfer calls in flight, `restricted` names API groups that need a
    metadata credential. Stop it with `await server.stop(grace)`.
    """
    settings = GrpcOptions.from_kwargs(**options)
    server = GrpcServer(settings, limiter or InflightLimiter(), restricted or RestrictedApi())
    add_to_server(core, settings, server)
    services = [grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name]
    if settings.health:
        health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(core.ready), server)
        services.append(health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
    if settings.reflection:
        _enable_reflection(server, services)
    if settings.handoff is not None:
        server.serve_handed(settings.handoff)
        bound = server.port = port
    else:
        bound = await server.start(host, port, settings.reuse_port)
    log.info("gRPC inference service listening on %s:%s%s", host, bound,
             "" if settings.tls is None else " (TLS" + (", client certificates required)" if settings.tls.mutual
                                                      else ")"))
    return server
