"""One gRPC call over one HTTP/2 stream: length-prefixed messages, compression, deadlines, status trailers.

`Call` is also the servicer context the handlers receive (the subset of `grpc.aio.ServicerContext` that
servicers use: abort, codes and details, metadata, peer, deadline, trailing metadata), so the generated
`add_*Servicer_to_server` functions, grpcio-reflection and Kiln's servicers run unchanged on this transport.
Handlers are grpcio `RpcMethodHandler`s with coroutine (unary response) or async-generator (streaming
response) behaviors.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import struct
import zlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc

from server.core import hop_stats

from .errors import status_of
from .hpack import Encoder
from .http2 import NO_ERROR, Stream

log = logging.getLogger("kiln.server.grpc")

_PREFIX = struct.Struct(">BI")
OK = grpc.StatusCode.OK
# Compressions the server reads; "identity" is no compression at all.
DECOMPRESSORS: dict[str, int] = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
# Headers that are transport, not call metadata (grpcio leaves them out of invocation_metadata too).
_TRANSPORT_HEADERS = frozenset({"content-type", "te", "grpc-timeout", "grpc-encoding", "grpc-accept-encoding"})

_encoder = Encoder()
#: a callback-style unary behavior: submit(request, reply) calls reply(response, None) or reply(None, error) once
#: and returns what to cancel to withdraw the request (or None)
#: (request, reply, call) -> what to cancel; the call is the servicer context (its invocation_metadata)
Submitter = Callable[[Any, Callable[[Any, "BaseException | None"], None], Any], "asyncio.Future | None"]


def response_headers(encoding: str | None) -> bytes:
    """The response's header block (an HPACK block that never changes, so it is encoded once per encoding)."""
    block = _HEADER_BLOCKS.get(encoding)
    if block is None:
        headers = [(":status", "200"), ("content-type", "application/grpc")]
        if encoding:
            headers.append(("grpc-encoding", encoding))
        block = _HEADER_BLOCKS[encoding] = _encoder.encode(headers)
    return block


_HEADER_BLOCKS: dict[str | None, bytes] = {}
_OK_TRAILERS = _encoder.encode([("grpc-status", "0")])


def percent_encode(message: str) -> str:
    """grpc-message's encoding: printable ASCII except '%' as is, every other UTF-8 byte as %XX."""
    if message.isascii() and message.isprintable() and "%" not in message:
        return message
    return "".join(chr(b) if 0x20 <= b <= 0x7E and b != 0x25 else f"%{b:02X}" for b in message.encode())


def parse_timeout(value: str) -> float | None:
    """grpc-timeout ("100m", "5S", ...) in seconds; None when it does not parse (then the call has no deadline)."""
    unit = _TIMEOUT_UNITS.get(value[-1:])
    digits = value[:-1]
    if unit is None or not digits.isdigit() or len(digits) > 8:
        return None
    return int(digits) * unit


def call_metadata(headers: Sequence[tuple[str, str]]) -> tuple[tuple[str, str | bytes], ...]:
    """invocation_metadata(): custom headers and user-agent; "-bin" values base64-decoded to bytes."""
    metadata: list[tuple[str, str | bytes]] = []
    for name, value in headers:
        if name.startswith(":") or name in _TRANSPORT_HEADERS:
            continue
        if name.endswith("-bin"):
            try:
                metadata.append((name, base64.b64decode(value + "=" * (-len(value) % 4))))
            except ValueError:
                continue
        else:
            metadata.append((name, value))
    return tuple(metadata)


class CallEnded(Exception):
    """The call already has its status (a malformed message in a request stream, an oversize message)."""


