"""Reduced precision (FP16/BF16), precision constraints and I/O types on the CPU backend.

Each build is checked twice: the plan's graph (layer types, reformat layers, tensor dtypes) and the
numbers against the float32 build of the same model. Tolerances are absolute, on outputs of order
one, and about 4x the errors measured for these models and seeds.
"""

from __future__ import annotations

from collections.abc import Callable

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import engine_core as kiln
from engine_core.errors import BuildError
from engine_core.logger import Severity
from engine_core.network import NetworkDefinition
from engine_core.ops import TensorInfo
from engine_core.passes import infer_shapes
from engine_core.passes.reduce_precision import precision_policy, reduce_precision
from engine_core.plan import Plan, deserialize_plan
from engine_core.types import TensorFormat
from tests.engine import models
from tools.make_models import MODELS

F = kiln.BuilderFlag
DT = kiln.DataType
BF16 = np.dtype(ml_dtypes.bfloat16)
FP16 = np.dtype(np.float16)
Setup = Callable[[NetworkDefinition], None]


# -- helpers -------------------------------------------------------------------------------------


class _Warnings(kiln.Logger):
    """Collects the build's warnings (the pass reports ignored/unhonoured constraints there)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def log(self, severity: Severity, msg: str) -> None:
        if severity <= Severity.WARNING:
            self.messages.append(msg)


def build(model: onnx.ModelProto, shapes: dict[str, tuple], flags: tuple = (), setup: Setup | None = None,
          network_flags: int = 0, backend: str = "cpu") -> tuple[bytes, list[str]]:
    """Parse and build ``model`` on the CPU backend with exactly ``flags`` (TF32, a new config's default, only when
    asked for; ``setup`` edits the network first); returns the plan bytes and the warnings logged during the build."""
    b = kiln.Builder()
    network = b.create_network(network_flags)
    parser = kiln.OnnxParser(network)
    assert parser.parse(model.SerializeToString()), [str(e) for e in parser.errors]
    config = b.create_builder_config()
    config.backend = backend
    config.builder_optimization_level = 0  # no fusions: these tests inspect each ONNX layer's type
    config.clear_flag(F.TF32)
    for flag in flags:
        config.set_flag(flag)
    profile = b.create_optimization_profile()
    for name, triple in shapes.items():
        profile.set_shape(name, *triple)
    config.add_optimization_profile(profile)
    if setup is not None:
        setup(network)
    logger = _Warnings()
    return kiln.build_plan(network, config, logger), logger.messages


def run(data: bytes, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    engine = kiln.Runtime().deserialize_cuda_engine(data)
    return engine.create_execution_context().infer(feeds)


def tensor_dtypes(plan: Plan, feeds: dict[str, np.ndarray]) -> dict[str, np.dtype]:
    """dtype of every tensor of the plan's graph for ``feeds``."""
    infos = infer_shapes(plan.graph, {k: TensorInfo(v.dtype, v.shape) for k, v in feeds.items()})
    return {k: v.dtype for k, v in infos.items()}


def precisions(plan: Plan, feeds: dict[str, np.ndarray]) -> dict[str, str]:
    """Layer name -> the type it computes in: its first float input's (else its first output's)."""
    dtypes = tensor_dtypes(plan, feeds)
    result = {}
    for node in plan.graph.nodes:
        floats = [dtypes[i] for i in node.inputs if i and (dtypes[i].kind == "f" or dtypes[i] == BF16)]
        result[node.name] = (floats[0] if floats else dtypes[node.outputs[0]]).name
    return result


def layer_types(plan: Plan) -> dict[str, str]:
    return {n.name: n.op_type for n in plan.graph.nodes}


