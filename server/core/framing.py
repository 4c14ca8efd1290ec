"""The framing of the core's Unix-socket protocol (server/core/remote.py): messages pickled with protocol 5, numpy
arrays and the request/response dataclasses reduced cheaply, contiguous arrays as out-of-band buffers; and
`FramedConnection`, the buffered protocol both ends run.

A frame is `!II` (payload length, buffer count), one `!Q` length per buffer, the pickled payload (the list of
messages sent during one turn of the sender's event loop), the buffers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import logging
import operator
import pickle
import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from .grouping import PartAnswers
from .types import InferInput, InferOutput, InferRequest, InferResponse, RequestedOutput

log = logging.getLogger("kiln.server.remote")

_HEAD = struct.Struct("!II")
# Writers wait for the socket to drain past this many buffered bytes (a slow reader must not grow memory).
HIGH_WATER = 4 << 20


def _reduce_array(array: np.ndarray) -> tuple:
    """A contiguous array of a builtin numeric dtype as its bytes (out of band), dtype string and shape: cheaper
    both ways than numpy's own reduction. Object (BYTES), strided and extension-dtype (bfloat16, whose string is
    only 'V2') arrays keep numpy's."""
    code = array.dtype.str
    if not array.flags.c_contiguous or type(array) is not np.ndarray or code[1] not in _BUILTIN_KINDS:
        return array.__reduce_ex__(5)  # type: ignore[return-value]  # an ndarray reduces to a tuple
    return _array, (pickle.PickleBuffer(array), code, array.shape)  # type: ignore[arg-type]  # ndarray is a buffer


_BUILTIN_KINDS = frozenset("biuf")  # bool, signed, unsigned, float: a dtype string says all of these


