"""What the core and an executor process (`executor.py`, `executor_main.py`) say to each other, and how.

One stream socket per worker lane, used in lockstep (a request, then its reply), and one control socket. A message
is an 8-byte length and a pickle (protocol 5); file descriptors of shared-memory regions travel beside the first
bytes (SCM_RIGHTS). Reads go straight into one buffer with the interpreter lock released, so a core worker thread
waiting for its executor costs the event loop nothing.

Tensors in registered shared memory (a client's system or CUDA region, a frontend's tensor arena) cross as
`RegionRef`s, (region id, offset, shape, dtype), never as bytes: the executor maps each region once (`RegionMap`,
sent with the first batch that names it) and reads and writes it in place, on the device where it can.
"""

from __future__ import annotations

import array
import logging
import os
import pickle
import socket
import struct
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine_core.cuda.view import DeviceView
from engine_core.errors import KilnError, ShapeError

from .heap import keep_large_buffers_in_heap

_HEADER = struct.Struct("<Q")
log = logging.getLogger("kiln.server.executor")


def env_number(name: str, default: float, minimum: float = 0.0) -> float:
    """A number from the environment variable `name` (at least `minimum`); `default` when unset, and when it is not
    a number (said once in the log: a typo in a tuning variable must not stop a model from loading)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return max(float(text), minimum)
    except ValueError:
        log.warning("%s=%r is not a number; using %g", name, text, default)
        return default


#: the interpreter switch interval of the server process and the generation processes: a thread that gave the lock
#: away for a driver call or a socket gets it back within this, not Python's 5 ms (KILN_SWITCH_INTERVAL_US)
SWITCH_INTERVAL_S = env_number("KILN_SWITCH_INTERVAL_US", 200, 1) / 1e6
#: descriptors a message may carry (a batch names at most a few new regions)
MAX_FDS = 64


@dataclass(frozen=True)
class RegionView(DeviceView):
    """A tensor in a registered region, named for an executor process: region `region` (its registration id),
    `offset` bytes in. `ptr` is not an address here (-1); `owner` keeps the core's region alive, and with it the
    memory, while a job holds the view."""

    region: int = 0
    offset: int = 0
    owner: Any = field(default=None, compare=False, repr=False)

    def ref(self) -> RegionRef:
        return RegionRef(self.region, self.offset, self.shape, self.dtype.str)


@dataclass(frozen=True)
class RegionRef:
    """A `RegionView` as it crosses the socket."""

    region: int
    offset: int
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class RegionMap:
    """How an executor maps region `region`: system memory of `nbytes` from the descriptor sent beside the message
    (`fd_index` into them), or a CUDA allocation from its IPC handle."""

    region: int
    kind: str  # "system" or "cuda"
    nbytes: int
    fd_index: int = -1
    offset: int = 0  # where the registered span starts in the object the descriptor names
    ipc_handle: bytes = b""
    device_id: int = 0


class ExecutorGone(ConnectionError):
    """The executor process closed its end (it exited or was killed)."""


class RemoteError(RuntimeError):
    """An execution failed in the executor for a reason other than the request's data (a fault)."""


#: exceptions an executor sends back as what they are: the request's fault, which the core reports as such
_REQUEST_ERRORS: dict[str, type[Exception]] = {"ShapeError": ShapeError, "TypeError": TypeError,
                                               "ValueError": ValueError, "KilnError": KilnError}


def error_reply(error: BaseException) -> tuple[str, str, str]:
    return ("error", type(error).__name__, str(error))


def raise_reply(reply: tuple) -> Any:
    """The reply's value, or its error raised as the class the executor raised where the core knows it."""
    if reply[0] == "ok":
        return reply[1]
    _, kind, message = reply
    raise _REQUEST_ERRORS.get(kind, RemoteError)(message if kind in _REQUEST_ERRORS else f"{kind}: {message}")


