"""Depthwise convolutions (group == C_in == C_out) on Kiln's direct kernel (cuda_kernels/depthwise_conv.cu): which
convolutions lower to it and with which arguments (no GPU: the emulator's numpy model of the kernel runs the exact
launches, against the CPU backend), and on the device its numbers against the CPU backend."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import engine_core as kiln
from engine_core.backends.cuda.lower_rules import conv as conv_rule
from engine_core.backends.cuda.lowering import Launch, LoweringOptions, lower_graph, transform_weight
from engine_core.interpret import GraphRunner
from tests.cuda.emulate import Emulator
from tests.cuda.models import lowered_at, mobilenet_small, optimized_graph
from tests.cuda.test_backend_cpu import _graph_and_infos

#: image sides: odd, unequal, and a width whose last W tile is partial for every tiled kernel
H, W = 15, 17
#: ONNX element type -> numpy dtype of the models below
NUMPY = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}


def depthwise_model(channels: int, kernel: int = 3, stride: int = 1, pad: int = 1, dilation: int = 1,
                    activation: str = "", bias: bool = True, dtype: int = TensorProto.FLOAT16,
                    seed: int = 0) -> onnx.ModelProto:
    """x -> dw1 (the case: bias, then Relu / Clip(0, 6) / nothing) -> a1 -> dw2 (3x3/1, pad 1) + a1 -> Relu -> y.
    dw1 writes an arena tensor channels-last; dw2 becomes a FusedConv with a channels-last residual and a ReLU and
    writes the graph output (through a step buffer and a reformat)."""
    rng = np.random.default_rng(seed)
    np_type = NUMPY[dtype]
    inits = [numpy_helper.from_array((rng.standard_normal((channels, 1, kernel, kernel)) * 0.3).astype(np_type), "w1"),
             numpy_helper.from_array((rng.standard_normal((channels, 1, 3, 3)) * 0.3).astype(np_type), "w2")]
    conv1 = ["x", "w1"]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(channels).astype(np_type), "b1"))
        conv1.append("b1")
    nodes = [helper.make_node("Conv", conv1, ["c1" if activation else "a1"], name="dw1", group=channels,
                              kernel_shape=[kernel, kernel], strides=[stride, stride], pads=[pad] * 4,
                              dilations=[dilation, dilation])]
    if activation == "Relu":
        nodes.append(helper.make_node("Relu", ["c1"], ["a1"], name="act1"))
    elif activation == "Clip":
        inits += [numpy_helper.from_array(np.array(0, np_type), "lo"), numpy_helper.from_array(np.array(6, np_type), "hi")]
        nodes.append(helper.make_node("Clip", ["c1", "lo", "hi"], ["a1"], name="act1"))
    nodes += [helper.make_node("Conv", ["a1", "w2"], ["c2"], name="dw2", group=channels, kernel_shape=[3, 3],
                               pads=[1, 1, 1, 1]),
              helper.make_node("Add", ["c2", "a1"], ["s2"], name="residual"),
              helper.make_node("Relu", ["s2"], ["y"], name="relu2")]
    graph = helper.make_graph(nodes, "depthwise", [helper.make_tensor_value_info("x", dtype, ["batch", channels, H, W])],
                              [helper.make_tensor_value_info("y", dtype, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def input_residual_model(channels: int, dtype: int = TensorProto.FLOAT16) -> onnx.ModelProto:
    """y = Clip(dw(x) + r, 0, 6) + x: the residual r is a graph input (linear, not channels-last), which the kernel
    does not read, so the add and the Clip follow as a generated epilogue kernel; the last Add reads x, which dw
    read channels-last."""
    rng = np.random.default_rng(1)
    np_type = NUMPY[dtype]
    inits = [numpy_helper.from_array((rng.standard_normal((channels, 1, 3, 3)) * 0.3).astype(np_type), "w"),
             numpy_helper.from_array(np.array(0, np_type), "lo"), numpy_helper.from_array(np.array(6, np_type), "hi")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="dw", group=channels, kernel_shape=[3, 3],
                              pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c", "r"], ["s"], name="residual"),
             helper.make_node("Clip", ["s", "lo", "hi"], ["a"], name="clip"),
             helper.make_node("Add", ["a", "x"], ["y"], name="skip")]
    shape = ["batch", channels, H, W]
    graph = helper.make_graph(nodes, "depthwise_input_residual",
                              [helper.make_tensor_value_info(n, dtype, shape) for n in ("x", "r")],
                              [helper.make_tensor_value_info("y", dtype, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def grouped_model(channels: int = 32, group: int = 2) -> onnx.ModelProto:
    """A depthwise conv, then a grouped (not depthwise) conv: only the first is the kernel's."""
    rng = np.random.default_rng(2)
    h = lambda *s: (rng.standard_normal(s) * 0.3).astype(np.float16)  # noqa: E731
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], name="dw", group=channels, pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["c1", "w2"], ["y"], name="grouped", group=group, pads=[1, 1, 1, 1])]
    graph = helper.make_graph(nodes, "grouped",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["batch", channels, H, W])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)],
                              [numpy_helper.from_array(h(channels, 1, 3, 3), "w1"),
                               numpy_helper.from_array(h(channels, channels // group, 3, 3), "w2")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


#: (id, depthwise_model arguments, the kernel dw1 takes in fp16)
CASES = [
    ("3x3s1_c32_relu", dict(channels=32, activation="Relu"), "depthwise_conv_k3s1"),
    ("3x3s2_c144_clip", dict(channels=144, stride=2, activation="Clip"), "depthwise_conv_k3s2"),
    ("5x5s2_c144", dict(channels=144, kernel=5, stride=2, pad=2), "depthwise_conv_k5s2"),
    ("5x5s1_c32_clip_nobias", dict(channels=32, kernel=5, pad=2, activation="Clip", bias=False), "depthwise_conv_k5s1"),
    ("7x7s2_c32_relu", dict(channels=32, kernel=7, stride=2, pad=3, activation="Relu"), "depthwise_conv_k7s2"),
    ("3x3_dilation2_c32_clip", dict(channels=32, pad=2, dilation=2, activation="Clip"), "depthwise_conv"),
    ("3x3s1_c20_relu", dict(channels=20, activation="Relu"), "depthwise_conv_scalar"),
    ("5x5s2_c20_clip", dict(channels=20, kernel=5, stride=2, pad=2, activation="Clip"), "depthwise_conv_scalar"),
]


# -- no GPU: the lowering, checked by a numpy model of the kernel -------------------------------------------------


def _feeds(model: onnx.ModelProto, batch: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Seeded N(0, 1) values of the model's inputs (all [batch, C, H, W] of one type) at ``batch``."""
    feeds = {}
    for value in model.graph.input:
        shape = (batch, *[d.dim_value for d in value.type.tensor_type.shape.dim[1:]])
        feeds[value.name] = rng.standard_normal(shape).astype(NUMPY[value.type.tensor_type.elem_type])
    return feeds


def _lowered(model: onnx.ModelProto, batch: int = 2, **options):
    feeds = _feeds(model, batch, np.random.default_rng(batch))
    graph, infos = _graph_and_infos(model, {name: value.shape for name, value in feeds.items()})
    return graph, lower_graph(graph, infos, None, LoweringOptions(**{"cudnn": True, **options})), feeds


def _emulate(model: onnx.ModelProto, batch: int = 2, tol: float = 1e-2, **options):
    """The lowering emulated launch by launch against the CPU backend's outputs; returns the lowering."""
    graph, lowered, feeds = _lowered(model, batch, **options)
    got = Emulator(graph, lowered, feeds).run()
    want = GraphRunner(graph).run(feeds)
    for name, value in want.items():
        np.testing.assert_allclose(got[name].astype(np.float32), value.astype(np.float32), rtol=tol, atol=tol,
                                   err_msg=name)
    return lowered


def _launches(lowered, layer: str) -> list[Launch]:
    step = next(s for s in lowered.steps if s.node.name == layer)
    return [op for op in step.ops if isinstance(op, Launch)]


@pytest.mark.parametrize("case, kwargs, function", CASES, ids=[c[0] for c in CASES])
def test_depthwise_convolutions_lower_to_the_kernel_and_match_the_cpu_backend(case, kwargs, function):
    lowered = _emulate(depthwise_model(**kwargs))
    tactics = lowered.tactics()
    assert tactics["dw1"] == ("kernel:FusedConv" if kwargs.get("activation") else "kernel:Conv")
    assert tactics["dw2"] == "kernel:FusedConv"
    first = _launches(lowered, "dw1")
    assert [op.function for op in first] == [f"{function}_f16"]  # bias and activation in the kernel
    x, w, bias, z, y, geom = (value for value, _ in first[0].args)
    assert w.tensor == "w1#rskc" and lowered.weight_transforms["w1#rskc"] == ("w1", "rskc")
    assert (bias != 0) == kwargs.get("bias", True) and z == 0
    assert geom.activation == conv_rule.DEPTHWISE_ACTIVATIONS[kwargs.get("activation", "")]
    assert lowered.layouts[y.tensor] == "nhwc" and lowered.layouts[x.tensor] == "nhwc"
    # dw2: its residual a1 (channels-last) and ReLU fused; the graph output through a step buffer and a reformat
    second = _launches(lowered, "dw2")
    assert [op.module for op in second] == ["depthwise_conv", "pointwise"]
    _, _, bias, z, y, geom = (value for value, _ in second[0].args)
    assert bias == 0 and z.tensor == first[0].args[4][0].tensor and geom.activation == 1
    assert y.tensor == "dw2#conv" and second[1].args[0][0].tensor == "y"


@pytest.mark.parametrize("batch", [1, 4])
def test_fp32_depthwise_convolutions_run_the_kernel_channels_last(batch):
    """fp32 convolutions that run channels-last (TF32 allowed) take the kernel in exact fp32 (FMA sums); strict fp32
    builds run convolutions NCHW (cuDNN's FFMA engines), where the depthwise ones stay on cuDNN."""
    model = depthwise_model(144, stride=2, activation="Clip", dtype=TensorProto.FLOAT)
    lowered = _emulate(model, batch, tol=1e-5, tf32=True)
    assert [op.function for op in _launches(lowered, "dw1")] == ["depthwise_conv_k3s2_f32"]
    _, strict, _ = _lowered(model, batch, strict_fp32_nchw=True)
    assert strict.tactics()["dw1"] == "conv:cudnn" and not strict.weight_transforms


def test_a_linear_residual_and_the_activation_after_it_follow_as_one_epilogue_kernel():
    lowered = _emulate(input_residual_model(32))
    kernel, rest = _launches(lowered, "dw")
    assert kernel.function == "depthwise_conv_k3s1_f16" and kernel.args[0][0].tensor == "x#nhwc"
    assert kernel.args[3][0] == 0 and kernel.args[5][0].activation == 0  # no residual, no activation in the kernel
    assert [pw.op for pw in rest.program.nodes] == ["Add", "Clip"] and rest.args[2][0].tensor == "r"


def test_a_grouped_convolution_stays_on_cudnn_and_the_switch_sends_depthwise_ones_there(monkeypatch):
    lowered = _emulate(grouped_model())
    assert lowered.tactics()["dw"] == "kernel:Conv" and lowered.tactics()["grouped"] == "conv:cudnn"
    assert [op.function for op in _launches(lowered, "dw")] == ["depthwise_conv_k3s1_f16"]
    monkeypatch.setattr(conv_rule, "DEPTHWISE_KERNEL", False)
    _, lowered, _ = _lowered(grouped_model())
    assert lowered.tactics()["dw"] == lowered.tactics()["grouped"] == "conv:cudnn"
    assert set(lowered.weight_transforms) == {"w1#krsc", "w2#krsc"}


def test_depthwise_convolutions_need_no_cudnn():
    """The kernel is Kiln's own: without the cuDNN frontend a depthwise conv still runs on the device, the grouped
    one on the host."""
    _, lowered, _ = _lowered(grouped_model(), cudnn=False)
    assert lowered.tactics()["dw"] == "kernel:Conv" and lowered.tactics()["grouped"] == "host"


def test_the_rskc_transform_puts_each_filter_tap_s_channels_together():
    w = np.arange(3 * 1 * 2 * 2, dtype=np.float32).reshape(3, 1, 2, 2)  # [C, 1, kh, kw]
    taps = transform_weight(w, "rskc")
    assert taps.shape == (2, 2, 3, 1) and taps.flags.c_contiguous
    assert taps[1, 0, :, 0].tolist() == w[:, 0, 1, 0].tolist()


def test_mobilenet_runs_its_depthwise_convolutions_on_the_kernel_in_fp16():
    """The small MobileNetV2 of tools/make_models.py in fp16 (the builder's precision pass): every depthwise layer
    (a FusedConv with Clip, ReLU6) lowers to the kernel with the Clip fused; the emulation matches the CPU backend."""
    x = np.random.default_rng(3).standard_normal((2, 3, 64, 64)).astype(np.float32)
    graph = optimized_graph(mobilenet_small(), {"input": x}, kiln.BuilderFlag.FP16)
    lowered = lowered_at(graph, {"input": x}, LoweringOptions(cudnn=True))
    depthwise = [n for n in graph.nodes if n.op_type == "FusedConv" and n.attr("group", 1) > 1]
    assert depthwise and all(n.attr("activation") == "Clip" for n in depthwise)
    for node in depthwise:
        (launch,) = _launches(lowered, node.name)
        assert launch.module == "depthwise_conv" and launch.args[5][0].activation == 2
    got = Emulator(graph, lowered, {"input": x}).run()
    want = GraphRunner(graph).run({"input": x})
    for name, value in want.items():
        scale = float(np.abs(value.astype(np.float32)).max())
        assert float(np.abs(got[name].astype(np.float32) - value.astype(np.float32)).max()) <= 2e-2 * scale, name


# -- on the device ------------------------------------------------------------------------------------------------


def _device_vs_cpu(model: onnx.ModelProto, flags=(), batches=(1, 4)) -> tuple[kiln.CudaEngine, list]:
    from tests.cuda.test_backend_gpu import _build

    profiles = {}
    for value in model.graph.input:
        shape = [d.dim_value for d in value.type.tensor_type.shape.dim[1:]]
        profiles[value.name] = tuple((b, *shape) for b in (1, 2, 4))
    gpu, cpu = _build(model, "cuda", profiles, flags=flags), _build(model, "cpu", profiles)
    gctx, cctx = gpu.create_execution_context(), cpu.create_execution_context()
    rng = np.random.default_rng(4)
    results = []
    for batch in batches:  # a new binding per batch; a second run on the same binding replays its CUDA graph
        for _ in range(2):
            feeds = _feeds(model, batch, rng)
            results.append((gctx.infer(feeds), cctx.infer(feeds)))
    return gpu, results


def _tactics(engine: kiln.CudaEngine) -> dict[str, str]:
    return {layer["name"]: layer["tactic"] for layer in engine.plan.layers}


@pytest.mark.gpu
@pytest.mark.parametrize("case, kwargs, function", CASES, ids=[c[0] for c in CASES])
def test_fp16_depthwise_kernel_matches_the_cpu_backend(case, kwargs, function):
    engine, results = _device_vs_cpu(depthwise_model(**kwargs))
    for got, want in results:
        np.testing.assert_allclose(got["y"].astype(np.float32), want["y"].astype(np.float32), rtol=1e-2, atol=1e-2)
    tactics = _tactics(engine)
    assert tactics["dw1"] == ("kernel:FusedConv" if kwargs.get("activation") else "kernel:Conv")
    assert tactics["dw2"] == "kernel:FusedConv" and "depthwise_conv" in engine.plan.kernels


@pytest.mark.gpu
@pytest.mark.parametrize("case, kwargs, function", CASES, ids=[c[0] for c in CASES])
def test_fp32_depthwise_kernel_matches_the_cpu_backend(case, kwargs, function):
    """Channels-last fp32 (the TF32 flag; nothing in these models uses tensor cores): exact fp32 FMA sums, so
    only summation order differs from the CPU backend."""
    model = depthwise_model(**kwargs, dtype=TensorProto.FLOAT)
    engine, results = _device_vs_cpu(model, flags=[kiln.BuilderFlag.TF32])
    for got, want in results:
        np.testing.assert_allclose(got["y"], want["y"], rtol=1e-5, atol=1e-5)
    assert _tactics(engine)["dw1"] == ("kernel:FusedConv" if kwargs.get("activation") else "kernel:Conv")


@pytest.mark.gpu
def test_a_linear_residual_on_the_device():
    engine, results = _device_vs_cpu(input_residual_model(20))
    for got, want in results:
        np.testing.assert_allclose(got["y"].astype(np.float32), want["y"].astype(np.float32), rtol=1e-2, atol=1e-2)
    assert _tactics(engine)["dw"] == "kernel:FusedConv"


@pytest.mark.gpu
def test_grouped_convolution_beside_the_kernel_on_the_device():
    engine, results = _device_vs_cpu(grouped_model())
    for got, want in results:
        np.testing.assert_allclose(got["y"].astype(np.float32), want["y"].astype(np.float32), rtol=2e-2, atol=2e-2)
    tactics = _tactics(engine)
    assert tactics["dw"] == "kernel:Conv" and tactics["grouped"] == "conv:cudnn"
