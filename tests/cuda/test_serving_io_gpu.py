"""The engine's serving I/O path on the device: runs given the default stream fork onto the context's stream
and still replay CUDA graphs; ``infer`` stages through pinned host memory and returns fresh arrays."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import engine_core as kiln
from engine_core.backends.cuda.runner import STAGING_SLOTS
from tests.cuda.models import build_engine, mlp

pytestmark = pytest.mark.gpu

PROFILE = {"x": ((1, 64), (8, 64), (32, 64))}


def _driver():
    from cuda.bindings import driver

    from engine_core.cuda.driver import check

    return driver, check


def _x(seed: int, batch: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, 64)).astype(np.float32)


def _replays(context) -> int:
    return context._backend_context.graph_replays


def _graphs(context) -> int:
    return sum(len(b.graphs) for b in context._backend_context._bindings.values())


class _Bound:
    """One context with its own device input/output buffers, run through execute_async_v3."""

    def __init__(self, engine, x: np.ndarray) -> None:
        from engine_core.cuda.driver import DeviceBuffer

        self.context = engine.create_execution_context()
        self.x, self.dx, self.dy = x, DeviceBuffer.from_array(x), DeviceBuffer(x.shape[0] * 32 * 4)
        self.context.set_input_shape("x", x.shape)
        self.context.set_tensor_address("x", self.dx.ptr)
        self.context.set_tensor_address("y", self.dy.ptr)

    def run(self, stream: int) -> np.ndarray:
        driver, check = _driver()
        assert self.context.execute_async_v3(stream)
        check(driver.cuStreamSynchronize(stream), "cuStreamSynchronize")
        return self.dy.to_array(np.float32, (self.x.shape[0], 32))


# -- the default stream ------------------------------------------------------------------------------------


def test_default_stream_gives_the_created_stream_results_and_replays_a_graph():
    driver, check = _driver()
    engine = build_engine(mlp(), "cuda", PROFILE)
    x = _x(3, 8)
    stream = int(check(driver.cuStreamCreate(0), "cuStreamCreate"))
    created, default = _Bound(engine, x), _Bound(engine, x)
    want = [created.run(stream) for _ in range(4)]  # eager, captured, replayed twice
    assert _replays(created.context) >= 2
    got = [default.run(0) for _ in range(4)]
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, want[0])
        np.testing.assert_array_equal(b, want[0])
    assert _graphs(default.context) == 1 and _replays(default.context) >= 2


def test_default_stream_profiler_and_consumed_event_order_correctly():
    driver, check = _driver()
    engine = build_engine(mlp(), "cuda", PROFILE)
    x = _x(4, 5)
    want = engine.create_execution_context().infer({"x": x})["y"]

    class Times(kiln.IProfiler):
        def __init__(self) -> None:
            self.layers: list[tuple[str, float]] = []

        def report_layer_time(self, layer_name: str, ms: float) -> None:
            self.layers.append((layer_name, ms))

    bound = _Bound(engine, x)
    bound.context.profiler = Times()
    np.testing.assert_allclose(bound.run(0), want, rtol=1e-5, atol=1e-6)
    assert bound.context.profiler.layers and all(ms >= 0 for _, ms in bound.context.profiler.layers)
    bound.context.profiler = None
    consumed = check(driver.cuEventCreate(0), "cuEventCreate")
    assert bound.context.set_input_consumed_event(int(consumed))
    for _ in range(4):  # eager, captured (external event node), replayed
        np.testing.assert_allclose(bound.run(0), want, rtol=1e-5, atol=1e-6)
        check(driver.cuEventSynchronize(consumed), "cuEventSynchronize")
    assert _replays(bound.context) >= 2
    driver.cuEventDestroy(consumed)


# -- pinned staging in infer --------------------------------------------------------------------------------


def test_infer_stages_through_pinned_memory_and_returns_fresh_arrays():
    gpu, cpu = build_engine(mlp(), "cuda", PROFILE), build_engine(mlp(), "cpu", PROFILE)
    context, reference = gpu.create_execution_context(), cpu.create_execution_context()
    xs = [_x(seed, 6) for seed in range(4)]
    results = [context.infer({"x": x})["y"] for x in xs]  # eager, captured, replayed twice
    for x, y in zip(xs, results):  # earlier results survive later runs: they are not the staging buffers
        np.testing.assert_allclose(y, reference.infer({"x": x})["y"], rtol=1e-5, atol=1e-6)
    assert not any(np.shares_memory(a, b) for i, a in enumerate(results) for b in results[i + 1:])
    (binding,) = context._backend_context._bindings.values()
    assert set(binding.stages) == {"x", "y"} and _replays(context) >= 2
    before = _replays(context)
    fortran = np.asfortranarray(xs[0])  # a non-contiguous feed is copied into the pinned mirror as it is
    np.testing.assert_array_equal(context.infer({"x": fortran})["y"], results[0])
    assert _replays(context) == before + 1


# -- infer_batch and warm_up ----------------------------------------------------------------------------------


def _binding(context):
    (binding,) = context._backend_context._bindings.values()
    return binding


def test_warm_up_captures_so_the_first_request_replays():
    gpu, cpu = build_engine(mlp(), "cuda", PROFILE), build_engine(mlp(), "cpu", PROFILE)
    context = gpu.create_execution_context()
    context.warm_up({"x": (8, 64)})
    binding = _binding(context)
    # one per slot for infer's staged copies, one for batches gathered on the device (the slots share its buffers)
    assert len(binding.graphs) == STAGING_SLOTS + 1 and binding.verified and not binding.graph_failed
    runs, replays = binding.runs, _replays(context)
    x = _x(30, 8)
    y = context.infer({"x": x})["y"]
    assert _replays(context) == replays + 1 and binding.runs == runs and len(binding.graphs) == STAGING_SLOTS + 1
    np.testing.assert_allclose(y, cpu.create_execution_context().infer({"x": x})["y"], rtol=1e-5, atol=1e-6)


def test_infer_batch_after_warm_up_replays_the_graph_infer_uses():
    engine = build_engine(mlp(), "cuda", PROFILE)
    context = engine.create_execution_context()
    parts = [_x(10, 2), _x(11, 3), _x(12, 1)]
    padded = np.concatenate(parts + [np.zeros((2, 64), np.float32)])
    context.warm_up({"x": (8, 64)})
    binding, replays = _binding(context), _replays(context)
    results = context.infer_batch([{"x": p} for p in parts], pad_to=8)
    assert _replays(context) == replays + 1 and len(context._backend_context._bindings) == 1
    want = context.infer({"x": padded})["y"]
    assert _replays(context) == replays + 2 and len(binding.graphs) == STAGING_SLOTS + 1  # the same graphs
    for (start, stop), result in zip(((0, 2), (2, 5), (5, 6)), results):
        assert list(result) == ["y"]
        np.testing.assert_array_equal(result["y"], want[start:stop])


def test_batches_gathered_on_the_device_after_warm_up_replay_without_a_capture():
    """Requests in shared memory and a server's frontend arenas reach the engine as ``DeviceRows``: after
    ``warm_up`` their first batch replays a graph captured at warm-up (no capture on a live request), in either
    staging slot, and answers as the CPU backend."""
    from engine_core.cuda.driver import DeviceBuffer, copy_to_host

    gpu, cpu = build_engine(mlp(), "cuda", PROFILE), build_engine(mlp(), "cpu", PROFILE)
    context = gpu.create_execution_context()
    context.warm_up({"x": (8, 64)})
    graphs, replays = _graphs(context), _replays(context)
    x = _x(31, 8)
    source, target = DeviceBuffer.from_array(x), DeviceBuffer(8 * 32 * 4)
    rows = np.ones(8, np.int64)
    inputs = {"x": kiln.DeviceRows(source.ptr + np.arange(8, dtype=np.uint64) * 256, rows, (64,), np.float32)}
    outputs = {"y": kiln.DeviceRows(target.ptr + np.arange(8, dtype=np.uint64) * 128, rows, (32,), np.float32)}
    assert context.infer_rows(inputs, destinations=outputs) == {}
    host = context.infer_rows(inputs)["y"]
    assert _graphs(context) == graphs and _replays(context) == replays + 2
    expected = cpu.create_execution_context().infer({"x": x})["y"]
    np.testing.assert_allclose(copy_to_host(target.ptr, np.dtype(np.float32), (8, 32)), expected, rtol=2e-3,
                               atol=2e-5)
    np.testing.assert_allclose(host, expected, rtol=2e-3, atol=2e-5)


def test_two_threads_on_one_context_overlap_and_each_gets_its_rows():
    """A server runs two workers per CUDA context (ExecutionContext.concurrent_runs): their batches interleave
    on the context's stream, each in its own staging slot, and every part still gets its own rows."""
    gpu, cpu = build_engine(mlp(), "cuda", PROFILE), build_engine(mlp(), "cpu", PROFILE)
    context, reference = gpu.create_execution_context(), cpu.create_execution_context()
    assert context.concurrent_runs == STAGING_SLOTS == 2
    for batch in (8, 16):
        context.warm_up({"x": (batch, 64)})
    failures: list[str] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for step in range(60):
            sizes = [int(n) for n in rng.integers(1, 5, int(rng.integers(1, 4)))]
            parts = [_x(seed * 1000 + step * 10 + i, n) for i, n in enumerate(sizes)]
            got = context.infer_batch([{"x": p} for p in parts], pad_to=8 if sum(sizes) <= 8 else 16)
            for part, result in zip(parts, got):
                want = reference.infer({"x": part})["y"]
                if not np.allclose(result["y"], want, rtol=1e-4, atol=1e-5):
                    failures.append(f"worker {seed} step {step}: rows of another batch or slot")

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not failures, failures[:3]
    assert _graphs(context) == 2 * (STAGING_SLOTS + 1)  # warmed: no capture


