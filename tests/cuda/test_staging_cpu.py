"""The CUDA runner's host I/O path without a GPU: ``infer``, ``infer_batch`` and ``warm_up`` of a
``CudaContextState`` over a fake driver whose "device" memory is host memory (copies are memmoves) and whose
run is the CPU backend reading and writing the bound addresses. Why: the row offsets, padding, pinned
mirrors, device-view gathers and destination copies are plain host logic; a mistake there shows up here on
every machine, before the GPU tests run."""

from __future__ import annotations

import ctypes
import gc
import sys
import threading
import time
import types

import numpy as np
import pytest

import engine_core as kiln
from engine_core.backends.cuda import runner, runner_staging
from engine_core.cuda import driver as kiln_driver
from engine_core.interpret import GraphRunner
from engine_core.ops import TensorInfo
from engine_core.passes import infer_shapes
from tests.engine.test_infer_batch import SHAPES, batch_model
from tests.engine.util import build


class FakeDriver:
    """The driver calls the staging path makes; device pointers are host addresses."""

    CUresult = types.SimpleNamespace(CUDA_SUCCESS=0)

    def __init__(self) -> None:
        self.memory: dict[int, ctypes.Array] = {}
        self.calls: list[str] = []

    def _alloc(self, nbytes: int) -> tuple[int, int]:
        buf = ctypes.create_string_buffer(nbytes)
        self.memory[ctypes.addressof(buf)] = buf
        return 0, ctypes.addressof(buf)

    def cuMemAlloc(self, nbytes):  # noqa: N802 (driver names)
        return self._alloc(nbytes)

    def cuMemHostAlloc(self, nbytes, flags):  # noqa: N802
        return self._alloc(nbytes)

    def cuMemFree(self, ptr):  # noqa: N802
        return (0,)

    cuMemFreeHost = cuMemFree

    def _copy(self, kind: str):
        def copy(dst, src, nbytes, stream=None):
            self.calls.append(kind)
            ctypes.memmove(int(dst), int(src), int(nbytes))
            return (0,)
        return copy

    def __getattr__(self, name: str):
        kinds = {"cuMemcpyHtoDAsync": "HtoD", "cuMemcpyDtoHAsync": "DtoH", "cuMemcpyDtoDAsync": "DtoD",
                 "cuMemcpyHtoD": "HtoD sync", "cuMemcpyDtoH": "DtoH sync"}
        if name in kinds:
            return self._copy(kinds[name])
        raise AttributeError(name)

    CUmemcpyAttributes = types.SimpleNamespace
    CUmemcpySrcAccessOrder = types.SimpleNamespace(CU_MEMCPY_SRC_ACCESS_ORDER_STREAM=1)

    @staticmethod
    def CUdeviceptr(value):  # noqa: N802
        return int(value)

    def cuMemcpyBatchAsync(self, dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, stream):  # noqa: N802
        assert len(dsts) == len(srcs) == len(sizes) == count and attrs_idxs == [0] and num_attrs == 1
        assert attrs[0].srcAccessOrder == 1  # sources read in stream order (after the uploads before them)
        self.calls.append(f"DtoD x{count}")
        for dst, src, nbytes in zip(dsts, srcs, sizes):
            ctypes.memmove(int(dst), int(src), int(nbytes))
        return (0,)

    def cuMemsetD8Async(self, dst, value, nbytes, stream):  # noqa: N802
        self.calls.append("memset")
        ctypes.memset(int(dst), int(value), int(nbytes))
        return (0,)

    def cuStreamCreate(self, flags):  # noqa: N802
        return 0, 0x5000

    def cuStreamSynchronize(self, stream):  # noqa: N802
        self.calls.append("sync")
        return (0,)

    CUevent_flags = types.SimpleNamespace(CU_EVENT_DISABLE_TIMING=2, CU_EVENT_BLOCKING_SYNC=1)

    def cuEventCreate(self, flags):  # noqa: N802
        self.calls.append("event")
        return 0, f"event{self.calls.count('event')}"

    def cuEventRecord(self, event, stream):  # noqa: N802
        self.calls.append(f"record {event} on {stream:#x}")
        return (0,)

    def cuStreamWaitEvent(self, stream, event, flags):  # noqa: N802
        self.calls.append(f"{stream:#x} waits {event}")
        return (0,)

    def cuEventSynchronize(self, event):  # noqa: N802
        self.calls.append("wait")
        return (0,)


