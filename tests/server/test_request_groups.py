"""A frontend process's alike requests go to the core as one message (server/core/grouping.py), and so do those
that reach the server process's own frontends in one turn of its event loop (server/core/turn_groups.py).

The rules first (which requests may group, cutting a group's response back), then a real `ServerCore` served by
`CoreService` and called through `RemoteCore` on one event loop, as a frontend process calls it: concurrent
requests come back with their own rows and ids, statistics count each request, and groups the core cannot run as
one job (too many rows, a model without dynamic batching, tracing on, the in-flight limit) still answer every
member on its own.
"""

from __future__ import annotations

import asyncio
import functools
import gc
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto

from server.core import CoreOptions, ServerCore
from server.core.errors import ErrorKind, ServerError
from server.core.grouping import by_reference, concatenate, group_key, settle, split_response
from server.core.limits import InflightLimiter
from server.core.remote import CoreService, RemoteCore
from server.core.turn_groups import TurnGroups
from server.core.types import InferInput, InferOutput, InferRequest, InferResponse, RequestedOutput

from .conftest import examples

_CONFIG = """name: "{name}"
max_batch_size: 8
input [
  {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] }},
  {{ name: "INPUT1" data_type: TYPE_FP32 dims: [ 16 ] }}
]
output [
  {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] }},
  {{ name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 16 ] }}
]
{batching}
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
"""


def _request(value: float, rows: int = 1, request_id: str = "", model: str = "batched", **extra) -> InferRequest:
    a = np.full((rows, 16), value, np.float32)
    b = np.arange(16, dtype=np.float32) * np.ones((rows, 1), np.float32)
    return InferRequest(model, [InferInput("INPUT0", "FP32", a.shape, a), InferInput("INPUT1", "FP32", b.shape, b)],
                        id=request_id, **extra)


def test_only_plain_alike_requests_share_a_key():
    key = group_key(_request(1.0))
    assert key is not None and key == group_key(_request(2.0, request_id="other"))
    assert group_key(_request(1.0, rows=3)) == key  # rows are what members may differ in
    assert group_key(_request(1.0, model="other")) != key
    assert group_key(_request(1.0, parameters={"binary_data_output": True})) not in (None, key)
    for request in (_request(1.0, parameters={"priority": 1}), _request(1.0, parameters={"timeout": 5}),
                    _request(1.0, outputs=[RequestedOutput("OUTPUT0", {"classification": 2})]),
                    InferRequest("batched", [], raw_input=b"1234")):
        assert group_key(request) is None
    disagreeing = _request(1.0)
    disagreeing.inputs[1] = InferInput("INPUT1", "FP32", (2, 16), np.zeros((2, 16), np.float32))
    assert group_key(disagreeing) is None  # inputs that disagree on the batch size get their own error
    strings = InferRequest("batched", [InferInput("S", "BYTES", (1,), np.array([b"x"], dtype=object))])
    assert group_key(strings) is None


def _in_region(index: int, rows: int = 1, region: str = "r", output: bool = True) -> InferRequest:
    """Member `index` of a group whose inputs (and outputs) are in shared memory: its own slice of `region`."""
    size, slot = rows * 16 * 4, 2 * 16 * 4  # a slot of up to 2 rows per tensor
    inputs = [InferInput(name, "FP32", (rows, 16), None, {"shared_memory_region": region,
                                                           "shared_memory_offset": (4 * index + k) * slot,
                                                           "shared_memory_byte_size": size})
              for k, name in enumerate(("INPUT0", "INPUT1"))]
    outputs = [RequestedOutput(name, {"shared_memory_region": region, "shared_memory_offset": (4 * index + 2 + k) * slot,
                                      "shared_memory_byte_size": size})
               for k, name in enumerate(("OUTPUT0", "OUTPUT1"))] if output else []
    return InferRequest("batched", inputs, id=f"m{index}", outputs=outputs)


def test_requests_in_shared_memory_group_by_reference():
    key = group_key(_in_region(0))
    assert key is not None and by_reference(key) and not by_reference(group_key(_request(1.0)))
    assert group_key(_in_region(1)) == key and group_key(_in_region(1, region="other")) == key  # regions are per member
    assert group_key(_in_region(1, rows=2)) == key
    assert group_key(_in_region(1, output=False)) not in (None, key)  # outputs in the response: another group
    odd = _in_region(0)
    odd.inputs[0].parameters["shared_memory_extra"] = 1
    assert group_key(odd) is None
    both = _in_region(0)
    both.inputs[0].data = np.zeros((1, 16), np.float32)
    assert group_key(both) is None  # data and a region: the core's error, for this request alone


