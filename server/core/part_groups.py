"""A frontend's group of alike requests whose tensors are in shared memory, run as one job of parts.

Why: a request whose inputs or outputs are in a shared-memory region cannot be concatenated by the frontend (its
data is not in the message), so each one used to be a core message and a batcher job of its own, and paid the
core's whole cost per request: CUDA and system shared memory served fewer requests a second than plain gRPC on the
GPU (docs/performance.md). Now the frontend sends the alike ones of a loop turn as one message (grouping.py
`by_reference`: the first request, then each member's `Part`); the core checks each member and resolves its regions,
then queues them as one job whose parts the engine gathers straight from each member's region
(`ExecutionContext.infer_batch`), as it gathers a batch's jobs. Each member gets its own response, and its own error
when its check fails (a region unregistered or too small is that member's fault alone); an execution error reaches
every member, as it would have in one batch.

The first member takes the full check; the others are alike it (grouping.group_key), so only what is their own is
checked (`_Alike`): their regions and their rows. Their answer (grouping.PartAnswers) carries per member only its
outputs' shapes and byte sizes; the frontend makes the responses.

Groups run as one job only where a batch's jobs are gathered by the engine (a CUDA model that batches
dynamically, no padding switch, no tracing, no response cache) and the rows fit max_batch_size; otherwise each
member runs as its own request, still answered in one message.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from . import request_io
from .grouping import (
    GROUPABLE_OUTPUT_PARAMETERS,
    SHARED_MEMORY_PARAMETERS,
    Answer,
    MemberResults,
    Part,
    PartAnswers,
    PartOutput,
    part_request,
    run_requests,
)
from .model import ModelVersion
from .scheduler import Job, JobResult
from .shared_memory import SharedMemory
from .types import InferRequest, RequestedOutput, datatype_of_numpy, numpy_dtype

#: (name, parameters) of each output a member asks for (all the model's, with none, when it names none)
Asked = list[tuple[str, dict[str, Any]]]


@dataclass
class _Checked:
    """A member that passed its checks: where its answer goes in the group's results, and what it asks for."""

    index: int
    inputs: dict[str, Any]
    batch: int
    asked: Asked
    destinations: dict[str, Any]


def submit_parts(core: Any, first: InferRequest, parts: list[Part], reply: Answer) -> list[asyncio.Future]:
    """`ServerCore.submit_infer_parts`: `reply(PartAnswers or MemberResults, None)` once every member is answered.
    Returns the futures to cancel to withdraw the group."""
    model = _runs_as_parts(core, first, parts)
    if model is None:
        requests = [first, *(part_request(first, part) for part in parts[1:])]
        return run_requests(requests, core.submit_infer, lambda results: reply(results, None))
    started = time.perf_counter_ns()
    failed: dict[int, BaseException] = {}
    members: list[_Checked] = []
    alike: _Alike | None = None
    for index, part in enumerate(parts):
        try:
            if alike is not None:
                members.append(alike.check(index, part))
                continue
            members.append(_full_check(core, model, index, first if index == 0 else part_request(first, part)))
        except Exception as e:  # noqa: BLE001 - this member's own error; the others still run
            model.statistics.record_failure(time.perf_counter_ns() - started)
            failed[index] = e
            continue
        if not _reshapes(model):  # else every member takes the full check
            alike = _Alike(core, model, first, members[0])
    if not members:
        reply(_results(len(parts), failed), None)
        return []
    model.traffic.record(members[0].inputs)  # once: the members' shapes are alike
    job = Job(members[0].inputs, sum(m.batch for m in members), requests=len(members),
              parts=[(m.inputs, m.destinations) for m in members])
    try:
        future = model.scheduler.enqueue(job)
    except Exception as e:  # noqa: BLE001 - e.g. the queue is full: every checked member hears it
        model.statistics.record_failure(time.perf_counter_ns() - started, len(members))
        failed.update((member.index, e) for member in members)
        reply(_results(len(parts), failed), None)
        return []
    answers = alike or _Alike(core, model, first, members[0])
    future.add_done_callback(functools.partial(_finish, answers=answers, members=members, failed=failed,
                                               count=len(parts), started=started, reply=reply))
    return [future]


