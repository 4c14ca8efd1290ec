"""A frontend's group of alike requests whose tensors are in shared memory, run as one job of parts.

Why: a request whose inputs or outputs are in a shared-memory region cannot be concatenated by the frontend (its
data is not in the message), so each one used to be a core message and a batcher job of its own, and paid the
core's whole cost per request: CUDA and system shared memory served fewer requests a second than plain gRPC on the
GPU (docs/performance.md). Now the frontend sends the alike ones of a loop turn as one message (grouping.py
`by_reference`); the core checks each member and resolves its regions, then queues them as one job whose parts the
engine gathers straight from each member's region (`ExecutionContext.infer_batch`), as it gathers a batch's jobs.
Each member gets its own response, and its own error when its check fails (a region unregistered or too small is
that member's fault alone); an execution error reaches every member, as it would have in one batch.

Groups run as one job only where a batch's jobs are gathered by the engine (a CUDA model that batches
dynamically, no padding switch, no tracing, no response cache) and the rows fit max_batch_size; otherwise each
member runs as its own request, still answered in one message.
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from . import request_io
from .grouping import Answer, MemberResults, rows, run_requests
from .model import ModelVersion
from .scheduler import Job, JobResult
from .types import InferRequest, InferResponse, RequestedOutput


@dataclass
class _Checked:
    """A member that passed its checks: where its answer goes in the group's results, and what it asks for."""

    index: int
    request: InferRequest
    inputs: dict[str, Any]
    batch: int
    requested: list[RequestedOutput]
    destinations: dict[str, Any]


def submit_parts(core: Any, requests: list[InferRequest], reply: Answer) -> list[asyncio.Future]:
    """`ServerCore.submit_infer_parts`: `reply(MemberResults, None)` once every member is answered. Returns the
    futures to cancel to withdraw the group."""
    model = _runs_as_parts(core, requests)
    if model is None:
        return run_requests(requests, core.submit_infer, lambda results: reply(results, None))
    started = time.perf_counter_ns()
    results: list[tuple[Any, BaseException | None]] = [(None, None)] * len(requests)
    members: list[_Checked] = []
    alike = not _reshapes(model)  # members after a checked one need only their own checks
    for index, request in enumerate(requests):
        try:
            if members and alike:
                inputs, batch, requested = _alike_member(core, model, members[0], request)
            else:
                inputs, batch, requested = core._checked(model, request)
            destinations = request_io.output_views(core.system_shm, model, requested, inputs)
        except Exception as e:  # noqa: BLE001 - this member's own error; the others still run
            model.statistics.record_failure(time.perf_counter_ns() - started)
            results[index] = (None, e)
            continue
        members.append(_Checked(index, request, inputs, batch, requested, destinations))
    if not members:
        reply(MemberResults(results), None)
        return []
    model.traffic.record(members[0].inputs)  # once: the members' shapes are alike
    job = Job(members[0].inputs, sum(m.batch for m in members), requests=len(members),
              parts=[(m.inputs, m.destinations) for m in members])
    try:
        future = model.scheduler.enqueue(job)
    except Exception as e:  # noqa: BLE001 - e.g. the queue is full: every checked member hears it
        model.statistics.record_failure(time.perf_counter_ns() - started, len(members))
        for member in members:
            results[member.index] = (None, e)
        reply(MemberResults(results), None)
        return []
    future.add_done_callback(functools.partial(_finish, core=core, model=model, members=members, results=results,
                                               started=started, reply=reply))
    return [future]


def _reshapes(model: ModelVersion) -> bool:
    """Whether the config reshapes an input (`reshape`): each member's arrays then take the full check."""
    return any(spec.model_dims != spec.dims for spec in model.inputs.values())


def _alike_member(core: Any, model: ModelVersion, first: _Checked, request: InferRequest
                  ) -> tuple[dict[str, Any], int, list[RequestedOutput]]:
    """A member after one that passed the full check: alike it in input names, datatypes, shapes past the batch
    dim and output names (grouping.group_key), so only what is its own is checked: its regions (resolved, their
    sizes against its shapes) and its batch size. Why: the full check per member was most of the core's time for
    a group in shared memory (docs/performance.md)."""
    batch = rows(request)
    if not 1 <= batch <= model.max_batch_size:
        return core._checked(model, request)  # says what is wrong, in the full check's words
    arrays = {tensor.name: request_io.input_array(core.system_shm, tensor, model) for tensor in request.inputs}
    return arrays, batch, request.outputs or first.requested


def _runs_as_parts(core: Any, requests: list[InferRequest]) -> ModelVersion | None:
    """The model when the group can run as one job of parts, else None (then member by member)."""
    first = requests[0]
    if not 0 < sum(rows(r) for r in requests) <= core.group_rows(first):
        return None  # group_rows: a ModelVersion (never decoupled) behind a dynamic batcher, no tracing, no cache
    model = core._version(first.model_name, first.model_version)
    return model if model.scheduler.gathers_parts else None


def _finish(done: asyncio.Future, *, core: Any, model: ModelVersion, members: list[_Checked],
            results: list[tuple[Any, BaseException | None]], started: int, reply: Answer) -> None:
    """The group's job is done: each member's outputs (already in its CUDA region, or written to its region
    now) into its response, statistics recorded, the group answered."""
    if done.cancelled():
        reply(None, asyncio.CancelledError())
        return
    try:
        result: JobResult = done.result()
    except Exception as e:  # noqa: BLE001 - the engine refusing the data is the clients' error, all of them
        error = request_io.execution_error(model, e)
        model.statistics.record_failure(time.perf_counter_ns() - started, len(members))
        for member in members:
            results[member.index] = (None, error)
        reply(MemberResults(results), None)
        return
    t0 = time.perf_counter_ns()
    succeeded = items = 0
    per_member = cast(list[dict[str, np.ndarray]], result.outputs)  # a job of parts: one dict per member
    for member, outputs in zip(members, per_member):
        try:
            answer = request_io.outputs(core.system_shm, model, member.requested, outputs, member.destinations)
        except Exception as e:  # noqa: BLE001 - e.g. its output region went away: this member's error
            model.statistics.record_failure(time.perf_counter_ns() - started)
            results[member.index] = (None, e)
            continue
        results[member.index] = (InferResponse(model.name, str(model.version), answer, id=member.request.id), None)
        succeeded += 1
        items += member.batch
    result.times.compute_output_ns = time.perf_counter_ns() - t0
    if succeeded:
        model.statistics.record_success(items, time.perf_counter_ns() - started, result.times, succeeded)
    reply(MemberResults(results), None)
