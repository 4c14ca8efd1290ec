"""Quantization ops: QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear, MatMulInteger,
QLinearMatMul, QLinearConv.

Scales and zero points come per tensor (scalar), per axis (1-D along ``axis``) or blocked (same rank
as the data, ``block_size`` elements of ``axis`` share one entry); ``expand_quant_param`` turns any
of the three into an array that broadcasts against the data, so each op does its math once.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from engine_core.ir import Node
from engine_core.ops.cast import SATURATING_FLOAT8, cast_array
from engine_core.ops.registry import (
    ShapeInferenceError,
    TensorInfo,
    broadcast_shapes,
    normalize_axis,
    register_op,
)
from engine_core.types import onnx_to_np

#: Integer quantized types and their ranges (ml_dtypes' iinfo covers the sub-byte ones).
INTEGER_QUANT_TYPES = frozenset(
    np.dtype(t)
    for t in (np.uint8, np.int8, np.uint16, np.int16, ml_dtypes.uint4, ml_dtypes.int4, ml_dtypes.uint2, ml_dtypes.int2)
)
FLOAT4 = np.dtype(ml_dtypes.float4_e2m1fn)


def expand_quant_param(value: np.ndarray, shape: tuple[int, ...], axis: int, block_size: int = 0) -> np.ndarray:
    """A scale/zero point (scalar, per-axis 1-D, or blocked) as an array broadcastable to ``shape``."""
    if value.ndim == 0 or value.size == 1 and not block_size:
        return value.reshape(())
    axis = normalize_axis(axis, len(shape))
    if not block_size:
        if value.ndim != 1 or value.size != shape[axis]:
            raise ShapeInferenceError(
                f"per-axis scale/zero point of shape {value.shape} does not match axis {axis} of {shape}")
        dims = [1] * len(shape)
        dims[axis] = value.size
        return value.reshape(dims)
    if block_size < 0:
        raise ShapeInferenceError(f"block_size must be positive, got {block_size}")
    expected = tuple(math.ceil(d / block_size) if i == axis else d for i, d in enumerate(shape))
    if value.shape != expected:
        raise ShapeInferenceError(f"blocked scale/zero point has shape {value.shape}, expected {expected}")
    return np.repeat(value, block_size, axis=axis).take(np.arange(shape[axis]), axis=axis)


def _param_shape_ok(param: TensorInfo | None, x: TensorInfo, node: Node) -> None:
    """Build-time check of a scale/zero point against the data shape (cheap: shapes only)."""
    if param is None or param.shape is None or x.shape is None:
        return
    expand_quant_param(np.empty(param.shape, np.int8), x.shape, node.attr("axis", 1), node.attr("block_size", 0))


# -- QuantizeLinear ----------------------------------------------------------------------------------


def _quantized_dtype(node: Node, zero_point_dtype: np.dtype | None) -> np.dtype:
    """Output type: the zero point's, else ``output_dtype``, else uint8."""
    attr = node.attr("output_dtype", 0)
    declared = onnx_to_np(attr) if attr else None
    if zero_point_dtype is not None:
        if declared is not None and declared != zero_point_dtype:
            raise ShapeInferenceError(f"output_dtype {declared} differs from the zero point's type {zero_point_dtype}")
        return np.dtype(zero_point_dtype)
    return declared if declared is not None else np.dtype(np.uint8)


def _quantize_infer(node: Node, x: TensorInfo, scale: TensorInfo, zero_point: TensorInfo | None = None) -> TensorInfo:
    dtype = _quantized_dtype(node, zero_point.dtype if zero_point is not None else None)
    if dtype not in INTEGER_QUANT_TYPES and dtype not in SATURATING_FLOAT8 and dtype != FLOAT4:
        raise ShapeInferenceError(f"QuantizeLinear cannot produce {dtype}")
    _param_shape_ok(scale, x, node)
    _param_shape_ok(zero_point, x, node)
    return TensorInfo(dtype, x.shape)


def quantize(x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None, dtype: np.dtype,
             saturate: bool = True, precision: np.dtype | None = None) -> np.ndarray:
    """saturate(round(x / scale) + zero_point) in ``dtype`` (scale/zero point already broadcastable)."""
    if precision is not None:
        scaled = x.astype(precision) / scale.astype(precision)
    else:
        scaled = x / scale
    if dtype in INTEGER_QUANT_TYPES:
        q = np.rint(scaled).astype(np.int64)  # int64: no wrap-around before clipping
        if zero_point is not None:
            q += zero_point.astype(np.int64)
        info = ml_dtypes.iinfo(dtype)
        return np.clip(q, int(info.min), int(info.max)).astype(dtype)
    if dtype == FLOAT4:  # no Inf/NaN codes: the conversion itself saturates
        if zero_point is not None:
            scaled = scaled + zero_point.astype(np.float32)
        return scaled.astype(dtype)
    return cast_array(scaled, dtype, saturate)


