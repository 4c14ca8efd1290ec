"""How requests reach execution contexts: the seam where a dynamic batcher plugs in.

A scheduler takes a `Job` (one request's model-ready input arrays, batch-first when the model batches) and
returns the model's output arrays for it plus where the time went. `DirectScheduler` runs each job alone on
the first free execution context, in a worker thread so the event loop never blocks on numpy. A dynamic
batcher would implement the same `submit`, gather jobs from a queue, concatenate their inputs along the batch
dimension, run once, and split the outputs back per job.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .errors import ErrorKind, ServerError, unavailable
from .statistics import ExecutionTimes

# Runs one execution on one context: (context, inputs) -> outputs. Model code supplies it.
Executor = Callable[[object, dict[str, np.ndarray]], dict[str, np.ndarray]]


@dataclass
class Job:
    """One request's inputs, ready for the engine (dtype, batch dim and reshape already applied)."""

    inputs: dict[str, np.ndarray]
    batch_size: int
    enqueued_ns: int = 0


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

    def __init__(self, contexts: list[object], execute: Executor, thread_name: str) -> None:
        self._contexts = contexts
        self._free: asyncio.Queue[object] | None = None
        self._execute = execute
        self._pool = ThreadPoolExecutor(max_workers=len(contexts), thread_name_prefix=thread_name)
        self._closed = False

    def _queue(self) -> asyncio.Queue[object]:
        if self._free is None:  # created on first use, inside the serving event loop
            self._free = asyncio.Queue()
            for context in self._contexts:
                self._free.put_nowait(context)
        return self._free

    async def submit(self, job: Job) -> JobResult:
        if self._closed:
            raise unavailable("this model version was unloaded while the request waited; retry")
        free = self._queue()
        job.enqueued_ns = job.enqueued_ns or time.perf_counter_ns()
        context = await free.get()
        started = time.perf_counter_ns()
        try:
            loop = asyncio.get_running_loop()
            outputs, compute_input_ns, compute_infer_ns = await loop.run_in_executor(
                self._pool, self._run, context, job)
        except RuntimeError as e:
            if self._closed:  # the pool shut down between the check above and the hand-off
                raise unavailable("this model version was unloaded while the request waited; retry") from None
            raise ServerError(ErrorKind.INTERNAL, f"execution failed: {e}") from e
        finally:
            free.put_nowait(context)
        times = ExecutionTimes(queue_ns=started - job.enqueued_ns, compute_input_ns=compute_input_ns,
                               compute_infer_ns=compute_infer_ns)
        return JobResult(outputs, times)

    def _run(self, context: object, job: Job) -> tuple[dict[str, np.ndarray], int, int]:
        """In a worker thread: make inputs contiguous (the "compute input" step), then execute."""
        t0 = time.perf_counter_ns()
        inputs = {name: (np.ascontiguousarray(a) if a.dtype != object else a) for name, a in job.inputs.items()}
        t1 = time.perf_counter_ns()
        outputs = self._execute(context, inputs)
        return outputs, t1 - t0, time.perf_counter_ns() - t1

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=False)
