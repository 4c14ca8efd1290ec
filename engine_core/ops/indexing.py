"""Indexing ops: Gather*, Scatter*, TensorScatter, Compress, NonZero, Unique, TopK, OneHot.

Index tensors may hold negative indices (counted from the end of their axis); anything outside
``[-dim, dim)`` is an error, never a silent wrap. Outputs whose size depends on data (NonZero,
Unique, Compress) have ``shape=None`` at build time unless the deciding values are known.
"""

from __future__ import annotations

import math

import numpy as np

from engine_core.ir import Graph, Node
from engine_core.ops.registry import ShapeInferenceError, TensorInfo, normalize_axis, register_op
from engine_core.ops.tensor import attr_to_input, ints

Shape = tuple[int, ...]


def wrap_indices(indices: np.ndarray, dims: int | np.ndarray, op: str) -> np.ndarray:
    """Indices as int64 in [0, dim): negatives count from the end; out-of-range ones raise."""
    idx = np.asarray(indices).astype(np.int64, copy=False)
    dims = np.asarray(dims, dtype=np.int64)
    outside = (idx < -dims) | (idx >= dims)
    if outside.any():
        bad = idx[outside][:4].tolist()
        raise ShapeInferenceError(f"{op} indices {bad} are out of range for dims {dims.tolist()}")
    return np.where(idx < 0, idx + dims, idx)


# -- Gather / GatherElements / GatherND -------------------------------------------------------------


def _gather_infer(node: Node, x: TensorInfo, indices: TensorInfo) -> TensorInfo:
    if x.shape is None or indices.shape is None:
        return TensorInfo(x.dtype, None)
    axis = normalize_axis(node.attr("axis", 0), len(x.shape))
    return TensorInfo(x.dtype, (*x.shape[:axis], *indices.shape, *x.shape[axis + 1:]))


def _gather_cpu(node: Node, x: np.ndarray, indices: np.ndarray) -> np.ndarray:
    axis = normalize_axis(node.attr("axis", 0), x.ndim)
    return np.take(x, wrap_indices(indices, x.shape[axis], "Gather"), axis=axis)


register_op("Gather", infer=_gather_infer, cpu=_gather_cpu)


def element_index(indices: np.ndarray, axis: int, dim: int, op: str) -> tuple[np.ndarray, ...]:
    """Full index for GatherElements/ScatterElements: ``indices`` on ``axis``, the position itself on
    every other axis (open grids, so index tensors smaller than the data work)."""
    grid = list(np.ogrid[tuple(slice(n) for n in indices.shape)])
    grid[axis] = wrap_indices(indices, dim, op)
    return tuple(grid)


def _same_rank(x: TensorInfo, indices: TensorInfo, op: str) -> None:
    if x.shape is not None and indices.shape is not None and len(x.shape) != len(indices.shape):
        raise ShapeInferenceError(f"{op} data {x.shape} and indices {indices.shape} differ in rank")


def _gather_elements_infer(node: Node, x: TensorInfo, indices: TensorInfo) -> TensorInfo:
    _same_rank(x, indices, "GatherElements")
    return TensorInfo(x.dtype, indices.shape)


def _gather_elements_cpu(node: Node, x: np.ndarray, indices: np.ndarray) -> np.ndarray:
    axis = normalize_axis(node.attr("axis", 0), x.ndim)
    return x[element_index(indices, axis, x.shape[axis], "GatherElements")]


register_op("GatherElements", infer=_gather_elements_infer, cpu=_gather_elements_cpu, min_opset=11)


def _gather_nd_shape(node: Node, data: Shape, indices: Shape) -> Shape:
    b = node.attr("batch_dims", 0)
    if not indices or indices[-1] > len(data) - b or data[:b] != indices[:b]:
        raise ShapeInferenceError(f"GatherND indices {indices} do not index data {data} with batch_dims={b}")
    return (*indices[:-1], *data[b + indices[-1]:])


def _gather_nd_infer(node: Node, x: TensorInfo, indices: TensorInfo) -> TensorInfo:
    if x.shape is None or indices.shape is None:
        return TensorInfo(x.dtype, None)
    return TensorInfo(x.dtype, _gather_nd_shape(node, x.shape, indices.shape))


