"""The server side of HTTP/2 (RFC 9113) over an asyncio transport: frames, streams, flow control, pings.

Why Kiln has its own: grpcio's server spends ~300 µs of CPU per unary call in its completion queue and thread
hand-offs, 4-5x what the rest of a request costs; an asyncio protocol that parses frames in place costs ~60 µs.
This layer knows nothing of gRPC: `Http2Connection` hands each new stream's headers to an application object
(`StreamHandler`), delivers its data to the callbacks the application sets on the `Stream`, and sends what the
application writes, within the peer's flow-control windows. Cleartext HTTP/2 with prior knowledge only (what
gRPC clients speak); no server push, priorities are read and ignored.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from server.core.framing import ReadBuffer

from .hpack import Decoder, Encoder, HpackError

log = logging.getLogger("kiln.server.grpc")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# frame types
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
# flags
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
# error codes
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 0x5, 0x6, 0x7, 0x8, 0x9
ENHANCE_YOUR_CALM = 0xB
# settings identifiers
SETTINGS_HEADER_TABLE_SIZE, SETTINGS_ENABLE_PUSH, SETTINGS_MAX_CONCURRENT_STREAMS = 0x1, 0x2, 0x3
SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE, SETTINGS_MAX_HEADER_LIST_SIZE = 0x4, 0x5, 0x6

MAX_WINDOW = (1 << 31) - 1
DEFAULT_WINDOW = 65_535
DEFAULT_FRAME_SIZE = 16_384

_HEAD = struct.Struct(">HBBBI")  # 24-bit length as (high 16, low 8), type, flags, stream id
_U32 = struct.Struct(">I")
_SETTING = struct.Struct(">HI")


def frame(kind: int, flags: int, stream_id: int, payload: bytes | memoryview = b"") -> bytes:
    """One frame: 9-byte header and payload."""
    n = len(payload)
    return _HEAD.pack(n >> 8, n & 0xFF, kind, flags, stream_id) + payload


_SMALL = 4096  # payloads up to this size are copied behind their frame header; larger ones are written as they are


class ConnectionError_(Exception):  # noqa: N801 - the builtin ConnectionError means something else
    """A connection error (RFC 9113 5.4.1): the connection ends with GOAWAY carrying `code`."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Http2Settings:
    """What this server advertises and how it polices pings (the gRPC keepalive options map onto these)."""

    initial_window: int = 4 << 20  # per stream; gRPC messages of a few MB flow without waiting for updates
    connection_window: int = 64 << 20
    max_frame_size: int = 1 << 20  # large DATA frames: fewer frames (and Python calls) per big tensor
    max_header_list_size: int = 64 << 10
    keepalive_time_s: float = 7200.0
    keepalive_timeout_s: float = 20.0
    keepalive_permit_without_calls: bool = False
    max_pings_without_data: int = 2  # server pings sent with no data in between (0: no limit)
    min_recv_ping_interval_s: float = 300.0  # closer client pings without data are strikes
    max_ping_strikes: int = 2  # strikes beyond this: GOAWAY ENHANCE_YOUR_CALM (0: no limit)


def _release(stream: Stream) -> None:
    """A stream that ended drops its application's callbacks (stream -> call -> stream): the call's objects then go
    with reference counting, leaving no cycle for the garbage collector to pause the event loop over."""
    stream.on_data = stream.on_end = stream.on_reset = None


def _reset(stream: Stream) -> None:
    """A stream reset by either side: closed both ways, its application told, then released."""
    stream.closed_local = stream.closed_remote = True
    on_reset = stream.on_reset
    _release(stream)
    if on_reset is not None:
        on_reset()


class StreamHandler(Protocol):
    """The application: told of each new stream once its header block is complete."""

    def stream_opened(self, stream: Stream, end_stream: bool) -> None: ...


