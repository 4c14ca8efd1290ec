"""fuse_qdq_matmul: explicit Q/DQ MatMul/Gemm chains -> ``kiln.QMatMul`` (the graph it makes, the numbers it
computes), and what it leaves alone (asymmetric, uint8, non-constant or wrongly scaled weights).

Numbers: the fused op sums int8 products exactly in int32 (checked bit for bit against an integer reference);
the unfused graph multiplies dequantized floats in float32, so the two agree to float32 rounding of a
K-term sum: |difference| <= 1e-5 * max|y| here (K <= 96).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import engine_core as kiln
from engine_core.backends.cpu import GraphRunner
from engine_core.ir import Graph
from engine_core.ops import ShapeInferenceError, TensorInfo, get_op
from engine_core.passes import FUSION_PASSES, eliminate_dead_code, fuse_gelu
from engine_core.passes.fuse_qdq_matmul import fuse_qdq_matmul, keeps_int8_weight
from engine_core.passes.pattern import Uses

F = TensorProto.FLOAT
RTOL = 1e-5


def _model(nodes: list, inputs: dict[str, list], outputs: list[str], inits: dict[str, np.ndarray],
           opset: int = 21) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "qdq", [helper.make_tensor_value_info(n, F, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info(n, F, None) for n in outputs],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    return model


def _graph(model: onnx.ModelProto) -> Graph:
    network = kiln.Builder().create_network()
    assert kiln.OnnxParser(network).parse(model.SerializeToString())
    return network.graph


def _fused(model: onnx.ModelProto) -> tuple[Graph, Graph, int]:
    """(unfused graph, fused graph, fusion count): GELU first, as in the builder's pipeline."""
    before, after = _graph(model), _graph(model)
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
    graph = _graph(model)
    uses = Uses(graph)
    dq = {n.name: n for n in graph.nodes}
    assert keeps_int8_weight(graph, dq["dq_w"], uses)
    assert not keeps_int8_weight(graph, dq["dq_x"], uses)  # an activation, not a constant weight
    model, _ = _qdq_linear(rng, zero=np.array(3, np.int8))
    graph = _graph(model)
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
    with pytest.raises(ShapeInferenceError, match="int8 operands"):
        op.infer(node, TensorInfo(np.uint8, (2, 8)), TensorInfo(f32, ()), TensorInfo(i8, (8, 4)),
                 TensorInfo(f32, (4,)))
    with pytest.raises(ShapeInferenceError, match="w_scale of shape"):
        op.infer(node, TensorInfo(i8, (2, 8)), TensorInfo(f32, ()), TensorInfo(i8, (8, 4)), TensorInfo(f32, (3,)))


@pytest.mark.skipif(fuse_qdq_matmul not in FUSION_PASSES, reason="fuse_qdq_matmul is not in FUSION_PASSES yet")
def test_cpu_build_runs_qmatmul_and_matches_the_unfused_build(rng):
    """Through the builder: fold_constants keeps the int8 weight, the fused layer is in the plan."""
    model, feeds = _qdq_linear(rng, gemm=True)
    shape = feeds["x"].shape

    def run(level: int) -> tuple[dict, list[str]]:
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

    (fused, types), (plain, _) = run(3), run(0)
    assert "QMatMul" in types and "Gemm" not in types
    _close(fused["y"], plain["y"])