def _gather_nd_cpu(node: Node, x: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """Batch dims fold into one leading axis; the k index columns become one fancy index."""
    out_shape = _gather_nd_shape(node, x.shape, indices.shape)
    b, k = node.attr("batch_dims", 0), indices.shape[-1]
    batch = math.prod(x.shape[:b])
    data = x.reshape((batch, *x.shape[b:]))
    rows = math.prod(indices.shape[b:-1])
    idx = wrap_indices(indices, x.shape[b:b + k], "GatherND").reshape(batch, rows, k)
    picked = data[(np.arange(batch)[:, None], *(idx[..., i] for i in range(k)))]
    return picked.reshape(out_shape)


register_op("GatherND", infer=_gather_nd_infer, cpu=_gather_nd_cpu, min_opset=11)


# -- Scatter / ScatterElements / ScatterND / TensorScatter -------------------------------------------

#: ONNX reduction attribute -> the ufunc whose ``.at`` applies duplicates one after another.
_REDUCTIONS = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}


def _scatter_into(node: Node, data: np.ndarray, index: tuple[np.ndarray, ...], updates: np.ndarray) -> np.ndarray:
    reduction = node.attr("reduction", "none")
    out = data.copy()
    if reduction == "none":
        out[index] = updates
    elif reduction in _REDUCTIONS:
        _REDUCTIONS[reduction].at(out, index, updates)
    else:
        raise ShapeInferenceError(f"{node.op_type} reduction '{reduction}' is not none/add/mul/max/min")
    return out


def _scatter_elements_infer(node: Node, x: TensorInfo, indices: TensorInfo, updates: TensorInfo) -> TensorInfo:
    _same_rank(x, indices, node.op_type)
    if indices.shape is not None and updates.shape is not None and indices.shape != updates.shape:
        raise ShapeInferenceError(f"{node.op_type} indices {indices.shape} and updates {updates.shape} differ")
    return TensorInfo(x.dtype, x.shape)


def _scatter_elements_cpu(node: Node, x: np.ndarray, indices: np.ndarray, updates: np.ndarray) -> np.ndarray:
    axis = normalize_axis(node.attr("axis", 0), x.ndim)
    return _scatter_into(node, x, element_index(indices, axis, x.shape[axis], node.op_type), updates)


register_op("ScatterElements", infer=_scatter_elements_infer, cpu=_scatter_elements_cpu, min_opset=11)
# Scatter (opsets 9-10, deprecated) is ScatterElements without reductions.
register_op("Scatter", infer=_scatter_elements_infer, cpu=_scatter_elements_cpu, min_opset=9)


def _scatter_nd_infer(node: Node, x: TensorInfo, indices: TensorInfo, updates: TensorInfo) -> TensorInfo:
    if x.shape is not None and indices.shape is not None and updates.shape is not None:
        k = indices.shape[-1] if indices.shape else len(x.shape) + 1
        expected = (*indices.shape[:-1], *x.shape[k:])
        if k > len(x.shape) or updates.shape != expected:
            raise ShapeInferenceError(f"ScatterND updates {updates.shape} must have shape {expected} "
                                      f"for data {x.shape} and indices {indices.shape}")
    return TensorInfo(x.dtype, x.shape)


def _scatter_nd_cpu(node: Node, x: np.ndarray, indices: np.ndarray, updates: np.ndarray) -> np.ndarray:
    k = indices.shape[-1]
    idx = wrap_indices(indices, x.shape[:k], "ScatterND")
    return _scatter_into(node, x, tuple(idx[..., i] for i in range(k)), updates)


register_op("ScatterND", infer=_scatter_nd_infer, cpu=_scatter_nd_cpu, min_opset=11)


def _tensor_scatter_axis(node: Node, cache: Shape, update: Shape) -> int:
    axis = normalize_axis(node.attr("axis", -2), len(cache))
    if axis == 0 or len(update) != len(cache) or update[axis] > cache[axis] or any(
        u != c for i, (u, c) in enumerate(zip(update, cache)) if i != axis
    ):
        raise ShapeInferenceError(f"TensorScatter update {update} does not fit cache {cache} on axis {axis}")
    if node.attr("mode", "linear") not in ("linear", "circular"):
        raise ShapeInferenceError(f"TensorScatter mode '{node.attr('mode')}' is not linear or circular")
    return axis


def _tensor_scatter_infer(node: Node, cache: TensorInfo, update: TensorInfo,
                          write_indices: TensorInfo | None = None) -> TensorInfo:
    if cache.shape is not None and update.shape is not None:
        _tensor_scatter_axis(node, cache.shape, update.shape)
    return TensorInfo(cache.dtype, cache.shape)