def _array(data: Any, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    return np.frombuffer(data, dtype).reshape(shape)


def _reduce_fields(cls: type) -> Callable[[Any], tuple]:
    """A dataclass as its constructor and positional fields (pickle's default goes through copyreg and __dict__)."""
    fields = operator.attrgetter(*(f.name for f in dataclasses.fields(cls)))  # every one has 2+ fields: a tuple
    return lambda obj: (cls, fields(obj))


_REDUCERS: dict[type, Callable[[Any], tuple]] = {
    np.ndarray: _reduce_array,
    **{cls: _reduce_fields(cls) for cls in (InferRequest, InferInput, RequestedOutput, InferResponse, InferOutput,
                                            PartAnswers)},
}


def encode(message: Any) -> list[bytes | memoryview]:
    """`message` as the frames of one message (contiguous numpy arrays stay out of band: no copy here)."""
    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    pickler = pickle.Pickler(out, protocol=5, buffer_callback=buffers.append)
    pickler.dispatch_table = _REDUCERS  # type: ignore[assignment]
    pickler.dump(message)
    payload = out.getbuffer()
    raws = [b.raw() for b in buffers]
    sizes = struct.pack(f"!{len(raws)}Q", *(r.nbytes for r in raws))
    return [_HEAD.pack(len(payload), len(raws)) + sizes, payload, *raws]


class ReadBuffer:
    """Where a buffered protocol reads a stream of frames: one shared buffer for the frames that fit in it, and for a
    large frame still arriving a buffer of its own size, so its payload is copied once, from the socket into its
    final place. Its reader (`FrameDecoder`, the gRPC frontend's HTTP/2 connection) parses `data[:end]`, copies out
    what it keeps of a small frame (the shared buffer is reused), calls `read_large` for a large one and
    `keep_from` with where the unhandled bytes start."""

    BIG = 1 << 16  # a frame payload at least this large, not yet complete, is read into a buffer of its own

    def __init__(self) -> None:
        self.data = bytearray(1 << 18)
        self.end = 0  # bytes of `data` read and not yet handled
        self.header: Any = None  # what the reader noted of the large frame being read (its type, sizes, ...)
        self._body: bytearray | None = None
        self._filled = 0

    @property
    def reading_large(self) -> bool:
        return self._body is not None

    def buffer(self) -> memoryview:
        """Where the next bytes should be read to."""
        if self._body is not None:
            return memoryview(self._body)[self._filled:]
        if self.end == len(self.data):
            self.data.extend(bytes(len(self.data)))
        return memoryview(self.data)[self.end:]

    def read_large(self, start: int, length: int, header: Any) -> None:
        """The frame whose payload starts at `start` (`length` bytes, more than have arrived) is read into a buffer
        of its own from here on: its bytes so far move there, and `data` keeps nothing of it."""
        have = self.end - start
        self._body = bytearray(length)
        self._body[:have] = self.data[start:self.end]
        self._filled, self.header = have, header
        self.end = 0

    def large_arrived(self, count: int) -> memoryview | None:
        """`count` more bytes of the large frame were read: its payload once complete (then it is done with)."""
        self._filled += count
        body = self._body
        if body is None or self._filled < len(body):
            return None
        self._body = None
        return memoryview(body)

    def keep_from(self, start: int) -> None:
        """The bytes before `start` are handled: what follows moves to the front."""
        if start:
            remaining = self.end - start
            self.data[:remaining] = self.data[start:self.end]
            self.end = remaining


class FrameDecoder:
    """Frames in, messages out: `feed` bytes as they arrive (or read into `buffer()` and `advance`); complete
    messages go to `on_message` in order. A frame too large for the shared buffer is read into one bytearray of
    its own size (`ReadBuffer`), so a large tensor is copied once, from the socket into its final place."""

    def __init__(self, on_message: Callable[[Any], None]) -> None:
        self.on_message = on_message
        self._read = ReadBuffer()

    def buffer(self) -> memoryview:
        """Where the next bytes should be read to."""
        return self._read.buffer()

    def advance(self, count: int) -> None:
        """`count` bytes were read into `buffer()`."""
        if self._read.reading_large:
            body = self._read.large_arrived(count)
            if body is not None:
                self._deliver(body, *self._read.header)
            return
        self._read.end += count
        self._decode()

    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            target = self.buffer()
            count = min(len(target), len(view))
            target[:count] = view[:count]
            view = view[count:]
            self.advance(count)

    def _decode(self) -> None:
        read = self._read
        buf, start, end = read.data, 0, read.end
        while end - start >= _HEAD.size:
            length, count = _HEAD.unpack_from(buf, start)
            meta = _HEAD.size + 8 * count
            if end - start < meta:
                break
            sizes = struct.unpack_from(f"!{count}Q", buf, start + _HEAD.size)
            total = length + sum(sizes)
            if end - start - meta >= total:
                body = bytes(buf[start + meta:start + meta + total])  # one copy: the message may outlive the shared buffer
                start += meta + total
                self._deliver(memoryview(body), length, sizes)
                continue
            if total >= read.BIG:  # read the rest straight into the frame's own buffer
                read.read_large(start + meta, total, (length, sizes))
                return
            if meta + total > len(buf):
                buf.extend(bytes(meta + total - len(buf)))
            break
        read.keep_from(start)

    def _deliver(self, body: memoryview, length: int, sizes: tuple[int, ...]) -> None:
        buffers, offset = [], length
        for size in sizes:
            buffers.append(body[offset:offset + size])
            offset += size
        self.on_message(pickle.loads(body[:length], buffers=buffers))


class FramedConnection(asyncio.BufferedProtocol):
    """One end of a core connection: decodes frames into `on_message`, batches `send`s into one write per turn of
    the event loop, and tells `on_lost` when the peer goes."""

    def __init__(self, on_message: Callable[[Any], None], on_lost: Callable[[Exception | None], None]) -> None:
        self._on_message = on_message
        self._decoder = FrameDecoder(self._received)
        self._on_lost = on_lost
        #: told about a message that could not be pickled and was not sent (whoever waits for it must hear)
        self.on_unencodable: Callable[[Any, Exception], None] = _log_unencodable
        self.transport: asyncio.Transport | None = None
        self._out: list[Any] = []  # messages sent during this turn of the event loop
        self._flushing = False
        self._writable: asyncio.Event | None = None  # set while the socket takes more (cleared when paused)
        self.closed = False

    def _received(self, messages: list[Any]) -> None:
        for message in messages:  # a frame holds every message its sender sent in one turn of its event loop
            self._on_message(message)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._writable = asyncio.Event()
        self._writable.set()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._decoder.buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self._decoder.advance(nbytes)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._writable is not None:
            self._writable.set()  # a paused sender wakes up and finds the connection closed
        self._on_lost(exc)

    def pause_writing(self) -> None:
        if self._writable is not None:
            self._writable.clear()

    def resume_writing(self) -> None:
        if self._writable is not None:
            self._writable.set()

    def send(self, message: Any) -> None:
        """Queue `message`; it leaves in one frame with everything else sent during this turn of the event loop."""
        if self.closed:
            raise ConnectionResetError("the core connection is closed")
        self._out.append(message)
        if not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flushing = False
        messages, self._out = self._out, []
        if self.closed or self.transport is None:
            return
        try:
            frames = encode(messages)
        except Exception:  # noqa: BLE001 - one message that cannot be pickled must not sink the others
            frames = []
            for message in messages:
                try:
                    frames += encode([message])
                except Exception as e:  # noqa: BLE001 - its sender hears about it instead
                    self.on_unencodable(message, e)
        self.transport.writelines(frames)

    async def drain(self) -> None:
        """Wait while the socket's write buffer is over its high-water mark (a slow reader must not grow memory)."""
        if self._writable is not None and not self._writable.is_set():
            await self._writable.wait()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _log_unencodable(message: Any, error: Exception) -> None:
    log.error("dropped a core message that cannot be pickled: %s", error)