def max_err(out: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> float:
    return max(float(np.max(np.abs(out[k].astype(np.float32) - ref[k]))) for k in ref)


RNG = np.random.default_rng(0)
MLP = (models.mlp(), {"x": ((1, 16), (4, 16), (8, 16))}, {"x": RNG.standard_normal((4, 16)).astype(np.float32)})
CNN = (models.small_cnn(), {"x": ((1, 3, 16, 16), (2, 3, 16, 16), (4, 3, 16, 16))},
       {"x": RNG.standard_normal((2, 3, 16, 16)).astype(np.float32)})
_SEQ = ((1, 8), (2, 16), (4, 32))
BERT = (MODELS["bert_base"][1](), {n: _SEQ for n in ("input_ids", "attention_mask", "token_type_ids")},
        {"input_ids": RNG.integers(0, 1000, (2, 16)), "attention_mask": np.array([[1] * 16, [1] * 12 + [0] * 4]),
         "token_type_ids": np.zeros((2, 16), np.int64)})
GPT2 = (MODELS["gpt2"][1](), {"input_ids": ((1, 4), (2, 16), (2, 32))}, {"input_ids": RNG.integers(0, 1000, (2, 16))})
CASES = {"mlp": MLP, "cnn": CNN, "bert": BERT, "gpt2": GPT2}
#: (model, flag) -> max abs error vs the float32 build (measured: mlp 3e-4/2.5e-3, cnn 1.1e-3/2.1e-3,
#: bert 6.6e-3/3.7e-2, gpt2 8.3e-4/6.6e-3)
TOLERANCE = {("gpt2", F.FP16): 4e-3, ("gpt2", F.BF16): 3e-2, ("mlp", F.FP16): 2e-3, ("mlp", F.BF16): 1e-2, ("cnn", F.FP16): 5e-3, ("cnn", F.BF16): 1e-2,
             ("bert", F.FP16): 3e-2, ("bert", F.BF16): 1.5e-1}


@pytest.fixture(scope="module")
def fp32_outputs() -> dict[str, dict[str, np.ndarray]]:
    return {name: run(build(m, shapes)[0], feeds) for name, (m, shapes, feeds) in CASES.items()}


# -- whole models ----------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", [F.FP16, F.BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_reduced_precision_model(name: str, flag: F, fp32_outputs) -> None:
    model, shapes, feeds = CASES[name]
    target = FP16 if flag == F.FP16 else BF16
    data, _ = build(model, shapes, (flag,))
    plan = deserialize_plan(data)
    layers = layer_types(plan)
    float_inputs = [v.name for v in plan.graph.inputs if v.dtype == np.float32]
    assert [f"reformat_in:{n}" for n in float_inputs] == [n for n in layers if n.startswith("reformat_in:")]
    assert {f"reformat_out:{v.name}" for v in plan.graph.outputs} == {n for n in layers if n.startswith("reformat_out:")}
    assert all(io.dtype == np.float32 for io in plan.io if io.name in float_inputs or io.mode == kiln.TensorIOMode.OUTPUT)
    # every float weight that a layer reads as data is stored in the target type (Pow's exponent is
    # not data: its schema type variable differs from the base's)
    float_weights = {k: v.dtype for k, v in plan.graph.constants.items() if v.dtype.kind == "f" or v.dtype == BF16}
    read = {i for n in plan.graph.nodes for i in (n.inputs[:1] if n.op_type == "Pow" else n.inputs)}
    assert {k: d for k, d in float_weights.items() if k in read and d == np.float32} == {}
    # every float tensor between the reformat layers is in the target type
    dtypes = tensor_dtypes(plan, feeds)
    boundary = set(float_inputs) | set(plan.graph.output_names)
    inner = {t for n in plan.graph.nodes for t in n.outputs if t not in boundary}
    assert {t: dtypes[t] for t in inner if dtypes[t] == np.float32} == {}
    assert {dtypes[t] for t in inner if dtypes[t].kind == "f" or dtypes[t] == BF16} == {target}
    # the numbers
    out = run(data, feeds)
    assert all(v.dtype == np.float32 for v in out.values())
    assert max_err(out, fp32_outputs[name]) < TOLERANCE[(name, flag)]


@pytest.mark.gpu
@pytest.mark.parametrize("flag", [F.FP16, F.BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_reduced_precision_model_cuda(name: str, flag: F, fp32_outputs) -> None:
    """The same reduced-precision graphs on the CUDA backend, against the CPU float32 build."""
    model, shapes, feeds = CASES[name]
    data, _ = build(model, shapes, (flag,), backend="cuda")
    out = run(data, feeds)
    assert all(v.dtype == np.float32 for v in out.values())
    assert max_err(out, fp32_outputs[name]) < TOLERANCE[(name, flag)]


def test_transformer_keeps_shape_computations_and_softmax_io(fp32_outputs) -> None:
    """BERT in fp16: position/shape arithmetic stays integer, Softmax/LayerNorm get fp16 I/O, and the
    attention mask's Cast(to=FLOAT) casts to fp16 directly (no extra reformat)."""
    model, shapes, feeds = BERT
    data, _ = build(model, shapes, (F.FP16,))
    plan = deserialize_plan(data)
    dtypes = tensor_dtypes(plan, feeds)
    for node in plan.graph.nodes:
        if node.op_type in ("Softmax", "LayerNormalization", "MatMul"):
            assert dtypes[node.inputs[0]] == FP16 and dtypes[node.outputs[0]] == FP16, node
        if node.op_type in ("Shape", "Range", "Squeeze"):
            assert dtypes[node.outputs[0]] == np.int64, node
    casts = [n for n in plan.graph.nodes if n.op_type == "Cast" and not n.name.startswith("reformat")]
    assert casts and all(n.attrs["to"] == TensorProto.FLOAT16 for n in casts)
    assert not [n for n in plan.graph.nodes if n.name.startswith("reformat_in:")]  # int64 inputs only


def test_conv_weights_keep_their_names_for_refit() -> None:
    """Converted weights keep their names (refit and the inspector find them by name)."""
    data, _ = build(*MLP[:2], (F.FP16,))
    constants = deserialize_plan(data).graph.constants
    assert {k: v.dtype for k, v in constants.items()} == {"W1": FP16, "b1": FP16, "W2": FP16, "b2": FP16}


def _rotary_model() -> onnx.ModelProto:
    """y = x * cos(a) + x * sin(a), a = positions x inv_freq computed in the graph, as Llama exports do it."""
    inv_freq = (1.0 / 10000 ** (np.arange(0, 8, 2) / 8)).astype(np.float32).reshape(1, 4, 1)
    nodes = [helper.make_node("Unsqueeze", ["position_ids", "axis1"], ["p3"]),
             helper.make_node("Cast", ["p3"], ["pf"], to=TensorProto.FLOAT),
             helper.make_node("MatMul", ["inv_freq", "pf"], ["freqs"]),
             helper.make_node("Transpose", ["freqs"], ["ft"], perm=[0, 2, 1]),
             helper.make_node("Concat", ["ft", "ft"], ["angles"], axis=-1),
             helper.make_node("Cos", ["angles"], ["cos"]), helper.make_node("Sin", ["angles"], ["sin"]),
             helper.make_node("Mul", ["x", "cos"], ["xc"]), helper.make_node("Mul", ["x", "sin"], ["xs"]),
             helper.make_node("Add", ["xc", "xs"], ["y"])]
    inits = [numpy_helper.from_array(inv_freq, "inv_freq"), numpy_helper.from_array(np.array([1], np.int64), "axis1")]
    graph = helper.make_graph(nodes, "rotary", [helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1, "s"]),
                                                helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "s", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "s", 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("flag", [F.FP16, F.BF16], ids=["fp16", "bf16"])
def test_rotary_angles_stay_float32(flag: F) -> None:
    """Positions x frequencies and their Sin/Cos stay float32 (in fp16 the angle at position 2000 is off by up to
    1 rad); the rotation itself runs in the reduced type."""
    feeds = {"position_ids": np.arange(1990, 2006, dtype=np.int64)[None],
             "x": RNG.standard_normal((1, 16, 8)).astype(np.float32)}
    shapes = {"position_ids": ((1, 1), (1, 16), (1, 64)), "x": ((1, 1, 8), (1, 16, 8), (1, 64, 8))}
    data, _ = build(_rotary_model(), shapes, (flag,))
    plan = deserialize_plan(data)
    layers = {n.name or n.outputs[0]: n for n in plan.graph.nodes}
    kept = {name: p for name, p in precisions(plan, feeds).items() if layers[name].op_type in ("MatMul", "Cos", "Sin")}
    assert set(kept.values()) == {"float32"} and len(kept) == 3, kept
    assert {p for name, p in precisions(plan, feeds).items() if layers[name].op_type in ("Mul", "Add")} == \
        {np.dtype(FP16 if flag == F.FP16 else BF16).name}
    reference = run(build(_rotary_model(), shapes)[0], feeds)
    assert max_err(run(data, feeds), reference) < (1e-2 if flag == F.FP16 else 8e-2)


def test_weights_beyond_fp16_range_saturate_with_a_warning() -> None:
    """transformers' additive mask ``(1 - mask) * finfo(float32).min``: the constant becomes fp16's lowest finite
    value, not -inf, so kept positions add 0 (not 0 * -inf = NaN) and masked ones a huge negative number."""
    lowest = np.finfo(np.float32).min
    nodes = [helper.make_node("Sub", ["one", "m"], ["keep"]), helper.make_node("Mul", ["keep", "lowest"], ["bias"]),
             helper.make_node("Add", ["x", "bias"], ["y"])]
    inits = [numpy_helper.from_array(np.array(1.0, np.float32), "one"),
             numpy_helper.from_array(np.array(lowest, np.float32), "lowest")]
    info = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 4]) for n in ("x", "m", "y")]
    model = helper.make_model(helper.make_graph(nodes, "mask", info[:2], info[2:], inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    data, warnings = build(model, {}, (F.FP16,))
    assert any("'lowest': 1 value(s) outside the float16 range clamped" in w for w in warnings), warnings
    mask = np.array([[1, 1, 0, 0], [1, 0, 1, 0]], np.float32)
    y = run(data, {"x": np.ones((2, 4), np.float32), "m": mask})["y"].astype(np.float32)
    np.testing.assert_array_equal(y[mask == 1], 1.0)
    assert np.all(np.isfinite(y)) and np.all(y[mask == 0] <= -65000)


# -- schema type constraints -----------------------------------------------------------------------


def _resize_pow_model() -> onnx.ModelProto:
    """x -> Resize(scales) -> Pow(exponent) -> y: the non-data float inputs must stay float32."""
    nodes = [helper.make_node("Resize", ["x", "", "scales"], ["r"], mode="nearest"),
             helper.make_node("Pow", ["r", "e"], ["y"])]
    inits = [numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"),
             numpy_helper.from_array(np.array(2.0, np.float32), "e")]
    graph = helper.make_graph(nodes, "resize_pow", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 3, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 6, 6])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])


