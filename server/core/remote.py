"""The core in one process, the frontends in others: `CoreService` serves a `ServerCore` over a Unix socket and
`RemoteCore` gives a frontend process the same async methods.

Why: parsing HTTP/gRPC and encoding responses is most of a request's CPU, and in one process all of it holds the
interpreter lock that the GPU workers need between their CUDA calls (docs/performance.md). Frontend processes
(`kiln serve --frontend-processes N`) parse on other cores and hand the core one small message per call; tensors
travel as pickle protocol 5 out-of-band buffers, written with one `writelines` and read without re-joining.

Frames and their pickling are `framing.py`'s. Calls are `(call_id, method, args, kwargs)`, replies `(call_id,
value, error)` (error None on success); many calls share a connection (replies come in completion order). Only the
core API's public methods (`CORE_METHODS`) are served.
A caller that gives up (a client disconnect) sends `(call_id, CANCEL, (), {})`: the call is cancelled in the core
too, so a queued request leaves the batcher's queue as it does in one process. `--max-inflight-requests` is
enforced here, for all frontends together, with the same error as in one process.

A stream (`submit_stream`: a decoupled model's responses, server/core/decoupled.py) is one `STREAM` call answered
by several replies `(call_id, StreamPart, None)`, one per response, the last with `final` set; the caller's CANCEL
withdraws it as any call. It counts once against `--max-inflight-requests`, until its final part.

Inference takes a faster road on both ends. `RemoteCore.infer` holds a request until the end of the event-loop
turn and sends the alike ones of that turn as one `INFER_GROUP` call (server/core/grouping.py). The core starts
each call with `ServerCore.submit_infer`/`submit_infer_group` and answers it from the job's completion callback,
with no task per request.

Large request tensors travel through the frontend's shared-memory arena instead (`tensor_arena.py`, `ARENA`).
Responses of models in executor processes come straight from the executor to the frontend's inbox where the core has
nothing to add to them (`direct_replies.py`, `INBOX`): the core then only counts them and frees their slots.

Both ends run `FramedConnection` (framing.py), a buffered protocol: the socket is read straight into its buffer (a
large frame into one buffer of its own size), every complete frame in a read is decoded at once, and everything sent
during one turn of the event loop leaves in one write. Why: at tens of thousands of calls a second a stream reader's
awaits per frame and a write per reply were most of the core's own time (docs/performance.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from . import direct_replies, executor, hop_stats
from .decoupled import OnPart, StreamPart
from .direct_replies import DELIVERED
from .errors import ErrorKind, ServerError, unavailable
from .framing import HIGH_WATER, FramedConnection
from .grouping import (
    Answer,
    MemberResults,
    Part,
    PartAnswers,
    by_reference,
    concatenate,
    group_key,
    member_answers,
    outcome,
    part_request,
    parts_of,
    rows,
    run_members,
    run_requests,
    settle,
)
from .limits import InflightLimiter
from .tensor_arena import TensorArena, open_arena
from .types import InferRequest, InferResponse

log = logging.getLogger("kiln.server.remote")
_INBOX_IDS = itertools.count(1)

#: the `ServerCore` methods a frontend may call (server/core/__init__.py lists them)
CORE_METHODS = frozenset({
    "live", "ready", "server_metadata", "model_ready", "model_metadata", "model_config", "infer",
    "repository_index", "load_model", "unload_model", "model_statistics", "system_shared_memory_status",
    "register_system_shared_memory", "unregister_system_shared_memory", "cuda_shared_memory_status",
    "register_cuda_shared_memory", "unregister_cuda_shared_memory", "trace_settings", "log_settings",
})
CANCEL = "__cancel__"
INFER_GROUP = "__infer_group__"  # a frontend's group of alike requests (server/core/grouping.py)
INFER_PARTS = "__infer_parts__"  # the same for requests in shared memory: the first and each one's part (part_groups.py)
STREAM = "__stream__"  # a request answered by several replies (server/core/decoupled.py)
ARENA = "__arena__"  # a frontend's tensor arena: (name, key, byte_size), registered for its connection's life
INBOX = "__inbox__"  # a frontend's inbox: (socket path,), where executors send its responses (direct_replies.py)


class CoreService:
    """Serves `core`'s methods to frontend processes on a Unix socket at `path`."""

    def __init__(self, core: Any, path: str, limiter: InflightLimiter | None = None) -> None:
        self.core = core
        self.path = path
        self.limiter = limiter or InflightLimiter()  # inference calls in flight, every frontend's together
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[_ServedConnection] = set()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _ServedConnection(self), path=self.path)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections):
            connection.close()

    async def answer(self, method: str, args: tuple, kwargs: dict) -> tuple[Any, ServerError | None]:
        """One call's reply: (value, None) or (None, the ServerError the frontend raises). Inference calls take
        `_ServedConnection._infer` instead."""
        try:
            if method not in CORE_METHODS:
                raise ServerError(ErrorKind.INTERNAL, f"the core has no method '{method}' for frontends")
            return await getattr(self.core, method)(*args, **kwargs), None
        except Exception as e:  # noqa: BLE001 - what an in-process frontend would turn into a 500, said as one
            return None, _as_server_error(method, e)


