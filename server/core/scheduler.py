"""How requests reach execution contexts: the seam where a dynamic batcher plugs in.

A scheduler takes a `Job` (one request's model-ready input arrays, batch-first when the model batches) and
returns the model's output arrays for it plus where the time went. `DirectScheduler` runs each job alone on
the first free execution context, in a worker thread so the event loop never blocks on numpy;
`batcher.DynamicBatcher` gathers jobs from per-priority queues, concatenates their inputs along the batch
dimension, runs once, and splits the outputs back per job. Both report each execution (not each request) to
an `ExecutionRecorder`, which is what makes execution_count and batch_stats differ from per-request counts.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .errors import ErrorKind, ServerError, unavailable
from .statistics import ExecutionTimes

# Runs one execution on one context: (context, inputs) -> outputs. Model code supplies it.
Executor = Callable[[object, dict[str, np.ndarray]], dict[str, np.ndarray]]
# Told about each model execution: (items in the executed batch, its compute times).
ExecutionRecorder = Callable[[int, ExecutionTimes], None]


@dataclass
class Job:
    """One request's inputs, ready for the engine (dtype, batch dim and reshape already applied)."""

    inputs: dict[str, np.ndarray]
    batch_size: int
    enqueued_ns: int = 0
    parameters: dict[str, Any] = field(default_factory=dict)  # the request's: `priority`, `timeout` (us)


@dataclass
class JobResult:
    outputs: dict[str, np.ndarray]
    times: ExecutionTimes


class Scheduler(Protocol):
    async def submit(self, job: Job) -> JobResult:
        """Run `job` and return its outputs; raises what the execution raised."""
        ...

    def close(self) -> None:
        """Stop taking jobs; running ones finish."""
        ...


class DirectScheduler:
    """No batching: each job runs by itself on a free context from a fixed pool (one per model instance)."""

    def __init__(self, contexts: list[object], execute: Executor, thread_name: str,
                 record_execution: ExecutionRecorder | None = None) -> None:
        self._contexts = contexts
        self._free: list[object] = list(contexts)
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._execute = execute
        self._record = record_execution
        self._pool = ThreadPoolExecutor(max_workers=len(contexts), thread_name_prefix=thread_name)
        self._closed = False
        self._active = 0  # jobs submitted and not finished: close() leaves the pool to the last of them

    async def _acquire(self) -> object:
        """A free context; waiting jobs are served in arrival order (a job that just finished cannot jump the
        queue, which asyncio.Queue allows and which starved some clients under load)."""
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

    def _release(self, context: object) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(context)
                return
        self._free.append(context)

    async def submit(self, job: Job) -> JobResult:
        if self._closed:
            raise unavailable("this model version was unloaded while the request waited; retry")
        job.enqueued_ns = job.enqueued_ns or time.perf_counter_ns()
        self._active += 1
        try:
            context = await self._acquire()
            started = time.perf_counter_ns()
            try:
                execution = asyncio.get_running_loop().run_in_executor(
                    self._pool, run_on_context, self._execute, context, job.inputs)
            except RuntimeError as e:  # the pool is shut down
                self._release(context)
                raise ServerError(ErrorKind.INTERNAL, f"execution failed: {e}") from e
            # Back to the pool when the thread is done, not when the caller stops waiting: a cancelled request
            # (HTTP disconnect, gRPC cancel) must not hand a context that is still running to the next job.
            execution.add_done_callback(lambda _: self._release(context))
            try:
                outputs, compute_input_ns, compute_infer_ns = await asyncio.shield(execution)
            except RuntimeError as e:
                raise ServerError(ErrorKind.INTERNAL, f"execution failed: {e}") from e
        finally:
            self._active -= 1
            if self._closed and not self._active:
                self._pool.shutdown(wait=False)
        times = ExecutionTimes(queue_ns=started - job.enqueued_ns, compute_input_ns=compute_input_ns,
                               compute_infer_ns=compute_infer_ns)
        if self._record is not None:
            self._record(job.batch_size, times)
        return JobResult(outputs, times)

    def close(self) -> None:
        """Take no new jobs; jobs already submitted still run (a hot swap fails no request)."""
        self._closed = True
        if not self._active:
            self._pool.shutdown(wait=False)


def run_on_context(execute: Executor, context: object,
                   inputs: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], int, int]:
    """In a worker thread: make inputs contiguous (the "compute input" step), then execute; returns the
    outputs and the two durations in ns."""
    t0 = time.perf_counter_ns()
    inputs = {name: (np.ascontiguousarray(a) if a.dtype != object else a) for name, a in inputs.items()}
    t1 = time.perf_counter_ns()
    outputs = execute(context, inputs)
    return outputs, t1 - t0, time.perf_counter_ns() - t1