def test_non_data_float_inputs_stay_float32() -> None:
    x = RNG.standard_normal((1, 2, 3, 3)).astype(np.float32)
    data, _ = build(_resize_pow_model(), {}, (F.FP16,))
    plan = deserialize_plan(data)
    assert plan.graph.constants["scales"].dtype == np.float32
    assert plan.graph.constants["e"].dtype == np.float32
    dtypes = tensor_dtypes(plan, {"x": x})
    assert dtypes["r"] == FP16
    out = run(data, {"x": x})["y"]
    np.testing.assert_allclose(out, np.repeat(np.repeat(x, 2, 2), 2, 3) ** 2, rtol=2e-3, atol=1e-3)


# -- precision constraints ---------------------------------------------------------------------------


def _softmax_fp32(network: NetworkDefinition) -> None:
    next(n for n in network if n.op_type == "Softmax").precision = DT.FLOAT


@pytest.mark.parametrize("mode", [F.OBEY_PRECISION_CONSTRAINTS, F.PREFER_PRECISION_CONSTRAINTS])
def test_constrained_layer_stays_fp32(mode: F) -> None:
    model, shapes, feeds = MLP
    data, _ = build(model, shapes, (F.FP16, mode), _softmax_fp32)
    plan = deserialize_plan(data)
    softmax = next(n for n in plan.graph.nodes if n.op_type == "Softmax")
    dtypes = tensor_dtypes(plan, feeds)
    assert dtypes[softmax.inputs[0]] == np.float32 and dtypes[softmax.outputs[0]] == np.float32
    assert "reformat:h4:float32" in layer_types(plan)  # the fp16 -> fp32 boundary before it
    assert not any(n.startswith("reformat_out:") for n in layer_types(plan))  # already float32
    assert precisions(plan, feeds)["Gemm_0"] == "float16"
    ref = run(build(model, shapes)[0], feeds)
    assert max_err(run(data, feeds), ref) < 2e-3


