"""Triton's dynamic batcher: queue requests per model, run several as one execution, split the outputs back.

Requests wait in one queue per priority level. The dispatcher (`_dispatch`, on the event loop) forms a batch
whenever an execution context is free: it takes the oldest request of the highest priority, then adds every queued
request whose non-batch shapes and datatypes match, up to `max_batch_size` items. The batch runs at once when
it is full, when it reaches a preferred size, or when its oldest request has waited `max_queue_delay`;
otherwise the dispatcher waits for more requests (opportunistic batching: while every context is busy,
requests simply accumulate, so batches grow with load). Queue policies give per-request timeouts (REJECT
answers an error, DELAY only lowers the request's priority) and a maximum queue size (RESOURCE_EXHAUSTED).

Padding (model config parameter `kiln_pad_batch: "true"`): requests whose non-batch dims differ are batched
too when their inputs have the same names, datatypes and ranks and fall in the same optimization profile.
Each input is padded with zeros to the largest shape in the batch; each output is cut back to the shape the
request would get alone (the engine's shape inference, no execution). That is done only where it is sound:
every output dim that changes with the padding must follow an input dim. When one does not (a reduced or
data-dependent dim), the batch runs without the odd members and padding is switched off for the model.
Whether zeros are neutral for the model's math (true for elementwise ops and row-wise ops over unpadded
axes, not for a softmax or mean over a padded axis) is the config owner's call; docs/server.md says so.

A fault while executing (see `scheduler.Workers`) fails only the requests of that batch, and their worker
context is replaced; the dispatcher keeps serving on the others meanwhile.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from server.protos import model_config_pb2

from . import hop_stats
from .errors import ErrorKind, ServerError, invalid, unavailable
from .scheduler import (
    AsyncJobsExecutor,
    AsyncPartsExecutor,
    DispatchOnce,
    Execution,
    ExecutionRecorder,
    Executor,
    Job,
    JobResult,
    JobsExecutor,
    PartsExecutor,
    Workers,
    started_pool,
)
from .statistics import ExecutionTimes

log = logging.getLogger("kiln.server.batcher")

QueuePolicy = model_config_pb2.ModelQueuePolicy
DynamicBatching = model_config_pb2.ModelDynamicBatching

# Batches run on the event loop per dispatch at most (Workers.runs_inline), before the loop takes in I/O again.
_INLINE_PER_DISPATCH = 4

# A job's compatibility key: per input, its dtype and its shape without the batch dim.
ShapeKey = tuple[tuple[str, str, tuple[int, ...]], ...]
# With padding: the job's profile (bucket) and, per input, its dtype and rank.
PadKey = tuple[int, tuple[tuple[str, str, int], ...]]
Shapes = dict[str, tuple[int, ...]]


@dataclass
class Padding:
    """What the batcher needs from the model to pad: the output shapes that given input shapes produce
    (None when shape inference cannot tell), and the bucket (optimization profile) of a job's input shapes;
    only jobs of one bucket are padded together, so a batch never outgrows its profile."""

    output_shapes: Callable[[Shapes], Shapes | None]
    bucket: Callable[[Shapes], int] = lambda shapes: 0


@dataclass
class _Pending:
    """A queued job: its future, where it queues, and when it gives up waiting."""

    job: Job
    future: asyncio.Future
    level: int
    key: ShapeKey
    deadline_ns: int  # 0 = no timeout
    reject_on_timeout: bool
    delayed: bool = False  # DELAY policy: timed out, now behind every request that has not
    pad_key: PadKey | None = None  # set when the model pads: jobs with equal pad keys may be padded together


@dataclass
class _Outcome:
    """One batch's execution as its worker thread hands it back: the members that ran, those deferred (left
    out of a padded batch), their output parts, and the compute-output time."""

    execution: Execution
    ran: list[_Pending]
    deferred: list[_Pending]
    parts: list[dict[str, np.ndarray]] = field(default_factory=list)
    output_ns: int = 0
    done_ns: int = 0  # when the worker thread handed it back, if hops are timed (hop_stats.py)


@dataclass
class _LevelPolicy:
    timeout_us: int
    reject_on_timeout: bool
    allow_override: bool
    max_queue_size: int  # 0 = unlimited


@dataclass
class BatchingSettings:
    """The parts of `dynamic_batching` the batcher reads, with Triton's defaults resolved."""

    max_batch_size: int
    preferred_sizes: tuple[int, ...] = ()
    max_queue_delay_ns: int = 0
    priority_levels: int = 0  # 0 = one level
    default_priority: int = 0
    policies: dict[int, _LevelPolicy] = field(default_factory=dict)
    preserve_ordering: bool = False  # answers in the order the requests reached the batcher (`ResponseOrder`)

    @classmethod
    def from_config(cls, config: DynamicBatching, max_batch_size: int, model: str) -> BatchingSettings:
        """Read and check a `dynamic_batching` message; INVALID_ARGUMENT naming the model when inconsistent."""
        levels = int(config.priority_levels)
        default = int(config.default_priority_level)
        if levels and not 1 <= default <= levels:
            raise invalid(f"model '{model}': default_priority_level {default} must be in 1..{levels} "
                          f"(priority_levels)")
        preferred = tuple(sorted({int(s) for s in config.preferred_batch_size}))
        bad = [s for s in preferred if not 1 <= s <= max_batch_size]
        if bad:
            raise invalid(f"model '{model}': preferred_batch_size {bad} must be in 1..{max_batch_size} "
                          f"(max_batch_size)")
        unknown = sorted(k for k in config.priority_queue_policy if not 1 <= k <= levels)
        if unknown:
            raise invalid(f"model '{model}': priority_queue_policy names levels {unknown}, outside 1..{levels}")
        policies = {level: _policy(config.priority_queue_policy.get(level, config.default_queue_policy))
                    for level in range(1, max(levels, 1) + 1)}
        return cls(max_batch_size, preferred, int(config.max_queue_delay_microseconds) * 1000, levels,
                   default if levels else 1, policies, bool(config.preserve_ordering))


