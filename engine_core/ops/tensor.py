"""Shape and data-movement ops: Reshape, Shape, Transpose, Concat, Split, Slice, Pad, Tile, ...

Ops whose output shape depends on the *value* of an input (Reshape's target, Slice's starts, Pad's
pads, ...) read that value from ``TensorInfo.value`` at build time and report ``shape=None`` only
when it is not known. Older opsets that carried those values as attributes are normalized at import
into constant inputs, so each op has one canonical form.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import ml_dtypes
import numpy as np

from engine_core.ir import Graph, Node
from engine_core.ops.registry import (
    ShapeInferenceError,
    TensorInfo,
    broadcast_shapes,
    normalize_axis,
    register_op,
)
from engine_core.types import onnx_to_np

Shape = tuple[int, ...]


# -- helpers shared by the ops here and in indexing.py --------------------------------------------


def known(info: TensorInfo | None) -> np.ndarray | None:
    """The build-time value of an input, or None when it is absent or not known."""
    return None if info is None else info.value


def ints(value: np.ndarray | Sequence[int]) -> list[int]:
    """A shape-carrying tensor as Python ints (Python ints never overflow while clamping)."""
    return [int(v) for v in np.asarray(value).reshape(-1)]


def attr_to_input(node: Node, graph: Graph, attr: str, position: int, dtype: type = np.int64) -> None:
    """Move attribute ``attr`` (the form of older opsets) into input ``position`` as a constant."""
    if attr not in node.attrs:
        return
    value = np.array(node.attrs.pop(attr), dtype=dtype)
    while len(node.inputs) <= position:
        node.inputs.append("")
    node.inputs[position] = graph.add_constant(f"{node.name}_{attr}", value)


def normalize_axes(axes: Sequence[int], rank: int, op: str) -> list[int]:
    """Axes mapped into [0, rank); repeated axes are an error in every op that takes a list."""
    result = [normalize_axis(int(a), rank) for a in axes]
    if len(set(result)) != len(result):
        raise ShapeInferenceError(f"{op} axes {list(axes)} repeat an axis")
    return result


# -- Reshape / Shape / Size / Identity ------------------------------------------------------------


def reshape_target(shape_in: Shape, target: np.ndarray, allowzero: int) -> Shape:
    """Resolve ONNX Reshape's target (0 = copy dim unless allowzero, -1 = infer)."""
    dims = ints(target)
    if not allowzero:
        if any(d == 0 and i >= len(shape_in) for i, d in enumerate(dims)):
            raise ShapeInferenceError(f"Reshape target {dims} copies a dim that input {shape_in} lacks")
        dims = [shape_in[i] if d == 0 else d for i, d in enumerate(dims)]
    if dims.count(-1) > 1 or any(d < -1 for d in dims):
        raise ShapeInferenceError(f"Reshape target {dims} is invalid (at most one -1, no other negatives)")
    total = math.prod(shape_in)
    if -1 in dims:
        known_part = math.prod(d for d in dims if d != -1)
        if known_part == 0 or total % known_part:
            raise ShapeInferenceError(f"cannot reshape {shape_in} to {dims}")
        dims[dims.index(-1)] = total // known_part
    if math.prod(dims) != total:
        raise ShapeInferenceError(f"cannot reshape {shape_in} ({total} elements) to {dims}")
    return tuple(dims)


def _reshape_infer(node: Node, x: TensorInfo, shape: TensorInfo) -> TensorInfo:
    if x.shape is None or shape.value is None:
        return TensorInfo(x.dtype, None)
    return TensorInfo(x.dtype, reshape_target(x.shape, shape.value, node.attr("allowzero", 0)))


def _reshape_cpu(node: Node, x: np.ndarray, shape: np.ndarray) -> np.ndarray:
    return x.reshape(reshape_target(x.shape, shape, node.attr("allowzero", 0)))


def _reshape_normalize(node: Node, graph: Graph) -> None:
    """Opset < 5 carried the target shape as an attribute; make it an input."""
    attr_to_input(node, graph, "shape", 1)


register_op("Reshape", infer=_reshape_infer, cpu=_reshape_cpu, normalize=_reshape_normalize)


def _shape_of(node: Node, shape: Shape) -> np.ndarray:
    """Shape's output: dims start..end (clamped like Python slicing, which the spec mirrors)."""
    return np.array(shape[slice(node.attr("start", 0), node.attr("end", None))], dtype=np.int64)


