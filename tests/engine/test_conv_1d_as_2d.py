"""conv_1d_as_2d: every 1-D Conv becomes Unsqueeze -> 2-D Conv -> Squeeze, computing the same numbers on the CPU
backend, so that the CUDA backend runs it on cuDNN (2-D only) instead of on the host."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import engine_core as kiln
from engine_core.interpret import GraphRunner
from engine_core.ir import Graph
from engine_core.ops import TensorInfo
from engine_core.passes import PIPELINE, PRE_PASSES, conv_1d_as_2d, fold_conv_batchnorm, infer_shapes
from tests.engine.util import build, ort_run, parsed_graph

_DTYPES = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16}


def _model(nodes: list, x_shape: list, inits: dict[str, np.ndarray], outputs: tuple[str, ...] = ("y",),
           dtype: type = np.float32, opset: int = 17) -> onnx.ModelProto:
    """A model of ``nodes`` reading one input ``x`` of ``x_shape`` (``dtype``), writing ``outputs``."""
    elem = _DTYPES[np.dtype(dtype)]
    graph = helper.make_graph(nodes, "conv1d", [helper.make_tensor_value_info("x", elem, x_shape)],
                              [helper.make_tensor_value_info(o, elem, None) for o in outputs],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _conv1d(rng: np.random.Generator, channels: int = 4, out: int = 6, kernel: int = 3, group: int = 1,
            bias: bool = True, dtype: type = np.float32, **attrs) -> onnx.ModelProto:
    """One Conv1d over x [batch, channels, length]."""
    inits = {"w": (rng.standard_normal((out, channels // group, kernel)) / np.sqrt(channels * kernel)).astype(dtype)}
    if bias:
        inits["b"] = (rng.standard_normal(out) * 0.1).astype(dtype)
    conv = helper.make_node("Conv", ["x", "w", *(["b"] if bias else [])], ["y"], name="conv", group=group, **attrs)
    return _model([conv], ["batch", channels, "length"], inits, dtype=dtype)


def _whisper_stem(rng: np.random.Generator, mels: int = 80, width: int = 32, dtype: type = np.float32) -> onnx.ModelProto:
    """Whisper's encoder stem as torch exports it: Conv1d(k3, p1) -> erf GELU -> Conv1d(k3, p1, s2) -> erf GELU ->
    Transpose to [batch, frames, width]."""
    def gelu(x: str, y: str) -> list:
        return [helper.make_node("Div", [x, "sqrt2"], [f"{y}_d"]), helper.make_node("Erf", [f"{y}_d"], [f"{y}_e"]),
                helper.make_node("Add", [f"{y}_e", "one"], [f"{y}_a"]),
                helper.make_node("Mul", [x, f"{y}_a"], [f"{y}_m"]), helper.make_node("Mul", [f"{y}_m", "half"], [y])]

    attrs = dict(kernel_shape=[3], pads=[1, 1], dilations=[1], group=1)
    inits = {"w1": rng.standard_normal((width, mels, 3)) / np.sqrt(mels * 3), "b1": rng.standard_normal(width) * 0.1,
             "w2": rng.standard_normal((width, width, 3)) / np.sqrt(width * 3), "b2": rng.standard_normal(width) * 0.1,
             "sqrt2": np.array(np.sqrt(2.0)), "one": np.array(1.0), "half": np.array(0.5)}
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", strides=[1], **attrs), *gelu("c1", "g1"),
             helper.make_node("Conv", ["g1", "w2", "b2"], ["c2"], name="conv2", strides=[2], **attrs), *gelu("c2", "g2"),
             helper.make_node("Transpose", ["g2"], ["y"], name="transpose", perm=[0, 2, 1])]
    return _model(nodes, ["batch", mels, "frames"], {k: v.astype(dtype) for k, v in inits.items()}, dtype=dtype)


def _ops(graph: Graph) -> list[str]:
    return [n.op_type for n in graph.nodes]


_CASES = {
    "whisper_conv1": dict(kernel_shape=[3], pads=[1, 1], strides=[1], dilations=[1]),
    "whisper_conv2": dict(kernel_shape=[3], pads=[1, 1], strides=[2]),
    "dilated_grouped_asymmetric": dict(kernel=5, group=2, bias=False, pads=[3, 1], dilations=[2], strides=[3]),
    "depthwise": dict(channels=6, out=12, group=6, pads=[2, 2], kernel=5, kernel_shape=[5]),
    "same_upper_no_kernel_shape": dict(auto_pad="SAME_UPPER", strides=[2], kernel=4),
    "same_lower": dict(auto_pad="SAME_LOWER", kernel=4),
    "valid": dict(auto_pad="VALID", bias=False, dilations=[3]),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_conv1d_becomes_a_2d_conv_between_views_with_the_same_numbers(case, rng):
    attrs = _CASES[case]
    model = _conv1d(rng, **attrs)
    graph = parsed_graph(model)
    before = copy.deepcopy(graph)
    assert conv_1d_as_2d(graph) == 1
    assert _ops(graph) == ["Unsqueeze", "Conv", "Squeeze"]
    unsqueeze, conv, squeeze = graph.nodes
    assert graph.constants[unsqueeze.inputs[1]].tolist() == graph.constants[squeeze.inputs[1]].tolist() == [2]
    assert conv.inputs[0] == unsqueeze.outputs[0] and squeeze.inputs[0] == conv.outputs[0]
    assert squeeze.outputs == ["y"] and conv.name == "conv" and conv.origin == ["conv"]
    w = before.constants["w"]
    assert graph.constants[conv.inputs[1]].shape == (w.shape[0], w.shape[1], 1, w.shape[2])
    assert conv.inputs[2:] == before.nodes[0].inputs[2:]  # the bias, unchanged
    assert conv.attrs["kernel_shape"] == [1, w.shape[2]]
    assert conv.attrs["strides"] == [1, *attrs.get("strides", [1])]
    assert conv.attrs["dilations"] == [1, *attrs.get("dilations", [1])]
    assert conv.attrs.get("pads") == ([0, attrs["pads"][0], 0, attrs["pads"][1]] if "pads" in attrs else None)
    assert conv.attrs.get("auto_pad") == attrs.get("auto_pad") and conv.attrs["group"] == attrs.get("group", 1)
    x = {"x": rng.standard_normal((2, attrs.get("channels", 4), 17)).astype(np.float32)}
    want = GraphRunner(before).run(x)["y"]
    np.testing.assert_array_equal(GraphRunner(graph).run(x)["y"], want)  # the same im2col matmul, bit for bit
    np.testing.assert_allclose(want, ort_run(model, x)[0], rtol=1e-5, atol=1e-6)


def test_cpu_builds_match_onnxruntime_in_fp32_and_fp16(rng):
    """Whole CPU builds (every pass, the builder's order): fp32 and fp16, dynamic batch and length."""
    for dtype, tol in ((np.float32, 1e-5), (np.float16, 2e-3)):
        model = _whisper_stem(rng, dtype=dtype)
        x = rng.standard_normal((3, 80, 50)).astype(dtype)
        plan = build(model, {"x": ((1, 80, 8), (2, 80, 50), (4, 80, 64))})
        engine = kiln.Runtime().load(plan)
        got = engine.create_execution_context().infer({"x": x})["y"]
        assert [layer["name"] for layer in engine.plan.layers][:3] == ["conv1_unsqueeze", "conv1", "conv1_squeeze"]
        want = ort_run(model, {"x": x})[0]
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=tol, atol=tol)