class Stream:
    """One request/response exchange. The application sets `on_data`, `on_end` and `on_reset` and writes with
    `send_headers`/`send_data`; writes queue behind the peer's flow-control window."""

    __slots__ = ("id", "headers", "connection", "send_window", "pending", "closed_remote", "closed_local",
                 "on_data", "on_end", "on_reset", "recv_window", "credit")

    def __init__(self, stream_id: int, headers: list[tuple[str, str]], connection: Http2Connection,
                 send_window: int, recv_window: int) -> None:
        self.id = stream_id
        self.headers = headers
        self.connection = connection
        self.send_window = send_window
        self.pending: deque[tuple[int, bytes, bool]] = deque()  # (frame type, payload or header block, end)
        self.closed_remote = False
        self.closed_local = False
        self.on_data: Callable[[bytes], None] | None = None
        self.on_end: Callable[[], None] | None = None
        self.on_reset: Callable[[], None] | None = None
        self.recv_window = recv_window  # what the peer may still send on this stream
        self.credit = 0  # bytes the application consumed and the peer has not been told of yet

    def send_headers(self, headers: list[tuple[str, str]] | bytes, end_stream: bool = False) -> None:
        """Headers (or trailers, with end_stream) as pairs or an HPACK block encoded before."""
        if self.closed_local:
            return
        block = headers if isinstance(headers, bytes) else self.connection.encoder.encode(headers)
        self.pending.append((HEADERS, block, end_stream))
        self.closed_local = end_stream
        self.connection.pump(self)

    def send_data(self, data: bytes, end_stream: bool = False) -> None:
        if self.closed_local:
            return
        self.pending.append((DATA, data, end_stream))
        self.closed_local = end_stream
        self.connection.pump(self)

    def consumed(self, n: int) -> None:
        """The application took `n` received bytes: the peer may send that much more on this stream."""
        self.connection.release_stream_window(self, n)

    def reset(self, code: int = CANCEL) -> None:
        """End the stream at once (RST_STREAM); queued writes are dropped."""
        self.connection.reset_stream(self, code)