def test_a_group_response_is_cut_back_per_member():
    members = [_request(1.0, rows=1, request_id="a"), _request(2.0, rows=3, request_id="b")]
    group = concatenate(members)
    assert group.inputs[0].shape == (4, 16) and group.id == ""
    out = np.arange(4 * 16, dtype=np.float32).reshape(4, 16)
    response = InferResponse("batched", "1", [InferOutput("OUTPUT0", "FP32", out.shape, out, {"binary_data": True})])
    first, second = split_response(response, [1, 3], ["a", "b"])
    assert (first.id, second.id) == ("a", "b")
    np.testing.assert_array_equal(first.outputs[0].data, out[:1])
    np.testing.assert_array_equal(second.outputs[0].data, out[1:])
    assert second.outputs[0].shape == (3, 16) and second.outputs[0].parameters == {"binary_data": True}
    with pytest.raises(ValueError, match="cannot be split"):
        split_response(response, [1, 1], ["a", "b"])


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    make = examples
    root = tmp_path_factory.mktemp("groups")
    make.write_model(root, "batched", make.add_sub_model(TensorProto.FLOAT),
                     _CONFIG.format(name="batched", batching="dynamic_batching { max_queue_delay_microseconds: 2000 }"))
    make.write_model(root, "unbatched", make.add_sub_model(TensorProto.FLOAT),
                     _CONFIG.format(name="unbatched", batching=""))
    return root


def _serve(repository: Path, tmp_path: Path, scenario, limit: int = 0):
    """Run `scenario(core, remote, service)` against a real core behind a core service, on one event loop."""

    async def go():
        core = ServerCore(CoreOptions([str(repository)], model_control_mode="explicit",
                                      startup_models=["batched", "unbatched"], allow_client_shm=True))
        await core.start()
        await core.wait_for_startup()
        service = CoreService(core, str(tmp_path / "core.sock"), InflightLimiter(limit))
        await service.start()
        remote = RemoteCore(service.path)
        await remote.connect()
        try:
            return await scenario(core, remote, service)
        finally:
            await remote.close()
            await service.stop()
            await core.stop()

    return asyncio.run(go())


def _check(responses, requests) -> None:
    for response, request in zip(responses, requests):
        a, b = (t.data for t in request.inputs)
        assert response.id == request.id
        outputs = {o.name: o for o in response.outputs}
        np.testing.assert_array_equal(outputs["OUTPUT0"].data, a + b)
        np.testing.assert_array_equal(outputs["OUTPUT1"].data, a - b)
        assert tuple(outputs["OUTPUT0"].shape) == a.shape


def test_concurrent_requests_get_their_own_rows_ids_and_statistics(repository: Path, tmp_path: Path):
    requests = [_request(float(i), rows=1 + i % 2, request_id=f"r{i}") for i in range(5)]  # 7 rows: one batch

    async def scenario(core, remote, service):
        responses = await asyncio.gather(*(remote.infer(r) for r in requests))
        _check(responses, requests)
        stats = (await core.model_statistics("batched"))["model_stats"][0]
        assert stats["inference_stats"]["success"]["count"] == len(requests)
        assert stats["inference_count"] == 7
        assert stats["execution_count"] == 1  # one loop turn, one group, one execution
        assert service.limiter.count == 0

    _serve(repository, tmp_path, scenario)


