"""Fusion passes (engine_core/passes/fuse_*.py): the fused graph they make and the numbers it computes.

Every pattern is checked twice: the pass output (which layers, which attributes, ``origin``) and a full
CPU build of the model against onnxruntime running the unfused ONNX model.
"""

from __future__ import annotations

import math
from collections import Counter

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import engine_core as kiln
from engine_core.ir import Graph, Node
from engine_core.ops import get_op
from engine_core.passes import (
    FUSION_PASSES,
    PIPELINE,
    PRE_PASSES,
    eliminate_transposes,
    fuse_attention,
    fuse_conv_epilogue,
    fuse_gelu,
    fuse_layer_norm,
    fuse_log_softmax,
    fuse_matmul_epilogue,
    fuse_pointwise_chain,
    fuse_rms_norm,
)
from engine_core.types import LayerInformationFormat, ProfilingVerbosity
from tests.engine.util import build, float_model, ort_run, parsed_graph

F = TensorProto.FLOAT


def _ops(graph: Graph) -> list[str]:
    return [n.op_type for n in graph.nodes]


def _matches_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray], rtol: float = 1e-4,
                 atol: float = 1e-5, backend: str = "cpu") -> None:
    """A build (all passes on) computes what onnxruntime computes on the unfused model."""
    plan = build(model, {k: (v.shape, v.shape, v.shape) for k, v in feeds.items()}, backend=backend)
    out = kiln.Runtime().load(plan).create_execution_context().infer(feeds)
    names = [o.name for o in model.graph.output]
    for name, ref in zip(names, ort_run(model, feeds)):
        np.testing.assert_allclose(out[name], ref, rtol=rtol, atol=atol, err_msg=name)


def _w(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return (rng.standard_normal(shape) * 0.3).astype(np.float32)


# -- fuse_conv_epilogue ------------------------------------------------------------------------------


def _conv_block(rng: np.random.Generator, activation: str) -> onnx.ModelProto:
    """Conv (no bias) -> Add(per-channel constant) -> Add(residual) -> activation."""
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c", "b"], ["cb"], name="bias"),
             helper.make_node("Add", ["z", "cb"], ["s"], name="residual")]
    inits = {"w": _w(rng, 4, 3, 3, 3), "b": _w(rng, 1, 4, 1, 1)}
    if activation == "Clip":
        nodes.append(helper.make_node("Clip", ["s", "lo", "hi"], ["y"], name="act"))
        inits.update(lo=np.float32(-0.5), hi=np.float32(0.75))
    else:
        attrs = {"alpha": 0.2} if activation == "LeakyRelu" else {}
        nodes.append(helper.make_node(activation, ["s"], ["y"], name="act", **attrs))
    return float_model(nodes, {"x": [2, 3, 8, 8], "z": [2, 4, 8, 8]}, ["y"], inits)


@pytest.mark.parametrize("activation,alpha,beta", [("Relu", 0.0, 0.0), ("Clip", -0.5, 0.75),
                                                   ("LeakyRelu", 0.2, 0.0), ("Sigmoid", 0.0, 0.0)])
def test_conv_bias_residual_activation_become_one_fused_conv(rng, activation, alpha, beta):
    model = _conv_block(rng, activation)
    graph = parsed_graph(model)
    assert fuse_conv_epilogue(graph) == 1
    (node,) = graph.nodes
    assert (node.op_type, node.domain) == ("FusedConv", "kiln")
    assert node.inputs[0:2] == ["x", "w"] and node.inputs[3] == "z" and node.outputs == ["y"]
    np.testing.assert_array_equal(graph.constants[node.inputs[2]], model_init(model, "b").reshape(-1))
    assert node.attrs["activation"] == activation and node.attrs["pads"] == [1, 1, 1, 1]
    assert node.attrs["activation_alpha"] == pytest.approx(alpha)
    assert node.attrs["activation_beta"] == pytest.approx(beta)
    assert node.origin == ["conv", "bias", "residual", "act"]
    feeds = {"x": rng.standard_normal((2, 3, 8, 8)).astype(np.float32),
             "z": rng.standard_normal((2, 4, 8, 8)).astype(np.float32)}
    _matches_ort(model, feeds)


def model_init(model: onnx.ModelProto, name: str) -> np.ndarray:
    return next(numpy_helper.to_array(t) for t in model.graph.initializer if t.name == name)


