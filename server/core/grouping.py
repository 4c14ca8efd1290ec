"""Requests that a frontend process sends to the core as one: alike in everything but their rows.

Why: the core process serves every frontend on one event-loop thread, and at GPU speeds its cost per message
(decode, checks, queueing, reply, encode) is the server's ceiling (docs/performance.md). A frontend that receives
several requests for the same model in one turn of its event loop, with the same inputs (names, datatypes, shapes
past the batch dim), the same requested outputs and no per-request options, concatenates their inputs along the
batch dim and sends one message; the core queues it as one job and answers with the concatenated outputs, which
the frontend cuts back into one response per request.

What a group does not change: each request still gets its own response, id and rows, and statistics count each
one. What the core does when a group cannot run as one job (a model without dynamic batching or batch dim, more
rows than max_batch_size, tracing on, the in-flight limit nearly reached, a model that caches responses, whose
members are looked up one by one): it runs each member as its own request and answers each one (`MemberResults`).
What it shares: members are validated together (they are alike, so they pass or fail alike) and run in the same
execution (as the dynamic batcher would have run them), so an execution error reaches all of them, as it would
have. The group is one entry in the batcher's queue.

Requests whose tensors are in shared memory group too, by reference: their data is not in the message, so the
frontend sends the group's first request and, per member, only what is its own (`Part`: its id, rows, and its
tensors' regions), and the core resolves each member's regions and runs them as one job of parts
(server/core/part_groups.py). Its answer (`PartAnswers`) holds per member only what the frontend cannot know (each
output's shape and byte size), and the frontend makes each member's response from its own request. Why: whole
requests and responses per member were most of the pickling at both ends for such groups.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .types import InferInput, InferOutput, InferRequest, InferResponse, RequestedOutput

#: request parameters a group may carry (all members equal): the frontends' own, the core ignores them
GROUPABLE_REQUEST_PARAMETERS = frozenset({"binary_data_output"})
#: requested-output parameters a group may carry (all members equal)
GROUPABLE_OUTPUT_PARAMETERS = frozenset({"binary_data"})
#: tensor parameters that name where a tensor is in shared memory: per member, so such requests group by reference
SHARED_MEMORY_PARAMETERS = frozenset({"shared_memory_region", "shared_memory_offset", "shared_memory_byte_size"})


#: how a request (or a group, or a core call) is answered: (value, None) or (None, error)
Answer = Callable[[Any, BaseException | None], None]


def outcome(done: asyncio.Future) -> tuple[Any, BaseException | None]:
    """A finished future as an `Answer`'s arguments: (value, None), (None, error), or (None, CancelledError())."""
    if done.cancelled():
        return None, asyncio.CancelledError()
    error = done.exception()
    return (None, error) if error is not None else (done.result(), None)


def settle(answer: asyncio.Future, value: Any, error: BaseException | None) -> None:
    """Answer a caller's future the way an `Answer` is told, unless the caller gave up meanwhile."""
    if answer.done():
        return
    if error is not None:
        answer.set_exception(error)
    else:
        answer.set_result(value)


@dataclass
class MemberResults:
    """The core's answer to a group it ran as separate requests: per member, in member order, (InferResponse,
    None) or (None, the error it raised), as an `Answer` would have been told."""

    results: list[tuple[Any, BaseException | None]]


#: a member of a group by reference as it crosses to the core: its id, its rows, per input of the group's first
#: request its parameters (a region) or its array, and per requested output its parameters
Part = tuple[str, int, tuple[Any, ...], tuple[dict[str, Any], ...]]

#: one output of a member's answer (`PartAnswers`): (datatype, shape, the array or None, the byte size written to
#: its region or None), or the whole InferOutput where it is not one of the usual kind
PartOutput = tuple[str, tuple[int, ...], Any, Any] | InferOutput


def parts_of(requests: list[InferRequest]) -> list[Part]:
    """Each member of a group by reference (alike in everything `group_key` covers) as its `Part`."""
    return [(r.id, int(r.inputs[0].shape[0]), tuple(t.parameters or t.data for t in r.inputs),
             tuple(o.parameters for o in r.outputs)) for r in requests]


