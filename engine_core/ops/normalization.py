"""Normalizations: Batch/Instance/Layer/Group/RMS, LRN, MeanVarianceNormalization, LpNormalization.

Statistics are computed in a wide type — the ``stash_type`` of the ops that have one (float32 by
default), else float32 for narrow floats — and the result is rounded to the input's dtype once.
Per-channel parameters (scale, bias, mean, var) broadcast as (C, 1, ..., 1) against (N, C, ...).
"""

from __future__ import annotations

import numpy as np

from engine_core.ir import Node
from engine_core.ops.elementwise import compute_dtype, quiet
from engine_core.ops.registry import ShapeInferenceError, TensorInfo, normalize_axis, register_op
from engine_core.ops.tensor import normalize_axes
from engine_core.types import onnx_to_np


def channel_param(p: np.ndarray, rank: int, dtype: np.dtype) -> np.ndarray:
    """A per-channel parameter shaped to broadcast over (N, C, *spatial). A parameter of more than
    one dim (BatchNormalization's per-activation form, spatial=0 before opset 9) already has the
    (C, *spatial) layout."""
    p = np.asarray(p).astype(dtype, copy=False)
    return p.reshape(-1, *([1] * (rank - 2))) if p.ndim <= 1 else p


def _stash_dtype(node: Node, x_dtype: np.dtype) -> np.dtype:
    """The type statistics are computed (and, for LayerNormalization, returned) in: ``stash_type``
    (default float32) where the op has it — all but GroupNormalization before opset 21."""
    has_stash = node.op_type != "GroupNormalization" or node.opset >= 21
    if not has_stash:
        return compute_dtype(x_dtype)
    return np.dtype(onnx_to_np(int(node.attr("stash_type", 1))))


# -- BatchNormalization -------------------------------------------------------------------------------


def _batchnorm_training(node: Node) -> bool:
    """Opset >= 14 says so with training_mode; before, asking for the statistics outputs did."""
    if node.opset >= 14:
        return bool(node.attr("training_mode", 0))
    return any(node.outputs[1:])


def _batchnorm_infer(node: Node, x: TensorInfo, scale: TensorInfo, b: TensorInfo, mean: TensorInfo,
                     var: TensorInfo) -> list[TensorInfo]:
    if x.shape is not None and len(x.shape) < 2:
        raise ShapeInferenceError(f"BatchNormalization needs an input (N, C, ...), got shape {x.shape}")
    stats = TensorInfo(mean.dtype, mean.shape)
    return [TensorInfo(x.dtype, x.shape)] + [stats] * (len(node.outputs) - 1)


@quiet
def _batchnorm_cpu(node: Node, x: np.ndarray, scale: np.ndarray, b: np.ndarray, mean: np.ndarray,
                   var: np.ndarray) -> list[np.ndarray]:
    """Inference: y = x * a + c with a = scale / sqrt(var + eps), c = b - mean * a (per channel).
    Training: normalize with the batch's statistics and return the updated running statistics,
    running = running * momentum + batch * (1 - momentum)."""
    work = compute_dtype(x.dtype)
    eps = node.attr("epsilon", 1e-5)
    params = [channel_param(p, x.ndim, work) for p in (scale, b, mean, var)]
    s, bias, m, v = params
    xw = x.astype(work, copy=False)
    if not _batchnorm_training(node):
        a = s / np.sqrt(v + eps)
        return [(xw * a + (bias - m * a)).astype(x.dtype, copy=False)]
    axes = (0,) if np.ndim(mean) > 1 else (0, *range(2, x.ndim))
    batch_mean = xw.mean(axis=axes)
    batch_var = xw.var(axis=axes)
    bm, bv = channel_param(batch_mean, x.ndim, work), channel_param(batch_var, x.ndim, work)
    y = (s * (xw - bm) / np.sqrt(bv + eps) + bias).astype(x.dtype, copy=False)
    momentum = node.attr("momentum", 0.9)
    running_mean = (mean * momentum + batch_mean * (1 - momentum)).astype(mean.dtype, copy=False)
    running_var = (var * momentum + batch_var * (1 - momentum)).astype(var.dtype, copy=False)
    outputs = [y, running_mean, running_var]
    if node.opset < 14:
        outputs += [batch_mean.astype(mean.dtype), batch_var.astype(var.dtype)]
    return outputs[: len(node.outputs)]


register_op("BatchNormalization", infer=_batchnorm_infer, cpu=_batchnorm_cpu)


# -- InstanceNormalization -------------------------------------------------------------------------------


def _same_shape_infer(node: Node, x: TensorInfo, *params: TensorInfo | None) -> TensorInfo:
    return TensorInfo(x.dtype, x.shape)


