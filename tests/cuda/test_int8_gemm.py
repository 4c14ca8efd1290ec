"""``kiln.QMatMul`` on the CUDA backend: the INT8 GEMM lowering (engine_core/backends/cuda/int8_gemm.py).

Without a GPU: the lowered steps (Int8Gemm + dequantizing epilogue kernel) run through the numpy emulator
and must equal the CPU backend bit for bit (int32 sums are exact, the epilogue keeps the CPU op's order).
With a GPU (``-m gpu``): a Q/DQ MLP and tools/make_models.py's small bert_qdq against the CPU backend.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import engine_core as kiln
from engine_core.backends.cuda import lowering
from engine_core.backends.cuda.int8_gemm import Fp8Gemm, Int8Gemm, lower_qmatmul
from engine_core.backends.cuda.pointwise import PointwiseKernel, PwNode, Unsupported
from engine_core.interpret import GraphRunner
from engine_core.ir import Graph, Node
from engine_core.ops import TensorInfo
from engine_core.passes import PIPELINE
from engine_core.passes.fuse_qdq_matmul import fuse_qdq_matmul, requantizes
from tests.cuda.emulate import Emulator
from tests.cuda.models import bert_feeds, build_engine, lowered_at, optimized_graph, pipeline_lowered, small_model

_WIRED = fuse_qdq_matmul in PIPELINE and "QMatMul" in lowering._LOWER and hasattr(Emulator, "_int8gemm")
needs_wiring = pytest.mark.skipif(not _WIRED, reason="QMatMul is not wired into the pipeline / lowering yet")


def _mlp_model(name: str, inits: dict[str, np.ndarray], din: int, dout: int, dq_w1: tuple[list[str], dict],
               dq_w2: tuple[list[str], dict]) -> onnx.ModelProto:
    """x -> Q/DQ -> MatMul(DQ(w1)) + b1 -> Relu -> Q/DQ -> Gemm(transB, DQ(w2)) + b2 -> Gelu -> y over ``inits``;
    ``dq_w1`` / ``dq_w2``: each weight DequantizeLinear's inputs and attributes (zero point, axis)."""
    n = helper.make_node
    nodes = [n("QuantizeLinear", ["x", "s_x", "zero"], ["xq"], name="q_x"),
             n("DequantizeLinear", ["xq", "s_x", "zero"], ["xd"], name="dq_x"),
             n("DequantizeLinear", dq_w1[0], ["w1d"], name="dq_w1", **dq_w1[1]),
             n("MatMul", ["xd", "w1d"], ["h"], name="fc1"), n("Add", ["h", "b1"], ["hb"], name="bias1"),
             n("Relu", ["hb"], ["r"], name="relu"),
             n("QuantizeLinear", ["r", "s_h", "zero"], ["rq"], name="q_h"),
             n("DequantizeLinear", ["rq", "s_h", "zero"], ["rd"], name="dq_h"),
             n("DequantizeLinear", dq_w2[0], ["w2d"], name="dq_w2", **dq_w2[1]),
             n("Gemm", ["rd", "w2d", "b2"], ["g"], transB=1, name="fc2"), n("Gelu", ["g"], ["y"], name="gelu")]
    graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", din])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", dout])],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def qdq_mlp(din: int = 64, hidden: int = 96, dout: int = 32, seed: int = 0) -> onnx.ModelProto:
    """x[B, din] -> Q/DQ -> MatMul(per-column int8 W) + bias + Relu -> Q/DQ -> Gemm(transB, per-tensor W)
    + bias -> Gelu -> y: both weight layouts and both scale kinds."""
    rng = np.random.default_rng(seed)
    w1 = rng.integers(-127, 128, (din, hidden)).astype(np.int8)
    w2 = rng.integers(-127, 128, (dout, hidden)).astype(np.int8)
    inits = {"w1": w1, "w1_scale": rng.uniform(0.002, 0.01, hidden).astype(np.float32), "w1_zero": np.zeros(hidden, np.int8),
             "b1": (0.1 * rng.standard_normal(hidden)).astype(np.float32), "w2": w2,
             "w2_scale": np.array(0.004, np.float32), "b2": (0.1 * rng.standard_normal(dout)).astype(np.float32),
             "s_x": np.array(0.03, np.float32), "s_h": np.array(0.05, np.float32), "zero": np.array(0, np.int8)}
    return _mlp_model("qdq_mlp", inits, din, dout, (["w1", "w1_scale", "w1_zero"], {"axis": 1}), (["w2", "w2_scale"], {}))