def test_constraints_without_flag_are_ignored_with_warning() -> None:
    model, shapes, feeds = MLP
    data, warnings = build(model, shapes, (F.FP16,), _softmax_fp32)
    assert any("neither OBEY_PRECISION_CONSTRAINTS" in w for w in warnings)
    plan = deserialize_plan(data)
    softmax = next(n for n in plan.graph.nodes if n.op_type == "Softmax")
    assert precisions(plan, feeds)[softmax.name] == "float16"


def test_fp16_constraint_without_fp16_flag() -> None:
    """A HALF constraint needs the FP16 flag: OBEY refuses, PREFER warns and keeps the default (bf16)."""
    model, shapes, feeds = MLP

    def relu_half(network: NetworkDefinition) -> None:
        next(n for n in network if n.op_type == "Relu").precision = DT.HALF

    with pytest.raises(BuildError, match=r"Relu.*float16 is not enabled"):
        build(model, shapes, (F.BF16, F.OBEY_PRECISION_CONSTRAINTS), relu_half)
    data, warnings = build(model, shapes, (F.BF16, F.PREFER_PRECISION_CONSTRAINTS), relu_half)
    assert any("Relu" in w and "PREFER" in w for w in warnings)
    assert precisions(deserialize_plan(data), feeds)["Relu_1"] == "bfloat16"
    run(data, feeds)


