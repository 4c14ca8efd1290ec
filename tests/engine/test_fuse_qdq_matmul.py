"""fuse_qdq_matmul: explicit Q/DQ MatMul/Gemm chains -> ``kiln.QMatMul`` (the graph it makes, the numbers it
computes), and what it leaves alone (asymmetric, uint8, non-constant or wrongly scaled weights).

Numbers: the fused op sums int8 products exactly in int32 (checked bit for bit against an integer reference);
the unfused graph multiplies dequantized floats in float32, so the two agree to float32 rounding of a
K-term sum: |difference| <= 1e-5 * max|y| here (K <= 96).
"""

from __future__ import annotations

from collections import Counter

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import engine_core as kiln
from engine_core.interpret import GraphRunner
from engine_core.ir import Graph
from engine_core.ops import ShapeInferenceError, TensorInfo, get_op
from engine_core.passes import FUSION_PASSES, eliminate_dead_code, fuse_gelu
from engine_core.passes.fuse_qdq_matmul import fuse_qdq_matmul, keeps_int8_weight
from engine_core.passes.pattern import Uses
from tests.cuda.models import build_engine
from tests.engine.util import float_model, parsed_graph

F = TensorProto.FLOAT
RTOL = 1e-5


def _model(nodes: list, inputs: dict[str, list], outputs: list[str], inits: dict[str, np.ndarray],
           opset: int = 21) -> onnx.ModelProto:
    """``float_model`` at opset 21 by default (int4 / output_dtype Q/DQ need it)."""
    return float_model(nodes, inputs, outputs, inits, opset)



def _fused(model: onnx.ModelProto) -> tuple[Graph, Graph, int]:
    """(unfused graph, fused graph, fusion count): GELU first, as in the builder's pipeline."""
    before, after = parsed_graph(model), parsed_graph(model)
    fuse_gelu(before)
    fuse_gelu(after)
    count = fuse_qdq_matmul(after)
    eliminate_dead_code(after)
    return before, after, count


def _ops(graph: Graph) -> list[str]:
    return [n.op_type for n in graph.nodes]


def _qdq_linear(rng, *, k: int = 96, n: int = 40, per_channel: bool = True, gemm: bool = False,
                bias: bool = True, activation: str | None = "Relu", zero: np.ndarray | None = None,
                weight_dtype=np.int8, axis: int | None = None) -> tuple[onnx.ModelProto, dict]:
    """x -> Q(int8) -> DQ -> MatMul (or Gemm transB) <- DQ(int8 W) -> Add(bias) -> activation."""
    shape = (n, k) if gemm else (k, n)
    info = np.iinfo(weight_dtype)
    w = rng.integers(max(info.min, -127), min(info.max, 127) + 1, shape).astype(weight_dtype)
    w_scale = rng.uniform(0.002, 0.02, n if per_channel else ()).astype(np.float32)
    inits = {"w_q": w, "w_scale": w_scale, "x_scale": np.array(0.025, np.float32),
             "x_zero": np.array(0, np.int8) if zero is None else zero,
             "w_zero": np.zeros(w_scale.shape, weight_dtype), "b": rng.standard_normal(n).astype(np.float32)}
    w_axis = axis if axis is not None else (0 if gemm else 1)
    nodes = [helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero"], ["x_q"], name="q"),
             helper.make_node("DequantizeLinear", ["x_q", "x_scale", "x_zero"], ["x_dq"], name="dq_x"),
             helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zero"], ["w_dq"], name="dq_w",
                              axis=w_axis)]
    tail = "mm"
    if gemm:
        nodes.append(helper.make_node("Gemm", ["x_dq", "w_dq", *(["b"] if bias else [])], [tail], transB=1,
                                      name="fc"))
    else:
        nodes.append(helper.make_node("MatMul", ["x_dq", "w_dq"], [tail], name="fc"))
        if bias:
            nodes.append(helper.make_node("Add", [tail, "b"], ["biased"], name="bias"))
            tail = "biased"
    if activation:
        nodes.append(helper.make_node(activation, [tail], ["act"], name="act"))
        tail = "act"
    nodes.append(helper.make_node("Identity", [tail], ["y"], name="out"))
    x_shape = [2, 5, k] if not gemm else [6, k]
    model = _model(nodes, {"x": x_shape}, ["y"], inits)
    feeds = {"x": (rng.standard_normal(x_shape) * 1.5).astype(np.float32)}
    return model, feeds


