"""Instance placement on several GPUs (server/core/placement.py), without a GPU: the normalisation of instance groups
(Triton's: KIND_AUTO / KIND_GPU without gpus -> every visible GPU), the refusals with their reasons, the executors'
CUDA_VISIBLE_DEVICES and `kiln serve --gpus`. The devices are injected. The last tests load a model whose executions
run in two CPU executor processes (KILN_EXECUTOR_CPU=1): the lanes of both serve, and a killed one restarts alone.
tests/server/test_multi_gpu.py runs the same on two GPUs.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto

from server import plan_cache
from server.cli import restrict_gpus
from server.core import executor, placement
from server.core.errors import ServerError
from server.core.model_config import ModelConfig, parse_config_text
from server.core.placement import (
    Devices,
    Placement,
    child_visible_devices,
    place_instances,
    restricted_visible_devices,
)
from server.core.types import InferInput, InferRequest
from server.protos import model_config_pb2

from .conftest import examples

KIND = model_config_pb2.ModelInstanceGroup


def _devices(count: int, archs: dict[int, str] | None = None):
    return lambda: Devices(count, lambda ordinal: (archs or {}).get(ordinal, "sm_90"))


def _config(groups: str) -> ModelConfig:
    """A config whose groups are completed as `complete_config` leaves them (named, count >= 1)."""
    config = parse_config_text(f'name: "m"\nmax_batch_size: 8\ninstance_group [ {groups} ]', "m")
    for index, group in enumerate(config.instance_group):
        group.name = group.name or f"m_{index}"
        group.count = group.count or 1
    return config


def _groups(config: ModelConfig) -> list[tuple[str, list[int]]]:
    return [(KIND.Kind.Name(group.kind), list(group.gpus)) for group in config.instance_group]


def test_count_instances_run_on_each_listed_gpu_one_executor_per_gpu():
    config = _config("{ count: 2 kind: KIND_GPU gpus: [0, 1] }")
    assert place_instances(config, "cuda", "", _devices(2)) == [Placement(0, 2), Placement(1, 2)]
    assert _groups(config) == [("KIND_GPU", [0, 1])]


def test_a_gpu_group_without_gpus_and_kind_auto_get_every_visible_gpu():
    config = _config("{ kind: KIND_GPU }, { count: 3 kind: KIND_AUTO }")
    assert place_instances(config, "cuda", "", _devices(3)) == [Placement(0, 4), Placement(1, 4), Placement(2, 4)]
    assert _groups(config) == [("KIND_GPU", [0, 1, 2]), ("KIND_GPU", [0, 1, 2])]  # what /config shows


def test_groups_on_the_same_gpu_share_its_executor_in_first_listed_order():
    config = _config("{ count: 1 kind: KIND_GPU gpus: [1] }, { count: 2 kind: KIND_GPU gpus: [0, 1] }")
    assert place_instances(config, "cuda", "", _devices(2)) == [Placement(1, 3), Placement(0, 2)]


def test_a_gpu_id_past_the_visible_devices_fails_naming_the_id_and_the_count():
    with pytest.raises(ServerError, match=r"model 'm': instance group 'm_0' lists GPU 2, but this server sees 2 "
                                          r"CUDA device\(s\) \(ids 0..1"):
        place_instances(_config("{ kind: KIND_GPU gpus: [0, 2] }"), "cuda", "", _devices(2))


def test_gpus_of_different_compute_capabilities_are_refused():
    with pytest.raises(ServerError, match=r"differ in compute capability \(GPU 0 sm_90, GPU 1 sm_80\)"):
        place_instances(_config("{ kind: KIND_GPU gpus: [0, 1] }"), "cuda", "", _devices(2, {1: "sm_80"}))
    with pytest.raises(ServerError, match="GPU 0 sm_80, GPU 1 sm_90"):  # the plan is built for GPU 0 even unlisted
        place_instances(_config("{ kind: KIND_GPU gpus: [1] }"), "cuda", "", _devices(2, {0: "sm_80"}))


def test_models_that_run_in_the_server_process_stay_on_gpu_zero_and_say_why_others_are_refused():
    why = executor.why_in_core("cuda", 0, False)
    config = _config("{ count: 2 kind: KIND_AUTO }")
    assert place_instances(config, "cuda", why, _devices(2)) == [Placement(None, 2)]
    assert _groups(config) == [("KIND_GPU", [0])]
    assert place_instances(_config("{ kind: KIND_GPU gpus: [0] }"), "cuda", why, _devices(2)) == [Placement(None, 1)]
    with pytest.raises(ServerError, match=r"lists gpus \[0, 1\], but a model with max_batch_size 0 runs in the "
                                          r"server process .* which runs on GPU 0 only; use gpus: \[0\]"):
        place_instances(_config("{ kind: KIND_GPU gpus: [0, 1] }"), "cuda", why, _devices(2))


def test_why_in_core_names_each_reason(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("KILN_EXECUTOR", raising=False)
    monkeypatch.delenv("KILN_EXECUTOR_CPU", raising=False)
    assert executor.why_in_core("cuda", 8, False) == ""
    assert "max_batch_size 0" in executor.why_in_core("cuda", 0, False)
    assert "sequence model" in executor.why_in_core("cuda", 8, True)
    assert "cpu backend" in executor.why_in_core("cpu", 8, False)
    monkeypatch.setenv("KILN_EXECUTOR_CPU", "1")
    assert executor.why_in_core("cpu", 8, False) == ""
    monkeypatch.setenv("KILN_EXECUTOR", "thread")
    assert "KILN_EXECUTOR=thread" in executor.why_in_core("cuda", 8, False)
    assert not executor.runs_remote("cuda", 8, False)


def test_cpu_models_take_no_gpu_placement():
    config = _config("{ count: 2 kind: KIND_CPU }, { kind: KIND_AUTO gpus: [0] }")
    assert place_instances(config, "cpu", "", _devices(0)) == [Placement(None, 3)]
    assert _groups(config) == [("KIND_CPU", []), ("KIND_AUTO", [0])]  # left as they were
    with pytest.raises(ServerError, match=r"lists gpus \[1\], but the model runs on the cpu backend"):
        place_instances(_config("{ kind: KIND_CPU gpus: [1] }"), "cpu", "", _devices(0))


def test_an_executor_sees_its_gpu_first_and_the_others_after_it():
    assert child_visible_devices(0, 2, {}) == "0,1"
    assert child_visible_devices(1, 3, {}) == "1,0,2"
    parent = {"CUDA_VISIBLE_DEVICES": "GPU-a, GPU-b,GPU-c,GPU-unused"}
    assert child_visible_devices(2, 3, parent) == "GPU-c,GPU-a,GPU-b"  # the driver stops at `count` devices
    with pytest.raises(ValueError, match="device 2 is not one of the 2 visible"):
        child_visible_devices(2, 2, {})


def test_serve_gpus_narrows_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch):
    assert restricted_visible_devices("1,0", None) == "1,0"
    assert restricted_visible_devices("0, 2", "2,3,5") == "2,5"
    for bad, message in [("0,0", "distinct"), ("a", "comma-separated"), ("", "distinct"), ("-1", "distinct")]:
        with pytest.raises(ValueError, match=message):
            restricted_visible_devices(bad, None)
    with pytest.raises(ValueError, match=r"GPU 3 is not visible \(CUDA_VISIBLE_DEVICES=2,3,5 lists 3"):
        restricted_visible_devices("0,3", "2,3,5")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    restrict_gpus("1")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "6"
    restrict_gpus(None)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "6"


# ----------------------------------------------------------------------------- two executors of one version (CPU)

@pytest.fixture
def two_executors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A core in explicit mode whose CPU models run in executors (KILN_EXECUTOR_CPU), each version placed in two
    of them: what two GPUs give a CUDA model."""
    monkeypatch.setenv("KILN_EXECUTOR", "process")
    monkeypatch.setenv("KILN_EXECUTOR_CPU", "1")
    monkeypatch.setattr(plan_cache, "_default", plan_cache.PlanCache(tmp_path / "plans"))
    real = placement.place_instances

    def two(config, backend, why_in_core, devices=placement.visible_devices):
        (single,) = real(config, backend, why_in_core, devices)
        return [single, Placement(None, single.count)]

    monkeypatch.setattr(placement, "place_instances", two)
    config = ('max_batch_size: 8\ninstance_group [{ kind: KIND_CPU }]\n'
              "dynamic_batching { max_queue_delay_microseconds: 2000 }\n")
    examples.write_model(tmp_path / "models", "add_sub", examples.add_sub_model(TensorProto.FLOAT), config)
    return tmp_path / "models"


