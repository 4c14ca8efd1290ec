"""Messages between the server and a Python stub: remote.py's frame layout, pickle protocol 5, stdlib only.

A frame is `!II` (payload length, buffer count), one `!Q` length per buffer, the pickled payload, the buffers:
the layout of server/core/remote.py, so the server reads a stub's frames with its `FrameDecoder`. Contiguous numpy
arrays travel as out-of-band buffers through numpy's own pickling (no Kiln class is pickled: a stub may run in an
environment without Kiln's packages). A frame below JOIN_BELOW (64 KiB) is joined and
written at once; a larger one goes part by part, its arrays never copied.

A message is `(kind, call_id, body)`. The server calls the stub with AUTO_COMPLETE, INITIALIZE, EXECUTE and
FINALIZE; the stub calls the server with INFER (a BLS request); either side answers a call with
`(REPLY, call_id, (value, error))`, where error is None or `(code, message)` with a TritonError code name
("INTERNAL", "INVALID_ARG", ...). LOG `(level, text)` needs no answer.

Decoupled models: each request of an EXECUTE call carries a `stream` id; the stub sends its responses as they are
sent, from any thread, as `(RESPONSE, stream, (result, flags))` (result None for a bare final flag, else
`{"outputs": [...]}` or `{"error": (code, message)}`; flags 1 = final), and the server tells the stub that a
stream's client went away with `(CANCEL, stream, None)` (the sender's `is_cancelled()`). Neither is answered.

BLS with decoupled models: an INFER whose body says `"decoupled": True` is answered by `(PART, call_id, (value,
error, final))` messages, one per response as the target model sends it (value None for a bare final flag), the
last with final True; the stub sends `(CANCEL, call_id, None)` when the model cancels the response iterator.

Model control from a model (`pb_utils.load_model`, `unload_model`, `is_model_ready`): `(CONTROL, call_id, {"op":
"load" | "unload" | "ready", ...})`, answered with a REPLY. Custom metrics (`pb_utils.MetricFamily`, `Metric`):
`(METRIC, call_id, {"op": "family" | "metric" | "value" | "increment" | "set" | "observe", ...})`; a call_id of 0
(the updates) is not answered.
"""

from __future__ import annotations

import pickle
import socket
import struct
from typing import Any

AUTO_COMPLETE = "auto_complete"
INITIALIZE = "initialize"
EXECUTE = "execute"
FINALIZE = "finalize"
INFER = "infer"
LOG = "log"
REPLY = "reply"
RESPONSE = "response"
CANCEL = "cancel"
PART = "part"
CONTROL = "control"
METRIC = "metric"
FINAL = 1  # TRITONSERVER_RESPONSE_COMPLETE_FINAL

_HEAD = struct.Struct("!II")


def encode(message: Any) -> list[bytes | memoryview]:
    """`message` as one frame's parts (arrays' memory is referenced, not copied)."""
    buffers: list[pickle.PickleBuffer] = []
    payload = pickle.dumps(message, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    sizes = struct.pack(f"!{len(raws)}Q", *(r.nbytes for r in raws))
    return [_HEAD.pack(len(payload), len(raws)) + sizes, payload, *raws]


#: frames up to this size are joined and written with one system call (a copy of a few KiB costs less than a
#: write per part); larger ones go part by part, their arrays never copied
JOIN_BELOW = 1 << 16


def joined(parts: list[bytes | memoryview]) -> bytes | None:
    """The frame's parts as one bytes object when the frame is small (JOIN_BELOW), else None."""
    if sum(memoryview(p).nbytes for p in parts) < JOIN_BELOW:
        return b"".join(parts)
    return None


def send(sock: socket.socket, message: Any) -> None:
    """Write one message to a blocking socket (callers serialize their sends)."""
    parts = encode(message)
    frame = joined(parts)
    if frame is not None:
        sock.sendall(frame)
        return
    for part in parts:
        sock.sendall(part)


def receive(sock: socket.socket) -> Any:
    """Read one message from a blocking socket; None when the peer closed it. The frame is read into one buffer
    of its own, which the message's arrays then use (writable, no further copy)."""
    head = _read_exactly(sock, _HEAD.size)
    if head is None:
        return None
    length, count = _HEAD.unpack(head)
    raw_sizes = _read_exactly(sock, 8 * count) if count else b""
    if raw_sizes is None:
        return None
    sizes = struct.unpack(f"!{count}Q", raw_sizes)
    body = bytearray(length + sum(sizes))
    view = memoryview(body)
    filled = 0
    while filled < len(body):
        got = sock.recv_into(view[filled:])
        if not got:
            return None
        filled += got
    buffers, offset = [], length
    for size in sizes:
        buffers.append(view[offset:offset + size])
        offset += size
    return pickle.loads(view[:length], buffers=buffers)


def _read_exactly(sock: socket.socket, count: int) -> bytes | None:
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            return None
        data += chunk
    return data