class MessageReader:
    """Cuts a stream's DATA into gRPC messages (1-byte compressed flag, 4-byte length, payload).

    Messages that arrive whole in one chunk are returned as views of it (no copy); a message split over chunks is
    joined once, when its last byte has arrived."""

    __slots__ = ("chunks", "have", "need", "encoding", "max_size")

    def __init__(self, encoding: str | None, max_size: int) -> None:
        self.chunks: list[bytes | memoryview] = []  # the start of an incomplete message
        self.have = 0
        self.need = 0
        self.encoding = encoding
        self.max_size = max_size

    @property
    def pending(self) -> bool:
        """Whether part of a message has arrived without its end."""
        return bool(self.chunks)

    def feed(self, data: bytes | memoryview) -> list[bytes | memoryview]:
        """The complete messages in what arrived so far; raises ValueError (OverflowError for a message above the
        size limit) naming what is wrong."""
        if self.chunks:
            self.chunks.append(data)
            self.have += len(data)
            if self.have < self.need:
                return []
            data = b"".join(self.chunks)
            self.chunks, self.have = [], 0
        view = memoryview(data)
        pos, end = 0, len(view)
        messages = []
        self.need = 5
        while end - pos >= 5:
            flag, length = _PREFIX.unpack_from(view, pos)
            if length > self.max_size:
                raise OverflowError(f"Received message larger than max ({length} vs. {self.max_size})")
            if end - pos - 5 < length:
                self.need = 5 + length
                break
            messages.append(self._payload(flag, view[pos + 5:pos + 5 + length]))
            pos += 5 + length
        if pos < end:
            self.chunks, self.have = [view[pos:]], end - pos
        return messages

    def _payload(self, flag: int, payload: memoryview) -> bytes | memoryview:
        if not flag:
            return payload
        if flag != 1:
            raise ValueError(f"invalid message flag {flag}")
        if self.encoding not in DECOMPRESSORS:
            raise ValueError(f"compressed message without a known grpc-encoding ({self.encoding!r})")
        inflater = zlib.decompressobj(DECOMPRESSORS[self.encoding])
        try:
            data = inflater.decompress(payload, self.max_size + 1)
        except zlib.error as error:
            raise ValueError(f"compressed message does not decompress: {error}") from None
        if len(data) > self.max_size or inflater.unconsumed_tail:
            raise OverflowError(f"Received message larger than max after decompression (> {self.max_size})")
        return data