def _run(repository: Path, scenario):
    from server.core import CoreOptions, ServerCore

    async def go():
        core = ServerCore(CoreOptions([str(repository)], model_control_mode="explicit"))
        await core.start()
        try:
            await core.load_model("add_sub")
            return await scenario(core, core.models["add_sub"].versions[1])
        finally:
            await core.stop()

    return asyncio.run(go())


async def _infer(core, value: float) -> np.ndarray:
    a = np.full((1, 16), value, np.float32)
    response = await core.infer(InferRequest("add_sub", [InferInput("INPUT0", "FP32", (1, 16), a),
                                                         InferInput("INPUT1", "FP32", (1, 16), a)]))
    return next(o.data for o in response.outputs if o.name == "OUTPUT0")


def test_a_version_in_two_executors_serves_on_the_lanes_of_both(two_executors: Path):
    async def scenario(core, version):
        assert len(version.executors) == 2
        lanes = version.workers.initial
        assert [lane.executor for lane in lanes[:2]] == version.executors  # interleaved: a burst reaches both
        outputs = await asyncio.gather(*(_infer(core, float(i)) for i in range(64)))
        for i, output in enumerate(outputs):
            np.testing.assert_array_equal(output, np.full((1, 16), 2.0 * i, np.float32))
        return version

    version = _run(two_executors, scenario)
    assert all(e._closed for e in version.executors)  # unloading stopped both


