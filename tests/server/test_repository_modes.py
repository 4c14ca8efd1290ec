"""Plan cache (hit on restart, corrupt entries rebuilt) and poll mode (add, hot swap under load, failed
build keeps serving, removal), each against real `python -m server` processes."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
import tritonclient.http as http
from onnx import TensorProto, helper

import engine_core as kiln
from server.plan_cache import PLAN_SUFFIX, PlanCache, build_description, cache_key
from tests.server.conftest import examples
from tests.support.servers import ServerProcess
from tests.support.servers import start_server as support_start_server

CONFIG = ('max_batch_size: 8\ninput [{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] }]\n'
          'output [{ name: "Y" data_type: TYPE_FP32 dims: [ 4 ] }]\ninstance_group [{ count: 2 kind: KIND_CPU }]\n'
          'dynamic_batching { max_queue_delay_microseconds: 1000 }\n')


def scale_model(factor: float) -> onnx.ModelProto:
    """Y = X * factor: the factor tells which version answered."""
    k = helper.make_tensor("k", TensorProto.FLOAT, [], [factor])
    graph = helper.make_graph([helper.make_node("Mul", ["X", "k"], ["Y"])], f"scale{factor}",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["n", 4])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["n", 4])], [k])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def start_server(repository: Path, log_path: Path, *flags: str) -> ServerProcess:
    return support_start_server(repository, log_path, "--allow-grpc", "false", "--drain-delay", "0", *flags)


def stop_server(server: ServerProcess) -> None:
    server.process.terminate()
    server.process.wait(timeout=15)


def infer(url: str, model: str, x: np.ndarray) -> tuple[np.ndarray, str]:
    client = http.InferenceServerClient(url)
    tensor = http.InferInput("X", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    result = client.infer(model, [tensor])
    return result.as_numpy("Y"), result.get_response()["model_version"]


def wait_for(condition, timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


# -- plan cache -----------------------------------------------------------------------------------------------
def _network_and_config(model: onnx.ModelProto, max_batch: int = 8):
    builder = kiln.Builder()
    network = builder.create_network()
    assert kiln.OnnxParser(network).parse(model)
    config = kiln.BuilderConfig("cpu")
    profile = builder.create_optimization_profile()
    profile.set_shape("X", [1, 4], [max_batch, 4], [max_batch, 4])
    config.add_optimization_profile(profile)
    return network, config


def test_plan_cache_builds_once_hits_after_and_rebuilds_a_corrupt_entry(tmp_path: Path):
    cache = PlanCache(tmp_path / "plans")
    network, config = _network_and_config(scale_model(3.0))
    key = cache_key("digest", build_description(config), "cpu")
    builds = []

    def build() -> bytes:
        builds.append(1)
        return kiln.build_plan(network, config)

    first = cache.load_or_build(key, build, "m")
    second = cache.load_or_build(key, build, "m")
    assert (first.origin, second.origin, len(builds)) == ("built", "cache hit", 1)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    np.testing.assert_array_equal(second.engine.create_execution_context().infer({"X": x})["Y"], x * 3)
    entries = list((tmp_path / "plans").rglob("*"))
    assert [p.name for p in entries if p.is_file()] == [f"{key}{PLAN_SUFFIX}"]  # no temporary files left

    path = cache.path(key)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    third = cache.load_or_build(key, build, "m")
    assert third.origin.startswith("rebuilt") and "checksum" in third.origin and len(builds) == 2
    assert kiln.Runtime().load(path.read_bytes()).num_io_tensors == 2  # the entry was replaced by a good plan


def test_cache_key_covers_model_file_profiles_flags_arch_and_version(monkeypatch):
    monkeypatch.delenv("KILN_INT8_GEMM", raising=False)
    _, config = _network_and_config(scale_model(1.0))
    _, other_profile = _network_and_config(scale_model(1.0), max_batch=4)
    base = cache_key("a", build_description(config), "cpu")
    assert base == cache_key("a", build_description(config), "cpu")
    assert base != cache_key("b", build_description(config), "cpu")
    assert base != cache_key("a", build_description(other_profile), "cpu")
    assert base != cache_key("a", build_description(config), "sm_90")
    assert base != cache_key("a", build_description(config), "cpu", "other.onnx")  # default_model_filename
    monkeypatch.setenv("KILN_INT8_GEMM", "0")  # a build switch in the environment
    assert base != cache_key("a", build_description(config), "cpu")
    monkeypatch.delenv("KILN_INT8_GEMM")
    config.set_flag(kiln.BuilderFlag.FP16)
    assert base != cache_key("a", build_description(config), "cpu")


def test_restart_hits_the_plan_cache_and_survives_a_corrupt_entry(tmp_path: Path):
    repository = tmp_path / "models"
    examples.write_model(repository, "scale", scale_model(2.0), CONFIG)
    cache_dir = tmp_path / "plans"
    flags = ("--plan-cache-dir", str(cache_dir))
    x = np.ones((1, 4), np.float32)
    logs = []
    for run in range(3):
        if run == 2:  # corrupt the one entry before the third start
            (entry,) = cache_dir.rglob(f"*{PLAN_SUFFIX}")
            entry.write_bytes(entry.read_bytes()[:-10])
        server = start_server(repository, tmp_path / f"server{run}.log", *flags)
        try:
            np.testing.assert_array_equal(infer(server.http_url, "scale", x)[0], x * 2)
        finally:
            stop_server(server)
        logs.append(server.log())
    assert "stored in the plan cache" in logs[0] and "cache hit" not in logs[0]
    assert "plan cache hit" in logs[1] and "stored in the plan cache" not in logs[1]
    assert "unusable" in logs[2] and "truncated" in logs[2] and "plan rebuilt" in logs[2]


def test_a_linked_version_directory_loads_and_a_filename_leaving_it_is_refused(tmp_path: Path):
    """A version directory may be a link to a model store elsewhere (as in Triton); default_model_filename may
    not climb out of its version directory."""
    store = tmp_path / "store" / "scale-v1"
    store.mkdir(parents=True)
    onnx.save(scale_model(3.0), store / "model.onnx")
    repository = tmp_path / "models"
    (repository / "linked").mkdir(parents=True)
    (repository / "linked" / "1").symlink_to(store, target_is_directory=True)
    (repository / "linked" / "config.pbtxt").write_text(CONFIG)
    examples.write_model(repository, "escape", scale_model(2.0),
                         CONFIG + 'default_model_filename: "../../linked/1/model.onnx"\n')
    server = start_server(repository, tmp_path / "server.log", "--strict-readiness", "false",
                          "--exit-on-error", "false")
    try:
        x = np.ones((1, 4), np.float32)
        np.testing.assert_array_equal(infer(server.http_url, "linked", x)[0], x * 3)
        index = {m["name"]: m for m in http.InferenceServerClient(server.http_url).get_model_repository_index()}
        assert index["escape"]["state"] == "UNAVAILABLE"
        assert "must be relative to its directory, without '..'" in index["escape"]["reason"]
    finally:
        stop_server(server)


# -- poll mode ------------------------------------------------------------------------------------------------
def _add_version(repository: Path, name: str, version: int, content: bytes) -> None:
    """Write a version directory beside the model and rename it into place, so a poll never sees half of it."""
    staging = repository / f".staging-{name}-{version}"
    staging.mkdir(parents=True)
    (staging / "model.onnx").write_bytes(content)
    os.rename(staging, repository / name / str(version))


def test_poll_mode_adds_hot_swaps_under_load_keeps_serving_on_a_bad_build_and_removes(tmp_path: Path):
    repository = tmp_path / "models"
    examples.write_model(repository, "swap", scale_model(1.0), CONFIG)
    server = start_server(repository, tmp_path / "server.log", "--model-control-mode", "poll",
                          "--repository-poll-secs", "0.2", "--plan-cache-dir", str(tmp_path / "plans"))
    url = server.http_url
    client = http.InferenceServerClient(url)
    try:
        # a model copied into the directory is picked up
        staging = tmp_path / "incoming"
        examples.write_model(staging, "added", scale_model(5.0), CONFIG)
        shutil.move(str(staging / "added"), str(repository / "added"))
        wait_for(lambda: client.is_model_ready("added"), what="the added model")
        x = np.arange(4, dtype=np.float32)[None]
        np.testing.assert_array_equal(infer(url, "added", x)[0], x * 5)

        # hot swap under load: version 2 appears while clients keep sending; nothing fails
        failures: list[BaseException] = []
        seen: list[str] = []
        stop = threading.Event()

        def client_loop(seed: int) -> None:
            rng = np.random.default_rng(seed)
            while not stop.is_set():
                x = rng.standard_normal((int(rng.integers(1, 4)), 4)).astype(np.float32)
                try:
                    y, version = infer(url, "swap", x)
                    np.testing.assert_allclose(y, x * (1.0 if version == "1" else 7.0), rtol=1e-6)
                    seen.append(version)
                except BaseException as e:  # noqa: BLE001 - every failure is collected and reported
                    failures.append(e)

        threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(6)]
        for thread in threads:
            thread.start()
        wait_for(lambda: len(seen) > 20, what="traffic on version 1")
        _add_version(repository, "swap", 2, scale_model(7.0).SerializeToString())
        wait_for(lambda: seen[-12:] == ["2"] * 12, what="traffic on version 2")
        stop.set()
        for thread in threads:
            thread.join()
        assert failures == []
        assert seen[0] == "1" and seen.count("2") >= 12

        # a version that cannot build: the log says why, version 2 keeps serving
        _add_version(repository, "swap", 3, b"this is not an onnx model")
        wait_for(lambda: "reload of model 'swap' failed" in server.log(), what="the failed reload")
        assert "not a valid ONNX model" in server.log()
        assert infer(url, "swap", x)[1] == "2"

        # removal unloads
        shutil.rmtree(repository / "added")
        wait_for(lambda: not client.is_model_ready("added"), what="the removed model to unload")
        with pytest.raises(Exception, match="explicit"):
            client.load_model("swap")  # poll mode: the directory decides, not the API
    finally:
        stop_server(server)
