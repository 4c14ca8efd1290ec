"""Triton's sequence batcher, for stateful models: requests come in sequences (correlation IDs), each sequence is
bound to a sequence slot for its life, its requests run in order, one at a time, and the batcher feeds the model
the control inputs (START, END, READY, CORRID) and the implicit state of each batch row.

A sequence starts with a request flagged `sequence_start` and gets a free slot, or waits in the backlog (oldest
first) until one frees; it ends after the request flagged `sequence_end` has been taken, or when it has had no
request queued or running for `max_sequence_idle_microseconds` (default 1 s). Either way its slot goes to the
oldest backlogged sequence and its state is dropped; a later request for that ID without START is refused with
Triton's text. A START for an ID that is still live continues in its slot after the queued requests (Triton's
"conflict": the earlier sequence simply ends early). When a request's caller gives up (a disconnect) before the
request was taken, the whole sequence is cancelled, as in Triton: its queued requests fail and its slot frees.

Two strategies (`SequenceSettings.oldest`):

- direct (`DirectSequenceBatcher`): an instance has max_batch_size slots, slot i is batch row i. Whenever the
  instance is free it runs one batch holding the next request of every ready slot, rows 0 up to the last ready
  one; a slot in between without a request (or whose request's shapes differ from the first ready one's) gets a
  row of zeros with READY (and START, END) false and CORRID 0. With max_queue_delay_microseconds and
  minimum_slot_utilization both set, a batch waits until that share of the slots is ready or its oldest request
  has waited that long.
- oldest (`OldestSequenceBatcher`): max_candidate_sequences slots per instance; the next request of every
  slot whose previous one has finished goes to a dynamic batcher (server/core/batcher.py) over all instances,
  which batches them oldest first (preferred_batch_size, max_queue_delay_microseconds). Kiln keeps every state
  itself, so which instance runs a step does not matter and one batcher serves them all.

The state is kept per sequence as the array the model wrote (a view of its batch output, no copy), and read back
as the state input of the sequence's next step; START starts from the config's initial state. Statistics count
each request once and each execution at its batch size, rows without a request included (what the model ran).
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from server.protos import model_config_pb2

from .batcher import BatchingSettings, DynamicBatcher, ResponseOrder, split_outputs
from .errors import ServerError, invalid, unavailable
from .grouping import outcome
from .scheduler import (
    DispatchOnce,
    Execution,
    ExecutionRecorder,
    Executor,
    Job,
    JobResult,
    JobsExecutor,
    PartsExecutor,
    Workers,
)
from .sequence_config import CorrelationId, SequenceRequest, SequenceSettings, check_corrid_type, request_of
from .statistics import ExecutionTimes

log = logging.getLogger("kiln.server.sequence")

Feeds = dict[str, np.ndarray]
ShapeKey = tuple[tuple[str, str, tuple[int, ...]], ...]


@dataclass(eq=False)
class _Request:
    job: Job
    future: asyncio.Future
    flags: SequenceRequest  # its correlation ID, START and END


@dataclass(frozen=True, order=True)
class _Slot:
    """Slot `index` of instance `instance`; free slots are taken lowest index first, so sequences spread over
    the instances before doubling up on one (Triton's order)."""

    index: int
    instance: int


@dataclass(eq=False)
class _Sequence:
    """One live sequence: its queued requests, its slot (None while backlogged) and its state."""

    corrid: CorrelationId
    queue: collections.deque[_Request] = field(default_factory=collections.deque)
    slot: _Slot | None = None
    state: Feeds | None = None  # by state input name, as the model last wrote it
    busy: bool = False  # one of its requests is running (or handed to the oldest strategy's batcher)
    last_ns: int = 0  # its last arrival or completion: the idle timeout counts from here


class SequenceBatcher:
    """What both strategies share: checking a request's sequence parameters, binding sequences to slots, the
    backlog, idle release, cancellation, and the dispatch loop on the event loop. A subclass runs what is ready
    (`_run_ready`) and says which slot belongs to which instance (`_on_bound`, `_on_unbound`)."""

    workers: Workers

    def __init__(self, settings: SequenceSettings, instances: int, clock: Callable[[], int]) -> None:
        self.settings = settings
        self._clock = clock
        self._sequences: dict[CorrelationId, _Sequence] = {}  # live IDs: a request without START joins these
        self._free = [_Slot(index, instance) for index in range(settings.slots) for instance in range(instances)]
        heapq.heapify(self._free)
        self._holders: dict[_Slot, _Sequence] = {}
        self._backlog: collections.deque[_Sequence] = collections.deque()
        self._retired: set[int] = set()  # instances that faulted and could not be replaced: their slots are gone
        self._schedule = DispatchOnce(self._dispatch)  # `_dispatch` once on the next loop turn
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False
        self._order = ResponseOrder() if settings.preserve_ordering else None

    # -- submission -----------------------------------------------------------------------------------------
    async def submit(self, job: Job) -> JobResult:
        return await self.enqueue(job)

    def enqueue(self, job: Job) -> asyncio.Future:
        """Queue `job` in its sequence; errors for a request the sequence batcher cannot take, with Triton's texts."""
        if self._closed:
            raise unavailable("this model version was unloaded while the request waited; retry")
        gone = self.workers.none_left()
        if gone is not None:
            raise gone
        request = self._checked(job)
        sequence = self._sequences.get(request.corrid)
        if sequence is None:
            if not request.start:
                raise invalid(f"inference request for sequence {request.corrid} to model '{self.settings.model}' "
                              "must specify the START flag on the first request of the sequence")
            sequence = self._begin(request.corrid)
        elif request.start:
            log.warning("sequence %s for model '%s' has a conflict. The previous sequence did not end before this "
                        "sequence start. Previous sequence will be terminated early.", request.corrid,
                        self.settings.model)
        if request.end:  # a later request with this ID starts a new sequence
            del self._sequences[request.corrid]
        job.enqueued_ns = job.enqueued_ns or self._clock()
        future = asyncio.get_running_loop().create_future()
        sequence.queue.append(_Request(job, future, request))
        sequence.last_ns = job.enqueued_ns
        self._schedule()
        return future if self._order is None else self._order.follow(future)

    def _checked(self, job: Job) -> SequenceRequest:
        """The request's sequence parameters, in Triton's order of checks (infer_request.cc, then the scheduler)."""
        request = request_of(job.parameters)
        check_corrid_type(request, self.settings)
        model = self.settings.model
        if job.batch_size > 1:
            raise invalid(f"inference request to model '{model}' must specify batch-size 1 due to requirements of "
                          "sequence batcher")
        if request.corrid in (0, ""):
            raise invalid(f"inference request to model '{model}' must specify a non-zero or non-empty correlation ID")
        return request

    def pending(self) -> dict[int, int]:
        return {1: sum(1 for sequence in self._live() for r in sequence.queue if not r.future.done())}

    def _live(self) -> list[_Sequence]:
        return [*self._holders.values(), *self._backlog]

    # -- slots ----------------------------------------------------------------------------------------------
    def _begin(self, corrid: CorrelationId) -> _Sequence:
        sequence = _Sequence(corrid)
        self._sequences[corrid] = sequence
        if self._free:
            self._bind(sequence, heapq.heappop(self._free))
        else:
            self._backlog.append(sequence)
        return sequence

    def _bind(self, sequence: _Sequence, slot: _Slot) -> None:
        sequence.slot = slot
        self._holders[slot] = sequence
        self._on_bound(sequence, slot)

    def _release(self, sequence: _Sequence) -> None:
        """`sequence` gives up its slot (its END was taken, it idled, it was cancelled): the oldest backlogged
        sequence takes the slot, else it is free. Its ID is no longer live (unless a newer sequence has it)."""
        if self._sequences.get(sequence.corrid) is sequence:
            del self._sequences[sequence.corrid]
        slot = sequence.slot
        if slot is None:
            return
        sequence.slot = None
        del self._holders[slot]
        self._on_unbound(slot)
        if slot.instance in self._retired:
            return
        if self._backlog:
            self._bind(self._backlog.popleft(), slot)
        else:
            heapq.heappush(self._free, slot)

    def _on_bound(self, sequence: _Sequence, slot: _Slot) -> None:
        """A subclass's hook: `sequence` now holds `slot`."""

    def _on_unbound(self, slot: _Slot) -> None:
        """A subclass's hook: `slot` has no sequence now."""

    def _state_for(self, sequence: _Sequence, request: _Request) -> Feeds:
        """The state inputs of `request`'s step: the initial state at START, else what the last step wrote."""
        if request.flags.start or sequence.state is None:
            return self.settings.initial_states()
        return sequence.state

    def _keep_state(self, sequence: _Sequence, outputs: Feeds) -> None:
        """The state outputs of a step become the sequence's state (the output arrays themselves)."""
        if self.settings.states:
            sequence.state = {s.input_name: outputs[s.output_name] for s in self.settings.states}

    # -- dispatch -------------------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        """Drop cancelled sequences, release idle ones, run what is ready; then wait (a timer) for the next queue
        delay or idle timeout. Runs on the event loop, only when something changed or a timer fires."""
        self._schedule.queued = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        gone = self.workers.none_left()
        if gone is not None:
            self._fail_all(gone)
        now = self._clock()
        self._cancel_abandoned()
        self._release_idle(now)
        wait_ns = self._run_ready(now)
        if self._closed:
            if self._drained():
                self._shut_down()
            return
        deadlines = [s.last_ns + self.settings.idle_ns - now for s in self._holders.values() if self._idle(s)]
        if wait_ns is not None:
            deadlines.append(wait_ns)
        if deadlines:
            assert self._schedule.loop is not None
            self._timer = self._schedule.loop.call_later(max(min(deadlines), 0) / 1e9, self._schedule)

    def _run_ready(self, now: int) -> int | None:
        """Start what is ready; return how long (ns) to wait before trying again, None for no reason to."""
        raise NotImplementedError

    def _idle(self, sequence: _Sequence) -> bool:
        return not sequence.queue and not sequence.busy

    def _release_idle(self, now: int) -> None:
        """Sequences with nothing queued or running for max_sequence_idle_microseconds lose their slot and state."""
        for sequence in list(self._holders.values()):
            if self._idle(sequence) and now - sequence.last_ns >= self.settings.idle_ns:
                log.debug("sequence %s of model '%s' was idle for %g us: its slot is released", sequence.corrid,
                         self.settings.model, self.settings.idle_ns / 1000)
                self._release(sequence)

    def _cancel_abandoned(self) -> None:
        """A sequence whose next request's caller gave up is cancelled whole, as Triton does: its later requests
        would run on a state that skipped a step."""
        for sequence in self._live():
            if not sequence.busy and sequence.queue and sequence.queue[0].future.done():
                self._cancel(sequence, unavailable(
                    f"sequence {sequence.corrid} of model '{self.settings.model}' was cancelled: an earlier request "
                    "of it was cancelled before it ran; start the sequence again"))

    def _cancel(self, sequence: _Sequence, error: ServerError) -> None:
        for request in sequence.queue:
            if not request.future.done():
                request.future.set_exception(error)
        sequence.queue.clear()
        if sequence in self._backlog:
            self._backlog.remove(sequence)
        self._release(sequence)

    def _fail_all(self, error: ServerError) -> None:
        """No worker is left: nothing queued can run, so every queued request hears it now."""
        for sequence in self._live():
            self._cancel(sequence, error)

    def _drained(self) -> bool:
        return not any(s.queue or s.busy for s in self._live())

    def _shut_down(self) -> None:
        """A subclass's hook: closed and nothing left to run."""

    def close(self) -> None:
        """Take no new requests; queued ones still run (a hot swap fails no request already accepted). The
        sequences themselves end here: the next version starts them afresh."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._drained():
            self._shut_down()


# -- direct -------------------------------------------------------------------------------------------------
@dataclass(eq=False)
class _Instance:
    """One model instance: its execution context (None once it faulted and could not be replaced) and its
    slots, slot i being batch row i."""

    context: object | None
    slots: list[_Sequence | None]
    busy: bool = False


@dataclass
class _Row:
    """One batch row: a sequence's request, or none (a row of zeros with READY false)."""

    sequence: _Sequence | None = None
    request: _Request | None = None
    feeds: Feeds | None = None  # its inputs: the request's and its state


@dataclass
class _Outcome:
    execution: Execution
    parts: list[Feeds] = field(default_factory=list)
    output_ns: int = 0


class DirectSequenceBatcher(SequenceBatcher):
    """The direct strategy: batches of one row per slot, each instance running its own (module docstring)."""

    def __init__(self, contexts: list[object], execute: Executor, thread_name: str, settings: SequenceSettings,
                 record_execution: ExecutionRecorder | None = None, clock: Callable[[], int] = time.perf_counter_ns,
                 create_context: Callable[[], object] | None = None) -> None:
        super().__init__(settings, len(contexts), clock)
        self.workers = Workers(contexts, create_context, thread_name)
        self._instances = [_Instance(context, [None] * settings.slots) for context in contexts]
        self._execute = execute
        self._record = record_execution
        self._pool = ThreadPoolExecutor(max_workers=len(contexts), thread_name_prefix=thread_name)
        self._running: set[asyncio.Task] = set()

    def _on_bound(self, sequence: _Sequence, slot: _Slot) -> None:
        self._instances[slot.instance].slots[slot.index] = sequence

    def _on_unbound(self, slot: _Slot) -> None:
        self._instances[slot.instance].slots[slot.index] = None

    def _run_ready(self, now: int) -> int | None:
        waits = []
        for instance in self._instances:
            if instance.busy or instance.context is None:
                continue
            rows, wait_ns = self._form(instance, now)
            if rows:
                self._start(instance, rows)
            elif wait_ns is not None:
                waits.append(wait_ns)
        return min(waits, default=None)

    def _form(self, instance: _Instance, now: int) -> tuple[list[_Row], int | None]:
        """The batch `instance` runs now (empty: none, or wait the returned ns for the queue delay)."""
        ready = [i for i, sequence in enumerate(instance.slots) if sequence is not None and sequence.queue]
        if not ready:
            return [], None
        settings = self.settings
        if settings.max_queue_delay_ns and settings.minimum_slot_utilization:
            waited = now - min(instance.slots[i].queue[0].job.enqueued_ns for i in ready)  # type: ignore[union-attr]
            if (waited < settings.max_queue_delay_ns
                    and len(ready) / max(1, settings.max_batch_size) < settings.minimum_slot_utilization):
                return [], settings.max_queue_delay_ns - waited
        first = instance.slots[ready[0]]
        key = _shape_key(self._feeds(first, first.queue[0]))  # type: ignore[union-attr,arg-type]
        rows = []
        for index in range(ready[-1] + 1):
            sequence = instance.slots[index]
            feeds = self._feeds(sequence, sequence.queue[0]) if sequence is not None and sequence.queue else None
            if feeds is None or _shape_key(feeds) != key:  # waits for a batch of its own shapes
                rows.append(_Row())
                continue
            rows.append(_Row(sequence, self._take(sequence), feeds))  # type: ignore[arg-type]
        return rows, None

    def _feeds(self, sequence: _Sequence, request: _Request) -> Feeds:
        return {**request.job.inputs, **self._state_for(sequence, request)}

    def _take(self, sequence: _Sequence) -> _Request:
        """The sequence's next request leaves its queue for a batch; after its END the slot frees at once (the
        next holder's rows run in later batches, as in Triton)."""
        request = sequence.queue.popleft()
        sequence.busy = True
        if request.flags.end:
            self._release(sequence)
        return request

    def _start(self, instance: _Instance, rows: list[_Row]) -> None:
        instance.busy = True
        task = asyncio.get_running_loop().create_task(self._run(instance, rows))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _run(self, instance: _Instance, rows: list[_Row]) -> None:
        """Execute one batch on `instance` in a worker thread and answer each row's request."""
        started = self._clock()
        context = instance.context
        template = next(row.feeds for row in rows if row.feeds is not None)
        feeds = [row.feeds if row.feeds is not None else _zeros_like(template) for row in rows]
        flags = [(r.request.flags.corrid, r.request.flags.start, r.request.flags.end)
                 if r.request is not None else None for r in rows]
        controls = self.settings.controls(flags)
        execution = asyncio.get_running_loop().run_in_executor(self._pool, self._execute_rows, context, feeds,
                                                               controls)
        try:
            outcome = await self.workers.wait(execution)
        except Exception as e:  # noqa: BLE001 - abandoned past kiln_execution_timeout_ms, or the pool is gone
            self._fail(rows, e)
            execution.add_done_callback(lambda done: self._return_late(instance, done, context))
            return
        self._return(instance, outcome.execution.context)
        self._answer(rows, outcome, started)

    def _execute_rows(self, context: object, feeds: list[Feeds], controls: Feeds) -> _Outcome:
        """In a worker thread: stack the rows (compute input), run (compute infer), cut the outputs back per row
        (compute output)."""
        t0 = time.perf_counter_ns()
        inputs = _stack(feeds) | controls
        t1 = time.perf_counter_ns()
        execution = self.workers.run(self._execute, context, inputs)
        if execution.error is not None:
            return _Outcome(execution)
        t2 = time.perf_counter_ns()
        outputs = execution.outputs or {}
        parts = split_outputs(outputs, [1] * len(feeds)) if self.settings.batched else [outputs]
        execution.compute_input_ns += t1 - t0
        return _Outcome(execution, parts, time.perf_counter_ns() - t2)

    def _return(self, instance: _Instance, context: object | None) -> None:
        """The instance is free again with `context` (its replacement after a fault); None: it could not be
        replaced, so its sequences are cancelled and its slots retired."""
        instance.busy = False
        instance.context = context
        if context is None:
            self._retire(self._instances.index(instance))
        self._schedule()

    def _retire(self, index: int) -> None:
        """Instance `index` is gone: its slots leave the pool and its sequences are cancelled."""
        self._retired.add(index)
        self._free = [slot for slot in self._free if slot.instance != index]
        heapq.heapify(self._free)
        for sequence in list(self._instances[index].slots):
            if sequence is not None:
                self._cancel(sequence, unavailable(
                    f"the instance of model '{self.settings.model}' that served sequence {sequence.corrid} failed "
                    "and could not be replaced; start the sequence again"))

    def _return_late(self, instance: _Instance, done: asyncio.Future, context: object | None) -> None:
        """An abandoned execution's thread returned: the instance serves again (on its replacement after a fault)."""
        back = context if done.cancelled() or done.exception() is not None else done.result().execution.context
        self._return(instance, back)

    def _fail(self, rows: list[_Row], error: BaseException) -> None:
        now = self._clock()
        for row in rows:
            if row.request is not None and row.sequence is not None:
                row.sequence.busy, row.sequence.last_ns = False, now
                if not row.request.future.done():
                    row.request.future.set_exception(error)

    def _answer(self, rows: list[_Row], outcome: _Outcome, started: int) -> None:
        """Each request's outputs (its row of the batch's), and its sequence's new state."""
        execution = outcome.execution
        if execution.error is not None:
            self._fail(rows, execution.error)
            return
        times = ExecutionTimes(0, execution.compute_input_ns, execution.compute_infer_ns, outcome.output_ns)
        if self._record is not None:
            self._record(len(rows), times)
        now = self._clock()
        for row, part in zip(rows, outcome.parts):
            if row.request is None or row.sequence is None:
                continue
            row.sequence.busy, row.sequence.last_ns = False, now
            self._keep_state(row.sequence, part)
            if not row.request.future.done():
                row.request.future.set_result(JobResult(part, ExecutionTimes(
                    started - row.request.job.enqueued_ns, times.compute_input_ns, times.compute_infer_ns)))

    def _shut_down(self) -> None:
        self._pool.shutdown(wait=False)


def _shape_key(feeds: Feeds) -> ShapeKey:
    """Rows with equal keys stack into one batch: per input, its dtype and shape after the batch dim."""
    return tuple(sorted((name, a.dtype.str, tuple(a.shape[1:])) for name, a in feeds.items()))


def _zeros_like(feeds: Feeds) -> Feeds:
    """A row without a request: zeros (empty strings for BYTES) shaped like a real row."""
    return {name: np.full(a.shape, b"", dtype=object) if a.dtype == object else np.zeros_like(a)
            for name, a in feeds.items()}


def _stack(feeds: list[Feeds]) -> Feeds:
    """The rows as one batch along the batch dim (one row: its arrays as they are, no copy)."""
    if len(feeds) == 1:
        return dict(feeds[0])
    return {name: np.concatenate([f[name] for f in feeds], axis=0) for name in feeds[0]}


# -- oldest -------------------------------------------------------------------------------------------------
class OldestSequenceBatcher(SequenceBatcher):
    """The oldest strategy: each sequence's next request, once its previous one has finished, goes to a dynamic
    batcher over every instance (module docstring)."""

    def __init__(self, contexts: list[object], execute: Executor, thread_name: str, settings: SequenceSettings,
                 record_execution: ExecutionRecorder | None = None, clock: Callable[[], int] = time.perf_counter_ns,
                 create_context: Callable[[], object] | None = None,
                 execute_parts: PartsExecutor | None = None, execute_jobs: JobsExecutor | None = None) -> None:
        super().__init__(settings, len(contexts), clock)
        config = model_config_pb2.ModelDynamicBatching(preferred_batch_size=list(settings.preferred_sizes),
                                                       max_queue_delay_microseconds=settings.max_queue_delay_ns // 1000)
        batching = BatchingSettings.from_config(config, max(1, settings.max_batch_size), settings.model)
        self._batcher = DynamicBatcher(contexts, execute, thread_name, batching, record_execution, clock=clock,
                                       create_context=create_context, execute_parts=execute_parts,
                                       execute_jobs=execute_jobs)
        self.workers = self._batcher.workers

    def pending(self) -> dict[int, int]:
        return {1: super().pending()[1] + sum(self._batcher.pending().values())}

    def _run_ready(self, now: int) -> int | None:
        ready = [s for s in self._holders.values() if s.queue and not s.busy]
        for sequence in sorted(ready, key=lambda s: s.queue[0].job.enqueued_ns):
            self._hand_off(sequence)
        return None

    def _hand_off(self, sequence: _Sequence) -> None:
        """The sequence's next request, with its controls and state, joins the batcher's queue."""
        request = sequence.queue.popleft()
        flags = request.flags
        controls = self.settings.controls([(flags.corrid, flags.start, flags.end)])
        inputs = {**request.job.inputs, **self._state_for(sequence, request), **controls}
        sequence.busy = True
        if flags.end:
            self._release(sequence)
        try:
            job = request.job  # its id, outputs and sequence parameters go along (a Python model reads them)
            future = self._batcher.enqueue(Job(inputs, job.batch_size, enqueued_ns=job.enqueued_ns,
                                               parameters=_without_batching(job.parameters),
                                               request_id=job.request_id, outputs=job.outputs))
        except Exception as e:  # noqa: BLE001 - the caller hears it
            self._completed(sequence, request, None, e)
            return
        future.add_done_callback(lambda done: self._completed(sequence, request, *outcome(done)))

    def _completed(self, sequence: _Sequence, request: _Request, result: JobResult | None,
                   error: BaseException | None) -> None:
        sequence.busy, sequence.last_ns = False, self._clock()
        if error is None and result is not None:
            self._keep_state(sequence, result.outputs)
        if not request.future.done():
            if error is not None:
                request.future.set_exception(error)
            else:
                request.future.set_result(result)
        self._schedule()

    def _shut_down(self) -> None:
        self._batcher.close()


def _without_batching(parameters: dict) -> dict:
    """A sequence request's parameters for the batcher behind the oldest strategy: `priority` and `timeout` are
    left out (the sequence batcher ignores them, as documented), the rest goes to the model."""
    if "priority" not in parameters and "timeout" not in parameters:
        return parameters
    return {k: v for k, v in parameters.items() if k not in ("priority", "timeout")}


def sequence_batcher(contexts: list[object], execute: Executor, thread_name: str, settings: SequenceSettings,
                     record_execution: ExecutionRecorder | None = None,
                     create_context: Callable[[], object] | None = None,
                     execute_parts: PartsExecutor | None = None,
                     execute_jobs: JobsExecutor | None = None) -> SequenceBatcher:
    """The sequence batcher of the config's strategy. A Python model (`execute_jobs`: its execute() takes the
    requests as they are, each with its own control inputs, so rows are never stacked) runs either strategy as
    the oldest one: each sequence's next request joins its batcher once the previous one has finished, and no row
    without a request is sent (Triton's direct strategy sends those as null requests with READY false)."""
    if settings.oldest or execute_jobs is not None:
        return OldestSequenceBatcher(contexts, execute, thread_name, settings, record_execution,
                                     create_context=create_context, execute_parts=execute_parts,
                                     execute_jobs=execute_jobs)
    return DirectSequenceBatcher(contexts, execute, thread_name, settings, record_execution,
                                 create_context=create_context)