class Channel:
    """Length-prefixed pickles over one connected stream socket (not thread-safe: one user at a time)."""

    def __init__(self, sock: socket.socket, alternating: bool = False) -> None:
        self.sock = sock
        #: each side sends its next message only after the other's reply (a lane): a read can never run into the
        #: next message, so `recv` reads as much as has arrived at once
        self.alternating = alternating
        self._buffer = bytearray(1 << 16)

    def send(self, message: Any, fds: list[int] | tuple[int, ...] = ()) -> None:
        payload = pickle.dumps(message, protocol=5)
        header = _HEADER.pack(len(payload))
        try:
            if fds:  # the descriptors ride on the header's bytes
                sent = self.sock.sendmsg([header], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
                self.sock.sendall(header[sent:] + payload)
            elif len(payload) < (1 << 16):
                self.sock.sendall(header + payload)
            else:  # large: no concatenated copy
                self.sock.sendall(header)
                self.sock.sendall(payload)
        except (BrokenPipeError, ConnectionResetError) as e:
            raise ExecutorGone(f"the other process closed the channel: {e}") from None

    def recv(self) -> tuple[Any, list[int]]:
        """The next message and the descriptors that came with it.

        On an `alternating` channel one `recvmsg_into` reads the header, the descriptors and as much of the payload
        as has arrived (all of a small message: the sender writes header and payload at once); otherwise the first
        read stops at the header, so that a message queued behind this one stays in the socket. Why: a batch's
        message and its reply each took two system calls to read, one of them only for the 8-byte header."""
        fds: list[int] = []
        view = memoryview(self._buffer)
        first = view if self.alternating else view[:_HEADER.size]
        got, ancillary, _, _ = self.sock.recvmsg_into([first], socket.CMSG_SPACE(MAX_FDS * 4))
        if not got:
            raise ExecutorGone("the other process closed the channel")
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", payload[:len(payload) - len(payload) % 4]))
        while got < _HEADER.size:
            got = self._more(view, got, _HEADER.size)
        (size,) = _HEADER.unpack_from(view)
        end = _HEADER.size + size
        if end > len(self._buffer):  # a large message: the rest straight into a buffer of its own size
            head = bytes(view[:got])
            self._buffer = bytearray(end)
            view = memoryview(self._buffer)
            view[:got] = head
        while got < end:
            got = self._more(view, got, end)
        return pickle.loads(view[_HEADER.size:end]), fds

    def _more(self, view: memoryview, got: int, end: int) -> int:
        count = self.sock.recv_into(view[got:end], end - got)
        if not count:
            raise ExecutorGone("the other process closed the channel")
        return got + count

    def request(self, message: Any, fds: list[int] | tuple[int, ...] = ()) -> Any:
        """Send `message` and return the reply's value (its error raised)."""
        self.send(message, fds)
        reply, _ = self.recv()
        return raise_reply(reply)

    def close(self) -> None:
        self.sock.close()


_ROOT = Path(__file__).resolve().parents[2]


def child_launch(module: str, env: Mapping[str, str] | None = None) -> tuple[subprocess.Popen, Channel]:
    """A child process (`python -m <module> <fd>`: executor_main.py, generation_main.py) and the parent's end of its
    socket; the child gets the server's environment, the repository on its path, unbuffered output and ``env``."""
    ours, theirs = socket.socketpair()
    child_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1",
                 "PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH", "")]))}
    process = subprocess.Popen([sys.executable, "-m", module, str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                               stdin=subprocess.DEVNULL, env=child_env)
    theirs.close()
    return process, Channel(ours)


def child_start(argv: list[str] | None, name: str) -> tuple[Channel, Any] | None:
    """A child process's start (executor_main.py, generation_main.py): logging as `name`, the channel on the
    descriptor its first argument names, and the parent's first message; None when the parent closed first."""
    args = argv if argv is not None else sys.argv[1:]
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name}[%(process)d] %(message)s")
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # lanes (or the loop) beside other threads get the lock back soon
    keep_large_buffers_in_heap()  # batches' outputs and inline inputs reused from the heap (heap.py)
    channel = Channel(socket.socket(fileno=int(args[0])))
    try:
        first, _ = channel.recv()
    except ExecutorGone:
        return None
    return channel, first


def to_wire(value: Any) -> Any:
    """A job's input or destination as it crosses: region tensors by reference, host arrays as they are."""
    return value.ref() if isinstance(value, RegionView) else value