def _reference(feeds: dict, model: onnx.ModelProto, gemm: bool, activation: str | None) -> np.ndarray:
    """Integer reference: int64 sums of int8 products, then the float32 epilogue in the op's order."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    x_q = np.clip(np.rint(feeds["x"] / inits["x_scale"]), -128, 127).astype(np.int64)
    w = inits["w_q"].astype(np.int64)
    acc = x_q @ (w.T if gemm else w)
    y = acc.astype(np.float32) * inits["x_scale"] * inits["w_scale"].reshape(-1) + inits["b"]
    return np.maximum(y, 0) if activation == "Relu" else y


def _close(got: np.ndarray, want: np.ndarray) -> None:
    scale = float(np.abs(want).max())
    assert float(np.abs(got - want).max()) <= RTOL * scale, float(np.abs(got - want).max()) / scale


@pytest.mark.parametrize("per_channel", [True, False])
def test_matmul_bias_relu_becomes_one_qmatmul(rng, per_channel):
    model, feeds = _qdq_linear(rng, per_channel=per_channel)
    before, after, count = _fused(model)
    assert count == 1
    assert _ops(before) == ["QuantizeLinear", "DequantizeLinear", "DequantizeLinear", "MatMul", "Add", "Relu",
                            "Identity"]
    assert _ops(after) == ["QuantizeLinear", "QMatMul", "Identity"]
    node = after.nodes[1]
    assert (node.domain, node.inputs, node.attrs) == ("kiln", ["x_q", "x_scale", "w_q", "w_scale", "b"],
                                                      {"transB": 0, "activation": "Relu"})
    assert node.origin == ["fc", "bias", "act"]
    assert after.constants["w_q"].dtype == np.int8  # the weight stays int8
    got = GraphRunner(after).run(feeds)["y"]
    np.testing.assert_array_equal(got, _reference(feeds, model, False, "Relu"))  # exact int32 sums
    _close(got, GraphRunner(before).run(feeds)["y"])


def test_per_channel_gemm_transb_with_bias_and_gelu(rng):
    model, feeds = _qdq_linear(rng, gemm=True, activation="Gelu")
    before, after, count = _fused(model)
    assert count == 1 and _ops(after) == ["QuantizeLinear", "QMatMul", "Identity"]
    node = after.nodes[1]
    assert node.attrs == {"transB": 1, "activation": "Gelu"} and node.inputs[4] == "b"
    _close(GraphRunner(after).run(feeds)["y"], GraphRunner(before).run(feeds)["y"])


def test_plain_matmul_without_epilogue_and_shared_activation_dq(rng):
    """One quantized activation read by two MatMuls (BERT's Q/K/V): both fuse and the DQ goes away."""
    model, feeds = _qdq_linear(rng, bias=False, activation=None)
    graph = model.graph
    w2 = rng.integers(-127, 128, (96, 12)).astype(np.int8)
    graph.initializer.extend([numpy_helper.from_array(w2, "w2_q"),
                              numpy_helper.from_array(np.array(0.01, np.float32), "w2_scale")])
    graph.node.insert(3, helper.make_node("DequantizeLinear", ["w2_q", "w2_scale"], ["w2_dq"], name="dq_w2"))
    graph.node.append(helper.make_node("MatMul", ["x_dq", "w2_dq"], ["y2"], name="fc2"))
    graph.output.append(helper.make_tensor_value_info("y2", F, None))
    before, after, count = _fused(model)
    assert count == 2 and Counter(_ops(after)) == Counter({"QuantizeLinear": 1, "QMatMul": 2, "Identity": 1})
    assert [n.inputs[4] for n in after.nodes if n.op_type == "QMatMul"] == ["", ""]
    got, want = GraphRunner(after).run(feeds), GraphRunner(before).run(feeds)
    for name in ("y", "y2"):
        _close(got[name], want[name])


@pytest.mark.parametrize("case", ["asymmetric", "uint8", "weight_axis", "float_weight", "computed_weight"])
def test_graphs_outside_the_pattern_stay_as_they_are(rng, case):
    kwargs: dict = {}
    if case == "asymmetric":
        kwargs = {"zero": np.array(3, np.int8)}
    elif case == "uint8":
        kwargs = {"zero": np.array(128, np.uint8), "weight_dtype": np.uint8}
    elif case == "weight_axis":
        kwargs = {"axis": 0, "n": 96}  # per-row (K) weight scales: not a per-output-column scale
    model, feeds = _qdq_linear(rng, **kwargs)
    if case == "float_weight":  # the weight DQ already folded into a float constant
        graph = model.graph
        dq = next(n for n in graph.node if n.name == "dq_w")
        graph.node.remove(dq)
        graph.initializer.append(numpy_helper.from_array(rng.standard_normal((96, 40)).astype(np.float32), "w_dq"))
    elif case == "computed_weight":  # the int8 weight is an input, not a constant
        graph = model.graph
        init = next(t for t in graph.initializer if t.name == "w_q")
        graph.initializer.remove(init)
        graph.input.append(helper.make_tensor_value_info("w_q", TensorProto.INT8, [96, 40]))
        feeds["w_q"] = numpy_helper.to_array(init)
    before, after, count = _fused(model)
    assert count == 0 and _ops(after) == _ops(before)


def test_keeps_int8_weight_only_for_quantized_gemm_weights(rng):
    model, _ = _qdq_linear(rng)
    graph = parsed_graph(model)
    uses = Uses(graph)
    dq = {n.name: n for n in graph.nodes}
    assert keeps_int8_weight(graph, dq["dq_w"], uses)
    assert not keeps_int8_weight(graph, dq["dq_x"], uses)  # an activation, not a constant weight
    model, _ = _qdq_linear(rng, zero=np.array(3, np.int8))
    graph = parsed_graph(model)
    graph.constants["w_zero"] = np.full(40, 2, np.int8)
    assert not keeps_int8_weight(graph, next(n for n in graph.nodes if n.name == "dq_w"), Uses(graph))


def test_qmatmul_shape_inference_names_the_problem():
    op = get_op("QMatMul", "kiln")
    from engine_core.ir import Node

    node = Node("QMatMul", ["x", "s", "w", "ws", "b"], ["y"], {"transB": 0, "activation": ""}, "fc", "kiln", 1)
    i8, f32 = np.dtype(np.int8), np.dtype(np.float32)
    out = op.infer(node, TensorInfo(i8, (2, 3, 8)), TensorInfo(f32, ()), TensorInfo(i8, (8, 4)),
                   TensorInfo(f32, (4,)), TensorInfo(f32, (4,)))
    assert (out.dtype, out.shape) == (f32, (2, 3, 4))
    with pytest.raises(ShapeInferenceError, match="disagree on K"):
        op.infer(node, TensorInfo(i8, (2, 7)), TensorInfo(f32, ()), TensorInfo(i8, (8, 4)), TensorInfo(f32, (4,)))
    with pytest.raises(ShapeInferenceError, match="two int8 or two float8e4m3fn operands, got uint8 and int8"):
        op.infer(node, TensorInfo(np.uint8, (2, 8)), TensorInfo(f32, ()), TensorInfo(i8, (8, 4)),
                 TensorInfo(f32, (4,)))
    fp8 = np.dtype(ml_dtypes.float8_e4m3fn)
    with pytest.raises(ShapeInferenceError, match="got float8_e4m3fn and int8"):  # no mixed int8 x fp8 GEMM
        op.infer(node, TensorInfo(fp8, (2, 8)), TensorInfo(f32, ()), TensorInfo(i8, (8, 4)), TensorInfo(f32, (4,)))
    out = op.infer(node, TensorInfo(fp8, (2, 8)), TensorInfo(f32, ()), TensorInfo(fp8, (8, 4)), TensorInfo(f32, ()))
    assert (out.dtype, out.shape) == (f32, (2, 4))
    with pytest.raises(ShapeInferenceError, match="w_scale of shape"):
        op.infer(node, TensorInfo(i8, (2, 8)), TensorInfo(f32, ()), TensorInfo(i8, (8, 4)), TensorInfo(f32, (3,)))


def _cpu_build(model: onnx.ModelProto, feeds: dict, level: int = 3) -> tuple[dict, list[str]]:
    """(outputs, layer types) of a CPU build at optimization ``level`` (0: no fusions)."""
    shape = feeds["x"].shape
    builder = kiln.Builder()
    network = builder.create_network()
    assert kiln.OnnxParser(network).parse(model.SerializeToString())
    config = builder.create_builder_config()
    config.backend = "cpu"
    config.builder_optimization_level = level
    profile = builder.create_optimization_profile()
    profile.set_shape("x", shape, shape, shape)
    config.add_optimization_profile(profile)
    engine = kiln.Runtime().load(kiln.build_plan(network, config))
    return engine.create_execution_context().infer(feeds), [layer["type"] for layer in engine.plan.layers]


@pytest.mark.skipif(fuse_qdq_matmul not in FUSION_PASSES, reason="fuse_qdq_matmul is not in FUSION_PASSES yet")
def test_cpu_build_runs_qmatmul_and_matches_the_unfused_build(rng):
    """Through the builder: fold_constants keeps the int8 weight, the fused layer is in the plan."""
    model, feeds = _qdq_linear(rng, gemm=True)
    (fused, types), (plain, _) = _cpu_build(model, feeds), _cpu_build(model, feeds, level=0)
    assert "QMatMul" in types and "Gemm" not in types
    _close(fused["y"], plain["y"])


@pytest.mark.skipif(fuse_qdq_matmul not in FUSION_PASSES, reason="fuse_qdq_matmul is not in FUSION_PASSES yet")
def test_kiln_int8_gemm_0_keeps_float_gemms_of_the_dequantized_weight(rng, monkeypatch):
    """KILN_INT8_GEMM=0: the pass makes no QMatMul and fold_constants folds the weight's DequantizeLinear (the two
    agree); the build equals the unfused one."""
    model, feeds = _qdq_linear(rng, gemm=True)
    graph = parsed_graph(model)
    dq_w = next(n for n in graph.nodes if n.name == "dq_w")
    monkeypatch.setenv("KILN_INT8_GEMM", "0")
    assert not keeps_int8_weight(graph, dq_w, Uses(graph)) and fuse_qdq_matmul(graph) == 0
    (got, types), (plain, _) = _cpu_build(model, feeds), _cpu_build(model, feeds, level=0)
    assert "QMatMul" not in types and "DequantizeLinear" not in types
    np.testing.assert_array_equal(got["y"], plain["y"])


# -- requantizing epilogue: QMatMul -> QuantizeLinear(int8) becomes one int8-writing QMatMul ---------------


def _requant_mlp(rng, *, q_zero: np.ndarray | None = np.array(0, np.int8), q_scale=np.float32(2.0 ** -4),
                 q_attrs: dict | None = None, extra_reader: bool = False, opset: int = 21) -> tuple[onnx.ModelProto, dict]:
    """x -> Q/DQ -> fc1 (MatMul [64, 48] + bias + Gelu) -> Q(h) -> DQ -> fc2 (Gemm transB + bias) -> y, with the
    int8 ``h_q`` also a graph output. Scales are powers of two: every float product and K-term sum of the
    unfused graph is then exact, so fused and unfused agree bit for bit (not only to float rounding)."""
    w1 = rng.integers(-127, 128, (64, 48)).astype(np.int8)
    w2 = rng.integers(-127, 128, (24, 48)).astype(np.int8)
    inits = {"w1": w1, "w1_scale": (2.0 ** -rng.integers(7, 10, 48)).astype(np.float32),
             "b1": rng.standard_normal(48).astype(np.float32), "w2": w2, "w2_scale": np.float32(2.0 ** -8),
             "b2": rng.standard_normal(24).astype(np.float32), "s_x": np.float32(2.0 ** -5), "s_h": q_scale,
             "zero": np.array(0, np.int8)}
    q_inputs = ["g", "s_h"] + ([] if q_zero is None else ["z_h"])
    if q_zero is not None:
        inits["z_h"] = q_zero
    h_zero = ["z_h"] if q_zero is not None else []
    n = helper.make_node
    nodes = [n("QuantizeLinear", ["x", "s_x", "zero"], ["x_q"], name="q_x"),
             n("DequantizeLinear", ["x_q", "s_x", "zero"], ["x_dq"], name="dq_x"),
             n("DequantizeLinear", ["w1", "w1_scale"], ["w1_dq"], name="dq_w1", axis=1),
             n("MatMul", ["x_dq", "w1_dq"], ["h"], name="fc1"), n("Add", ["h", "b1"], ["hb"], name="bias1"),
             n("Gelu" if opset >= 20 else "Relu", ["hb"], ["g"], name="gelu"),  # Gelu is opset 20
             n("QuantizeLinear", q_inputs, ["h_q"], name="q_h", **(q_attrs or {})),
             n("DequantizeLinear", ["h_q", "s_h", *h_zero], ["h_dq"], name="dq_h"),
             n("DequantizeLinear", ["w2", "w2_scale"], ["w2_dq"], name="dq_w2"),
             n("Gemm", ["h_dq", "w2_dq", "b2"], ["y"], transB=1, name="fc2")]
    if extra_reader:
        nodes.append(n("Identity", ["g"], ["g_out"], name="tap"))
    model = _model(nodes, {"x": [6, 64]}, ["y"], inits, opset=opset)
    model.graph.output.append(helper.make_tensor_value_info("h_q", TensorProto.INT8, None))
    if extra_reader:
        model.graph.output.append(helper.make_tensor_value_info("g_out", F, None))
    return model, {"x": (rng.standard_normal((6, 64)) * 1.5).astype(np.float32)}


def _fused_variant(model: onnx.ModelProto, requantize: bool) -> tuple[Graph, int]:
    graph = parsed_graph(model)
    count = fuse_qdq_matmul(graph, requantize=requantize)
    eliminate_dead_code(graph)
    return graph, count


def test_requantizing_epilogue_absorbs_the_quantize_and_is_bit_exact(rng):
    from engine_core.passes.fuse_qdq_matmul import requantizes

    model, feeds = _requant_mlp(rng)
    fused, count = _fused_variant(model, requantize=True)
    plain, _ = _fused_variant(model, requantize=False)
    assert count == 2
    assert _ops(fused) == ["QuantizeLinear", "QMatMul", "QMatMul"]  # q_h, dq_h, dq_x's float tensors gone
    assert _ops(plain) == ["QuantizeLinear", "QMatMul", "QuantizeLinear", "QMatMul"]
    fc1, fc2 = fused.nodes[1], fused.nodes[2]
    assert fc1.inputs == ["x_q", "s_x", "w1", "w1_scale", "b1", "s_h"] and fc1.outputs == ["h_q"]
    assert fc1.origin == ["fc1", "bias1", "gelu", "q_h"] and requantizes(fc1) and not requantizes(fc2)
    assert fc2.inputs[:2] == ["h_q", "s_h"]  # the next GEMM reads the int8 tensor: no float round trip
    got = GraphRunner(fused).run(feeds)
    assert got["h_q"].dtype == np.int8
    want = GraphRunner(plain).run(feeds)
    unfused = GraphRunner(parsed_graph(model)).run(feeds)
    assert np.count_nonzero(got["h_q"] == 127) and np.count_nonzero(got["h_q"] == 0)  # saturates; Gelu < 0 -> 0
    for name in ("h_q", "y"):
        np.testing.assert_array_equal(got[name], want[name])  # == QMatMul -> QuantizeLinear
        np.testing.assert_array_equal(got[name], unfused[name])  # == the ONNX graph (exact scales)


def test_requantize_rounds_half_to_even_like_quantize_linear():
    """Results exactly between two int8 steps: QuantizeLinear rounds half to even, so must the epilogue."""
    from engine_core.ir import Node

    op = get_op("QMatMul", "kiln")
    node = Node("QMatMul", ["x", "s", "w", "ws", "", "ys"], ["y"], {"transB": 0, "activation": ""}, "fc", "kiln", 1)
    x = np.array([[1, 3, 5, 7, -1, -3, 100, -100]], np.int8).T  # [8, 1]
    w = np.ones((1, 1), np.int8)
    got = op.cpu(node, x, np.float32(0.5), w, np.float32(1.0), None, np.float32(1.0))
    assert got.dtype == np.int8
    np.testing.assert_array_equal(got.reshape(-1), [0, 2, 2, 4, 0, -2, 50, -50])


@pytest.mark.parametrize("case", ["zero_point", "uint8", "per_channel_scale", "second_reader"])
def test_quantize_outside_the_requantize_pattern_stays_a_layer(rng, case):
    kwargs: dict = {}
    if case == "zero_point":
        kwargs = {"q_zero": np.array(3, np.int8)}
    elif case == "uint8":  # no zero point and no output_dtype: QuantizeLinear writes uint8
        kwargs = {"q_zero": None}
    elif case == "per_channel_scale":
        kwargs = {"q_scale": np.full(48, 2.0 ** -4, np.float32)}
    elif case == "second_reader":
        kwargs = {"extra_reader": True}
    model, feeds = _requant_mlp(rng, **kwargs)
    fused, _ = _fused_variant(model, requantize=True)
    assert not any(len(n.inputs) > 5 for n in fused.nodes if n.op_type == "QMatMul")
    assert "QuantizeLinear" in _ops(fused)[1:]  # q_h is still its own layer
    got, want = GraphRunner(fused).run(feeds), GraphRunner(parsed_graph(model)).run(feeds)
    np.testing.assert_array_equal(got["h_q"], want["h_q"])


def test_requantize_with_output_dtype_int8_and_no_zero_point(rng):
    model, feeds = _requant_mlp(rng, q_zero=None, q_attrs={"output_dtype": TensorProto.INT8}, opset=21)
    fused, _ = _fused_variant(model, requantize=True)
    assert _ops(fused) == ["QuantizeLinear", "QMatMul", "QMatMul"]
    got, want = GraphRunner(fused).run(feeds), GraphRunner(parsed_graph(model)).run(feeds)
    for name in ("h_q", "y"):
        np.testing.assert_array_equal(got[name], want[name])


def test_requantize_shape_inference():
    from engine_core.ir import Node

    op = get_op("QMatMul", "kiln")
    node = Node("QMatMul", ["x", "s", "w", "ws", "", "ys"], ["y"], {"transB": 0, "activation": ""}, "fc", "kiln", 1)
    i8, f32 = np.dtype(np.int8), np.dtype(np.float32)
    args = (TensorInfo(i8, (2, 8)), TensorInfo(f32, ()), TensorInfo(i8, (8, 4)), TensorInfo(f32, (4,)), None)
    out = op.infer(node, *args, TensorInfo(f32, ()))
    assert (out.dtype, out.shape) == (i8, (2, 4))
    with pytest.raises(ShapeInferenceError, match="y_scale of shape"):
        op.infer(node, *args, TensorInfo(f32, (4,)))
    with pytest.raises(ShapeInferenceError, match="y_scale must be a float"):
        op.infer(node, *args, TensorInfo(i8, ()))


# -- reduced precision: Q/DQ typed like TensorRT, so FP16/BF16 builds still fuse ------------------------


@pytest.mark.parametrize("opset", [17, 21])
@pytest.mark.parametrize("flag", [kiln.BuilderFlag.FP16, kiln.BuilderFlag.BF16])
def test_reduced_precision_build_fuses_with_exact_scales(rng, opset, flag):
    """No zero points on the weights (the case that kept a float32 DequantizeLinear and a reformat Cast
    before the MatMul): the 16-bit build has both GEMMs as QMatMul writing the 16-bit type, fc1 requantizing,
    the scales still float32, and no Cast but the output's reformat."""
    model, feeds = _requant_mlp(rng, opset=opset)
    engine16 = build_engine(model, "cpu", {"x": ((6, 64),) * 3}, flag)
    engine32 = build_engine(model, "cpu", {"x": ((6, 64),) * 3}, None)
    graph = engine16.plan.graph
    # the input's reformat Cast and its quantization are one pointwise chain: reformat_in:x + q_x, fc1, fc2,
    # reformat_out:y
    assert [n.op_type for n in graph.nodes] == ["PointwiseChain", "QMatMul", "QMatMul", "Cast"], \
        [n.name for n in graph.nodes]
    assert [n.op_type for n in graph.nodes[0].attrs["body"].nodes] == ["Cast", "QuantizeLinear"]
    half = np.dtype(np.float16) if flag == kiln.BuilderFlag.FP16 else np.dtype("bfloat16")
    fc1, fc2 = graph.nodes[1], graph.nodes[2]
    assert len(fc1.inputs) == 6 and fc2.attrs["float_dtype"] == kiln.types.np_to_onnx(half)
    assert all(graph.constants[fc2.inputs[i]].dtype == np.float32 for i in (1, 3))
    got, want = engine16.create_execution_context().infer(feeds), engine32.create_execution_context().infer(feeds)
    # h_q: the 16-bit input x moves some of x_q across a rounding boundary and g is stored 16-bit before
    # q_h: measured (3 seeds) at most 1 int8 step on <= 6% of values (FP16), 2 steps on <= 15% (BF16); y:
    # that plus the 16-bit output, <= 0.7% (FP16) / 1.4% (BF16) of max|y|
    steps, moved, rel = (1, 0.1, 0.01) if flag == kiln.BuilderFlag.FP16 else (2, 0.25, 0.025)
    assert np.abs(got["h_q"].astype(int) - want["h_q"]).max() <= steps and np.mean(got["h_q"] != want["h_q"]) < moved
    scale = float(np.abs(want["y"]).max())
    assert float(np.abs(got["y"] - want["y"]).max()) <= rel * scale


def test_precision_pass_types_dequantize_by_its_output_not_its_scale(rng):
    """The rewrite itself: DequantizeLinear declares the 16-bit output, scales and zero points keep their
    types, QuantizeLinear's data input is converted, and no Cast sits between a DQ and its MatMul."""
    from engine_core.passes import PRE_PASSES
    from engine_core.passes.reduce_precision import precision_policy, reduce_precision

    model, _ = _requant_mlp(rng, opset=17)
    builder = kiln.Builder()
    network = builder.create_network()
    assert kiln.OnnxParser(network).parse(model.SerializeToString())
    config = builder.create_builder_config()
    config.set_flag(kiln.BuilderFlag.FP16)
    graph = network.graph
    for graph_pass in PRE_PASSES:
        graph_pass(graph)
    assert reduce_precision(graph, precision_policy(config, network)) > 0
    nodes = {n.name: n for n in graph.nodes}
    fp16 = kiln.types.np_to_onnx(np.dtype(np.float16))
    for name in ("dq_x", "dq_w1", "dq_h", "dq_w2"):
        assert nodes[name].attrs.get("output_dtype") == fp16, name
    assert all(graph.constants[s].dtype == np.float32 for s in ("s_x", "s_h", "w1_scale", "w2_scale"))
    casts = [n for n in graph.nodes if n.op_type == "Cast"]
    assert [c.name for c in casts] == ["reformat_in:x", "reformat_out:y"]  # none next to a DQ
    assert nodes["q_x"].inputs[0] == casts[0].outputs[0]


def _bert_qdq() -> onnx.ModelProto:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    from make_models import MODELS

    return MODELS["bert_qdq"][1]()


def test_fp16_bert_qdq_keeps_every_linear_layer_int8_and_matches_fp32():
    """tools/make_models.py's small bert_qdq (2 layers): 13 QMatMul in both builds (Q, K, V, attention
    output, FFN1, FFN2 per layer; the pooler), FFN1 requantizing into FFN2's input, the 4 encoder SkipLayerNorms
    quantizing the next linear layer's input (fuse_norm_quantize), the 2 attentions writing the attention-output
    projection's int8 input (fuse_attention_quantize: 1 QuantizeLinear left, the pooler's input); no
    DequantizeLinear and no reformat Cast inside the FP16 network."""
    from engine_core.passes.fuse_qdq_matmul import requantizes

    model = _bert_qdq()
    names = ("input_ids", "attention_mask", "token_type_ids")
    shapes = {n: ((1, 8), (2, 16), (4, 32)) for n in names}
    engines = {flag: build_engine(model, "cpu", shapes, flag) for flag in (None, kiln.BuilderFlag.FP16)}
    for engine in engines.values():
        nodes = engine.plan.graph.nodes
        types = Counter(n.op_type for n in nodes)
        assert types["QMatMul"] == 13 and types["QuantizeLinear"] == 1 and not types["DequantizeLinear"]
        assert types["AttentionQuantize"] == 2
        assert sum(n.op_type == "SkipLayerNorm" and len(n.outputs) == 2 for n in nodes) == 4
        assert sorted(n.name for n in nodes if requantizes(n)) == ["MatMul_110", "MatMul_203"]  # the two FFN1
        assert not any(n.op_type == "Cast" or n.name.startswith("reformat:") for n in nodes)  # internal reformats
    fp16 = engines[kiln.BuilderFlag.FP16].plan.graph
    assert all(kiln.types.onnx_to_np(n.attr("float_dtype")) == np.float16 for n in fp16.nodes
               if n.op_type == "QMatMul")
    rng = np.random.default_rng(1)
    for batch, seq in ((2, 16), (4, 32)):
        mask = np.ones((batch, seq), np.int64)
        mask[:, seq - seq // 4:] = 0
        feeds = {"input_ids": rng.integers(0, 1000, (batch, seq)).astype(np.int64), "attention_mask": mask,
                 "token_type_ids": rng.integers(0, 2, (batch, seq)).astype(np.int64)}
        got = engines[kiln.BuilderFlag.FP16].create_execution_context().infer(feeds)
        want = engines[None].create_execution_context().infer(feeds)
        for name, value in want.items():
            # measured (3 feeds): max 0.24% / 0.50% of max|output| (hidden state / pooler), mean 0.02% / 0.13%
            scale = float(np.abs(value).max())
            error = np.abs(got[name].astype(np.float64) - value)
            assert float(error.max()) <= 1.5e-2 * scale and float(error.mean()) <= 3e-3 * scale, (name, error.max())


# -- FP8 (E4M3) ---------------------------------------------------------------------------------------

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def _fp8_linear(rng, *, per_channel: bool = False, requantize: bool = False, weight_dtype=FP8,
                x_dtype=FP8, k: int = 64, n: int = 48) -> tuple[onnx.ModelProto, dict]:
    """x -> Q(fp8) -> DQ -> MatMul <- DQ(fp8 W constant) -> Add(bias) -> Relu [-> Q(fp8) -> DQ] -> y."""
    w = (rng.standard_normal((k, n)) * 40).astype(np.float32).astype(weight_dtype)
    w_scale = rng.uniform(0.002, 0.02, n if per_channel else ()).astype(np.float32)
    inits = {"w_q": w, "w_scale": w_scale, "x_scale": np.array(0.01, np.float32),
             "x_zero": np.zeros((), x_dtype), "b": rng.standard_normal(n).astype(np.float32),
             "y_scale": np.array(0.02, np.float32), "y_zero": np.zeros((), FP8)}
    nodes = [helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero"], ["x_q"], name="q"),
             helper.make_node("DequantizeLinear", ["x_q", "x_scale", "x_zero"], ["x_dq"], name="dq_x"),
             helper.make_node("DequantizeLinear", ["w_q", "w_scale"], ["w_dq"], name="dq_w", axis=1),
             helper.make_node("MatMul", ["x_dq", "w_dq"], ["mm"], name="fc"),
             helper.make_node("Add", ["mm", "b"], ["biased"], name="bias"),
             helper.make_node("Relu", ["biased"], ["act"], name="act")]
    tail = "act"
    if requantize:
        nodes += [helper.make_node("QuantizeLinear", ["act", "y_scale", "y_zero"], ["y_q"], name="q_y"),
                  helper.make_node("DequantizeLinear", ["y_q", "y_scale", "y_zero"], ["y_dq"], name="dq_y")]
        tail = "y_dq"
    nodes.append(helper.make_node("Identity", [tail], ["y"], name="out"))
    model = _model(nodes, {"x": [3, 5, k]}, ["y"], inits)
    return model, {"x": (rng.standard_normal((3, 5, k)) * 1.5).astype(np.float32)}


def _fp8_reference(feeds: dict, model: onnx.ModelProto) -> np.ndarray:
    """Exact float64 sums of e4m3 products rounded once to float32, then the float32 epilogue in the op's
    order (x_scale, w_scale, bias, Relu)."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    x_q = np.clip(feeds["x"] / inits["x_scale"], -448, 448).astype(FP8)
    acc = (x_q.astype(np.float64) @ inits["w_q"].astype(np.float64)).astype(np.float32)
    y = acc * inits["x_scale"] * inits["w_scale"].reshape(-1) + inits["b"]
    return np.maximum(y, 0)


@pytest.mark.parametrize("per_channel", [False, True])
def test_fp8_matmul_bias_relu_becomes_one_qmatmul(rng, per_channel):
    """Per-tensor and per-column weight scales both fuse: the CUDA lowering applies the scales in its
    epilogue, not through cuBLASLt's per-tensor A/B scales."""
    model, feeds = _fp8_linear(rng, per_channel=per_channel)
    before, after, count = _fused(model)
    assert count == 1 and _ops(after) == ["QuantizeLinear", "QMatMul", "Identity"]
    node = after.nodes[1]
    assert node.inputs == ["x_q", "x_scale", "w_q", "w_scale", "b"] and node.attrs == {"transB": 0,
                                                                                       "activation": "Relu"}
    assert after.constants["w_q"].dtype == FP8  # the weight stays e4m3
    got = GraphRunner(after).run(feeds)["y"]
    np.testing.assert_array_equal(got, _fp8_reference(feeds, model))
    # the unfused graph sums the dequantized products in float32 (K = 64 terms)
    _close(got, GraphRunner(before).run(feeds)["y"])


def test_fp8_requantizing_epilogue_writes_e4m3(rng):
    """Relu -> Q(fp8): the layer writes e4m3, exactly QMatMul (float) -> QuantizeLinear."""
    model, feeds = _fp8_linear(rng, requantize=True)
    _, after, count = _fused(model)
    plain = parsed_graph(model)
    fuse_gelu(plain)
    fuse_qdq_matmul(plain, requantize=False)
    eliminate_dead_code(plain)
    assert count == 1 and _ops(after) == ["QuantizeLinear", "QMatMul", "DequantizeLinear", "Identity"]
    assert _ops(plain) == ["QuantizeLinear", "QMatMul", "QuantizeLinear", "DequantizeLinear", "Identity"]
    node = after.nodes[1]
    assert node.inputs[5] == "y_scale" and node.outputs == ["y_q"]
    infos = [TensorInfo(FP8, (3, 5, 64))] + [TensorInfo(after.constants[n].dtype, after.constants[n].shape)
                                             for n in node.inputs[1:]]
    assert get_op("QMatMul", "kiln").infer(node, *infos).dtype == FP8
    np.testing.assert_array_equal(GraphRunner(after).run(feeds)["y"], GraphRunner(plain).run(feeds)["y"])


@pytest.mark.parametrize("case", ["int8_x_fp8_w", "e5m2_weight", "fp8_requantize_to_int8"])
def test_fp8_graphs_outside_the_pattern_stay_as_they_are(rng, case):
    if case == "int8_x_fp8_w":  # no tensor-core GEMM mixes int8 and e4m3 operands
        model, _ = _fp8_linear(rng, x_dtype=np.int8)
    elif case == "e5m2_weight":
        model, _ = _fp8_linear(rng, weight_dtype=ml_dtypes.float8_e5m2)
    else:  # the layer fuses, but a QuantizeLinear to another type than its operands' stays a layer
        model, _ = _fp8_linear(rng, requantize=True)
        zero = next(t for t in model.graph.initializer if t.name == "y_zero")
        zero.CopyFrom(numpy_helper.from_array(np.array(0, np.int8), "y_zero"))
        _, after, count = _fused(model)
        assert count == 1 and _ops(after) == ["QuantizeLinear", "QMatMul", "QuantizeLinear", "DequantizeLinear",
                                              "Identity"]
        return
    before, after, count = _fused(model)
    assert count == 0 and _ops(after) == _ops(before)


def test_keeps_fp8_weight_for_constant_folding(rng):
    model, _ = _fp8_linear(rng)
    graph = parsed_graph(model)
    assert keeps_int8_weight(graph, next(n for n in graph.nodes if n.name == "dq_w"), Uses(graph))
