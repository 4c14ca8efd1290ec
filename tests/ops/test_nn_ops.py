"""NN ops (engine_core/ops/nn.py, pooling.py, normalization.py, training.py losses) against onnxruntime.

Each case is a one-node ONNX model built with onnx.helper, run through the public Kiln API and through
onnxruntime (or onnx's ReferenceEvaluator where onnxruntime lacks the op or follows other semantics).
Integer and boolean outputs must match exactly; float outputs to within a few float32 ulps of the
reference's (different summation orders), dtype included. Every case also checks build-time shape
inference against the real output shapes. A small ResNet-style network checks the ops together.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import engine_core as kiln
from engine_core.errors import KilnError
from tests.ops.harness import Arrays, Case, i64, parse, run_case, run_kiln, run_reference

RNG = np.random.default_rng(7)
f32, u8 = Arrays(RNG).f32, Arrays(RNG).u8
#: Default float tolerance (rtol and atol): a few float32 ulps, as summation orders differ.
TOL = 1e-5


def pos32(*shape: int) -> np.ndarray:
    return RNG.uniform(0.5, 2.0, shape).astype(np.float32)


def assert_matches(actual: list[np.ndarray], expected: list[np.ndarray], rtol: float, atol: float) -> None:
    assert len(actual) == len(expected)
    for index, (act, exp) in enumerate(zip(actual, expected)):
        exp = np.asarray(exp)
        assert act.dtype == exp.dtype, f"output {index}: dtype {act.dtype} != {exp.dtype}"
        assert act.shape == exp.shape, f"output {index}: shape {act.shape} != {exp.shape}"
        if exp.dtype.kind in "biu":
            np.testing.assert_array_equal(act, exp, err_msg=f"output {index}")
        else:
            np.testing.assert_allclose(act.astype(np.float64), exp.astype(np.float64), rtol=rtol, atol=atol,
                                       err_msg=f"output {index}")


def check(case: Case) -> None:
    """Values as assert_matches (TOL unless the case says), and inferred dtypes and shapes exactly."""
    expected, actual, infos = run_case(case)
    assert_matches(actual, expected, TOL if case.rtol is None else case.rtol, TOL if case.atol is None else case.atol)
    for index, (info, act) in enumerate(zip(infos, actual)):
        assert info.dtype == act.dtype, f"output {index}: inferred dtype {info.dtype} != {act.dtype}"
        assert info.shape == act.shape, f"output {index}: inferred shape {info.shape} != {act.shape}"


X4 = f32(2, 4, 7, 9)  # a shared NCHW input with odd, unequal spatial dims
W4 = f32(6, 4, 3, 3)
B6 = f32(6)

CASES: dict[str, Case] = {
    # MatMul / Gemm
    "matmul_batch_broadcast": Case("MatMul", [f32(2, 1, 3, 4), f32(5, 4, 6)]),
    "matmul_vector_matrix": Case("MatMul", [f32(4), f32(3, 4, 2)]),
    "matmul_int32": Case("MatMul", [RNG.integers(-9, 9, (3, 4)).astype(np.int32),
                                    RNG.integers(-9, 9, (4, 2)).astype(np.int32)]),
    "matmul_float16": Case("MatMul", [f32(3, 8).astype(np.float16), f32(8, 5).astype(np.float16)],
                           rtol=2e-3, atol=2e-3),
    "gemm_trans_alpha_beta": Case("Gemm", [f32(4, 3), f32(5, 4), f32(1, 5)],
                                  {"transA": 1, "transB": 1, "alpha": 0.5, "beta": 2.0}),
    "gemm_no_c": Case("Gemm", [f32(3, 4), f32(4, 5)], {"alpha": 1.5}),
    "gemm_opset7_c_scalar": Case("Gemm", [f32(3, 4), f32(4, 5), f32(1)], opset=7),
    # Conv
    "conv_pads_bias": Case("Conv", [X4, W4, B6], {"pads": [1, 1, 1, 1]}),
    "conv_strides_dilations_asym_pads": Case("Conv", [X4, W4, B6],
                                             {"strides": [2, 3], "dilations": [2, 1], "pads": [2, 0, 1, 2]}),
    "conv_groups": Case("Conv", [X4, f32(6, 2, 3, 2)], {"group": 2, "pads": [0, 1, 0, 1]}),
    "conv_depthwise_multiplier": Case("Conv", [X4, f32(8, 1, 3, 3), f32(8)], {"group": 4, "pads": [1, 1, 1, 1]}),
    "conv_same_upper_stride2": Case("Conv", [X4, W4], {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    "conv_same_lower_even_kernel": Case("Conv", [X4, f32(6, 4, 2, 4)], {"auto_pad": "SAME_LOWER"}),
    "conv_valid": Case("Conv", [X4, W4], {"auto_pad": "VALID", "strides": [1, 2]}),
    "conv_pointwise": Case("Conv", [X4, f32(5, 4, 1, 1), f32(5)]),
    "conv_pointwise_strided": Case("Conv", [X4, f32(5, 4, 1, 1)], {"strides": [2, 2]}),
    "conv_1d": Case("Conv", [f32(2, 3, 11), f32(4, 3, 3)], {"pads": [2, 1], "dilations": [2]}),
    "conv_3d": Case("Conv", [f32(1, 2, 5, 6, 4), f32(3, 2, 3, 2, 3), f32(3)], {"pads": [1, 0, 1, 1, 1, 0],
                                                                               "strides": [2, 1, 1]}),
    "conv_kernel_shape_attr": Case("Conv", [X4, W4], {"kernel_shape": [3, 3]}, opset=7),
    "conv_weights_const": Case("Conv", [X4, W4, B6], {"pads": [1, 1, 1, 1]}, consts=(1, 2)),
    "conv_float64": Case("Conv", [X4.astype(np.float64), W4.astype(np.float64)], reference="onnx", rtol=1e-12),
    "conv_float16": Case("Conv", [X4.astype(np.float16), W4.astype(np.float16)], {"pads": [1, 1, 1, 1]},
                         rtol=5e-3, atol=1e-2),
    # ConvTranspose
    "convtranspose_basic": Case("ConvTranspose", [f32(2, 3, 4, 5), f32(3, 2, 3, 3), f32(2)]),
    "convtranspose_strides_pads_outpad": Case("ConvTranspose", [f32(1, 3, 4, 5), f32(3, 2, 3, 2)],
                                              {"strides": [2, 3], "pads": [1, 0, 0, 1], "output_padding": [1, 2]}),
    "convtranspose_dilations_groups": Case("ConvTranspose", [f32(1, 4, 3, 4), f32(4, 3, 2, 3), f32(6)],
                                           {"dilations": [2, 2], "group": 2}),
    "convtranspose_output_shape": Case("ConvTranspose", [f32(1, 2, 3, 3), f32(2, 2, 3, 3)],
                                       {"strides": [3, 2], "output_shape": [10, 8]}),
    "convtranspose_same_upper": Case("ConvTranspose", [f32(1, 2, 3, 4), f32(2, 3, 3, 3)],
                                     {"strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    "convtranspose_1d": Case("ConvTranspose", [f32(2, 2, 5), f32(2, 3, 4)], {"strides": [3], "pads": [1, 2]}),
    "convtranspose_3d": Case("ConvTranspose", [f32(1, 2, 3, 2, 3), f32(2, 2, 2, 3, 2)], {"strides": [1, 2, 2]}),
    # SAME padding comes out negative when the stride exceeds the kernel: it is clamped to 0
    "conv_same_stride_exceeds_kernel": Case("Conv", [f32(1, 2, 6, 6), f32(3, 2, 1, 1)],
                                            {"auto_pad": "SAME_UPPER", "strides": [3, 3]}),
    "convtranspose_output_shape_crops": Case("ConvTranspose", [f32(1, 2, 3, 4), f32(2, 2, 3, 3)],
                                             {"strides": [3, 2], "dilations": [2, 1], "output_shape": [7, 6]}),
    "convtranspose_output_shape_extends": Case("ConvTranspose", [f32(1, 2, 3), f32(2, 1, 3)],
                                               {"strides": [3], "dilations": [2], "output_shape": [13]}),
    "convtranspose_same_lower_kernel_below_stride": Case("ConvTranspose", [f32(1, 2, 4, 3), f32(2, 2, 1, 2)],
                                                         {"strides": [3, 2], "auto_pad": "SAME_LOWER"}),
    # ConvInteger
    "convinteger_zero_points": Case("ConvInteger", [u8(1, 3, 6, 5), u8(4, 3, 3, 3), np.array(131, np.uint8),
                                                    np.array(7, np.uint8)], {"pads": [1, 1, 1, 1]}, opset=10),
    "convinteger_int8_weights_groups": Case("ConvInteger", [u8(2, 4, 5, 5),
                                                            RNG.integers(-128, 128, (4, 2, 2, 2)).astype(np.int8)],
                                            {"group": 2, "strides": [2, 1]}, opset=10),
    "convinteger_per_channel_zero": Case("ConvInteger", [u8(1, 2, 4, 4), u8(3, 2, 2, 2), None,
                                                         np.array([3, 200, 9], np.uint8)], opset=10,
                                         reference="onnx"),
    # Col2Im / DeformConv
    "col2im_strides_pads_dilations": Case("Col2Im", [f32(2, 2 * 6, 9), i64(5, 6), i64(2, 3)],
                                          {"strides": [2, 1], "pads": [1, 0, 0, 1], "dilations": [1, 2]},
                                          opset=18, consts=(1, 2)),
    "col2im_3d_image": Case("Col2Im", [f32(1, 8, 8), i64(3, 3, 3), i64(2, 2, 2)], opset=18, consts=(1, 2)),
    "deformconv_offsets_mask_groups": Case("DeformConv", [f32(2, 4, 5, 6), f32(4, 2, 2, 3), 0.7 * f32(2, 2 * 12, 5, 6),
                                                          f32(4), RNG.uniform(0, 1, (2, 12, 5, 6)).astype(np.float32)],
                                           {"group": 2, "offset_group": 2, "pads": [1, 1, 0, 1], "strides": [1, 1]},
                                           opset=19),
    "deformconv_strided_dilated": Case("DeformConv", [f32(1, 2, 7, 7), f32(3, 2, 3, 3), 1.5 * f32(1, 18, 2, 3)],
                                       {"strides": [2, 2], "dilations": [2, 1], "pads": [0, 0, 0, 0]}, opset=19),
    # Softmax family
    "softmax_opset11_coerce_2d": Case("Softmax", [f32(2, 3, 4)], {"axis": 1}, opset=11),
    "softmax_opset13_axis1": Case("Softmax", [f32(2, 3, 4)], {"axis": 1}),
    "logsoftmax_opset11_default": Case("LogSoftmax", [f32(2, 3, 4)], opset=11),
    "logsoftmax_large_values": Case("LogSoftmax", [100 * f32(3, 5)], {"axis": 0}),
    "hardmax_ties_opset11": Case("Hardmax", [np.array([[[1, 3], [3, 2]], [[0, 0], [0, 0]]], np.float32)], opset=11),
    "hardmax_axis0": Case("Hardmax", [np.array([[1, 3, 3], [4, 3, 2]], np.float32)], {"axis": 0}),
    # Einsum
    "einsum_batch_matmul": Case("Einsum", [f32(2, 3, 4), f32(2, 4, 5)], {"equation": "bij,bjk->bik"}),
    "einsum_ellipsis_broadcast": Case("Einsum", [f32(2, 1, 3, 4), f32(1, 5, 4, 2)], {"equation": "...ij,...jk->...ik"}),
    "einsum_implicit_transpose": Case("Einsum", [f32(3, 4, 2)], {"equation": "kji"}),
    "einsum_trace_sum": Case("Einsum", [f32(4, 4)], {"equation": "ii"}),
    "einsum_outer_spaces": Case("Einsum", [f32(3), f32(4)], {"equation": "i, j -> ij"}),
    "einsum_int64": Case("Einsum", [np.arange(6, dtype=np.int64).reshape(2, 3), np.arange(3, dtype=np.int64)],
                         {"equation": "ij,j->i"}),
    # Dropout
    "dropout_inference_mask": Case("Dropout", [f32(3, 4), np.array(0.3, np.float32)], outputs=2),
    "dropout_opset7_ratio": Case("Dropout", [f32(3, 4)], {"ratio": 0.2}, opset=7),
    "dropout_training_seeded": Case("Dropout", [f32(4, 5), np.array(0.4, np.float32), np.array(True)],
                                    {"seed": 3}, outputs=2, reference="onnx"),
    # MaxPool
    "maxpool_pads_strides": Case("MaxPool", [X4], {"kernel_shape": [3, 2], "pads": [1, 0, 1, 1], "strides": [2, 2]}),
    "maxpool_ceil_dilations_indices": Case("MaxPool", [X4], {"kernel_shape": [2, 3], "strides": [2, 2],
                                                             "dilations": [2, 1], "ceil_mode": 1}, outputs=2),
    "maxpool_indices_column_major": Case("MaxPool", [X4], {"kernel_shape": [2, 2], "strides": [2, 2],
                                                           "storage_order": 1, "pads": [1, 1, 0, 0]}, outputs=2),
    "maxpool_same_upper": Case("MaxPool", [X4], {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    "maxpool_same_lower": Case("MaxPool", [X4], {"kernel_shape": [2, 2], "auto_pad": "SAME_LOWER"}),
    "maxpool_int8": Case("MaxPool", [RNG.integers(-128, 128, (1, 2, 5, 5)).astype(np.int8)],
                         {"kernel_shape": [2, 2], "pads": [1, 1, 1, 1]}),
    "maxpool_uint8": Case("MaxPool", [u8(1, 2, 5, 6)], {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}),
    "maxpool_1d_indices": Case("MaxPool", [f32(2, 3, 10)], {"kernel_shape": [3], "strides": [3], "ceil_mode": 1},
                               outputs=2),
    "maxpool_3d_indices": Case("MaxPool", [f32(1, 2, 5, 4, 6)], {"kernel_shape": [2, 2, 3], "strides": [2, 1, 2]},
                               outputs=2),
    "maxpool_float16": Case("MaxPool", [X4.astype(np.float16)], {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}),
    # AveragePool / LpPool
    "avgpool_exclude_pad": Case("AveragePool", [X4], {"kernel_shape": [3, 3], "pads": [1, 2, 1, 0]}),
    "avgpool_include_pad": Case("AveragePool", [X4], {"kernel_shape": [3, 3], "pads": [1, 2, 1, 0],
                                                      "count_include_pad": 1}),
    "avgpool_ceil_include_pad": Case("AveragePool", [X4], {"kernel_shape": [3, 2], "strides": [2, 3], "pads": [1, 1, 1, 1],
                                                           "ceil_mode": 1, "count_include_pad": 1}),
    "avgpool_dilations_ceil": Case("AveragePool", [X4], {"kernel_shape": [2, 2], "dilations": [2, 3], "strides": [2, 1],
                                                         "ceil_mode": 1}),
    "avgpool_same_lower": Case("AveragePool", [X4], {"kernel_shape": [2, 3], "strides": [2, 2],
                                                     "auto_pad": "SAME_LOWER"}),
    "avgpool_3d": Case("AveragePool", [f32(1, 2, 4, 5, 6)], {"kernel_shape": [2, 3, 2], "strides": [1, 2, 2]}),
    "lppool_p3_pads": Case("LpPool", [X4], {"kernel_shape": [2, 3], "p": 3, "pads": [1, 1, 0, 1]}, opset=18),
    "lppool_ceil_dilations": Case("LpPool", [X4], {"kernel_shape": [2, 2], "strides": [2, 2], "dilations": [1, 2],
                                                   "ceil_mode": 1}, opset=18),
    "lppool_p1_opset11": Case("LpPool", [X4], {"kernel_shape": [3, 3], "p": 1}, opset=11),
    # global pooling
    "global_average": Case("GlobalAveragePool", [X4]),
    "global_max_3d": Case("GlobalMaxPool", [f32(2, 3, 4, 2, 3)]),
    "global_lp_p3": Case("GlobalLpPool", [X4], {"p": 3}),
    "global_average_1d": Case("GlobalAveragePool", [f32(2, 3, 5)]),
    # MaxUnpool (with an output_shape, onnx's reference semantics are the ones its conformance case encodes)
    "maxunpool_from_maxpool": Case("MaxUnpool", [f32(1, 2, 2, 3), np.array([[[[1, 3, 4], [10, 13, 17]],
                                                                          [[18, 21, 23], [30, 32, 35]]]])],
                                   {"kernel_shape": [2, 2], "strides": [2, 2]}),
    "maxunpool_output_shape": Case("MaxUnpool", [f32(1, 1, 2, 2), i64(5, 7, 13, 15).reshape(1, 1, 2, 2),
                                                 i64(1, 1, 5, 5)], {"kernel_shape": [2, 2], "strides": [2, 2]},
                                   consts=(2,), reference="onnx"),
    # normalizations
    "batchnorm_inference": Case("BatchNormalization", [X4, f32(4), f32(4), f32(4), pos32(4)], {"epsilon": 1e-3}),
    "batchnorm_opset9_3d": Case("BatchNormalization", [f32(2, 3, 5), f32(3), f32(3), f32(3), pos32(3)], opset=9),
    "batchnorm_training_mode": Case("BatchNormalization", [X4, f32(4), f32(4), f32(4), pos32(4)],
                                    {"training_mode": 1, "momentum": 0.8}, opset=15, outputs=3),
    "instancenorm": Case("InstanceNormalization", [X4, f32(4), f32(4)], {"epsilon": 1e-2}),
    "layernorm_axis1_stats": Case("LayerNormalization", [X4, f32(7, 9), f32(7, 9)], {"axis": 2}, opset=17, outputs=3),
    "layernorm_float64_stats_in_stash_type": Case("LayerNormalization", [f32(2, 6).astype(np.float64),
                                                                      f32(6).astype(np.float64)], opset=17, outputs=3),
    "layernorm_no_bias": Case("LayerNormalization", [f32(3, 8), f32(8)], {"epsilon": 1e-3}, opset=17),
    "layernorm_float16": Case("LayerNormalization", [f32(3, 16).astype(np.float16), f32(16).astype(np.float16),
                                                     f32(16).astype(np.float16)], opset=17, outputs=3,
                              rtol=2e-3, atol=2e-3),
    "groupnorm_opset21": Case("GroupNormalization", [f32(2, 6, 3, 4), f32(6), f32(6)], {"num_groups": 3}),
    "groupnorm_opset18_per_group": Case("GroupNormalization", [f32(2, 6, 5), f32(2), f32(2)],
                                        {"num_groups": 2, "epsilon": 1e-2}, opset=18),
    "rmsnorm_axis": Case("RMSNormalization", [f32(2, 3, 8), f32(3, 8)], {"axis": 1}, opset=23),
    "lrn_attrs": Case("LRN", [X4], {"size": 5, "alpha": 1e-2, "beta": 0.6, "bias": 2.0}),
    "lrn_size3": Case("LRN", [f32(2, 5, 3, 3)], {"size": 3}),
    # onnxruntime takes odd sizes only; onnx's reference loops over channels up to N, so N == C here
    "lrn_even_size": Case("LRN", [f32(3, 3, 2, 2)], {"size": 2, "alpha": 0.1}, reference="onnx"),
    "mvn_default_axes": Case("MeanVarianceNormalization", [X4], rtol=1e-4, atol=1e-5),
    "mvn_last_axis": Case("MeanVarianceNormalization", [f32(3, 10)], {"axes": [1]}, rtol=1e-4, atol=1e-5),
    "lpnorm_l1_axis0": Case("LpNormalization", [f32(3, 4)], {"axis": 0, "p": 1}),
    "lpnorm_l2_default": Case("LpNormalization", [f32(2, 3, 4)]),
    # losses
    "sce_mean_weights_ignore_logprob": Case("SoftmaxCrossEntropyLoss", [f32(3, 5, 2), np.array([[1, 4], [-1, 2], [0, 3]]),
                                                                        pos32(5)], {"ignore_index": -1},
                                            opset=13, outputs=2),
    "sce_none_4d": Case("SoftmaxCrossEntropyLoss", [f32(2, 3, 2, 2), RNG.integers(0, 3, (2, 2, 2))],
                        {"reduction": "none"}, opset=13),
    "sce_sum_int32_labels": Case("SoftmaxCrossEntropyLoss", [f32(4, 3), np.array([0, 2, 1, 2], np.int32)],
                                 {"reduction": "sum"}, opset=13),
    "nll_mean_ignore_only": Case("NegativeLogLikelihoodLoss", [f32(4, 3), i64(0, 2, 1, 2)], {"ignore_index": 2}),
    "nll_none_weights": Case("NegativeLogLikelihoodLoss", [f32(2, 3, 4), np.array([[0, 1, 2, 1], [2, 2, 0, 1]]),
                                                           pos32(3)], {"reduction": "none"}),
    "nll_sum_weights_ignore_out_of_range": Case("NegativeLogLikelihoodLoss", [f32(3, 4), i64(3, 10, 0), pos32(4)],
                                                {"reduction": "sum", "ignore_index": 10}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_op(name: str) -> None:
    check(CASES[name])


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool", "LpPool"])
def test_pool_same_padding_below_zero_is_clamped(op: str) -> None:
    """Kernel 1 at stride 3 over 6 rows: SAME's formula pads -2. Kiln clamps that to 0 (as Conv
    does; onnxruntime's MaxPool rejects the model, its AveragePool shifts the windows), so the result
    equals the explicitly padded pooling (the columns' SAME_LOWER padding is 1 at the beginning),
    which onnxruntime computes."""
    x = f32(1, 2, 6, 7)
    same = Case(op, [x], {"kernel_shape": [1, 2], "strides": [3, 3], "auto_pad": "SAME_LOWER"}, opset=18)
    explicit = Case(op, [x], {"kernel_shape": [1, 2], "strides": [3, 3], "pads": [0, 1, 0, 0]}, opset=18)
    actual, infos = run_kiln(same.model(), same.feeds())
    assert_matches(actual, run_reference(explicit.model(), explicit.feeds()), 1e-6, 1e-6)
    assert infos[0].shape == actual[0].shape == (1, 2, 2, 3)


def test_dropout_training_keeps_expected_fraction() -> None:
    """Unseeded training-mode dropout: kept elements are scaled by 1/(1-ratio), dropped ones are 0."""
    x = np.ones((200, 50), np.float32)
    case = Case("Dropout", [x, np.array(0.25, np.float32), np.array(True)], outputs=2)
    (y, mask), _ = run_kiln(case.model(), case.feeds())
    assert mask.dtype == np.bool_
    np.testing.assert_array_equal(y, np.where(mask, np.float32(1 / 0.75), 0).astype(np.float32))
    assert 0.70 < mask.mean() < 0.80


@pytest.mark.parametrize("attrs, message", [
    ({"kernel_shape": [9, 9]}, "does not fit"),
    ({"kernel_shape": [2, 2], "auto_pad": "SAME_MIDDLE"}, "auto_pad"),
    ({"kernel_shape": [2, 2], "strides": [1]}, "strides"),
])
def test_pool_rejects_bad_geometry(attrs: dict[str, Any], message: str) -> None:
    """Bad attributes fail at build time with a message naming the problem."""
    model = Case("MaxPool", [f32(1, 1, 4, 4)], attrs).model()
    network = parse(model)
    with pytest.raises(KilnError, match=message):
        kiln.build_plan(network, kiln.Builder().create_builder_config())


def test_conv_channel_mismatch_is_a_build_error() -> None:
    model = Case("Conv", [f32(1, 3, 5, 5), f32(2, 4, 3, 3)]).model()
    network = parse(model)
    with pytest.raises(KilnError, match="channels"):
        kiln.build_plan(network, kiln.Builder().create_builder_config())


# -- a small ResNet-style network: the ops together, with Conv+BN folding and weights as initializers ---------


def _conv_bn_relu(nodes: list, inits: list, x: str, name: str, c_in: int, c_out: int, k: int, stride: int,
                  relu: bool = True) -> str:
    w = numpy_helper.from_array((RNG.standard_normal((c_out, c_in, k, k)) * (2 / (c_in * k * k)) ** 0.5)
                                .astype(np.float32), f"{name}_w")
    bn = [numpy_helper.from_array(v.astype(np.float32), f"{name}_{p}") for p, v in
          (("scale", RNG.uniform(0.5, 1.5, c_out)), ("bias", RNG.standard_normal(c_out) * 0.1),
           ("mean", RNG.standard_normal(c_out) * 0.1), ("var", RNG.uniform(0.5, 1.5, c_out)))]
    inits += [w, *bn]
    nodes.append(helper.make_node("Conv", [x, w.name], [f"{name}_c"], pads=[k // 2] * 4, strides=[stride] * 2))
    nodes.append(helper.make_node("BatchNormalization", [f"{name}_c"] + [t.name for t in bn], [f"{name}_bn"]))
    if not relu:
        return f"{name}_bn"
    nodes.append(helper.make_node("Relu", [f"{name}_bn"], [f"{name}_out"]))
    return f"{name}_out"


def small_resnet() -> onnx.ModelProto:
    """Stem (7x7/2 conv, 3x3/2 max pool), two bottleneck blocks (one downsampling, with projection),
    global average pool, Gemm classifier and Softmax."""
    nodes: list = []
    inits: list = []
    x = _conv_bn_relu(nodes, inits, "input", "stem", 3, 16, 7, 2)
    nodes.append(helper.make_node("MaxPool", [x], ["pool"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]))
    x = "pool"
    for index, (c_in, mid, c_out, stride) in enumerate(((16, 8, 32, 1), (32, 16, 64, 2))):
        name = f"block{index}"
        a = _conv_bn_relu(nodes, inits, x, f"{name}a", c_in, mid, 1, 1)
        b = _conv_bn_relu(nodes, inits, a, f"{name}b", mid, mid, 3, stride)
        c = _conv_bn_relu(nodes, inits, b, f"{name}c", mid, c_out, 1, 1, relu=False)
        shortcut = _conv_bn_relu(nodes, inits, x, f"{name}s", c_in, c_out, 1, stride, relu=False)
        nodes.append(helper.make_node("Add", [c, shortcut], [f"{name}_sum"]))
        nodes.append(helper.make_node("Relu", [f"{name}_sum"], [f"{name}_out"]))
        x = f"{name}_out"
    nodes.append(helper.make_node("GlobalAveragePool", [x], ["gap"]))
    nodes.append(helper.make_node("Flatten", ["gap"], ["flat"]))
    inits += [numpy_helper.from_array(f32(10, 64) * 0.1, "fc_w"), numpy_helper.from_array(f32(10), "fc_b")]
    nodes.append(helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"], transB=1))
    nodes.append(helper.make_node("Softmax", ["logits"], ["probs"]))
    graph = helper.make_graph(nodes, "small_resnet",
                              [helper.make_tensor_value_info("input", onnx.TensorProto.FLOAT, [2, 3, 64, 64])],
                              [helper.make_tensor_value_info("probs", onnx.TensorProto.FLOAT, [2, 10])],
                              initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def test_small_resnet_matches_onnxruntime() -> None:
    model = small_resnet()
    onnx.checker.check_model(model)
    feeds = {"input": f32(2, 3, 64, 64)}
    expected = run_reference(model, feeds)
    actual, infos = run_kiln(model, feeds)
    assert_matches(actual, expected, rtol=1e-4, atol=1e-6)
    assert infos[0].shape == (2, 10)