def _tensor_scatter_cpu(node: Node, cache: np.ndarray, update: np.ndarray,
                        write_indices: np.ndarray | None = None) -> np.ndarray:
    """Batch b's update rows land at write_indices[b] + t (mod the cache length when circular)."""
    axis = _tensor_scatter_axis(node, cache.shape, update.shape)
    batch, length, capacity = cache.shape[0], update.shape[axis], cache.shape[axis]
    start = np.zeros(batch, np.int64) if write_indices is None else np.asarray(write_indices, np.int64)
    rows = start.reshape(-1, 1) + np.arange(length)  # (batch, length)
    if node.attr("mode", "linear") == "circular":
        rows %= max(capacity, 1)
    elif rows.size and (rows.max() >= capacity or rows.min() < 0):
        raise ShapeInferenceError(f"TensorScatter write indices {start.tolist()} + {length} overflow {capacity}")
    shape = [1] * cache.ndim
    shape[0], shape[axis] = batch, length
    out = cache.copy()
    np.put_along_axis(out, np.broadcast_to(rows.reshape(shape), update.shape), update, axis=axis)
    return out


register_op("TensorScatter", infer=_tensor_scatter_infer, cpu=_tensor_scatter_cpu, min_opset=24)


# -- data-dependent sizes: Compress / NonZero / Unique ----------------------------------------------------


def _compress_axis(node: Node, rank: int) -> int | None:
    axis = node.attr("axis")
    return None if axis is None else normalize_axis(axis, rank)


def _compress_cpu(node: Node, x: np.ndarray, condition: np.ndarray) -> np.ndarray:
    axis = _compress_axis(node, x.ndim)
    dim = x.size if axis is None else x.shape[axis]
    keep = np.asarray(condition).astype(bool).reshape(-1)
    if keep[dim:].any():
        raise ShapeInferenceError(f"Compress condition selects index >= {dim}, the size of the axis")
    return np.compress(keep[:dim], x, axis=axis)


def _compress_infer(node: Node, x: TensorInfo, condition: TensorInfo) -> TensorInfo:
    if x.shape is None or condition.value is None:
        return TensorInfo(x.dtype, None)
    axis = _compress_axis(node, len(x.shape))
    dim = math.prod(x.shape) if axis is None else x.shape[axis]
    count = int(np.count_nonzero(np.asarray(condition.value).reshape(-1)[:dim]))
    return TensorInfo(x.dtype, (count,) if axis is None else (*x.shape[:axis], count, *x.shape[axis + 1:]))


register_op("Compress", infer=_compress_infer, cpu=_compress_cpu, min_opset=9)


def _nonzero_cpu(node: Node, x: np.ndarray) -> np.ndarray:
    """(rank, count) int64 coordinates; a scalar is treated as a 1-element vector."""
    return np.array(np.nonzero(x.reshape(-1) if x.ndim == 0 else x), dtype=np.int64).reshape(max(x.ndim, 1), -1)


def _nonzero_infer(node: Node, x: TensorInfo) -> TensorInfo:
    """The count of non-zeros is data: known only with the value (small, so just compute it)."""
    return TensorInfo.of(_nonzero_cpu(node, x.value)) if x.value is not None else TensorInfo(np.int64, None)


register_op("NonZero", infer=_nonzero_infer, cpu=_nonzero_cpu, min_opset=9)