def _shape_infer(node: Node, x: TensorInfo) -> TensorInfo:
    if x.shape is None:
        return TensorInfo(np.int64, None)
    return TensorInfo.of(_shape_of(node, x.shape))


register_op("Shape", infer=_shape_infer, cpu=lambda node, x: _shape_of(node, x.shape))


def _size_infer(node: Node, x: TensorInfo) -> TensorInfo:
    if x.shape is None:
        return TensorInfo(np.int64, ())
    return TensorInfo.of(np.array(math.prod(x.shape), dtype=np.int64))


register_op("Size", infer=_size_infer, cpu=lambda node, x: np.array(np.size(x), dtype=np.int64))


def _identity_infer(node: Node, x: TensorInfo) -> TensorInfo:
    """Tensors keep dtype and shape; sequences and optionals pass through with their info."""
    return TensorInfo(x.dtype, x.shape, x.value)


# Wrapped in a list: a sequence input is itself a list, which the backend would read as many outputs.
register_op("Identity", infer=_identity_infer, cpu=lambda node, x: [x])


# -- Transpose / Concat / Split -------------------------------------------------------------------


def _perm(node: Node, rank: int) -> list[int]:
    perm = node.attr("perm")
    if perm is None:
        return list(range(rank))[::-1]
    if sorted(perm) != list(range(rank)):
        raise ShapeInferenceError(f"Transpose perm {perm} is not a permutation of {rank} axes")
    return list(perm)


def _transpose_infer(node: Node, x: TensorInfo) -> TensorInfo:
    if x.shape is None:
        return TensorInfo(x.dtype, None)
    return TensorInfo(x.dtype, tuple(x.shape[p] for p in _perm(node, len(x.shape))))


register_op("Transpose", infer=_transpose_infer, cpu=lambda node, x: np.transpose(x, _perm(node, x.ndim)))


def _concat_infer(node: Node, *xs: TensorInfo) -> TensorInfo:
    dtype = xs[0].dtype
    if any(x.dtype != dtype for x in xs):
        raise ShapeInferenceError(f"Concat inputs differ in dtype: {[str(x.dtype) for x in xs]}")
    if any(x.shape is None for x in xs):
        return TensorInfo(dtype, None)
    rank = len(xs[0].shape)
    if rank == 0 or any(len(x.shape) != rank for x in xs):
        raise ShapeInferenceError(f"Concat inputs need one rank >= 1, got {[x.shape for x in xs]}")
    axis = normalize_axis(node.attr("axis", 0), rank)
    rest = {x.shape[:axis] + x.shape[axis + 1:] for x in xs}
    if len(rest) > 1:
        raise ShapeInferenceError(f"Concat inputs {[x.shape for x in xs]} differ outside axis {axis}")
    out = list(xs[0].shape)
    out[axis] = sum(x.shape[axis] for x in xs)
    return TensorInfo(dtype, tuple(out))


def _concat_cpu(node: Node, *xs: np.ndarray) -> np.ndarray:
    return np.concatenate(xs, axis=node.attr("axis", 0))


register_op("Concat", infer=_concat_infer, cpu=_concat_cpu)