def test_groups_the_core_cannot_run_as_one_job_answer_each_member(repository: Path, tmp_path: Path):
    too_many = [_request(float(i), rows=3, request_id=f"big{i}") for i in range(4)]  # 12 rows > max batch 8
    unbatched = [_request(float(i), request_id=f"u{i}", model="unbatched") for i in range(3)]

    async def scenario(core, remote, service):
        _check(await asyncio.gather(*(remote.infer(r) for r in too_many)), too_many)
        _check(await asyncio.gather(*(remote.infer(r) for r in unbatched)), unbatched)
        stats = (await core.model_statistics("unbatched"))["model_stats"][0]
        assert stats["inference_stats"]["success"]["count"] == 3 and stats["execution_count"] == 3
        trace = tmp_path / "trace.json"
        await core.trace_settings(updates={"trace_file": str(trace), "trace_level": ["TIMESTAMPS"], "trace_rate": "1"})
        traced = [_request(float(i), request_id=f"t{i}") for i in range(3)]
        _check(await asyncio.gather(*(remote.infer(r) for r in traced)), traced)
        assert len(trace.read_text().splitlines()) == 3  # one trace per request, not per group

    _serve(repository, tmp_path, scenario)


def test_a_group_near_the_inflight_limit_admits_its_members_one_by_one(repository: Path, tmp_path: Path):
    requests = [_request(float(i), request_id=f"r{i}") for i in range(3)]

    async def scenario(core, remote, service):
        results = await asyncio.gather(*(remote.infer(r) for r in requests), return_exceptions=True)
        refused = [r for r in results if isinstance(r, ServerError)]
        assert len(refused) == 1 and refused[0].kind == ErrorKind.RESOURCE_EXHAUSTED
        _check([r for r in results if not isinstance(r, Exception)], requests[:2])
        assert service.limiter.count == 0

    _serve(repository, tmp_path, scenario, limit=2)


def test_errors_reach_every_member_and_withdrawn_groups_leave_the_queue(repository: Path, tmp_path: Path):
    async def scenario(core, remote, service):
        wrong = [InferRequest("batched", [InferInput("INPUT0", "FP32", (1, 16), np.zeros((1, 16), np.float32))],
                              id=f"w{i}") for i in range(3)]
        results = await asyncio.gather(*(remote.infer(r) for r in wrong), return_exceptions=True)
        assert all(isinstance(r, ServerError) and r.kind == ErrorKind.INVALID_ARGUMENT for r in results)
        missing = await asyncio.gather(*(remote.infer(_request(1.0, model="nope")) for _ in range(2)),
                                       return_exceptions=True)
        assert all(isinstance(r, ServerError) and r.kind == ErrorKind.NOT_FOUND for r in missing)
        waiting = [asyncio.ensure_future(remote.infer(_request(float(i)))) for i in range(3)]
        while core.models["batched"].latest().scheduler.pending()[1] == 0:  # queued for the 2 ms batching delay
            await asyncio.sleep(0)
        for task in waiting:
            task.cancel()
        for _ in range(200):
            if core.models["batched"].latest().scheduler.pending()[1] == 0 and service.limiter.count == 0:
                break
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.02)  # well past the batching delay: a group still queued would have run by now
        stats = (await core.model_statistics("batched"))["model_stats"][0]
        assert service.limiter.count == 0 and stats["execution_count"] == 0  # withdrawn, never run

    _serve(repository, tmp_path, scenario)


# -- the server process's own frontends: TurnGroups (server/core/turn_groups.py) ---------------------------------

def _in_process(repository: Path, scenario):
    """Run `scenario(core, turns)` with a real core and the grouping the server process's frontends submit through."""

    async def go():
        core = ServerCore(CoreOptions([str(repository)], model_control_mode="explicit",
                                      startup_models=["batched", "unbatched"]))
        await core.start()
        await core.wait_for_startup()
        try:
            return await scenario(core, TurnGroups(core))
        finally:
            await core.stop()

    return asyncio.run(go())


def _submit(turns: TurnGroups, request: InferRequest) -> tuple[asyncio.Future, object]:
    answer = asyncio.get_running_loop().create_future()
    return answer, turns.submit_infer(request, functools.partial(settle, answer))


async def _answers(turns: TurnGroups, requests: list[InferRequest]) -> list:
    futures = [_submit(turns, r)[0] for r in requests]
    return await asyncio.gather(*futures, return_exceptions=True)


