"""Explicitly quantized (Q/DQ) ONNX graphs on the CPU backend vs onnxruntime: per-tensor, per-channel,
blocked, FP8 E4M3, and tools/make_models.py's resnet50_qdq."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import engine_core as kiln
from engine_core.calibration import quantization_report
from tests.engine.util import build
from tools.make_models import MODELS


def _model(nodes, inits, inputs, outputs, opset: int) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "qdq", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model)
    return model


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray], name: str = "x") -> dict[str, np.ndarray]:
    shape = feeds[name].shape
    plan = build(model, {name: (shape, shape, shape)})
    return kiln.Runtime().load(plan).create_execution_context().infer(feeds)


def ort_run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """onnxruntime, op by op: its Q/DQ -> QLinearConv/MatMul fusions use u8s8 kernels that can saturate
    int16 intermediates on CPUs without VNNI, which is ORT's numerics, not the ONNX semantics."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _f(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


@pytest.mark.parametrize("zero_type", [np.int8, np.uint8])
def test_per_tensor_qdq_conv(rng, zero_type):
    """Q/DQ on activation and weight of a Conv (QAT export form: float weight -> Q -> DQ)."""
    zp = np.array(0 if zero_type == np.int8 else 128, zero_type)
    inits = [numpy_helper.from_array(rng.standard_normal((6, 3, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(np.array(0.02, np.float32), "s_x"),
             numpy_helper.from_array(np.array(0.01, np.float32), "s_w"),
             numpy_helper.from_array(zp, "zp"),
             numpy_helper.from_array(rng.standard_normal(6).astype(np.float32), "b")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s_x", "zp"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "s_x", "zp"], ["xd"]),
             helper.make_node("QuantizeLinear", ["w", "s_w", "zp"], ["wq"]),
             helper.make_node("DequantizeLinear", ["wq", "s_w", "zp"], ["wd"]),
             helper.make_node("Conv", ["xd", "wd", "b"], ["y"], pads=[1, 1, 1, 1])]
    model = _model(nodes, inits, [_f("x", [2, 3, 8, 8])], [_f("y", [2, 6, 8, 8])], 13)
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(_run(model, {"x": x})["y"], ort_run(model, {"x": x})[0], rtol=1e-4, atol=1e-4)


def test_per_channel_int8_weights_conv_and_gemm(rng):
    """Pre-quantized int8 weights read through per-channel DequantizeLinear (axis 0 Conv, axis 0 Gemm transB)."""
    wq = rng.integers(-127, 128, (4, 3, 3, 3)).astype(np.int8)
    gq = rng.integers(-127, 128, (5, 64)).astype(np.int8)
    inits = [numpy_helper.from_array(wq, "wq"), numpy_helper.from_array(np.linspace(.001, .01, 4, dtype=np.float32), "s_w"),
             numpy_helper.from_array(np.zeros(4, np.int8), "z_w"),
             numpy_helper.from_array(gq, "gq"), numpy_helper.from_array(np.linspace(.002, .02, 5, dtype=np.float32), "s_g"),
             numpy_helper.from_array(np.zeros(5, np.int8), "z_g"),
             numpy_helper.from_array(np.array(0.03, np.float32), "s_a"), numpy_helper.from_array(np.array(0, np.int8), "z_a")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s_a", "z_a"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "s_a", "z_a"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "s_w", "z_w"], ["wd"], axis=0),
             helper.make_node("Conv", ["xd", "wd"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Flatten", ["r"], ["f"]),
             helper.make_node("QuantizeLinear", ["f", "s_a", "z_a"], ["fq"]),
             helper.make_node("DequantizeLinear", ["fq", "s_a", "z_a"], ["fd"]),
             helper.make_node("DequantizeLinear", ["gq", "s_g", "z_g"], ["gd"], axis=0),
             helper.make_node("Gemm", ["fd", "gd"], ["y"], transB=1)]
    model = _model(nodes, inits, [_f("x", [3, 3, 8, 8])], [_f("y", [3, 5])], 13)
    x = rng.standard_normal((3, 3, 8, 8)).astype(np.float32)
    diff = np.abs(_run(model, {"x": x})["y"] - ort_run(model, {"x": x})[0])
    assert diff.max() < 0.1 and diff.mean() < 0.01  # at most a few int8 codes one step apart (float rounding)
    rows = quantization_report(_network(model).graph, {"x": x})  # explicit: vs the model without activation Q/DQ
    assert [r.op_type for r in rows] == ["Conv", "Gemm"]
    assert 0 < rows[0].relative_error < 0.05  # rounding of x to 0.03 steps
    assert rows[1].relative_error > rows[0].relative_error  # the Gemm input also clips at 127 * 0.03


def _network(model: onnx.ModelProto) -> kiln.NetworkDefinition:
    network = kiln.Builder().create_network()
    assert kiln.OnnxParser(network).parse(model.SerializeToString())
    return network


def test_blocked_int8_weights_matmul(rng):
    """Opset-21 blocked DequantizeLinear (block_size along K, as int4/int8 weight-only LLM exports use)."""
    k, n, block = 64, 8, 16
    wq = rng.integers(-127, 128, (k, n)).astype(np.int8)
    scale = (rng.random((k // block, n)) * 0.01 + 0.001).astype(np.float32)
    inits = [numpy_helper.from_array(wq, "wq"), numpy_helper.from_array(scale, "s"),
             numpy_helper.from_array(np.zeros((k // block, n), np.int8), "z")]
    nodes = [helper.make_node("DequantizeLinear", ["wq", "s", "z"], ["wd"], axis=0, block_size=block),
             helper.make_node("MatMul", ["x", "wd"], ["y"])]
    model = _model(nodes, inits, [_f("x", [4, k])], [_f("y", [4, n])], 21)
    x = rng.standard_normal((4, k)).astype(np.float32)
    expected = x @ (wq.astype(np.float32) * np.repeat(scale, block, axis=0))
    got = _run(model, {"x": x})["y"]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got, ort_run(model, {"x": x})[0], rtol=1e-4, atol=1e-5)
    bad = _model([helper.make_node("DequantizeLinear", ["wq", "s", "z"], ["wd"], axis=0, block_size=block * 2),
                  helper.make_node("MatMul", ["x", "wd"], ["y"])], inits, [_f("x", [4, k])], [_f("y", [4, n])], 21)
    with pytest.raises(kiln.KilnError, match="blocked scale"):
        _run(bad, {"x": x})


@pytest.mark.parametrize("saturate", [1, 0])
def test_fp8_e4m3_qdq(rng, saturate):
    """QuantizeLinear/DequantizeLinear to float8e4m3fn (opset 19): ml_dtypes rounding, saturation at 448."""
    scale = np.array(0.05, np.float32)
    inits = [numpy_helper.from_array(scale, "s"),
             helper.make_tensor("z", TensorProto.FLOAT8E4M3FN, [], [0])]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], saturate=saturate),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])]
    model = _model(nodes, inits, [_f("x", [2, 64])], [_f("y", [2, 64])], 19)
    x = (rng.standard_normal((2, 64)) * 4).astype(np.float32)
    x[0, :3] = [30.0, -100.0, 0.0]  # 30/0.05 = 600 > 448: saturates (or NaN without saturate)
    got = _run(model, {"x": x})["y"]
    fp8 = (x / scale).astype(ml_dtypes.float8_e4m3fn)
    if saturate:
        fp8 = np.clip(x / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(got, fp8.astype(np.float32) * scale)
    if saturate:
        assert got[0, 0] == pytest.approx(448 * 0.05) and got[0, 1] == pytest.approx(-448 * 0.05)
    else:
        assert np.isnan(got[0, 0]) and np.isnan(got[0, 1])
    np.testing.assert_array_equal(got, ort_run(model, {"x": x})[0])


@pytest.fixture(scope="module")
def resnet50_qdq() -> onnx.ModelProto:
    return MODELS["resnet50_qdq"][1]()


def test_qdq_network_with_int8_flag_is_explicit(resnet50_qdq):
    """BuilderFlag.INT8 on a Q/DQ model: explicit mode, no calibration; the calibrator is ignored with a warning."""
    from engine_core.calibration import make_calibrator
    from engine_core.passes.quantize_implicit import int8_policy

    network = _network(resnet50_qdq)
    config = kiln.Builder().create_builder_config()
    config.set_flag(kiln.BuilderFlag.INT8)
    assert int8_policy(config, network).mode == "explicit"
    config.int8_calibrator = make_calibrator([])
    assert "ignored" in int8_policy(config, network).warnings[0]


def test_resnet50_qdq_matches_onnxruntime_and_keeps_top1(rng, resnet50_qdq):
    """The small explicitly quantized ResNet-50: per-channel int8 weights, per-tensor activations."""
    model = resnet50_qdq
    ops = [n.op_type for n in model.graph.node]
    assert "BatchNormalization" not in ops and ops.count("Conv") == 53
    weights = {t.name: t for t in model.graph.initializer}
    per_channel = [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in weights
                   and weights[n.input[0]].data_type == TensorProto.INT8]
    assert len(per_channel) == 54 and all(helper.get_attribute_value(n.attribute[0]) == 0 for n in per_channel)
    x = rng.standard_normal((16, 3, 64, 64)).astype(np.float32)
    plan = build(model, {"input": ((1, 3, 64, 64), (16, 3, 64, 64), (16, 3, 64, 64))})
    got = kiln.Runtime().load(plan).create_execution_context().infer({"input": x})["logits"]
    expected = ort_run(model, {"input": x})[0]
    # int8 tolerance: a float rounding difference flips an int8 code (one step) now and then, and a
    # random-weight ResNet carries the flip through; the result stays within a few % and keeps top-1
    assert np.linalg.norm(got - expected) / np.linalg.norm(expected) < 0.1
    assert np.mean(got.argmax(1) == expected.argmax(1)) >= 0.9
    fp32 = ort_run(MODELS["resnet50"][1](), {"input": x})[0]
    assert np.mean(got.argmax(1) == fp32.argmax(1)) >= 0.9  # top-1 agreement of the int8 model vs fp32
