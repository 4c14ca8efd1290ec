"""Lowering rules of the norms: LayerNormalization / RMSNormalization (layer_norm.cu) and ``kiln.SkipLayerNorm``
(skip_layer_norm.cu, with its int8 output and dequantizing forms).
"""

from __future__ import annotations

import ctypes

import numpy as np

from engine_core.backends.cuda.lower_rules.common import (
    WARP_ROW_LIMIT,
    check_int8_output,
    quantize_launch,
    row_suffix,
    rows_cols,
    warp_grid,
)
from engine_core.backends.cuda.lowering_context import (
    THREADS,
    Launch,
    LoweringContext,
    Ref,
    launch_program,
    lowering_rule,
)
from engine_core.backends.cuda.pointwise import (
    PwNode,
    Unsupported,
    broadcast_strides,
    contiguous_strides,
    program_kernel,
)
from engine_core.ir import Node
from engine_core.ops.registry import normalize_axis


def _norm_geometry(node: Node, ctx: LoweringContext, shape: tuple[int, ...], dtype: np.dtype) -> tuple[str, int, int]:
    """(kernel suffix, rows, cols) of a LayerNormalization / RMSNormalization / SkipLayerNorm over ``shape``;
    raises Unsupported for what the row kernels do not take."""
    if any(node.outputs[2 if node.op_type == "SkipLayerNorm" else 1:]):  # SkipLayerNorm's output 1: int8 of y
        raise Unsupported(f"{node.op_type} with mean/inv-std outputs")
    suffix = row_suffix(dtype, node.op_type)
    if node.attr("stash_type", 1) != 1:
        raise Unsupported(f"{node.op_type} with a non-fp32 stash_type")
    rows, cols = rows_cols(shape, normalize_axis(node.attr("axis", -1), len(shape)))
    first = 2 if node.op_type == "SkipLayerNorm" else 1
    for name in node.inputs[first:first + 2]:
        if name and (int(np.prod(ctx.info(name).shape)) != cols or ctx.info(name).dtype != dtype):
            raise Unsupported(f"{node.op_type} scale/bias that broadcast or differ in dtype")
    return suffix, rows, cols


def _norm_tail(node: Node, first: int, y: Ref | None = None) -> list[tuple]:
    """The (scale, bias or null, output, cols placeholder) launch arguments shared by the row-norm kernels; ``y``
    stands in for output 0 (a SkipLayerNorm's may be absent: null, or scratch when a later launch reads it)."""
    bias = node.inputs[first + 1] if len(node.inputs) > first + 1 else ""
    y = y if y is not None else Ref(node.outputs[0]) if node.outputs[0] else None
    return [(Ref(node.inputs[first]), ctypes.c_void_p), (Ref(bias), ctypes.c_void_p) if bias else (0, ctypes.c_void_p),
            (y, ctypes.c_void_p) if y is not None else (0, ctypes.c_void_p)]


@lowering_rule("LayerNormalization", "RMSNormalization")
def _lower_norm(node: Node, ctx: LoweringContext) -> list:
    """LayerNormalization / RMSNormalization over trailing axes with same-size scale (and bias)."""
    x = ctx.info(node.inputs[0])
    suffix, rows, cols = _norm_geometry(node, ctx, x.shape, x.dtype)
    if rows * cols == 0:
        return []
    kind = "layer_norm" if node.op_type == "LayerNormalization" else "rms_norm"
    return [_norm_launch("layer_norm", kind, suffix, rows, cols, [Ref(node.inputs[0])], node, 1)]


def _norm_launch(module: str, kind: str, suffix: str, rows: int, cols: int, xs: list[Ref], node: Node,
                 first: int, quantized: list[Ref] | None = None, y: Ref | None = None) -> Launch:
    """One row-norm launch: a warp per row held in registers for rows of at most WARP_ROW_LIMIT elements (every
    row read once), else a block per row. ``quantized`` (int8 output, its scale): the warp kernel's ``_q`` form
    also writes the output quantized (callers check cols <= WARP_ROW_LIMIT). ``y``: see _norm_tail."""
    eps = (float(node.attr("epsilon", 1e-5)), ctypes.c_float)
    args = [*[(x, ctypes.c_void_p) for x in xs], *_norm_tail(node, first, y),
            *[(ref, ctypes.c_void_p) for ref in quantized or []]]
    if quantized:
        kind = f"{kind}_q"
    if cols <= WARP_ROW_LIMIT:
        return Launch(module, f"{kind}_warp_{suffix}", warp_grid(rows), (THREADS, 1, 1),
                      [*args, (cols, ctypes.c_int), eps, (rows, ctypes.c_longlong)])
    return Launch(module, f"{kind}_{suffix}", (rows, 1, 1), (THREADS, 1, 1), [*args, (cols, ctypes.c_longlong), eps])