def test_one_turns_alike_requests_run_as_one_job_cut_to_the_max_batch(repository: Path):
    requests = [_request(float(i), rows=1 + i % 2, request_id=f"r{i}") for i in range(5)]  # 7 rows: one job
    big = [_request(float(i), rows=3, request_id=f"b{i}") for i in range(4)]  # 12 rows: runs of <= 8

    async def scenario(core, turns):
        _check(await _answers(turns, requests), requests)
        stats = (await core.model_statistics("batched"))["model_stats"][0]
        assert stats["inference_stats"]["success"]["count"] == 5 and stats["inference_count"] == 7
        assert stats["execution_count"] == 1
        _check(await _answers(turns, big), big)
        stats = (await core.model_statistics("batched"))["model_stats"][0]
        assert stats["inference_count"] == 7 + 12 and stats["execution_count"] == 1 + 2
        unbatched = [_request(float(i), request_id=f"u{i}", model="unbatched") for i in range(3)]
        _check(await _answers(turns, unbatched), unbatched)  # no dynamic batcher: one by one, as before
        stats = (await core.model_statistics("unbatched"))["model_stats"][0]
        assert stats["execution_count"] == 3

    _in_process(repository, scenario)


def test_a_refused_group_gives_each_request_its_own_words(repository: Path):
    def wrong(rows: int, request_id: str) -> InferRequest:
        data = np.zeros((rows, 17), np.float32)  # 17 columns where the model takes 16
        return InferRequest("batched", [InferInput("INPUT0", "FP32", data.shape, data),
                                        InferInput("INPUT1", "FP32", data.shape, data)], id=request_id)

    async def scenario(core, turns):
        alone = []
        for rows in (1, 2):
            answer = asyncio.get_running_loop().create_future()
            core.submit_infer(wrong(rows, "x"), functools.partial(settle, answer))
            alone.append(str(await asyncio.gather(answer, return_exceptions=True)))
        grouped = await _answers(turns, [wrong(1, "a"), wrong(2, "b")])
        assert [str([g]) for g in grouped] == alone  # [1, 17] and [2, 17], not the group's [3, 17]
        assert "1, 17" in alone[0] and "2, 17" in alone[1], alone

    _in_process(repository, scenario)


def test_withdrawn_members_hear_cancelled_and_a_withdrawn_group_never_runs(repository: Path):
    async def scenario(core, turns):
        answers = [_submit(turns, _request(float(i), request_id=f"r{i}")) for i in range(3)]
        assert answers[0][1].cancel()  # before the turn ends: it never reaches the core
        results = await asyncio.gather(*(a for a, _ in answers), return_exceptions=True)
        assert isinstance(results[0], asyncio.CancelledError)
        _check(results[1:], [_request(float(i), request_id=f"r{i}") for i in (1, 2)])
        queued = [_submit(turns, _request(float(i))) for i in range(3)]
        while core.models["batched"].latest().scheduler.pending()[1] == 0:  # the group waits its 2 ms delay
            await asyncio.sleep(0)
        for _, handle in queued:
            handle.cancel()
        await asyncio.sleep(0.02)
        stats = (await core.model_statistics("batched"))["model_stats"][0]
        assert stats["execution_count"] == 1  # the first group's; the withdrawn one never ran
        assert all(a.cancelled() or isinstance(a.exception(), asyncio.CancelledError) for a, _ in queued)

    _in_process(repository, scenario)


def test_answered_requests_leave_no_cycles_for_the_collector(repository: Path):
    """A request's objects (its member, group, caller's callback) go with reference counting once it is answered:
    cyclic garbage per request made the collector run every few hundred requests, pausing the event loop."""
    async def scenario(core, turns):
        requests = [_request(float(i), request_id=f"r{i}") for i in range(6)]
        _check(await _answers(turns, requests), requests)  # warm: lazily made objects exist from here on
        gc.collect()
        gc.disable()
        try:
            for _ in range(5):
                _check(await _answers(turns, requests), requests)
            return gc.collect()
        finally:
            gc.enable()

    assert _in_process(repository, scenario) == 0


@pytest.fixture
def region():
    """A system shared-memory segment of 8 members' inputs and outputs (4 tensors of up to 2 rows each)."""
    segment = shared_memory.SharedMemory(create=True, size=8 * 4 * 2 * 16 * 4)
    try:
        yield segment
    finally:
        segment.close()
        segment.unlink()


def _fill(segment, request: InferRequest) -> tuple[np.ndarray, np.ndarray]:
    a, b = (np.random.default_rng(len(request.id) + int(request.id[1:])).random(t.shape, np.float32)
            for t in request.inputs)
    for tensor, data in zip(request.inputs, (a, b)):
        offset = tensor.parameters["shared_memory_offset"]
        segment.buf[offset:offset + data.nbytes] = data.tobytes()
    return a, b


