"""Channels-last through DenseNet's concatenations: Concat of NHWC convolution outputs writes an NHWC result (each
input a strided copy into its channel slice) and the BatchNormalization -> ReLU after it (a Mul/Add/Relu
PointwiseChain once decompose_batchnorm ran) stays NHWC, so a block needs no layout reformats.

The CPU tests lower for CUDA (cuDNN on, no GPU) and run every launch in the numpy emulation; the GPU tests build the
same model for the device and compare with the CPU backend in fp16 and fp32."""

from __future__ import annotations

import copy
from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import engine_core as kiln
from engine_core.backends.cuda.lowering import Lowered, LoweringOptions, lower_graph
from engine_core.backends.cuda.pointwise import pointwise_source
from engine_core.cuda import compile_cubin
from engine_core.interpret import GraphRunner
from engine_core.ops import TensorInfo
from engine_core.passes import PIPELINE, infer_shapes
from tests.cuda.emulate import Emulator

_ONNX_TYPE = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16}


class _Net:
    """A model under construction: nodes and initializers of one float type."""

    def __init__(self, dtype: np.dtype, seed: int = 0) -> None:
        self.dtype, self.rng = np.dtype(dtype), np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def const(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(value).astype(self.dtype), name))
        return name

    def node(self, op: str, inputs: list[str], out: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out

    def conv(self, x: str, c_in: int, c_out: int, k: int, name: str) -> str:
        w = self.rng.standard_normal((c_out, c_in, k, k)) * np.sqrt(2.0 / (c_in * k * k))
        return self.node("Conv", [x, self.const(f"{name}_w", w)], name, pads=[k // 2] * 4)

    def bn(self, x: str, c: int, name: str) -> str:
        params = [1 + 0.2 * self.rng.standard_normal(c), 0.2 * self.rng.standard_normal(c),
                  0.2 * self.rng.standard_normal(c), 0.5 + self.rng.random(c)]
        names = [self.const(f"{name}_{p}", v) for p, v in zip(("scale", "bias", "mean", "var"), params)]
        return self.node("BatchNormalization", [x, *names], name)

    def bn_relu_conv(self, x: str, c_in: int, c_out: int, k: int, name: str) -> str:
        """DenseNet's pre-activation unit: the BN cannot fold into the conv (a ReLU sits between them)."""
        return self.conv(self.node("Relu", [self.bn(x, c_in, f"{name}_bn")], f"{name}_relu"), c_in, c_out, k,
                         f"{name}_conv")

    def model(self, inputs: dict[str, list], outputs: list[str]) -> onnx.ModelProto:
        t = _ONNX_TYPE[self.dtype]
        graph = helper.make_graph(self.nodes, "densenet_like",
                                  [helper.make_tensor_value_info(n, t, s) for n, s in inputs.items()],
                                  [helper.make_tensor_value_info(n, t, None) for n in outputs], self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 10
        return model


def _dense_block(net: _Net, x: str, channels: int, layers: int, growth: int, name: str) -> tuple[str, int]:
    """``layers`` dense layers (Concat of every earlier output -> BN -> ReLU -> Conv1x1 -> BN -> ReLU -> Conv3x3),
    then the block's Concat: torchvision's DenseNet as torch.onnx exports it (a one-input Concat first)."""
    features = [x]
    for i in range(layers):
        cat = net.node("Concat", list(features), f"{name}_l{i}_cat", axis=1)
        width = channels + i * growth
        bottleneck = net.bn_relu_conv(cat, width, 2 * growth, 1, f"{name}_l{i}_a")
        features.append(net.bn_relu_conv(bottleneck, 2 * growth, growth, 3, f"{name}_l{i}_b"))
    return net.node("Concat", features, f"{name}_cat", axis=1), channels + layers * growth


def densenet_like(dtype=np.float32, growth: int = 8) -> onnx.ModelProto:
    """x[N, 3, 16, 16] -> stem (Conv, BN, ReLU, MaxPool) -> dense block -> transition (BN, ReLU, Conv1x1,
    AveragePool) -> dense block -> BN -> ReLU -> GlobalAveragePool -> Flatten -> Gemm -> y[N, 10]. The stem has 12
    channels (24 fp16 bytes: the copies' strided path) and the growth rate 8 (the vector path)."""
    net = _Net(dtype)
    stem = net.node("Relu", [net.bn(net.conv("x", 3, 12, 3, "stem"), 12, "stem_bn")], "stem_relu")
    pooled = net.node("MaxPool", [stem], "stem_pool", kernel_shape=[2, 2], strides=[2, 2])
    block, width = _dense_block(net, pooled, 12, 3, growth, "block1")
    transition = net.bn_relu_conv(block, width, width // 2, 1, "trans")
    pooled = net.node("AveragePool", [transition], "trans_pool", kernel_shape=[2, 2], strides=[2, 2])
    block, width = _dense_block(net, pooled, width // 2, 2, growth, "block2")
    head = net.node("Relu", [net.bn(block, width, "final_bn")], "final_relu")
    flat = net.node("Flatten", [net.node("GlobalAveragePool", [head], "gap")], "flat")
    fc = net.const("fc_w", net.rng.standard_normal((width, 10)) / np.sqrt(width))
    net.node("Gemm", [flat, fc, net.const("fc_b", np.zeros(10))], "y")
    return net.model({"x": ["batch", 3, 16, 16]}, ["y"])


def concat_mixed(dtype=np.float32) -> onnx.ModelProto:
    """Concats the DenseNet path does not take: an NHWC conv output with a linear graph input along H (axis 2),
    read into an NHWC result without a reformat, and a channel Concat that is a graph output (linear)."""
    net = _Net(dtype, seed=1)
    a = net.conv("x", 4, 8, 3, "conv_a")
    tall = net.node("Concat", [a, "z"], "cat_h", axis=2)
    net.conv(net.node("Relu", [tall], "relu_h"), 8, 8, 1, "conv_h")
    net.node("Concat", [a, net.conv(a, 8, 8, 1, "conv_b")], "cat_out", axis=1)
    return net.model({"x": ["batch", 4, 8, 8], "z": ["batch", 8, 8, 8]}, ["conv_h", "cat_out"])


def _lowered(model: onnx.ModelProto, shapes: dict[str, tuple], options: LoweringOptions):
    network = kiln.Builder().create_network()
    assert kiln.OnnxParser(network).parse(model.SerializeToString())
    graph = copy.deepcopy(network.graph)
    for graph_pass in PIPELINE:
        graph_pass(graph)
    infos = infer_shapes(graph, {v.name: TensorInfo(v.dtype, shapes[v.name]) for v in graph.inputs})
    return graph, lower_graph(graph, infos, None, options)


def _reformats(lowered: Lowered) -> list[str]:
    return [step.node.name for step in lowered.steps if step.tactic.startswith("reformat:")]


def _emulated_matches_cpu(graph, lowered: Lowered, feeds: dict[str, np.ndarray], tol: float) -> None:
    got = Emulator(graph, lowered, feeds).run()
    for name, want in GraphRunner(graph).run(feeds).items():
        want = want.astype(np.float32)
        scale = float(np.abs(want).max())
        assert float(np.abs(got[name].astype(np.float32) - want).max()) <= tol * scale, name


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_a_densenet_block_runs_channels_last_without_reformats(dtype):
    """Only the image input is reformatted (to NHWC for the first conv): every Concat and BN -> ReLU chain keeps
    the convolutions' NHWC layout, where the linear-only Concat took two reformats per dense layer."""
    x = np.random.default_rng(0).standard_normal((2, 3, 16, 16)).astype(dtype)
    graph, lowered = _lowered(densenet_like(dtype), {"x": x.shape}, LoweringOptions(cudnn=True))
    assert _reformats(lowered) == ["reformat:x->nhwc"]
    kinds = Counter(step.node.op_type for step in lowered.steps)
    assert kinds["Concat"] == 7 and kinds["BatchNormalization"] == 0 and kinds["Relu"] == 0
    # each BN -> ReLU before a dense layer's or the transition's conv, and the final one: one Mul/Add/Relu kernel
    # (the BNs between a layer's two convs fold into the first)
    assert kinds["PointwiseChain"] == 5 + 1 + 1
    for step in lowered.steps:
        if step.node.op_type in ("Concat", "PointwiseChain"):
            assert lowered.layouts[step.node.outputs[0]] == "nhwc", step.node.name
    _emulated_matches_cpu(graph, lowered, {"x": x}, tol=2e-2 if dtype == np.float16 else 1e-5)


def test_concat_writes_each_input_as_a_channel_slice_of_the_nhwc_output():
    """Block 1's closing Concat of 12 + 3 x 8 channels: one concat.cu launch whose table writes each input at its
    channel offset with the output's NHWC strides (36 channels a pixel) and reads it through the input's own."""
    graph, lowered = _lowered(densenet_like(np.float16), {"x": (2, 3, 16, 16)}, LoweringOptions(cudnn=True))
    (step,) = [s for s in lowered.steps if s.node.name == "block1_cat"]
    (launch,) = step.ops
    rows = lowered.folded[launch.args[1][0].tensor].reshape(-1, 24)  # concat.cu's table: offsets and strides in units
    assert [int(r[3] * r[5]) for r in rows] == [0, 12 * 2, 20 * 2, 28 * 2]  # bytes: channel starts 0, 12, 20, 28
    assert [int(r[12 + 4] * r[5]) for r in rows] == [36 * 2] * 4  # bytes from one pixel to the next in the output
    assert [int(r[18 + 4] * r[5]) for r in rows] == [12 * 2, 8 * 2, 8 * 2, 8 * 2]  # and in each input
    assert [ref.tensor for ref, _ in launch.args[4:8]] == step.node.inputs


def test_the_channels_last_kernels_compile_for_sm90(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    _, lowered = _lowered(densenet_like(np.float16), {"x": (2, 3, 16, 16)}, LoweringOptions(cudnn=True))
    cubin = compile_cubin(pointwise_source(lowered.kernels), "pw.cu", "sm_90")
    assert all(kernel.name.encode() in cubin for kernel in lowered.kernels)


def test_concat_along_other_axes_and_into_graph_outputs_reads_any_layout():
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((2, 4, 8, 8)).astype(np.float32),
             "z": rng.standard_normal((2, 8, 8, 8)).astype(np.float32)}
    graph, lowered = _lowered(concat_mixed(), {k: v.shape for k, v in feeds.items()}, LoweringOptions(cudnn=True))
    assert lowered.layouts["cat_h"] == "nhwc" and lowered.layouts.get("cat_out", "linear") == "linear"
    assert _reformats(lowered) == ["reformat:x->nhwc"]  # neither z nor the conv outputs are reformatted
    _emulated_matches_cpu(graph, lowered, feeds, tol=1e-5)


def test_strict_fp32_convolutions_keep_the_linear_concat():
    """Strict fp32 runs NCHW convolutions: nothing is channels-last, so Concat stays linear too."""
    graph, lowered = _lowered(densenet_like(), {"x": (2, 3, 16, 16)},
                              LoweringOptions(cudnn=True, strict_fp32_nchw=True))
    assert _reformats(lowered) == [] and "nhwc" not in lowered.layouts.values()


# -- on the device: the CUDA backend against the CPU backend --------------------------------------------


def _engine(model: onnx.ModelProto, backend: str, flags=(), batch: int = 4):
    builder = kiln.Builder()
    network = builder.create_network()
    assert kiln.OnnxParser(network).parse(model.SerializeToString())
    config = builder.create_builder_config()
    config.backend = backend
    config.clear_flag(kiln.BuilderFlag.TF32)
    for flag in flags:
        config.set_flag(flag)
    profile = builder.create_optimization_profile()
    profile.set_shape("x", (1, 3, 16, 16), (batch, 3, 16, 16), (batch, 3, 16, 16))
    config.add_optimization_profile(profile)
    return kiln.Runtime().load(kiln.build_plan(network, config))


class _Layers(kiln.IProfiler):
    """The layer names of a profiled run (the device steps, reformats included)."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def report_layer_time(self, layer_name: str, ms: float) -> None:
        self.names.append(layer_name)


@pytest.mark.gpu
@pytest.mark.parametrize("flags, tol", [((kiln.BuilderFlag.FP16,), 2e-2), ((kiln.BuilderFlag.TF32,), 1e-2), ((), 1e-4)],
                         ids=["fp16", "tf32", "fp32"])
def test_densenet_like_on_the_gpu_matches_the_cpu_backend(flags, tol):
    """fp16 and TF32 run the NHWC path (one layout reformat: the image input's), strict fp32 the NCHW one (none).
    The fp16 build's I/O casts (reformat_in / reformat_out: fp32 I/O around fp16 layers) are not layout changes."""
    model = densenet_like()
    gpu, cpu = _engine(model, "cuda", flags), _engine(model, "cpu")
    tactics = {layer["name"]: layer["tactic"] for layer in gpu.plan.layers}
    assert "host" not in tactics.values(), tactics
    rng = np.random.default_rng(2)
    for batch in (1, 4):
        feeds = {"x": rng.standard_normal((batch, 3, 16, 16)).astype(np.float32)}
        context = gpu.create_execution_context()
        context.profiler = _Layers()
        got = context.infer(feeds)["y"]
        want = cpu.create_execution_context().infer(feeds)["y"]
        assert float(np.abs(got - want).max()) <= tol * float(np.abs(want).max()), batch
        reformats = [name for name in context.profiler.names if name.startswith("reformat:")]
        assert len(reformats) == (1 if flags else 0), reformats


def squeeze_excite_like(dtype=np.float32) -> onnx.ModelProto:
    """conv -> global pool -> 1x1 conv -> Sigmoid -> Mul(x, s) -> conv: EfficientNet's squeeze-and-excitation, whose
    [N, C, 1, 1] tensors move between the linear pointwise ops and the NHWC convs."""
    net = _Net(dtype, seed=3)
    x = net.conv("x", 3, 16, 3, "stem")
    pooled = net.node("GlobalAveragePool", [x], "pool")
    scale = net.node("Sigmoid", [net.conv(net.node("Relu", [net.conv(pooled, 16, 4, 1, "squeeze")], "sq_relu"),
                                          4, 16, 1, "excite")], "gate")
    net.conv(net.node("Mul", [x, scale], "scaled"), 16, 8, 1, "project")
    return net.model({"x": ["batch", 3, 8, 8]}, ["project"])


def test_layout_changes_of_one_position_tensors_are_aliases_not_copies():
    """A [N, C, 1, 1] tensor has the same bytes in NCHW and NHWC: its reformats become views of it
    (same_bytes_in_both_layouts), and the run still computes what the CPU backend does."""
    x = np.random.default_rng(1).standard_normal((2, 3, 8, 8)).astype(np.float32)
    graph, lowered = _lowered(squeeze_excite_like(), {"x": x.shape}, LoweringOptions(cudnn=True))
    aliases = [s.node.name for s in lowered.steps if s.tactic == "view" and s.node.name.startswith("reformat:")]
    assert _reformats(lowered) == ["reformat:x->nhwc"] and aliases, [s.node.name for s in lowered.steps]
    _emulated_matches_cpu(graph, lowered, {"x": x}, tol=1e-5)
