"""How requests reach execution contexts: the seam where a dynamic batcher plugs in.

A scheduler takes a `Job` (one request's model-ready input arrays, batch-first when the model batches) and
returns the model's output arrays for it plus where the time went. `DirectScheduler` runs each job alone on
the first free execution context, in a worker thread so the event loop never blocks on numpy;
`batcher.DynamicBatcher` gathers jobs from per-priority queues, concatenates their inputs along the batch
dimension, runs once, and splits the outputs back per job. Both report each execution (not each request) to
an `ExecutionRecorder`, which is what makes execution_count and batch_stats differ from per-request counts.

Both run executions through `Workers`, which owns the fault policy: an execution that raises (anything but the
engine refusing the request's shapes or dtypes before it runs) fails only the requests in it, with an INTERNAL
error that says so, and the context it ran on is discarded and replaced by a fresh one from the engine.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from engine_core.errors import ShapeError

from .errors import ErrorKind, ServerError, unavailable
from .statistics import ExecutionTimes

log = logging.getLogger("kiln.server.workers")

# Runs one execution on one context: (context, inputs) -> outputs. Model code supplies it.
Executor = Callable[[object, dict[str, np.ndarray]], dict[str, np.ndarray]]
# Runs several jobs as one execution, the engine gathering their inputs: (context, per-job inputs, per-job output
# destinations or None, per-job `Job.route`s or None) -> per-job outputs.
PartsExecutor = Callable[..., list[Any]]
# The same as a coroutine on the event loop (an executor process's lanes with KILN_EXECUTOR_IO=loop).
AsyncPartsExecutor = Callable[..., Awaitable[list[Any]]]
# Told about each model execution: (items in the executed batch, its compute times).
ExecutionRecorder = Callable[[int, ExecutionTimes], None]


class ResponseStream(Protocol):
    """Where a decoupled model's responses to one request go, on the event loop: zero or more, then the final flag
    (alone or with the last). The model sets `on_cancel` to hear that the client gave up."""

    on_cancel: Callable[[], None] | None

    def deliver(self, outputs: dict[str, np.ndarray] | None, error: BaseException | None, final: bool) -> None: ...


@dataclass
class Job:
    """One request's inputs, ready for the engine (dtype, batch dim and reshape already applied)."""

    inputs: dict[str, np.ndarray]  # or engine_core.DeviceView for inputs in CUDA shared memory (zero-copy)
    batch_size: int
    enqueued_ns: int = 0
    parameters: dict[str, Any] = field(default_factory=dict)  # the request's: `priority`, `timeout` (us)
    #: outputs the engine writes straight into CUDA shared memory (name -> DeviceView); left out of the result
    destinations: dict[str, Any] = field(default_factory=dict)
    #: client requests this job stands for (a frontend's group of alike requests is one job: core/grouping.py)
    requests: int = 1
    #: the request's id and the outputs it asks for, for models that see requests as they are (Python models)
    request_id: str = ""
    outputs: tuple[str, ...] = ()
    #: a decoupled model's request: where each of its responses goes (core/decoupled.py), as the model sends it
    responses: ResponseStream | None = None
    #: a group of requests in shared memory (core/part_groups.py): each member's (inputs, destinations), gathered
    #: by the engine like the jobs of a batch; the job's result is then one outputs dict per member
    parts: list[tuple[dict[str, Any], dict[str, Any]]] | None = None
    #: where an executor process sends this job's response itself (core/direct_replies.py), or None
    route: Any = None

    @property
    def on_device(self) -> bool:
        """Whether an input or output of this job lives in device memory (or it is a group of parts): only the
        engine's gathering path (`PartsExecutor`) can run it."""
        return (self.parts is not None or bool(self.destinations)
                or any(not isinstance(a, np.ndarray) for a in self.inputs.values()))


# Runs several jobs as one execution, handed over as they are: (context, jobs) -> per job its outputs or its own
# error (a Python model answers each request of a batch separately, and one may fail alone).
JobsExecutor = Callable[[object, list[Job]], list[dict[str, np.ndarray] | BaseException]]
# The same as a coroutine on the event loop (a Python model's execute() is a message to its stub and the answer).
AsyncJobsExecutor = Callable[[object, list[Job]], Awaitable[list[dict[str, np.ndarray] | BaseException]]]