def _policy(policy: QueuePolicy) -> _LevelPolicy:
    return _LevelPolicy(int(policy.default_timeout_microseconds), policy.timeout_action == QueuePolicy.REJECT,
                        bool(policy.allow_timeout_override), int(policy.max_queue_size))


def shape_key(inputs: dict[str, np.ndarray]) -> ShapeKey:
    """Jobs with equal keys can be concatenated along the batch dim."""
    return tuple(sorted((name, a.dtype.str, tuple(a.shape[1:])) for name, a in inputs.items()))


def pad_key(inputs: dict[str, np.ndarray], bucket: int) -> PadKey | None:
    """Jobs with equal keys can be padded to one shape; None for BYTES inputs (no neutral padding value)."""
    if any(not isinstance(a, np.ndarray) or a.dtype == object for a in inputs.values()):
        return None  # BYTES have no neutral padding value; device tensors are not padded on the host
    return bucket, tuple(sorted((name, a.dtype.str, a.ndim) for name, a in inputs.items()))


def pad_inputs(jobs: list[Job]) -> dict[str, np.ndarray]:
    """One batch's inputs: each job's input zero-padded (at the end of each non-batch dim) to the largest
    shape among the jobs, then stacked along the batch dim."""
    batch: dict[str, np.ndarray] = {}
    total = sum(job.batch_size for job in jobs)
    for name, first in jobs[0].inputs.items():
        arrays = [job.inputs[name] for job in jobs]
        target = tuple(max(a.shape[d] for a in arrays) for d in range(1, first.ndim))
        out = np.zeros((total, *target), dtype=first.dtype)
        row = 0
        for a in arrays:
            out[(slice(row, row + a.shape[0]), *(slice(0, d) for d in a.shape[1:]))] = a
            row += a.shape[0]
        batch[name] = out
    return batch