def _full_check(core: Any, model: ModelVersion, index: int, request: InferRequest) -> _Checked:
    """A member checked as a request of its own would be (`ServerCore._checked`), its in-place outputs resolved."""
    inputs, batch, requested = core._checked(model, request)
    destinations = request_io.output_views(core.system_shm, model, requested, inputs)
    return _Checked(index, inputs, batch, [(o.name, o.parameters) for o in requested], destinations)


def _results(count: int, failed: dict[int, BaseException]) -> MemberResults:
    """The answer of a group none of whose members ran: each member's error."""
    return MemberResults([(None, failed[i]) for i in range(count)])


def _reshapes(model: ModelVersion) -> bool:
    """Whether the config reshapes an input (`reshape`): each member's arrays then take the full check."""
    return any(spec.model_dims != spec.dims for spec in model.inputs.values())


def _runs_as_parts(core: Any, first: InferRequest, parts: list[Part]) -> ModelVersion | None:
    """The model when the group can run as one job of parts, else None (then member by member)."""
    if not 0 < sum(part[1] for part in parts) <= core.group_rows(first):
        return None  # group_rows: a ModelVersion (never decoupled) behind a dynamic batcher, no tracing, no cache
    model = core._version(first.model_name, first.model_version)
    return model if model.scheduler.gathers_parts else None


@dataclass
class _Input:
    """What every alike member's input of one name shares with the first member's."""

    name: str
    dtype: np.dtype
    tail: tuple[int, ...]  # the shape past the batch dim
    row_bytes: int  # 0 for BYTES, whose size the data says: such an input takes request_io's road
    in_place: bool  # the engine may read it where it is (`request_io.input_array`'s device path)
    host: bool  # ... also from a page-locked system region (`request_io.host_regions`)