@dataclass
class JobResult:
    outputs: dict[str, np.ndarray]
    times: ExecutionTimes
    batch_size: int = 0  #: of the execution the job ran in, when batched with others (a trace's compute span)


@dataclass
class Execution:
    """What a worker thread hands back: the context to return to the pool (the one it ran on, its replacement
    after a fault, or None when no replacement could be made) and either the outputs or the error."""

    context: object | None
    outputs: dict[str, np.ndarray] | None = None
    compute_input_ns: int = 0
    compute_infer_ns: int = 0
    error: BaseException | None = None


def _timed(run: Callable[[], Any]) -> Callable[[], tuple[Any, int, int]]:
    """`run` as `Workers._guarded` takes it: (its outputs, compute input ns (none: the engine gathers), its ns)."""

    def go() -> tuple[Any, int, int]:
        started = time.perf_counter_ns()
        outputs = run()
        return outputs, 0, time.perf_counter_ns() - started

    return go


def started_pool(workers: int, thread_name: str) -> ThreadPoolExecutor:
    """A pool of `workers` execution threads, all started now. Why: ThreadPoolExecutor starts a thread at the first
    submit that finds none idle, so the first requests after ready paid for thread creation (traced on the CPU: the
    first request's hand-back took 0.9 ms against 0.2 steady, docs/next-steps.md)."""
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=thread_name)
    together = threading.Barrier(workers)  # each task holds its thread until all are up: one thread per task
    for started in [pool.submit(together.wait, 10) for _ in range(workers)]:
        started.result()
    return pool


#: fast executions in a row before a model's executions run on the event loop (Workers.runs_inline)
INLINE_AFTER = 32
#: how fast "fast" is, for CPU-backend models: in a worker thread its CPU time (wall time there counted its waits
#: for the interpreter lock beside a busy event loop, so under load executions looked slow, rarely went inline, and
#: every batch paid for the hand-off); on the event loop wall time (reading a thread's CPU clock is a system call,
#: ~9% of the loop per JSON request on a 2-core VM), where one slow run in a row is forgiven: a busy machine
#: preempts the loop now and then, a slow model is slow every time (docs/performance.md)
INLINE_BELOW_NS = 1_000_000

# Raised by the engine before it runs anything, about the request itself: the context is still sound.
REQUEST_ERRORS = (ShapeError, TypeError)


class _PartsBatch:
    """Jobs as the engine gathers them: every part's feeds and destinations in order (a job of parts gives each of
    its members), the routes of jobs an executor may answer itself, and the outputs regrouped per job."""

    def __init__(self, jobs: list[Job]) -> None:
        self.jobs = jobs
        self.grouped = any(job.parts is not None for job in jobs)
        parts = [part for job in jobs for part in (job.parts if job.parts is not None else
                                                    [(job.inputs, job.destinations)])]
        self.feeds = [inputs for inputs, _ in parts]
        self.destinations = [d for _, d in parts] if any(d for _, d in parts) else None
        self.routes = (None if self.grouped or not any(job.route for job in jobs) else
                       [job.route for job in jobs])

    def per_job(self, outputs: list[Any]) -> list[Any]:
        if not self.grouped:
            return outputs
        flat = iter(outputs)
        return [[next(flat) for _ in job.parts] if job.parts is not None else next(flat) for job in self.jobs]