def test_infer_batch_reads_and_writes_device_views():
    from engine_core.cuda.driver import DeviceBuffer

    engine = build_engine(mlp(), "cuda", PROFILE)
    context = engine.create_execution_context()
    parts = [_x(20, 2), _x(21, 3), _x(22, 1)]
    want = context.infer({"x": np.concatenate(parts + [np.zeros((2, 64), np.float32)])})["y"]
    sources = [DeviceBuffer.from_array(parts[0]), DeviceBuffer.from_array(parts[2])]
    feeds = [{"x": kiln.DeviceView(sources[0].ptr, (2, 64), np.float32)}, {"x": parts[1]},
             {"x": kiln.DeviceView(sources[1].ptr, (1, 64), np.float32)}]
    out = DeviceBuffer(3 * 32 * 4)
    for _ in range(3):  # the binding's second run is captured, the third replayed
        out.copy_from(np.full((3, 32), np.nan, np.float32))
        results = context.infer_batch(feeds, pad_to=8,
                                      destinations=[{}, {"y": kiln.DeviceView(out.ptr, (3, 32), np.float32)}, {}])
        assert list(results[1]) == [] and list(results[0]) == list(results[2]) == ["y"]
        np.testing.assert_array_equal(results[0]["y"], want[0:2])
        np.testing.assert_array_equal(out.to_array(np.float32, (3, 32)), want[2:5])
        np.testing.assert_array_equal(results[2]["y"], want[5:6])
    assert _replays(context) >= 2 and len(context._backend_context._bindings) == 1
    from engine_core.backends.cuda import runner_staging

    assert runner_staging._BatchCopies.usable  # the gathers went as one cuMemcpyBatchAsync through ctypes
    with pytest.raises(kiln.ShapeError, match="destination of output 'y' for part 1 has shape \\[2, 32\\]"):
        context.infer_batch(feeds, pad_to=8, destinations=[{}, {"y": kiln.DeviceView(out.ptr, (2, 32), np.float32)}, {}])