def test_batchnorm_is_folded_into_the_1d_conv_first(rng):
    """fold_conv_batchnorm handles 1-D convs: in PRE_PASSES order the BN goes into the weights, then the rewrite."""
    assert PRE_PASSES.index(fold_conv_batchnorm) < PRE_PASSES.index(conv_1d_as_2d)
    model = _conv1d(rng, pads=[1, 1])
    c = 6
    bn = {"s": 1 + 0.1 * rng.standard_normal(c), "bb": 0.1 * rng.standard_normal(c), "m": 0.1 * rng.standard_normal(c),
          "v": 1 + np.abs(0.1 * rng.standard_normal(c))}
    model.graph.node[0].output[0] = "c"
    model.graph.node.append(helper.make_node("BatchNormalization", ["c", "s", "bb", "m", "v"], ["y"], name="bn"))
    model.graph.initializer.extend(numpy_helper.from_array(v.astype(np.float32), k) for k, v in bn.items())
    graph = parsed_graph(model)
    counts = [graph_pass(graph) for graph_pass in PRE_PASSES]
    assert counts[-2:] == [1, 1] and _ops(graph) == ["Unsqueeze", "Conv", "Squeeze"]
    x = {"x": rng.standard_normal((2, 4, 20)).astype(np.float32)}
    np.testing.assert_allclose(GraphRunner(graph).run(x)["y"], ort_run(model, x)[0], rtol=1e-5, atol=1e-5)