# -- host emulation of the lowered steps --------------------------------------------------------------


def _lowered_build(model: onnx.ModelProto, feeds: dict[str, np.ndarray], flag: kiln.BuilderFlag | None):
    """The builder's optimized graph (precision pass included), lowered for the CUDA backend."""
    graph = optimized_graph(model, feeds, flag)
    return graph, lowered_at(graph, feeds)


@needs_wiring
@pytest.mark.parametrize("batch", [1, 7])
def test_emulated_int8_gemm_steps_equal_the_cpu_backend(batch):
    x = np.random.default_rng(batch).standard_normal((batch, 64)).astype(np.float32)
    graph, lowered = pipeline_lowered(qdq_mlp(), {"x": x})
    steps = {s.node.name: s for s in lowered.steps}
    assert {s.node.op_type for s in lowered.steps} >= {"QMatMul"} and "host" not in lowered.tactics().values()
    for name, (n, k) in (("fc1", (96, 64)), ("fc2", (32, 96))):
        gemm = steps[name].ops[0]
        assert isinstance(gemm, Int8Gemm) and (gemm.m, gemm.n, gemm.k) == (batch, n, k)
    assert lowered.weight_transforms == {"w1#nk": ("w1", "nk")}  # MatMul's [K, N] weight as [N, K] rows, once
    # fc1's Relu output was read only by q_h: fc1 requantizes, its epilogue kernel stores int8 through the
    # pointwise QuantizeLinear, and fc2 reads that int8 tensor
    assert steps["fc1"].node.outputs == ["rq"] and "q_h" not in steps
    assert [n.op for n in _program(steps["fc1"])][-1] == "QuantizeLinear"
    assert lowered.infos["rq"].dtype == np.int8 and steps["fc2"].node.inputs[0] == "rq"
    got = Emulator(graph, lowered, {"x": x}).run()["y"]
    np.testing.assert_array_equal(got, GraphRunner(graph).run({"x": x})["y"])


def _program(step) -> list[PwNode]:
    """The pointwise program of a QMatMul step's epilogue kernel."""
    program = step.ops[1].program
    assert isinstance(program, PointwiseKernel)
    return list(program.nodes)


@needs_wiring
@pytest.mark.parametrize("flag", [kiln.BuilderFlag.FP16, kiln.BuilderFlag.BF16])
def test_emulated_reduced_precision_qdq_mlp_equals_the_cpu_backend(flag):
    """A 16-bit build: both GEMMs stay INT8 (fp32 scales, 16-bit results), fc1's epilogue rounds to the
    16-bit type before requantizing, exactly as the CPU op does."""
    x = np.random.default_rng(5).standard_normal((7, 64)).astype(np.float32)
    graph, lowered = _lowered_build(qdq_mlp(), {"x": x}, flag)
    tactics = lowered.tactics()
    assert tactics["fc1"] == tactics["fc2"] == "gemm:cublaslt_int8" and "host" not in tactics.values()
    steps = {s.node.name: s for s in lowered.steps}
    half = np.dtype(np.float16) if flag == kiln.BuilderFlag.FP16 else np.dtype("bfloat16")
    assert [(n.op, n.dtype) for n in _program(steps["fc1"])][-2:] == [("Cast", half),
                                                                              ("QuantizeLinear", np.int8)]
    assert lowered.infos[steps["fc2"].node.outputs[0]].dtype == half
    got = Emulator(graph, lowered, {"x": x}).run()["y"]
    np.testing.assert_array_equal(got, GraphRunner(graph).run({"x": x})["y"])