def split_sizes(node: Node, dim: int, split: np.ndarray | None) -> list[int]:
    """Chunk sizes along the split axis: given sizes, or equal parts (the last smaller, opset 18)."""
    count = node.attr("num_outputs", len(node.outputs))
    if split is not None and split.size:
        sizes = ints(split)
        if len(sizes) != len(node.outputs) or sum(sizes) != dim or min(sizes, default=0) < 0:
            raise ShapeInferenceError(f"Split sizes {sizes} do not cut a dim of {dim} into {len(node.outputs)}")
        return sizes
    if count != len(node.outputs) or count < 1:
        raise ShapeInferenceError(f"Split num_outputs={count} but the node has {len(node.outputs)} outputs")
    if dim % count and node.opset < 18:
        raise ShapeInferenceError(f"Split cannot cut a dim of {dim} into {count} equal parts")
    chunk = -(-dim // count)
    return [max(0, min(chunk, dim - i * chunk)) for i in range(count)]


def _split_infer(node: Node, x: TensorInfo, split: TensorInfo | None = None) -> list[TensorInfo]:
    if x.shape is None or (split is not None and split.value is None):
        return [TensorInfo(x.dtype, None) for _ in node.outputs]
    axis = normalize_axis(node.attr("axis", 0), len(x.shape))
    sizes = split_sizes(node, x.shape[axis], known(split))
    return [TensorInfo(x.dtype, (*x.shape[:axis], s, *x.shape[axis + 1:])) for s in sizes]


def _split_cpu(node: Node, x: np.ndarray, split: np.ndarray | None = None) -> list[np.ndarray]:
    axis = normalize_axis(node.attr("axis", 0), x.ndim)
    sizes = split_sizes(node, x.shape[axis], split)
    return np.split(x, np.cumsum(sizes)[:-1], axis=axis)


def _split_normalize(node: Node, graph: Graph) -> None:
    """Opsets 2-12 carried the sizes as the ``split`` attribute; make them input 1."""
    attr_to_input(node, graph, "split", 1)


register_op("Split", infer=_split_infer, cpu=_split_cpu, normalize=_split_normalize)


# -- Slice ------------------------------------------------------------------------------------------


def clamped_slice(dim: int, start: int, end: int, step: int) -> slice:
    """One axis of ONNX Slice: negatives count from the end, then start clamps to [0, dim] ([0, dim-1]
    when stepping back) and end to [0, dim] ([-1, dim-1] back, -1 meaning "through index 0").
    Python slicing differs in one place: it empties a backward slice whose start is below 0."""
    start = start + dim if start < 0 else start
    end = end + dim if end < 0 else end
    if step > 0:
        return slice(min(max(start, 0), dim), min(max(end, 0), dim), step)
    end = min(max(end, -1), dim - 1)
    return slice(min(max(start, 0), dim - 1), None if end < 0 else end, step)


def slice_index(
    shape: Shape, starts: np.ndarray, ends: np.ndarray, axes: np.ndarray | None, steps: np.ndarray | None
) -> tuple[slice, ...]:
    """ONNX Slice as one numpy index (basic slicing: a view, no copy)."""
    rank = len(shape)
    starts_, ends_ = ints(starts), ints(ends)
    axes_ = ints(axes) if axes is not None else list(range(len(starts_)))
    steps_ = ints(steps) if steps is not None else [1] * len(starts_)
    if not len(starts_) == len(ends_) == len(axes_) == len(steps_):
        raise ShapeInferenceError(f"Slice starts/ends/axes/steps differ in length: {starts_}, {ends_}, {axes_}, {steps_}")
    if 0 in steps_:
        raise ShapeInferenceError("Slice steps must not be 0")
    index = [slice(None)] * rank
    for axis, start, end, step in zip(normalize_axes(axes_, rank, "Slice"), starts_, ends_, steps_):
        index[axis] = clamped_slice(shape[axis], start, end, step)
    return tuple(index)


def _slice_infer(node: Node, x: TensorInfo, starts: TensorInfo, ends: TensorInfo,
                 axes: TensorInfo | None = None, steps: TensorInfo | None = None) -> TensorInfo:
    args = (starts, ends, axes, steps)
    if x.shape is None or any(a is not None and a.value is None for a in args):
        return TensorInfo(x.dtype, None)
    index = slice_index(x.shape, starts.value, ends.value, known(axes), known(steps))
    return TensorInfo(x.dtype, tuple(len(range(*s.indices(d))) for s, d in zip(index, x.shape)))


def _slice_cpu(node: Node, x: np.ndarray, starts: np.ndarray, ends: np.ndarray,
               axes: np.ndarray | None = None, steps: np.ndarray | None = None) -> np.ndarray:
    return x[slice_index(x.shape, starts, ends, axes, steps)]


def _slice_normalize(node: Node, graph: Graph) -> None:
    """Opsets < 10 carried starts/ends/axes as attributes; make them inputs 1-3."""
    for position, attr in enumerate(("starts", "ends", "axes"), start=1):
        attr_to_input(node, graph, attr, position)


register_op("Slice", infer=_slice_infer, cpu=_slice_cpu, normalize=_slice_normalize)


# -- Squeeze / Unsqueeze / Flatten ------------------------------------------------------------------


def squeeze_shape(shape: Shape, axes: np.ndarray | None) -> Shape:
    """Drop the listed axes (each must have size 1), or every size-1 axis when none are given."""
    if axes is None:
        return tuple(d for d in shape if d != 1)
    drop = normalize_axes(ints(axes), len(shape), "Squeeze")
    bad = [a for a in drop if shape[a] != 1]
    if bad:
        raise ShapeInferenceError(f"Squeeze axes {bad} of shape {shape} do not have size 1")
    return tuple(d for i, d in enumerate(shape) if i not in drop)


def unsqueeze_shape(shape: Shape, axes: np.ndarray) -> Shape:
    """Insert size-1 axes at the listed positions of the output (any order, negative allowed)."""
    rank = len(shape) + len(ints(axes))
    new = set(normalize_axes(ints(axes), rank, "Unsqueeze"))
    dims = iter(shape)
    return tuple(1 if i in new else next(dims) for i in range(rank))


def _axes_reshape_infer(shape_fn):
    def infer(node: Node, x: TensorInfo, axes: TensorInfo | None = None) -> TensorInfo:
        if x.shape is None or (axes is not None and axes.value is None):
            return TensorInfo(x.dtype, None)
        return TensorInfo(x.dtype, shape_fn(x.shape, known(axes)))

    return infer


def _axes_normalize(node: Node, graph: Graph) -> None:
    """Opsets < 13 carried ``axes`` as an attribute; make it input 1."""
    attr_to_input(node, graph, "axes", 1)


register_op(
    "Squeeze",
    infer=_axes_reshape_infer(squeeze_shape),
    cpu=lambda node, x, axes=None: x.reshape(squeeze_shape(x.shape, axes)),
    normalize=_axes_normalize,
)
register_op(
    "Unsqueeze",
    infer=_axes_reshape_infer(unsqueeze_shape),
    cpu=lambda node, x, axes: x.reshape(unsqueeze_shape(x.shape, axes)),
    normalize=_axes_normalize,
)


def flatten_shape(node: Node, shape: Shape) -> Shape:
    """2-D (prod(dims before axis), prod(dims from axis)); axis may equal the rank."""
    rank = len(shape)
    axis = node.attr("axis", 1)
    if not -rank <= axis <= rank:
        raise ShapeInferenceError(f"Flatten axis {axis} is out of range for rank {rank}")
    axis = axis + rank if axis < 0 else axis
    return math.prod(shape[:axis]), math.prod(shape[axis:])


register_op(
    "Flatten",
    infer=lambda node, x: TensorInfo(x.dtype, None if x.shape is None else flatten_shape(node, x.shape)),
    cpu=lambda node, x: x.reshape(flatten_shape(node, x.shape)),
)


# -- Expand / Tile ----------------------------------------------------------------------------------


def _expand_infer(node: Node, x: TensorInfo, shape: TensorInfo) -> TensorInfo:
    if x.shape is None or shape.value is None:
        return TensorInfo(x.dtype, None)
    return TensorInfo(x.dtype, broadcast_shapes(x.shape, tuple(ints(shape.value))))


def _expand_cpu(node: Node, x: np.ndarray, shape: np.ndarray) -> np.ndarray:
    """A materialized copy: broadcast views are read-only and later layers may write."""
    return np.array(np.broadcast_to(x, broadcast_shapes(x.shape, tuple(ints(shape)))))


register_op("Expand", infer=_expand_infer, cpu=_expand_cpu, min_opset=8)


def _tile_repeats(shape: Shape, repeats: np.ndarray) -> list[int]:
    reps = ints(repeats)
    if len(reps) != len(shape) or min(reps, default=0) < 0:
        raise ShapeInferenceError(f"Tile repeats {reps} must be {len(shape)} non-negative values")
    return reps


def _tile_infer(node: Node, x: TensorInfo, repeats: TensorInfo) -> TensorInfo:
    if x.shape is None or repeats.value is None:
        return TensorInfo(x.dtype, None)
    reps = _tile_repeats(x.shape, repeats.value)
    return TensorInfo(x.dtype, tuple(d * r for d, r in zip(x.shape, reps)))


register_op(
    "Tile",
    infer=_tile_infer,
    cpu=lambda node, x, repeats: np.tile(x, _tile_repeats(x.shape, repeats)),
)


# -- Pad / CenterCropPad ----------------------------------------------------------------------------


def pad_widths(shape: Shape, pads: np.ndarray, axes: np.ndarray | None) -> list[tuple[int, int]]:
    """(begin, end) per dim from ONNX's [x1_begin, x2_begin, ..., x1_end, x2_end, ...] layout."""
    rank = len(shape)
    axes_ = normalize_axes(ints(axes), rank, "Pad") if axes is not None else list(range(rank))
    p = ints(pads)
    if len(p) != 2 * len(axes_):
        raise ShapeInferenceError(f"Pad pads {p} must hold 2 values per padded axis ({len(axes_)} axes)")
    widths = [(0, 0)] * rank
    for i, axis in enumerate(axes_):
        widths[axis] = (p[i], p[i + len(axes_)])
    for d, (b, e) in zip(shape, widths):
        if d + b + e < 0:
            raise ShapeInferenceError(f"Pad pads {p} crop more than shape {shape} holds")
    return widths


def _pad_infer(node: Node, x: TensorInfo, pads: TensorInfo, value: TensorInfo | None = None,
               axes: TensorInfo | None = None) -> TensorInfo:
    if x.shape is None or pads.value is None or (axes is not None and axes.value is None):
        return TensorInfo(x.dtype, None)
    widths = pad_widths(x.shape, pads.value, known(axes))
    return TensorInfo(x.dtype, tuple(d + b + e for d, (b, e) in zip(x.shape, widths)))


def _pad_cpu(node: Node, x: np.ndarray, pads: np.ndarray, value: np.ndarray | None = None,
             axes: np.ndarray | None = None) -> np.ndarray:
    """Negative pads crop first; the non-negative rest is numpy's pad in the same mode."""
    widths = pad_widths(x.shape, pads, axes)
    x = x[tuple(slice(max(-b, 0), d - max(-e, 0)) for d, (b, e) in zip(x.shape, widths))]
    grow = [(max(b, 0), max(e, 0)) for b, e in widths]
    mode = node.attr("mode", "constant")
    if mode == "constant":
        fill = np.asarray(value).reshape(-1)[0] if value is not None and np.size(value) else 0
        return np.pad(x, grow, mode="constant", constant_values=np.array(fill).astype(x.dtype))
    if mode not in ("reflect", "edge", "wrap"):
        raise ShapeInferenceError(f"Pad mode '{mode}' is not one of constant, reflect, edge, wrap")
    if any(g != (0, 0) and d == 0 for d, g in zip(x.shape, grow)):
        raise ShapeInferenceError(f"Pad mode '{mode}' cannot pad an empty axis of shape {x.shape}")
    return np.pad(x, grow, mode=mode)


def _pad_normalize(node: Node, graph: Graph) -> None:
    """Opsets < 11 carried ``pads`` and ``value`` as attributes; make them inputs 1 and 2
    (the float value is cast to the data type when the layer runs)."""
    attr_to_input(node, graph, "pads", 1)
    attr_to_input(node, graph, "value", 2, np.float32)


register_op("Pad", infer=_pad_infer, cpu=_pad_cpu, normalize=_pad_normalize)


def _crop_pad_plan(shape: Shape, target: np.ndarray, axes: list[int] | None) -> tuple[Shape, tuple, tuple]:
    """Output shape and the (source, destination) index of the centered overlap."""
    rank = len(shape)
    axes_ = normalize_axes(axes, rank, "CenterCropPad") if axes is not None else list(range(rank))
    sizes = ints(target)
    if len(sizes) != len(axes_) or min(sizes, default=0) < 0:
        raise ShapeInferenceError(f"CenterCropPad shape {sizes} must hold one size per axis {axes_}")
    out, src, dst = list(shape), [slice(None)] * rank, [slice(None)] * rank
    for axis, size in zip(axes_, sizes):
        dim = shape[axis]
        out[axis] = size
        if size < dim:
            begin = (dim - size) // 2
            src[axis] = slice(begin, begin + size)
        elif size > dim:
            begin = (size - dim) // 2
            dst[axis] = slice(begin, begin + dim)
    return tuple(out), tuple(src), tuple(dst)


def _center_crop_pad_infer(node: Node, x: TensorInfo, shape: TensorInfo) -> TensorInfo:
    if x.shape is None or shape.value is None:
        return TensorInfo(x.dtype, None)
    return TensorInfo(x.dtype, _crop_pad_plan(x.shape, shape.value, node.attr("axes"))[0])


def _center_crop_pad_cpu(node: Node, x: np.ndarray, shape: np.ndarray) -> np.ndarray:
    out_shape, src, dst = _crop_pad_plan(x.shape, shape, node.attr("axes"))
    y = np.zeros(out_shape, dtype=x.dtype)
    y[dst] = x[src]
    return y


register_op("CenterCropPad", infer=_center_crop_pad_infer, cpu=_center_crop_pad_cpu, min_opset=18)


# -- generators: ConstantOfShape / Range / EyeLike ------------------------------------------------------


def _fill_value(node: Node) -> np.ndarray:
    value = node.attr("value")
    return np.zeros((), np.float32) if value is None else np.asarray(value).reshape(-1)[:1].reshape(())


def _target_shape(shape: np.ndarray) -> Shape:
    dims = tuple(ints(shape))
    if any(d < 0 for d in dims):
        raise ShapeInferenceError(f"ConstantOfShape shape {list(dims)} has negative dims")
    return dims


def _constant_of_shape_infer(node: Node, shape: TensorInfo) -> TensorInfo:
    dtype = _fill_value(node).dtype
    return TensorInfo(dtype, None if shape.value is None else _target_shape(shape.value))


register_op(
    "ConstantOfShape",
    infer=_constant_of_shape_infer,
    cpu=lambda node, shape: np.full(_target_shape(shape), _fill_value(node)),
    min_opset=9,
)

#: Range's stash_type (opset 27): half-precision ranges accumulate in this type.
_STASH_DTYPES = {1: np.dtype(np.float32), 11: np.dtype(np.float64)}


def _range_cpu(node: Node, start: np.ndarray, limit: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """np.arange over Python scalars (exact for ints); float16/bfloat16 go through the stash type
    from opset 27 on, as the spec asks, and through float64 before. Inputs are scalars, but
    exporters also pass 1-element tensors."""
    dtype = np.asarray(start).dtype
    first, stop, step = (np.asarray(v).reshape(-1)[0] for v in (start, limit, delta))
    if step == 0:
        raise ShapeInferenceError("Range delta must not be 0")
    if dtype.kind in "iu":
        return np.arange(int(first), int(stop), int(step)).astype(dtype)
    if dtype in (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)) and node.opset >= 27:
        stash = _STASH_DTYPES.get(node.attr("stash_type", 1))
        if stash is None:
            raise ShapeInferenceError(f"Range stash_type {node.attr('stash_type')} is not FLOAT (1) or DOUBLE (11)")
        return np.arange(first.astype(stash), float(stop), float(step), dtype=stash).astype(dtype)
    return np.arange(float(first), float(stop), float(step)).astype(dtype)


def _range_infer(node: Node, start: TensorInfo, limit: TensorInfo, delta: TensorInfo) -> TensorInfo:
    """Values known -> the length is computed by running the op (shape inference does so)."""
    if start.value is not None and limit.value is not None and delta.value is not None:
        return TensorInfo.of(_range_cpu(node, start.value, limit.value, delta.value))
    return TensorInfo(start.dtype, None)


register_op("Range", infer=_range_infer, cpu=_range_cpu, min_opset=11)


def _eye_like_dtype(node: Node, x: np.dtype) -> np.dtype:
    dtype = node.attr("dtype")
    return np.dtype(x) if dtype is None else onnx_to_np(dtype)


def _eye_like_infer(node: Node, x: TensorInfo) -> TensorInfo:
    if x.shape is not None and len(x.shape) != 2:
        raise ShapeInferenceError(f"EyeLike needs a 2-D input, got shape {x.shape}")
    return TensorInfo(_eye_like_dtype(node, x.dtype), x.shape)


register_op(
    "EyeLike",
    infer=_eye_like_infer,
    cpu=lambda node, x: np.eye(*x.shape, k=node.attr("k", 0), dtype=_eye_like_dtype(node, x.dtype)),
    min_opset=9,
)


# -- Trilu / DepthToSpace / SpaceToDepth / ReverseSequence -----------------------------------------------


def _trilu_infer(node: Node, x: TensorInfo, k: TensorInfo | None = None) -> TensorInfo:
    if x.shape is not None and len(x.shape) < 2:
        raise ShapeInferenceError(f"Trilu needs rank >= 2, got shape {x.shape}")
    return TensorInfo(x.dtype, x.shape)


def _trilu_cpu(node: Node, x: np.ndarray, k: np.ndarray | None = None) -> np.ndarray:
    diagonal = 0 if k is None else int(np.asarray(k).reshape(-1)[0])
    return (np.triu if node.attr("upper", 1) else np.tril)(x, diagonal)


register_op("Trilu", infer=_trilu_infer, cpu=_trilu_cpu, min_opset=14)


def _block_size(node: Node, shape: Shape, to_space: bool) -> int:
    bs = node.attr("blocksize")
    op = "DepthToSpace" if to_space else "SpaceToDepth"
    if bs is None or bs < 1 or len(shape) != 4:
        raise ShapeInferenceError(f"{op} needs a positive blocksize and a 4-D input, got {bs} and {shape}")
    _, c, h, w = shape
    if (to_space and c % (bs * bs)) or (not to_space and (h % bs or w % bs)):
        raise ShapeInferenceError(f"{op} blocksize {bs} does not divide input shape {shape}")
    if node.attr("mode", "DCR") not in ("DCR", "CRD"):
        raise ShapeInferenceError(f"{op} mode '{node.attr('mode')}' is not DCR or CRD")
    return bs


def _depth_to_space_shape(node: Node, shape: Shape) -> Shape:
    bs = _block_size(node, shape, True)
    n, c, h, w = shape
    return n, c // (bs * bs), h * bs, w * bs


def _depth_to_space_cpu(node: Node, x: np.ndarray) -> np.ndarray:
    """DCR: depth is (row, column, channel); CRD: (channel, row, column)."""
    bs = _block_size(node, x.shape, True)
    n, c, h, w = x.shape
    if node.attr("mode", "DCR") == "DCR":
        y = x.reshape(n, bs, bs, c // (bs * bs), h, w).transpose(0, 3, 4, 1, 5, 2)
    else:
        y = x.reshape(n, c // (bs * bs), bs, bs, h, w).transpose(0, 1, 4, 2, 5, 3)
    return y.reshape(_depth_to_space_shape(node, x.shape))


register_op(
    "DepthToSpace",
    infer=lambda node, x: TensorInfo(x.dtype, None if x.shape is None else _depth_to_space_shape(node, x.shape)),
    cpu=_depth_to_space_cpu,
)


def _space_to_depth_shape(node: Node, shape: Shape) -> Shape:
    bs = _block_size(node, shape, False)
    n, c, h, w = shape
    return n, c * bs * bs, h // bs, w // bs


def _space_to_depth_cpu(node: Node, x: np.ndarray) -> np.ndarray:
    """The inverse of DepthToSpace in the same mode."""
    bs = _block_size(node, x.shape, False)
    n, c, h, w = x.shape
    y = x.reshape(n, c, h // bs, bs, w // bs, bs)
    y = y.transpose(0, 3, 5, 1, 2, 4) if node.attr("mode", "DCR") == "DCR" else y.transpose(0, 1, 3, 5, 2, 4)
    return y.reshape(_space_to_depth_shape(node, x.shape))


register_op(
    "SpaceToDepth",
    infer=lambda node, x: TensorInfo(x.dtype, None if x.shape is None else _space_to_depth_shape(node, x.shape)),
    cpu=_space_to_depth_cpu,
)


def _sequence_axes(node: Node, rank: int) -> tuple[int, int]:
    batch, time = node.attr("batch_axis", 1), node.attr("time_axis", 0)
    if rank < 2 or {batch, time} != {0, 1}:
        raise ShapeInferenceError(f"ReverseSequence needs rank >= 2 and batch/time axes 0 and 1, got {batch}, {time}")
    return batch, time


def _reverse_sequence_infer(node: Node, x: TensorInfo, lens: TensorInfo) -> TensorInfo:
    if x.shape is not None:
        batch, _ = _sequence_axes(node, len(x.shape))
        if lens.shape is not None and lens.shape != (x.shape[batch],):
            raise ShapeInferenceError(f"ReverseSequence sequence_lens {lens.shape} != batch size {x.shape[batch]}")
    return TensorInfo(x.dtype, x.shape)


def _reverse_sequence_cpu(node: Node, x: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Gather along time with index len-1-t for t < len and t otherwise (one take_along_axis)."""
    batch, time = _sequence_axes(node, x.ndim)
    steps = np.arange(x.shape[time]).reshape(-1, 1)  # (time, 1)
    lens = np.asarray(lens, dtype=np.int64).reshape(1, -1)  # (1, batch)
    source = np.where(steps < lens, lens - 1 - steps, steps)  # (time, batch)
    if time == 1:
        source = source.T
    source = source.reshape(source.shape + (1,) * (x.ndim - 2))
    return np.take_along_axis(x, np.broadcast_to(source, x.shape), axis=time)


register_op("ReverseSequence", infer=_reverse_sequence_infer, cpu=_reverse_sequence_cpu, min_opset=10)