def unpad_shapes(padded_in: Shapes, own_in: list[Shapes], padded_out: Shapes | None,
                 own_out: list[Shapes | None]) -> list[Shapes] | None:
    """Per job, the shape of each output to cut from its rows of the padded batch's output; None when that is
    not sound: an output dim that differs between the padded batch and a job alone must follow one input dim
    (same size as that input dim in the padded batch and in every job)."""
    if padded_out is None or any(o is None for o in own_out):
        return None
    candidates = [(name, axis) for name, shape in padded_in.items() for axis in range(1, len(shape))]
    for name, shape in padded_out.items():
        for axis in range(1, len(shape)):
            sizes = [o[name][axis] for o in own_out]  # type: ignore[index]
            if shape[axis] < 0 or any(s < 0 for s in sizes):
                return None
            if all(s == shape[axis] for s in sizes):
                continue
            if not any(padded_in[n][a] == shape[axis] and all(s == i[n][a] for s, i in zip(sizes, own_in))
                       for n, a in candidates):
                return None
    return [dict(o) for o in own_out]  # type: ignore[arg-type]


def _int_parameter(parameters: dict, name: str) -> int | None:
    value = parameters.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise invalid(f"request parameter '{name}' must be an integer, got {value!r}")
    try:
        number = int(value)
    except ValueError:
        raise invalid(f"request parameter '{name}' must be an integer, got {value!r}") from None
    if number < 0:
        raise invalid(f"request parameter '{name}' must be >= 0, got {number}")
    return number


def concat_inputs(jobs: list[Job]) -> dict[str, np.ndarray]:
    """One batch's inputs: each input of every job, concatenated along the batch dim."""
    if len(jobs) == 1:
        return jobs[0].inputs
    return {name: np.concatenate([job.inputs[name] for job in jobs], axis=0) for name in jobs[0].inputs}


def split_outputs(outputs: dict[str, np.ndarray], sizes: list[int]) -> list[dict[str, np.ndarray]]:
    """The batch's outputs cut back into per-job outputs (views, in job order); every output must be batched."""
    total = sum(sizes)
    if len(sizes) == 1:
        return [outputs]
    bounds = np.cumsum(sizes)[:-1]
    parts: list[dict[str, np.ndarray]] = [{} for _ in sizes]
    for name, array in outputs.items():
        array = np.asarray(array)
        if array.ndim == 0 or array.shape[0] != total:
            raise ServerError(ErrorKind.INTERNAL, f"output '{name}' has shape {list(array.shape)}; a batch of "
                                                  f"{total} needs it to start with the batch dim")
        for part, piece in zip(parts, np.split(array, bounds, axis=0)):
            part[name] = piece
    return parts


def _alike_first(batch: list[_Pending]) -> tuple[list[_Pending], list[_Pending]]:
    """The members that run together (those alike the first in non-batch shapes) and those that wait for a run of
    their own."""
    key = batch[0].key
    ran = [p for p in batch if p.key == key]
    return ran, ([p for p in batch if p.key != key] if len(ran) < len(batch) else [])


class ResponseOrder:
    """`dynamic_batching.preserve_ordering` (and the oldest sequence strategy's): each job's answer is handed out
    only once every job that reached the batcher before it has its own, as Triton does, whatever order their batches
    end in (several instances, priority levels, padding that defers a job). The batcher answers its own futures as
    before; callers get twins released in arrival order. A caller that gives up (its twin cancelled) withdraws its
    job as before and holds nobody back."""

    def __init__(self) -> None:
        self._waiting: collections.deque[tuple[asyncio.Future, asyncio.Future]] = collections.deque()

    def follow(self, answered: asyncio.Future) -> asyncio.Future:
        """The future the caller waits on for `answered` (the batcher's)."""
        handed = answered.get_loop().create_future()
        self._waiting.append((answered, handed))
        answered.add_done_callback(self._release)
        handed.add_done_callback(lambda twin: answered.cancel() if twin.cancelled() else None)
        return handed

    def _release(self, _: asyncio.Future | None = None) -> None:
        while self._waiting and self._waiting[0][0].done():
            answered, handed = self._waiting.popleft()
            if handed.done():
                continue
            if answered.cancelled():
                handed.cancel()
            elif answered.exception() is not None:
                handed.set_exception(answered.exception())  # type: ignore[arg-type]
            else:
                handed.set_result(answered.result())