def part_request(first: InferRequest, part: Part) -> InferRequest:
    """A member as the request it was, from the group's first request and its `Part`."""
    request_id, count, tensors, outputs = part
    inputs = [InferInput(t.name, t.datatype, (count, *t.shape[1:]), *((None, v) if type(v) is dict else (v, {})))
              for t, v in zip(first.inputs, tensors)]
    return InferRequest(first.model_name, inputs, first.model_version, request_id,
                        [RequestedOutput(o.name, params) for o, params in zip(first.outputs, outputs)],
                        first.parameters)


@dataclass
class PartAnswers:
    """The core's answer to a group by reference it ran as one job of parts: the names of the outputs every member's
    response holds, in order, and per member (in member order) its `PartOutput`s or its error. The frontend makes
    each response from the member's own request (`responses`): its id, and each output's parameters as it asked,
    with the byte size written."""

    model_name: str
    model_version: str
    names: list[str]
    members: list[list[PartOutput] | BaseException]

    def responses(self, requests: list[InferRequest]) -> list[tuple[Any, BaseException | None]]:
        """Each member's (InferResponse, None) or (None, its error), in member order."""
        results: list[tuple[Any, BaseException | None]] = []
        for request, member in zip(requests, self.members):
            if isinstance(member, BaseException):
                results.append((None, member))
                continue
            asked = {o.name: o.parameters for o in request.outputs} if request.outputs else {}
            outputs = [entry if isinstance(entry, InferOutput) else _part_output(name, entry, asked.get(name))
                       for name, entry in zip(self.names, member)]
            results.append((InferResponse(self.model_name, self.model_version, outputs, request.id), None))
        return results


def _part_output(name: str, entry: tuple, asked: dict[str, Any] | None) -> InferOutput:
    """A `PartOutput` as the InferOutput the core would have made: the parameters asked for, the byte size
    written to its region where it went to one."""
    datatype, shape, data, byte_size = entry
    params = dict(asked) if asked else {}
    if byte_size is not None:
        params["shared_memory_byte_size"] = byte_size
    return InferOutput(name, datatype, shape, data, params)


def group_key(request: InferRequest) -> Hashable | None:
    """What requests must share to be sent as one (None: this one goes alone). Only plain requests group: numeric
    tensors in the message or in shared memory, a batch dim of at least 1 that every input agrees on, and no
    per-request option the core acts on (priority, timeout, classification, raw binary input, a client's trace).
    A key's first item says whether its group goes by reference (`by_reference`)."""
    if request.raw_input is not None or not request.inputs or request.traceparent:
        return None  # a request continuing a client's trace gets spans of its own
    if request.parameters and not GROUPABLE_REQUEST_PARAMETERS.issuperset(request.parameters):
        return None
    rows = None
    signature = []
    referenced = False
    for tensor in request.inputs:
        data, shape = tensor.data, tuple(tensor.shape)
        if tensor.parameters:  # in shared memory: checked against its region by the core, member by member
            if (data is not None or "shared_memory_region" not in tensor.parameters
                    or not SHARED_MEMORY_PARAMETERS.issuperset(tensor.parameters)):
                return None
            referenced = True
            kind = "shm"
        elif type(data) is not np.ndarray or data.dtype.kind not in "biuf" or data.shape != shape:
            return None
        else:
            kind = data.dtype.str
        if not shape:
            return None
        if rows is None:
            rows = shape[0]
        if shape[0] != rows:
            return None
        signature.append((tensor.name, tensor.datatype, shape[1:], kind))
    if not rows:
        return None
    outputs = []
    for output in request.outputs:
        params = output.parameters
        in_region = bool(params) and "shared_memory_region" in params
        if in_region:
            params = {k: v for k, v in params.items() if k not in SHARED_MEMORY_PARAMETERS}
            referenced = True
        if params and not GROUPABLE_OUTPUT_PARAMETERS.issuperset(params):
            return None
        outputs.append((output.name, in_region, tuple(sorted(params.items())) if params else ()))
    return (referenced, request.model_name, request.model_version, tuple(signature), tuple(outputs),
            tuple(sorted(request.parameters.items())) if request.parameters else ())


def by_reference(key: Hashable) -> bool:
    """Whether a group of this key holds tensors in shared memory: its members go as they are, not concatenated."""
    return key[0]  # type: ignore[index,no-any-return]  # group_key's tuple


def rows(request: InferRequest) -> int:
    """A groupable request's batch size (its inputs agree on it: `group_key`)."""
    return int(request.inputs[0].shape[0])