def _read(segment, output: RequestedOutput, shape) -> np.ndarray:
    offset = output.parameters["shared_memory_offset"]
    return np.frombuffer(segment.buf, np.float32, int(np.prod(shape)), offset).reshape(shape).copy()


def test_a_group_in_shared_memory_runs_as_one_job_and_each_member_reads_its_own_region(
        repository: Path, tmp_path: Path, region):
    members = [_in_region(i, rows=1 + i % 2) for i in range(5)]  # 7 rows: one batch
    data = [_fill(region, m) for m in members]
    broken = _in_region(5)
    broken.inputs[1].parameters["shared_memory_region"] = "unregistered"

    async def scenario(core, remote, service):
        await core.register_system_shared_memory("r", f"/{region.name}", 0, region.size)
        responses = await asyncio.gather(*(remote.infer(m) for m in [*members, broken]), return_exceptions=True)
        error = responses.pop()
        assert isinstance(error, ServerError) and "unregistered" in str(error)  # that member's own error
        for response, member, (a, b) in zip(responses, members, data):
            assert response.id == member.id
            outputs = {o.name: o for o in response.outputs}
            assert outputs["OUTPUT0"].data is None and tuple(outputs["OUTPUT0"].shape) == a.shape
            assert outputs["OUTPUT0"].parameters["shared_memory_region"] == "r"
            np.testing.assert_array_equal(_read(region, member.outputs[0], a.shape), a + b)
            np.testing.assert_array_equal(_read(region, member.outputs[1], a.shape), a - b)
        stats = (await core.model_statistics("batched"))["model_stats"][0]
        assert stats["inference_stats"]["success"]["count"] == 5 and stats["inference_count"] == 7
        assert stats["inference_stats"]["fail"]["count"] == 1
        assert stats["execution_count"] == 1  # one message, one job of parts, one execution
        assert service.limiter.count == 0

    _serve(repository, tmp_path, scenario)


def test_a_group_in_shared_memory_over_max_batch_runs_member_by_member(repository: Path, tmp_path: Path, region):
    members = [_in_region(i, rows=2) for i in range(5)]  # 10 rows > max batch 8
    data = [_fill(region, m) for m in members]

    async def scenario(core, remote, service):
        await core.register_system_shared_memory("r", f"/{region.name}", 0, region.size)
        responses = await asyncio.gather(*(remote.infer(m) for m in members))
        for response, member, (a, b) in zip(responses, members, data):
            assert response.id == member.id
            np.testing.assert_array_equal(_read(region, member.outputs[0], a.shape), a + b)
        stats = (await core.model_statistics("batched"))["model_stats"][0]
        assert stats["inference_stats"]["success"]["count"] == 5 and stats["inference_count"] == 10

    _serve(repository, tmp_path, scenario)


def test_members_after_the_first_are_checked_for_what_is_their_own(repository: Path, tmp_path: Path, region):
    """A member alike the first that passed its check still has its own region sizes and rows checked."""
    members = [_in_region(i) for i in range(3)]
    data = [_fill(region, m) for m in members]
    members[1].inputs[0].parameters["shared_memory_byte_size"] = 8  # too small for [1, 16] FP32
    members[2].inputs[1].parameters["shared_memory_offset"] = region.size  # past the region's end

    async def scenario(core, remote, service):
        await core.register_system_shared_memory("r", f"/{region.name}", 0, region.size)
        first, small, outside = await asyncio.gather(*(remote.infer(m) for m in members), return_exceptions=True)
        np.testing.assert_array_equal(_read(region, members[0].outputs[0], data[0][0].shape), data[0][0] + data[0][1])
        for error in (small, outside):
            assert isinstance(error, ServerError) and error.kind == ErrorKind.INVALID_ARGUMENT
        assert "expected 64 bytes for FP32 [1, 16], got 8" in str(small)
        assert "is outside its" in str(outside)
        stats = (await core.model_statistics("batched"))["model_stats"][0]
        assert stats["inference_stats"]["success"]["count"] == 1 and stats["inference_stats"]["fail"]["count"] == 2

    _serve(repository, tmp_path, scenario)