def test_many_device_parts_go_through_the_segment_kernel():
    """Ten requests in device memory (CUDA shared memory): one copy_segments launch gathers their rows and one
    writes each output back; the results are those of a host batch."""
    from engine_core.backends.cuda import runner_staging
    from engine_core.cuda.driver import DeviceBuffer

    engine = build_engine(mlp(), "cuda", PROFILE)
    context = engine.create_execution_context()
    parts = [_x(40 + i, 1 + i % 3) for i in range(10)]  # 19 rows
    total = sum(p.shape[0] for p in parts)
    want = context.infer({"x": np.concatenate(parts + [np.zeros((24 - total, 64), np.float32)])})["y"][:total]
    assert len(parts) >= runner_staging.SEGMENT_KERNEL_MIN_COPIES
    sources = [DeviceBuffer.from_array(p) for p in parts]
    targets = [DeviceBuffer(p.shape[0] * 32 * 4) for p in parts]
    feeds = [{"x": kiln.DeviceView(s.ptr, p.shape, np.float32)} for s, p in zip(sources, parts)]
    destinations = [{"y": kiln.DeviceView(t.ptr, (p.shape[0], 32), np.float32)} for t, p in zip(targets, parts)]
    for _ in range(3):  # both staging slots' tables, then one reused
        for target, part in zip(targets, parts):
            target.copy_from(np.full((part.shape[0], 32), np.nan, np.float32))
        results = context.infer_batch(feeds, pad_to=24, destinations=destinations)
        assert all(list(r) == [] for r in results)
        got = np.concatenate([t.to_array(np.float32, (p.shape[0], 32)) for t, p in zip(targets, parts)])
        np.testing.assert_array_equal(got, want)