async def _burst(core, count: int) -> list[str]:
    """`count` requests at once (the batcher spreads them over every free lane); the errors' messages."""
    async def one(i: int) -> str:
        try:
            np.testing.assert_array_equal(await _infer(core, float(i)), np.full((1, 16), 2.0 * i, np.float32))
        except ServerError as e:
            return e.message
        return ""

    return [message for message in await asyncio.gather(*(one(i) for i in range(count))) if message]


def test_a_killed_executor_restarts_alone_and_the_other_keeps_serving(two_executors: Path):
    async def scenario(core, version):
        first, second = version.executors
        pids = [e._process.pid for e in version.executors]
        os.kill(pids[0], signal.SIGKILL)
        await asyncio.to_thread(first._process.wait)
        errors: list[str] = []
        for _ in range(20):  # until a batch reaches the killed one's lane: it fails (503) and the process restarts
            errors += await _burst(core, 16)
            if first.restarts:
                break
        assert first.restarts == 1 and first._process.pid != pids[0]
        assert len(errors) <= 16 and all("executor process ended" in m for m in errors), errors  # one batch at most
        assert second.restarts == 0 and second._process.pid == pids[1]  # the other one served on, untouched
        assert await _burst(core, 32) == []

    _run(two_executors, scenario)


def test_when_one_gpu_s_executor_fails_to_start_the_others_are_stopped(monkeypatch: pytest.MonkeyPatch):
    from server.core import model as model_module

    made = []

    class Fake:
        def __init__(self, label, engine, config_bytes, instances, device, device_count) -> None:
            if device == 1:
                raise executor.RemoteError(f"{label}: out of memory")
            self.closed = False
            made.append(self)

        def close(self) -> None:
            self.closed = True

    monkeypatch.setattr(executor, "ExecutorProcess", Fake)
    with pytest.raises(executor.RemoteError, match="model 'm' version 1 on GPU 1: out of memory"):
        model_module._start_executors("model 'm' version 1", None, b"", [Placement(0, 1), Placement(1, 1)], 2)
    assert len(made) == 1 and made[0].closed


def test_python_models_get_count_instances_on_each_listed_gpu_with_triton_s_device_ids(tmp_path):
    """Triton's Python backend: a KIND_GPU group makes `count` instances on each of its GPUs, named alike on every
    GPU, each told its GPU in model_instance_device_id; a KIND_CPU group's instances say device 0."""
    from server.core.python_model import _instances
    from server.repository import ModelSource

    config = parse_config_text('name: "m"\nbackend: "python"\ninstance_group [{ name: "g" count: 2 kind: KIND_GPU '
                               'gpus: [0, 1] }, { name: "c" count: 1 kind: KIND_CPU }]', "m")
    source = ModelSource("m", tmp_path, None, {1: tmp_path / "1"})
    instances = _instances(config, source, 1, tmp_path / "1" / "model.py", "python3", {}, None)  # type: ignore[arg-type]
    seen = [(i.args["model_instance_name"], i.args["model_instance_kind"], i.args["model_instance_device_id"])
            for i in instances]
    assert seen == [("g_0", "GPU", "0"), ("g_0", "GPU", "1"), ("g_1", "GPU", "0"), ("g_1", "GPU", "1"),
                    ("c_0", "CPU", "0")]
