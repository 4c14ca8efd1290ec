"""Builds in child processes (server/core/build_process.py): real forkserver children build real ONNX files;
limits on time and memory stop them with a reason; a stopped build leaves nothing in the plan cache."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import engine_core as kiln
from server.core import build_process
from server.core.build_process import BuildLimits, format_size, parse_size
from server.plan_cache import PLAN_SUFFIX, STALE_TEMPORARY_S, TEMPORARY_SUFFIX, PlanCache


def _save(model: onnx.ModelProto, directory: Path) -> Path:
    path = directory / "1" / "model.onnx"
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)
    return path


def _model(nodes, initializers, x_shape, output: str = "Y") -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("X", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def scale_model(factor: float = 3.0) -> onnx.ModelProto:
    """Y = X * factor, X [n, 4]."""
    return _model([helper.make_node("Mul", ["X", "k"], ["Y"])],
                  [helper.make_tensor("k", TensorProto.FLOAT, [], [factor])], ["n", 4])


def slow_build_model(size: int = 1024, steps: int = 400) -> onnx.ModelProto:
    """Constant folding multiplies a size x size weight by itself `steps` times: minutes of build work."""
    weight = numpy_helper.from_array(np.eye(size, dtype=np.float32), "W0")
    nodes = [helper.make_node("MatMul", [f"W{i}", "W0"], [f"W{i + 1}"]) for i in range(steps)]
    nodes.append(helper.make_node("Add", ["X", f"W{steps}"], ["Y"]))
    return _model(nodes, [weight], [size, size])


def memory_hog_model(directory: Path, size: int = 768 << 20) -> Path:
    """A tiny ONNX file whose weight lives in a `size`-byte external data file (sparse: no disk used)."""
    weight = TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[size // 4])
    weight.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "weights.bin"), ("offset", "0"), ("length", str(size))):
        entry = weight.external_data.add()
        entry.key, entry.value = key, value
    path = _save(_model([helper.make_node("Add", ["X", "W"], ["Y"])], [weight], [size // 4]), directory)
    with open(path.parent / "weights.bin", "wb") as handle:
        handle.truncate(size)
    return path


def cpu_config(shapes: dict[str, tuple[list[int], list[int], list[int]]] | None = None) -> kiln.BuilderConfig:
    config = kiln.BuilderConfig("cpu")
    for name, (low, opt, high) in (shapes or {}).items():
        profile = kiln.OptimizationProfile()
        profile.set_shape(name, low, opt, high)
        config.add_optimization_profile(profile)
    return config


@pytest.fixture(autouse=True)
def _fresh_limits():
    """stop_all() marks the module as shutting down; every test starts from configured defaults."""
    build_process.configure(BuildLimits(build_process.default_memory_limit()))
    yield
    build_process.configure(BuildLimits(build_process.default_memory_limit()))


def test_child_builds_a_plan_that_runs(tmp_path: Path):
    path = _save(scale_model(3.0), tmp_path)
    plan = build_process.build_plan(path, cpu_config({"X": ([1, 4], [8, 4], [8, 4])}), "scale")
    context = kiln.Runtime().load(plan).create_execution_context()
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    np.testing.assert_array_equal(context.infer({"X": x})["Y"], x * 3)


def test_child_reports_the_models_own_error(tmp_path: Path):
    path = tmp_path / "1" / "model.onnx"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\x08\x07garbage that is not protobuf")
    with pytest.raises(kiln.BuildError, match="ONNX import failed: not a valid ONNX model"):
        build_process.build_plan(path, cpu_config(), "broken")


def test_time_limit_stops_the_build_and_leaves_no_cache_entry(tmp_path: Path):
    path = _save(slow_build_model(), tmp_path / "model")
    cache = PlanCache(tmp_path / "plans")
    limits = BuildLimits(memory_bytes=None, timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(kiln.BuildError, match=r"ran past its time limit of 1 s \(--build-timeout-secs\)"):
        cache.load_or_build("ab" * 32, lambda: build_process.build_plan(path, cpu_config(), "slow", limits), "slow")
    assert time.monotonic() - started < 30  # stopped, not run to the end (minutes of matmuls)
    assert not build_process._active
    assert [p for p in (tmp_path / "plans").rglob("*") if p.is_file()] == []


def test_memory_limit_fails_the_build_with_the_limit_named(tmp_path: Path):
    path = memory_hog_model(tmp_path)
    limits = BuildLimits(memory_bytes=512 << 20, timeout_s=120)
    with pytest.raises(kiln.BuildError, match=r"out of memory: it needs more than its limit of 512 MiB "
                                              r"\(--build-memory-limit\)"):
        build_process.build_plan(path, cpu_config(), "hog", limits)


def _build_in_thread(path: Path, limits: BuildLimits) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            build_process.build_plan(path, cpu_config(), "slow", limits)
        except BaseException as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 30
    while not build_process._active and time.monotonic() < deadline:
        time.sleep(0.02)
    assert build_process._active, "the build process did not start"
    return thread, errors


def test_a_killed_build_process_is_reported_with_its_signal(tmp_path: Path):
    """What the kernel's OOM killer does to a build: the load fails naming the signal, nothing hangs."""
    path = _save(slow_build_model(), tmp_path)
    thread, errors = _build_in_thread(path, BuildLimits(memory_bytes=8 << 30, timeout_s=120))
    (process,) = list(build_process._active)
    os.kill(process.pid, signal.SIGKILL)
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], kiln.BuildError)
    assert "killed by SIGKILL" in str(errors[0]) and "memory limit of 8 GiB" in str(errors[0])