class Call:
    """A call in progress, and the context its handler sees."""

    def __init__(self, stream: Stream, method: str, handler: grpc.RpcMethodHandler, reader: MessageReader,
                 response_encoding: str | None, max_send_size: int) -> None:
        self.stream = stream
        self.method = method
        self.handler = handler
        # grpcio's handlers leave out (de)serializers for raw bytes
        self.deserialize: Callable[[bytes], Any] = (handler and handler.request_deserializer) or _identity
        self.serialize: Callable[[Any], bytes] = (handler and handler.response_serializer) or _identity
        self.reader = reader
        self.response_encoding = response_encoding
        self.max_send_size = max_send_size
        self.task: asyncio.Future | None = None  # the handler's task, or the submitted job
        self.deadline: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._code: grpc.StatusCode = OK
        self._details = ""
        self._trailing: tuple = ()
        self._headers_sent = False
        self._finished = False
        self._cancelled = False
        self._done_callbacks: list[Callable[[Call], None]] = []
        self.on_finish: Callable[[Call], None] | None = None
        self.limited = False  # holds a slot of the inflight limiter until it finishes
        self.hop_started_ns = 0  # when its request was read, if hops are timed (server/core/hop_stats.py)
        self._metadata: tuple | None = None

    # -- servicer context ---------------------------------------------------------------------------------------
    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Sequence = ()) -> None:
        if code == OK:
            raise ValueError("abort() needs a status other than OK")
        self._code, self._details = code, details
        if trailing_metadata:
            self._trailing = tuple(trailing_metadata)
        raise grpc.aio.AbortError(f"aborted: {code.name} {details}")

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def set_trailing_metadata(self, trailing_metadata: Sequence) -> None:
        self._trailing = tuple(trailing_metadata)

    async def send_initial_metadata(self, initial_metadata: Sequence) -> None:
        """Initial metadata beyond the standard headers is not sent (no Kiln servicer has any)."""
        self._send_headers()

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        if self._metadata is None:
            self._metadata = call_metadata(self.stream.headers)
        return self._metadata

    def peer(self) -> str:
        return self.stream.connection.peer

    def auth_context(self) -> dict:
        return {}

    def time_remaining(self) -> float | None:
        if self.deadline is None:
            return None
        return max(self.deadline - self.stream.connection.loop.time(), 0.0)

    def cancelled(self) -> bool:
        return self._cancelled

    def done(self) -> bool:
        return self._finished

    def add_done_callback(self, callback: Callable[[Call], None]) -> None:
        if self._finished:
            callback(self)
        else:
            self._done_callbacks.append(callback)

    # -- running ---------------------------------------------------------------------------------------------------
    def set_deadline(self, timeout_s: float) -> None:
        loop = self.stream.connection.loop
        self.deadline = loop.time() + timeout_s
        self._timer = loop.call_later(timeout_s, self._deadline_expired)

    def _deadline_expired(self) -> None:
        self._timer = None
        if not self._finished:
            self.finish(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            if self.task is not None:
                self.task.cancel()

    def start_unary(self, request: Any) -> None:
        """Run a unary-response behavior; the response is sent from the task's completion (no wrapper task)."""
        behavior = self.handler.unary_unary or self.handler.stream_unary
        self.task = task = asyncio.ensure_future(behavior(request, self))
        task.add_done_callback(self._unary_done)

    def _unary_done(self, task: asyncio.Task) -> None:
        if task.cancelled():
            self._answered(None, asyncio.CancelledError())
        elif task.exception() is None and self._code != OK:  # set_code without abort
            self.finish(self._code, self._details)
        else:
            error = task.exception()
            self._answered(None if error is not None else task.result(), error)

    def start_submitted(self, submit: Submitter, request: Any) -> None:
        """Run a unary call through a callback-style submitter (no task, no coroutine frames)."""
        self.task = submit(request, self._answered, self)

    def _answered(self, response: Any, error: BaseException | None) -> None:
        """The end of a unary call: its response, or the error that took its place."""
        if self._finished:
            return
        if isinstance(error, asyncio.CancelledError):
            self._cancelled = True
            self.finish(grpc.StatusCode.CANCELLED, "Cancelled")
            return
        if error is None:
            try:
                self.send_message(self.serialize(response))
            except Exception as e:  # noqa: BLE001 - a response that does not serialize is a server bug
                error = e
        if error is not None:
            self._fail(error)
        else:
            self.finish(OK, "")
        if self.hop_started_ns:
            hop_stats.stats("frontend").add("gRPC request in -> response out", self.hop_started_ns)

    def start_streaming(self, request: Any) -> None:
        self.task = asyncio.ensure_future(self._stream_responses(request))

    async def _stream_responses(self, request: Any) -> None:
        behavior = self.handler.stream_stream or self.handler.unary_stream
        serialize = self.serialize
        connection = self.stream.connection
        try:
            async for message in behavior(request, self):
                self.send_message(serialize(message))
                await connection.drain()
        except asyncio.CancelledError:
            self._cancelled = True
            self.finish(grpc.StatusCode.CANCELLED, "Cancelled")
            raise
        except Exception as error:  # noqa: BLE001 - turned into the call's status
            self._fail(error)
            return
        self.finish(self._code, self._details)

    def _fail(self, error: BaseException) -> None:
        """A handler's exception as the call's status: an abort's own status, a ServerError's mapped one, and for
        anything else (a bug) INTERNAL, logged with its traceback (`errors.status_of`)."""
        if self._finished:
            return
        if isinstance(error, (grpc.aio.AbortError, CallEnded)) and self._code != OK:
            self.finish(self._code, self._details)
            return
        self.finish(*status_of(error))

    def send_message(self, payload: bytes) -> None:
        if self._finished:
            raise CallEnded()
        if len(payload) > self.max_send_size:
            self.finish(grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"Sent message larger than max ({len(payload)} vs. {self.max_send_size})")
            raise CallEnded()
        flag = 0
        if self.response_encoding is not None:
            payload = _compress(payload, self.response_encoding)
            flag = 1
        self._send_headers()
        prefix = _PREFIX.pack(flag, len(payload))
        if len(payload) <= 4096:
            self.stream.send_data(prefix + payload)
        else:  # two DATA frames rather than a copy of a large message
            self.stream.send_data(prefix)
            self.stream.send_data(payload)

    def _send_headers(self) -> None:
        if not self._headers_sent:
            self._headers_sent = True
            self.stream.send_headers(response_headers(self.response_encoding))

    def finish(self, code: grpc.StatusCode, details: str) -> None:
        """Send the status (as trailers, or trailers-only when nothing was sent yet) and end the stream."""
        if self._finished:
            return
        self._finished = True
        self._code, self._details = code, details
        self._stop_timer()
        stream = self.stream
        if code == OK and not self._trailing:
            self._send_headers()
            stream.send_headers(_OK_TRAILERS, end_stream=True)
        else:
            trailers = [("grpc-status", str(code.value[0]))]
            if details:
                trailers.append(("grpc-message", percent_encode(details)))
            trailers.extend(_ascii_metadata(self._trailing))
            if not self._headers_sent:  # trailers-only response
                self._headers_sent = True
                trailers = [(":status", "200"), ("content-type", "application/grpc"), *trailers]
            stream.send_headers(trailers, end_stream=True)
        if not stream.closed_remote and not stream.pending:
            stream.reset(NO_ERROR)  # answered before the request ended: the client may stop sending
        self._notify()

    def reset_by_peer(self) -> None:
        """RST_STREAM from the client or a lost connection: nothing more can be sent; the handler stops."""
        if self._finished:
            return
        self._cancelled = True
        self._finished = True
        self._stop_timer()
        if self.task is not None:
            self.task.cancel()
        self._notify()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _notify(self) -> None:
        if self.on_finish is not None:
            self.on_finish(self)
        for callback in self._done_callbacks:
            callback(self)


def _identity(data: Any) -> Any:
    """Raw-bytes methods (no serializer) get bytes, as from grpcio, even where the transport holds a view."""
    return bytes(data) if isinstance(data, memoryview) else data


def _compress(payload: bytes, encoding: str) -> bytes:
    deflater = zlib.compressobj(wbits=DECOMPRESSORS[encoding])
    return deflater.compress(payload) + deflater.flush()


def _ascii_metadata(metadata: Sequence) -> list[tuple[str, str]]:
    pairs = []
    for name, value in metadata:
        if isinstance(value, bytes):
            value = base64.b64encode(value).decode().rstrip("=")
        pairs.append((str(name).lower(), str(value)))
    return pairs


class RequestStream:
    """The request iterator of a client-streaming call: messages as they arrive, then the end.

    Received bytes go back to the client's flow-control window as they arrive while few messages wait unread;
    beyond that only as the handler reads them, so a client that sends faster than the server serves is held back
    by HTTP/2 flow control instead of filling memory.
    """

    UNREAD_LIMIT = 32

    def __init__(self, call: Call, deserialize: Callable[[bytes], Any]) -> None:
        self._call = call
        self._deserialize = deserialize
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._owed = 0  # consumed-window credit held back while the handler lags

    def received(self, nbytes: int, messages: list[bytes]) -> None:
        for message in messages:
            self._queue.put_nowait(message)
        if self._queue.qsize() < self.UNREAD_LIMIT:
            self._call.stream.consumed(nbytes + self._owed)
            self._owed = 0
        else:
            self._owed += nbytes

    def end(self, error: Exception | None = None) -> None:
        self._queue.put_nowait(error if error is not None else StopAsyncIteration())

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        item = await self._queue.get()
        if self._owed and self._queue.qsize() < self.UNREAD_LIMIT:
            self._call.stream.consumed(self._owed)
            self._owed = 0
        if isinstance(item, BaseException):
            self._queue.put_nowait(item)  # every later read ends the same way
            raise item
        try:
            return self._deserialize(item)
        except Exception as error:  # noqa: BLE001 - any parse failure is the client's malformed message
            self._call.set_code(grpc.StatusCode.INVALID_ARGUMENT)
            self._call.set_details(malformed_message(error))
            raise CallEnded() from None


def malformed_message(error: Exception) -> str:
    return f"the request message does not parse: {type(error).__name__}: {str(error)[:200]}"
