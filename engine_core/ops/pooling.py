"""Pooling: MaxPool (with indices), AveragePool, LpPool, their global forms, and MaxUnpool.

A pooling is a reduction across kernel offsets: for each offset, one strided view of the padded
input holds that tap of every window, and the views are combined elementwise (max, sum of values,
sum of |x|^p) — vectorized over all windows, one numpy op per kernel offset. The window geometry
(output sizes incl. auto_pad and ceil_mode) is ``nn.window_geometry``'s, shared with Conv.

Windows may reach into the explicit padding and, in ceil_mode, beyond it. Max pooling pads with the
lowest value, so padding never wins; average pooling divides by the number of taps that hit the
input (or the input plus its explicit padding with count_include_pad) — taps beyond the explicit
padding never count, as in onnxruntime and onnx's reference.
"""

from __future__ import annotations

import math

import numpy as np

from engine_core.ir import Node
from engine_core.ops.elementwise import compute_dtype, is_float
from engine_core.ops.nn import Window, padded_input, window_geometry, work_dtype
from engine_core.ops.registry import ShapeInferenceError, TensorInfo, register_op


def pool_window(node: Node, shape: tuple[int, ...]) -> Window:
    """Window geometry of a pooling node over an input of ``shape`` (N, C, *spatial)."""
    kernel = node.attr("kernel_shape")
    if not kernel:
        raise ShapeInferenceError(f"{node.op_type} needs the kernel_shape attribute")
    if len(shape) < 3:
        raise ShapeInferenceError(f"{node.op_type} needs an input (N, C, *spatial), got shape {shape}")
    return window_geometry(node, shape[2:], kernel, ceil_mode=bool(node.attr("ceil_mode", 0)))


def _pool_infer(node: Node, x: TensorInfo) -> TensorInfo | list[TensorInfo]:
    shape = None
    if x.shape is not None:
        shape = (*x.shape[:2], *pool_window(node, x.shape).out)
    y = TensorInfo(x.dtype, shape)
    if node.op_type == "MaxPool" and len(node.outputs) > 1:
        return [y, TensorInfo(np.int64, shape)]
    return y


def _taps(xp: np.ndarray, win: Window):
    """(kernel offset index, view of that tap for every window), in row-major kernel order."""
    for index, offset in enumerate(win.offsets()):
        yield index, xp[(Ellipsis, *win.taps(offset))]


# -- MaxPool ----------------------------------------------------------------------------------------


def _lowest(dtype: np.dtype) -> float | int:
    """The padding value of max pooling: the lowest finite value, as onnxruntime starts from (so a
    window that lies wholly in the padding gives it, not -inf)."""
    dtype = np.dtype(dtype)
    return np.finfo(dtype).min if is_float(dtype) else np.iinfo(dtype).min


def max_indices(win: Window, argmax: np.ndarray, x_shape: tuple[int, ...], column_major: bool) -> np.ndarray:
    """Flat indices into x (N, C, *spatial) of each window's maximum, from the winning kernel
    offset per window. storage_order=1 numbers the spatial dims column-major (batch and channel
    stay outermost), as the spec and onnxruntime do."""
    spatial = x_shape[2:]
    taps = np.array(list(win.offsets()), dtype=np.int64).reshape(win.size, len(spatial))
    order = range(len(spatial) - 1, -1, -1) if not column_major else range(len(spatial))
    place, step = {}, 1
    for dim in order:
        place[dim] = step
        step *= spatial[dim]
    flat = np.zeros(argmax.shape, dtype=np.int64)
    for dim in range(len(spatial)):
        start = np.arange(win.out[dim], dtype=np.int64) * win.strides[dim] - win.pads_begin[dim]
        start = start.reshape((-1,) + (1,) * (len(spatial) - dim - 1))
        flat += (start + taps[argmax, dim] * win.dilations[dim]) * place[dim]
    planes = np.arange(x_shape[0] * x_shape[1], dtype=np.int64).reshape(x_shape[0], x_shape[1], *([1] * len(spatial)))
    return flat + planes * math.prod(spatial)