class _Alike:
    """A group's members after the first that passed the full check: alike it in input names, datatypes, shapes
    past the batch dim and requested outputs (grouping.group_key), so only what is their own is checked: their
    regions (resolved, their sizes against their rows) and their batch size. What follows from the model and the
    first member (dtypes, row sizes, which outputs the engine may write in place, output shapes by batch size,
    output datatypes) is worked out once per group. Why: request_io's checks per member, each asking the model and
    the config again, were most of the core's time for a group in shared memory (docs/performance.md).

    Anything off the expected path (a size that does not match its rows, a region the engine cannot use in place,
    an output to convert) goes through request_io's own functions, so errors and fallbacks stay theirs, word for
    word."""

    def __init__(self, core: Any, model: ModelVersion, request: InferRequest, checked: _Checked) -> None:
        self.core = core
        self.shm: SharedMemory = core.system_shm
        self.model = model
        self.request = request  # the group's first request, whose inputs the members' parts follow
        self.asked = checked.asked
        self.names = [name for name, _ in checked.asked]
        self.device = request_io.device_io(model)
        self.host = request_io.host_regions(model)
        self.inputs: list[_Input] = []
        for tensor in request.inputs:
            dtype = numpy_dtype(tensor.datatype)
            tail = tuple(int(d) for d in tensor.shape[1:])
            fixed = tensor.datatype != "BYTES"
            self.inputs.append(_Input(tensor.name, dtype, tail, math.prod(tail) * dtype.itemsize if fixed else 0,
                                      request_io.reads_in_place(model, tensor.datatype), self.host))
        self._in_place: dict[str, bool] = {}  # per output: whether the engine may write it into its region
        self._shapes: dict[int, dict[str, tuple[int, ...]] | None] = {}  # output shapes by batch size
        self._datatypes: dict[str, str] = {}  # an output's datatype when it comes back from the device
        self._host_dtypes: dict[str, Any] = {}  # an output's dtype when it goes back as the engine made it

    def check(self, index: int, part: Part) -> _Checked:
        """Member `index`'s own checks; the full check (its words) when its batch size is out of range or its
        inputs are not laid out as the first member's."""
        _, batch, tensors, outputs = part
        if (not 1 <= batch <= self.model.max_batch_size or len(tensors) != len(self.inputs)
                or (outputs and len(outputs) != len(self.names))):
            return self._full(index, part)
        inputs = {}
        for plan, tensor in zip(self.inputs, tensors):
            array = _in_region(self.shm, plan, tensor, batch) if type(tensor) is dict else None
            if array is None:
                return self._full(index, part)  # says what is wrong, or takes the road request_io takes
            inputs[plan.name] = array
        asked = list(zip(self.names, outputs)) if outputs else self.asked
        return _Checked(index, inputs, batch, asked, self._destinations(asked, inputs, batch))

    def _full(self, index: int, part: Part) -> _Checked:
        return _full_check(self.core, self.model, index, part_request(self.request, part))

    def _destinations(self, asked: Asked, inputs: dict[str, Any], batch: int) -> dict[str, Any]:
        """`request_io.output_views` for a member: the outputs the engine writes straight into its regions."""
        if not self.device:
            return {}
        views: dict[str, Any] = {}
        for name, params in asked:
            if params.get("shared_memory_region") is None or not self._writes_in_place(name):
                continue
            if not _GROUPED_OUTPUT_PARAMETERS.issuperset(params):  # e.g. classification: request_io decides
                return request_io.output_views(self.shm, self.model, _requested(asked), inputs)
            shapes = self._output_shapes(inputs, batch)
            if shapes is None:
                return {}  # shapes the engine cannot tell before running: the host path writes them afterwards
            view = request_io.output_view(self.shm, self.model, name, params, shapes[name])
            if view is not None:
                views[name] = view
        return views

    def _writes_in_place(self, name: str) -> bool:
        """`request_io.writes_in_place`, asked of the model once per group."""
        known = self._in_place.get(name)
        if known is None:
            known = self._in_place[name] = request_io.writes_in_place(self.model, name)
        return known

    def _output_shapes(self, inputs: dict[str, Any], batch: int) -> dict[str, tuple[int, ...]] | None:
        """The model's output shapes for a member's inputs: alike members of a batch size share them."""
        if batch not in self._shapes:
            self._shapes[batch] = self.model.output_shapes({name: tuple(a.shape) for name, a in inputs.items()})
        return self._shapes[batch]

    def outputs(self, member: _Checked, arrays: dict[str, np.ndarray]) -> list[PartOutput]:
        """`request_io.outputs` for a member, as `PartOutput`s: an output the engine wrote into its region
        described, one as the engine made it (the config's dtype, no reshape, no classification) written into its
        region or sent as it is, any other as request_io makes it."""
        answer: list[PartOutput] = []
        for name, params in member.asked:
            view = member.destinations.get(name)
            if view is not None:
                answer.append((self._device_datatype(name, view), view.shape, None, view.nbytes))
                continue
            array = arrays[name]
            datatype = self._as_made(name, params, array)
            if datatype is None:
                answer.append(request_io.output(self.shm, self.model, RequestedOutput(name, params), array))
                continue
            region = params.get("shared_memory_region")
            if region is None:
                answer.append((datatype, tuple(array.shape), array, None))
                continue
            data = array.tobytes()
            self.shm.write(str(region), int(params.get("shared_memory_offset", 0)),
                           int(params["shared_memory_byte_size"]), data)
            answer.append((datatype, tuple(array.shape), None, len(data)))
        return answer

    def _device_datatype(self, name: str, view: Any) -> str:
        """`request_io.output_on_device`'s datatype, looked up once per output name."""
        datatype = self._datatypes.get(name)
        if datatype is None:
            datatype = self._datatypes[name] = datatype_of_numpy(view.dtype)
        return datatype

    def _as_made(self, name: str, params: dict[str, Any], array: Any) -> str | None:
        """The datatype of output `name` when `request_io.output` would send or write `array` as it is: the
        config's dtype, no reshape, no classification, a region's byte size given. None: request_io's way."""
        dtype = self._host_dtypes.get(name, False)
        if dtype is False:
            spec = self.model.outputs[name]
            dtype = self._host_dtypes[name] = (numpy_dtype(spec.datatype) if spec.model_dims == spec.dims
                                               and spec.datatype != "BYTES" else None)
        if (dtype is None or type(array) is not np.ndarray or array.dtype != dtype
                or not _GROUPED_OUTPUT_PARAMETERS.issuperset(params)
                or ("shared_memory_region" in params and params.get("shared_memory_byte_size") is None)):
            return None
        return self.model.outputs[name].datatype


