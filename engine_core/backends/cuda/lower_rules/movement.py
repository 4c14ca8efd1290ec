"""Lowering rules that move data: views (aliases, strided views of strided views), Transpose, Expand, Slice
(strided copies), Split (views at offsets where the input lives in the arena, else strided copies), Concat (one
concat.cu launch for all its inputs) and Gather (gather.cu).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from engine_core.backends.cuda.lower_rules.common import may_be_channels_last
from engine_core.backends.cuda.lowering_context import (
    THREADS,
    Copy,
    Launch,
    LoweringContext,
    Ref,
    copy_launch,
    grid_for,
    lowering_rule,
)
from engine_core.backends.cuda.pointwise import (
    Unsupported,
    broadcast_strides,
    coalesce,
    contiguous_strides,
)
from engine_core.ir import Node
from engine_core.ops.registry import normalize_axis

VIEW_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})
#: ops whose rules read every input through ``ctx.strides``, so a strided view (a Split part, a head transpose of
#: one) needs no copy in front of them: the generated pointwise kernels, the concat kernel and strided copies,
#: flash attention (its operands' batch, head and row strides are arguments)
STRIDED_READERS = frozenset({"Gelu", "PointwiseChain", "Concat", "Transpose", "Split", "Attention",
                             "AttentionQuantize"})


def view_source(node: Node, ctx: LoweringContext) -> Node | None:
    """``node`` as a view of one input's bytes (that input first), or None when it moves data at these shapes.

    Views: the view ops; an Expand with nothing to broadcast (fuse_attention's key-count Expand of a mask that
    already has the key count: one per layer); a Transpose that moves only dims of size 1 (a decoder's head split
    and merge of one new token, [B, 1, H, D] <-> [B, H, 1, D]) or whose input is a strided view already (then only
    its strides move); a Concat whose other inputs are empty (an export's Concat of the one past, a prefill's
    Concat of an empty past). An input that is a strided view must have strides for the result (``view_strides``:
    a Reshape may need a copy first). Bindings are per input shapes, so the same layer is a copy at shapes where
    it moves data."""
    if not node.inputs or not node.inputs[0] or node.op_type not in (*VIEW_OPS, "Expand", "Transpose", "Concat"):
        return None
    if node.op_type == "Concat":
        filled = [n for n in node.inputs if n and int(np.prod(ctx.info(n).shape, dtype=np.int64))]
        if len(filled) != 1 or ctx.layouts.get(filled[0], "linear") == "nhwc":
            return None
        node = replace(node, inputs=filled)
    shape = ctx.info(node.inputs[0]).shape  # unknown: Unsupported (the layer runs on the host)
    layout = ctx.layouts.get(node.inputs[0], "linear")
    if layout == "strided":
        return node if view_strides(node, ctx) is not None else None
    if node.op_type == "Transpose":
        moved = [axis for axis in _perm(node, len(shape)) if shape[axis] != 1]
        return node if moved == sorted(moved) and layout == "linear" else None
    if node.op_type in VIEW_OPS or shape == ctx.info(node.outputs[0]).shape:
        return node
    return None


def view_strides(node: Node, ctx: LoweringContext) -> tuple[int, ...] | None:
    """Element strides of a view layer's output over its first input's bytes (read through that input's strides),
    or None when no strides describe it (a Reshape merging dims that are not contiguous)."""
    src, shape = ctx.strides(node.inputs[0]), ctx.info(node.inputs[0]).shape
    out = ctx.info(node.outputs[0]).shape
    if node.op_type == "Transpose":
        return tuple(src[axis] for axis in _perm(node, len(shape)))
    if node.op_type in ("Expand", "Concat"):
        return tuple(src) if tuple(shape) == tuple(out) else None
    return reshape_strides(shape, src, out)


def reshape_strides(shape: Sequence[int], strides: Sequence[int], new_shape: Sequence[int]) -> tuple[int, ...] | None:
    """Strides that read ``shape`` (at ``strides``) as ``new_shape`` without a copy, or None (numpy's rule: each
    group of old dims merged or split into new ones must be contiguous within itself)."""
    if int(np.prod(new_shape, dtype=np.int64)) == 0:
        return contiguous_strides(tuple(new_shape))
    old = [(int(d), int(s)) for d, s in zip(shape, strides) if d != 1]
    new = [int(d) for d in new_shape]
    result = [0] * len(new)
    i = j = 0  # next old dim, next new dim
    while i < len(old):
        group_end, size = i + 1, old[i][0]  # old dims i..group_end-1 become new dims j..k-1
        k, new_size = j, 1
        while new_size != size:
            if new_size < size:
                if k == len(new):
                    return None
                new_size *= new[k]
                k += 1
            elif group_end == len(old):
                return None
            else:
                size *= old[group_end][0]
                group_end += 1
        if any(old[a][1] != old[a + 1][0] * old[a + 1][1] for a in range(i, group_end - 1)):
            return None
        stride = old[group_end - 1][1]
        for d in range(k - 1, j - 1, -1):
            result[d] = stride
            stride *= new[d]
        i, j = group_end, k
    return tuple(result)  # new dims of size 1 left over keep stride 0: nothing steps along them


def _perm(node: Node, rank: int) -> list[int]:
    return node.attr("perm", None) or list(reversed(range(rank)))


def lower_view(node: Node, ctx: LoweringContext) -> list:
    """Views alias their input (``node`` as ``view_source`` gives it); the view of a strided view is one too. Only a
    view that is a graph output needs a copy."""
    src, out_name = node.inputs[0], node.outputs[0]
    out = ctx.info(out_name)
    strided = ctx.layouts.get(src) == "strided"
    if out_name not in ctx.graph_outputs:
        if strided:
            ctx.view(out_name, src, 0, view_strides(node, ctx) or ())
        return []
    if strided:
        return [copy_launch(ctx, out.dtype, Ref(out_name), Ref(src), out.shape, contiguous_strides(out.shape),
                            view_strides(node, ctx))]
    return [Copy(Ref(out_name), Ref(src), int(np.prod(out.shape)) * out.dtype.itemsize)]


@lowering_rule("Transpose")
def _lower_transpose(node: Node, ctx: LoweringContext) -> list:
    x, out = ctx.info(node.inputs[0]), ctx.info(node.outputs[0])
    perm = node.attr("perm", None) or list(reversed(range(len(x.shape))))
    src = ctx.strides(node.inputs[0])
    return [copy_launch(ctx, x.dtype, Ref(node.outputs[0]), Ref(node.inputs[0]), out.shape,
                        contiguous_strides(out.shape), [src[p] for p in perm])]


@lowering_rule("Expand")
def _lower_expand(node: Node, ctx: LoweringContext) -> list:
    x, out = ctx.info(node.inputs[0]), ctx.info(node.outputs[0])
    return [copy_launch(ctx, x.dtype, Ref(node.outputs[0]), Ref(node.inputs[0]), out.shape,
                        contiguous_strides(out.shape), broadcast_strides(x.shape, out.shape))]


@lowering_rule("Concat")
def _lower_concat(node: Node, ctx: LoweringContext) -> list:
    """Concat: every input read in its own layout and written to its slice of the output along the axis, in one
    concat.cu launch (``concat_launches``), or one strided copy per input where that kernel does not apply (a single
    input, dims that do not merge to its rank). The output is channels-last when an input is (``concat_layout``):
    then a CNN's channel concat of convolution outputs (DenseNet's blocks, Inception's branches) writes each input as
    a channel slice of the NHWC result, and neither the inputs nor the next convolution's input need a reformat."""
    out = ctx.info(node.outputs[0])
    axis = normalize_axis(node.attr("axis"), len(out.shape))
    ctx.layouts[node.outputs[0]] = concat_layout(node, ctx)
    out_strides = ctx.strides(node.outputs[0])
    slices, start = [], 0  # (input, its shape, its slice's element offset in the output)
    for name in node.inputs:
        x = ctx.info(name)
        if int(np.prod(x.shape)):
            slices.append((name, x.shape, start * out_strides[axis]))
        start += x.shape[axis]
    parts = [concat_part(Ref(name), shape, out_strides, ctx.strides(name), offset, out.dtype.itemsize)
             for name, shape, offset in slices]
    if len(parts) >= 2 and out.dtype.itemsize in CONCAT_ELEMENT_BYTES and all(p is not None for p in parts):
        return concat_launches(ctx, Ref(node.outputs[0]), [p for p in parts if p is not None])
    return [copy_launch(ctx, out.dtype, Ref(node.outputs[0], offset * out.dtype.itemsize), Ref(name), shape,
                        out_strides, ctx.strides(name)) for name, shape, offset in slices]


def concat_layout(node: Node, ctx: LoweringContext) -> str:
    """A Concat's output layout: channels-last when one of its inputs is and the output may be
    (``may_be_channels_last``), else linear. Any axis works: a slice of an NHWC tensor along any logical axis is
    a strided view of it, so each copy only needs the output's strides and the slice's offset."""
    if may_be_channels_last(node.outputs[0], ctx) and any(ctx.layouts.get(n) == "nhwc" for n in node.inputs if n):
        return "nhwc"
    return "linear"


#: cuda_kernels/concat.cu: inputs one launch takes (a warp's lanes find a block's input), dims after merging, int64s
#: per table row, units a thread moves
CONCAT_MAX_INPUTS, CONCAT_MAX_RANK, CONCAT_ROW, CONCAT_UNROLL = 32, 6, 24, 4
#: blocks one input gets at most (its threads then loop over the rest): many times what fills an H100
CONCAT_MAX_BLOCKS = 4096
#: element sizes the kernel moves (every Concat dtype Kiln runs on the GPU)
CONCAT_ELEMENT_BYTES = (1, 2, 4, 8)
#: vector units, widest first (the kernel moves single elements where an address is not aligned to them)
_VECTOR_BYTES = (16, 8, 4, 2)


@dataclass(frozen=True)
class ConcatPart:
    """One input of a one-launch Concat, in units of ``unit_bytes``: its dims in the output's memory order (merged
    where contiguous in both tensors), the output's and its own strides, and its slice's offset in the output."""

    src: Ref
    unit_bytes: int
    offset: int
    shape: tuple[int, ...]
    dst_strides: tuple[int, ...]
    src_strides: tuple[int, ...]

    @property
    def units(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def concat_part(src: Ref, shape: Sequence[int], dst_strides: Sequence[int], src_strides: Sequence[int], offset: int,
                itemsize: int) -> ConcatPart | None:
    """``src`` (``shape`` read through ``src_strides``, in elements) written at element ``offset`` of an output with
    ``dst_strides``, in the widest units it allows; None when its dims do not merge to the kernel's rank. Why the
    output's memory order: consecutive threads then write consecutive addresses whatever the layouts."""
    order = sorted(range(len(shape)), key=lambda d: -int(dst_strides[d]))
    dims, (dst, srcs) = coalesce([shape[d] for d in order], [[dst_strides[d] for d in order],
                                                             [src_strides[d] for d in order]])
    if not dims:  # a single element
        dims, dst, srcs = [1], [1], [1]
    if len(dims) > CONCAT_MAX_RANK:
        return None
    return _vectorized(ConcatPart(src, itemsize, int(offset), tuple(dims), tuple(dst), tuple(srcs)))


def _vectorized(part: ConcatPart) -> ConcatPart:
    """``part`` in the widest vector units its innermost dim (contiguous in both tensors), other strides and offset
    divide into: DenseNet's NHWC slices of 32 fp16 channels move as four 16-byte vectors a pixel."""
    if part.dst_strides[-1] != 1 or part.src_strides[-1] != 1:
        return part
    steps = (part.offset, part.shape[-1], *part.dst_strides[:-1], *part.src_strides[:-1])
    for width in _VECTOR_BYTES:
        v = width // part.unit_bytes
        if width > part.unit_bytes and width % part.unit_bytes == 0 and all(s % v == 0 for s in steps):
            return ConcatPart(part.src, width, part.offset // v, (*part.shape[:-1], part.shape[-1] // v),
                              (*(s // v for s in part.dst_strides[:-1]), 1), (*(s // v for s in part.src_strides[:-1]), 1))
    return part


def concat_table(parts: Sequence[ConcatPart]) -> np.ndarray:
    """The kernel's table for one launch: a row per part (the layout concat.cu describes), each part given the
    blocks its units need at THREADS x CONCAT_UNROLL a block, dims right-aligned (extent 1, stride 0 in front)."""
    if not 1 <= len(parts) <= CONCAT_MAX_INPUTS:
        raise ValueError(f"a concat launch takes 1 to {CONCAT_MAX_INPUTS} inputs, not {len(parts)}")
    table = np.zeros((len(parts), CONCAT_ROW), np.int64)
    first = 0
    for row, part in zip(table, parts):
        blocks = min(max(1, -(-part.units // (THREADS * CONCAT_UNROLL))), CONCAT_MAX_BLOCKS)
        pad = CONCAT_MAX_RANK - len(part.shape)
        row[:6] = first, blocks, part.units, part.offset, len(part.shape), part.unit_bytes
        row[6:] = ((1,) * pad + part.shape) + ((0,) * pad + part.dst_strides) + ((0,) * pad + part.src_strides)
        first += blocks
    return table


def concat_launch(y: Ref, table: Ref, parts: Sequence[ConcatPart], rows: np.ndarray, itemsize: int) -> Launch:
    """One concat_copy launch of ``parts`` (at most CONCAT_MAX_INPUTS) whose table ``rows`` live at ``table``."""
    grid = (int(rows[-1, 0] + rows[-1, 1]), 1, 1)
    sources = [(p.src, ctypes.c_void_p) for p in parts] + [(0, ctypes.c_void_p)] * (CONCAT_MAX_INPUTS - len(parts))
    return Launch("concat", "concat_copy", grid, (THREADS, 1, 1),
                  [(y, ctypes.c_void_p), (table, ctypes.c_void_p), (len(parts), ctypes.c_int),
                   (itemsize, ctypes.c_int), *sources])


def concat_launches(ctx: LoweringContext, y: Ref, parts: Sequence[ConcatPart]) -> list[Launch]:
    """A Concat's launches: one per CONCAT_MAX_INPUTS parts, their tables one folded constant (uploaded with the
    binding, so a captured graph replays the same table)."""
    chunks = [parts[i:i + CONCAT_MAX_INPUTS] for i in range(0, len(parts), CONCAT_MAX_INPUTS)]
    tables = [concat_table(chunk) for chunk in chunks]
    folded = ctx.fold(f"{y.tensor}#concat_table", np.concatenate(tables))
    row_bytes = CONCAT_ROW * np.dtype(np.int64).itemsize
    itemsize = ctx.info(y.tensor).dtype.itemsize
    return [concat_launch(y, Ref(folded.tensor, i * CONCAT_MAX_INPUTS * row_bytes), chunk, rows, itemsize)
            for i, (chunk, rows) in enumerate(zip(chunks, tables))]


@lowering_rule("Slice")
def _lower_slice(node: Node, ctx: LoweringContext) -> list:
    x, out = ctx.info(node.inputs[0]), ctx.info(node.outputs[0])
    args = [ctx.value(n) if i < len(node.inputs) and n else None for i, n in enumerate(node.inputs[1:5])]
    if node.opset < 10 or args[0] is None or args[1] is None or any(
            a is None for a, n in zip(args[2:], node.inputs[3:5]) if n):
        raise Unsupported("Slice needs known starts/ends/axes/steps")
    starts, ends = args[0].tolist(), args[1].tolist()
    axes = args[2].tolist() if len(args) > 2 and args[2] is not None else list(range(len(starts)))
    steps = args[3].tolist() if len(args) > 3 and args[3] is not None else [1] * len(starts)
    strides = list(contiguous_strides(x.shape))
    base = 0
    for s, e, a, st in zip(starts, ends, axes, steps):
        a = normalize_axis(a, len(x.shape))
        first, _, _ = slice(s, e, st).indices(x.shape[a])
        base += first * strides[a]
        strides[a] *= st
    return [copy_launch(ctx, x.dtype, Ref(node.outputs[0]), Ref(node.inputs[0], base * x.dtype.itemsize), out.shape,
                        contiguous_strides(out.shape), strides)]


@lowering_rule("Split")
def _lower_split(node: Node, ctx: LoweringContext) -> list:
    """Split: each output a view of the input at its offset along the axis, read through the input's strides
    (``ctx.view``; a decoder's q, k, v parts of one packed projection: three copies per layer and step otherwise),
    where the input lives in the arena and the part is no graph output; else one strided copy per output. The
    output shapes, known from shape inference, give the sizes whichever way the split was declared."""
    x = ctx.info(node.inputs[0])
    axis = normalize_axis(node.attr("axis", 0), len(x.shape))
    strides = ctx.strides(node.inputs[0])
    viewable = ctx.in_arena(node.inputs[0])
    ops, start = [], 0
    for name in node.outputs:
        out = ctx.info(name)
        offset = start * strides[axis] * x.dtype.itemsize
        if viewable and name not in ctx.graph_outputs:
            ctx.view(name, node.inputs[0], offset, strides)
        elif int(np.prod(out.shape, dtype=np.int64)):
            ops.append(copy_launch(ctx, x.dtype, Ref(name), Ref(node.inputs[0], offset), out.shape,
                                   contiguous_strides(out.shape), strides))
        start += out.shape[axis]
    return ops


@lowering_rule("Gather")
def _lower_gather(node: Node, ctx: LoweringContext) -> list:
    data, idx = ctx.info(node.inputs[0]), ctx.info(node.inputs[1])
    ctx.info(node.outputs[0])
    if idx.dtype not in (np.dtype(np.int64), np.dtype(np.int32)):
        raise Unsupported(f"Gather indices of {idx.dtype}")
    axis = normalize_axis(node.attr("axis", 0), len(data.shape))
    outer = int(np.prod(data.shape[:axis], dtype=np.int64))
    inner_bytes = int(np.prod(data.shape[axis + 1:], dtype=np.int64)) * data.dtype.itemsize
    word = next(w for w in (16, 8, 4, 2, 1) if inner_bytes % w == 0)
    nidx = int(np.prod(idx.shape, dtype=np.int64))
    total = outer * nidx * (inner_bytes // word)
    if total == 0:
        return []
    suffix = "i64" if idx.dtype == np.int64 else "i32"
    return [Launch("gather", f"gather_w{word}_{suffix}", grid_for(total), (THREADS, 1, 1),
                   [(Ref(node.outputs[0]), ctypes.c_void_p), (Ref(node.inputs[0]), ctypes.c_void_p),
                    (Ref(node.inputs[1]), ctypes.c_void_p), (outer, ctypes.c_longlong), (nidx, ctypes.c_longlong),
                    (data.shape[axis], ctypes.c_longlong), (inner_bytes // word, ctypes.c_longlong)])]