def _unique_cpu(node: Node, x: np.ndarray) -> list[np.ndarray]:
    """np.unique, reordered by first occurrence when ``sorted`` is 0."""
    axis = node.attr("axis")
    if axis is not None:
        axis = normalize_axis(axis, x.ndim)
    y, first, inverse, counts = np.unique(x, return_index=True, return_inverse=True, return_counts=True, axis=axis)
    inverse = inverse.reshape(-1)
    if not node.attr("sorted", 1):
        order = np.argsort(first, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        y = np.take(y, order, axis=0 if axis is None else axis)
        first, counts, inverse = first[order], counts[order], rank[inverse]
    outputs = [y, first.astype(np.int64), inverse.astype(np.int64), counts.astype(np.int64)]
    return outputs[:max(len(node.outputs), 1)]


def _unique_infer(node: Node, x: TensorInfo) -> list[TensorInfo]:
    """Sizes are data: known only with the value (small, so just compute it)."""
    if x.value is not None:
        return [TensorInfo.of(v) for v in _unique_cpu(node, x.value)]
    infos = [TensorInfo(x.dtype, None)] + [TensorInfo(np.int64, None) for _ in range(3)]
    if x.shape is not None:  # inverse_indices: one per element (or per slice along axis)
        axis = node.attr("axis")
        per = math.prod(x.shape) if axis is None else x.shape[normalize_axis(axis, len(x.shape))]
        infos[2] = TensorInfo(np.int64, (per,))
    return infos[:max(len(node.outputs), 1)]


register_op("Unique", infer=_unique_infer, cpu=_unique_cpu, min_opset=11)


# -- TopK / OneHot --------------------------------------------------------------------------------------


def _topk_k(shape: Shape, axis: int, k: np.ndarray) -> int:
    count = ints(k)
    if len(count) != 1 or not 0 <= count[0] <= shape[axis]:
        raise ShapeInferenceError(f"TopK k={count} is not one value in [0, {shape[axis]}] for shape {shape}")
    return count[0]


def _topk_infer(node: Node, x: TensorInfo, k: TensorInfo) -> list[TensorInfo]:
    if x.shape is None or k.value is None:
        return [TensorInfo(x.dtype, None), TensorInfo(np.int64, None)]
    axis = normalize_axis(node.attr("axis", -1), len(x.shape))
    shape = (*x.shape[:axis], _topk_k(x.shape, axis, k.value), *x.shape[axis + 1:])
    return [TensorInfo(x.dtype, shape), TensorInfo(np.int64, shape)]


def _topk_cpu(node: Node, x: np.ndarray, k: np.ndarray) -> list[np.ndarray]:
    """A stable sort, so equal values keep ascending index order as the spec requires. For the
    largest, sort the reversed axis ascending and read it backwards (NaN counts as largest)."""
    axis = normalize_axis(node.attr("axis", -1), x.ndim)
    count, n = _topk_k(x.shape, axis, k), x.shape[axis]
    if node.attr("largest", 1):
        reversed_order = np.argsort(np.flip(x, axis), axis=axis, kind="stable")
        order = (n - 1) - np.flip(reversed_order, axis)
    else:
        order = np.argsort(x, axis=axis, kind="stable")
    indices = np.take(order, np.arange(count), axis=axis).astype(np.int64)
    return [np.take_along_axis(x, indices, axis=axis), indices]


def _topk_normalize(node: Node, graph: Graph) -> None:
    """Opsets < 10 carried ``k`` as an attribute; make it input 1 (a 1-element int64 tensor)."""
    if "k" in node.attrs:
        node.attrs["k"] = [node.attrs["k"]]
    attr_to_input(node, graph, "k", 1)


register_op("TopK", infer=_topk_infer, cpu=_topk_cpu, normalize=_topk_normalize)


def _onehot_depth(depth: np.ndarray) -> int:
    value = np.asarray(depth).reshape(-1)
    if value.size != 1 or int(value[0]) < 1:
        raise ShapeInferenceError(f"OneHot depth {value.tolist()} must be one positive value")
    return int(value[0])


def _onehot_axis(node: Node, rank: int) -> int:
    return normalize_axis(node.attr("axis", -1), rank + 1)


def _onehot_infer(node: Node, indices: TensorInfo, depth: TensorInfo, values: TensorInfo) -> TensorInfo:
    if indices.shape is None or depth.value is None:
        return TensorInfo(values.dtype, None)
    axis = _onehot_axis(node, len(indices.shape))
    return TensorInfo(values.dtype, (*indices.shape[:axis], _onehot_depth(depth.value), *indices.shape[axis:]))


def _onehot_cpu(node: Node, indices: np.ndarray, depth: np.ndarray, values: np.ndarray) -> np.ndarray:
    """on where the (wrapped) index equals the position on the new axis; out-of-range rows stay off."""
    n = _onehot_depth(depth)
    axis = _onehot_axis(node, indices.ndim)
    idx = np.asarray(indices).astype(np.int64)
    idx = np.expand_dims(np.where(idx < 0, idx + n, idx), axis)
    positions = np.arange(n).reshape((n,) + (1,) * (indices.ndim - axis))
    off, on = np.asarray(values).reshape(-1)[:2]
    return np.where(idx == positions, on, off).astype(values.dtype)


register_op("OneHot", infer=_onehot_infer, cpu=_onehot_cpu, min_opset=9)