class _Withdrawal:
    """A group's jobs, cancelled together when its frontend gives up on it."""

    def __init__(self, jobs: list[asyncio.Future]) -> None:
        self.jobs = jobs

    def cancel(self) -> None:
        for job in self.jobs:
            job.cancel()


@dataclasses.dataclass
class _SentGroup:
    """A group on its way to the core: its call, and how many of its members still wait for it."""

    call_id: int
    waiting: int


@dataclasses.dataclass
class _Member:
    """One request of a group: its caller's future, and the group call once it is sent."""

    request: InferRequest
    answer: asyncio.Future
    sent: _SentGroup | None = None


def _distribute(reply: asyncio.Future, members: list[_Member], sizes: list[int]) -> None:
    """A group's reply to its members: each its own response (its rows, its id) or the error."""
    if reply.cancelled():
        return  # every member gave up
    results: list[tuple[Any, BaseException | None]]
    try:
        value = reply.result()
        if len(members) == 1:
            results = [(value, None)]
        elif isinstance(value, PartAnswers):
            results = value.responses([m.request for m in members])
        else:
            results = member_answers(value, [m.request.id for m in members], sizes)
    except Exception as e:  # noqa: BLE001 - every member raises it
        results = [(None, e)] * len(members)
    for member, (response, error) in zip(members, results):
        settle(member.answer, response, error)


def _as_server_error(method: str, error: BaseException) -> ServerError:
    """What a frontend raises for a core call's error: a ServerError as it is, anything else as an internal
    error (logged here, with its traceback, since the frontend only sees the message)."""
    if isinstance(error, ServerError):
        return error
    log.error("core call %s failed", method, exc_info=error)
    return ServerError(ErrorKind.INTERNAL, f"internal error: {type(error).__name__}: {error}")


class _StreamCall:
    """A stream served to a frontend: ended by its final part or by the frontend's CANCEL, once either way (its
    in-flight slot is given back then)."""

    def __init__(self, connection: _ServedConnection, call_id: int) -> None:
        self.connection = connection
        self.call_id = call_id
        self.handle: Any = None  # what submit_stream returned: cancel() withdraws the request
        self.ended = False

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self.connection.calls.pop(self.call_id, None)
            self.connection.service.limiter.release()

    def cancel(self) -> None:
        if not self.ended:
            self.end()
            if self.handle is not None:
                self.handle.cancel()


