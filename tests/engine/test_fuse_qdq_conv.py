"""fuse_qdq_conv: explicit Q/DQ Conv chains -> ``kiln.QConv`` (the graph it makes, the numbers it computes),
what it leaves alone (grouped, asymmetric, uint8), the folding rule that keeps the int8 weights, and
tools/make_models.py's small resnet50_qdq through the builder.

Numbers: the fused op sums int8 products exactly in int32; the unfused graph convolves dequantized floats in
float32. With power-of-two scales every product and sum is exact in float32 too, so the two graphs must agree
bit for bit (requantized int8 included); with arbitrary scales they agree to float32 rounding.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from engine_core.interpret import GraphRunner
from engine_core.ir import Graph, Node
from engine_core.ops import ShapeInferenceError, TensorInfo, get_op
from engine_core.passes import PIPELINE, eliminate_dead_code, fold_constants
from engine_core.passes.fuse_qdq_conv import fuse_qdq_conv, keeps_int8_conv_weight, requantizes
from engine_core.passes.pattern import Uses
from tests.cuda.models import optimized_graph
from tests.engine.util import parsed_graph

F = TensorProto.FLOAT
_WIRED = fuse_qdq_conv in PIPELINE
needs_wiring = pytest.mark.skipif(not _WIRED, reason="fuse_qdq_conv is not in the builder's pipeline yet")


@pytest.fixture(autouse=True)
def int8_convolutions(monkeypatch):
    """INT8 implicit-GEMM convolutions are opt-in (KILN_INT8_CONV=1) until measured on a GPU."""
    monkeypatch.setenv("KILN_INT8_CONV", "1")


def qdq_conv_model(rng: np.random.Generator, *, cin: int = 8, cout: int = 16, kernel: int = 3, stride: int = 1,
                   pad: int = 1, size: int = 9, batch: int = 2, residual: bool = False, relu: bool = True,
                   requantize: bool = True, exact: bool = True, per_channel: bool = True, group: int = 1,
                   x_zero: np.ndarray | None = None) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """x -> Q/DQ -> Conv(int8 W via DQ, bias) [-> Add(Q/DQ of r)] [-> Relu] [-> Q/DQ] -> y. ``exact``: scales
    are powers of two and the bias a multiple of the accumulator's step, so float32 computes without rounding."""
    w = rng.integers(-127, 128, (cout, cin // group, kernel, kernel)).astype(np.int8)
    if exact:
        w_scale = (2.0 ** -rng.integers(6, 9, cout if per_channel else ())).astype(np.float32)
        scales = {"x_s": 2.0 ** -5, "r_s": 2.0 ** -4, "y_s": 2.0 ** -2}
        bias = (rng.integers(-64, 64, cout) * 2.0 ** -9).astype(np.float32)
    else:
        w_scale = rng.uniform(0.002, 0.01, cout if per_channel else ()).astype(np.float32)
        scales = {"x_s": 0.031, "r_s": 0.047, "y_s": 0.21}
        bias = (0.3 * rng.standard_normal(cout)).astype(np.float32)
    zero = np.array(0, np.int8)
    inits = {"w_q": w, "w_s": w_scale, "w_z": np.zeros(w_scale.shape, np.int8), "b": bias, "zero": zero,
             "x_z": zero if x_zero is None else x_zero, **{k: np.array(v, np.float32) for k, v in scales.items()}}
    n = helper.make_node
    nodes = [n("QuantizeLinear", ["x", "x_s", "x_z"], ["x_q"], name="q_x"),
             n("DequantizeLinear", ["x_q", "x_s", "x_z"], ["x_dq"], name="dq_x"),
             n("DequantizeLinear", ["w_q", "w_s", "w_z"], ["w_dq"], name="dq_w", axis=0),
             n("Conv", ["x_dq", "w_dq", "b"], ["c"], name="conv", kernel_shape=[kernel, kernel], strides=[stride] * 2,
               pads=[pad] * 4, group=group)]
    tail = "c"
    out = (size + 2 * pad - kernel) // stride + 1
    inputs = {"x": [batch, cin, size, size]}
    if residual:
        inputs["r"] = [batch, cout, out, out]
        nodes += [n("QuantizeLinear", ["r", "r_s", "zero"], ["r_q"], name="q_r"),
                  n("DequantizeLinear", ["r_q", "r_s", "zero"], ["r_dq"], name="dq_r"),
                  n("Add", [tail, "r_dq"], ["added"], name="add")]
        tail = "added"
    if relu:
        nodes.append(n("Relu", [tail], ["act"], name="relu"))
        tail = "act"
    if requantize:
        nodes += [n("QuantizeLinear", [tail, "y_s", "zero"], ["y_q"], name="q_y"),
                  n("DequantizeLinear", ["y_q", "y_s", "zero"], ["y_dq"], name="dq_y")]
        tail = "y_dq"
    nodes[-1].output[0] = "y"  # the graph output (no Identity: a view of a channels-last tensor, see the report)
    graph = helper.make_graph(nodes, "qdq_conv", [helper.make_tensor_value_info(k, F, s) for k, s in inputs.items()],
                              [helper.make_tensor_value_info("y", F, None)],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    feeds = {k: (rng.standard_normal(s) * 2).astype(np.float32) for k, s in inputs.items()}
    return model, feeds



def _fused(model: onnx.ModelProto, requantize: bool = True) -> tuple[Graph, Graph, int]:
    before, after = parsed_graph(model), parsed_graph(model)
    count = fuse_qdq_conv(after, requantize=requantize)
    eliminate_dead_code(after)
    return before, after, count


def _ops(graph: Graph) -> list[str]:
    return [n.op_type for n in graph.nodes]


def test_conv_bias_relu_requantize_becomes_one_qconv(rng):
    model, feeds = qdq_conv_model(rng)
    before, after, count = _fused(model)
    assert count == 1
    assert _ops(after) == ["QuantizeLinear", "QConv", "DequantizeLinear"]
    node = after.nodes[1]
    assert node.domain == "kiln" and requantizes(node)
    assert node.inputs == ["x_q", "x_s", "w_q", "w_s", "b", "", "y_s"] and node.outputs == ["y_q"]
    assert node.attrs == {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1], "activation": "Relu"}
    assert set(node.origin) == {"conv", "relu", "q_y"}
    want, got = GraphRunner(before).run(feeds)["y"], GraphRunner(after).run(feeds)["y"]
    np.testing.assert_array_equal(got, want)  # exact scales: bit for bit, through the requantization


@pytest.mark.parametrize("stride,pad,kernel", [(2, 1, 3), (1, 0, 1), (2, 0, 1), (2, 3, 7)])
def test_residual_add_joins_and_numbers_are_exact(rng, stride, pad, kernel):
    model, feeds = qdq_conv_model(rng, residual=True, stride=stride, pad=pad, kernel=kernel, cin=4 if kernel == 7 else 8)
    before, after, count = _fused(model)
    assert count == 1 and "Add" not in _ops(after) and "Relu" not in _ops(after)
    node = next(n for n in after.nodes if n.op_type == "QConv")
    # the shortcut's DequantizeLinear folds in: the convolution reads it as int8 with its scale (input 7)
    assert node.inputs[5] == "r_q" and node.inputs[7] == "r_s"
    assert "dq_r" not in {n.name for n in after.nodes}
    np.testing.assert_array_equal(GraphRunner(after).run(feeds)["y"], GraphRunner(before).run(feeds)["y"])


@pytest.mark.parametrize("per_channel", [True, False])
def test_arbitrary_scales_agree_to_float32_rounding(rng, per_channel):
    """No requantization: the float results agree to float32 rounding of a C*R*S-term sum (72 terms)."""
    model, feeds = qdq_conv_model(rng, exact=False, requantize=False, per_channel=per_channel)
    before, after, count = _fused(model)
    assert count == 1 and not requantizes(after.nodes[1])
    want, got = GraphRunner(before).run(feeds)["y"], GraphRunner(after).run(feeds)["y"]
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(np.abs(want).max()))


def test_channels_not_a_multiple_of_four_stay_a_float_convolution(rng):
    """An RGB stem (C = 3) is not fused and its weight is folded to float: the GPU's INT8 kernels need C % 4 == 0
    (INT8_CHANNEL_MULTIPLE), and padded the stem ran 12x slower than its fp16 convolution."""
    model, _ = qdq_conv_model(rng, kernel=7, stride=2, pad=3, cin=3)
    _, after, count = _fused(model)
    assert count == 0 and "QConv" not in _ops(after)


def test_requantize_false_keeps_the_quantize_layer(rng):
    model, _ = qdq_conv_model(rng)
    _, after, count = _fused(model, requantize=False)
    assert count == 1 and _ops(after) == ["QuantizeLinear", "QConv", "QuantizeLinear", "DequantizeLinear"]


@pytest.mark.parametrize("case", ["grouped", "asymmetric", "uint8"])
def test_what_stays_unfused(rng, case):
    """Grouped convolutions (depthwise) and non-symmetric / uint8 activations are left as they are."""
    kwargs = {"grouped": {"group": 2}, "asymmetric": {"x_zero": np.array(3, np.int8)},
              "uint8": {"x_zero": np.array(128, np.uint8)}}[case]
    model, feeds = qdq_conv_model(rng, **kwargs)
    before, after, count = _fused(model)
    assert count == 0 and "QConv" not in _ops(after) and "Conv" in _ops(after)


def test_folding_keeps_int8_conv_weights_only_where_the_pass_fuses(rng):
    fused_model, _ = qdq_conv_model(rng)
    graph = parsed_graph(fused_model)
    dq_w = next(n for n in graph.nodes if n.name == "dq_w")
    assert keeps_int8_conv_weight(graph, dq_w, Uses(graph))
    grouped_model, _ = qdq_conv_model(rng, group=2)
    grouped = parsed_graph(grouped_model)
    dq_w = next(n for n in grouped.nodes if n.name == "dq_w")
    assert not keeps_int8_conv_weight(grouped, dq_w, Uses(grouped))  # a float conv: folding dequantizes it once


@needs_wiring
def test_fold_constants_then_fusion_makes_a_qconv(rng):
    model, feeds = qdq_conv_model(rng)
    graph = parsed_graph(model)
    fold_constants(graph)
    assert "dq_w" in [n.name for n in graph.nodes]
    assert fuse_qdq_conv(graph) == 1


def test_qconv_infer_rejects_bad_operands():
    op = get_op("QConv", "kiln")
    node = Node("QConv", ["x", "s", "w", "ws", "", "", ""], ["y"], {"pads": [1, 1, 1, 1], "activation": ""},
                        "c", "kiln", 1)
    i8, f32 = np.dtype(np.int8), np.dtype(np.float32)
    x, s, w = TensorInfo(i8, (1, 8, 5, 5)), TensorInfo(f32, ()), TensorInfo(i8, (4, 8, 3, 3))
    assert op.infer(node, x, s, w, TensorInfo(f32, (4,))).shape == (1, 4, 5, 5)
    with pytest.raises(ShapeInferenceError, match="int8 operands"):
        op.infer(node, TensorInfo(f32, (1, 8, 5, 5)), s, w, TensorInfo(f32, (4,)))
    with pytest.raises(ShapeInferenceError, match="w_scale"):
        op.infer(node, x, s, w, TensorInfo(f32, (3,)))
    with pytest.raises(ShapeInferenceError, match="channels"):
        op.infer(node, TensorInfo(i8, (1, 6, 5, 5)), s, w, TensorInfo(f32, (4,)))


# -- the small resnet50_qdq through the builder ---------------------------------------------------------


@pytest.fixture(scope="module")
def resnet50_qdq() -> onnx.ModelProto:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    from make_models import MODELS

    return MODELS["resnet50_qdq"][1]()


@needs_wiring
def test_resnet50_qdq_runs_every_convolution_as_qconv(resnet50_qdq):
    x = np.random.default_rng(1).standard_normal((2, 3, 64, 64)).astype(np.float32)
    graph = optimized_graph(resnet50_qdq, {"input": x})
    ops = Counter(_ops(graph))
    # the 3-channel stem stays a float convolution of its dequantized weight (INT8_CHANNEL_MULTIPLE)
    assert ops["QConv"] == 52 and ops["Conv"] + ops["FusedConv"] == 1
    # every QConv but the last block's (read by GlobalAveragePool) writes int8
    assert sum(requantizes(n) for n in graph.nodes) == 51
    # the 16 shortcuts reach their QConv as int8 with their scale: no DequantizeLinear is left
    assert ops["DequantizeLinear"] == 0 and sum(len(n.inputs) > 7 for n in graph.nodes if n.op_type == "QConv") == 16
    got = GraphRunner(graph).run({"input": x})["logits"]
    want = GraphRunner(parsed_graph(resnet50_qdq)).run({"input": x})["logits"]  # the unfused, unfolded graph
    # float32 sums in another order move a few values across int8 rounding boundaries, and 50 layers
    # propagate that: measured max <= 3.0% / mean <= 0.33% of max|logits| (3 feeds); the classes agree
    scale = float(np.abs(want).max())
    error = np.abs(got - want)
    assert float(error.max()) <= 0.08 * scale and float(error.mean()) <= 0.01 * scale
    assert (got.argmax(1) == want.argmax(1)).all()


def test_int8_convolutions_are_off_by_default(rng, monkeypatch):
    """Without KILN_INT8_CONV=1 the Q/DQ convolutions stay float convs on folded weights (the measured path)."""
    monkeypatch.delenv("KILN_INT8_CONV")
    graph = parsed_graph(qdq_conv_model(rng)[0])
    fold_constants(graph)
    assert fuse_qdq_conv(graph) == 0 and "QConv" not in _ops(graph)
    assert not [n for n in graph.nodes if n.op_type == "DequantizeLinear" and n.inputs[0] in graph.constants]


def test_cuda_builds_with_cudnn_int8_turn_int8_convolutions_on(rng, monkeypatch):
    """The builder's choice (KILN_INT8_CONV unset): INT8 convolutions for CUDA builds of Q/DQ (or calibrated)
    graphs whose cuDNN builds INT8 graphs; never for the CPU backend; the variable forces either way."""
    import engine_core as kiln
    from engine_core.backends.cuda import cudnn_conv
    from engine_core.builder import _int8_convolutions
    from engine_core.passes.fuse_qdq_conv import enabled, int8_convolutions

    monkeypatch.delenv("KILN_INT8_CONV")
    graph = parsed_graph(qdq_conv_model(rng)[0])
    config = kiln.Builder().create_builder_config()
    monkeypatch.setattr(cudnn_conv, "int8_unsupported", lambda: "")
    config.backend = "cpu"
    assert not _int8_convolutions(graph, config, calibrated=False)
    config.backend = "cuda"
    assert _int8_convolutions(graph, config, calibrated=False)
    float_graph = parsed_graph(qdq_conv_model(rng)[0])
    float_graph.nodes = [n for n in float_graph.nodes if n.op_type != "DequantizeLinear"]
    assert not _int8_convolutions(float_graph, config, calibrated=False)
    assert _int8_convolutions(float_graph, config, calibrated=True)
    monkeypatch.setattr(cudnn_conv, "int8_unsupported", lambda: "no cuDNN frontend")
    assert not _int8_convolutions(graph, config, calibrated=False)
    with int8_convolutions(True):
        assert enabled()
        monkeypatch.setenv("KILN_INT8_CONV", "0")
        assert not enabled()
    monkeypatch.setenv("KILN_INT8_CONV", "1")
    assert enabled()
    monkeypatch.delenv("KILN_INT8_CONV")
    assert not enabled()