class Http2Connection(asyncio.BufferedProtocol):
    """One client connection. Read as a buffered protocol: the socket is read straight into the connection's buffer,
    and a large frame into a buffer of its own size (`ReadBuffer`), so a 600 KB tensor is copied once on its way in,
    not once into a `bytes` per read and again when the reads of one frame were joined (21% of a frontend's CPU
    serving ResNet-50 over gRPC, docs/performance.md)."""

    def __init__(self, handler: StreamHandler, settings: Http2Settings,
                 on_close: Callable[[Http2Connection], None] | None = None) -> None:
        self.handler = handler
        self.settings = settings
        self._on_close = on_close
        self.encoder = Encoder()
        self._decoder = Decoder(max_table_size=4096)
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()
        self._read = ReadBuffer()  # a large frame's header: its type, flags and stream id
        self._preface_seen = False
        self._out: list[bytes] = []
        self._flush_scheduled = False
        self.streams: dict[int, Stream] = {}
        self._last_stream_id = 0
        self._header_block: tuple[int, int, bytearray] | None = None  # stream id, flags, fragments so far
        # flow control: what the peer lets us send, what we let the peer send
        self._send_window = DEFAULT_WINDOW
        self._peer_initial_window = DEFAULT_WINDOW
        self._peer_max_frame = DEFAULT_FRAME_SIZE
        self._blocked: dict[int, Stream] = {}  # streams waiting for window, in order
        self._table_size_update = b""
        self._recv_unacknowledged = 0
        # shutdown
        self.going_away = False
        self.closed = False
        self._writable = asyncio.Event()
        self._writable.set()
        # pings
        self._ping_payload: bytes | None = None
        self._ping_timeout: asyncio.TimerHandle | None = None
        self._keepalive: asyncio.TimerHandle | None = None
        self._pings_without_data = 0
        self._last_ping_received = -1e18
        self._ping_strikes = 0
        self.peer = ""

    # -- asyncio.Protocol ------------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        address = transport.get_extra_info("peername")
        if isinstance(address, tuple):
            host = address[0]
            self.peer = f"ipv6:[{host}]:{address[1]}" if ":" in host else f"ipv4:{host}:{address[1]}"
        s = self.settings
        payload = b"".join(_SETTING.pack(k, v) for k, v in (
            (SETTINGS_ENABLE_PUSH, 0), (SETTINGS_INITIAL_WINDOW_SIZE, s.initial_window),
            (SETTINGS_MAX_FRAME_SIZE, s.max_frame_size), (SETTINGS_MAX_HEADER_LIST_SIZE, s.max_header_list_size)))
        self._write(frame(SETTINGS, 0, 0, payload))
        if s.connection_window > DEFAULT_WINDOW:
            self._write(frame(WINDOW_UPDATE, 0, 0, _U32.pack(s.connection_window - DEFAULT_WINDOW)))
        self._arm_keepalive()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._read.buffer()

    def buffer_updated(self, nbytes: int) -> None:
        try:
            if not self._read.reading_large:
                self._read.end += nbytes
                self._read_frames()
            elif (body := self._read.large_arrived(nbytes)) is not None:
                self._on_frame(*self._read.header, body)
        except ConnectionError_ as error:
            self.close_with(error.code, str(error))
        self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_timers()
        self._writable.set()
        streams, self.streams = self.streams, {}
        for stream in streams.values():
            if stream.on_reset is not None:
                stream.on_reset()
        if self._on_close is not None:
            self._on_close(self)

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    async def drain(self) -> None:
        """Wait while the transport's write buffer is full (a slow reader)."""
        await self._writable.wait()

    # -- reading ----------------------------------------------------------------------------------------------------
    def _read_frames(self) -> None:
        """Handle every whole frame read so far (a small one's payload copied out: a handler may keep it past the
        buffer's reuse); start reading a large incomplete one into its own buffer; keep the rest at the front."""
        read = self._read
        buf, start, end = read.data, 0, read.end
        if not self._preface_seen:
            if end < len(PREFACE):
                return
            if buf[:len(PREFACE)] != PREFACE:
                raise ConnectionError_(PROTOCOL_ERROR, "not an HTTP/2 connection preface (gRPC needs HTTP/2)")
            self._preface_seen = True
            start = len(PREFACE)
        limit = self.settings.max_frame_size
        while end - start >= 9:
            high, low, kind, flags, stream_id = _HEAD.unpack_from(buf, start)
            length = (high << 8) | low
            if length > limit:
                raise ConnectionError_(FRAME_SIZE_ERROR, f"frame of {length} bytes exceeds {limit}")
            have = end - start - 9
            if have >= length:
                payload = bytes(buf[start + 9:start + 9 + length])
                start += 9 + length
                self._on_frame(kind, flags, stream_id & 0x7FFFFFFF, payload)
                if self.closed:
                    return
                continue
            if length >= read.BIG:
                read.read_large(start + 9, length, (kind, flags, stream_id & 0x7FFFFFFF))
                return
            break
        read.keep_from(start)

    def _on_frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self._header_block is not None and kind != CONTINUATION:
            raise ConnectionError_(PROTOCOL_ERROR, "expected a CONTINUATION frame")
        if kind == DATA:
            self._on_data(flags, stream_id, payload)
        elif kind == HEADERS:
            self._on_headers(flags, stream_id, payload)
        elif kind == CONTINUATION:
            self._on_continuation(flags, stream_id, payload)
        elif kind == SETTINGS:
            self._on_settings(flags, stream_id, payload)
        elif kind == WINDOW_UPDATE:
            self._on_window_update(stream_id, payload)
        elif kind == PING:
            self._on_ping(flags, stream_id, payload)
        elif kind == RST_STREAM:
            if stream_id == 0 or len(payload) != 4:
                raise ConnectionError_(PROTOCOL_ERROR, "malformed RST_STREAM")
            stream = self.streams.pop(stream_id, None)
            self._blocked.pop(stream_id, None)
            if stream is not None:
                _reset(stream)
        elif kind == GOAWAY:
            self.going_away = True
            self._maybe_close()
        elif kind == PRIORITY:
            if stream_id == 0 or len(payload) != 5:
                raise ConnectionError_(PROTOCOL_ERROR, "malformed PRIORITY")
        elif kind == PUSH_PROMISE:
            raise ConnectionError_(PROTOCOL_ERROR, "clients cannot push")
        # frames of unknown types are ignored (RFC 9113 4.1)

    @staticmethod
    def _unpad(flags: int, payload: bytes) -> bytes:
        if flags & PADDED:
            if not payload:
                raise ConnectionError_(PROTOCOL_ERROR, "padded frame without a pad length")
            pad = payload[0]
            if pad >= len(payload):
                raise ConnectionError_(PROTOCOL_ERROR, "padding longer than the frame")
            return payload[1:len(payload) - pad]
        return payload

    def _on_data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise ConnectionError_(PROTOCOL_ERROR, "DATA on stream 0")
        size = len(payload)
        self._recv_unacknowledged += size
        if self._recv_unacknowledged > self.settings.connection_window:
            raise ConnectionError_(FLOW_CONTROL_ERROR, "the client overran the connection window")
        if self._recv_unacknowledged >= self.settings.connection_window // 2:
            self._write(frame(WINDOW_UPDATE, 0, 0, _U32.pack(self._recv_unacknowledged)))
            self._recv_unacknowledged = 0
        stream = self.streams.get(stream_id)
        if stream is None or stream.closed_remote:
            if stream_id > self._last_stream_id:
                raise ConnectionError_(PROTOCOL_ERROR, f"DATA on idle stream {stream_id}")
            if stream is not None:
                self.reset_stream(stream, STREAM_CLOSED)
            return  # a stream this side reset or finished: frames still in flight are ignored (RFC 9113 5.1)
        stream.recv_window -= size
        if stream.recv_window < 0:
            self.reset_stream(stream, FLOW_CONTROL_ERROR)
            return
        data = self._unpad(flags, payload)
        if data and stream.on_data is not None:
            stream.on_data(data)
        if size > len(data):  # padding counts against the window but never reaches the application
            self.release_stream_window(stream, size - len(data))
        if flags & END_STREAM:
            self._end_remote(stream)

    def _end_remote(self, stream: Stream) -> None:
        stream.closed_remote = True
        if stream.on_end is not None:
            stream.on_end()
        self._forget_if_done(stream)

    def _on_headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise ConnectionError_(PROTOCOL_ERROR, "HEADERS on stream 0")
        fragment = self._unpad(flags, payload)
        if flags & PRIORITY_FLAG:
            fragment = fragment[5:]
        if flags & END_HEADERS:
            self._on_header_block(stream_id, flags, bytes(fragment))
        else:
            self._header_block = (stream_id, flags, bytearray(fragment))

    def _on_continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        if self._header_block is None or self._header_block[0] != stream_id:
            raise ConnectionError_(PROTOCOL_ERROR, "unexpected CONTINUATION frame")
        block = self._header_block[2]
        block += payload
        if len(block) > self.settings.max_header_list_size * 2:
            raise ConnectionError_(ENHANCE_YOUR_CALM, "header block too large")
        if flags & END_HEADERS:
            first_flags = self._header_block[1]
            self._header_block = None
            self._on_header_block(stream_id, first_flags, bytes(block))

    def _on_header_block(self, stream_id: int, flags: int, block: bytes) -> None:
        try:
            headers = self._decoder.decode(block)
        except HpackError as error:
            raise ConnectionError_(COMPRESSION_ERROR, f"header block does not decode: {error}") from None
        end_stream = bool(flags & END_STREAM)
        stream = self.streams.get(stream_id)
        if stream is not None:  # trailers
            if stream.closed_remote or not end_stream:
                raise ConnectionError_(PROTOCOL_ERROR, f"unexpected HEADERS on stream {stream_id}")
            self._end_remote(stream)
            return
        if stream_id % 2 == 0 or stream_id <= self._last_stream_id:
            raise ConnectionError_(PROTOCOL_ERROR, f"HEADERS on stream {stream_id}: not a new client stream")
        self._last_stream_id = stream_id
        if self.going_away:
            self._write(frame(RST_STREAM, 0, stream_id, _U32.pack(REFUSED_STREAM)))
            return
        if sum(len(n) + len(v) + 32 for n, v in headers) > self.settings.max_header_list_size:
            self._write(frame(RST_STREAM, 0, stream_id, _U32.pack(REFUSED_STREAM)))
            return
        stream = Stream(stream_id, headers, self, self._peer_initial_window, self.settings.initial_window)
        self.streams[stream_id] = stream
        self.handler.stream_opened(stream, end_stream)
        if end_stream and stream_id in self.streams:
            self._end_remote(stream)

    def _on_settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id != 0:
            raise ConnectionError_(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            return
        if len(payload) % 6:
            raise ConnectionError_(FRAME_SIZE_ERROR, "SETTINGS length not a multiple of 6")
        for offset in range(0, len(payload), 6):
            key, value = _SETTING.unpack_from(payload, offset)
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ConnectionError_(FLOW_CONTROL_ERROR, "initial window above 2^31-1")
                delta = value - self._peer_initial_window
                self._peer_initial_window = value
                for stream in self.streams.values():
                    stream.send_window += delta
            elif key == SETTINGS_MAX_FRAME_SIZE:
                if not DEFAULT_FRAME_SIZE <= value <= (1 << 24) - 1:
                    raise ConnectionError_(PROTOCOL_ERROR, f"invalid max frame size {value}")
                self._peer_max_frame = value
            elif key == SETTINGS_HEADER_TABLE_SIZE and value < 4096:
                # our encoder never adds to the table, but a decoder that shrank it expects the change signalled
                self._table_size_update = b"\x20"  # RFC 7541 6.3: maximum size 0, at the start of the next block
            elif key == SETTINGS_ENABLE_PUSH and value > 1:
                raise ConnectionError_(PROTOCOL_ERROR, "invalid ENABLE_PUSH")
        self._write(frame(SETTINGS, ACK, 0))
        self._resume_blocked()

    def _on_window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ConnectionError_(FRAME_SIZE_ERROR, "WINDOW_UPDATE of the wrong length")
        increment = _U32.unpack(payload)[0] & 0x7FFFFFFF
        if stream_id == 0:
            if increment == 0:
                raise ConnectionError_(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self._send_window += increment
            if self._send_window > MAX_WINDOW:
                raise ConnectionError_(FLOW_CONTROL_ERROR, "connection window above 2^31-1")
            self._resume_blocked()
            return
        stream = self.streams.get(stream_id)
        if stream is None:
            return
        if increment == 0:
            self.reset_stream(stream, PROTOCOL_ERROR)
            return
        stream.send_window += increment
        if stream.send_window > MAX_WINDOW:
            self.reset_stream(stream, FLOW_CONTROL_ERROR)
            return
        self.pump(stream)

    def _on_ping(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id != 0 or len(payload) != 8:
            raise ConnectionError_(PROTOCOL_ERROR if stream_id else FRAME_SIZE_ERROR, "malformed PING")
        if flags & ACK:
            if payload == self._ping_payload and self._ping_timeout is not None:
                self._ping_timeout.cancel()
                self._ping_timeout = None
            return
        self._police_ping()
        self._write(frame(PING, ACK, 0, payload))

    def _police_ping(self) -> None:
        """grpc-core's rule: pings closer together than allowed while no data flows are strikes, and too many
        strikes end the connection (a client's keepalive must not keep a server busy)."""
        now = self.loop.time()
        s = self.settings
        allowed = s.min_recv_ping_interval_s
        if not self.streams and not s.keepalive_permit_without_calls:
            allowed = max(allowed, 7200.0)
        if now - self._last_ping_received < allowed:
            self._ping_strikes += 1
            if s.max_ping_strikes and self._ping_strikes > s.max_ping_strikes:
                raise ConnectionError_(ENHANCE_YOUR_CALM, "too_many_pings")
        self._last_ping_received = now

    # -- writing ----------------------------------------------------------------------------------------------------
    def _write(self, data: bytes) -> None:
        self._out.append(data)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Everything written during one loop turn goes out in one send."""
        self._flush_scheduled = False
        if self._out and self.transport is not None and not self.closed:
            data = b"".join(self._out) if len(self._out) > 1 else self._out[0]
            self._out.clear()
            self.transport.write(data)
        else:
            self._out.clear()

    def _sent_data(self) -> None:
        self._pings_without_data = 0
        self._ping_strikes = 0

    def pump(self, stream: Stream) -> None:
        """Write what `stream` has queued, as far as the flow-control windows allow."""
        if self.closed:
            return
        pending = stream.pending
        max_frame = self._peer_max_frame
        while pending:
            kind, payload, end = pending[0]
            if kind == HEADERS:
                pending.popleft()
                self._write_header_block(stream.id, payload, end)
                continue
            size = len(payload)
            if size:
                room = min(stream.send_window, self._send_window, max_frame)
                if room <= 0:
                    self._blocked[stream.id] = stream
                    return
                if size > room:
                    self._write_data(0, stream.id, payload[:room])
                    pending[0] = (DATA, payload[room:], end)
                    stream.send_window -= room
                    self._send_window -= room
                    continue
                stream.send_window -= size
                self._send_window -= size
            pending.popleft()
            self._write_data(END_STREAM if end else 0, stream.id, payload)
        self._blocked.pop(stream.id, None)
        self._sent_data()
        if stream.closed_local:
            self._forget_if_done(stream)

    def _write_data(self, flags: int, stream_id: int, payload: bytes | memoryview) -> None:
        n = len(payload)
        if n <= _SMALL:
            self._write(frame(DATA, flags, stream_id, payload))
        else:  # no copy into a header+payload string: `_flush` joins everything once
            self._write(_HEAD.pack(n >> 8, n & 0xFF, DATA, flags, stream_id))
            self._out.append(payload)

    def _write_header_block(self, stream_id: int, block: bytes, end: bool) -> None:
        if self._table_size_update:
            block, self._table_size_update = self._table_size_update + block, b""
        max_frame = self._peer_max_frame
        flags = END_STREAM if end else 0
        if len(block) <= max_frame:
            self._write(frame(HEADERS, flags | END_HEADERS, stream_id, block))
            return
        self._write(frame(HEADERS, flags, stream_id, block[:max_frame]))
        for offset in range(max_frame, len(block), max_frame):
            last = offset + max_frame >= len(block)
            self._write(frame(CONTINUATION, END_HEADERS if last else 0, stream_id, block[offset:offset + max_frame]))

    def _resume_blocked(self) -> None:
        for stream in list(self._blocked.values()):
            if self._send_window <= 0:
                return
            self.pump(stream)

    def release_stream_window(self, stream: Stream, n: int) -> None:
        """Give `n` consumed bytes back to the peer's window on `stream`, in updates of a quarter window or more
        (a unary request never needs one: it ends before its window runs out)."""
        stream.credit += n
        if stream.credit >= self.settings.initial_window // 4 and not stream.closed_remote and not self.closed:
            self._write(frame(WINDOW_UPDATE, 0, stream.id, _U32.pack(stream.credit)))
            stream.recv_window += stream.credit
            stream.credit = 0

    def reset_stream(self, stream: Stream, code: int) -> None:
        if stream.id in self.streams:
            del self.streams[stream.id]
            self._blocked.pop(stream.id, None)
            stream.pending.clear()
            self._write(frame(RST_STREAM, 0, stream.id, _U32.pack(code)))
            _reset(stream)
            self._maybe_close()

    def _forget_if_done(self, stream: Stream) -> None:
        if stream.closed_local and stream.closed_remote and not stream.pending:
            self.streams.pop(stream.id, None)
            _release(stream)
            self._maybe_close()

    # -- shutdown ---------------------------------------------------------------------------------------------------
    def go_away(self) -> None:
        """Graceful: refuse new streams, finish the open ones, then close."""
        if self.closed or self.going_away:
            return
        self.going_away = True
        self._write(frame(GOAWAY, 0, 0, _U32.pack(self._last_stream_id) + _U32.pack(NO_ERROR)))
        self._maybe_close()

    def close_with(self, code: int, message: str) -> None:
        """Connection error: GOAWAY with `code` and close now."""
        if self.closed:
            return
        if code != NO_ERROR:
            log.info("gRPC connection %s closed: %s", self.peer, message)
        self._out.append(frame(GOAWAY, 0, 0, _U32.pack(self._last_stream_id) + _U32.pack(code)
                               + message.encode()[:256]))
        self._flush()
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _maybe_close(self) -> None:
        if self.going_away and not self.streams and not self.closed:
            self._flush()
            self.closed = True
            if self.transport is not None:
                self.transport.close()

    def abort(self) -> None:
        """Close at once, without waiting for streams (the end of a shutdown grace period)."""
        if self.transport is not None:
            self.transport.abort()

    # -- keepalive ----------------------------------------------------------------------------------------------------
    def _arm_keepalive(self) -> None:
        if self.settings.keepalive_time_s > 0:
            self._keepalive = self.loop.call_later(self.settings.keepalive_time_s, self._send_keepalive)

    def _send_keepalive(self) -> None:
        s = self.settings
        limited = s.max_pings_without_data and self._pings_without_data >= s.max_pings_without_data
        if not self.closed and (self.streams or s.keepalive_permit_without_calls) and not limited:
            self._ping_payload = os.urandom(8)
            self._pings_without_data += 1
            self._write(frame(PING, 0, 0, self._ping_payload))
            if self._ping_timeout is None:
                self._ping_timeout = self.loop.call_later(s.keepalive_timeout_s, self._keepalive_expired)
        if not self.closed:
            self._arm_keepalive()

    def _keepalive_expired(self) -> None:
        self._ping_timeout = None
        log.info("gRPC connection %s: no keepalive ping answer in %.0f s, closing", self.peer,
                 self.settings.keepalive_timeout_s)
        self.abort()

    def _cancel_timers(self) -> None:
        for timer in (self._keepalive, self._ping_timeout):
            if timer is not None:
                timer.cancel()
        self._keepalive = self._ping_timeout = None
