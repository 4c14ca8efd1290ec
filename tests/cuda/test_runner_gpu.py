"""CUDA runner features on the device: weight streaming (outputs equal the fully resident run at
every budget, through eager runs, capture and graph replay, and after a refit), the debug listener
(device pointers whose bytes equal the CPU backend's intermediates) and the input-consumed event."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from onnx import TensorProto, helper

import engine_core as kiln
from engine_core.types import BuilderFlag, TensorLocation
from tests.cuda.models import _model, build_engine, mlp, vi

pytestmark = pytest.mark.gpu

PROFILE = {"x": ((1, 64), (8, 64), (32, 64))}


def _build(model, backend="cuda", flags=(), profiles=PROFILE, debug=()):
    return build_engine(model, backend, profiles, flags=flags, debug=debug)


def _driver():
    from cuda.bindings import driver

    from engine_core.cuda.driver import check

    return driver, check


def _feeds(seed: int, batch: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((batch, 64)).astype(np.float32)}


def _runs(context, feeds_list):
    """infer() on the context's own stream: run 1 eager, run 2 captured, runs 3+ replayed."""
    return [context.infer(feeds)["y"] for feeds in feeds_list]


# -- weight streaming -------------------------------------------------------------------------------------


def test_streaming_at_every_budget_equals_the_resident_run():
    engine = _build(mlp(), flags=[BuilderFlag.WEIGHT_STREAMING])
    total = engine.streamable_weights_size
    assert total > 0
    feeds = [_feeds(seed, batch) for seed, batch in enumerate((5, 5, 5, 5, 32, 1))]
    resident_ctx = engine.create_execution_context()
    assert resident_ctx._backend_context.engine.host_weights == {}
    want = _runs(resident_ctx, feeds)
    del resident_ctx
    gc.collect()
    for budget in (0, total // 2, total, engine.get_weight_streaming_automatic_budget()):
        engine.weight_streaming_budget_v2 = budget
        streamed = engine._streamed_weights()
        context = engine.create_execution_context()
        state = context._backend_context.engine
        assert set(state.host_weights) >= streamed and not streamed & set(state.weights), budget
        assert bool(streamed) == (budget < total)
        for got, expected in zip(_runs(context, feeds), want):
            np.testing.assert_array_equal(got, expected, err_msg=f"budget {budget}")
        if streamed:
            binding = next(b for b in context._backend_context._bindings.values() if b.graphs)  # the capture included uploads
            assert not binding.graph_failed and binding.schedule().uses_copy_stream
        del context
        gc.collect()


def test_streamed_execute_async_v3_and_refit_update_the_host_copies():
    driver, check = _driver()
    from engine_core.cuda.driver import DeviceBuffer

    # one plan loaded twice: two builds may time different fp32 GEMM tactics, whose sums differ in the last bits
    # (seen when this test ran after others on the same GPU)
    plan = bytes(_build(mlp(), flags=[BuilderFlag.WEIGHT_STREAMING, BuilderFlag.REFIT]).serialize())
    streamed_engine, resident_engine = kiln.Runtime().load(plan), kiln.Runtime().load(plan)
    streamed_engine.weight_streaming_budget_v2 = 0
    stream = int(check(driver.cuStreamCreate(0), "cuStreamCreate"))
    x = _feeds(7, 8)["x"]
    dx, dy = DeviceBuffer.from_array(x), DeviceBuffer(8 * 32 * 4)
    contexts = [e.create_execution_context() for e in (streamed_engine, resident_engine)]
    assert contexts[0]._backend_context.engine.streamed and not contexts[1]._backend_context.engine.streamed

    def run(ctx) -> np.ndarray:
        ctx.set_input_shape("x", x.shape)
        ctx.set_tensor_address("x", dx.ptr)
        ctx.set_tensor_address("y", dy.ptr)
        assert ctx.execute_async_v3(stream)
        check(driver.cuStreamSynchronize(stream), "cuStreamSynchronize")
        return dy.to_array(np.float32, (8, 32))

    for _ in range(3):  # eager, captured, replayed
        np.testing.assert_array_equal(run(contexts[0]), run(contexts[1]))
    w1 = np.random.default_rng(11).standard_normal((256, 64)).astype(np.float32) / 8
    for engine in (streamed_engine, resident_engine):
        refitter = kiln.Refitter(engine)
        assert refitter.set_named_weights("w1", w1) and refitter.refit_cuda_engine()
    for _ in range(3):
        got, want = run(contexts[0]), run(contexts[1])
        np.testing.assert_array_equal(got, want)
    before = kiln.Runtime().load(plan).create_execution_context().infer({"x": x})["y"]
    assert not np.array_equal(got, before)  # the refit really changed the outputs


# -- debug listener ---------------------------------------------------------------------------------------


class DeviceRecorder(kiln.IDebugListener):
    """Copies each debug tensor to the host inside the callback, on the stream it was given."""

    def __init__(self):
        self.seen = []

    def process_debug_tensor(self, addr, location, type, shape, name, stream):
        driver, check = _driver()
        out = np.empty(shape, np.float32)
        if location == TensorLocation.DEVICE:
            check(driver.cuMemcpyDtoHAsync(out.ctypes.data, addr, out.nbytes, stream), "DtoH")
            check(driver.cuStreamSynchronize(stream), "cuStreamSynchronize")
        else:
            import ctypes

            out[...] = np.frombuffer((ctypes.c_char * out.nbytes).from_address(addr), np.float32).reshape(shape)
        self.seen.append((name, location, type, tuple(shape), out))
        return True


def test_debug_listener_gets_device_pointers_equal_to_cpu_intermediates():
    debug = ["h", "r"]
    gpu = _build(mlp(), debug=debug, flags=[BuilderFlag.WEIGHT_STREAMING])
    gpu.weight_streaming_budget_v2 = 0  # debug runs with streamed weights too
    cpu = _build(mlp(), backend="cpu", debug=debug)
    gctx, cctx = gpu.create_execution_context(), cpu.create_execution_context()
    glisten, clisten = DeviceRecorder(), DeviceRecorder()
    for ctx, listener in ((gctx, glisten), (cctx, clisten)):
        assert ctx.set_debug_listener(listener) and ctx.set_all_tensors_debug_state(True)
    for seed in range(3):  # three runs on one stream: with a listener, never a replay that skips callbacks
        feeds = _feeds(seed, 6)
        np.testing.assert_allclose(gctx.infer(feeds)["y"], cctx.infer(feeds)["y"], rtol=1e-4, atol=1e-6)
    assert [s[:4] for s in glisten.seen] == [(n, TensorLocation.DEVICE, kiln.DataType.FLOAT, (6, 256))
                                             for _ in range(3) for n in debug]
    assert [s[0] for s in clisten.seen] == [s[0] for s in glisten.seen]
    for got, want in zip(glisten.seen, clisten.seen):
        np.testing.assert_allclose(got[4], want[4], rtol=1e-4, atol=1e-5, err_msg=got[0])
    assert all(not b.graphs for b in gctx._backend_context._bindings.values())
    glisten.seen.clear()
    assert gctx.set_tensor_debug_state("h", False)
    gctx.infer(_feeds(9, 6))
    assert [s[0] for s in glisten.seen] == ["r"]


# -- input-consumed event ---------------------------------------------------------------------------------


def deep_chain(d: int = 2048, layers: int = 12):
    """x is read by the first layer only; the rest is long enough to time against."""
    rng = np.random.default_rng(5)
    n, nodes, inits, prev = helper.make_node, [], [], "x"
    for i in range(layers):
        inits.append((f"W{i}", (rng.standard_normal((d, d)) / np.sqrt(d)).astype(np.float32)))
        nodes += [n("MatMul", [prev, f"W{i}"], [f"m{i}"], name=f"mm{i}"), n("Tanh", [f"m{i}"], [f"t{i}"], name=f"t{i}")]
        prev = f"t{i}"
    nodes.append(n("Identity", [prev], ["y"], name="out"))
    return _model(nodes, [vi("x", TensorProto.FLOAT, ["B", d])], [vi("y", TensorProto.FLOAT, ["B", d])], inits)


def test_input_consumed_event_fires_after_the_first_layer_and_inputs_may_be_refilled():
    driver, check = _driver()
    from engine_core.cuda.driver import DeviceBuffer

    d, batch = 2048, 1024
    engine = _build(deep_chain(d), profiles={"x": ((1, d), (batch, d), (batch, d))})
    ctx = engine.create_execution_context()
    stream = int(check(driver.cuStreamCreate(0), "cuStreamCreate"))
    other = int(check(driver.cuStreamCreate(1), "cuStreamCreate"))
    start, consumed, end = (check(driver.cuEventCreate(0), "cuEventCreate") for _ in range(3))
    assert ctx.set_input_consumed_event(int(consumed)) and ctx.get_input_consumed_event() == int(consumed)
    x = np.random.default_rng(1).standard_normal((batch, d)).astype(np.float32)
    want = engine.create_execution_context().infer({"x": x})["y"]  # not this context: its runs must start eager
    dx, dy = DeviceBuffer(x.nbytes), DeviceBuffer(x.nbytes)
    ctx.set_input_shape("x", x.shape)
    ctx.set_tensor_address("x", dx.ptr)
    ctx.set_tensor_address("y", dy.ptr)
    for run in range(4):  # eager, captured (external event node), replayed twice
        dx.copy_from(x)
        check(driver.cuEventRecord(start, stream), "record")
        assert ctx.execute_async_v3(stream)
        check(driver.cuEventRecord(end, stream), "record")
        # refill the input as soon as the engine says it was consumed: the results must not change
        check(driver.cuStreamWaitEvent(other, consumed, 0), "wait")
        check(driver.cuMemsetD32Async(dx.ptr, 0x7FC00000, x.size, other), "memset NaN")
        check(driver.cuStreamSynchronize(stream), "sync")
        check(driver.cuStreamSynchronize(other), "sync")
        to_consumed = check(driver.cuEventElapsedTime(start, consumed), "elapsed")
        total = check(driver.cuEventElapsedTime(start, end), "elapsed")
        # (run 0 creates library handles and run 1 captures the CUDA graph on the host between the events:
        # only replays are timed)
        assert 0 <= to_consumed and (run < 2 or to_consumed < 0.5 * total), (run, to_consumed, total)
        np.testing.assert_array_equal(dy.to_array(np.float32, (batch, d)), want)
    assert any(b.graphs for b in ctx._backend_context._bindings.values())