def concatenate(requests: list[InferRequest]) -> InferRequest:
    """One request carrying every member's inputs, concatenated along the batch dim in member order."""
    first = requests[0]
    inputs = []
    for i, tensor in enumerate(first.inputs):
        data = np.concatenate([r.inputs[i].data for r in requests])  # type: ignore[misc]
        inputs.append(InferInput(tensor.name, tensor.datatype, data.shape, data))
    return InferRequest(first.model_name, inputs, first.model_version, "", first.outputs, first.parameters)


def member_request(group: InferRequest, start: int, stop: int, request_id: str = "") -> InferRequest:
    """Member rows start:stop of a concatenated request, as the request it was (views, no copies; a tensor in a
    frontend's arena, tensor_arena.py, as its rows' span of the region)."""
    inputs = [InferInput(t.name, t.datatype, (stop - start, *t.shape[1:]), t.data[start:stop]) if t.data is not None
              else _rows_in_region(t, start, stop) for t in group.inputs]
    return InferRequest(group.model_name, inputs, group.model_version, request_id, group.outputs, group.parameters)


def _rows_in_region(tensor: InferInput, start: int, stop: int) -> InferInput:
    """Rows start:stop of a tensor named by region, offset and byte size."""
    params = tensor.parameters
    row_bytes = int(params["shared_memory_byte_size"]) // tensor.shape[0]
    return InferInput(tensor.name, tensor.datatype, (stop - start, *tensor.shape[1:]), None, {
        "shared_memory_region": params["shared_memory_region"],
        "shared_memory_offset": int(params.get("shared_memory_offset", 0)) + start * row_bytes,
        "shared_memory_byte_size": (stop - start) * row_bytes})


def run_members(group: InferRequest, sizes: list[int],
                submit: Callable[[InferRequest, Answer], asyncio.Future | None],
                reply: Callable[[MemberResults], None]) -> list[asyncio.Future]:
    """Each member of `group` as a request of its own through `submit(request, answer)` (which answers at once
    when it refuses one); `reply` gets every member's result once all are answered. Returns the members' jobs."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return run_requests([member_request(group, start, start + size) for start, size in zip(starts, sizes)],
                        submit, reply)


def run_requests(requests: list[InferRequest], submit: Callable[[InferRequest, Answer], asyncio.Future | None],
                 reply: Callable[[MemberResults], None]) -> list[asyncio.Future]:
    """`run_members` for members given as requests (a group by reference)."""
    results: list[tuple[Any, BaseException | None]] = [(None, None)] * len(requests)
    left = [len(requests)]

    def answered(index: int, response: Any, error: BaseException | None) -> None:
        results[index] = (response, error)
        left[0] -= 1
        if not left[0]:
            reply(MemberResults(results))

    jobs = []
    for index, request in enumerate(requests):
        job = submit(request, functools.partial(answered, index))
        if job is not None:
            jobs.append(job)
    return jobs


def member_answers(value: Any, ids: list[str], sizes: list[int]) -> list[tuple[Any, BaseException | None]]:
    """A group's reply as each member's (response, error), in member order: the core's `MemberResults`, each
    response given its member's id (the core ran them as requests without one), or the group's response cut per
    member (`split_response`, whose ValueError this raises)."""
    if isinstance(value, MemberResults):
        for request_id, (response, _) in zip(ids, value.results):
            if response is not None:
                response.id = request_id
        return value.results
    return [(response, None) for response in split_response(value, sizes, ids)]


def split_response(response: InferResponse, sizes: list[int], ids: list[str]) -> list[InferResponse]:
    """The group's response cut back into one response per member (views of its rows). Every output of a model
    that batches starts with the batch dim; an output that does not (it cannot be cut) raises ValueError."""
    total = sum(sizes)
    for output in response.outputs:
        if output.data is None or not output.shape or output.shape[0] != total:
            raise ValueError(f"output '{output.name}' of shape {list(output.shape)} cannot be split into requests "
                             f"of {sizes} rows")
    members = []
    start = 0
    for size, request_id in zip(sizes, ids):
        outputs = [InferOutput(o.name, o.datatype, (size, *o.shape[1:]), o.data[start:start + size],  # type: ignore[index]
                               dict(o.parameters) if o.parameters else {}) for o in response.outputs]
        members.append(InferResponse(response.model_name, response.model_version, outputs, request_id,
                                     dict(response.parameters)))
        start += size
    return members