@needs_wiring
@pytest.mark.parametrize("flag", [None, kiln.BuilderFlag.FP16])
def test_emulated_bert_qdq_runs_every_linear_layer_as_int8(flag):
    """fp32 and FP16 builds: every linear layer an INT8 GEMM (13 = Q, K, V, output, two FFN per layer; the
    pooler), FFN1 (GELU -> FFN2's input quantization) requantizing, no host layers."""
    feeds = bert_feeds(2, 16)
    graph, lowered = _lowered_build(small_model("bert_qdq"), feeds, flag)
    qmatmuls = [s for s in lowered.steps if s.node.op_type == "QMatMul"]
    assert len(qmatmuls) == 2 * 6 + 1
    assert all(isinstance(s.ops[0], Int8Gemm) for s in qmatmuls) and "host" not in lowered.tactics().values()
    assert {lowered.tactics()[s.node.name] for s in qmatmuls} == {"gemm:cublaslt_int8"}
    requantizing = [s.node for s in qmatmuls if requantizes(s.node)]
    assert len(requantizing) == 2 and all(n.attr("activation") == "Gelu" for n in requantizing)
    assert not any(n.op_type in ("DequantizeLinear", "Cast") for n in graph.nodes if not n.name.startswith("reformat_"))
    got, want = Emulator(graph, lowered, feeds).run(), GraphRunner(graph).run(feeds)
    # fp32: measured equal (3 feeds); fp16: the emulated LayerNorm/attention (float64 math) round to other fp16
    # values than numpy's now and then, which can move a value across a QuantizeLinear boundary: measured
    # <= 0.42% of max|output| (3 feeds)
    tolerance = 1e-4 if flag is None else 1e-2
    for name, value in want.items():
        scale = float(np.abs(value).max())
        assert float(np.abs(got[name] - value).max()) <= tolerance * scale, name


def test_k_or_n_not_a_multiple_of_four_runs_on_the_host():
    """cuBLASLt's IMMA kernels need m and k multiples of 4: other shapes take the visible host path."""
    node = Node("QMatMul", ["x", "s", "w", "ws", ""], ["y"], {"transB": 1, "activation": ""}, "fc", "kiln", 1)
    i8, f32 = np.dtype(np.int8), np.dtype(np.float32)
    infos = {"x": TensorInfo(i8, (4, 6)), "s": TensorInfo(f32, ()), "w": TensorInfo(i8, (8, 6)),
             "ws": TensorInfo(f32, (8,)), "y": TensorInfo(f32, (4, 8))}
    graph = Graph(nodes=[node])
    ctx = lowering.LoweringContext(infos, frozenset({"y"}), {}, lowering.LoweringOptions(), graph.constants)
    with pytest.raises(Unsupported, match="multiples of 4"):
        lower_qmatmul(node, ctx)


# -- on the GPU -------------------------------------------------------------------------------------


def _int8_layers(engine) -> dict[str, str]:
    return {layer["name"]: layer["tactic"] for layer in engine.plan.layers if layer["type"] == "QMatMul"}


@pytest.mark.gpu
def test_bert_qdq_on_the_gpu_matches_the_cpu_backend():
    names = ("input_ids", "attention_mask", "token_type_ids")
    profiles = {n: ((1, 8), (2, 64), (4, 128)) for n in names}
    model = small_model("bert_qdq")
    gpu, cpu = build_engine(model, "cuda", profiles), build_engine(model, "cpu", profiles)
    tactics = _int8_layers(gpu)
    assert len(tactics) == 13 and "host" not in tactics.values(), tactics
    assert gpu.plan.build_info["cuda"]["host_layers"] == []
    gctx, cctx = gpu.create_execution_context(), cpu.create_execution_context()
    for feeds in (bert_feeds(2, 64), bert_feeds(1, 8, seed=1), bert_feeds(4, 33, seed=2)):
        got, want = gctx.infer(feeds), cctx.infer(feeds)
        for name in want:
            # float differences elsewhere (LayerNorm, softmax) can move a value across a QuantizeLinear
            # rounding boundary: one int8 step, so compare to the output's scale, not bit for bit
            scale = float(np.abs(want[name]).max())
            error = np.abs(got[name] - want[name])
            assert float(error.max()) <= 0.03 * scale and float(error.mean()) <= 1e-3 * scale, (name, error.max())