class DynamicBatcher:
    """A `Scheduler` that batches queued jobs onto a fixed pool of execution contexts."""

    def __init__(self, contexts: list[object], execute: Executor, thread_name: str, settings: BatchingSettings,
                 record_execution: ExecutionRecorder | None = None,
                 clock: Callable[[], int] = time.perf_counter_ns,
                 create_context: Callable[[], object] | None = None, padding: Padding | None = None,
                 execute_parts: PartsExecutor | None = None, execute_jobs: JobsExecutor | None = None,
                 execute_jobs_async: AsyncJobsExecutor | None = None,
                 execute_parts_async: AsyncPartsExecutor | None = None) -> None:
        self.settings = settings
        #: takes a batch's jobs as they are and answers each (a Python model's execute() gets a list of requests);
        #: set, it replaces `execute` and `execute_parts`
        self._execute_jobs = execute_jobs
        #: the same as a coroutine, run on the event loop instead of a worker thread (a Python model's execute() is
        #: a message to its stub process and the answer: a thread would only wait, and handing each batch to one
        #: and back cost two thread switches per batch); set, it replaces the three above
        self._execute_jobs_async = execute_jobs_async
        #: runs jobs of equal shapes as one batch, the engine gathering their inputs into its staging buffers and
        #: handing back each job's outputs (no concatenation and splitting here); None: concatenate and split
        self._execute_parts = execute_parts
        #: `execute_parts` as a coroutine on the event loop (executor lanes with KILN_EXECUTOR_IO=loop: a batch's
        #: message and reply cross on the loop, no worker thread); used for batches of alike jobs when the model
        #: has no execution timeout (abandoning a hung execution needs the thread road)
        self._execute_parts_async = execute_parts_async
        self.workers = Workers(contexts, create_context, thread_name)
        self.padding = padding  # None: only jobs of equal shapes share a batch
        self._free: list[object] = list(contexts)
        self._execute = execute
        self._record = record_execution
        self._clock = clock
        self._pool = started_pool(len(contexts), thread_name)
        self._queues: dict[int, collections.deque[_Pending]] = {
            level: collections.deque() for level in settings.policies}
        self._schedule = DispatchOnce(self._dispatch)  # `_dispatch` once on the next loop turn
        self._timer: asyncio.TimerHandle | None = None  # the next _dispatch for a queue delay or deadline
        self._deadlines = 0  # at least the queued requests with a timeout (recounted by _expire; 0: none queued)
        self._running: set[asyncio.Task] = set()
        self._closed = False
        self._order = ResponseOrder() if settings.preserve_ordering else None

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        """The loop this batcher serves, looked up once: `asyncio.get_running_loop()` makes a getpid system call
        per call on Python 3.11 (one per request here, and system calls are dear on virtual machines)."""
        loop = self._schedule.loop
        if loop is None:
            loop = self._schedule.loop = asyncio.get_running_loop()
        return loop

    # -- submission -----------------------------------------------------------------------------------------
    async def submit(self, job: Job) -> JobResult:
        return await self.enqueue(job)

    def pending(self) -> dict[int, int]:
        return {level: sum(p.job.requests for p in queue if not p.future.done())
                for level, queue in sorted(self._queues.items())}

    def enqueue(self, job: Job) -> asyncio.Future:
        """Queue `job`; its future gets the result. No task per request: the dispatcher answers the future."""
        if self._closed:
            raise unavailable("this model version was unloaded while the request waited; retry")
        gone = self.workers.none_left()
        if gone is not None:
            raise gone
        pending = self._enqueue(job)
        if self._free or pending.deadline_ns:  # else the next free context (or a running timer) finds it
            self._schedule()
        return pending.future if self._order is None else self._order.follow(pending.future)

    def _enqueue(self, job: Job) -> _Pending:
        level = self._level(job)
        policy = self.settings.policies[level]
        queue = self._queues[level]
        if policy.max_queue_size and len(queue) >= policy.max_queue_size:
            raise ServerError(ErrorKind.RESOURCE_EXHAUSTED,
                              f"exceeds maximum queue size: {policy.max_queue_size} requests are already queued"
                              + (f" at priority {level}" if self.settings.priority_levels else ""))
        timeout_us = policy.timeout_us
        requested = _int_parameter(job.parameters, "timeout")
        if requested is not None and policy.allow_override:
            timeout_us = requested
        job.enqueued_ns = job.enqueued_ns or self._clock()
        deadline = job.enqueued_ns + timeout_us * 1000 if timeout_us else 0
        future = self._event_loop().create_future()
        pending = _Pending(job, future, level, shape_key(job.inputs), deadline, policy.reject_on_timeout)
        self._deadlines += bool(deadline)
        if self.padding is not None:
            pending.pad_key = pad_key(job.inputs, self.padding.bucket({n: a.shape for n, a in job.inputs.items()}))
        queue.append(pending)
        return pending

    def _level(self, job: Job) -> int:
        """The queue a job joins: its `priority` parameter (0 or absent = the default level); 1 is highest."""
        levels = self.settings.priority_levels
        priority = _int_parameter(job.parameters, "priority") or 0
        if not levels:
            return 1
        if priority == 0:
            return self.settings.default_priority
        if priority > levels:
            raise invalid(f"priority {priority} is out of range: this model has priority levels 1..{levels}")
        return priority

    # -- dispatch -------------------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        """Form and start batches while contexts are free; then wait (a timer) for the first queue delay or
        deadline to run out. Runs on the event loop, only when something changed: an arrival that a free context
        or a deadline cares about, a context coming back, a timer. Why not a task waiting on an event: that woke
        for every arrival while every context was busy, and cost the event loop more than the arrival itself."""
        self._schedule.queued = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        now = self._clock()
        if self._deadlines:
            self._expire(now)
        gone = self.workers.none_left()
        if gone is not None:
            self._fail_queued(gone)
        if not any(self._queues.values()):
            if self._closed and not self._running:  # a started batch's task may not have reached the pool yet
                self._retire()
            return
        wait_ns = None
        inline_left = _INLINE_PER_DISPATCH
        while self._free:
            inline = self.workers.runs_inline()
            if inline and not inline_left:  # let the loop take in I/O, then go on (before a batch leaves its queue)
                self._schedule()
                return
            batch, wait_ns = self._form_batch(now)
            if not batch:
                break
            if inline:
                inline_left -= 1
                self._run_inline(batch)
                now = self._clock()
                continue
            self._start(batch)
        timeouts = [wait_ns] if wait_ns is not None else []
        if self._deadlines:
            timeouts += [p.deadline_ns - now for q in self._queues.values() for p in q
                         if p.deadline_ns and not p.delayed]
        if timeouts:
            assert self._schedule.loop is not None
            self._timer = self._schedule.loop.call_later(max(min(timeouts), 0) / 1e9, self._schedule)

    def _expire(self, now: int) -> None:
        """Answer REJECT requests past their deadline; DELAY ones move behind the rest. Drop cancelled ones."""
        self._deadlines = 0
        for level, queue in self._queues.items():
            kept: collections.deque[_Pending] = collections.deque()
            for pending in queue:
                if pending.future.done():
                    continue
                if pending.deadline_ns and now >= pending.deadline_ns and not pending.delayed:
                    if pending.reject_on_timeout:
                        pending.future.set_exception(unavailable(
                            "request timeout expired while queued (queue policy timeout "
                            f"{(pending.deadline_ns - pending.job.enqueued_ns) // 1000} us)"))
                        continue
                    pending.delayed = True
                self._deadlines += bool(pending.deadline_ns)
                kept.append(pending)
            self._queues[level] = kept

    def _fail_queued(self, error: ServerError) -> None:
        """No worker is left: nothing queued can ever run, so every queued request hears it now."""
        for level, queue in self._queues.items():
            for pending in queue:
                if not pending.future.done():
                    pending.future.set_exception(error)
            self._queues[level] = collections.deque()

    def _ordered(self) -> list[_Pending]:
        """Queued requests in service order: priority level, then not-delayed before delayed, then arrival."""
        live = [p for level in sorted(self._queues) for p in self._queues[level] if not p.future.done()]
        return [p for p in live if not p.delayed] + [p for p in live if p.delayed]

    def _form_batch(self, now: int) -> tuple[list[_Pending], int | None]:
        """The batch to run now (empty if it should wait), and how long to wait for it (ns) when waiting."""
        ordered = self._ordered()
        if not ordered:  # only requests whose callers gave up
            for queue in self._queues.values():
                queue.clear()
            return [], None
        limit = self.settings.max_batch_size
        head = ordered[0]
        batch, total = [head], head.job.batch_size
        for pending in ordered[1:]:
            if total == limit:
                break
            if self._compatible(head, pending) and total + pending.job.batch_size <= limit:
                batch.append(pending)
                total += pending.job.batch_size
        waited = now - min(p.job.enqueued_ns for p in batch)
        delay = self.settings.max_queue_delay_ns
        preferred = self.settings.preferred_sizes
        if total >= limit or waited >= delay or total in preferred:
            return self._take(batch), None
        if preferred:  # a preferred size is within reach by dropping the newest members: run that now
            sizes = np.cumsum([p.job.batch_size for p in batch])
            reachable = [i for i, size in enumerate(sizes) if int(size) in preferred]
            if reachable:
                return self._take(batch[: reachable[-1] + 1]), None
        return [], delay - waited

    def _compatible(self, head: _Pending, other: _Pending) -> bool:
        """Equal shapes always batch; with padding on, equal pad keys (same profile, dtypes, ranks) too."""
        if other.key == head.key:
            return True
        return self.padding is not None and head.pad_key is not None and other.pad_key == head.pad_key

    def _take(self, batch: list[_Pending]) -> list[_Pending]:
        """`batch` out of the queues, and requests whose callers gave up (cancelled futures) with it."""
        chosen = {id(p) for p in batch}
        for level, queue in self._queues.items():
            self._queues[level] = collections.deque(p for p in queue if id(p) not in chosen and not p.future.done())
        return batch

    def _run_inline(self, batch: list[_Pending]) -> None:
        """Execute `batch` right here on the event loop (`Workers.runs_inline`: its executions are known to be
        far shorter than a hand-off to a thread) and answer its members."""
        context = self._free.pop()
        started = self._clock()
        try:
            outcome = self._execute_batch(context, batch)
        except Exception as e:  # noqa: BLE001 - every member must hear about the failure
            self._free.append(context)
            for pending in batch:
                if not pending.future.done():
                    pending.future.set_exception(e)
            return
        self._take_back(outcome)
        if self.workers.none_left() is not None:  # the last context faulted: the queue must hear it
            self._schedule()
        self._answer(outcome, started)

    def _take_back(self, outcome: _Outcome) -> None:
        """After an execution: the members left out go back to the front of their queues, and its context (the
        replacement after a fault) to the pool; none when no replacement could be made (the pool shrinks)."""
        self._requeue(outcome.deferred)
        if outcome.execution.context is not None:
            self._free.append(outcome.execution.context)

    def _start(self, batch: list[_Pending]) -> None:
        context = self._free.pop()
        task = self._event_loop().create_task(self._run_batch(context, batch))
        self._running.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        self._running.discard(task)
        if self._closed and not self._running and not any(self._queues.values()):
            self._retire()

    def _retire(self) -> None:
        """Closed and idle: the worker threads end and the contexts let go of what they hold."""
        self._pool.shutdown(wait=False)
        self.workers.retire()

    async def _run_batch(self, context: object, batch: list[_Pending]) -> None:
        """Execute one batch on `context` in a worker thread and answer each member's future."""
        if self._execute_jobs_async is not None or (self._execute_parts_async is not None
                                                     and self.workers.timeout_s is None and self.padding is None):
            await self._run_batch_on_loop(context, batch)
            return
        started = self._clock()
        give_back: object | None = context
        execute = self._execute_batch_timed if hop_stats.ON else self._execute_batch
        execution = self._event_loop().run_in_executor(self._pool, execute, context, batch)
        try:
            outcome = await self.workers.wait(execution)
        except ServerError as e:  # abandoned past kiln_execution_timeout_ms: the context returns with the thread
            give_back = None
            execution.add_done_callback(lambda done: self._return_late(done, context))
            for pending in batch:
                if not pending.future.done():
                    pending.future.set_exception(e)
        except Exception as e:  # noqa: BLE001 - every member must hear about the failure
            for pending in batch:
                if not pending.future.done():
                    pending.future.set_exception(e)
        else:
            # the context goes back and the next batch starts before this one's members are answered: the
            # device works on it while the event loop sends these replies
            give_back = None
            if outcome.done_ns:
                hop_stats.stats("core").add("lane result -> event loop", outcome.done_ns, len(outcome.ran))
            self._take_back(outcome)
            self._dispatch()
            self._answer(outcome, started)
        finally:
            if give_back is not None:
                self._free.append(give_back)
            if give_back is not None or self.workers.none_left() is not None:  # queued requests must hear it
                self._schedule()

    async def _run_batch_on_loop(self, context: object, batch: list[_Pending]) -> None:
        """`_run_batch` for a coroutine executor (a Python model's jobs as they are; an executor lane's parts with
        KILN_EXECUTOR_IO=loop): the batch's alike jobs awaited here, the others back to their queues (as
        `_execute_batch` defers them); each member answered."""
        started = self._clock()
        ran, deferred = _alike_first(batch)
        jobs = [p.job for p in ran]
        if self._execute_jobs_async is not None:
            execution = await self.workers.run_jobs_async(self._execute_jobs_async, context, jobs)
        else:
            assert self._execute_parts_async is not None
            execution = await self.workers.run_parts_async(self._execute_parts_async, context, jobs)
        outcome = _Outcome(execution, ran, deferred, execution.outputs or [])  # type: ignore[arg-type]
        self._take_back(outcome)
        if self.workers.none_left() is not None:  # the last context is gone: the queue must hear it
            self._schedule()
        self._dispatch()
        self._answer(outcome, started)

    def _return_late(self, done: asyncio.Future, context: object) -> None:
        """An abandoned execution's thread returned: its context (or the replacement after a fault) serves again."""
        back = context if done.cancelled() or done.exception() is not None else done.result().execution.context
        if back is not None and not self._closed:
            self._free.append(back)
            self._schedule()

    def _answer(self, outcome: _Outcome, started: int) -> None:
        """Set each executed member's result (its part of the outputs) or the execution's error."""
        execution = outcome.execution
        if execution.error is not None:
            for pending in outcome.ran:
                if not pending.future.done():
                    pending.future.set_exception(execution.error)
            return
        batch = sum(p.job.batch_size for p in outcome.ran)
        if self._record is not None:
            self._record(batch, ExecutionTimes(0, execution.compute_input_ns, execution.compute_infer_ns,
                                               outcome.output_ns))
        for pending, part in zip(outcome.ran, outcome.parts):
            if isinstance(part, BaseException):  # that job's own error (`execute_jobs`)
                if not pending.future.done():
                    pending.future.set_exception(part)
                continue
            if not pending.future.done():
                times = ExecutionTimes(queue_ns=started - pending.job.enqueued_ns,
                                       compute_input_ns=execution.compute_input_ns,
                                       compute_infer_ns=execution.compute_infer_ns)
                pending.future.set_result(JobResult(part, times, batch))

    def _requeue(self, deferred: list[_Pending]) -> None:
        """Members left out of a batch go back to the front of their queues, in their order."""
        for pending in reversed(deferred):
            self._queues[pending.level].appendleft(pending)

    def _execute_batch_timed(self, context: object, batch: list[_Pending]) -> _Outcome:
        outcome = self._execute_batch(context, batch)
        outcome.done_ns = time.monotonic_ns()
        return outcome

    def _execute_batch(self, context: object, batch: list[_Pending]) -> _Outcome:
        """In a worker thread: concatenate or pad (compute input), run (compute infer), split and cut back
        (compute output). Members whose padding would not be sound are deferred, not run."""
        t0 = time.perf_counter_ns()
        ran, cuts = batch, None
        deferred: list[_Pending] = []
        if any(p.key != batch[0].key for p in batch):
            padding = self.padding  # read once: another worker may switch padding off meanwhile
            cuts = self._unpad_plan(padding, [p.job for p in batch]) if padding is not None else None
            if cuts is None:
                ran, deferred = _alike_first(batch)
        jobs = [p.job for p in ran]
        if self._execute_jobs is not None:
            execution = self.workers.run_jobs(self._execute_jobs, context, jobs)
            return _Outcome(execution, ran, deferred, execution.outputs or [])  # type: ignore[arg-type]
        if cuts is None and self._execute_parts is not None:
            # the engine gathers, runs and splits in one call: all of it counts as compute infer
            execution = self.workers.run_parts(self._execute_parts, context, jobs)
            return _Outcome(execution, ran, deferred, execution.outputs or [])  # type: ignore[arg-type]
        inputs = concat_inputs(jobs) if cuts is None else pad_inputs(jobs)
        t1 = time.perf_counter_ns()
        execution = self.workers.run(self._execute, context, inputs)
        if execution.error is not None:
            return _Outcome(execution, ran, deferred)
        t2 = time.perf_counter_ns()
        parts = split_outputs(execution.outputs, [job.batch_size for job in jobs])  # type: ignore[arg-type]
        if cuts is not None:
            parts = [{name: array[tuple(slice(0, d) for d in cut[name])] if name in cut else array
                      for name, array in part.items()} for part, cut in zip(parts, cuts)]
        execution.compute_input_ns += t1 - t0  # concatenating/padding is part of preparing the input
        return _Outcome(execution, ran, deferred, parts, time.perf_counter_ns() - t2)

    def _unpad_plan(self, padding: Padding, jobs: list[Job]) -> list[Shapes] | None:
        """Per job, the output shapes to cut back to after padding; None (and padding switched off for this
        model, with a warning) when the model's outputs do not follow its padded input dims."""
        own_in = [{n: tuple(a.shape) for n, a in job.inputs.items()} for job in jobs]
        padded_in = {n: (sum(job.batch_size for job in jobs),
                         *(max(s[n][d] for s in own_in) for d in range(1, len(own_in[0][n]))))
                     for n in own_in[0]}
        cuts = unpad_shapes(padded_in, own_in, padding.output_shapes(padded_in),
                            [padding.output_shapes(s) for s in own_in])
        if cuts is None and self.padding is not None:
            log.warning("%s: kiln_pad_batch is set, but an output dim does not follow the padded input dims; "
                        "requests of different shapes now run in separate batches", self.workers.label)
            self.padding = None
        return cuts

    @property
    def gathers_parts(self) -> bool:
        """Whether the engine gathers this model's batches from their jobs' own arrays (a job may then be a group
        of parts: core/part_groups.py); not with padding, which pads each job's arrays on the host."""
        return self._execute_parts is not None and self._execute_jobs is None and self.padding is None

    def close(self) -> None:
        """Take no new jobs; the queued and running ones still finish (a hot swap fails no request)."""
        self._closed = True
        if not any(self._queues.values()) and not self._running:
            self._retire()
