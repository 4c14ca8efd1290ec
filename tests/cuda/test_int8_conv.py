"""``kiln.QConv`` on the CUDA backend: the implicit-GEMM lowering (engine_core/backends/cuda/int8_conv.py).

Without a GPU: the lowered steps (zero fill, interior copy, im2col copy, Int8Gemm, epilogue) run through the
numpy emulator -- exact launches, strides, offsets and arena placement -- and must equal the CPU backend bit
for bit (int32 sums are exact, the epilogue keeps the CPU op's order). With a GPU (``-m gpu``): the small
resnet50_qdq against the CPU backend.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest

import engine_core as kiln
from engine_core.backends.cuda import lowering
from engine_core.backends.cuda.int8_conv import lower_qconv
from engine_core.backends.cuda.int8_gemm import Int8Gemm
from engine_core.backends.cuda.lowering import Launch
from engine_core.backends.cuda.pointwise import Unsupported
from engine_core.interpret import GraphRunner
from engine_core.ir import Graph, Node
from engine_core.ops import TensorInfo
from engine_core.passes import PIPELINE
from engine_core.passes.fuse_qdq_conv import fuse_qdq_conv
from tests.cuda.emulate import Emulator
from tests.cuda.models import lowered_at, optimized_graph, pipeline_lowered, small_model
from tests.engine.test_fuse_qdq_conv import qdq_conv_model

_WIRED = fuse_qdq_conv in PIPELINE and "QConv" in lowering._LOWER and "QConv" in lowering.LAYOUT_AWARE
needs_wiring = pytest.mark.skipif(not _WIRED, reason="QConv is not wired into the pipeline / lowering yet")


@pytest.fixture(autouse=True)
def int8_convolutions(monkeypatch):
    """INT8 implicit-GEMM convolutions are opt-in (KILN_INT8_CONV=1) until measured on a GPU."""
    monkeypatch.setenv("KILN_INT8_CONV", "1")


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)


def _qconv_step(lowered):
    steps = [s for s in lowered.steps if s.node.op_type == "QConv"]
    assert len(steps) == 1 and lowered.tactics()[steps[0].node.name] == "conv:cublaslt_int8_im2col"
    return steps[0]


def _gemm(step) -> Int8Gemm:
    return next(op for op in step.ops if isinstance(op, Int8Gemm))


#: (kernel, stride, pad, cin, residual, relu, requantize) -> (launches before the GEMM, GEMM reduction)
CASES = {
    "1x1": ((1, 1, 0, 8, False, True, True), 0, 8),  # NHWC input is the GEMM operand as it lies
    "3x3_pad1": ((3, 1, 1, 8, False, True, True), 3, 72),  # fill, interior copy, im2col
    "1x1_stride2": ((1, 2, 0, 8, False, False, True), 1, 8),  # im2col only (no padding)
    "3x3_stride2": ((3, 2, 1, 8, True, True, False), 3, 72),
    "7x7_stride2": ((7, 2, 3, 4, False, True, False), 3, 7 * 7 * 4),
    "residual_relu_requantize": ((3, 1, 1, 16, True, True, True), 3, 144),
}


@needs_wiring
@pytest.mark.parametrize("case", list(CASES))
def test_emulated_qconv_equals_the_cpu_backend(rng, case):
    (kernel, stride, pad, cin, residual, relu, requantize), before_gemm, reduction = CASES[case]
    model, feeds = qdq_conv_model(rng, kernel=kernel, stride=stride, pad=pad, cin=cin, residual=residual,
                                  relu=relu, requantize=requantize, exact=False, size=11, batch=2)
    graph, lowered = pipeline_lowered(model, feeds)
    step = _qconv_step(lowered)
    assert "host" not in lowered.tactics().values()
    gemm = _gemm(step)
    out = (11 + 2 * pad - kernel) // stride + 1
    assert (gemm.m, gemm.n, gemm.k) == (2 * out * out, 16, reduction)
    assert step.ops.index(gemm) == before_gemm and all(isinstance(op, Launch) for op in step.ops if op is not gemm)
    got = Emulator(graph, lowered, feeds).run()["y"]
    np.testing.assert_array_equal(got, GraphRunner(graph).run(feeds)["y"])


def _chain(rng) -> tuple[onnx.ModelProto, dict]:
    """Two QConvs: the first requantizes into an NHWC int8 tensor that the second (3x3, residual) reads."""
    first, feeds = qdq_conv_model(rng, kernel=1, pad=0, cin=8, cout=16, exact=False, size=10)
    second, more = qdq_conv_model(rng, kernel=3, pad=1, cin=16, cout=8, exact=False, size=10, residual=True)
    graph = first.graph
    graph.node[-1].output[0] = "y_dq"  # first's output feeds the second conv's input quantization
    rename = {"x": "y_dq", "y": "y"}
    for node in second.graph.node:
        node.input[:] = [rename.get(i, f"b_{i}") if i else i for i in node.input]
        node.output[:] = [rename.get(o, f"b_{o}") for o in node.output]
        node.name = f"b_{node.name}"
        graph.node.append(node)
    for init in second.graph.initializer:
        init.name = f"b_{init.name}"
        graph.initializer.append(init)
    graph.input.append(onnx.helper.make_tensor_value_info("b_r", onnx.TensorProto.FLOAT, [2, 8, 10, 10]))
    return first, {**feeds, "b_r": more["r"]}


@needs_wiring
def test_emulated_qconv_chain_keeps_int8_channels_last_between_layers(rng):
    model, feeds = _chain(rng)
    graph, lowered = pipeline_lowered(model, feeds)
    steps = [s for s in lowered.steps if s.node.op_type == "QConv"]
    assert len(steps) == 2  # the only reformat: the network input's quantization, for the first (1x1) conv
    assert [s.node.inputs[0] for s in lowered.steps if s.tactic.startswith("reformat")] == ["x_q"]
    between = steps[0].node.outputs[0]
    assert lowered.infos[between].dtype == np.int8 and lowered.layouts[between] == "nhwc"
    got = Emulator(graph, lowered, feeds).run()["y"]
    np.testing.assert_array_equal(got, GraphRunner(graph).run(feeds)["y"])


@needs_wiring
def test_emulated_resnet50_qdq_equals_the_cpu_backend():
    """All 52 QConvs lower to INT8 implicit GEMMs, the RGB stem to a float cuDNN convolution (no host layer);
    the emulated launches equal the CPU backend bit for bit."""
    x = np.random.default_rng(2).standard_normal((1, 3, 64, 64)).astype(np.float32)
    graph = optimized_graph(small_model("resnet50_qdq"), {"input": x})
    lowered = lowered_at(graph, {"input": x}, lowering.LoweringOptions(cudnn=True))
    tactics = lowered.tactics()
    assert "host" not in tactics.values()
    assert sum(t == "conv:cublaslt_int8_im2col" for t in tactics.values()) == 52
    got = Emulator(graph, lowered, {"input": x}).run()["logits"]
    np.testing.assert_array_equal(got, GraphRunner(graph).run({"input": x})["logits"])


@pytest.mark.parametrize("c,k", [(8, 6), (6, 8)])
def test_channels_not_a_multiple_of_four_run_on_the_host(c, k):
    """The IMMA and cuDNN INT8 kernels need C and K multiples of 4 (fuse_qdq_conv makes no other QConv)."""
    node = Node("QConv", ["x", "s", "w", "ws", "", "", ""], ["y"], {"activation": ""}, "conv", "kiln", 1)
    i8, f32 = np.dtype(np.int8), np.dtype(np.float32)
    infos = {"x": TensorInfo(i8, (1, c, 5, 5)), "s": TensorInfo(f32, ()), "w": TensorInfo(i8, (k, c, 1, 1)),
             "ws": TensorInfo(f32, (k,)), "y": TensorInfo(f32, (1, k, 5, 5))}
    graph = Graph(nodes=[node], constants={"w": np.zeros((k, c, 1, 1), np.int8)})
    ctx = lowering.LoweringContext(infos, frozenset({"y"}), {}, lowering.LoweringOptions(), graph.constants)
    with pytest.raises(Unsupported, match="multiples of 4"):
        lower_qconv(node, ctx)


# -- on the GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_resnet50_qdq_on_the_gpu_matches_the_cpu_backend():
    model = small_model("resnet50_qdq")
    engines = {}
    for backend in ("cuda", "cpu"):
        builder = kiln.Builder()
        net = builder.create_network()
        assert kiln.OnnxParser(net).parse(model)
        config = builder.create_builder_config()
        config.backend = backend
        config.clear_flag(kiln.BuilderFlag.TF32)  # the float layers in strict fp32, as the CPU reference
        profile = builder.create_optimization_profile()
        profile.set_shape("input", (1, 3, 64, 64), (4, 3, 64, 64), (8, 3, 64, 64))
        config.add_optimization_profile(profile)
        engines[backend] = kiln.Runtime().load(kiln.build_plan(net, config))
    tactics = {layer["name"]: layer["tactic"] for layer in engines["cuda"].plan.layers if layer["type"] == "QConv"}
    # with cuDNN INT8 (when this GPU's cuDNN builds the graphs) all 52 QConvs are one cuDNN graph (the RGB stem
    # is no QConv); else with the int8-output GEMMs (when its cuBLASLt has them) 51 are one call each
    lowered_with = engines["cuda"].plan.build_info["cuda"]["lowering"]
    requant, cudnn_int8 = lowered_with["int8_requant"], lowered_with["cudnn_int8"]
    counts = Counter(tactics.values())
    assert counts == ({"conv:cudnn_int8": 52} if cudnn_int8
                      else {"conv:cublaslt_int8_requant": 51, "conv:cublaslt_int8_im2col": 1} if requant
                      else {"conv:cublaslt_int8_im2col": 52}), counts
    gctx, cctx = engines["cuda"].create_execution_context(), engines["cpu"].create_execution_context()
    rng = np.random.default_rng(7)
    for batch in (1, 3, 8):
        x = {"input": rng.standard_normal((batch, 3, 64, 64)).astype(np.float32)}
        got, want = gctx.infer(x)["logits"], cctx.infer(x)["logits"]
        # the im2col QConvs are exact (int32 sums, the CPU op's epilogue order); MaxPool is exact; the global
        # average pool sums in another order and can move a value across the head's input quantization
        # boundary: one int8 step, so compare to the logits' scale, and the classes must agree. The int8-output
        # GEMMs round once per layer (up to a step per layer): the emulated test's bounds
        scale = float(np.abs(want).max())
        error = np.abs(got - want)
        bound = (0.08, 0.01) if requant or cudnn_int8 else (0.02, 2e-3)
        assert float(error.max()) <= bound[0] * scale and float(error.mean()) <= bound[1] * scale, float(error.max())
        assert (got.argmax(1) == want.argmax(1)).all()


# -- the int8-output cuBLASLt GEMM (LoweringOptions.int8_requant: probed on the GPU at build time) ----------

REQUANT = lowering.LoweringOptions(int8_requant=True, cudnn=True)


def _lowered_case(rng, case: str, options):
    """(graph, lowering with ``options``, the QConv step, feeds) of one CASES model, inexact scales, batch 2."""
    (kernel, stride, pad, cin, residual, relu, requantize), _, _ = CASES[case]
    model, feeds = qdq_conv_model(rng, kernel=kernel, stride=stride, pad=pad, cin=cin, residual=residual,
                                  relu=relu, requantize=requantize, exact=False, size=11, batch=2)
    graph = optimized_graph(model, feeds)
    lowered = lowered_at(graph, feeds, options)
    (step,) = [s for s in lowered.steps if s.node.op_type == "QConv"]
    return graph, lowered, step, feeds


def _assert_within_one_step(graph, lowered, step, feeds) -> None:
    """Emulated requantized outputs within one quantization step of the CPU op, nearly all equal (one float32
    rounding per layer instead of the CPU op's steps)."""
    got = Emulator(graph, lowered, feeds).run()["y"]
    ref = GraphRunner(graph).run(feeds)["y"]
    steps = np.abs(got.astype(np.float64) - ref) / float(graph.constants[step.node.inputs[6]])
    assert steps.max() <= 1.0 + 1e-6 and (steps < 0.5).mean() >= 0.98, (steps.max(), (steps < 0.5).mean())


@pytest.mark.parametrize("case", ["1x1", "3x3_pad1", "1x1_stride2", "residual_relu_requantize"])
def test_requantizing_qconv_is_one_int8_output_gemm(rng, case):
    """A requantizing QConv with constant scales becomes one Int8GemmRequant writing int8 NHWC (no int32 buffer,
    no epilogue kernel); its outputs stay within one quantization step of the CPU op, nearly all equal."""
    from engine_core.backends.cuda.int8_gemm import Int8GemmRequant

    (_, _, _, _, residual, relu, _), before_gemm, reduction = CASES[case]
    graph, lowered, step, feeds = _lowered_case(rng, case, REQUANT)
    assert lowered.tactics()[step.node.name] == "conv:cublaslt_int8_requant"
    gemm = step.ops[-1]
    assert isinstance(gemm, Int8GemmRequant) and step.ops.index(gemm) == before_gemm
    assert (gemm.k, gemm.relu, gemm.bias is not None, gemm.c is not None) == (reduction, relu, True, residual)
    assert lowered.infos[gemm.y.tensor].dtype == np.int8 and lowered.layouts[gemm.y.tensor] == "nhwc"
    _assert_within_one_step(graph, lowered, step, feeds)


def test_requant_needs_a_relu_or_no_activation_and_a_requantizing_layer(rng):
    """Sigmoid (no cuBLASLt int8 epilogue) and float outputs keep the int32 GEMM + epilogue kernel."""
    for options in ({"relu": False, "requantize": False}, {"relu": True, "requantize": False}):
        model, feeds = qdq_conv_model(rng, kernel=1, pad=0, cin=8, exact=False, size=6, **options)
        graph = optimized_graph(model, feeds)
        lowered = lowered_at(graph, feeds, REQUANT)
        assert "conv:cublaslt_int8_im2col" in lowered.tactics().values()
    model, feeds = qdq_conv_model(rng, kernel=1, pad=0, cin=8, exact=False, size=6)
    graph = optimized_graph(model, feeds)
    (node,) = [n for n in graph.nodes if n.op_type == "QConv"]
    node.attrs["activation"] = "Sigmoid"
    assert "conv:cublaslt_int8_im2col" in lowered_at(graph, feeds, REQUANT).tactics().values()


def _assert_logits_within_one_rounding_per_layer(graph, lowered, feeds) -> None:
    """resnet50_qdq's emulated logits vs the CPU backend when each layer rounds once (the bounds of the
    float32-reordering test in test_fuse_qdq_conv.py), and the classes agree."""
    got = Emulator(graph, lowered, feeds).run()["logits"]
    want = GraphRunner(graph).run(feeds)["logits"]
    scale = float(np.abs(want).max())
    error = np.abs(got - want)
    assert float(error.max()) <= 0.08 * scale and float(error.mean()) <= 0.01 * scale
    assert (got.argmax(1) == want.argmax(1)).all()


@needs_wiring
def test_emulated_resnet50_qdq_with_int8_output_gemms():
    """resnet50_qdq with the int8-output GEMMs: the 51 requantizing convolutions are one cuBLASLt call each
    (the last, read by GlobalAveragePool, keeps the epilogue kernel); one
    rounding per layer instead of the CPU op's steps moves values by a quantization step here and there, which
    50 layers propagate: the bounds of the float32-reordering test in test_fuse_qdq_conv.py hold."""
    x = np.random.default_rng(2).standard_normal((1, 3, 64, 64)).astype(np.float32)
    graph = optimized_graph(small_model("resnet50_qdq"), {"input": x})
    lowered = lowered_at(graph, {"input": x}, REQUANT)
    tactics = list(lowered.tactics().values())
    assert "host" not in tactics
    assert tactics.count("conv:cublaslt_int8_requant") == 51 and tactics.count("conv:cublaslt_int8_im2col") == 1
    _assert_logits_within_one_rounding_per_layer(graph, lowered, {"input": x})
    # the word-sized im2col / padding copies and the remaining epilogues compile (NVRTC, no GPU needed)
    from engine_core.backends.cuda.pointwise import pointwise_source
    from engine_core.cuda.nvrtc import compile_cubin

    assert compile_cubin(pointwise_source(lowered.kernels), "pw.cu", "sm_90")[:4] == b"\x7fELF"


# -- the cuDNN INT8 graph (LoweringOptions.cudnn_int8: probed on the GPU at build time) ----------------------

CUDNN_INT8 = lowering.LoweringOptions(cudnn_int8=True, int8_requant=True, cudnn=True)


@pytest.mark.parametrize("case", ["1x1", "3x3_pad1", "1x1_stride2", "residual_relu_requantize"])
def test_qconv_is_one_cudnn_int8_graph(rng, case):
    """With cuDNN INT8 a requantizing QConv over C % 4 == 0 channels is one Conv step: int8 NHWC in, the
    epilogue folded into float32 [K] vectors, the int8 output written NHWC, within one quantization step of the
    CPU op (one float32 rounding instead of its steps). (A float-output QConv writing a graph output keeps the
    GEMM path, whose output layout is linear; resnet50_qdq below has float-output cuDNN layers.)"""
    from engine_core.backends.cuda.lowering import Conv

    (_, _, _, _, residual, relu, _), _, _ = CASES[case]
    graph, lowered, step, feeds = _lowered_case(rng, case, CUDNN_INT8)
    assert lowered.tactics()[step.node.name] == "conv:cudnn_int8"
    (conv,) = step.ops
    assert isinstance(conv, Conv) and conv.int8 and conv.dtype == np.int8
    assert (conv.z is not None, conv.activation) == (residual, "Relu" if relu else "")
    assert conv.y_dtype == np.int8 and lowered.layouts[conv.y.tensor] == "nhwc"
    assert conv.x_strides == lowering.nhwc_strides(conv.x_dims) and conv.w_strides[1] == 1  # NHWC, KRSC
    assert {r.tensor for r in conv.refs()} <= set(lowered.locations)
    _assert_within_one_step(graph, lowered, step, feeds)


def test_cudnn_int8_leaves_other_activations_to_the_gemm_path(rng):
    """A Sigmoid keeps the implicit GEMM; so does a build whose probe found no cuDNN INT8 (the option off)."""
    model, feeds = qdq_conv_model(rng, kernel=1, pad=0, cin=8, exact=False, size=6)
    graph = optimized_graph(model, feeds)
    assert "conv:cudnn_int8" in lowered_at(graph, feeds, CUDNN_INT8).tactics().values()
    assert "conv:cudnn_int8" not in lowered_at(graph, feeds, REQUANT).tactics().values()
    (node,) = [n for n in graph.nodes if n.op_type == "QConv"]
    node.attrs["activation"] = "Sigmoid"
    assert "conv:cudnn_int8" not in lowered_at(graph, feeds, CUDNN_INT8).tactics().values()


@needs_wiring
def test_emulated_resnet50_qdq_with_cudnn_int8():
    """resnet50_qdq with cuDNN INT8: every QConv is one cuDNN graph (the RGB stem a float one); within the bounds
    of the int8-output GEMM test above (one rounding per layer), and the classes agree."""
    x = np.random.default_rng(2).standard_normal((1, 3, 64, 64)).astype(np.float32)
    graph = optimized_graph(small_model("resnet50_qdq"), {"input": x})
    lowered = lowered_at(graph, {"input": x}, CUDNN_INT8)
    tactics = Counter(lowered.tactics().values())
    assert "host" not in tactics and tactics["conv:cudnn_int8"] == 52, tactics
    _assert_logits_within_one_rounding_per_layer(graph, lowered, {"input": x})


def test_a_cudnn_int8_graph_that_cannot_build_turns_the_option_off(monkeypatch):
    """prepare_plan checks every probed option's steps on this GPU; an INT8 graph cuDNN cannot build re-lowers
    the network without cuDNN INT8 and records why (build_info lowering / cudnn_int8_fallback)."""
    from engine_core.backends import cuda as cuda_backend
    from engine_core.backends.cuda import cudnn_conv
    from engine_core.ops import TensorInfo
    from engine_core.passes import infer_shapes

    x = np.random.default_rng(2).standard_normal((1, 3, 64, 64)).astype(np.float32)
    graph = optimized_graph(small_model("resnet50_qdq"), {"input": x})

    infos = infer_shapes(graph, {"input": TensorInfo(np.dtype(np.float32), x.shape)}, values=True)
    monkeypatch.setattr(cudnn_conv, "unbuildable_convs",
                        lambda ops: ["CudaError: no engine"] if any(getattr(o, "int8", False) for o in ops) else [])
    build = cuda_backend.prepare_plan(graph, {(0, 1): infos}, arch="sm_90", timer_for=lambda op: lambda t: 1.0,
                                      options=CUDNN_INT8, conv_tuner=lambda op: (0, {}))
    assert build.info["lowering"]["cudnn_int8"] is False
    assert build.info["cudnn_int8_fallback"] == "CudaError: no engine"
    assert "conv:cudnn_int8" not in build.tactics.values()


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["1x1", "3x3_pad1", "1x1_stride2", "residual_relu_requantize"])
def test_cudnn_int8_qconv_on_the_gpu_matches_the_cpu_backend(rng, case):
    """The cuDNN INT8 graph on the GPU: within one quantization step of the CPU op, nearly all equal (what
    bench/cudnn_int8.py saw for every ResNet-50 shape at batch 128: at most 1 step, <0.01% differing)."""
    from tests.cuda.models import build_engine

    (kernel, stride, pad, cin, residual, relu, requantize), _, _ = CASES[case]
    model, feeds = qdq_conv_model(rng, kernel=kernel, stride=stride, pad=pad, cin=cin, residual=residual,
                                  relu=relu, requantize=requantize, exact=False, size=11, batch=2)
    engines = {backend: build_engine(model, backend, {n: (v.shape,) * 3 for n, v in feeds.items()})
               for backend in ("cuda", "cpu")}
    if not engines["cuda"].plan.build_info["cuda"]["lowering"]["cudnn_int8"]:
        pytest.skip(f"no cuDNN INT8 here: {engines['cuda'].plan.build_info['cuda']['cudnn_int8_unsupported']}")
    assert "conv:cudnn_int8" in {layer["tactic"] for layer in engines["cuda"].plan.layers}
    got, want = (engines[b].create_execution_context().infer(feeds)["y"] for b in ("cuda", "cpu"))
    y_scale = float(engines["cpu"].plan.graph.constants[
        next(n for n in engines["cpu"].plan.graph.nodes if n.op_type == "QConv").inputs[6]])
    steps = np.abs(got.astype(np.float64) - want) / y_scale
    assert steps.max() <= 1.0 + 1e-6 and (steps < 0.5).mean() >= 0.98, (steps.max(), (steps < 0.5).mean())