@pytest.mark.gpu
@pytest.mark.parametrize("flag, seed, tolerance", [
    # int32 sums are exact; fc1's epilogue is bit-exact, fc2's Gelu differs by the erf's last bits
    (None, 3, 1e-6),
    # FP16 build: fc1 requantizes (int8 store, bit-exact), fc2 writes fp16: its Gelu may differ by one fp16 ulp
    (kiln.BuilderFlag.FP16, 4, 2e-3),
])
def test_qdq_mlp_on_the_gpu_equals_the_cpu_backend(flag, seed, tolerance):
    """Both INT8 GEMMs on the device, fp32 and FP16 builds."""
    profiles = {"x": ((1, 64), (16, 64), (64, 64))}
    gpu, cpu = build_engine(qdq_mlp(), "cuda", profiles, flag), build_engine(qdq_mlp(), "cpu", profiles, flag)
    tactics = _int8_layers(gpu)
    assert set(tactics) == {"fc1", "fc2"} and "host" not in tactics.values(), tactics
    gctx, cctx = gpu.create_execution_context(), cpu.create_execution_context()
    rng = np.random.default_rng(seed)
    for batch in (1, 7, 64):
        x = {"x": rng.standard_normal((batch, 64)).astype(np.float32)}
        got, want = gctx.infer(x)["y"], cctx.infer(x)["y"]
        np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)


@pytest.mark.gpu
def test_fp16_bert_qdq_on_the_gpu_matches_the_cpu_backend():
    names = ("input_ids", "attention_mask", "token_type_ids")
    profiles = {n: ((1, 8), (2, 64), (4, 128)) for n in names}
    model, fp16 = small_model("bert_qdq"), kiln.BuilderFlag.FP16
    gpu, cpu = build_engine(model, "cuda", profiles, fp16), build_engine(model, "cpu", profiles, fp16)
    tactics = _int8_layers(gpu)
    # cuBLASLt on every GPU: the small model's layers have fewer than qgemm.MIN_TILES output tiles
    assert len(tactics) == 13 and set(tactics.values()) == {"gemm:cublaslt_int8"}, tactics
    assert gpu.plan.build_info["cuda"]["host_layers"] == []
    gctx, cctx = gpu.create_execution_context(), cpu.create_execution_context()
    for feeds in (bert_feeds(2, 64), bert_feeds(4, 33, seed=2)):
        got, want = gctx.infer(feeds), cctx.infer(feeds)
        for name in want:
            scale = float(np.abs(want[name]).max())
            error = np.abs(got[name] - want[name])
            assert float(error.max()) <= 0.03 * scale and float(error.mean()) <= 2e-3 * scale, (name, error.max())


# -- FP8 (E4M3) -----------------------------------------------------------------------------------------

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def fp8_mlp(din: int = 64, hidden: int = 96, dout: int = 32, seed: int = 0) -> onnx.ModelProto:
    """x[B, din] -> Q/DQ(fp8) -> MatMul(per-tensor e4m3 W) + bias + Relu -> Q/DQ(fp8) -> Gemm(transB,
    per-column e4m3 W) + bias -> Gelu -> y: both layouts, both scale kinds, fc1 requantizing to e4m3."""
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((din, hidden)) * 60).astype(FP8)
    w2 = (rng.standard_normal((dout, hidden)) * 60).astype(FP8)
    inits = {"w1": w1, "w1_scale": np.array(0.003, np.float32), "b1": (0.1 * rng.standard_normal(hidden)).astype(np.float32),
             "w2": w2, "w2_scale": rng.uniform(0.001, 0.004, dout).astype(np.float32),
             "b2": (0.1 * rng.standard_normal(dout)).astype(np.float32), "s_x": np.array(0.01, np.float32),
             "s_h": np.array(0.02, np.float32), "zero": np.zeros((), FP8)}
    return _mlp_model("fp8_mlp", inits, din, dout, (["w1", "w1_scale"], {}), (["w2", "w2_scale"], {"axis": 0}))