def test_conv_fusion_stops_at_tensors_read_elsewhere(rng):
    """An intermediate that is a graph output or has a second reader must stay materialized."""
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv"),
             helper.make_node("Relu", ["c"], ["y"], name="relu"),
             helper.make_node("Conv", ["x", "w", "b"], ["c2"], name="conv2"),
             helper.make_node("Relu", ["c2"], ["y2"], name="relu2"),
             helper.make_node("Sigmoid", ["c2"], ["y3"], name="sig")]
    model = float_model(nodes, {"x": [1, 3, 5, 5]}, ["c", "y", "y2", "y3"], {"w": _w(rng, 2, 3, 1, 1), "b": _w(rng, 2)})
    graph = parsed_graph(model)
    assert fuse_conv_epilogue(graph) == 0
    assert _ops(graph) == ["Conv", "Relu", "Conv", "Relu", "Sigmoid"]


def test_conv_with_bias_and_relu_keeps_bias_input(rng):
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", strides=[2, 2], group=2),
             helper.make_node("Relu", ["c"], ["y"], name="relu")]
    model = float_model(nodes, {"x": [1, 4, 9, 9]}, ["y"], {"w": _w(rng, 6, 2, 3, 3), "b": _w(rng, 6)})
    graph = parsed_graph(model)
    assert fuse_conv_epilogue(graph) == 1
    node = graph.nodes[0]
    assert node.inputs == ["x", "w", "b", ""] and node.attrs["group"] == 2 and node.attrs["strides"] == [2, 2]
    _matches_ort(model, {"x": rng.standard_normal((1, 4, 9, 9)).astype(np.float32)})


def test_constants_that_would_widen_the_output_are_not_biases(rng):
    """A [1, C, 1, 1] constant added to a 1-D conv's [N, C, L] output, or a [1, 1, N] one added to a 2-D
    GEMM's output, broadcasts to a larger tensor: folding either into a bias would change the shape."""
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"), helper.make_node("Add", ["c", "b"], ["y"]),
             helper.make_node("MatMul", ["m", "w2"], ["mm"]), helper.make_node("Add", ["mm", "b2"], ["y2"])]
    inits = {"w": _w(rng, 4, 3, 3), "b": _w(rng, 1, 4, 1, 1), "w2": _w(rng, 3, 2), "b2": _w(rng, 1, 1, 2)}
    model = float_model(nodes, {"x": [1, 3, 7], "m": [5, 3]}, ["y", "y2"], inits)
    graph = parsed_graph(model)
    assert fuse_conv_epilogue(graph) == 0 and fuse_matmul_epilogue(graph) == 0
    _matches_ort(model, {"x": _x(rng, 1, 3, 7), "m": _x(rng, 5, 3)})


# -- fuse_matmul_epilogue ----------------------------------------------------------------------------