#: the requested-output parameters a group by reference may carry (grouping.py): what `_Alike` handles itself
_GROUPED_OUTPUT_PARAMETERS = GROUPABLE_OUTPUT_PARAMETERS | SHARED_MEMORY_PARAMETERS


def _requested(asked: Asked) -> list[RequestedOutput]:
    return [RequestedOutput(name, params) for name, params in asked]


def _in_region(shm: SharedMemory, plan: _Input, params: dict[str, Any], batch: int) -> Any:
    """`request_io.input_array` for an alike member's input in a region whose size matches its rows: in place
    where the engine reads it there, else its bytes as an array. None when anything is off (request_io then
    says what)."""
    region = params.get("shared_memory_region")
    size = params.get("shared_memory_byte_size")
    if region is None or size is None or not plan.row_bytes or int(size) != batch * plan.row_bytes:
        return None
    offset, size = int(params.get("shared_memory_offset", 0)), int(size)
    shape = (batch, *plan.tail)
    if plan.in_place:
        view = shm.device_view(str(region), offset, size, shape, plan.dtype, plan.host)
        if view is not None:
            return view
    return np.frombuffer(shm.read(str(region), offset, size), plan.dtype).reshape(shape)


def _finish(done: asyncio.Future, *, answers: _Alike, members: list[_Checked], failed: dict[int, BaseException],
            count: int, started: int, reply: Answer) -> None:
    """The group's job is done: each member's outputs (already in its region, or written to its region now) into
    its answer, statistics recorded, the group answered."""
    model = answers.model
    if done.cancelled():
        reply(None, asyncio.CancelledError())
        return
    try:
        result: JobResult = done.result()
    except Exception as e:  # noqa: BLE001 - the engine refusing the data is the clients' error, all of them
        error = request_io.execution_error(model, e)
        model.statistics.record_failure(time.perf_counter_ns() - started, len(members))
        failed.update((member.index, error) for member in members)
        reply(_results(count, failed), None)
        return
    t0 = time.perf_counter_ns()
    succeeded = items = 0
    answered: list[list[PartOutput] | BaseException] = [failed[i] if i in failed else [] for i in range(count)]
    per_member = cast(list[dict[str, np.ndarray]], result.outputs)  # a job of parts: one dict per member
    for member, outputs in zip(members, per_member):
        try:
            answered[member.index] = answers.outputs(member, outputs)
        except Exception as e:  # noqa: BLE001 - e.g. its output region went away: this member's error
            model.statistics.record_failure(time.perf_counter_ns() - started)
            answered[member.index] = e
            continue
        succeeded += 1
        items += member.batch
    result.times.compute_output_ns = time.perf_counter_ns() - t0
    if succeeded:
        model.statistics.record_success(items, time.perf_counter_ns() - started, result.times, succeeded)
    reply(PartAnswers(model.name, str(model.version), answers.names, answered), None)