def _quantize_cpu(node: Node, x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None = None) -> np.ndarray:
    dtype = _quantized_dtype(node, zero_point.dtype if zero_point is not None else None)
    axis, block = node.attr("axis", 1), node.attr("block_size", 0)
    scale = expand_quant_param(scale, x.shape, axis, block)
    if zero_point is not None:
        zero_point = expand_quant_param(zero_point, x.shape, axis, block)
    precision = node.attr("precision", 0)
    return quantize(x, scale, zero_point, dtype, bool(node.attr("saturate", 1)),
                    onnx_to_np(precision) if precision else None)


register_op("QuantizeLinear", infer=_quantize_infer, cpu=_quantize_cpu, min_opset=10,
            doc="Linear quantization: per tensor, per axis or blocked.")


# -- DequantizeLinear --------------------------------------------------------------------------------


def _dequant_dtype(node: Node, scale_dtype: np.dtype) -> np.dtype:
    attr = node.attr("output_dtype", 0)
    return onnx_to_np(attr) if attr else np.dtype(scale_dtype)


def _dequantize_infer(node: Node, x: TensorInfo, scale: TensorInfo, zero_point: TensorInfo | None = None) -> TensorInfo:
    _param_shape_ok(scale, x, node)
    _param_shape_ok(zero_point, x, node)
    if zero_point is not None and zero_point.dtype != x.dtype:
        raise ShapeInferenceError(f"DequantizeLinear zero point type {zero_point.dtype} differs from input {x.dtype}")
    return TensorInfo(_dequant_dtype(node, scale.dtype), x.shape)


def _dequantize_cpu(node: Node, x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None = None) -> np.ndarray:
    axis, block = node.attr("axis", 1), node.attr("block_size", 0)
    values = x.astype(np.float32)
    if zero_point is not None:  # float8/float4 zero points must be 0: subtracting them is a no-op
        values = values - expand_quant_param(zero_point, x.shape, axis, block).astype(np.float32)
    y = values * expand_quant_param(scale, x.shape, axis, block)
    return y.astype(_dequant_dtype(node, scale.dtype))


register_op("DequantizeLinear", infer=_dequantize_infer, cpu=_dequantize_cpu, min_opset=10,
            doc="(x - zero_point) * scale: per tensor, per axis or blocked.")


# -- DynamicQuantizeLinear ---------------------------------------------------------------------------


def _dynamic_quantize_infer(node: Node, x: TensorInfo) -> list[TensorInfo]:
    return [TensorInfo(np.uint8, x.shape), TensorInfo(np.float32, ()), TensorInfo(np.uint8, ())]


def _dynamic_quantize_cpu(node: Node, x: np.ndarray) -> list[np.ndarray]:
    """uint8 quantization whose range [min(x, 0), max(x, 0)] is taken from the data itself."""
    hi = np.float32(max(0.0, float(x.max()))) if x.size else np.float32(0)
    lo = np.float32(min(0.0, float(x.min()))) if x.size else np.float32(0)
    scale = np.float32(1.0 if hi == lo else hi - lo) / np.float32(255)
    zero_point = np.rint(np.clip(np.float32(0) - lo / scale, 0, 255))
    y = np.clip(np.rint(x / scale) + zero_point, 0, 255).astype(np.uint8)
    return [y, np.array(scale, dtype=np.float32), np.array(zero_point, dtype=np.uint8)]


register_op("DynamicQuantizeLinear", infer=_dynamic_quantize_infer, cpu=_dynamic_quantize_cpu, min_opset=11,
            doc="uint8 quantization with scale and zero point computed from the input's range.")


# -- integer matrix products -------------------------------------------------------------------------