class Workers:
    """The execution contexts of one model version, and what happens when one of them faults.

    After an unexpected exception (or a CUDA error) a context's state is unknown: reusing it could fail or
    corrupt later requests. So the context is dropped and a fresh one made from the engine, in the worker
    thread that saw the fault (a CUDA context is current there). `restarts` counts replacements (for metrics);
    `alive` shrinks only when a replacement cannot be made, and at 0 the scheduler refuses requests instead
    of queueing them forever.
    """

    def __init__(self, contexts: list[object], create: Callable[[], object] | None = None,
                 label: str = "model", timeout_s: float | None = None) -> None:
        self.initial = list(contexts)
        self.alive = len(contexts)
        self.restarts = 0
        self.faults = 0
        self.label = label
        #: how long one execution may run before its requests are failed and its worker counts as hung (None:
        #: no limit; the model config's kiln_execution_timeout_ms)
        self.timeout_s = timeout_s
        self.hung = 0  # workers running an execution that outlived timeout_s (back in service when it returns)
        self.hangs = 0  # such executions over the scheduler's life (metrics)
        #: executions this fast may run on the event loop itself (0: never; see `runs_inline`)
        self.inline_below_ns = 0
        self._slow = INLINE_AFTER  # executions to see (all fast) before running inline; reset by a slow one
        self._struck = False  # the last execution on the event loop was slow (the next slow one counts)
        self._loop_thread = 0  # the event loop's thread (noted by runs_inline, which it calls)
        self._create = create
        self._lock = threading.Lock()
        #: called once the scheduler is closed and its last execution returned (an executor process then stops)
        self.on_retire: Callable[[], None] | None = None

    def retire(self) -> None:
        """The scheduler is closed and idle: release what the contexts hold outside this process."""
        retire, self.on_retire = self.on_retire, None
        if retire is not None:
            retire()

    def runs_inline(self) -> bool:
        """Whether the next execution may run on the event loop instead of a worker thread: the model allows it
        (`inline_below_ns`, CPU-backend models without an execution timeout) and its last `INLINE_AFTER`
        executions each took less than that. Why: a tiny numpy execution holds the interpreter lock anyway, and
        handing it to a thread and back (executor queue, lock switches, a wake-up of the loop) cost more than
        the execution itself and left batches queued behind a busy event loop (docs/performance.md)."""
        self._loop_thread = threading.get_ident()
        return bool(self.inline_below_ns) and self._slow == 0

    def timed(self, duration_ns: int, on_loop: bool = False) -> None:
        """Note one execution's duration (`runs_inline` goes back to threads after a slow one: in a worker thread
        any, on the event loop the second in a row)."""
        if duration_ns < self.inline_below_ns:
            self._struck = False
            if self._slow:
                self._slow -= 1
        elif on_loop and not self._struck:
            self._struck = True
        else:
            self._struck = False
            self._slow = INLINE_AFTER

    def run(self, execute: Executor, context: object, inputs: dict[str, np.ndarray]) -> Execution:
        """In a worker thread: execute on `context`; never raises (the error travels in the result)."""
        return self._guarded(context, lambda: run_on_context(execute, context, inputs))

    def run_parts(self, execute_parts: PartsExecutor, context: object, jobs: list[Job]) -> Execution:
        """Like `run` for several jobs gathered by the engine: `outputs` is then one dict per job, for a job of
        parts (core/part_groups.py) the list of its members' (each member is one part of the execution), for a
        job whose executor sent its response (`Job.route`) `direct_replies.DELIVERED`."""
        batch = _PartsBatch(jobs)

        def run() -> Any:
            return batch.per_job(execute_parts(context, batch.feeds, batch.destinations, batch.routes))

        return self._guarded(context, _timed(run))

    async def run_parts_async(self, execute_parts: AsyncPartsExecutor, context: object,
                              jobs: list[Job]) -> Execution:
        """`run_parts` on the event loop, for a coroutine `execute_parts` (executor lanes with
        KILN_EXECUTOR_IO=loop: server/core/executor.py); errors are sorted as `_guarded` sorts them."""
        batch = _PartsBatch(jobs)
        started = time.perf_counter_ns()
        try:
            outputs = batch.per_job(await execute_parts(context, batch.feeds, batch.destinations, batch.routes))
        except asyncio.CancelledError:  # the loop is closing: no fault of the context's
            raise
        except BaseException as e:  # noqa: BLE001 - any fault must reach the waiting requests, never hang them
            return self._failed(context, e)
        return Execution(context, outputs, 0, time.perf_counter_ns() - started)  # type: ignore[arg-type]  # per job

    def run_jobs(self, execute_jobs: JobsExecutor, context: object, jobs: list[Job]) -> Execution:
        """Like `run_parts` for models that take the jobs themselves (a Python model's execute() gets the batch's
        requests as they are): `outputs` is one dict per job, or that job's own error."""
        return self._guarded(context, _timed(lambda: execute_jobs(context, jobs)))

    @staticmethod
    async def run_jobs_async(execute_jobs: AsyncJobsExecutor, context: object, jobs: list[Job]) -> Execution:
        """`run_jobs` on the event loop, for a coroutine `execute_jobs` (a Python model's execute() is a message to
        its stub and the answer); an error it raises is every job's own (its context stays: the stub restarts
        itself)."""
        started = time.perf_counter_ns()
        try:
            outputs = await execute_jobs(context, jobs)
        except Exception as e:  # noqa: BLE001 - every member must hear about the failure
            outputs = [e for _ in jobs]
        return Execution(context, outputs, 0, time.perf_counter_ns() - started)  # type: ignore[arg-type]

    def _guarded(self, context: object, go: Callable[[], tuple[Any, int, int]]) -> Execution:
        try:
            if not self.inline_below_ns:  # no inline decision to make (CUDA models): nothing to time here
                outputs, input_ns, infer_ns = go()
            else:
                on_loop = threading.get_ident() == self._loop_thread
                clock = time.perf_counter_ns if on_loop else time.thread_time_ns
                started = clock()
                outputs, input_ns, infer_ns = go()
                self.timed(clock() - started, on_loop)
        except BaseException as e:  # noqa: BLE001 - any fault must reach the waiting requests, never hang them
            return self._failed(context, e)
        return Execution(context, outputs, input_ns, infer_ns)

    def _failed(self, context: object, error: BaseException) -> Execution:
        """An execution that raised: a request error as it is, anything else a fault (its context replaced)."""
        if isinstance(error, REQUEST_ERRORS):
            return Execution(context, error=error)
        return Execution(self._replace(context, error), error=self._fault_error(error))

    def _fault_error(self, error: BaseException) -> ServerError:
        if isinstance(error, ServerError):  # the worker said what the client should hear (an executor's exit: 503)
            return error
        return ServerError(ErrorKind.INTERNAL, f"{self.label}: execution failed ({type(error).__name__}: {error}); "
                                               f"the worker that ran it was replaced, retrying may succeed")

    def _replace(self, context: object, error: BaseException) -> object | None:
        """A fresh context for the faulted `context` (None when it cannot be made: the pool shrinks)."""
        with self._lock:
            self.faults += 1
        log.error("%s: worker fault, replacing its execution context", self.label, exc_info=error)
        if getattr(context, "replaces_itself", False):  # an executor process's lane: replaced over there already
            with self._lock:
                self.restarts += 1
            return context
        if self._create is None:  # nothing to make a new one from (schedulers built on bare contexts)
            return context
        try:
            fresh = self._create()
        except Exception:  # noqa: BLE001 - logged; the pool runs on with one worker fewer
            log.exception("%s: could not create a replacement execution context", self.label)
            with self._lock:
                self.alive -= 1
            return None
        with self._lock:
            self.restarts += 1
        return fresh

    def none_left(self) -> ServerError | None:
        """The error for requests when every worker is gone or hung, else None."""
        if self.alive - self.hung > 0:
            return None
        if self.alive > 0:
            return unavailable(f"{self.label}: every worker is still running an execution that exceeded "
                               f"{self._timeout_ms()} ms (kiln_execution_timeout_ms); retry later or reload the model")
        return unavailable(f"{self.label}: every execution context failed and none could be recreated; "
                           f"reload the model")

    def _timeout_ms(self) -> str:
        return f"{(self.timeout_s or 0) * 1000:g}"

    def abandon(self, execution: asyncio.Future) -> ServerError:
        """``execution`` outlived ``timeout_s``: count its worker as hung until the thread returns (then its
        context goes back to the pool as usual) and return the error for the requests it was running. Why not
        kill it: a thread inside a CUDA call or a plugin cannot be stopped safely; the requests must not wait
        forever, and the other workers keep serving."""
        with self._lock:
            self.hung += 1
            self.hangs += 1
        started = time.perf_counter()
        log.error("%s: an execution exceeded %s ms; its worker is out of service until it returns",
                  self.label, self._timeout_ms())

        def returned(_: asyncio.Future) -> None:
            with self._lock:
                self.hung -= 1
            log.warning("%s: the execution that exceeded %s ms returned %.1f s later; its worker serves again",
                        self.label, self._timeout_ms(), time.perf_counter() - started)

        execution.add_done_callback(returned)
        return unavailable(f"{self.label}: the execution ran longer than {self._timeout_ms()} ms "
                           f"(kiln_execution_timeout_ms) and was abandoned; its worker is out of service until it "
                           f"returns, the others keep serving")

    async def wait(self, execution: asyncio.Future) -> Any:
        """The result of ``execution`` (a worker-thread future), within ``timeout_s`` when set; past it raises the
        ``abandon`` error while the thread runs on. Without a timeout it is awaited as it is: a shield around it
        (which `wait_for` needs, so that its timeout does not cancel the execution) costs every batch one more turn
        of the event loop between its thread's return and its answers."""
        if self.timeout_s is None:
            return await execution
        try:
            return await asyncio.wait_for(asyncio.shield(execution), self.timeout_s)
        except TimeoutError:
            raise self.abandon(execution) from None


