"""Reductions (ReduceSum ... ReduceSumSquare), ArgMax/ArgMin and the scans CumSum/CumProd.

Canonical form: ``axes`` is input 1. Older opsets (ReduceSum < 13, the others < 18) carried it as an
attribute; ``normalize`` moves it into a constant input. No axes (or an empty list) means every
axis, unless ``noop_with_empty_axes`` is set: then it reduces over no axes, so each output element
is the reduction of the one input element (x for Sum/Max, |x| for L1, x^2 for SumSquare, log x for
LogSum), which is what onnxruntime and onnx's reference compute.

Reductions over zero elements give the identity of the reduction (0 for sums, 1 for products,
-inf / the lowest integer for max, -inf for the log-sums), as the spec and its tests expect.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from engine_core.ir import Graph, Node
from engine_core.ops.elementwise import compute_dtype, exact_dtype, quiet
from engine_core.ops.registry import TensorInfo, normalize_axis, register_op, same_as_input
from engine_core.ops.tensor import attr_to_input, ints, normalize_axes

Axes = tuple[int, ...]
Kernel = Callable[[np.ndarray, Axes, bool], np.ndarray]


def reduced_axes(node: Node, rank: int, axes: np.ndarray | None) -> Axes:
    """The axes to reduce, sorted and in [0, rank) (none at all for noop_with_empty_axes)."""
    if axes is None or np.asarray(axes).size == 0:
        return () if node.attr("noop_with_empty_axes", 0) else tuple(range(rank))
    return tuple(sorted(normalize_axes(ints(axes), rank, node.op_type)))


def reduced_shape(shape: tuple[int, ...], axes: Axes, keepdims: bool) -> tuple[int, ...]:
    if keepdims:
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def _reduce_infer(node: Node, data: TensorInfo, axes: TensorInfo | None = None) -> TensorInfo:
    if data.shape is None or (axes is not None and axes.value is None):
        return TensorInfo(data.dtype, None)
    red = reduced_axes(node, len(data.shape), None if axes is None else axes.value)
    return TensorInfo(data.dtype, reduced_shape(data.shape, red, bool(node.attr("keepdims", 1))))


def _extreme(dtype: np.dtype, highest: bool) -> np.generic:
    """The identity of max (lowest value) or min (highest value) for ``dtype``."""
    if dtype.kind == "b":
        return np.bool_(highest)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return dtype.type(info.max if highest else info.min)
    return dtype.type(np.inf if highest else -np.inf)


def _count(x: np.ndarray, axes: Axes) -> int:
    """How many elements each output of a reduction over ``axes`` combines (0 gives NaN means,
    quietly, where np.mean would warn)."""
    return int(np.prod([x.shape[i] for i in axes], dtype=np.int64))


def _log_sum_exp(x: np.ndarray, axes: Axes, keepdims: bool) -> np.ndarray:
    """log(sum(exp(x))) shifted by the max so large inputs do not overflow; an empty or all -inf
    slice gives -inf, a +inf element gives +inf."""
    peak = np.max(x, axis=axes, keepdims=True, initial=-np.inf)
    shift = np.where(np.isfinite(peak), peak, 0.0)
    total = np.log(np.sum(np.exp(x - shift), axis=axes, keepdims=True)) + shift
    return total if keepdims else np.squeeze(total, axis=axes)


#: op -> (kernel over the working array, True when integers must be computed as floats).
_REDUCTIONS: dict[str, tuple[Kernel, bool]] = {
    "ReduceSum": (lambda x, a, k: np.sum(x, axis=a, keepdims=k, dtype=x.dtype), False),
    "ReduceProd": (lambda x, a, k: np.prod(x, axis=a, keepdims=k, dtype=x.dtype), False),
    "ReduceMax": (lambda x, a, k: np.max(x, axis=a, keepdims=k, initial=_extreme(x.dtype, False)), False),
    "ReduceMin": (lambda x, a, k: np.min(x, axis=a, keepdims=k, initial=_extreme(x.dtype, True)), False),
    "ReduceL1": (lambda x, a, k: np.sum(np.abs(x), axis=a, keepdims=k, dtype=x.dtype), False),
    "ReduceSumSquare": (lambda x, a, k: np.sum(x * x, axis=a, keepdims=k, dtype=x.dtype), False),
    "ReduceMean": (lambda x, a, k: np.sum(x, axis=a, keepdims=k) / _count(x, a), True),
    "ReduceL2": (lambda x, a, k: np.sqrt(np.sum(x * x, axis=a, keepdims=k)), True),
    "ReduceLogSum": (lambda x, a, k: np.log(np.sum(x, axis=a, keepdims=k)), True),
    "ReduceLogSumExp": (_log_sum_exp, True),
}


def _reduce_cpu(kernel: Kernel, via_float: bool) -> Callable[..., np.ndarray]:
    """Narrow floats run in float32; integers natively (exact, overflow wraps as in C) unless
    the reduction needs real numbers (mean, sqrt, log), then in float64, truncated back."""

    @quiet
    def cpu(node: Node, data: np.ndarray, axes: np.ndarray | None = None) -> np.ndarray:
        red = reduced_axes(node, data.ndim, axes)
        work = data.astype(compute_dtype(data.dtype) if via_float else exact_dtype(data.dtype), copy=False)
        return np.asarray(kernel(work, red, bool(node.attr("keepdims", 1)))).astype(data.dtype, copy=False)

    return cpu


def _axes_to_input(since: int) -> Callable[[Node, Graph], None]:
    """Normalize rule: before opset ``since``, ``axes`` was an attribute."""

    def normalize(node: Node, graph: Graph) -> None:
        if node.opset < since:
            attr_to_input(node, graph, "axes", 1)

    return normalize


for _name, (_kernel, _via_float) in _REDUCTIONS.items():
    register_op(_name, infer=_reduce_infer, cpu=_reduce_cpu(_kernel, _via_float),
                normalize=_axes_to_input(13 if _name == "ReduceSum" else 18))


# -- ArgMax / ArgMin ---------------------------------------------------------------------------------


def _arg_infer(node: Node, data: TensorInfo) -> TensorInfo:
    if data.shape is None:
        return TensorInfo(np.int64, None)
    axis = normalize_axis(node.attr("axis", 0), len(data.shape))
    return TensorInfo(np.int64, reduced_shape(data.shape, (axis,), bool(node.attr("keepdims", 1))))


def _arg_cpu(fn: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
    """numpy returns the first extreme index; select_last_index searches the flipped axis."""

    def cpu(node: Node, data: np.ndarray) -> np.ndarray:
        axis = normalize_axis(node.attr("axis", 0), data.ndim)
        values = data.astype(exact_dtype(data.dtype), copy=False)
        if node.attr("select_last_index", 0):
            index = data.shape[axis] - 1 - fn(np.flip(values, axis), axis=axis)
        else:
            index = fn(values, axis=axis)
        if node.attr("keepdims", 1):
            index = np.expand_dims(index, axis)
        return np.asarray(index, dtype=np.int64)

    return cpu


register_op("ArgMax", infer=_arg_infer, cpu=_arg_cpu(np.argmax))
register_op("ArgMin", infer=_arg_infer, cpu=_arg_cpu(np.argmin))


# -- CumSum / CumProd ------------------------------------------------------------------------------


def _scan_cpu(scan: Callable[..., np.ndarray], identity: int) -> Callable[..., np.ndarray]:
    """Inclusive scan along ``axis`` (a scalar input); ``reverse`` scans from the end and
    ``exclusive`` shifts the result by one, starting from the identity."""

    @quiet
    def cpu(node: Node, x: np.ndarray, axis: np.ndarray) -> np.ndarray:
        ax = normalize_axis(ints(axis)[0], x.ndim)
        work = x.astype(exact_dtype(x.dtype), copy=False)
        if node.attr("reverse", 0):
            work = np.flip(work, ax)
        out = scan(work, axis=ax, dtype=work.dtype)
        if node.attr("exclusive", 0):
            first = [slice(None)] * x.ndim
            first[ax] = slice(0, 1)
            rest = [slice(None)] * x.ndim
            rest[ax] = slice(0, -1)
            out = np.concatenate([np.full_like(out[tuple(first)], identity), out[tuple(rest)]], axis=ax)
        if node.attr("reverse", 0):
            out = np.flip(out, ax)
        return np.ascontiguousarray(out).astype(x.dtype, copy=False)

    return cpu


register_op("CumSum", infer=same_as_input(), cpu=_scan_cpu(np.cumsum, 0), min_opset=11)
register_op("CumProd", infer=same_as_input(), cpu=_scan_cpu(np.cumprod, 1), min_opset=26)