def standardize(x: np.ndarray, axes: tuple[int, ...], eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x - mean) / sqrt(var + eps) over ``axes``, with the mean and 1 / sqrt(var + eps) (kept dims)."""
    mean = x.mean(axis=axes, keepdims=True)
    centered = x - mean
    inv_std = 1.0 / np.sqrt(np.mean(centered * centered, axis=axes, keepdims=True) + eps)
    return centered * inv_std, mean, inv_std


@quiet
def _instance_norm_cpu(node: Node, x: np.ndarray, scale: np.ndarray, b: np.ndarray) -> np.ndarray:
    work = compute_dtype(x.dtype)
    y, _, _ = standardize(x.astype(work, copy=False), tuple(range(2, x.ndim)), node.attr("epsilon", 1e-5))
    y = y * channel_param(scale, x.ndim, work) + channel_param(b, x.ndim, work)
    return y.astype(x.dtype, copy=False)


register_op("InstanceNormalization", infer=_same_shape_infer, cpu=_instance_norm_cpu)


# -- LayerNormalization / RMSNormalization ---------------------------------------------------------------


def _layer_norm_infer(node: Node, x: TensorInfo, scale: TensorInfo, b: TensorInfo | None = None) -> list[TensorInfo]:
    stats_shape = None
    if x.shape is not None:
        axis = normalize_axis(node.attr("axis", -1), len(x.shape))
        stats_shape = x.shape[:axis] + (1,) * (len(x.shape) - axis)
    stash = _stash_dtype(node, x.dtype)
    return [TensorInfo(x.dtype, x.shape)] + [TensorInfo(stash, stats_shape)] * (len(node.outputs) - 1)


@quiet
def _layer_norm_cpu(node: Node, x: np.ndarray, scale: np.ndarray, b: np.ndarray | None = None) -> list[np.ndarray]:
    """Standardize over dims axis.. in the stash type (float64 inputs keep float64 precision, as in
    onnxruntime); Mean and InvStdDev come back in the stash type."""
    stash = _stash_dtype(node, x.dtype)
    work = np.promote_types(stash, x.dtype) if x.dtype == np.float64 else stash
    axis = normalize_axis(node.attr("axis", -1), x.ndim)
    normalized, mean, inv_std = standardize(x.astype(work, copy=False), tuple(range(axis, x.ndim)),
                                            node.attr("epsilon", 1e-5))
    y = normalized.astype(x.dtype, copy=False) * scale
    if b is not None:
        y = y + b
    stats = [mean.astype(stash, copy=False), inv_std.astype(stash, copy=False)]
    return [y.astype(x.dtype, copy=False), *stats][: len(node.outputs)]


register_op("LayerNormalization", infer=_layer_norm_infer, cpu=_layer_norm_cpu, min_opset=17)


@quiet
def _rms_norm_cpu(node: Node, x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """x / sqrt(mean(x^2 over dims axis..) + eps) * scale, the statistic in the stash type."""
    stash = _stash_dtype(node, x.dtype)
    axis = normalize_axis(node.attr("axis", -1), x.ndim)
    xs = x.astype(stash, copy=False)
    mean_square = np.mean(xs * xs, axis=tuple(range(axis, x.ndim)), keepdims=True)
    normalized = xs / np.sqrt(mean_square + node.attr("epsilon", 1e-5))
    return (normalized.astype(x.dtype, copy=False) * scale).astype(x.dtype, copy=False)


register_op("RMSNormalization", infer=_same_shape_infer, cpu=_rms_norm_cpu, min_opset=23)


# -- GroupNormalization ----------------------------------------------------------------------------------------


def _group_norm_infer(node: Node, x: TensorInfo, scale: TensorInfo, b: TensorInfo) -> TensorInfo:
    groups = node.attr("num_groups")
    if groups is None or groups < 1:
        raise ShapeInferenceError("GroupNormalization needs a positive num_groups")
    if x.shape is not None and (len(x.shape) < 2 or x.shape[1] % groups):
        raise ShapeInferenceError(f"GroupNormalization: {groups} groups do not divide the channels of {x.shape}")
    return TensorInfo(x.dtype, x.shape)


@quiet
def _group_norm_cpu(node: Node, x: np.ndarray, scale: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Standardize each (sample, group of C/G channels); then scale and shift per channel (opset 21)
    or per group (opset 18, whose scale and bias have one value per group)."""
    groups = node.attr("num_groups")
    n, c = x.shape[:2]
    stash = _stash_dtype(node, x.dtype)
    grouped = x.astype(stash, copy=False).reshape(n, groups, -1)
    normalized, _, _ = standardize(grouped, (2,), node.attr("epsilon", 1e-5))
    normalized = normalized.reshape(x.shape).astype(x.dtype, copy=False)
    if node.opset < 21:
        scale, b = np.repeat(scale, c // groups), np.repeat(b, c // groups)
    work = compute_dtype(x.dtype)
    y = normalized.astype(work) * channel_param(scale, x.ndim, work) + channel_param(b, x.ndim, work)
    return y.astype(x.dtype, copy=False)


register_op("GroupNormalization", infer=_group_norm_infer, cpu=_group_norm_cpu, min_opset=18)


# -- LRN ------------------------------------------------------------------------------------------------------------


@quiet
def _lrn_cpu(node: Node, x: np.ndarray) -> np.ndarray:
    """y = x / (bias + alpha / size * sum of x^2 over channels [c - (size-1)//2, c + ceil((size-1)/2)])^beta.
    The channel-window sums are differences of one cumulative sum."""
    size = node.attr("size")
    alpha, beta, bias = node.attr("alpha", 1e-4), node.attr("beta", 0.75), node.attr("bias", 1.0)
    work = compute_dtype(x.dtype)
    xw = x.astype(work, copy=False)
    below, above = (size - 1) // 2, size - 1 - (size - 1) // 2
    c = x.shape[1]
    cumulative = np.zeros((x.shape[0], c + 1, *x.shape[2:]), dtype=work)
    np.cumsum(xw * xw, axis=1, out=cumulative[:, 1:])
    hi = np.minimum(np.arange(c) + above + 1, c)
    lo = np.maximum(np.arange(c) - below, 0)
    square_sum = cumulative[:, hi] - cumulative[:, lo]
    return (xw / (bias + (alpha / size) * square_sum) ** beta).astype(x.dtype, copy=False)


def _lrn_infer(node: Node, x: TensorInfo) -> TensorInfo:
    if not node.attr("size"):
        raise ShapeInferenceError("LRN needs a positive size attribute")
    if x.shape is not None and len(x.shape) < 3:
        raise ShapeInferenceError(f"LRN needs an input (N, C, D1, ...), got shape {x.shape}")
    return TensorInfo(x.dtype, x.shape)


register_op("LRN", infer=_lrn_infer, cpu=_lrn_cpu)


# -- MeanVarianceNormalization / LpNormalization ----------------------------------------------------------------


def _mvn_axes(node: Node, rank: int) -> tuple[int, ...]:
    return tuple(normalize_axes(node.attr("axes", [0, 2, 3]), rank, "MeanVarianceNormalization"))


def _mvn_infer(node: Node, x: TensorInfo) -> TensorInfo:
    if x.shape is not None:
        _mvn_axes(node, len(x.shape))
    return TensorInfo(x.dtype, x.shape)


@quiet
def _mvn_cpu(node: Node, x: np.ndarray) -> np.ndarray:
    """(x - E[x]) / (sqrt(E[x^2] - E[x]^2) + 1e-9), the spec's function body (the variance clamped
    at 0, where rounding could push it below)."""
    work = compute_dtype(x.dtype)
    xw = x.astype(work, copy=False)
    axes = _mvn_axes(node, x.ndim)
    mean = xw.mean(axis=axes, keepdims=True)
    variance = np.maximum(np.mean(xw * xw, axis=axes, keepdims=True) - mean * mean, 0)
    return ((xw - mean) / (np.sqrt(variance) + work.type(1e-9))).astype(x.dtype, copy=False)


register_op("MeanVarianceNormalization", infer=_mvn_infer, cpu=_mvn_cpu)


def _lp_norm_infer(node: Node, x: TensorInfo) -> TensorInfo:
    if node.attr("p", 2) not in (1, 2):
        raise ShapeInferenceError(f"LpNormalization supports p = 1 or 2, got {node.attr('p')}")
    if x.shape is not None:
        normalize_axis(node.attr("axis", -1), len(x.shape))
    return TensorInfo(x.dtype, x.shape)


@quiet
def _lp_norm_cpu(node: Node, x: np.ndarray) -> np.ndarray:
    """x / ||x||_p along ``axis``; a zero vector stays zero (0/0 taken as 0)."""
    work = compute_dtype(x.dtype)
    xw = x.astype(work, copy=False)
    axis = normalize_axis(node.attr("axis", -1), x.ndim)
    if node.attr("p", 2) == 1:
        norm = np.sum(np.abs(xw), axis=axis, keepdims=True)
    else:
        norm = np.sqrt(np.sum(xw * xw, axis=axis, keepdims=True))
    return np.where(norm == 0, 0, xw / norm).astype(x.dtype, copy=False)


register_op("LpNormalization", infer=_lp_norm_infer, cpu=_lp_norm_cpu)