class _ServedConnection(FramedConnection):
    """One frontend process's connection. An inference call is started with `ServerCore.submit_infer` and answered
    from its completion callback (no task per request: the core's event loop serves every frontend); any other
    call runs as a task of its own, so a slow model load never holds up another call. The frontend going away
    cancels its calls."""

    def __init__(self, service: CoreService) -> None:
        super().__init__(self._called, self._lost)
        self.on_unencodable = self._reply_unencodable
        self.service = service
        self.calls: dict[int, Any] = {}  # running calls, to cancel: a task, a request's job, a group's jobs
        self.arenas: list[str] = []  # the frontend's tensor arenas (tensor_arena.py), unregistered when it goes
        self.hop_received: dict[int, tuple[int, int]] = {}  # call id -> (received ns, members), when hops are timed
        self.inbox: int | None = None  # the id of the frontend's inbox (direct_replies.py), once it named one

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        transport.set_write_buffer_limits(high=HIGH_WATER)  # type: ignore[attr-defined]
        self.service._connections.add(self)

    def _called(self, message: Any) -> None:
        call_id, method, args, kwargs = message
        if method == CANCEL:
            running = self.calls.get(call_id)
            if running is not None:
                running.cancel()
            return
        if method == ARENA:
            self._register_arena(call_id, *args)
            return
        if method == INBOX:
            self._register_inbox(call_id, *args)
            return
        if method in ("infer", INFER_GROUP, INFER_PARTS, STREAM):
            if hop_stats.ON and method != STREAM:
                self.hop_received[call_id] = (time.monotonic_ns(), 1 if method == "infer" else len(args[1]))
            try:
                if method == "infer":
                    self._infer(call_id, *args, **kwargs)
                elif method == STREAM:
                    self._stream(call_id, *args)
                elif method == INFER_PARTS:
                    self._infer_parts(call_id, *args)
                else:
                    self._infer_group(call_id, *args)
            except Exception as e:  # noqa: BLE001 - a bug must not leave the caller waiting forever
                self.hop_received.pop(call_id, None)
                self._reply(call_id, None, _as_server_error(method, e))
            return
        task = self.calls[call_id] = asyncio.get_running_loop().create_task(self._run(call_id, method, args, kwargs))
        task.add_done_callback(lambda _: self.calls.pop(call_id, None))

    def _register_arena(self, call_id: int, name: str, key: str, byte_size: int) -> None:
        try:
            self.service.core.system_shm.register_arena(name, key, byte_size)
        except Exception as e:  # noqa: BLE001 - the frontend then sends tensors inline
            self._reply(call_id, None, _as_server_error(ARENA, e))
            return
        self.arenas.append(name)
        self._reply(call_id, None)

    def _register_inbox(self, call_id: int, path: str) -> None:
        """The frontend listens at `path` for responses that executors send it themselves (direct_replies.py)."""
        if self.inbox is None:
            self.inbox = next(_INBOX_IDS)
            executor.inbox_registered(self.inbox, path)
        self._reply(call_id, None)

    def _infer(self, call_id: int, request: InferRequest) -> None:
        job = self._submit_admitted(request, functools.partial(self._answer, call_id), self._route(call_id))
        if job is not None and not job.done():
            self.calls[call_id] = job

    def _route(self, call_id: int) -> tuple[int, int] | None:
        return None if self.inbox is None else (self.inbox, call_id)

    def _submit_admitted(self, request: InferRequest, answer: Answer,
                         inbox: tuple[int, int] | None = None) -> asyncio.Future | None:
        """`ServerCore.submit_infer` within the in-flight limit (every frontend's together): beyond it the request
        is answered RESOURCE_EXHAUSTED at once. `inbox`: where an executor may answer it itself."""
        limiter = self.service.limiter
        try:
            limiter.acquire()
        except ServerError as e:
            answer(None, e)
            return None

        def released(response: Any, error: BaseException | None) -> None:
            limiter.release()
            answer(response, error)

        return self.service.core.submit_infer(request, released, inbox=inbox)

    def _infer_group(self, call_id: int, request: InferRequest, sizes: list[int]) -> None:
        """A frontend's group of alike requests (server/core/grouping.py). Within the in-flight limit it counts
        as its members; near the limit the members are admitted (or refused) one by one, as single requests."""
        self._admit_group(call_id, len(sizes), lambda: run_members(request, sizes, self._submit_admitted, self._results(call_id)),
                          lambda answer: self.service.core.submit_infer_group(request, sizes, answer,
                                                                              inbox=self._route(call_id)))

    def _infer_parts(self, call_id: int, first: InferRequest, parts: list[Part]) -> None:
        """A frontend's group of alike requests in shared memory (server/core/part_groups.py): its first request and
        each member's part, admitted as `_infer_group`'s."""
        def one_by_one() -> list[asyncio.Future]:
            requests = [first, *(part_request(first, part) for part in parts[1:])]
            return run_requests(requests, self._submit_admitted, self._results(call_id))

        self._admit_group(call_id, len(parts), one_by_one,
                          lambda answer: self.service.core.submit_infer_parts(first, parts, answer))

    def _results(self, call_id: int) -> Callable[[MemberResults], None]:
        return lambda results: self._answer(call_id, results, None)

    def _admit_group(self, call_id: int, members: int, one_by_one: Callable[[], list[asyncio.Future]],
                     together: Callable[[Answer], list[asyncio.Future]]) -> None:
        """A group of `members` requests within the in-flight limit (every frontend's together): all admitted and
        run `together`, or near the limit `one_by_one`, each admitted or refused as a single request."""
        limiter = self.service.limiter
        if not limiter.fits(members):
            jobs = one_by_one()
        else:
            limiter.acquire(members)

            def released(value: Any, error: BaseException | None) -> None:
                limiter.release(members)
                self._answer(call_id, value, error)

            jobs = together(released)
        if any(not job.done() for job in jobs):
            self.calls[call_id] = _Withdrawal(jobs)

    def _stream(self, call_id: int, request: InferRequest) -> None:
        """`ServerCore.submit_stream`: each part is a reply of its own, the final one ends the call."""
        try:
            self.service.limiter.acquire()
        except ServerError as e:
            self._reply(call_id, StreamPart(error=e, final=True))
            return
        call = _StreamCall(self, call_id)

        def on_part(part: StreamPart) -> None:
            if part.final:
                call.end()
            if part.error is not None:
                part.error = _as_server_error("submit_stream", part.error)
            self._reply(call_id, part)

        call.handle = self.service.core.submit_stream(request, on_part)
        if not call.ended:
            self.calls[call_id] = call

    def _answer(self, call_id: int, value: Any, error: BaseException | None) -> None:
        """An inference call's reply: a response (a group's with every member's rows), the error (for every
        member of a group), or a group's per-member results; nothing once the frontend withdrew the call."""
        self.calls.pop(call_id, None)
        hop = self.hop_received.pop(call_id, None) if self.hop_received else None
        if isinstance(error, asyncio.CancelledError):
            return
        if value is DELIVERED:  # the executor sent the response to the frontend itself
            if hop is not None:
                hop_stats.stats("core").add("call in -> executor replied", *hop)
            return
        if isinstance(value, MemberResults):  # the members ran one by one
            if any(isinstance(e, asyncio.CancelledError) for _, e in value.results):
                return
            value.results = [(v, None if e is None else _as_server_error("infer", e)) for v, e in value.results]
        elif isinstance(value, PartAnswers):  # a group by reference: the members that failed say why
            value.members = [_as_server_error("infer", m) if isinstance(m, BaseException) else m
                             for m in value.members]
        self._reply(call_id, value, None if error is None else _as_server_error("infer", error))
        if hop is not None:
            hop_stats.stats("core").add("call in -> reply out", *hop)

    async def _run(self, call_id: int, method: str, args: tuple, kwargs: dict) -> None:
        value, error = await self.service.answer(method, args, kwargs)
        self._reply(call_id, value, error)
        await self.drain()

    def _reply(self, call_id: int, value: Any, error: ServerError | None = None) -> None:
        try:
            self.send((call_id, value, error))
        except ConnectionError:
            pass  # the frontend closed the connection meanwhile

    def _reply_unencodable(self, message: Any, error: Exception) -> None:
        """A reply that cannot be pickled: the caller still gets an answer, an internal error."""
        call_id = message[0]
        log.error("core call %s: the reply cannot be sent: %s", call_id, error)
        self._reply(call_id, None, ServerError(ErrorKind.INTERNAL, f"internal error: {error}"))

    def _lost(self, exc: Exception | None) -> None:
        self.service._connections.discard(self)
        for call in list(self.calls.values()):
            call.cancel()
        for name in self.arenas:
            self.service.core.system_shm.unregister_arena(name)
        if self.inbox is not None:
            executor.inbox_released(self.inbox)