def test_bf16_layer_in_fp16_network() -> None:
    """With FP16 and BF16 enabled, one layer constrained to BF16 runs in bf16 between fp16 layers."""
    model, shapes, feeds = MLP

    def matmul_bf16(network: NetworkDefinition) -> None:
        next(n for n in network if n.op_type == "MatMul").precision = DT.BF16

    data, _ = build(model, shapes, (F.FP16, F.BF16, F.OBEY_PRECISION_CONSTRAINTS), matmul_bf16)
    plan = deserialize_plan(data)
    dtypes = tensor_dtypes(plan, feeds)
    matmul = next(n for n in plan.graph.nodes if n.op_type == "MatMul")
    assert [dtypes[i] for i in matmul.inputs] == [BF16, BF16] and dtypes[matmul.outputs[0]] == BF16
    assert dtypes[next(n for n in plan.graph.nodes if n.op_type == "Gemm").outputs[0]] == FP16
    assert max_err(run(data, feeds), run(build(model, shapes)[0], feeds)) < 1e-2


def _nms_model() -> onnx.ModelProto:
    """boxes/scores -> NonMaxSuppression (float32-only schema), plus a Relu of the scores."""
    nodes = [helper.make_node("NonMaxSuppression", ["boxes", "scores", "k", "iou"], ["sel"]),
             helper.make_node("Relu", ["scores"], ["act"])]
    inits = [numpy_helper.from_array(np.array([3], np.int64), "k"), numpy_helper.from_array(np.array([0.5], np.float32), "iou")]
    graph = helper.make_graph(nodes, "nms", [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, [1, 4, 4]),
                                             helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, 1, 4])],
                              [helper.make_tensor_value_info("sel", TensorProto.INT64, [None, 3]),
                               helper.make_tensor_value_info("act", TensorProto.FLOAT, [1, 1, 4])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_unsupported_constraint_obey_fails_prefer_warns() -> None:
    def nms_half(network: NetworkDefinition) -> None:
        next(n for n in network if n.op_type == "NonMaxSuppression").precision = DT.HALF

    with pytest.raises(BuildError, match="NonMaxSuppression.*cannot be honoured"):
        build(_nms_model(), {}, (F.FP16, F.OBEY_PRECISION_CONSTRAINTS), nms_half)
    data, warnings = build(_nms_model(), {}, (F.FP16, F.PREFER_PRECISION_CONSTRAINTS), nms_half)
    plan = deserialize_plan(data)
    assert any("NonMaxSuppression" in w and "PREFER" in w for w in warnings)
    feeds = {"boxes": np.zeros((1, 4, 4), np.float32), "scores": np.zeros((1, 1, 4), np.float32)}
    assert precisions(plan, feeds)["Relu_1"] == "float16"
    nms = next(n for n in plan.graph.nodes if n.op_type == "NonMaxSuppression")
    assert nms.inputs[:2] == ["boxes", "scores"]  # fed the float32 inputs directly
    boxes = np.array([[[0, 0, 1, 1], [0, 0, 1, 1.05], [2, 2, 3, 3], [5, 5, 6, 6]]], np.float32)
    out = run(data, {"boxes": boxes, "scores": np.array([[[0.9, 0.8, 0.7, -0.2]]], np.float32)})
    assert out["sel"].tolist() == [[0, 0, 0], [0, 0, 2], [0, 0, 3]]
    assert out["act"].dtype == np.float32


def test_output_type_constraint_inserts_cast() -> None:
    model, shapes, feeds = MLP

    def relu_out_fp32(network: NetworkDefinition) -> None:
        next(n for n in network if n.op_type == "Relu").set_output_type(0, DT.FLOAT)

    data, _ = build(model, shapes, (F.FP16, F.OBEY_PRECISION_CONSTRAINTS), relu_out_fp32)
    plan = deserialize_plan(data)
    dtypes = tensor_dtypes(plan, feeds)
    assert dtypes["h2"] == np.float32 and "Relu_1:output_type:0" in layer_types(plan)
    matmul = next(n for n in plan.graph.nodes if n.op_type == "MatMul")
    assert dtypes[matmul.inputs[0]] == FP16  # cast back for the fp16 MatMul
    run(data, feeds)


def test_layer_constraint_api() -> None:
    network = kiln.Builder().create_network()
    kiln.OnnxParser(network).parse(models.mlp().SerializeToString())
    layer = network.get_layer(0)
    assert not layer.precision_is_set and layer.precision == DT.FLOAT
    layer.precision = DT.HALF
    assert layer.precision_is_set and layer.precision == DT.HALF
    layer.reset_precision()
    assert not layer.precision_is_set
    assert not layer.output_type_is_set(0) and layer.get_output_type(0) == DT.FLOAT
    layer.set_output_type(0, DT.BF16)
    assert layer.output_type_is_set(0) and layer.get_output_type(0) == DT.BF16
    layer.reset_output_type(0)
    assert not layer.output_type_is_set(0)
    with pytest.raises(ValueError, match="int8 is not supported"):
        layer.precision = DT.INT8
    with pytest.raises(IndexError, match="no output 3"):
        layer.set_output_type(3, DT.HALF)


# -- I/O types and formats -------------------------------------------------------------------------


def _half_io(network: NetworkDefinition) -> None:
    network.get_input(0).dtype = DT.HALF
    network.get_output(0).dtype = DT.HALF


def test_fp16_io_has_no_reformat_layers() -> None:
    model, shapes, feeds = MLP
    data, _ = build(model, shapes, (F.FP16,), _half_io)
    plan = deserialize_plan(data)
    assert not [n for n in layer_types(plan) if n.startswith("reformat")]
    assert {io.name: io.dtype for io in plan.io} == {"x": FP16, "y": FP16}
    engine = kiln.Runtime().deserialize_cuda_engine(data)
    assert engine.get_tensor_dtype("x") == DT.HALF and engine.get_tensor_dtype("y") == DT.HALF
    out = run(data, {"x": feeds["x"].astype(np.float16)})["y"]
    assert out.dtype == np.float16
    ref = run(build(model, shapes)[0], feeds)["y"]
    np.testing.assert_allclose(out.astype(np.float32), ref, atol=2e-3)


def test_fp16_io_on_fp32_network_reformats() -> None:
    """Without the FP16 flag the network computes in float32 and reformats the fp16 bindings."""
    model, shapes, feeds = MLP
    data, _ = build(model, shapes, (), _half_io)
    plan = deserialize_plan(data)
    assert {"reformat_in:x", "reformat_out:y"} <= set(layer_types(plan))
    assert precisions(plan, {"x": feeds["x"].astype(np.float16)})["Gemm_0"] == "float32"
    out = run(data, {"x": feeds["x"].astype(np.float16)})["y"]
    assert out.dtype == np.float16


def test_direct_io_refuses_reformat() -> None:
    with pytest.raises(BuildError, match="DIRECT_IO.*input 'x'"):
        build(*MLP[:2], (F.FP16, F.DIRECT_IO))
    data, _ = build(*MLP[:2], (F.FP16, F.DIRECT_IO), _half_io)
    assert not [n for n in layer_types(deserialize_plan(data)) if n.startswith("reformat")]


def test_io_dtype_and_format_validation() -> None:
    network = kiln.Builder().create_network()
    kiln.OnnxParser(network).parse(models.mlp().SerializeToString())
    x = network.get_input(0)
    with pytest.raises(ValueError, match="only be switched among FLOAT, HALF and BF16"):
        x.dtype = DT.INT32
    x.dtype = DT.BF16
    assert network.get_input(0).dtype == DT.BF16
    x.dtype = DT.FLOAT
    assert network.io_dtypes == {}
    with pytest.raises(ValueError, match="not a non-empty mask"):
        x.allowed_formats = 0

    def hwc_only(network: NetworkDefinition) -> None:
        network.get_input(0).allowed_formats = 1 << int(TensorFormat.HWC)

    with pytest.raises(BuildError, match="do not include LINEAR"):
        build(*MLP[:2], (F.FP16,), hwc_only)

    def linear_or_hwc(network: NetworkDefinition) -> None:
        network.get_input(0).allowed_formats = (1 << int(TensorFormat.LINEAR)) | (1 << int(TensorFormat.HWC))

    data, _ = build(*MLP[:2], (F.FP16,), linear_or_hwc)
    assert deserialize_plan(data).io[0].format == "LINEAR"


# -- strongly typed and untouched builds -------------------------------------------------------------


def _fp16_mlp() -> onnx.ModelProto:
    """The MLP with float16 weights and I/O (what a strongly typed fp16 export looks like)."""
    model = models.mlp()
    for init in model.graph.initializer:
        init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float16), init.name))
    for v in (*model.graph.input, *model.graph.output):
        v.type.tensor_type.elem_type = TensorProto.FLOAT16
    return model


