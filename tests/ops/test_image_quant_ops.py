"""Image/detection, quantization, cast and signal ops (engine_core/ops/{image,quantization,cast,signal}.py).

Each case is a one-node ONNX model built with onnx.helper, run through the public Kiln API and through
onnxruntime (or onnx's ReferenceEvaluator where onnxruntime lacks the op, opset or type). Integer,
quantized and gather-only results must match exactly; float interpolation results within ``rtol``
(onnxruntime accumulates in float32, Kiln in float64). Cases focus on what onnx's own node tests
(the conformance run) leave out: older opsets, per-axis/blocked quantization, other dtypes, flags.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto

from engine_core.errors import KilnError
from engine_core.ops import TensorInfo
from engine_core.passes import infer_shapes
from tests.ops.harness import Arrays, Case, build, i64, run_case, run_kiln

RNG = np.random.default_rng(7)
f32, u8 = Arrays(RNG).f32, Arrays(RNG).u8


def i8(*shape: int) -> np.ndarray:
    return RNG.integers(-128, 128, shape).astype(np.int8)


def scalar(value: float | int, dtype: Any) -> np.ndarray:
    return np.array(value, dtype=dtype)


def check(case: Case) -> None:
    """Exact (bit-exact for raw types), or within ``rtol`` where a case sets one; strings by value."""
    expected, actual, infos = run_case(case)
    for index, (exp, act, info) in enumerate(zip(expected, actual, infos)):
        exp = np.asarray(exp)
        if exp.dtype.kind == "U":  # the reference's strings; Kiln keeps them in object arrays
            assert act.tolist() == exp.tolist()
            continue
        assert act.dtype == exp.dtype, f"output {index}: dtype {act.dtype} != {exp.dtype}"
        assert act.shape == exp.shape, f"output {index}: shape {act.shape} != {exp.shape}"
        if case.rtol:
            np.testing.assert_allclose(act.astype(np.float64), exp.astype(np.float64), rtol=case.rtol, atol=case.rtol)
        else:
            np.testing.assert_array_equal(act.view(np.uint8) if act.dtype.kind == "V" else act,
                                          exp.view(np.uint8) if exp.dtype.kind == "V" else exp, f"output {index}")
        assert info.dtype == exp.dtype, f"output {index}: inferred dtype {info.dtype} != {exp.dtype}"
        if info.shape is not None:
            assert info.shape == exp.shape, f"output {index}: inferred shape {info.shape} != {exp.shape}"


IMAGE = f32(1, 2, 5, 7)
BOXES = np.array([[[0, 0, 1, 1], [0, 0.1, 1, 1.1], [0, -0.1, 1, 0.9], [0, 10, 1, 11], [1, 1, 0, 0.2],
                   [0, 100, 1, 101]]], np.float32)
CENTER_BOXES = np.array([[[0.5, 0.5, 1, 1], [0.5, 0.6, 1, 1], [0.5, 0.4, 1, 1], [0.5, 10.5, 1, 1],
                          [0.5, 10.6, 1, 1], [0.5, 100.5, 1, 1]]], np.float32)
NMS_SCORES = np.array([[[0.9, 0.75, 0.6, 0.95, 0.5, 0.3], [0.1, 0.9, 0.9, 0.2, 0.3, 0.4]]], np.float32)

CASES: dict[str, Case] = {
    # -- Cast / CastLike / BitCast --
    "cast_bfloat16_to_int32": Case("Cast", [np.array([1.5, -2.75, 300.0], ml_dtypes.bfloat16)],
                                   {"to": TensorProto.INT32}, reference="onnx"),
    "cast_float_to_bool": Case("Cast", [np.array([0.0, -0.0, 0.5, np.nan], np.float32)], {"to": TensorProto.BOOL}),
    "cast_double_to_uint8_wraps_like_ort": Case("Cast", [np.array([1.0, 255.0, 7.9], np.float64)],
                                                {"to": TensorProto.UINT8}),
    "cast_string_to_float": Case("Cast", [np.array(["1.5", "-inf", "1e-3", "NaN", "+7"], dtype=object)],
                                 {"to": TensorProto.FLOAT}, reference="onnx"),
    "cast_string_to_int64": Case("Cast", [np.array(["12345678901234567", "-3"], dtype=object)],
                                 {"to": TensorProto.INT64}),
    "cast_int_to_string": Case("Cast", [np.array([[1, -20], [300, 0]], np.int32)], {"to": TensorProto.STRING}),
    "cast_float_to_e4m3fnuz_saturates": Case("Cast", [np.array([1000.0, -1000.0, 0.3, np.inf], np.float32)],
                                             {"to": TensorProto.FLOAT8E4M3FNUZ}, reference="onnx"),
    "cast_float_to_e8m0_nearest": Case("Cast", [np.array([1.0, 1.4, 1.6, 3.0, 1e-30, 2.0**127 * 1.9], np.float32)],
                                       {"to": TensorProto.FLOAT8E8M0, "round_mode": "nearest"}, opset=25,
                                       reference="onnx"),
    "cast_float_to_e8m0_down": Case("Cast", [np.array([1.0, 1.4, 1.99, 0.75, np.nan], np.float32)],
                                    {"to": TensorProto.FLOAT8E8M0, "round_mode": "down"}, opset=25,
                                    reference="onnx"),
    "castlike_int4_to_float16": Case("CastLike", [np.array([-8, 7, 3], ml_dtypes.int4),
                                                  np.zeros(1, np.float16)], reference="onnx"),
    "bitcast_float16_to_uint16": Case("BitCast", [np.array([[1.0, -2.0], [np.inf, 0.5]], np.float16)],
                                      {"to": TensorProto.UINT16}, opset=26, reference="onnx"),
    # -- quantization --
    "quantize_per_axis_int8": Case("QuantizeLinear", [f32(2, 3, 4, scale=50), np.array([0.5, 1.0, 2.0], np.float32),
                                                      np.array([-3, 0, 5], np.int8)], opset=13, consts=(1, 2)),
    "quantize_opset10_uint8_default": Case("QuantizeLinear", [f32(3, 4, scale=100), scalar(0.7, np.float32)],
                                           opset=10),
    "quantize_blocked_int4": Case("QuantizeLinear", [f32(2, 6, scale=8), f32(2, 3, scale=1) ** 2 + 0.5,
                                                     np.array([[1, -2, 0], [3, 0, -1]], ml_dtypes.int4)],
                                  {"axis": 1, "block_size": 2}, consts=(1, 2), reference="onnx"),
    "quantize_output_dtype_uint16": Case("QuantizeLinear", [f32(4, 5, scale=3000), scalar(0.25, np.float32)],
                                         {"output_dtype": TensorProto.UINT16}),
    "quantize_e5m2_no_saturate": Case("QuantizeLinear", [np.array([1e5, -1e6, 3.0], np.float32),
                                                         scalar(1.0, np.float32),
                                                         np.zeros((), ml_dtypes.float8_e5m2)], {"saturate": 0},
                                      reference="onnx"),
    "dequantize_per_axis_int32": Case("DequantizeLinear", [np.array([[5, -7], [1000, 3]], np.int32),
                                                           np.array([0.5, 0.25], np.float32)], {"axis": 0},
                                      opset=13),
    "dequantize_blocked_uint4": Case("DequantizeLinear", [np.arange(24).reshape(4, 6).astype(ml_dtypes.uint4),
                                                          f32(2, 6) ** 2, np.ones((2, 6), ml_dtypes.uint4)],
                                     {"axis": 0, "block_size": 2}, reference="onnx"),
    "dequantize_uint8_to_float16": Case("DequantizeLinear", [u8(3, 4), scalar(0.125, np.float16),
                                                             scalar(128, np.uint8)]),
    "dynamic_quantize_all_positive": Case("DynamicQuantizeLinear", [np.abs(f32(3, 5)) + 1], opset=11, outputs=3),
    "matmul_integer_per_column_b": Case("MatMulInteger", [u8(2, 3, 4), u8(4, 5), scalar(12, np.uint8),
                                                          u8(5)], opset=10),
    "matmul_integer_int8": Case("MatMulInteger", [i8(3, 4), i8(4, 2)], opset=10),
    "qlinear_matmul_per_column": Case("QLinearMatMul", [u8(3, 4), scalar(0.02, np.float32), scalar(120, np.uint8),
                                                        u8(4, 3), np.array([0.01, 0.03, 0.02], np.float32),
                                                        np.array([128, 100, 130], np.uint8), scalar(0.2, np.float32),
                                                        scalar(5, np.uint8)], opset=21),
    "qlinear_conv_groups_strides": Case(
        "QLinearConv", [i8(1, 4, 7, 6), scalar(0.05, np.float32), scalar(-3, np.int8), i8(6, 2, 3, 2),
                        np.array([0.01, 0.02, 0.01, 0.03, 0.02, 0.01], np.float32), np.zeros(6, np.int8),
                        scalar(0.3, np.float32), scalar(-4, np.int8), RNG.integers(-500, 500, 6).astype(np.int32)],
        {"group": 2, "strides": [2, 1], "pads": [1, 0, 1, 1], "dilations": [1, 2]}, opset=10),
    "qlinear_conv_same_upper": Case(
        "QLinearConv", [u8(2, 3, 5, 5), scalar(0.02, np.float32), scalar(100, np.uint8), u8(4, 3, 3, 3),
                        scalar(0.01, np.float32), scalar(110, np.uint8), scalar(0.5, np.float32),
                        scalar(90, np.uint8)], {"auto_pad": "SAME_UPPER", "strides": [2, 2]}, opset=10),
    # -- signal --
    "dft_opset17_axis_attr_length": Case("DFT", [f32(2, 6, 5, 1), scalar(8, np.int64)], {"axis": 2}, opset=17, consts=(1,),
                                         rtol=1e-5),
    "dft_opset20_complex_inverse": Case("DFT", [f32(3, 8, 2), None, scalar(1, np.int64)], {"inverse": 1},
                                        opset=20, consts=(2,), rtol=1e-5),
    "dft_opset20_onesided": Case("DFT", [f32(2, 9, 1)], {"onesided": 1}, opset=20, rtol=1e-5),
    "stft_frame_length_no_window": Case("STFT", [f32(2, 40, 1), scalar(6, np.int64), None, scalar(10, np.int64)],
                                        opset=17, consts=(1, 3), rtol=1e-5),
    "stft_complex_twosided": Case("STFT", [f32(1, 24, 2), scalar(4, np.int64), np.hanning(8).astype(np.float32)],
                                  {"onesided": 0}, opset=17, consts=(1,), rtol=1e-5),
    "hann_symmetric_double": Case("HannWindow", [scalar(9, np.int64)],
                                  {"periodic": 0, "output_datatype": TensorProto.DOUBLE}, opset=17, rtol=1e-12),
    "hamming_periodic": Case("HammingWindow", [scalar(10, np.int32)], opset=17, consts=(0,), rtol=1e-6),
    "blackman_symmetric": Case("BlackmanWindow", [scalar(7, np.int64)], {"periodic": 0}, opset=17, rtol=1e-6),
    "mel_weight_matrix": Case("MelWeightMatrix", [scalar(10, np.int64), scalar(64, np.int64),
                                                  scalar(16000, np.int64), scalar(100.0, np.float32),
                                                  scalar(6000.0, np.float32)], opset=17, rtol=1e-6),
    "det_batched": Case("Det", [f32(2, 3, 4, 4)], opset=11, rtol=1e-5),
    # -- Resize / Upsample --
    "resize_opset10_nearest_down": Case("Resize", [IMAGE, np.array([1, 1, 0.6, 0.45], np.float32)], opset=10,
                                        consts=(1,)),
    "resize_opset10_linear_up": Case("Resize", [IMAGE, np.array([1, 1, 1.5, 2.0], np.float32)],
                                     {"mode": "linear"}, opset=10, consts=(1,), rtol=1e-5),
    "upsample_opset7_attr": Case("Upsample", [IMAGE], {"scales": [1.0, 1.0, 2.0, 3.0]}, opset=7),
    "upsample_opset9_linear": Case("Upsample", [IMAGE, np.array([1, 1, 2, 2], np.float32)], {"mode": "linear"},
                                   opset=9, consts=(1,), rtol=1e-5),
    "resize_uint8_linear_sizes": Case("Resize", [u8(1, 3, 6, 6), None, None, i64(1, 3, 4, 9)], {"mode": "linear"},
                                      opset=13, consts=(3,), reference="onnx"),
    "resize_opset11_empty_scales": Case("Resize", [IMAGE, np.zeros(0, np.float32), np.zeros(0, np.float32),
                                                   i64(1, 2, 3, 11)],
                                        {"mode": "cubic", "coordinate_transformation_mode": "align_corners"},
                                        opset=11, consts=(1, 2, 3), rtol=1e-5),
    "resize_cubic_antialias_axes": Case("Resize", [f32(2, 9, 8), None, np.array([0.4, 0.7], np.float32)],
                                        {"mode": "cubic", "antialias": 1, "axes": [1, 2]}, opset=18, consts=(2,),
                                        reference="onnx", rtol=1e-5),  # reference: float32 cubic_coeff_a
    "resize_nearest_ceil_asymmetric_runtime": Case("Resize", [IMAGE, None, np.array([1, 1, 1.7, 0.8], np.float32)],
                                                   {"nearest_mode": "ceil",
                                                    "coordinate_transformation_mode": "asymmetric"}, opset=19),
    "resize_crop_nearest_extrapolate": Case(
        "Resize", [IMAGE, np.array([0, 0, -0.2, 0.1, 1, 1, 0.9, 1.3], np.float32), None, i64(1, 2, 4, 4)],
        {"coordinate_transformation_mode": "tf_crop_and_resize", "extrapolation_value": -7.0}, consts=(1, 3)),
    "resize_half_pixel_symmetric_linear": Case("Resize", [IMAGE, None, np.array([1, 1, 1.3, 0.7], np.float32)],
                                               {"mode": "linear",
                                                "coordinate_transformation_mode": "half_pixel_symmetric"},
                                               opset=19, consts=(2,), rtol=1e-5),
    # the spec maps a 1-long output to x = 0 (onnx's reference uses -0.5): onnxruntime follows the spec
    "resize_pytorch_half_pixel_cubic_single_row": Case("Resize", [IMAGE, None, None, i64(1, 2, 1, 5)],
                                                       {"mode": "cubic",
                                                        "coordinate_transformation_mode": "pytorch_half_pixel"},
                                                       consts=(3,), rtol=1e-5),
    # -- GridSample / AffineGrid --
    "gridsample16_bicubic_reflection": Case("GridSample", [IMAGE, f32(1, 4, 3, 2, scale=0.8)],
                                            {"mode": "bicubic", "padding_mode": "reflection"}, opset=16, rtol=1e-4),
    "gridsample16_nearest_border_aligned": Case("GridSample", [IMAGE, f32(1, 3, 6, 2, scale=0.9)],
                                                {"mode": "nearest", "padding_mode": "border", "align_corners": 1},
                                                opset=16),
    "gridsample20_volumetric_linear_zeros": Case("GridSample", [f32(2, 2, 3, 4, 5), f32(2, 2, 3, 4, 3, scale=0.7)],
                                                 {"mode": "linear"}, opset=20, rtol=1e-5),
    "affine_grid_2d": Case("AffineGrid", [f32(2, 2, 3), i64(2, 3, 4, 5)], opset=20, consts=(1,), rtol=1e-5),
    "affine_grid_3d_aligned": Case("AffineGrid", [f32(1, 3, 4), i64(1, 1, 2, 3, 4)], {"align_corners": 1},
                                   opset=20, consts=(1,), rtol=1e-5),
    # -- RoiAlign / MaxRoiPool / NonMaxSuppression --
    "roialign10_max_output_half_pixel": Case(
        "RoiAlign", [f32(2, 3, 8, 8), np.array([[0, 0, 7, 7], [1.5, 2, 6.2, 5], [-3, 2, 4, 9]], np.float32),
                     i64(0, 1, 1)], {"mode": "max", "output_height": 3, "output_width": 2, "sampling_ratio": 2},
        opset=10, rtol=1e-5),
    "roialign16_avg_adaptive": Case(
        "RoiAlign", [f32(2, 3, 8, 8), np.array([[0, 0, 7, 7], [1.5, 2, 6.2, 5], [-3, 2, 4, 9]], np.float32),
                     i64(1, 0, 1)], {"output_height": 2, "output_width": 3, "spatial_scale": 0.8}, opset=16,
        rtol=1e-5),
    "maxroipool": Case("MaxRoiPool", [f32(2, 3, 6, 7), np.array([[0, 1, 1, 5, 4], [1, 0, 0, 6, 5], [1, 3, 2, 3, 2]],
                                                                np.float32)],
                       {"pooled_shape": [2, 3], "spatial_scale": 1.0}, opset=13),
    "nms_corners_two_classes": Case("NonMaxSuppression", [BOXES, NMS_SCORES, i64(2), np.array([0.5], np.float32)],
                                    opset=11, consts=(2, 3)),
    "nms_center_score_threshold": Case("NonMaxSuppression", [CENTER_BOXES, NMS_SCORES, i64(3),
                                                             np.array([0.4], np.float32),
                                                             np.array([0.35], np.float32)],
                                       {"center_point_box": 1}, opset=11),
    "nms_no_limit_input": Case("NonMaxSuppression", [BOXES, NMS_SCORES], opset=11),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name: str) -> None:
    check(CASES[name])


def test_shape_inference_with_known_values() -> None:
    """Resize sizes and window lengths known at build time give static output shapes."""
    model = CASES["resize_crop_nearest_extrapolate"].model()
    network, _ = build(model)
    infos = infer_shapes(network.graph, {"in0": TensorInfo(np.float32, IMAGE.shape)})
    assert infos["out0"].shape == (1, 2, 4, 4)
    network, _ = build(CASES["hamming_periodic"].model())
    assert infer_shapes(network.graph, {})["out0"].shape == (10,)


def test_nms_output_rows_are_data_dependent() -> None:
    network, _ = build(CASES["nms_corners_two_classes"].model())
    infos = infer_shapes(network.graph, {"in0": TensorInfo(np.float32, BOXES.shape),
                                         "in1": TensorInfo(np.float32, NMS_SCORES.shape)})
    assert infos["out0"].dtype == np.int64 and infos["out0"].shape is None


@pytest.mark.parametrize("case, message", [
    (Case("Resize", [IMAGE, None, np.array([1, 1, 2], np.float32)], consts=(2,)), "scales"),
    (Case("QuantizeLinear", [f32(2, 3), np.ones(4, np.float32)], {"axis": 1}, consts=(1,)), "per-axis"),
    (Case("BitCast", [np.zeros(2, np.float32)], {"to": TensorProto.INT16}, opset=26), "bit widths"),
    (Case("Det", [f32(2, 3)], opset=11), "Det"),
    (Case("DFT", [f32(2, 4, 2), None, scalar(2, np.int64)], opset=20, consts=(2,)), "axis"),
])
def test_bad_inputs_fail_the_build(case: Case, message: str) -> None:
    with pytest.raises(KilnError, match=message):
        run_kiln(case.model(), case.feeds())