class RemoteCore:
    """The core API in a frontend process: every `CORE_METHODS` call goes to the core process and back.

    `begin_drain` is local: a draining frontend reports not ready at once, without asking the core.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._connection: FramedConnection | None = None
        self._lost: ServerError | None = None
        self._draining = False
        self._groups: dict[Any, list[_Member]] = {}  # requests of this loop turn, by group key
        self._streams: dict[int, OnPart] = {}  # STREAM calls not yet final: where their parts go
        self.arena: TensorArena | None = None  # where large group inputs go (`open_arena`)
        self._leases: dict[int, list] = {}  # call id -> its arena spans, freed when the core's reply comes
        self._hop_sent: dict[int, tuple[int, int]] = {}  # call id -> (sent ns, members), when hops are timed
        #: called once the core connection is lost (a frontend process then shuts down)
        self.on_lost: Callable[[], None] | None = None
        self._inbox: asyncio.AbstractServer | None = None  # where executors send responses (`open_inbox`)
        self._inbox_path = f"{path}.inbox-{os.getpid()}"  # beside the core's socket, in the server's directory

    async def connect(self) -> None:
        loop = asyncio.get_running_loop()
        _, self._connection = await loop.create_unix_connection(
            lambda: FramedConnection(self._replied, self._connection_lost), self.path)
        self._connection.on_unencodable = self._unsent
        self._connection.transport.set_write_buffer_limits(high=HIGH_WATER)  # type: ignore[union-attr]

    async def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
        if self._inbox is not None:
            self._inbox.close()
            with contextlib.suppress(OSError):
                os.unlink(self._inbox_path)

    async def open_inbox(self) -> None:
        """Listen for responses that executor processes send this frontend themselves (direct_replies.py), beside
        the core's socket, and name the inbox to the core; off with KILN_DIRECT_REPLIES=0. On failure responses
        keep coming through the core, and the log says why."""
        if not direct_replies.enabled():
            return
        path = self._inbox_path
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        try:
            self._inbox = await asyncio.get_running_loop().create_unix_server(
                lambda: FramedConnection(self._replied, lambda _: None), path)
            await self.call(INBOX, path)
        except (OSError, ServerError) as e:
            log.warning("executors cannot answer this frontend directly (%s): responses go through the core", e)
            if self._inbox is not None:
                self._inbox.close()
                self._inbox = None

    async def open_arena(self, megabytes: float) -> None:
        """Large request tensors go to the core through a shared-memory arena from now on (tensor_arena.py); on any
        failure they keep going inline, and the log says why."""
        arena = open_arena(megabytes)
        if arena is None:
            return
        try:
            await self.call(ARENA, arena.name, arena.key, arena.nbytes)
        except ServerError as e:
            log.warning("the core cannot map this frontend's tensor arena (%s): tensors go inline", e.message)
            arena.close()
            return
        arena.unlink()  # both mappings stay; nothing is left in /dev/shm if a process dies
        self.arena = arena

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

    async def infer(self, request: InferRequest) -> InferResponse:
        """One inference request. Requests alike in all but their rows that arrive in one turn of the event loop
        go to the core as one message (server/core/grouping.py); each caller still gets its own response."""
        member = self._join_group(request)
        if member is None:
            return await self.call("infer", request)
        try:
            return await member.answer
        except asyncio.CancelledError:
            self._withdraw(member)
            raise

    def submit_infer(self, request: InferRequest, reply: Answer) -> asyncio.Future:
        """`ServerCore.submit_infer` from a frontend process: `reply` is called once, on the event loop (with a
        CancelledError when the returned future is cancelled, which also withdraws the request from the core).
        Why: the frontends answer from this callback instead of a task per request, as the core process does."""
        member = self._join_group(request)
        if member is None:
            task = asyncio.ensure_future(self.call("infer", request))
            task.add_done_callback(lambda done: reply(*outcome(done)))
            return task

        def answered(done: asyncio.Future) -> None:
            if done.cancelled():
                self._withdraw(member)
            reply(*outcome(done))

        member.answer.add_done_callback(answered)
        return member.answer

    def submit_stream(self, request: InferRequest, on_part: OnPart) -> _RemoteStream:
        """`ServerCore.submit_stream` from a frontend process: the parts come as the core sends them."""
        connection = self._connection
        if self._lost is not None or connection is None:
            on_part(StreamPart(error=self._lost or unavailable("the server core is not connected"), final=True))
            return _RemoteStream(self, -1)
        call_id = next(self._ids)
        self._streams[call_id] = on_part
        try:
            connection.send((call_id, STREAM, (request,), {}))
        except ConnectionError:
            self._streams.pop(call_id, None)
            on_part(StreamPart(error=self._lost or unavailable("the server core connection closed"), final=True))
        return _RemoteStream(self, call_id)

    def _join_group(self, request: InferRequest) -> _Member | None:
        """`request` as a member of this loop turn's group for its key (sent by `_send_groups`); None when it
        cannot be grouped (per-request options) or the core is not connected: it then goes as a call of its own."""
        key = group_key(request)
        if key is None or self._lost is not None or self._connection is None:
            return None
        member = _Member(request, asyncio.get_running_loop().create_future())
        members = self._groups.get(key)
        if members is None:
            members = self._groups[key] = []
            if len(self._groups) == 1:
                asyncio.get_running_loop().call_soon(self._send_groups)
        members.append(member)
        return member

    def _send_groups(self) -> None:
        """Every group gathered during the last turn of the event loop to the core: one call per group (a group
        of one as a plain request), answered from the reply's callback (no task per group)."""
        groups, self._groups = self._groups, {}
        for key, members in groups.items():
            members = [m for m in members if not m.answer.done()]  # callers that gave up meanwhile
            if not members:
                continue
            requests = [m.request for m in members]
            sizes = [rows(request) for request in requests]
            sent_ns = time.monotonic_ns() if hop_stats.ON else 0
            placed = self.arena.place(requests) if self.arena is not None and not by_reference(key) else None
            try:
                if placed is not None:
                    call_id, reply = (self._start("infer", (placed[0],), {}) if len(members) == 1 else
                                      self._start(INFER_GROUP, (placed[0], sizes), {}))
                    self._leases[call_id] = placed[1]
                elif len(members) == 1:
                    call_id, reply = self._start("infer", (requests[0],), {})
                elif by_reference(key):
                    call_id, reply = self._start(INFER_PARTS, (requests[0], parts_of(requests)), {})
                else:
                    call_id, reply = self._start(INFER_GROUP, (concatenate(requests), sizes), {})
            except Exception as e:  # noqa: BLE001 - e.g. the connection is gone: every member raises it
                if placed is not None:
                    self.arena.release(placed[1])  # type: ignore[union-attr]
                for member in members:
                    settle(member.answer, None, e)
                continue
            if sent_ns:
                self._hop_sent[call_id] = (sent_ns, len(members))
            sent = _SentGroup(call_id, len(members))
            for member in members:
                member.sent = sent
            reply.add_done_callback(functools.partial(_distribute, members=members, sizes=sizes))

    def _withdraw(self, member: _Member) -> None:
        """A member's caller gave up: once every member of its group has, the core stops the group too."""
        sent = member.sent
        if sent is None:
            return
        sent.waiting -= 1
        if not sent.waiting and sent.call_id in self._pending and sent.call_id not in self._leases:
            self._cancel(sent.call_id)  # a call reading the arena runs to its reply, which frees its space

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name not in CORE_METHODS:
            raise AttributeError(name)

        async def method(*args: Any, **kwargs: Any) -> Any:
            return await self.call(name, *args, **kwargs)

        method.__name__ = name
        return method

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run `method` in the core process; raises what it raised (a ServerError)."""
        call_id, reply = self._start(method, args, kwargs)
        try:
            await self._connection.drain()  # type: ignore[union-attr]
            return await reply
        except asyncio.CancelledError:
            if reply.cancelled() or not reply.done():  # no answer came: stop it there
                self._cancel(call_id)
            raise
        finally:
            self._pending.pop(call_id, None)

    def _cancel(self, call_id: int) -> None:
        """The caller of `call_id` gave up: the core stops the call (a queued request leaves its queue)."""
        self._pending.pop(call_id, None)
        self._hop_sent.pop(call_id, None)
        if self._lost is None and self._connection is not None:
            with contextlib.suppress(ConnectionError):
                self._connection.send((call_id, CANCEL, (), {}))

    def _start(self, method: str, args: tuple, kwargs: dict) -> tuple[int, asyncio.Future]:
        """Send one call: its id and the future that gets the reply."""
        connection = self._connection
        if self._lost is not None or connection is None:
            raise self._lost or unavailable("the server core is not connected")
        call_id = next(self._ids)
        reply = self._pending[call_id] = asyncio.get_running_loop().create_future()
        try:
            connection.send((call_id, method, args, kwargs))
        except ConnectionError:
            self._pending.pop(call_id, None)
            raise self._lost or unavailable("the server core connection closed") from None
        return call_id, reply

    def _replied(self, message: Any) -> None:
        call_id, value, error = message
        self._end_lease(call_id)
        if self._hop_sent:
            hop = self._hop_sent.pop(call_id, None)
            if hop is not None:
                hop_stats.stats("frontend").add("core round trip", *hop)
        reply = self._pending.pop(call_id, None)
        if reply is not None:
            settle(reply, value, error)
            return
        on_part = self._streams.get(call_id)  # a stream's part (stream calls are never pending)
        if on_part is not None:
            part = value if error is None else StreamPart(error=error, final=True)
            if part.final:
                del self._streams[call_id]
            on_part(part)
        # else the caller gave up (client disconnect)

    def _unsent(self, message: Any, error: Exception) -> None:
        """A call whose arguments cannot be pickled fails with the pickling error, as a local call would."""
        reply = self._pending.get(message[0])
        self._end_lease(message[0])
        self._hop_sent.pop(message[0], None)
        if reply is not None:
            settle(reply, None, error)

    def _end_lease(self, call_id: int) -> None:
        """The core is done with `call_id`'s arena space (it answered, or the call never left): free it."""
        spans = self._leases.pop(call_id, None)
        if spans is not None:
            self.arena.release(spans)  # type: ignore[union-attr]

    def _connection_lost(self, exc: Exception | None) -> None:
        self._lost = unavailable(f"the server core process is gone ({type(exc).__name__ if exc else 'closed'})")
        for reply in self._pending.values():
            if not reply.done():
                reply.set_exception(self._lost)
        streams, self._streams = self._streams, {}
        for on_part in streams.values():
            on_part(StreamPart(error=self._lost, final=True))
        if self.on_lost is not None:
            self.on_lost()


class _RemoteStream:
    """What a frontend cancels to withdraw a stream from the core (its parts stop at once)."""

    def __init__(self, core: RemoteCore, call_id: int) -> None:
        self._core = core
        self._call_id = call_id

    def cancel(self) -> None:
        if self._core._streams.pop(self._call_id, None) is not None:
            self._core._cancel(self._call_id)
