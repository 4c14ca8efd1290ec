"""Lowering rules that move data: views (aliases), Transpose, Expand, Concat, Slice, Split (strided copies) and
Gather (gather.cu).
"""

from __future__ import annotations

import ctypes

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
    contiguous_strides,
)
from engine_core.ir import Node
from engine_core.ops.registry import normalize_axis

VIEW_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})


def lower_view(node: Node, ctx: LoweringContext) -> list:
    """Views alias their input; only a view that is a graph output needs a copy."""
    if node.outputs[0] not in ctx.graph_outputs:
        return []
    out = ctx.info(node.outputs[0])
    return [Copy(Ref(node.outputs[0]), Ref(node.inputs[0]), int(np.prod(out.shape)) * out.dtype.itemsize)]


def is_view(node: Node, ctx: LoweringContext) -> bool:
    """A layer whose output is its input's bytes: the view ops, and an Expand with nothing to broadcast at these
    shapes (fuse_attention's key-count Expand of a mask that already has the key count: one per layer)."""
    if not node.inputs or not node.inputs[0] or node.op_type not in VIEW_OPS and node.op_type != "Expand":
        return False
    shape = ctx.info(node.inputs[0]).shape  # unknown: Unsupported (the layer runs on the host)
    return node.op_type in VIEW_OPS or shape == ctx.info(node.outputs[0]).shape


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
    """Concat: one strided copy per input, each read in its own layout and written to its slice of the output
    along the axis. The output is channels-last when an input is (``concat_layout``): then a CNN's channel concat
    of convolution outputs (DenseNet's blocks, Inception's branches) writes each input as a channel slice of the
    NHWC result, and neither the inputs nor the next convolution's input need a reformat."""
    out = ctx.info(node.outputs[0])
    axis = normalize_axis(node.attr("axis"), len(out.shape))
    ctx.layouts[node.outputs[0]] = concat_layout(node, ctx)
    out_strides = ctx.strides(node.outputs[0])
    launches, start = [], 0
    for name in node.inputs:
        x = ctx.info(name)
        if int(np.prod(x.shape)):
            dst = Ref(node.outputs[0], start * out_strides[axis] * out.dtype.itemsize)
            launches.append(copy_launch(ctx, x.dtype, dst, Ref(name), x.shape, out_strides, ctx.strides(name)))
        start += x.shape[axis]
    return launches


def concat_layout(node: Node, ctx: LoweringContext) -> str:
    """A Concat's output layout: channels-last when one of its inputs is and the output may be
    (``may_be_channels_last``), else linear. Any axis works: a slice of an NHWC tensor along any logical axis is
    a strided view of it, so each copy only needs the output's strides and the slice's offset."""
    if may_be_channels_last(node.outputs[0], ctx) and any(ctx.layouts.get(n) == "nhwc" for n in node.inputs if n):
        return "nhwc"
    return "linear"


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
    """Split: one strided copy per output, each reading the input from its offset along the axis (the
    output shapes, known from shape inference, give the sizes whichever way the split was declared)."""
    x = ctx.info(node.inputs[0])
    axis = normalize_axis(node.attr("axis", 0), len(x.shape))
    strides = contiguous_strides(x.shape)
    ops, start = [], 0
    for name in node.outputs:
        out = ctx.info(name)
        if name and int(np.prod(out.shape, dtype=np.int64)):
            ops.append(copy_launch(ctx, x.dtype, Ref(name), Ref(node.inputs[0], start * strides[axis] * x.dtype.itemsize),
                                   out.shape, contiguous_strides(out.shape), strides))
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