def _io(calls: list[str]) -> list[str]:
    """The driver calls of runs, each slot event's recording on the context stream as "done" (made once: left out)."""
    return ["done" if call.startswith("record ") and call.endswith(" on 0x5000") else call
            for call in calls if call != "event"]


def _host(address: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    return np.frombuffer((ctypes.c_char * nbytes).from_address(address), dtype).reshape(shape)


@pytest.fixture
def fake(monkeypatch):
    fake = FakeDriver()
    import cuda.bindings

    monkeypatch.setattr(cuda.bindings, "driver", fake, raising=False)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", fake)
    monkeypatch.setattr(runner, "primary_context", lambda ordinal=0: None)
    monkeypatch.setattr(runner_staging, "primary_context", lambda ordinal=0: None)  # PinnedBuffer's
    monkeypatch.setattr(kiln_driver, "primary_context", lambda ordinal=0: None)
    monkeypatch.setattr(runner_staging._BatchCopies, "usable", True)
    # the calls made with the interpreter lock held go to libcuda through ctypes: here to the fake as well
    monkeypatch.setattr(runner_staging, "record_event", lambda event, stream: fake.cuEventRecord(event, stream))
    monkeypatch.setattr(runner_staging, "memset_d8_async", lambda *args: fake.cuMemsetD8Async(*args))
    monkeypatch.setattr(runner, "memset_d8_async", lambda *args: fake.cuMemsetD8Async(*args))
    monkeypatch.setattr(runner_staging, "copy_pinned_async", lambda dst, src, nbytes, stream, to_device: (
        fake.cuMemcpyHtoDAsync if to_device else fake.cuMemcpyDtoHAsync)(dst, src, nbytes, stream))
    monkeypatch.setattr(runner_staging, "memcpy_dtod_async", lambda *args: fake.cuMemcpyDtoDAsync(*args))
    monkeypatch.setattr(runner_staging, "memcpy_batch_async", lambda copies, stream: fake.cuMemcpyBatchAsync(
        [d for d, _, _ in copies], [s for _, s, _ in copies], [n for _, _, n in copies], len(copies),
        [types.SimpleNamespace(srcAccessOrder=1)], [0], 1, stream))

    def copy_segments(function, grid, block, args, stream):  # the kernel: each (dst, src, nbytes) row of the table
        table, count = args[0].value, args[1].value
        fake.calls.append(f"segments x{count}")
        for dst, src, nbytes in _host(table, np.uint64, (count, 3)):
            ctypes.memmove(int(dst), int(src), int(nbytes))

    monkeypatch.setattr(runner_staging, "launch_held", copy_segments)
    return fake


@pytest.fixture
def setup(fake):
    """A CPU-built engine whose context runs through a CudaContextState: one binding per shape set, the run
    is the CPU graph over the bound addresses, and a graph counts as captured from the second run."""
    engine = kiln.Runtime().load(build(batch_model(), SHAPES))
    context = engine.create_execution_context()
    graph = engine.plan.graph
    state = runner.CudaContextState(types.SimpleNamespace(plan=engine.plan, function=lambda module, name: name))
    def bind(shapes, values=None):
        key = tuple(sorted(shapes.items()))
        if key not in state._bindings:
            infos = infer_shapes(graph, {v.name: TensorInfo(v.dtype, shapes[v.name]) for v in graph.inputs})
            state._bindings[key] = types.SimpleNamespace(lowered=types.SimpleNamespace(infos=infos), stages={},
                                                         graphs={}, has_host=False, graph_failed=False, runs=0,
                                                         staged=None, twins={}, tail=None,
                                                         output_names=graph.output_names)
        return state._bindings[key]

    def execute(shapes, addresses, stream, profiler=None, values=None, debug=None, consumed_event=None, staged=None):
        binding = bind(shapes)
        if staged is not None:
            staged.upload(stream)
        fake.calls.append("run")
        feeds = {v.name: _host(addresses[v.name], v.dtype, shapes[v.name]).copy() for v in graph.inputs}
        for name, value in GraphRunner(graph).run(feeds).items():
            _host(addresses[name], value.dtype, value.shape)[...] = value
        if staged is not None:
            staged.download(stream)
        binding.runs += 1
        if binding.runs >= 2:
            binding.graphs[runner.graph_key(addresses, consumed_event, staged)] = "captured"

    state.bind, state.execute = bind, execute
    context._backend_context = state
    yield engine.create_execution_context(), context, fake
    context._backend_context = None  # free the fake buffers while the fake driver is still installed
    state._bindings.clear()
    gc.collect()


def _part(seed: int, rows: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((rows, 3)).astype(np.float32), "ids": rng.integers(0, 9, (rows, 2))}


def _device(fake: FakeDriver, array: np.ndarray) -> kiln.DeviceView:
    _, ptr = fake.cuMemAlloc(array.nbytes)
    _host(ptr, array.dtype, array.shape)[...] = array
    return kiln.DeviceView(ptr, array.shape, array.dtype)


def test_infer_goes_through_pinned_mirrors_with_one_sync(setup) -> None:
    reference, context, fake = setup
    part = _part(0, 4)
    first = context.infer(part)
    assert _io(fake.calls) == ["HtoD", "HtoD", "run", "DtoH", "DtoH", "DtoH", "done", "wait"]
    second = context.infer(_part(1, 4))
    for name, value in reference.infer(part).items():
        np.testing.assert_array_equal(first[name], value)  # not overwritten by the second run's staging
    assert not np.shares_memory(first["y"], second["y"])
    (binding,) = context._backend_context._bindings.values()
    assert set(binding.stages) == {"x", "ids", "y", "k", "s"}


def test_stage_fill_clears_only_rows_an_earlier_run_wrote_and_takes_scalars(fake) -> None:
    stage = runner._Stage(np.dtype(np.float32), (4, 2))
    stage.fill([np.ones((1, 2), np.float32), np.full((2, 2), 2, np.float32)])
    np.testing.assert_array_equal(stage.array[:3], [[1, 1], [2, 2], [2, 2]])
    np.testing.assert_array_equal(stage.array[3], [0, 0])  # never written: a fresh mirror counts as written
    stage.fill([np.full((1, 2), 5, np.float32)])
    np.testing.assert_array_equal(stage.array, [[5, 5], [0, 0], [0, 0], [0, 0]])
    assert stage.written == 1
    scalar = runner._Stage(np.dtype(np.int64), ())
    scalar.fill([np.asarray(7, np.int64)])
    assert scalar.array == 7
    del stage, scalar
    gc.collect()  # free the fake buffers while the fake driver is still installed


def test_host_parts_gather_in_the_mirrors_and_run_with_their_copies(setup) -> None:
    reference, context, fake = setup
    for rows in ([3, 4, 1], [2, 1], [1]):  # fewer rows each time: rows an earlier run wrote must read as zeros
        parts = [_part(10 + i, n) for i, n in enumerate(rows)]
        fake.calls.clear()
        got = context.infer_batch(parts, pad_to=8)
        # the uploads of whole mirrors, the run and the downloads (one graph once captured), one wait
        assert _io(fake.calls) == ["HtoD", "HtoD", "run", "DtoH", "DtoH", "DtoH", "done", "wait"]
        for g, w in zip(got, reference.infer_batch(parts, pad_to=8)):
            for name in w:
                np.testing.assert_array_equal(g[name], w[name], err_msg=name)


def test_infer_batch_gathers_pads_splits_and_writes_destinations(setup) -> None:
    reference, context, fake = setup
    parts = [_part(1, 2), _part(2, 3), _part(3, 1), _part(4, 1)]
    want = reference.infer_batch(parts, pad_to=8)
    feeds = [parts[0], {"x": _device(fake, parts[1]["x"]), "ids": parts[1]["ids"]}, parts[2],
             {"x": parts[3]["x"], "ids": _device(fake, parts[3]["ids"])}]
    y_out = _device(fake, np.full((3, 3), np.nan, np.float32))
    s_out = _device(fake, np.zeros(3, np.float32))
    fake.calls.clear()
    got = context.infer_batch(feeds, pad_to=8, destinations=[{}, {"y": y_out}, {}, {"s": s_out}])
    # x: part 0 host, part 1 device, parts 2-3 host (one upload), padding; ids: parts 0-2 host, part 3 device;
    # the device parts' copies as one batch; after the run the destinations' copies as one batch
    calls = _io(fake.calls)
    assert calls[:7] == ["HtoD", "HtoD", "memset", "HtoD", "memset", "DtoD x2", "run"]
    assert "DtoD x2" in calls[7:] and calls[-2:] == ["done", "wait"] and "sync" not in calls
    assert [list(g) for g in got] == [["y", "k", "s"], ["k", "s"], ["y", "k", "s"], ["y", "k"]]
    for g, w in zip(got, want):
        for name in g:
            np.testing.assert_array_equal(g[name], w[name], err_msg=name)
    np.testing.assert_array_equal(_host(y_out.ptr, np.float32, (3, 3)), want[1]["y"])
    np.testing.assert_array_equal(_host(s_out.ptr, np.float32, (3,)), want[3]["s"])
    with pytest.raises(kiln.ShapeError, match="destination of output 'y' for part 1 has shape"):
        context.infer_batch(feeds, pad_to=8, destinations=[{}, {"y": s_out}, {}, {}])


def test_many_device_parts_gather_and_deliver_through_one_segment_kernel_each(setup) -> None:
    """A batch of requests in CUDA shared memory: a copy per request and tensor, so one copy_segments launch
    gathers them and one delivers the outputs, each reading its slot's table."""
    reference, context, fake = setup
    parts = [_part(30 + i, 1 + i % 2) for i in range(5)]  # 7 rows; 10 input copies
    want = reference.infer_batch(parts, pad_to=8)
    feeds = [{name: _device(fake, value) for name, value in part.items()} for part in parts]
    outs = [_device(fake, np.full((p["x"].shape[0], 3), np.nan, np.float32)) for p in parts]
    keys = [_device(fake, np.zeros((p["x"].shape[0], *want[0]["k"].shape[1:]), want[0]["k"].dtype)) for p in parts]
    for _ in range(2):  # the second run reuses the tables
        fake.calls.clear()
        got = context.infer_batch(feeds, pad_to=8, destinations=[{"y": y, "k": k} for y, k in zip(outs, keys)])
        calls = _io(fake.calls)
        assert calls.count("segments x10") == 2 and calls[-2:] == ["done", "wait"]  # gathers, deliveries
        assert calls.index("segments x10") < calls.index("run") < len(calls) - 1 - calls[::-1].index("segments x10")
        for index, (g, w) in enumerate(zip(got, want)):
            assert list(g) == ["s"]
            np.testing.assert_array_equal(_host(outs[index].ptr, np.float32, w["y"].shape), w["y"])
            np.testing.assert_array_equal(_host(keys[index].ptr, w["k"].dtype, w["k"].shape), w["k"])


def test_device_copies_go_one_call_each_where_the_driver_has_no_batch_copy(fake, monkeypatch, caplog) -> None:
    monkeypatch.delattr(FakeDriver, "cuMemcpyBatchAsync")
    src, dst = (fake.cuMemAlloc(16)[1] for _ in range(2))
    ctypes.memmove(src, b"0123456789abcdef", 16)
    runner_staging.memcpy_dtod_batch([(dst, src, 8), (dst + 8, src + 8, 8), (dst, src, 0)], 0x5000)
    runner_staging.memcpy_dtod_batch([(dst, src, 4), (dst + 4, src, 4)], 0x5000)
    assert fake.calls == ["DtoD"] * 4 and ctypes.string_at(dst, 8) == b"01230123"
    assert runner_staging._BatchCopies.usable is False
    assert [r.message for r in caplog.records].count(next(r.message for r in caplog.records)) == 1  # said once


def test_infer_batch_at_a_padded_total_shares_infer_buffers_and_warm_up_stops_once_captured(setup) -> None:
    reference, context, fake = setup
    context.warm_up({"x": (8, 3), "ids": (8, 2)})
    # eager, then "captured" in slot 0; captured at once in slot 1; a batch gathered on the device in each slot
    # (captured in slot 0: the slots share the device buffers), which also made each slot's copy tables
    assert fake.calls.count("run") == 5 and fake.calls.count("segments x16") == 4  # 8 rows of two tensors each way
    assert set(context._backend_context._copy_tables) == {(0, "gather"), (1, "gather"), (0, "deliver"),
                                                          (1, "deliver")}
    (binding,) = context._backend_context._bindings.values()
    addresses = {name: stage.device.ptr for name, stage in binding.stages.items()}
    context.infer_batch([_part(5, 3), _part(6, 4)], pad_to=8)
    context.infer(_part(7, 8))
    assert len(context._backend_context._bindings) == 1 and len(binding.graphs) == runner.STAGING_SLOTS + 1  # none new
    assert {name: stage.device.ptr for name, stage in binding.stages.items()} == addresses
    (twin, _), = binding.twins.values()  # slot 1: the same device buffers, mirrors of its own
    assert {name: stage.device.ptr for name, stage in twin.items()} == addresses
    assert not {stage.host.ptr for stage in twin.values()} & {stage.host.ptr for stage in binding.stages.values()}


def test_a_second_thread_gathers_and_runs_while_the_first_waits_for_its_run(setup, monkeypatch) -> None:
    """Two threads on one context (a server's pipelined worker): the second fills its own slot's mirrors and
    enqueues its run while the first still waits for its run's event; both get their own rows back."""
    reference, context, fake = setup
    second_enqueued = threading.Event()
    recorded: list[str] = []

    def record(event, stream):
        recorded.append(event)
        if len(recorded) == 2:
            second_enqueued.set()
        return (0,)

    def wait(event):
        if event == recorded[0]:  # the first run "completes" only once the second run was enqueued beside it
            assert second_enqueued.wait(5), "the second run could not start while the first was in flight"
        return (0,)

    monkeypatch.setattr(fake, "cuEventRecord", record, raising=False)
    monkeypatch.setattr(fake, "cuEventSynchronize", wait, raising=False)
    batches = [[_part(20, 3), _part(21, 2)], [_part(22, 1), _part(23, 4), _part(24, 1)]]
    results: dict[int, list] = {}

    def run(index: int) -> None:
        results[index] = context.infer_batch(batches[index], pad_to=8)

    first = threading.Thread(target=run, args=(0,))
    first.start()
    while not recorded:
        time.sleep(0.001)
    second = threading.Thread(target=run, args=(1,))
    second.start()
    first.join(10)
    second.join(10)
    assert len(recorded) == 2 and recorded[0] != recorded[1]  # one event per slot
    for index, parts in enumerate(batches):
        for got, want in zip(results[index], reference.infer_batch(parts, pad_to=8)):
            for name in want:
                np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_a_default_stream_run_forks_onto_the_context_stream_and_joins_back(fake, monkeypatch) -> None:
    state = runner.CudaContextState(types.SimpleNamespace(plan=None))
    ran = []
    monkeypatch.setattr(state, "_execute_on", lambda shapes, addresses, stream, *rest: ran.append(stream))
    for _ in range(2):
        state.execute({}, {}, 0)
    assert ran == [0x5000, 0x5000]
    run = ["record event1 on 0x0", "0x5000 waits event1", "record event2 on 0x5000", "0x0 waits event2"]
    assert fake.calls == ["event", *run[:2], "event", *run[2:], *run]  # two events, made once
    fake.calls.clear()
    state.execute({}, {}, 0x7000)  # a created stream: no fork
    assert ran[-1] == 0x7000 and fake.calls == []

    def fail(*args):
        raise runner.ExecutionError("layer failed")

    monkeypatch.setattr(state, "_execute_on", fail)
    with pytest.raises(runner.ExecutionError, match="layer failed"):
        state.execute({}, {}, 0)
    assert fake.calls[-2:] == run[2:]  # the caller's stream still joins what was enqueued