class DispatchOnce:
    """Runs a scheduler's `dispatch` once, on the event loop's next turn, however many arrivals, returns and timers
    ask for it during this turn. Why: batches are formed once per turn; a task woken per arrival while every
    context was busy cost the event loop more than the arrival itself. `dispatch` clears `queued` when it starts."""

    def __init__(self, dispatch: Callable[[], None]) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None  # the scheduler's loop, once something asked
        self.queued = False
        self._dispatch = dispatch

    def __call__(self) -> None:
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        if not self.queued:
            self.queued = True
            self.loop.call_soon(self._dispatch)


class Scheduler(Protocol):
    async def submit(self, job: Job) -> JobResult:
        """Run `job` and return its outputs; raises what the execution raised."""
        ...

    def enqueue(self, job: Job) -> asyncio.Future:
        """Start `job` without awaiting it: the future gets its `JobResult` or error; cancelling it withdraws the
        job. Raises at once what `submit` would raise before queueing (closed, no workers, a full queue)."""
        ...

    def close(self) -> None:
        """Stop taking jobs; running ones finish."""
        ...

    def pending(self) -> dict[int, int]:
        """Client requests queued and not yet executing, by priority level (Triton's pending request count)."""
        ...


class DirectScheduler:
    """No batching: each job runs by itself on a free context from a fixed pool (one per model instance)."""

    def __init__(self, contexts: list[object], execute: Executor, thread_name: str,
                 record_execution: ExecutionRecorder | None = None,
                 create_context: Callable[[], object] | None = None,
                 execute_parts: PartsExecutor | None = None) -> None:
        self.workers = Workers(contexts, create_context, thread_name)
        self._execute_parts = execute_parts  # for jobs with inputs or outputs on the device (Job.on_device)
        self._free: list[object] = list(contexts)
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._execute = execute
        self._record = record_execution
        self._pool = started_pool(len(contexts), thread_name)
        self._closed = False
        self._active = 0  # jobs submitted and not finished: close() leaves the pool to the last of them

    async def _acquire(self) -> object:
        """A free context; waiting jobs are served in arrival order (a job that just finished cannot jump the
        queue, which asyncio.Queue allows and which starved some clients under load)."""
        gone = self.workers.none_left()
        if gone is not None:
            raise gone
        if self._free and not self._waiters:
            return self._free.pop()
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # handed a context just as it was cancelled
                self._release(waiter.result())
            raise

    def _release(self, context: object | None) -> None:
        """Hand `context` to the oldest waiter; None (a faulted worker that could not be replaced) hands nothing,
        and once no worker is left every waiter is told so."""
        if context is None:
            self._refuse_waiters_if_none_left()
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(context)
                return
        self._free.append(context)

    def _refuse_waiters_if_none_left(self) -> None:
        """Once no worker can serve (all failed, or all hung), every waiting job is told so instead of waiting."""
        gone = self.workers.none_left()
        while gone is not None and self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(gone)

    def pending(self) -> dict[int, int]:
        return {1: sum(1 for waiter in self._waiters if not waiter.done())}

    def enqueue(self, job: Job) -> asyncio.Future:
        if self._closed:
            raise unavailable("this model version was unloaded while the request waited; retry")
        return asyncio.get_running_loop().create_task(self.submit(job))

    async def submit(self, job: Job) -> JobResult:
        if self._closed:
            raise unavailable("this model version was unloaded while the request waited; retry")
        job.enqueued_ns = job.enqueued_ns or time.perf_counter_ns()
        self._active += 1
        try:
            context = await self._acquire()
            started = time.perf_counter_ns()
            if self.workers.runs_inline():  # known to be far shorter than a hand-off to a thread (Workers)
                result = self._run(context, job)
                self._release(result.context)
            else:
                result = await self._in_thread(context, job)
            if result.error is not None:
                raise result.error
            outputs = result.outputs[0] if isinstance(result.outputs, list) else result.outputs
            assert outputs is not None, "an execution without an error has outputs"
            compute_input_ns, compute_infer_ns = result.compute_input_ns, result.compute_infer_ns
        finally:
            self._active -= 1
            if self._closed and not self._active:
                self._pool.shutdown(wait=False)
                self.workers.retire()
        times = ExecutionTimes(queue_ns=started - job.enqueued_ns, compute_input_ns=compute_input_ns,
                               compute_infer_ns=compute_infer_ns)
        if self._record is not None:
            self._record(job.batch_size, times)
        return JobResult(outputs, times)

    async def _in_thread(self, context: object, job: Job) -> Execution:
        """Run `job` on `context` in a worker thread; the context goes back to the pool when the thread is done."""
        try:
            execution = asyncio.get_running_loop().run_in_executor(self._pool, self._run, context, job)
        except RuntimeError as e:  # the pool is shut down
            self._release(context)
            raise ServerError(ErrorKind.INTERNAL, f"execution failed: {e}") from e
        # Back to the pool when the thread is done, not when the caller stops waiting: a cancelled request
        # (HTTP disconnect, gRPC cancel) must not hand a context that is still running to the next job.
        # After a fault the thread hands back the replacement context instead.
        execution.add_done_callback(lambda done: self._release(_context_after(done, context)))
        try:
            return await self.workers.wait(execution)
        except ServerError:  # abandoned past the timeout: with every worker hung, the queue hears it now
            self._refuse_waiters_if_none_left()
            raise

    def _run(self, context: object, job: Job) -> Execution:
        """In a worker thread: the job alone, through the engine's gathering path when it has device tensors."""
        if job.on_device and self._execute_parts is not None:
            return self.workers.run_parts(self._execute_parts, context, [job])
        return self.workers.run(self._execute, context, job.inputs)

    def close(self) -> None:
        """Take no new jobs; jobs already submitted still run (a hot swap fails no request)."""
        self._closed = True
        if not self._active:
            self._pool.shutdown(wait=False)
            self.workers.retire()


def _context_after(done: asyncio.Future, context: object) -> object | None:
    """The context to give back once an execution future is done (`Workers.run` never raises)."""
    if done.cancelled() or done.exception() is not None:
        return context
    return done.result().context


def run_on_context(execute: Executor, context: object,
                   inputs: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], int, int]:
    """In a worker thread: make inputs contiguous (the "compute input" step), then execute; returns the
    outputs and the two durations in ns."""
    t0 = time.perf_counter_ns()
    inputs = {name: (np.ascontiguousarray(a) if isinstance(a, np.ndarray) and a.dtype != object else a)
              for name, a in inputs.items()}
    t1 = time.perf_counter_ns()
    outputs = execute(context, inputs)
    return outputs, t1 - t0, time.perf_counter_ns() - t1
