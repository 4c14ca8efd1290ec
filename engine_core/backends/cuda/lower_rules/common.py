"""What lowering rules of several families share: row-kernel types and geometry, output layouts, the GEMM
operand type check and the int8 output of fused layers.
"""

from __future__ import annotations

import numpy as np

from engine_core.backends.cuda.lowering_context import (
    F16,
    F32,
    INT8,
    THREADS,
    Launch,
    LoweringContext,
    Ref,
    launch_program,
    same_bytes_in_both_layouts,
)
from engine_core.backends.cuda.pointwise import (
    BF16,
    PwNode,
    Unsupported,
    contiguous_strides,
    program_kernel,
)
from engine_core.ir import Node

#: storage types of the row kernels (softmax, norms, reductions, pooling)
ROW_SUFFIX = {F32: "f32", F16: "f16", BF16: "bf16"}


def may_be_channels_last(name: str, ctx: LoweringContext) -> bool:
    """Whether ``name`` may live channels-last: a 4-D tensor that is no graph output (bindings are linear) and
    whose layouts differ (C > 1 and H*W > 1; else NHWC and NCHW are the same bytes, and linear needs no reformat)."""
    shape = ctx.info(name).shape
    return name not in ctx.graph_outputs and len(shape) == 4 and not same_bytes_in_both_layouts(shape)


def out_layout(node: Node, ctx: LoweringContext, spatial: bool = False) -> str:
    """Layout of a layout-aware node's output: channels-last when a same-shape input is (``spatial``:
    when its first input is, as for pooling), unless the output is a graph output or the layouts
    coincide (H*W == 1 or C == 1)."""
    out = node.outputs[0]
    shape = ctx.info(out).shape
    if not may_be_channels_last(out, ctx):
        return "linear"
    if spatial:
        return ctx.layouts.get(node.inputs[0], "linear")
    for name in node.inputs:
        if name and ctx.layouts.get(name) == "nhwc" and ctx.info(name).shape == shape:
            return "nhwc"
    return "linear"


def rows_cols(shape: tuple[int, ...], axis: int) -> tuple[int, int]:
    return int(np.prod(shape[:axis], dtype=np.int64)), int(np.prod(shape[axis:], dtype=np.int64))


def row_suffix(dtype: np.dtype, what: str) -> str:
    if dtype not in ROW_SUFFIX:
        raise Unsupported(f"{what} over {dtype}")
    return ROW_SUFFIX[dtype]


#: rows up to this long run one warp per row (softmax.cu's *_warp kernels)
WARP_ROW_LIMIT = 1024


def warp_grid(rows: int) -> tuple[int, int, int]:
    return (max(1, (rows + THREADS // 32 - 1) // (THREADS // 32)), 1, 1)


def quantize_launch(ctx: LoweringContext, x: str, scale: str, y: str) -> Launch:
    """The generated QuantizeLinear of contiguous ``x`` to int8 ``y`` by one scale (zero point 0): what a fused
    layer that quantizes its output runs when its kernel cannot do it in registers."""
    shape = ctx.info(x).shape
    kernel = ctx.kernel(program_kernel([PwNode.make("QuantizeLinear", [0, 1, -1], INT8)], INT8,
                                       [ctx.info(x).dtype, ctx.info(scale).dtype]))
    strides = contiguous_strides(shape)
    return launch_program(kernel, Ref(y), [Ref(x), Ref(scale)], shape, strides, [strides, (0,) * len(shape)])


def check_int8_output(ctx: LoweringContext, node: Node) -> None:
    """A fused layer's int8 output (SkipLayerNorm, AttentionQuantize: inputs 4 and 5) takes a float32 scale and a
    zero point that is a constant 0 (or none)."""
    scale, zero = node.inputs[4], node.inputs[5] if len(node.inputs) > 5 else ""
    value = ctx.info(zero).value if zero else np.zeros((), np.int8)
    if value is None or np.any(value) or ctx.info(scale).dtype != np.float32:
        raise Unsupported(f"{node.op_type} quantizing with a zero point other than a constant 0 or a non-fp32 scale")


def gemm_dtype(dtypes: list[np.dtype], what: str) -> np.dtype:
    if len(set(dtypes)) != 1 or dtypes[0] not in ROW_SUFFIX:
        raise Unsupported(f"{what} over {[str(d) for d in dtypes]}")
    return dtypes[0]