@needs_wiring
@pytest.mark.parametrize("batch", [1, 7])
def test_emulated_fp8_gemm_steps_equal_the_cpu_backend(batch):
    """Both layers are FP8 GEMMs (float32 sums) with the generated epilogue; fc1 requantizes: its epilogue
    stores e4m3 (round to nearest even, saturating). Emulated steps equal the CPU backend bit for bit."""
    x = np.random.default_rng(batch).standard_normal((batch, 64)).astype(np.float32)
    graph, lowered = pipeline_lowered(fp8_mlp(), {"x": x})
    steps = {s.node.name: s for s in lowered.steps}
    for name, (n, k) in (("fc1", (96, 64)), ("fc2", (32, 96))):
        gemm = steps[name].ops[0]
        assert type(gemm) is Fp8Gemm and (gemm.m, gemm.n, gemm.k) == (batch, n, k)
        assert lowered.infos[steps[name].scratch[0]].dtype == np.float32  # the float32 accumulator
    assert lowered.weight_transforms == {"w1#nk": ("w1", "nk")}
    assert steps["fc1"].node.outputs == ["rq"] and lowered.infos["rq"].dtype == FP8
    fc1_ops = steps["fc1"].ops
    assert [type(o).__name__ for o in fc1_ops] == ["Fp8Gemm", "Launch"]
    assert fc1_ops[1].program.out == FP8 and fc1_ops[1].program.nodes[-1].op == "QuantizeLinear"
    assert [type(o).__name__ for o in steps["fc2"].ops] == ["Fp8Gemm", "Launch"]
    got = Emulator(graph, lowered, {"x": x}).run()["y"]
    np.testing.assert_array_equal(got, GraphRunner(graph).run({"x": x})["y"])


def test_fp8_k_or_n_not_a_multiple_of_sixteen_runs_on_the_host():
    """cuBLASLt's FP8 kernels need 16-byte aligned leading dimensions: K and N multiples of 16."""
    node = Node("QMatMul", ["x", "s", "w", "ws", ""], ["y"], {"transB": 1, "activation": ""}, "fc", "kiln", 1)
    f32 = np.dtype(np.float32)
    for n, k in ((24, 32), (32, 8)):
        infos = {"x": TensorInfo(FP8, (4, k)), "s": TensorInfo(f32, ()), "w": TensorInfo(FP8, (n, k)),
                 "ws": TensorInfo(f32, ()), "y": TensorInfo(f32, (4, n))}
        ctx = lowering.LoweringContext(infos, frozenset({"y"}), {}, lowering.LoweringOptions(), {})
        with pytest.raises(Unsupported, match=f"FP8 GEMM needs N and K multiples of 16, got N={n}, K={k}"):
            lower_qmatmul(node, ctx)


@pytest.mark.gpu
def test_fp8_mlp_on_the_gpu_matches_the_cpu_backend():
    """Both FP8 GEMMs run in cuBLASLt. Tolerance: the float32 accumulators differ from the CPU's exactly
    rounded sums by float32 rounding (~1e-7 relative); fc1's e4m3 requantization can move a hidden value
    lying on a rounding boundary by one e4m3 step (1/8 relative), which moves a few outputs by up to
    max|w2| * w2_scale * that step: max error <= 2% of max|y|, mean error <= 1e-4 of max|y|."""
    profiles = {"x": ((1, 64), (16, 64), (64, 64))}
    gpu, cpu = build_engine(fp8_mlp(), "cuda", profiles), build_engine(fp8_mlp(), "cpu", profiles)
    layers = _int8_layers(gpu)
    assert set(layers) == {"fc1", "fc2"} and "host" not in layers.values(), layers
    gctx, cctx = gpu.create_execution_context(), cpu.create_execution_context()
    rng = np.random.default_rng(5)
    for batch in (1, 7, 64):
        x = {"x": rng.standard_normal((batch, 64)).astype(np.float32)}
        got, want = gctx.infer(x)["y"], cctx.infer(x)["y"]
        scale, error = float(np.abs(want).max()), np.abs(got - want)
        assert float(error.max()) <= 0.02 * scale and float(error.mean()) <= 1e-4 * scale, (batch, error.max())