def _matmul_shape(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    if not a or not b:
        raise ShapeInferenceError("matrix product inputs must have rank >= 1")
    if a[-1] != (b[0] if len(b) == 1 else b[-2]):
        raise ShapeInferenceError(f"matrix product inner dimensions differ: {a} x {b}")
    batch = broadcast_shapes(a[:-2], b[:-2])
    return (*batch, *a[-2:-1], *(b[-1:] if len(b) > 1 else ()))


def exact_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Integer matmul through float64 BLAS: exact while |sums| < 2**53, far faster than int matmul."""
    return np.matmul(a.astype(np.float64), b.astype(np.float64))


def _row_zero_point(zero_point: np.ndarray, a: np.ndarray) -> np.ndarray:
    """A's zero point is a scalar or one entry per row (M): make the per-row form a column."""
    zp = zero_point.astype(np.int64)
    if zp.ndim >= 1 and zp.size > 1 and a.ndim >= 2:
        return zp.reshape(*zp.shape, 1)
    return zp


def _matmul_integer_infer(node: Node, a: TensorInfo, b: TensorInfo, *zero_points: TensorInfo | None) -> TensorInfo:
    shape = None if a.shape is None or b.shape is None else _matmul_shape(a.shape, b.shape)
    return TensorInfo(np.int32, shape)


def _matmul_integer_cpu(node: Node, a: np.ndarray, b: np.ndarray, a_zero_point: np.ndarray | None = None,
                        b_zero_point: np.ndarray | None = None) -> np.ndarray:
    a64 = a.astype(np.int64) - (_row_zero_point(a_zero_point, a) if a_zero_point is not None else 0)
    b64 = b.astype(np.int64) - (b_zero_point.astype(np.int64) if b_zero_point is not None else 0)
    return exact_matmul(a64, b64).astype(np.int32)


register_op("MatMulInteger", infer=_matmul_integer_infer, cpu=_matmul_integer_cpu, min_opset=10,
            doc="int8/uint8 matmul with zero points, int32 result.")


def requantize(acc: np.ndarray, multiplier: np.ndarray, zero_point: np.ndarray | None, dtype: np.dtype) -> np.ndarray:
    """Integer accumulator -> quantized output: round(acc * multiplier) + zero point, saturated."""
    y = acc * multiplier
    if zero_point is not None:
        y = y + zero_point
    info = np.iinfo(dtype)
    return np.clip(np.rint(y), info.min, info.max).astype(dtype)


def _qlinear_matmul_infer(node: Node, a: TensorInfo, a_scale: TensorInfo, a_zp: TensorInfo | None, b: TensorInfo,
                          b_scale: TensorInfo, b_zp: TensorInfo | None, y_scale: TensorInfo,
                          y_zp: TensorInfo | None = None) -> TensorInfo:
    shape = None if a.shape is None or b.shape is None else _matmul_shape(a.shape, b.shape)
    return TensorInfo(y_zp.dtype if y_zp is not None else a.dtype, shape)


def _qlinear_matmul_cpu(node: Node, a: np.ndarray, a_scale: np.ndarray, a_zp: np.ndarray | None, b: np.ndarray,
                        b_scale: np.ndarray, b_zp: np.ndarray | None, y_scale: np.ndarray,
                        y_zp: np.ndarray | None = None) -> np.ndarray:
    """b's scale and zero point may be per column (1-D over N): they broadcast along the last axis."""
    acc = _matmul_integer_cpu(node, a, b, a_zp, b_zp)
    return requantize(acc, a_scale * b_scale / y_scale, y_zp, y_zp.dtype if y_zp is not None else a.dtype)


register_op("QLinearMatMul", infer=_qlinear_matmul_infer, cpu=_qlinear_matmul_cpu, min_opset=10,
            doc="Quantized matmul: integer product, requantized to the output scale.")


# -- QLinearConv -------------------------------------------------------------------------------------


def _conv_geometry(node: Node, spatial: tuple[int, ...], kernel: tuple[int, ...]) -> tuple[list[int], list[int], list[int], list[int]]:
    """strides, dilations, pads (begins then ends) and output spatial size, auto_pad resolved."""
    n = len(spatial)
    strides = list(node.attr("strides", [1] * n))
    dilations = list(node.attr("dilations", [1] * n))
    pads = list(node.attr("pads", [0] * (2 * n)))
    auto_pad = node.attr("auto_pad", "NOTSET")
    effective = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        out = [math.ceil(s / st) for s, st in zip(spatial, strides)]
        total = [max(0, (o - 1) * st + e - s) for o, st, e, s in zip(out, strides, effective, spatial)]
        small = [t // 2 for t in total]
        big = [t - t // 2 for t in total]
        pads = (small + big) if auto_pad == "SAME_UPPER" else (big + small)
    elif auto_pad == "VALID":
        pads = [0] * (2 * n)
    out = [(s + pads[i] + pads[i + n] - effective[i]) // strides[i] + 1 for i, s in enumerate(spatial)]
    if any(o <= 0 for o in out):
        raise ShapeInferenceError(f"convolution output would be empty: input {spatial}, kernel {kernel}")
    return strides, dilations, pads, out


def integer_conv(x: np.ndarray, w: np.ndarray, node: Node) -> np.ndarray:
    """N-D grouped convolution of integer tensors (NC..., MC/g...) via im2col, exact int64 result."""
    n_spatial = x.ndim - 2
    kernel = tuple(w.shape[2:])
    strides, dilations, pads, out = _conv_geometry(node, tuple(x.shape[2:]), kernel)
    padded = np.pad(x, [(0, 0), (0, 0)] + [(pads[i], pads[i + n_spatial]) for i in range(n_spatial)])
    windows = np.lib.stride_tricks.sliding_window_view(
        padded, [(k - 1) * d + 1 for k, d in zip(kernel, dilations)], axis=tuple(range(2, x.ndim)))
    # windows: N, C, *positions, *window -> keep strided positions and dilated taps
    windows = windows[(slice(None), slice(None), *(slice(None, None, s) for s in strides),
                       *(slice(None, None, d) for d in dilations))]
    windows = windows[(slice(None), slice(None), *(slice(0, o) for o in out))]
    group = node.attr("group", 1)
    batch, channels = x.shape[:2]
    per_group = channels // group
    m = w.shape[0]
    # columns: N, group, positions, C/g * kernel
    cols = windows.reshape(batch, group, per_group, *out, *kernel)
    cols = np.moveaxis(cols, 2, 2 + n_spatial).reshape(batch, group, math.prod(out), per_group * math.prod(kernel))
    weights = w.reshape(group, m // group, per_group * math.prod(kernel))
    y = exact_matmul(cols, np.swapaxes(weights, 1, 2)[None])  # N, group, positions, M/g
    return np.moveaxis(y, 2, 3).reshape(batch, m, *out).astype(np.int64)


def _qlinear_conv_infer(node: Node, x: TensorInfo, x_scale: TensorInfo, x_zp: TensorInfo | None, w: TensorInfo,
                        w_scale: TensorInfo, w_zp: TensorInfo | None, y_scale: TensorInfo,
                        y_zp: TensorInfo | None = None, bias: TensorInfo | None = None) -> TensorInfo:
    dtype = y_zp.dtype if y_zp is not None else x.dtype
    if x.shape is None or w.shape is None:
        return TensorInfo(dtype, None)
    if len(x.shape) < 3 or len(w.shape) != len(x.shape):
        raise ShapeInferenceError(f"QLinearConv needs N-D input and weights of equal rank, got {x.shape}, {w.shape}")
    if x.shape[1] != w.shape[1] * node.attr("group", 1):
        raise ShapeInferenceError(f"QLinearConv channels {x.shape[1]} != {w.shape[1]} x group {node.attr('group', 1)}")
    *_, out = _conv_geometry(node, x.shape[2:], w.shape[2:])
    return TensorInfo(dtype, (x.shape[0], w.shape[0], *out))


def _per_channel(value: np.ndarray, trailing: int) -> np.ndarray:
    """A per-output-channel vector shaped to broadcast over an axis followed by ``trailing`` axes
    (weights [M, C/g, *kernel] or outputs [N, M, *spatial]); a single value stays a scalar."""
    return value.reshape(-1, *([1] * trailing)) if value.size > 1 else value.reshape(())


def _qlinear_conv_cpu(node: Node, x: np.ndarray, x_scale: np.ndarray, x_zp: np.ndarray | None, w: np.ndarray,
                      w_scale: np.ndarray, w_zp: np.ndarray | None, y_scale: np.ndarray,
                      y_zp: np.ndarray | None = None, bias: np.ndarray | None = None) -> np.ndarray:
    xi = x.astype(np.int64) - (x_zp.astype(np.int64) if x_zp is not None else 0)
    wi = w.astype(np.int64) - (_per_channel(w_zp, w.ndim - 1).astype(np.int64) if w_zp is not None else 0)
    acc = integer_conv(xi, wi, node)
    if bias is not None:
        acc = acc + _per_channel(bias.astype(np.int64), acc.ndim - 2)
    acc = acc.astype(np.int32)
    multiplier = x_scale * _per_channel(w_scale, acc.ndim - 2) / y_scale
    return requantize(acc, multiplier, y_zp, y_zp.dtype if y_zp is not None else x.dtype)


register_op("QLinearConv", infer=_qlinear_conv_infer, cpu=_qlinear_conv_cpu, min_opset=10,
            doc="Quantized convolution: integer conv + int32 bias, requantized to the output scale.")