def test_infer_batch_whole_outputs_match_the_cpu_backend():
    """y and k are split by rows, s (a sum over the batch, padding rows included) goes whole to every part,
    to a destination too."""
    from engine_core.cuda.driver import DeviceBuffer
    from tests.engine.test_infer_batch import SHAPES, batch_model

    gpu, cpu = (build_engine(batch_model(), backend, SHAPES) for backend in ("cuda", "cpu"))
    rng = np.random.default_rng(40)
    parts = [{"x": rng.standard_normal((rows, 3)).astype(np.float32), "ids": rng.integers(0, 9, (rows, 2))}
             for rows in (2, 3)]
    want = cpu.create_execution_context().infer_batch(parts, pad_to=8)
    whole = DeviceBuffer(3 * 4)
    got = gpu.create_execution_context().infer_batch(
        parts, pad_to=8, destinations=[{}, {"s": kiln.DeviceView(whole.ptr, (3,), np.float32)}])
    assert list(got[0]) == ["y", "k", "s"] and list(got[1]) == ["y", "k"]
    for g, w in zip(got, want):
        for name in g:
            np.testing.assert_allclose(g[name], w[name], rtol=1e-5, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(whole.to_array(np.float32, (3,)), want[1]["s"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mapped", [False, True], ids=["device", "page-locked host"])
def test_infer_rows_gathers_and_delivers_many_parts_by_address(mapped: bool):
    """``infer_rows`` with ``DeviceRows``: parts scattered over memory (device memory, or page-locked host memory
    as system shared memory is), more of them than the copy kernel's threshold, gathered into one padded batch and
    each part's output rows delivered to its own address; the same answers as the CPU backend."""
    import mmap

    from engine_core.cuda.driver import DeviceBuffer, copy_to_host
    from engine_core.cuda.host_memory import HostRegistration

    gpu, cpu = build_engine(mlp(), "cuda", PROFILE), build_engine(mlp(), "cpu", PROFILE)
    rows = np.array([1, 2, 1, 3, 1, 1, 2, 1, 1, 2, 1], np.int64)  # 16 rows, 11 parts
    x = _x(7, int(rows.sum()))
    stride = 3 * 64 * 4  # room for 3 rows per slot, parts placed out of order
    order = np.random.default_rng(1).permutation(len(rows))
    size = stride * len(rows) * 2
    if mapped:
        mapping = mmap.mmap(-1, size)
        host = np.frombuffer(mapping, np.uint8)
        registration = HostRegistration(host.ctypes.data, size)
        base = registration.device_address
    else:
        buffer = DeviceBuffer(size)
        base = buffer.ptr
    slots = base + order.astype(np.uint64) * np.uint64(stride)
    outs = base + np.uint64(stride * len(rows)) + order.astype(np.uint64) * np.uint64(stride // 2)
    starts = np.concatenate(([0], np.cumsum(rows)[:-1]))
    for slot, start, count in zip(slots, starts, rows):
        DeviceBuffer.copy_from(type("At", (), {"ptr": int(slot)})(), x[start:start + count])  # type: ignore[arg-type]
    context = gpu.create_execution_context()
    outputs = context.infer_rows({"x": kiln.DeviceRows(slots, rows, (64,), np.float32)}, pad_to=24,
                                 destinations={"y": kiln.DeviceRows(outs, rows, (32,), np.float32)})
    assert outputs == {}
    expected = cpu.create_execution_context().infer({"x": x})["y"]
    for out, start, count in zip(outs, starts, rows):
        got = copy_to_host(int(out), np.dtype(np.float32), (int(count), 32))
        np.testing.assert_allclose(got, expected[start:start + count], rtol=2e-3, atol=2e-5)
    host_outputs = context.infer_rows({"x": kiln.DeviceRows(slots, rows, (64,), np.float32)})  # outputs back whole
    np.testing.assert_allclose(host_outputs["y"], expected, rtol=2e-3, atol=2e-5)
