"""Groups by reference as they cross between a frontend process and the core (server/core/grouping.py `Part`,
`PartAnswers`), the core's checks of the members after the first (server/core/part_groups.py `_Alike`), and the
answers of one batch reaching a frontend together.

What must hold: a member rebuilt from its part is the request it was; a response made by the frontend from a
`PartAnswers` is the one the core would have made; the lean checks of alike members give the full checks' inputs,
in-place outputs and errors (in host memory, and by reference for an executor process); members' own output errors
stay theirs; every answer of one batch to one frontend arrives in one frame.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from onnx import TensorProto

from server.core import CoreOptions, ServerCore, cuda_ipc, part_groups, request_io
from server.core.errors import ErrorKind, ServerError
from server.core.grouping import PartAnswers, part_request, parts_of
from server.core.model import TensorSpec
from server.core.types import InferInput, InferOutput, InferRequest, InferResponse, RequestedOutput

from . import test_request_groups as groups
from .conftest import examples
from .test_request_groups import _fill, _in_region, _read, _request, _serve

repository, region = groups.repository, groups.region  # the same fixtures: the model and a region of 8 members


def test_a_member_rebuilt_from_its_part_is_the_request_it_was():
    members = [_in_region(i, rows=1 + i % 2) for i in range(3)]
    members[2].inputs[1] = InferInput("INPUT1", "FP32", (1, 16), np.ones((1, 16), np.float32))  # inline, rows 1
    members[2].inputs[0].shape = (1, 16)
    parts = parts_of(members)
    assert [p[:2] for p in parts] == [("m0", 1), ("m1", 2), ("m2", 1)]
    for member, part in zip(members[:2], parts[:2]):
        assert part_request(members[0], part) == member
    rebuilt = part_request(members[0], parts[2])
    np.testing.assert_array_equal(rebuilt.inputs[1].data, members[2].inputs[1].data)
    assert rebuilt.inputs[1].parameters == {} and rebuilt.inputs[0] == members[2].inputs[0]
    assert rebuilt.outputs == members[2].outputs and rebuilt.id == "m2"
    everything = InferRequest("batched", members[0].inputs, id="all")  # no outputs named: all of them, no parameters
    assert part_request(everything, parts_of([everything])[0]) == everything


def test_responses_made_from_part_answers_are_the_core_s():
    members = [_in_region(0), _in_region(1, rows=2), _in_region(2)]
    members[2].outputs[1].parameters["binary_data"] = True
    data = np.arange(16, dtype=np.float32).reshape(1, 16)
    answers = PartAnswers("batched", "1", ["OUTPUT0", "OUTPUT1"], [
        [("FP32", (1, 16), None, 64), ("FP32", (1, 16), None, 64)],
        ServerError(ErrorKind.INVALID_ARGUMENT, "its own"),
        [("FP32", (1, 16), None, 64), InferOutput("OUTPUT1", "BYTES", (1, 2), data, {"whole": 1})]])
    (first, none), (nothing, error), (third, _) = answers.responses(members)
    assert none is None and nothing is None and error.message == "its own"
    written = {**members[0].outputs[0].parameters, "shared_memory_byte_size": 64}
    assert first == InferResponse("batched", "1", [InferOutput("OUTPUT0", "FP32", (1, 16), None, written),
                                                   InferOutput("OUTPUT1", "FP32", (1, 16), None,
                                                               {**members[0].outputs[1].parameters})], "m0")
    assert third.id == "m2" and third.outputs[1].parameters == {"whole": 1}  # sent whole: as it is
    plain = PartAnswers("batched", "1", ["OUTPUT0"], [[("FP32", (1, 16), data, None)]])
    (response, _), = plain.responses([InferRequest("batched", [], id="x")])  # asked for nothing: all, no parameters
    assert response.outputs[0].parameters == {} and response.outputs[0].data is data


def test_outputs_written_in_place_are_those_the_engine_makes_as_the_config_says():
    """`request_io.writes_in_place`, the rule `output_views` and `_Alike` share: no reshape, a size that follows
    from the shape (not BYTES), and the engine's own dtype (nothing to convert on the host)."""
    specs = {"plain": ("FP32", (16,)), "reshaped": ("FP32", (4, 4)), "text": ("BYTES", (16,)), "cast": ("FP16", (16,))}
    outputs = {name: TensorSpec(name, datatype, dims, (16,)) for name, (datatype, dims) in specs.items()}
    model = SimpleNamespace(outputs=outputs, engine_output_dtype=lambda name: np.dtype(
        object if name == "text" else np.float32))
    assert [name for name in specs if request_io.writes_in_place(model, name)] == ["plain"]


def _core(repository: Path):
    return ServerCore(CoreOptions([str(repository)], model_control_mode="explicit", startup_models=["batched"],
                                  allow_client_shm=True))


