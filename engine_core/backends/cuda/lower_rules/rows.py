"""Lowering rules of the row kernels that are not norms: Softmax (softmax.cu) and the trailing-axes reductions
(reduce.cu).
"""

from __future__ import annotations

import ctypes

from engine_core.backends.cuda.lower_rules.common import (
    WARP_ROW_LIMIT,
    row_suffix,
    rows_cols,
    warp_grid,
)
from engine_core.backends.cuda.lowering_context import (
    THREADS,
    Launch,
    LoweringContext,
    Ref,
    lowering_rule,
)
from engine_core.backends.cuda.pointwise import (
    Unsupported,
)
from engine_core.ir import Node
from engine_core.ops.registry import normalize_axis


@lowering_rule("Softmax")
def _lower_softmax(node: Node, ctx: LoweringContext) -> list:
    x = ctx.info(node.inputs[0])
    if not x.shape:
        raise Unsupported("Softmax of a scalar")
    suffix = row_suffix(x.dtype, "Softmax")
    axis = normalize_axis(node.attr("axis", -1 if node.opset >= 13 else 1), len(x.shape))
    if node.opset >= 13 and axis != len(x.shape) - 1:
        raise Unsupported("Softmax over a non-last axis")
    rows, cols = rows_cols(x.shape, axis)
    if rows * cols == 0:
        return []
    args = [(Ref(node.inputs[0]), ctypes.c_void_p), (Ref(node.outputs[0]), ctypes.c_void_p), (cols, ctypes.c_longlong)]
    if cols <= WARP_ROW_LIMIT:
        return [Launch("softmax", f"softmax_warp_{suffix}", warp_grid(rows), (THREADS, 1, 1),
                       [*args, (rows, ctypes.c_longlong)])]
    return [Launch("softmax", f"softmax_{suffix}", (rows, 1, 1), (THREADS, 1, 1), args)]


_REDUCE_KERNELS = {"ReduceMean": "reduce_rows", "ReduceSum": "reduce_rows", "ReduceMax": "reduce_max_rows",
                   "ReduceMin": "reduce_min_rows"}


@lowering_rule("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin")
def _lower_reduce(node: Node, ctx: LoweringContext) -> list:
    x = ctx.info(node.inputs[0])
    if not x.shape:
        raise Unsupported(f"{node.op_type} of a scalar")
    suffix = row_suffix(x.dtype, node.op_type)
    if len(node.inputs) > 1 and node.inputs[1]:  # axes as an input (opset 18, or ReduceSum 13)
        axes = ctx.value(node.inputs[1])
        if axes is None:
            raise Unsupported(f"{node.op_type} axes not known")
        axes = axes.reshape(-1).tolist()
    else:
        axes = node.attr("axes", None)
    if not axes:
        raise Unsupported(f"{node.op_type} over all axes / noop_with_empty_axes")
    axes = sorted(normalize_axis(a, len(x.shape)) for a in axes)
    if axes != list(range(axes[0], len(x.shape))):
        raise Unsupported(f"{node.op_type} over non-trailing axes")
    rows, cols = rows_cols(x.shape, axes[0])
    if rows * cols == 0:
        raise Unsupported(f"{node.op_type} of an empty tensor")
    scale = 1.0 / cols if node.op_type == "ReduceMean" else 1.0
    return [Launch("reduce", f"{_REDUCE_KERNELS[node.op_type]}_{suffix}", (rows, 1, 1), (THREADS, 1, 1),
                   [(Ref(node.inputs[0]), ctypes.c_void_p), (Ref(node.outputs[0]), ctypes.c_void_p),
                    (cols, ctypes.c_longlong), (scale, ctypes.c_float)])]