def test_computed_weights_and_2d_convs_are_left_alone_and_a_shared_weight_is_reshaped_once(rng):
    w = (rng.standard_normal((4, 4, 3)) * 0.3).astype(np.float32)
    nodes = [helper.make_node("Neg", ["w"], ["w_neg"], name="neg"),  # a weight computed in the graph (no folding yet)
             helper.make_node("Conv", ["x", "w_neg"], ["computed"], name="computed", pads=[1, 1]),
             helper.make_node("Conv", ["x", "w"], ["a"], name="a", pads=[1, 1]),
             helper.make_node("Conv", ["a", "w"], ["y"], name="b", pads=[1, 1])]
    graph = parsed_graph(_model(nodes, [1, 4, 9], {"w": w}, outputs=("y", "computed")))
    assert conv_1d_as_2d(graph) == 2
    assert _ops(graph) == ["Neg", "Conv", "Unsqueeze", "Conv", "Squeeze", "Unsqueeze", "Conv", "Squeeze"]
    convs = {n.name: n for n in graph.nodes if n.op_type == "Conv"}
    assert convs["computed"].inputs[1] == "w_neg" and "kernel_shape" not in convs["computed"].attrs
    assert convs["a"].inputs[1] == convs["b"].inputs[1] != "w"  # one 2-D copy of the shared weight
    square = parsed_graph(_model([helper.make_node("Conv", ["x", "w2"], ["y"], pads=[1, 1, 1, 1])], [1, 4, 9, 9],
                                 {"w2": np.ones((4, 4, 3, 3), np.float32)}))
    assert conv_1d_as_2d(square) == 0 and _ops(square) == ["Conv"]


# -- the CUDA lowering, without a GPU: tactics, and every launch emulated on the host ------------------------


def _lowered(model: onnx.ModelProto, feeds: dict[str, np.ndarray], options: dict, rewrite: bool = True):
    """(the pass pipeline's graph, its CUDA lowering at the feeds' shapes), with or without conv_1d_as_2d."""
    from engine_core.backends.cuda.lowering import LoweringOptions, lower_graph

    graph = parsed_graph(model)
    for graph_pass in PIPELINE:
        if rewrite or graph_pass is not conv_1d_as_2d:
            graph_pass(graph)
    infos = infer_shapes(graph, {v.name: TensorInfo(v.dtype, feeds[v.name].shape) for v in graph.inputs}, values=True)
    return graph, lower_graph(graph, infos, None, LoweringOptions(**options))


@pytest.mark.parametrize("options", [{"cudnn": True}, {"cudnn": True, "strict_fp32_nchw": True}],
                         ids=["channels_last", "nchw"])