def _compare_checks(core, segment) -> None:
    """Every member checked both ways: the lean `_Alike.check` and the full check give the same result."""
    model = core._version("batched")
    good = [_in_region(i, rows=1 + i % 2) for i in range(6)]
    for member in good:
        _fill(segment, member)
    small, outside, unknown, no_size, output_small = (_in_region(i) for i in range(5))
    small.inputs[0].parameters["shared_memory_byte_size"] = 8
    outside.inputs[1].parameters["shared_memory_offset"] = segment.size
    unknown.inputs[0].parameters["shared_memory_region"] = "nowhere"
    del no_size.outputs[1].parameters["shared_memory_byte_size"]
    output_small.outputs[0].parameters["shared_memory_byte_size"] = 4
    members = [*good, small, outside, unknown, no_size, output_small]
    parts = parts_of(members)
    full = part_groups._full_check(core, model, 0, members[0])
    alike = part_groups._Alike(core, model, members[0], full)
    for index, (member, part) in enumerate(zip(members, parts)):
        try:
            expected = part_groups._full_check(core, model, index, member)
        except ServerError as e:
            with pytest.raises(ServerError) as raised:
                alike.check(index, part)
            assert raised.value.message == e.message
            continue
        got = alike.check(index, part)
        assert (got.index, got.batch, got.asked, got.destinations) == (
            expected.index, expected.batch, expected.asked, expected.destinations)
        assert got.inputs.keys() == expected.inputs.keys()
        for name, value in got.inputs.items():
            if isinstance(value, np.ndarray):
                np.testing.assert_array_equal(value, expected.inputs[name])
            else:
                assert value == expected.inputs[name]


def test_alike_members_are_checked_as_the_full_check_would(repository: Path, region):
    async def go():
        core = _core(repository)
        await core.start()
        await core.wait_for_startup()
        try:
            await core.register_system_shared_memory("r", f"/{region.name}", 0, region.size)
            _compare_checks(core, region)
        finally:
            await core.stop()

    asyncio.run(go())


def _checks_and_a_group_by_reference(repository: Path, segment, backend: str = "") -> None:
    """`_compare_checks`, then a group run by `submit_infer_parts`: every member's outputs in its own region."""
    members = [_in_region(i, rows=1 + i % 2) for i in range(5)]

    async def go():
        core = _core(repository)
        await core.start()
        await core.wait_for_startup()
        try:
            model = core._version("batched")
            assert backend in ("", model.engine.backend) and model.scheduler.gathers_parts
            await core.register_system_shared_memory("r", f"/{segment.name}", 0, segment.size)
            _compare_checks(core, segment)
            data = [_fill(segment, m) for m in members]  # _compare_checks wrote over the inputs
            answered = asyncio.get_running_loop().create_future()
            core.submit_infer_parts(members[0], parts_of(members), lambda v, e: answered.set_result((v, e)))
            value, error = await answered
            assert error is None and isinstance(value, PartAnswers)
            for (response, failure), member, (a, b) in zip(value.responses(members), members, data):
                assert failure is None and response.id == member.id
                assert response.outputs[0].parameters["shared_memory_byte_size"] == a.nbytes
                np.testing.assert_allclose(_read(segment, member.outputs[0], a.shape), a + b, rtol=1e-6)
                np.testing.assert_allclose(_read(segment, member.outputs[1], a.shape), a - b, rtol=1e-6)
            stats = (await core.model_statistics("batched"))["model_stats"][0]
            assert stats["inference_stats"]["success"]["count"] == 5 and stats["execution_count"] == 1
            return bool(model.executors)
        finally:
            await core.stop()

    return asyncio.run(go())


def test_alike_members_for_an_executor_are_checked_as_the_full_check_would(repository: Path, region,
                                                                          monkeypatch):
    """In an executor process the model takes region tensors by reference: inputs and outputs as views."""
    monkeypatch.setenv("KILN_EXECUTOR", "process")
    monkeypatch.setenv("KILN_EXECUTOR_CPU", "1")
    assert _checks_and_a_group_by_reference(repository, region)


@pytest.fixture(scope="module")
def cuda_repository(tmp_path_factory) -> Path:
    """The add/sub model that batches, on the GPU."""
    root = tmp_path_factory.mktemp("cuda_groups")
    config = groups._CONFIG.format(name="batched", batching="dynamic_batching { max_queue_delay_microseconds: 2000 }")
    examples.write_model(root, "batched", examples.add_sub_model(TensorProto.FLOAT), config.replace("KIND_CPU", "KIND_GPU"))
    return root


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_ipc.available(), reason="needs a CUDA device")
@pytest.mark.parametrize("executor", ["process", "thread"])
def test_alike_members_of_a_cuda_model_are_checked_as_the_full_check_would(cuda_repository: Path, region,
                                                                          monkeypatch, executor: str):
    """On the GPU: page-locked system regions read and written in place by the device (views in the core, region
    references for an executor process), the lean checks and the full ones alike, a group's outputs right."""
    monkeypatch.setenv("KILN_EXECUTOR", executor)
    assert _checks_and_a_group_by_reference(cuda_repository, region, "cuda") == (executor == "process")