def _linear(rng: np.random.Generator, activation: str) -> onnx.ModelProto:
    """MatMul(x [2, 3, 5], W [5, 7]) + bias [7] (+ activation)."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
             helper.make_node("Add", ["bias", "m"], ["a"], name="add")]
    output = "a"
    if activation:
        nodes.append(helper.make_node(activation, ["a"], ["y"], name="act"))
        output = "y"
    return float_model(nodes, {"x": [2, 3, 5]}, [output], {"w": _w(rng, 5, 7), "bias": _w(rng, 7)},
                  opset=20 if activation == "Gelu" else 17)


@pytest.mark.parametrize("activation", ["Relu", "Sigmoid", "Tanh", "Gelu", ""])
def test_linear_layer_becomes_fused_matmul(rng, activation):
    model = _linear(rng, activation)
    graph = parsed_graph(model)
    assert fuse_matmul_epilogue(graph) == 1
    (node,) = graph.nodes
    assert (node.op_type, node.domain, node.inputs) == ("FusedMatMul", "kiln", ["x", "w", "bias"])
    assert node.attrs == {"transA": 0, "transB": 0, "alpha": 1.0, "activation": activation}
    assert node.origin == ["mm", "add"] + (["act"] if activation else [])
    _matches_ort(model, {"x": rng.standard_normal((2, 3, 5)).astype(np.float32)})


def _gemm_and_transposed(rng: np.random.Generator) -> onnx.ModelProto:
    """Gemm(transB, alpha) + Relu, and a MatMul whose A is a last-two-dims Transpose."""
    nodes = [helper.make_node("Gemm", ["x", "w", "c"], ["g"], name="gemm", transB=1, alpha=0.5),
             helper.make_node("Relu", ["g"], ["y"], name="relu"),
             helper.make_node("Transpose", ["x3"], ["t"], name="tr", perm=[0, 2, 1]),
             helper.make_node("MatMul", ["t", "w2"], ["m"], name="mm"),
             helper.make_node("Add", ["m", "b2"], ["y2"], name="add")]
    inits = {"w": _w(rng, 6, 4), "c": _w(rng, 6), "w2": _w(rng, 3, 2), "b2": _w(rng, 1, 2)}
    return float_model(nodes, {"x": [5, 4], "x3": [2, 3, 4]}, ["y", "y2"], inits)


def test_gemm_and_transposed_operand_fold_into_flags(rng):
    model = _gemm_and_transposed(rng)
    graph = parsed_graph(model)
    assert fuse_matmul_epilogue(graph) == 2
    gemm, mm = graph.nodes
    assert gemm.attrs == {"transA": 0, "transB": 1, "alpha": 0.5, "activation": "Relu"}
    assert mm.inputs[0] == "x3" and mm.attrs["transA"] == 1 and graph.constants[mm.inputs[2]].shape == (2,)
    assert mm.origin == ["tr", "mm", "add"]
    _matches_ort(model, {"x": rng.standard_normal((5, 4)).astype(np.float32),
                         "x3": rng.standard_normal((2, 3, 4)).astype(np.float32)})


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_fused_ops_run_in_half_precision(rng, dtype):
    """fp16/bf16 graphs reach the CPU implementations directly: they compute in that type, close to fp32."""
    a, b, bias = rng.standard_normal((2, 3, 8)), rng.standard_normal((8, 4)), rng.standard_normal(4)
    node = Node("FusedMatMul", ["a", "b", "c"], ["y"], {"transA": 0, "transB": 0, "alpha": 2.0,
                                                        "activation": "GeluTanh"}, "fm", "kiln", 1)
    y = get_op("FusedMatMul", "kiln").cpu(node, a.astype(dtype), b.astype(dtype), bias.astype(dtype))
    z = 2.0 * a @ b + bias
    ref = 0.5 * z * (1 + np.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)))
    assert y.dtype == np.dtype(dtype)
    np.testing.assert_allclose(y.astype(np.float32), ref, rtol=0.05, atol=0.1)
    x, w, z_res = rng.standard_normal((1, 2, 5, 5)), rng.standard_normal((3, 2, 3, 3)), rng.standard_normal((1, 3, 3, 3))
    node = Node("FusedConv", ["x", "w", "", "z"], ["y"], {"activation": "Clip", "activation_alpha": -1.0,
                                                         "activation_beta": 1.0}, "fc", "kiln", 1)
    y = get_op("FusedConv", "kiln").cpu(node, x.astype(dtype), w.astype(dtype), None, z_res.astype(dtype))
    windows = np.lib.stride_tricks.sliding_window_view(x, (3, 3), axis=(2, 3))  # [1, 2, 3, 3, 3, 3]
    ref = np.clip(np.einsum("ncijkl,ockl->noij", windows, w) + z_res, -1, 1)
    assert y.dtype == np.dtype(dtype)
    np.testing.assert_allclose(y.astype(np.float32), ref, rtol=0.05, atol=0.1)


def test_fused_op_rejects_unknown_activation(rng):
    node = Node("FusedMatMul", ["a", "b"], ["y"], {"activation": "Swish"}, "fm", "kiln", 1)
    with pytest.raises(kiln.KilnError, match="unknown fused activation 'Swish'"):
        get_op("FusedMatMul", "kiln").cpu(node, np.ones((2, 2), np.float32), np.ones((2, 2), np.float32))


# -- fuse_gelu ---------------------------------------------------------------------------------------


def _gelu_erf(order: str) -> list:
    """x * 0.5 * (1 + erf(x / sqrt(2))) in the operand orders exporters write."""
    head = [helper.make_node("Div", ["x", "sqrt2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
            helper.make_node("Add", ["one", "e"], ["p"])]
    if order == "half_x_first":
        return head + [helper.make_node("Mul", ["x", "half"], ["h"]), helper.make_node("Mul", ["h", "p"], ["y"])]
    if order == "half_last":
        return head + [helper.make_node("Mul", ["p", "x"], ["h"]), helper.make_node("Mul", ["h", "half"], ["y"])]
    return head + [helper.make_node("Mul", ["half", "p"], ["h"]), helper.make_node("Mul", ["x", "h"], ["y"])]


def _gelu_tanh() -> list:
    return [helper.make_node("Pow", ["x", "three"], ["c"]), helper.make_node("Mul", ["c", "k"], ["ck"]),
            helper.make_node("Add", ["x", "ck"], ["inner"]), helper.make_node("Mul", ["s2pi", "inner"], ["arg"]),
            helper.make_node("Tanh", ["arg"], ["t"]), helper.make_node("Mul", ["x", "half"], ["h"]),
            helper.make_node("Add", ["t", "one"], ["p"]), helper.make_node("Mul", ["h", "p"], ["y"])]


@pytest.mark.parametrize("form", ["half_x_first", "half_last", "half_inner", "tanh"])
def test_gelu_patterns_become_one_gelu(rng, form):
    nodes = _gelu_tanh() if form == "tanh" else _gelu_erf(form)
    inits = {"sqrt2": np.float32(math.sqrt(2)), "one": np.float32(1), "half": np.float32(0.5),
             "three": np.float32(3), "k": np.float32(0.044715), "s2pi": np.float32(math.sqrt(2 / math.pi))}
    inits = {k: v for k, v in inits.items() if any(k in n.input for n in nodes)}
    model = float_model(nodes, {"x": [3, 16]}, ["y"], inits, opset=13)
    graph = parsed_graph(model)
    assert fuse_gelu(graph) == 1
    (node,) = graph.nodes
    assert (node.op_type, node.inputs, node.outputs, node.opset) == ("Gelu", ["x"], ["y"], 20)
    assert node.attrs["approximate"] == ("tanh" if form == "tanh" else "none")
    assert len(node.origin) == len(nodes)
    _matches_ort(model, {"x": rng.standard_normal((3, 16)).astype(np.float32) * 3})


def test_gelu_with_a_shared_intermediate_is_left_alone():
    nodes = _gelu_erf("half_x_first")
    model = float_model(nodes, {"x": [2, 4]}, ["y", "e"], {"sqrt2": np.float32(math.sqrt(2)), "one": np.float32(1),
                                                       "half": np.float32(0.5)}, opset=13)
    graph = parsed_graph(model)
    assert fuse_gelu(graph) == 0 and len(graph.nodes) == len(nodes)


# -- fuse_layer_norm / fuse_rms_norm ------------------------------------------------------------------


def _layer_norm_nodes(axes_as_input: bool) -> list:
    def mean(x: str, y: str) -> onnx.NodeProto:
        if axes_as_input:
            return helper.make_node("ReduceMean", [x, "axes"], [y], keepdims=1)
        return helper.make_node("ReduceMean", [x], [y], axes=[-1], keepdims=1)

    return [mean("x", "mu"), helper.make_node("Sub", ["x", "mu"], ["d"]),
            helper.make_node("Pow", ["d", "two"], ["sq"]), mean("sq", "var"),
            helper.make_node("Add", ["var", "eps"], ["ve"]), helper.make_node("Sqrt", ["ve"], ["sd"]),
            helper.make_node("Div", ["d", "sd"], ["n"]), helper.make_node("Mul", ["n", "gamma"], ["g"]),
            helper.make_node("Add", ["g", "beta"], ["y"])]


def _layer_norm(rng: np.random.Generator, opset: int, cols: int = 8) -> onnx.ModelProto:
    nodes = _layer_norm_nodes(axes_as_input=opset >= 18)
    inits = {"two": np.float32(2), "eps": np.float32(1e-5), "gamma": _w(rng, cols) + 1, "beta": _w(rng, cols),
             "axes": np.array([-1], np.int64)}
    inits = {k: v for k, v in inits.items() if any(k in n.input for n in nodes)}
    return float_model(nodes, {"x": [2, 5, cols]}, ["y"], inits, opset=opset)


@pytest.mark.parametrize("opset", [13, 18])
def test_decomposed_layer_norm_becomes_layer_normalization(rng, opset):
    model = _layer_norm(rng, opset)
    graph = parsed_graph(model)
    assert fuse_layer_norm(graph) == 1
    (node,) = graph.nodes
    assert (node.op_type, node.inputs, node.outputs, node.opset) == ("LayerNormalization", ["x", "gamma", "beta"],
                                                                    ["y"], 17)
    assert node.attrs["axis"] == -1 and node.attrs["epsilon"] == pytest.approx(1e-5)
    assert len(node.origin) == len(model.graph.node)
    _matches_ort(model, {"x": rng.standard_normal((2, 5, 8)).astype(np.float32)})


def test_decomposed_rms_norm_becomes_rms_normalization(rng):
    """x * (1 / sqrt(mean(x^2) + eps)) * gamma, as LLaMA-style exports write it."""
    nodes = [helper.make_node("Pow", ["x", "two"], ["sq"]),
             helper.make_node("ReduceMean", ["sq"], ["ms"], axes=[-1], keepdims=1),
             helper.make_node("Add", ["ms", "eps"], ["me"]), helper.make_node("Sqrt", ["me"], ["r"]),
             helper.make_node("Reciprocal", ["r"], ["inv"]), helper.make_node("Mul", ["x", "inv"], ["n"]),
             helper.make_node("Mul", ["gamma", "n"], ["y"])]
    model = float_model(nodes, {"x": [2, 3, 8]}, ["y"], {"two": np.float32(2), "eps": np.float32(1e-6),
                                                     "gamma": _w(rng, 8) + 1}, opset=13)
    graph = parsed_graph(model)
    assert fuse_rms_norm(graph) == 1
    (node,) = graph.nodes
    assert (node.op_type, node.inputs, node.opset) == ("RMSNormalization", ["x", "gamma"], 23)
    assert node.attrs["axis"] == -1 and node.attrs["epsilon"] == pytest.approx(1e-6)
    _matches_ort(model, {"x": rng.standard_normal((2, 3, 8)).astype(np.float32)})


# -- fuse_attention ----------------------------------------------------------------------------------


def _attention_model(rng: np.random.Generator, key_perm: str, masked: bool,
                     mask_shape: tuple[int, ...] = (2, 1, 1, 6)) -> onnx.ModelProto:
    """BERT-style heads: q/k/v [B, S, H*D] -> Reshape [B, S, H, D] -> Transpose -> scaled masked softmax."""
    nodes = [helper.make_node("Reshape", [t, "shape"], [f"{t}4"]) for t in ("q", "k", "v")]
    nodes += [helper.make_node("Transpose", ["q4"], ["qh"], perm=[0, 2, 1, 3]),
              helper.make_node("Transpose", ["v4"], ["vh"], perm=[0, 2, 1, 3])]
    if key_perm == "split_then_swap":  # torch: k.transpose(1, 2) then k.transpose(-1, -2)
        nodes += [helper.make_node("Transpose", ["k4"], ["kh"], perm=[0, 2, 1, 3]),
                  helper.make_node("Transpose", ["kh"], ["kt"], perm=[0, 1, 3, 2])]
    else:  # one Transpose straight from [B, S, H, D] to [B, H, D, S]
        nodes.append(helper.make_node("Transpose", ["k4"], ["kt"], perm=[0, 2, 3, 1]))
    nodes += [helper.make_node("MatMul", ["qh", "kt"], ["s"], name="scores"),
              helper.make_node("Div", ["s", "sqrt_d"], ["ss"], name="scale")]
    if masked:
        nodes.append(helper.make_node("Add", ["ss", "mask"], ["sm"], name="mask_add"))
    nodes += [helper.make_node("Softmax", ["sm" if masked else "ss"], ["p"], name="softmax", axis=-1),
              helper.make_node("MatMul", ["p", "vh"], ["y"], name="context")]
    inputs = {t: [2, 6, 8] for t in "qkv"} | ({"mask": list(mask_shape)} if masked else {})
    return float_model(nodes, inputs, ["y"], {"shape": np.array([0, 0, 2, 4], np.int64), "sqrt_d": np.float32(2.0)})


@pytest.mark.parametrize("key_perm,masked", [("split_then_swap", True), ("one_transpose", True),
                                             ("split_then_swap", False)])
def test_attention_block_becomes_onnx_attention(rng, key_perm, masked):
    model = _attention_model(rng, key_perm, masked)
    graph = parsed_graph(model)
    assert fuse_attention(graph) == 1
    attention = next(n for n in graph.nodes if n.op_type == "Attention")
    assert attention.opset == 23 and attention.attrs["scale"] == pytest.approx(0.5)
    assert attention.inputs[0] == "qh" and attention.inputs[2] == "vh"
    assert attention.inputs[3:] == (["mask"] if masked else [])
    key = next(n for n in graph.nodes if attention.inputs[1] in n.outputs)
    assert key.op_type == "Transpose" and key.attrs["perm"] == [0, 2, 1, 3] and key.inputs == ["k4"]
    assert {"scores", "scale", "softmax", "context"} <= set(attention.origin)
    _matches_ort(model, _attention_feeds(rng, masked))


def test_a_mask_broadcast_over_the_keys_is_expanded_not_padded(rng):
    """Add(scores, mask[..., 1]) adds one value to every key; Attention reads a short mask as "pad with -inf",
    so the fused node gets the mask expanded to the key count."""
    model = _attention_model(rng, "one_transpose", True, mask_shape=(2, 1, 1, 1))
    graph = parsed_graph(model)
    assert fuse_attention(graph) == 1
    attention = next(n for n in graph.nodes if n.op_type == "Attention")
    expand = next(n for n in graph.nodes if attention.inputs[3] in n.outputs)
    assert expand.op_type == "Expand" and expand.inputs[0] == "mask"
    feeds = _attention_feeds(rng, False) | {"mask": rng.standard_normal((2, 1, 1, 1)).astype(np.float32)}
    _matches_ort(model, feeds)


def _attention_feeds(rng: np.random.Generator, masked: bool) -> dict[str, np.ndarray]:
    feeds = {t: rng.standard_normal((2, 6, 8)).astype(np.float32) for t in "qkv"}
    if masked:
        mask = np.zeros((2, 1, 1, 6), np.float32)
        mask[0, ..., 4:] = -10000.0
        feeds["mask"] = mask
    return feeds


def _where_attention() -> onnx.ModelProto:
    """GPT-2: scores * scale -> Where(causal, ., -big) -> Softmax; Q/K/V straight from 4-D inputs."""
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]), helper.make_node("Mul", ["s", "scale"], ["ss"]),
             helper.make_node("Where", ["causal", "ss", "fill"], ["sm"]),
             helper.make_node("Softmax", ["sm"], ["p"], axis=-1), helper.make_node("MatMul", ["p", "v"], ["y"])]
    graph_def = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(t, F, [1, 2, 5, 4]) for t in "qkv"]
        + [helper.make_tensor_value_info("causal", TensorProto.BOOL, [1, 1, 5, 5])],
        [helper.make_tensor_value_info("y", F, None)],
        [numpy_helper.from_array(np.float32(0.5), "scale"),
         numpy_helper.from_array(np.float32(np.finfo(np.float32).min), "fill")])
    model = helper.make_model(graph_def, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def _where_feeds(rng: np.random.Generator) -> dict[str, np.ndarray]:
    feeds = {t: rng.standard_normal((1, 2, 5, 4)).astype(np.float32) for t in "qkv"}
    feeds["causal"] = np.tril(np.ones((5, 5), bool))[None, None]
    return feeds


def test_where_masked_attention_gets_a_boolean_mask(rng):
    model = _where_attention()
    graph = parsed_graph(model)
    assert fuse_attention(graph) == 1
    (attention,) = graph.nodes
    assert attention.inputs == ["q", "k", "v", "causal"] and attention.attrs["scale"] == pytest.approx(0.5)
    _matches_ort(model, _where_feeds(rng))


def test_softmax_over_another_axis_is_not_attention(rng):
    model = _attention_model(rng, "split_then_swap", masked=False)
    for node in model.graph.node:
        if node.op_type == "Softmax":
            node.attribute[0].i = 2
    graph = parsed_graph(model)
    assert fuse_attention(graph) == 0


# -- fuse_pointwise_chain, eliminate_transposes, fuse_log_softmax --------------------------------------


def _pointwise() -> onnx.ModelProto:
    """(x * 2 + y) -> Relu -> Sigmoid is one chain; e = Exp(x) is read twice, so it ends its own group."""
    nodes = [helper.make_node("Mul", ["x", "two"], ["a"], name="mul"),
             helper.make_node("Add", ["a", "y"], ["b"], name="add"),
             helper.make_node("Relu", ["b"], ["c"], name="relu"),
             helper.make_node("Sigmoid", ["c"], ["out"], name="sig"),
             helper.make_node("Exp", ["x"], ["e"], name="exp"),
             helper.make_node("Neg", ["e"], ["n"], name="neg"),
             helper.make_node("MatMul", ["e", "n"], ["out2"], name="mm")]
    return float_model(nodes, {"x": [4, 4], "y": [1, 4]}, ["out", "out2"], {"two": np.float32(2)})


def test_pointwise_layers_become_one_chain(rng):
    model = _pointwise()
    graph = parsed_graph(model)
    assert fuse_pointwise_chain(graph) == 1
    assert _ops(graph) == ["PointwiseChain", "Exp", "Neg", "MatMul"]
    chain = graph.nodes[0]
    assert chain.domain == "kiln" and chain.inputs == ["x", "two", "y"] and chain.outputs == ["out"]
    body = chain.attrs["body"]
    assert [v.name for v in body.inputs] == chain.inputs and body.output_names == ["out"]
    assert _ops(body) == ["Mul", "Add", "Relu", "Sigmoid"] and chain.origin == ["mul", "add", "relu", "sig"]
    _matches_ort(model, {"x": rng.standard_normal((4, 4)).astype(np.float32),
                         "y": rng.standard_normal((1, 4)).astype(np.float32)})


def _fake_quant(per_axis: bool) -> onnx.ModelProto:
    """Relu -> QuantizeLinear -> DequantizeLinear (an explicitly quantized activation) -> Exp."""
    scale = np.full(4, 0.05, np.float32) if per_axis else np.float32(0.05)
    zero = np.zeros(4, np.int8) if per_axis else np.int8(0)
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("QuantizeLinear", ["r", "s", "z"], ["q"], name="q", axis=1),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["dq"], name="dq", axis=1),
             helper.make_node("Exp", ["dq"], ["y"], name="exp")]
    return float_model(nodes, {"x": [2, 4, 3]}, ["y"], {"s": scale, "z": zero}, opset=13)


def test_per_tensor_quantize_dequantize_joins_a_chain(rng):
    """A per-tensor Q -> DQ pair (a Q/DQ model run in float) is pointwise: one kernel keeps the int8 value in
    registers. Per-axis pairs stay layers of their own (their scales broadcast along an axis)."""
    feeds = {"x": rng.standard_normal((2, 4, 3)).astype(np.float32)}
    graph = parsed_graph(_fake_quant(per_axis=False))
    assert fuse_pointwise_chain(graph) == 1 and _ops(graph) == ["PointwiseChain"]
    assert _ops(graph.nodes[0].attrs["body"]) == ["Relu", "QuantizeLinear", "DequantizeLinear", "Exp"]
    _matches_ort(_fake_quant(per_axis=False), feeds)
    graph = parsed_graph(_fake_quant(per_axis=True))
    fuse_pointwise_chain(graph)
    assert _ops(graph) == ["Relu", "QuantizeLinear", "DequantizeLinear", "Exp"]


def test_transposes_merge_and_identities_vanish(rng):
    nodes = [helper.make_node("Transpose", ["x"], ["a"], perm=[0, 2, 1, 3]),
             helper.make_node("Transpose", ["a"], ["b"], perm=[0, 1, 3, 2]),
             helper.make_node("Transpose", ["x"], ["c"], perm=[1, 0, 2, 3]),
             helper.make_node("Transpose", ["c"], ["d"], perm=[1, 0, 2, 3]),
             helper.make_node("Relu", ["d"], ["y2"])]
    model = float_model(nodes, {"x": [2, 3, 4, 5]}, ["b", "y2"], {})
    graph = parsed_graph(model)
    assert eliminate_transposes(graph) >= 2
    assert _ops(graph) == ["Transpose", "Relu"]
    assert graph.nodes[0].attrs["perm"] == [0, 2, 3, 1] and graph.nodes[0].inputs == ["x"]
    assert graph.nodes[1].inputs == ["x"]
    _matches_ort(model, {"x": rng.standard_normal((2, 3, 4, 5)).astype(np.float32)})


def test_softmax_then_log_becomes_log_softmax(rng):
    nodes = [helper.make_node("Softmax", ["x"], ["s"], name="sm", axis=1),
             helper.make_node("Log", ["s"], ["y"], name="log")]
    model = float_model(nodes, {"x": [3, 7]}, ["y"], {})
    graph = parsed_graph(model)
    assert fuse_log_softmax(graph) == 1
    (node,) = graph.nodes
    assert (node.op_type, node.attrs["axis"], node.origin) == ("LogSoftmax", 1, ["sm", "log"])
    _matches_ort(model, {"x": rng.standard_normal((3, 7)).astype(np.float32) * 10})


# -- the pipeline on whole models ---------------------------------------------------------------------


def test_pipeline_is_folding_then_fusions_then_dead_code():
    assert PIPELINE == PRE_PASSES + FUSION_PASSES
    assert FUSION_PASSES[-1].__name__ == "eliminate_dead_code"
    names = [p.__name__ for p in FUSION_PASSES]
    assert names.index("fuse_gelu") < names.index("fuse_matmul_epilogue") < names.index("fuse_pointwise_chain")
    assert names.index("fuse_attention") < names.index("eliminate_transposes")


def _fused_counts(model: onnx.ModelProto) -> Counter:
    graph = parsed_graph(model)
    for fuse in PIPELINE:
        fuse(graph)
    return Counter(n.op_type for n in graph.nodes)


def test_real_architectures_fuse_their_layers():
    """ResNet's Conv->Relu and Conv->Add->Relu, BERT's attention / GELU / linear layers, GPT-2's tanh GELU and
    causal attention (the numbers: tests/engine/test_real_models.py, which builds with every pass on)."""
    from tools.make_models import MODELS

    resnet = _fused_counts(MODELS["resnet50"][1]())
    assert resnet["FusedConv"] == 49 and resnet["Relu"] == 0 and resnet["Add"] == 0
    bert = _fused_counts(MODELS["bert_base"][1]())
    assert bert["Attention"] == 2 and bert["Softmax"] == 0 and bert["Erf"] == 0 and bert["MatMul"] == 0
    gpt2 = _fused_counts(MODELS["gpt2"][1]())
    assert gpt2["Tanh"] == 0 and gpt2["Pow"] == 0 and gpt2["FusedMatMul"] == 8 and gpt2["Attention"] == 2


def test_inspector_shows_the_onnx_nodes_a_fused_layer_covers(rng):
    builder = kiln.Builder()
    network = builder.create_network()
    assert kiln.OnnxParser(network).parse(_conv_block(rng, "Relu").SerializeToString())
    config = builder.create_builder_config()
    config.profiling_verbosity = ProfilingVerbosity.DETAILED
    engine = kiln.Runtime().load(kiln.build_plan(network, config))
    text = engine.create_engine_inspector().get_engine_information(LayerInformationFormat.ONELINE)
    assert "[FusedConv]" in text and "origin=conv,bias,residual,act" in text


# -- the fused ops on the CUDA backend (the lead's lowering of the same contracts) ----------------------


def _x(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


GPU_CASES = {
    **{f"conv_{a}": (lambda r, a=a: _conv_block(r, a), lambda r: {"x": _x(r, 2, 3, 8, 8), "z": _x(r, 2, 4, 8, 8)})
       for a in ("Relu", "Clip", "LeakyRelu", "Sigmoid")},
    **{f"linear_{a or 'none'}": (lambda r, a=a: _linear(r, a), lambda r: {"x": _x(r, 2, 3, 5)})
       for a in ("Relu", "Sigmoid", "Tanh", "Gelu", "")},
    "gemm_transposed": (_gemm_and_transposed, lambda r: {"x": _x(r, 5, 4), "x3": _x(r, 2, 3, 4)}),
    "attention_masked": (lambda r: _attention_model(r, "split_then_swap", True), lambda r: _attention_feeds(r, True)),
    "attention_one_transpose": (lambda r: _attention_model(r, "one_transpose", False),
                                lambda r: _attention_feeds(r, False)),
    "attention_where": (lambda r: _where_attention(), _where_feeds),
    "pointwise_chain": (lambda r: _pointwise(), lambda r: {"x": _x(r, 4, 4), "y": _x(r, 1, 4)}),
    "layer_norm": (lambda r: _layer_norm(r, 13), lambda r: {"x": _x(r, 2, 5, 8)}),
    # a warp per row: 16-byte vectors (768: three a lane), one element a lane (13 is no multiple of 4); a block per
    # row past 1024
    **{f"layer_norm_cols{c}": (lambda r, c=c: _layer_norm(r, 13, c), lambda r, c=c: {"x": _x(r, 2, 5, c)})
       for c in (13, 768, 1100)},
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_fused_layers_on_the_cuda_backend_match_onnxruntime(rng, case):
    make_model, make_feeds = GPU_CASES[case]
    _matches_ort(make_model(rng), make_feeds(rng), rtol=2e-3, atol=2e-3, backend="cuda")