def test_strongly_typed_fp16_model_runs_in_fp16() -> None:
    strongly = 1 << int(kiln.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    model, shapes, feeds = MLP
    data, warnings = build(_fp16_mlp(), shapes, (F.FP16,), network_flags=strongly)
    assert any("strongly typed network: FP16 ignored" in w for w in warnings)
    plan = deserialize_plan(data)
    assert not [n for n in plan.graph.nodes if n.op_type == "Cast"]
    dtypes = tensor_dtypes(plan, {"x": feeds["x"].astype(np.float16)})
    assert {dtypes[t] for n in plan.graph.nodes for t in n.outputs} == {FP16}
    out = run(data, {"x": feeds["x"].astype(np.float16)})["y"]
    assert out.dtype == np.float16
    np.testing.assert_allclose(out.astype(np.float32), run(build(model, shapes)[0], feeds)["y"], atol=2e-3)
    # a float32 model stays float32 under STRONGLY_TYPED, flags or not
    data, _ = build(model, shapes, (F.FP16,), network_flags=strongly)
    assert run(data, feeds)["y"].dtype == np.float32
    with pytest.raises(BuildError, match="strongly typed network: I/O types"):
        build(model, shapes, (), _half_io, network_flags=strongly)


def test_no_flags_no_pass() -> None:
    """Without FP16/BF16, constraints or I/O types the pass is not run (ONNX conformance is unchanged)."""
    b = kiln.Builder()
    network = b.create_network()
    kiln.OnnxParser(network).parse(models.mlp().SerializeToString())
    config = b.create_builder_config()
    assert precision_policy(config, network) is None
    config.set_flag(F.TF32)
    assert precision_policy(config, network) is None
    assert reduce_precision(network.graph, None) == 0


def _if_model() -> onnx.ModelProto:
    """x -> Relu -> h; If(c) then h + 1 else h * 2 (the branches read h from the enclosing graph)."""
    one = numpy_helper.from_array(np.array(1.0, np.float32), "one")
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    out = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 4])  # noqa: E731
    then = helper.make_graph([helper.make_node("Add", ["h", "one"], ["t"])], "then", [], [out("t")], [one])
    other = helper.make_graph([helper.make_node("Mul", ["h", "two"], ["e"])], "else", [], [out("e")], [two])
    nodes = [helper.make_node("Relu", ["x"], ["h"]),
             helper.make_node("If", ["c"], ["z"], then_branch=then, else_branch=other),
             helper.make_node("Neg", ["z"], ["y"])]
    graph = helper.make_graph(nodes, "if", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]),
                                            helper.make_tensor_value_info("c", TensorProto.BOOL, [])], [out("y")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("cond", [True, False])
def test_bodies_read_enclosing_tensors_in_model_types(cond: bool) -> None:
    x = RNG.standard_normal((2, 4)).astype(np.float32)
    data, _ = build(_if_model(), {}, (F.FP16,))
    plan = deserialize_plan(data)
    layers = precisions(plan, {"x": x, "c": np.array(cond)})
    assert (layers["Relu_0"], layers["If_1"], layers["Neg_2"]) == ("float16", "float32", "float16")
    assert "reformat:h:float32" in layer_types(plan)
    out = run(data, {"x": x, "c": np.array(cond)})["y"]
    expected = -(np.maximum(x, 0) + 1) if cond else -(np.maximum(x, 0) * 2)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, expected, rtol=2e-3, atol=1e-3)
