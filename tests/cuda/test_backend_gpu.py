"""CUDA backend on the device: engine outputs vs the CPU backend (same plan inputs), with stated
tolerances (fp32 everywhere; cuBLAS in pure fp32 mode, so differences are summation order only)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

import engine_core as kiln
from engine_core.types import LayerInformationFormat
from tests.cuda.models import (
    attention_feeds,
    attention_fp16,
    attention_model,
    bert_feeds,
    bert_small,
    cnn_fp16,
    mlp,
    op_mix,
    resnet_small,
)

pytestmark = pytest.mark.gpu


def _build(model, backend: str, profiles: dict | None = None, flags=(), cache=None, level: int = 3):
    builder = kiln.Builder()
    net = builder.create_network()
    kiln.OnnxParser(net).parse(model)
    cfg = builder.create_builder_config()
    cfg.backend = backend
    cfg.builder_optimization_level = level
    cfg.clear_flag(kiln.BuilderFlag.TF32)  # strict fp32 unless ``flags`` ask for TF32 (a new config allows it)
    for flag in flags:
        cfg.set_flag(flag)
    if cache is not None:
        assert cfg.set_timing_cache(cache)
    if profiles:
        prof = builder.create_optimization_profile()
        for name, (lo, opt, hi) in profiles.items():
            prof.set_shape(name, lo, opt, hi)
        cfg.add_optimization_profile(prof)
    return kiln.Runtime().load(kiln.build_plan(net, cfg))


def _both(model, feeds_list, profiles=None):
    gpu, cpu = _build(model, "cuda", profiles), _build(model, "cpu", profiles)
    gctx, cctx = gpu.create_execution_context(), cpu.create_execution_context()
    return gpu, [(gctx.infer(f), cctx.infer(f)) for f in feeds_list]


def _close_to_scale(got, want, fraction):
    for name in want:
        scale = float(np.abs(want[name]).max())
        assert float(np.abs(got[name] - want[name]).max()) <= fraction * scale, name


def _close(got, want, rtol, atol):
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=atol, err_msg=name)


def test_default_backend_is_cuda_here():
    assert kiln.Builder().create_builder_config().backend == "cuda"


def test_mlp_matches_cpu_backend_at_several_batches():
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.standard_normal((b, 64)).astype(np.float32)} for b in (1, 7, 64)]
    engine, results = _both(mlp(), feeds, {"x": ((1, 64), (16, 64), (64, 64))})
    for got, want in results:
        _close(got, want, rtol=1e-4, atol=1e-6)
    assert engine.plan.arch.startswith("sm_") and "pointwise" in engine.plan.kernels
    tactics = {layer["name"]: layer["tactic"] for layer in engine.plan.layers}
    assert tactics["fc1"] in ("gemm:cublas", "gemm:kiln_gemm", "gemm:cublaslt") and tactics["softmax"] == "kernel:Softmax"


def test_op_mix_matches_cpu_backend_and_host_fallback_is_visible():
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((2, 5, 6)).astype(np.float32), "ids": np.array([[1, 2, 3], [9, 0, -1]])}
    engine, [(got, want)] = _both(op_mix(), [feeds])
    _close(got, want, rtol=1e-4, atol=1e-5)
    inspector = engine.create_engine_inspector()
    layers = json.loads(inspector.get_engine_information(LayerInformationFormat.JSON))["layers"]
    assert [layer["name"] for layer in layers if layer["tactic"] == "host"] == ["cumsum_host"]


@pytest.mark.parametrize("tactic", ["cublas", "kiln_gemm"])
def test_both_gemm_tactics_compute_the_same(tactic):
    rng = np.random.default_rng(2)
    feeds = {"x": rng.standard_normal((2, 5, 6)).astype(np.float32), "ids": np.array([[0, 4, 3], [9, 0, -2]])}
    engine = _build(op_mix(), "cuda")
    engine.backend_state.gemm_choice = {layer["name"]: tactic for layer in engine.plan.layers
                               if layer["tactic"].startswith("gemm:")}
    got = engine.create_execution_context().infer(feeds)
    want = _build(op_mix(), "cpu").create_execution_context().infer(feeds)
    _close(got, want, rtol=1e-4, atol=1e-5)


def test_bert_small_matches_cpu_backend():
    profiles = {n: ((1, 8), (2, 64), (4, 128)) for n in ("input_ids", "attention_mask", "token_type_ids")}
    engine, results = _both(bert_small(), [bert_feeds(2, 128), bert_feeds(1, 8, seed=1), bert_feeds(4, 33, seed=2)],
                            profiles)
    for got, want in results:
        _close(got, want, rtol=1e-4, atol=2e-5)
    info = engine.plan.build_info["cuda"]
    assert info["host_layers"] == []
    assert 0 < engine.device_memory_size < info["activation_bytes_unshared"]
    print(f"\nbert_small: device_memory_size={engine.device_memory_size} "
          f"unshared={info['activation_bytes_unshared']} gemm_timings_ms={info['gemm_timings_ms']}")


def test_execute_async_v3_with_device_pointers_and_two_contexts():
    from cuda.bindings import driver

    from engine_core.cuda.driver import DeviceBuffer, check

    rng = np.random.default_rng(3)
    engine = _build(mlp(), "cuda", {"x": ((1, 64), (8, 64), (32, 64))})
    want = _build(mlp(), "cpu", {"x": ((1, 64), (8, 64), (32, 64))}).create_execution_context()
    stream = int(check(driver.cuStreamCreate(0), "cuStreamCreate"))
    contexts = [engine.create_execution_context() for _ in range(2)]
    assert contexts[0]._backend_context.engine.weights is contexts[1]._backend_context.engine.weights  # weights once per engine
    for ctx, batch in zip(contexts, (3, 32)):
        x = rng.standard_normal((batch, 64)).astype(np.float32)
        dx, dy = DeviceBuffer.from_array(x), DeviceBuffer(batch * 32 * 4)
        assert ctx.set_input_shape("x", x.shape)
        assert ctx.get_tensor_shape("y") == (batch, 32)
        ctx.set_tensor_address("x", dx.ptr)
        ctx.set_tensor_address("y", dy.ptr)
        for _ in range(3):  # eager, captured, replayed: all write the same numbers
            dy.copy_from(np.zeros((batch, 32), np.float32))
            assert ctx.execute_async_v3(stream)
            check(driver.cuStreamSynchronize(stream), "cuStreamSynchronize")
            np.testing.assert_allclose(dy.to_array(np.float32, (batch, 32)), want.infer({"x": x})["y"],
                                       rtol=1e-4, atol=1e-6)


def test_cuda_graph_replay_reads_new_inputs_each_run():
    profiles = {n: ((1, 8), (2, 32), (2, 64)) for n in ("input_ids", "attention_mask", "token_type_ids")}
    gpu, cpu = _build(bert_small(), "cuda", profiles), _build(bert_small(), "cpu", profiles)
    gctx, cctx = gpu.create_execution_context(), cpu.create_execution_context()
    for seed in range(4):  # run 1 eager, run 2 captured, runs 3-4 replayed with new data in the same buffers
        feeds = bert_feeds(2, 32, seed=seed)
        _close(gctx.infer(feeds), cctx.infer(feeds), rtol=1e-4, atol=2e-5)
    (binding,) = gctx._backend_context._bindings.values()
    assert len(binding.graphs) == 1 and not binding.graph_failed


def test_plans_with_host_layers_never_capture():
    rng = np.random.default_rng(4)
    engine = _build(op_mix(), "cuda")
    ctx = engine.create_execution_context()
    for _ in range(3):
        ctx.infer({"x": rng.standard_normal((2, 5, 6)).astype(np.float32), "ids": np.array([[1, 2, 3], [9, 0, -1]])})
    (binding,) = ctx._backend_context._bindings.values()
    assert binding.has_host and not binding.graphs


def test_profiler_reports_every_device_layer():
    class Collect(kiln.IProfiler):
        def __init__(self):
            self.times = {}

        def report_layer_time(self, layer_name, ms):
            self.times[layer_name] = ms

    engine = _build(mlp(), "cuda", {"x": ((1, 64), (8, 64), (32, 64))})
    ctx = engine.create_execution_context()
    ctx.profiler = Collect()
    x = np.random.default_rng(5).standard_normal((4, 64)).astype(np.float32)
    want = _build(mlp(), "cpu", {"x": ((1, 64), (8, 64), (32, 64))}).create_execution_context().infer({"x": x})
    _close(ctx.infer({"x": x}), want, rtol=1e-4, atol=1e-6)
    assert set(ctx.profiler.times) == {"fc1", "fc2", "softmax"}  # Relu, bias add and Tanh fused into the GEMMs
    assert all(0 <= ms < 100 for ms in ctx.profiler.times.values())


def test_resnet_small_runs_on_cudnn_channels_last_and_matches_cpu():
    rng = np.random.default_rng(6)
    profiles = {"input": ((1, 3, 64, 64), (2, 3, 64, 64), (4, 3, 64, 64))}
    feeds = [{"input": rng.standard_normal((b, 3, 64, 64)).astype(np.float32)} for b in (1, 4, 4, 4)]
    engine, results = _both(resnet_small(), feeds, profiles)
    for got, want in results:  # random weights give logits in the thousands: error relative to their scale
        _close_to_scale(got, want, 1e-5)
    tactics = [layer["tactic"] for layer in engine.plan.layers]
    assert "host" not in tactics and tactics.count("conv:cudnn") > 10


def test_tf32_flag_reaches_gemm_and_conv():
    rng = np.random.default_rng(7)
    profiles = {"input": ((1, 3, 64, 64), (2, 3, 64, 64), (2, 3, 64, 64))}
    x = {"input": rng.standard_normal((2, 3, 64, 64)).astype(np.float32)}
    engine = _build(resnet_small(), "cuda", profiles, flags=[kiln.BuilderFlag.TF32])
    assert engine.plan.build_info["cuda"]["lowering"]["tf32"] is True
    want = _build(resnet_small(), "cpu", profiles).create_execution_context().infer(x)
    _close_to_scale(engine.create_execution_context().infer(x), want, 3e-3)  # TF32: 10-bit mantissa


def test_fp16_cnn_and_attention_match_the_cpu_backend():
    rng = np.random.default_rng(8)
    x = {"x": rng.standard_normal((2, 3, 16, 16)).astype(np.float16)}
    profiles = {"x": ((1, 3, 16, 16), (2, 3, 16, 16), (4, 3, 16, 16))}
    engine, [(got, want)] = _both(cnn_fp16(), [x], profiles)
    _close({k: v.astype(np.float32) for k, v in got.items()}, {k: v.astype(np.float32) for k, v in want.items()},
           rtol=2e-2, atol=2e-2)
    feeds = {n: rng.standard_normal((2, 4, 16, 32)).astype(np.float16) for n in "qkv"}
    feeds["mask"] = np.where(rng.random((2, 1, 16, 16)) < 0.2, -10000, 0).astype(np.float16)
    engine, [(got, want)] = _both(attention_fp16(causal=1), [feeds])
    np.testing.assert_allclose(got["y"].astype(np.float32), want["y"].astype(np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("case", [
    dict(three_d=True, heads=12, seq=128, dim=64),                                  # BERT-base's shape, fp16
    dict(three_d=True, heads=12, seq=128, dim=64, mask="row"),                      # ... with its padding mask
    dict(seq=77, kv_seq=200, dim=128, mask="row"),                                  # ragged key tiles, rows past Sq
    dict(seq=96, kv_seq=160, dim=64, mask="bool"),                    # boolean rows streamed raw, a ragged key tile
    dict(seq=70, kv_seq=136, dim=32),                                 # additive [B, 1, Sq, Skv] rows streamed raw
    dict(causal=1, seq=100, dim=32),
    dict(dtype=onnx.TensorProto.BFLOAT16, dim=128, seq=200, kv_seq=150, mask="bool"),
    dict(dtype=onnx.TensorProto.FLOAT, three_d=True, heads=8, kv_heads=2, seq=70),   # TF32, grouped-query
    dict(dtype=onnx.TensorProto.FLOAT, dim=128, seq=64, causal=1, mask=""),          # TF32, 32-key tiles
])
def test_flash_attention_matches_the_cpu_backend(case, monkeypatch):
    """The fused kernel (mma.sync fp16/bf16/TF32, online softmax) against the CPU backend in fp64-accurate
    numpy; fp16/bf16/TF32 operands give errors of a few 1e-3 on outputs of magnitude ~1. Built without cuDNN, which
    would run the fp16/bf16 cases through its SDPA instead (test_cudnn_attention_gpu.py)."""
    monkeypatch.setattr("engine_core.backends.cuda.cudnn_conv.available", lambda: False)
    model = attention_model(**case)
    feeds = attention_feeds(model, np.random.default_rng(11), masked_from=case.get("kv_seq", case["seq"]) // 2)
    fp32 = case.get("dtype") == onnx.TensorProto.FLOAT
    gpu = _build(model, "cuda", flags=[kiln.BuilderFlag.TF32] if fp32 else [])
    assert {layer["name"]: layer["tactic"] for layer in gpu.plan.layers}["attention"] == "kernel:flash_attention"
    got = gpu.create_execution_context().infer(feeds)["y"].astype(np.float32)
    want = _build(model, "cpu").create_execution_context().infer(feeds)["y"].astype(np.float32)
    tol = 2e-2 if case.get("dtype") == onnx.TensorProto.BFLOAT16 else 5e-3
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_a_warm_timing_cache_skips_timing():
    cache = kiln.Builder().create_builder_config().create_timing_cache(b"")
    profiles = {"x": ((1, 64), (16, 64), (64, 64))}
    # optimization level 0: the GEMMs stay plain (fused ones run cuBLASLt epilogues and are not timed)
    first = _build(mlp(), "cuda", profiles, cache=cache, level=0).plan.build_info["cuda"]["timing_cache"]
    assert first["misses"] == 2 and len(cache) == 2
    blob = cache.serialize()
    warm = kiln.Builder().create_builder_config().create_timing_cache(blob)
    second = _build(mlp(), "cuda", profiles, cache=warm, level=0).plan.build_info["cuda"]["timing_cache"]
    assert second == {"hits": 2, "misses": 0}


def test_user_managed_device_memory_and_output_allocator():
    from cuda.bindings import driver

    from engine_core.cuda.driver import DeviceBuffer, check
    from engine_core.types import ExecutionContextAllocationStrategy

    class Allocator(kiln.IOutputAllocator):
        def __init__(self):
            super().__init__()
            self.buffers, self.shapes = {}, {}

        def reallocate_output_async(self, name, memory, size, alignment, stream):
            self.buffers[name] = DeviceBuffer(max(size, 1))
            return self.buffers[name].ptr

        def notify_shape(self, name, shape):
            self.shapes[name] = shape

    profiles = {"x": ((1, 64), (8, 64), (32, 64))}
    engine = _build(mlp(), "cuda", profiles)
    ctx = engine.create_execution_context(ExecutionContextAllocationStrategy.USER_MANAGED)
    x = np.random.default_rng(9).standard_normal((5, 64)).astype(np.float32)
    dx = DeviceBuffer.from_array(x)
    ctx.set_input_shape("x", x.shape)
    ctx.set_tensor_address("x", dx.ptr)
    allocator = Allocator()
    ctx.set_output_allocator("y", allocator)
    stream = int(check(driver.cuStreamCreate(0), "cuStreamCreate"))
    assert not ctx.execute_async_v3(stream)  # no device memory given yet: a clear failure, not a crash
    memory = DeviceBuffer(engine.device_memory_size)
    ctx.set_device_memory(memory.ptr, memory.nbytes)
    assert ctx.execute_async_v3(stream)
    check(driver.cuStreamSynchronize(stream), "cuStreamSynchronize")
    want = _build(mlp(), "cpu", profiles).create_execution_context().infer({"x": x})["y"]
    assert allocator.shapes["y"] == (5, 32)
    np.testing.assert_allclose(allocator.buffers["y"].to_array(np.float32, (5, 32)), want, rtol=1e-4, atol=1e-6)
    assert ctx._backend_context.arena.ptr == memory.ptr