def _max_pool_cpu(node: Node, x: np.ndarray) -> np.ndarray | list[np.ndarray]:
    """Running maximum over the kernel taps; with the Indices output, also the first tap (in
    row-major kernel order) that holds the maximum, as a strict comparison keeps it."""
    win = pool_window(node, x.shape)
    work = work_dtype(x.dtype)
    xp = padded_input(x.astype(work, copy=False), win, _lowest(work))
    want_indices = len(node.outputs) > 1 and bool(node.outputs[1])
    best = None
    argmax = np.zeros((*x.shape[:2], *win.out), dtype=np.int64) if want_indices else None
    for index, view in _taps(xp, win):
        if best is None:
            best = view.copy()
        elif want_indices:
            better = view > best
            np.copyto(best, view, where=better)
            argmax[better] = index
        else:
            np.maximum(best, view, out=best)
    y = best.astype(x.dtype, copy=False)
    if not want_indices:
        return y
    return [y, max_indices(win, argmax, x.shape, column_major=bool(node.attr("storage_order", 0)))]


register_op("MaxPool", infer=_pool_infer, cpu=_max_pool_cpu)


# -- AveragePool / LpPool ------------------------------------------------------------------------------


def window_counts(win: Window, spatial_in: tuple[int, ...], include_pad: bool) -> np.ndarray:
    """How many taps of each window count for the average, shape ``win.out``: taps inside the
    input, or inside input + explicit padding with ``include_pad``. Separable, so it is the outer
    product of one small count vector per spatial dim."""
    counts = np.ones((), dtype=np.float64)
    for dim, size in enumerate(spatial_in):
        lo = -win.pads_begin[dim] if include_pad else 0
        hi = size + win.pads_end[dim] if include_pad else size
        start = np.arange(win.out[dim]) * win.strides[dim] - win.pads_begin[dim]
        taps = start[:, None] + np.arange(win.kernel[dim]) * win.dilations[dim]
        per_dim = ((taps >= lo) & (taps < hi)).sum(axis=1)
        counts = np.multiply.outer(counts, per_dim)
    return counts


def _window_sum(xp: np.ndarray, win: Window) -> np.ndarray:
    total = None
    for _, view in _taps(xp, win):
        total = view.copy() if total is None else np.add(total, view, out=total)
    return total


def _average_pool_cpu(node: Node, x: np.ndarray) -> np.ndarray:
    win = pool_window(node, x.shape)
    work = compute_dtype(x.dtype)
    total = _window_sum(padded_input(x.astype(work, copy=False), win), win)
    counts = window_counts(win, x.shape[2:], bool(node.attr("count_include_pad", 0)))
    with np.errstate(invalid="ignore", divide="ignore"):
        return (total / counts.astype(work)).astype(x.dtype, copy=False)


register_op("AveragePool", infer=_pool_infer, cpu=_average_pool_cpu)


def _lp_power(x: np.ndarray, p: float) -> np.ndarray:
    return x * x if p == 2 else np.abs(x) ** p


def _lp_root(s: np.ndarray, p: float) -> np.ndarray:
    return np.sqrt(s) if p == 2 else s ** (1.0 / p)


def _lp_pool_cpu(node: Node, x: np.ndarray) -> np.ndarray:
    """(sum over the window of |x|^p)^(1/p); padding adds zeros, so it never matters."""
    p = float(node.attr("p", 2))
    win = pool_window(node, x.shape)
    work = compute_dtype(x.dtype)
    total = _window_sum(padded_input(_lp_power(x.astype(work, copy=False), p), win), win)
    return _lp_root(total, p).astype(x.dtype, copy=False)


register_op("LpPool", infer=_pool_infer, cpu=_lp_pool_cpu)