@pytest.mark.parametrize("make, dtype, tol", [
    (lambda rng, dtype: _conv1d(rng, kernel=5, group=2, pads=[3, 1], dilations=[2], strides=[3], dtype=dtype),
     np.float32, 1e-5),
    (_whisper_stem, np.float32, 1e-5),
    (_whisper_stem, np.float16, 2e-2),
], ids=["conv1d", "whisper_stem", "whisper_stem_fp16"])
def test_cuda_lowers_1d_convs_to_cudnn_and_the_launches_compute_the_cpu_numbers(make, dtype, tol, options, rng):
    """Without the rewrite a Conv1d lowers to "host"; with it each is a cuDNN convolution that adds its own bias
    (an activation after the Squeeze, Whisper's GELU included, stays a kernel of its own), and the emulated launches
    (views, channels-last reformats, cuDNN's conv) compute what the CPU backend computes."""
    from tests.cuda.emulate import Emulator

    model = make(rng, dtype=dtype)
    feeds = {"x": rng.standard_normal((2, model.graph.input[0].type.tensor_type.shape.dim[1].dim_value, 40))
             .astype(dtype)}
    convs = [n.name for n in model.graph.node if n.op_type == "Conv"]
    _, unrewritten = _lowered(model, feeds, options, rewrite=False)
    assert [unrewritten.tactics()[c] for c in convs] == ["host"] * len(convs)
    graph, lowered = _lowered(model, feeds, options)
    tactics = lowered.tactics()
    assert "host" not in tactics.values(), tactics
    assert [tactics[c] for c in convs] == ["conv:cudnn"] * len(convs)
    for step in (s for s in lowered.steps if s.node.name in convs):
        assert step.node.op_type == "Conv" and len(step.ops[0].x_dims) == 4 and step.ops[0].x_dims[2] == 1
        assert (step.ops[0].b is not None) == (len(step.node.inputs) > 2)
    assert _ops(graph).count("Squeeze") == len(convs) and "FusedConv" not in _ops(graph)
    got = Emulator(graph, lowered, feeds).run()
    want = GraphRunner(graph).run(feeds)
    np.testing.assert_allclose(got["y"].astype(np.float32), want["y"].astype(np.float32), rtol=tol, atol=tol)


# -- on the GPU: the CUDA backend against the CPU backend ----------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, rtol, atol", [(np.float32, 1e-4, 1e-5), (np.float16, 2e-2, 2e-2)],
                         ids=["fp32", "fp16"])
def test_cuda_runs_conv1d_and_whisper_stem_on_cudnn_like_the_cpu_backend(dtype, rtol, atol, rng):
    """A strided, dilated, grouped Conv1d and Whisper-tiny's stem at its real size (80 mels -> 384, 3000 frames)
    build with no host layer and match the CPU backend (strict fp32: summation order only; fp16 as in
    test_backend_gpu's fp16 CNN)."""
    cases = [(_conv1d(rng, channels=8, out=16, kernel=5, group=2, pads=[3, 1], dilations=[2], strides=[3],
                      dtype=dtype), 8, 97),
             (_whisper_stem(rng, mels=80, width=384, dtype=dtype), 80, 3000)]
    for model, channels, length in cases:
        shapes = {"x": ((1, channels, length), (2, channels, length), (4, channels, length))}
        gpu = kiln.Runtime().load(build(model, shapes, backend="cuda"))
        cpu = kiln.Runtime().load(build(model, shapes, backend="cpu"))
        assert gpu.plan.build_info["cuda"]["host_layers"] == []
        tactics = {layer["name"]: layer["tactic"] for layer in gpu.plan.layers}
        assert all(tactics[n.name] == "conv:cudnn" for n in model.graph.node if n.op_type == "Conv"), tactics
        gctx, cctx = gpu.create_execution_context(), cpu.create_execution_context()
        for batch in (1, 4, 3):
            x = {"x": rng.standard_normal((batch, channels, length)).astype(dtype)}
            got, want = gctx.infer(x)["y"], cctx.infer(x)["y"]
            np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=rtol, atol=atol)
