"""The core in one process, the frontends in others: `CoreService` serves a `ServerCore` over a Unix socket and
`RemoteCore` gives a frontend process the same async methods.

Why: parsing HTTP/gRPC and encoding responses is most of a request's CPU, and in one process all of it holds the
interpreter lock that the GPU workers need between their CUDA calls (docs/performance.md). Frontend processes
(`kiln serve --frontend-processes N`) parse on other cores and hand the core one small message per call; tensors
travel as pickle protocol 5 out-of-band buffers, written with one `writelines` and read without re-joining.

A message is a frame: `!II` (payload length, buffer count), one `!Q` length per buffer, the pickled payload, the
buffers. Calls are `(call_id, method, args, kwargs)`, replies `(call_id, ok, value_or_error)`; many calls share a
connection (replies come in completion order). Only the core API's public methods (`CORE_METHODS`) are served.
A caller that gives up (a client disconnect) sends `(call_id, CANCEL, (), {})`: the call is cancelled in the core
too, so a queued request leaves the batcher's queue as it does in one process. `--max-inflight-requests` is
enforced here, for all frontends together, with the same error as in one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import pickle
import struct
from collections.abc import Callable
from typing import Any

from .errors import ErrorKind, ServerError, unavailable
from .limits import InflightLimiter

log = logging.getLogger("kiln.server.remote")

#: the `ServerCore` methods a frontend may call (server/core/__init__.py lists them)
CORE_METHODS = frozenset({
    "live", "ready", "server_metadata", "model_ready", "model_metadata", "model_config", "infer",
    "repository_index", "load_model", "unload_model", "model_statistics", "system_shared_memory_status",
    "register_system_shared_memory", "unregister_system_shared_memory", "cuda_shared_memory_status",
    "register_cuda_shared_memory", "unregister_cuda_shared_memory", "trace_settings", "log_settings",
})
_HEAD = struct.Struct("!II")
CANCEL = "__cancel__"
# Writers wait for the socket to drain past this many buffered bytes (a slow reader must not grow memory).
_HIGH_WATER = 4 << 20


def encode(message: Any) -> list[bytes | memoryview]:
    """`message` as the frames of one message (contiguous numpy arrays stay out of band: no copy here)."""
    buffers: list[pickle.PickleBuffer] = []
    payload = pickle.dumps(message, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    sizes = struct.pack(f"!{len(raws)}Q", *(r.nbytes for r in raws))
    return [_HEAD.pack(len(payload), len(raws)) + sizes, payload, *raws]


async def read_message(reader: asyncio.StreamReader) -> Any:
    """The next message; raises asyncio.IncompleteReadError when the peer closed the connection."""
    length, count = _HEAD.unpack(await reader.readexactly(_HEAD.size))
    sizes = struct.unpack(f"!{count}Q", await reader.readexactly(8 * count)) if count else ()
    payload = await reader.readexactly(length)
    buffers = [await reader.readexactly(size) if size else b"" for size in sizes]
    return pickle.loads(payload, buffers=buffers)


async def _send(writer: asyncio.StreamWriter, message: Any) -> None:
    writer.writelines(encode(message))
    if writer.transport.get_write_buffer_size() > _HIGH_WATER:
        await writer.drain()


class CoreService:
    """Serves `core`'s methods to frontend processes on a Unix socket at `path`."""

    def __init__(self, core: Any, path: str, limiter: InflightLimiter | None = None) -> None:
        self.core = core
        self.path = path
        self.limiter = limiter or InflightLimiter()  # inference calls in flight, every frontend's together
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve_connection, path=self.path)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One frontend process: each call runs as its own task, so a slow model never holds up another call."""
        self._connections.add(asyncio.current_task())  # type: ignore[arg-type]
        calls: dict[int, asyncio.Task] = {}
        try:
            while True:
                call_id, method, args, kwargs = await read_message(reader)
                if method == CANCEL:
                    running = calls.get(call_id)
                    if running is not None:
                        running.cancel()
                    continue
                task = calls[call_id] = asyncio.create_task(self._answer(writer, call_id, method, args, kwargs))
                task.add_done_callback(lambda _, done=call_id: calls.pop(done, None))
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # the frontend went away (its callers are gone too), or the server stops
        finally:
            self._connections.discard(asyncio.current_task())  # type: ignore[arg-type]
            for task in list(calls.values()):
                task.cancel()
            writer.close()

    async def _answer(self, writer: asyncio.StreamWriter, call_id: int, method: str, args: tuple,
                      kwargs: dict) -> None:
        try:
            if method not in CORE_METHODS:
                raise ServerError(ErrorKind.INTERNAL, f"the core has no method '{method}' for frontends")
            if method == "infer":
                with self.limiter.admit():
                    reply = (call_id, True, await self.core.infer(*args, **kwargs))
            else:
                reply = (call_id, True, await getattr(self.core, method)(*args, **kwargs))
        except ServerError as e:
            reply = (call_id, False, e)
        except Exception as e:  # noqa: BLE001 - what an in-process frontend would turn into a 500, said as one
            log.exception("core call %s failed", method)
            reply = (call_id, False, ServerError(ErrorKind.INTERNAL, f"internal error: {type(e).__name__}: {e}"))
        try:
            await _send(writer, reply)
        except (ConnectionError, RuntimeError):
            pass  # the frontend closed the connection meanwhile
        except Exception as e:  # noqa: BLE001 - e.g. an unpicklable value: the caller must still get an answer
            await _send(writer, (call_id, False, ServerError(ErrorKind.INTERNAL, f"internal error: {e}")))


class RemoteCore:
    """The core API in a frontend process: every `CORE_METHODS` call goes to the core process and back.

    `begin_drain` is local: a draining frontend reports not ready at once, without asking the core.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task | None = None
        self._lost: ServerError | None = None
        self._draining = False
        #: called once the core connection is lost (a frontend process then shuts down)
        self.on_lost: Callable[[], None] | None = None

    async def connect(self) -> None:
        reader, self._writer = await asyncio.open_unix_connection(self.path)
        self._reading = asyncio.create_task(self._read_replies(reader))

    async def close(self) -> None:
        if self._reading is not None:
            self._reading.cancel()
        if self._writer is not None:
            self._writer.close()

    def begin_drain(self) -> None:
        self._draining = True

    async def ready(self) -> bool:
        if self._draining:
            return False
        return await self.call("ready")

    async def live(self) -> bool:
        if self._lost is not None:
            return False
        return await self.call("live")

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name not in CORE_METHODS:
            raise AttributeError(name)

        async def method(*args: Any, **kwargs: Any) -> Any:
            return await self.call(name, *args, **kwargs)

        method.__name__ = name
        return method

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run `method` in the core process; raises what it raised (a ServerError)."""
        if self._lost is not None or self._writer is None:
            raise self._lost or unavailable("the server core is not connected")
        call_id = next(self._ids)
        reply = self._pending[call_id] = asyncio.get_running_loop().create_future()
        try:
            await _send(self._writer, (call_id, method, args, kwargs))
            return await reply
        except asyncio.CancelledError:
            if self._lost is None and (reply.cancelled() or not reply.done()):  # no answer came: stop it there
                self._writer.writelines(encode((call_id, CANCEL, (), {})))
            raise
        finally:
            self._pending.pop(call_id, None)

    async def _read_replies(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                call_id, ok, value = await read_message(reader)
                reply = self._pending.get(call_id)
                if reply is None or reply.done():
                    continue  # the caller gave up (client disconnect)
                if ok:
                    reply.set_result(value)
                else:
                    reply.set_exception(value)
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            self._lost = unavailable(f"the server core process is gone ({type(e).__name__})")
            if self.on_lost is not None:
                self.on_lost()
        finally:
            with contextlib.suppress(Exception):
                for reply in self._pending.values():
                    if not reply.done():
                        reply.set_exception(self._lost or unavailable("the server core connection closed"))