# -- global pooling ---------------------------------------------------------------------------------------


def _global_infer(node: Node, x: TensorInfo) -> TensorInfo:
    if x.shape is None:
        return TensorInfo(x.dtype, None)
    if len(x.shape) < 2:
        raise ShapeInferenceError(f"{node.op_type} needs an input (N, C, ...), got shape {x.shape}")
    return TensorInfo(x.dtype, (*x.shape[:2], *([1] * (len(x.shape) - 2))))


def _spatial_axes(x: np.ndarray) -> tuple[int, ...]:
    return tuple(range(2, x.ndim))


def _global_average_cpu(node: Node, x: np.ndarray) -> np.ndarray:
    work = compute_dtype(x.dtype)
    return np.mean(x.astype(work, copy=False), axis=_spatial_axes(x), keepdims=True).astype(x.dtype, copy=False)


def _global_max_cpu(node: Node, x: np.ndarray) -> np.ndarray:
    return np.max(x, axis=_spatial_axes(x), keepdims=True)


def _global_lp_cpu(node: Node, x: np.ndarray) -> np.ndarray:
    p = float(node.attr("p", 2))
    work = compute_dtype(x.dtype)
    total = np.sum(_lp_power(x.astype(work, copy=False), p), axis=_spatial_axes(x), keepdims=True)
    return _lp_root(total, p).astype(x.dtype, copy=False)


register_op("GlobalAveragePool", infer=_global_infer, cpu=_global_average_cpu)
register_op("GlobalMaxPool", infer=_global_infer, cpu=_global_max_cpu)
register_op("GlobalLpPool", infer=_global_infer, cpu=_global_lp_cpu)


# -- MaxUnpool -----------------------------------------------------------------------------------------------


def unpooled_shape(node: Node, x_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape MaxPool's input had by the attributes: (in - 1) * stride - pads + kernel."""
    kernel = node.attr("kernel_shape")
    n = len(x_shape) - 2
    if not kernel or len(kernel) != n:
        raise ShapeInferenceError(f"MaxUnpool kernel_shape {kernel} does not fit input shape {x_shape}")
    strides = node.attr("strides") or [1] * n
    pads = node.attr("pads") or [0] * (2 * n)
    spatial = [(d - 1) * s - (pads[i] + pads[n + i]) + k
               for i, (d, s, k) in enumerate(zip(x_shape[2:], strides, kernel))]
    return (*x_shape[:2], *spatial)


def _max_unpool_infer(node: Node, x: TensorInfo, indices: TensorInfo, output_shape: TensorInfo | None = None) -> TensorInfo:
    if output_shape is not None:
        shape = None if output_shape.value is None else tuple(int(v) for v in output_shape.value)
        return TensorInfo(x.dtype, shape)
    return TensorInfo(x.dtype, None if x.shape is None else unpooled_shape(node, x.shape))


def _max_unpool_cpu(node: Node, x: np.ndarray, indices: np.ndarray, output_shape: np.ndarray | None = None) -> np.ndarray:
    """Scatter each value to its flat index in the unpooled shape (zeros elsewhere). A larger
    output_shape extends that tensor at the end of each dim (onnx's reference semantics, which its
    conformance case encodes)."""
    inferred = unpooled_shape(node, x.shape)
    flat = np.zeros(math.prod(inferred), dtype=x.dtype)
    flat[indices.reshape(-1)] = x.reshape(-1)
    y = flat.reshape(inferred)
    if output_shape is None:
        return y
    target = tuple(int(v) for v in output_shape)
    if target == inferred:
        return y
    out = np.zeros(target, dtype=x.dtype)
    common = tuple(slice(0, min(a, b)) for a, b in zip(target, inferred))
    out[common] = y[common]
    return out


register_op("MaxUnpool", infer=_max_unpool_infer, cpu=_max_unpool_cpu, min_opset=9)