@lowering_rule("SkipLayerNorm")
def _lower_skip_layer_norm(node: Node, ctx: LoweringContext) -> list:
    """``kiln.SkipLayerNorm``: one skip_layer_norm.cu launch when x and skip both have the output's shape; when
    one broadcasts, a generated Add into step-local scratch and the layer_norm.cu kernel (the unfused cost). Int8
    operands (inputs 6, 7: passes/fuse_norm_dequantize.py) take the warp kernel's ``_dq`` form only."""
    out = ctx.info(node.outputs[0] or node.outputs[1])
    dtype = ctx.info(node.inputs[2]).dtype  # gamma's: the layer's float type, also when output 0 is absent
    suffix, rows, cols = _norm_geometry(node, ctx, out.shape, dtype)
    if rows * cols == 0:
        return []
    x, skip = node.inputs[:2]
    quantized = _norm_quantized_output(node, ctx)
    same_shape = all(tuple(ctx.info(n).shape) == tuple(out.shape) for n in (x, skip))
    if len(node.inputs) > 6 and node.inputs[6]:
        return [_dequantizing_skip_norm(node, ctx, suffix, rows, cols, same_shape, quantized)]
    in_kernel = quantized and same_shape and cols <= WARP_ROW_LIMIT  # the warp kernel writes the int8 output too
    y = None if node.outputs[0] or in_kernel else ctx.new_scratch(f"{node.name}#y", dtype, tuple(out.shape))
    if same_shape:
        steps = [_norm_launch("skip_layer_norm", "skip_layer_norm", suffix, rows, cols, [Ref(x), Ref(skip)], node, 2,
                              [Ref(node.outputs[1]), Ref(node.inputs[4])] if in_kernel else None, y)]
    else:
        total = ctx.new_scratch(f"{node.name}#sum", out.dtype, tuple(out.shape))
        kernel = ctx.kernel(program_kernel([PwNode.make("Add", [0, 1], out.dtype)], out.dtype, [out.dtype, out.dtype]))
        strides = [broadcast_strides(ctx.info(n).shape, out.shape, ctx.strides(n)) for n in (x, skip)]
        add = launch_program(kernel, total, [Ref(x), Ref(skip)], out.shape, contiguous_strides(out.shape), strides)
        steps = [add, _norm_launch("layer_norm", "layer_norm", suffix, rows, cols, [total], node, 2, y=y)]
    if quantized and not in_kernel:  # wide or broadcast rows: the unfused QuantizeLinear after the norm
        steps.append(quantize_launch(ctx, y.tensor if y is not None else node.outputs[0], node.inputs[4],
                                      node.outputs[1]))
    return steps


def _dequantizing_skip_norm(node: Node, ctx: LoweringContext, suffix: str, rows: int, cols: int, same_shape: bool,
                            quantized: bool) -> Launch:
    """skip_layer_norm_dq_warp_*: int8 x and skip dequantized in the kernel (fp32 scales), y and the int8 output
    each written when the layer has it."""
    if not same_shape or cols > WARP_ROW_LIMIT:
        raise Unsupported("SkipLayerNorm of int8 operands that broadcast or rows wider than a warp kernel holds")
    if any(ctx.info(name).dtype != np.float32 for name in node.inputs[6:8]):
        raise Unsupported("SkipLayerNorm dequantizing by non-fp32 scales")
    quantized_args = [Ref(node.outputs[1]), Ref(node.inputs[4])] if quantized else [0, 0]
    args = [*[(Ref(name), ctypes.c_void_p) for name in (*node.inputs[:2], *node.inputs[6:8])], *_norm_tail(node, 2),
            *[(ref, ctypes.c_void_p) for ref in quantized_args],
            (cols, ctypes.c_int), (float(node.attr("epsilon", 1e-5)), ctypes.c_float), (rows, ctypes.c_longlong)]
    return Launch("skip_layer_norm", f"skip_layer_norm_dq_warp_{suffix}", warp_grid(rows), (THREADS, 1, 1), args)


def _norm_quantized_output(node: Node, ctx: LoweringContext) -> bool:
    """Whether a SkipLayerNorm also writes its output quantized (output 1); raises Unsupported for a zero point
    that is not a constant 0."""
    if len(node.outputs) < 2 or not node.outputs[1]:
        return False
    check_int8_output(ctx, node)
    return True