def test_stop_all_ends_running_builds_at_shutdown(tmp_path: Path):
    path = _save(slow_build_model(), tmp_path)
    thread, errors = _build_in_thread(path, BuildLimits(memory_bytes=None, timeout_s=120))
    build_process.stop_all()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert "server is shutting down" in str(errors[0])
    with pytest.raises(kiln.BuildError, match="shutting down"):
        build_process.build_plan(path, cpu_config(), "late")


def test_stale_temporary_files_of_a_killed_writer_are_removed_and_never_read(tmp_path: Path):
    directory = tmp_path / "plans" / "ab"
    directory.mkdir(parents=True)
    stale = directory / f".abababababababab-x{TEMPORARY_SUFFIX}"
    fresh = directory / f".abababababababab-y{TEMPORARY_SUFFIX}"
    for path in (stale, fresh):
        path.write_bytes(b"half a plan")
    old = time.time() - STALE_TEMPORARY_S - 60
    os.utime(stale, (old, old))
    cache = PlanCache(tmp_path / "plans")  # a restarted server opens the cache
    assert not stale.exists() and fresh.exists()  # a fresh one may belong to another server writing now
    assert cache.read("ab" * 32) is None
    path = _save(scale_model(), tmp_path / "model")
    built = cache.load_or_build("ab" * 32, lambda: build_process.build_plan(
        path, cpu_config({"X": ([1, 4], [1, 4], [1, 4])}), "scale"), "scale")
    assert built.origin == "built" and cache.path("ab" * 32).name.endswith(PLAN_SUFFIX)


@pytest.mark.parametrize(("text", "size"), [("8G", 8 << 30), ("512M", 512 << 20), ("1.5GiB", 3 << 29),
                                            ("4096", 4096), ("0", None), ("none", None)])
def test_memory_sizes_parse(text: str, size: int | None):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["lots", "-1G", "G"])
def test_bad_memory_sizes_are_refused(text: str):
    with pytest.raises(ValueError, match="memory size"):
        parse_size(text)


def test_sizes_format_for_people():
    assert (format_size(1 << 30), format_size(3 << 19), format_size(10)) == ("1 GiB", "1.5 MiB", "10 bytes")


def test_builds_run_below_the_serving_process(tmp_path) -> None:
    """The forkserver and each CPU build it forks run at BUILD_NICENESS: a build never outcompetes serving for a
    core."""
    from multiprocessing import forkserver

    build_process.warm_up()
    pid = forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    assert os.getpriority(os.PRIO_PROCESS, pid) >= build_process.BUILD_NICENESS
    assert os.getpriority(os.PRIO_PROCESS, 0) < build_process.BUILD_NICENESS  # the serving process keeps its own
    niceness = build_process.run_bounded(_own_niceness, (), "kiln-test niceness", build_process.BUILD)
    assert int(niceness) >= build_process.BUILD_NICENESS


def _own_niceness() -> bytes:
    return str(os.getpriority(os.PRIO_PROCESS, 0)).encode()