def test_a_member_s_output_errors_are_its_own(repository: Path, tmp_path: Path, region):
    members = [_in_region(i) for i in range(4)]
    data = [_fill(region, m) for m in members]
    members[1].outputs[0].parameters["shared_memory_byte_size"] = 4  # too small for its 64 bytes
    del members[2].outputs[1].parameters["shared_memory_byte_size"]
    members[3].outputs[1].parameters["shared_memory_region"] = "gone"

    async def scenario(core, remote, service):
        await core.register_system_shared_memory("r", f"/{region.name}", 0, region.size)
        first, small, sizeless, gone = await asyncio.gather(*(remote.infer(m) for m in members),
                                                           return_exceptions=True)
        np.testing.assert_array_equal(_read(region, members[0].outputs[0], (1, 16)), data[0][0] + data[0][1])
        assert first.outputs[0].parameters["shared_memory_byte_size"] == 64
        assert isinstance(small, ServerError) and "64 bytes" in small.message  # the host or the device path says
        assert isinstance(sizeless, ServerError) and "shared_memory_byte_size is required" in sizeless.message
        assert isinstance(gone, ServerError) and "'gone'" in gone.message
        stats = (await core.model_statistics("batched"))["model_stats"][0]
        assert stats["inference_stats"]["success"]["count"] == 1 and stats["inference_stats"]["fail"]["count"] == 3
        assert service.limiter.count == 0

    _serve(repository, tmp_path, scenario)


def test_a_batch_s_answers_reach_a_frontend_in_one_frame(repository: Path, tmp_path: Path):
    """Two groups sent in different turns of the frontend's loop run in one batch (the model waits 2 ms for
    more): the core answers both in one frame, so the frontend settles every member in one turn."""
    first = [_request(float(i), request_id=f"a{i}") for i in range(2)]
    second = [_request(float(i), request_id=f"b{i}") for i in range(2)]

    async def scenario(core, remote, service):
        frames: list[int] = []
        decoder = remote._connection._decoder
        deliver = decoder.on_message
        decoder.on_message = lambda messages: (frames.append(len(messages)), deliver(messages))
        calls = [asyncio.ensure_future(remote.infer(r)) for r in first]
        for _ in range(3):  # the first group leaves with this turn
            await asyncio.sleep(0)
        calls += [asyncio.ensure_future(remote.infer(r)) for r in second]
        responses = await asyncio.gather(*calls)
        assert [r.id for r in responses] == ["a0", "a1", "b0", "b1"]
        stats = (await core.model_statistics("batched"))["model_stats"][0]
        assert stats["execution_count"] == 1 and stats["inference_stats"]["success"]["count"] == 4
        assert frames[0] == 2  # both groups' replies, one frame

    _serve(repository, tmp_path, scenario)


def test_members_asking_for_every_output_get_them_as_arrays(repository: Path, tmp_path: Path, region):
    members = [_in_region(i, output=False) for i in range(3)]
    data = [_fill(region, m) for m in members]

    async def scenario(core, remote, service):
        await core.register_system_shared_memory("r", f"/{region.name}", 0, region.size)
        responses = await asyncio.gather(*(remote.infer(m) for m in members))
        for response, (a, b) in zip(responses, data):
            outputs = {o.name: o for o in response.outputs}
            np.testing.assert_array_equal(outputs["OUTPUT0"].data, a + b)
            np.testing.assert_array_equal(outputs["OUTPUT1"].data, a - b)
            assert outputs["OUTPUT0"].parameters == {} and outputs["OUTPUT0"].datatype == "FP32"
        stats = (await core.model_statistics("batched"))["model_stats"][0]
        assert stats["execution_count"] == 1

    _serve(repository, tmp_path, scenario)


def test_members_in_one_group_may_ask_for_outputs_back_as_data(repository: Path, tmp_path: Path,
                                                               region):
    members = [_in_region(i) for i in range(3)]
    for member in members:
        member.outputs[1] = RequestedOutput("OUTPUT1", {"binary_data": True})
    data = [_fill(region, m) for m in members]

    async def scenario(core, remote, service):
        await core.register_system_shared_memory("r", f"/{region.name}", 0, region.size)
        responses = await asyncio.gather(*(remote.infer(m) for m in members))
        for response, member, (a, b) in zip(responses, members, data):
            np.testing.assert_array_equal(_read(region, member.outputs[0], a.shape), a + b)
            assert response.outputs[1].parameters == {"binary_data": True}
            np.testing.assert_array_equal(response.outputs[1].data, a - b)

    _serve(repository, tmp_path, scenario)
