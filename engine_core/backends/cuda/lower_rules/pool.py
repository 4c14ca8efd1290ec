"""Lowering rule of pooling: Max/Average pooling and their global forms, 2-D (pool.cu).
"""

from __future__ import annotations

import ctypes

import numpy as np

from engine_core.backends.cuda.lower_rules.common import (
    out_layout,
    row_suffix,
)
from engine_core.backends.cuda.lowering_context import (
    THREADS,
    Launch,
    LoweringContext,
    Ref,
    grid_for,
    lowering_rule,
)
from engine_core.backends.cuda.pointwise import (
    Unsupported,
)
from engine_core.ir import Node


class PoolGeom(ctypes.Structure):
    """Mirror of ``struct KilnPoolGeom`` (cuda_kernels/pool.cu)."""

    _fields_ = [("xs", ctypes.c_longlong * 4), ("ys", ctypes.c_longlong * 4)] + [
        (name, ctypes.c_int) for name in ("n", "c", "h", "w", "oh", "ow", "kh", "kw", "sh", "sw", "ph", "pw",
                                          "ph_end", "pw_end", "dh", "dw", "channels_last", "count_include_pad")]


@lowering_rule("MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool")
def _lower_pool(node: Node, ctx: LoweringContext) -> list:
    x, out = ctx.info(node.inputs[0]), ctx.info(node.outputs[0])
    if len(x.shape) != 4 or any(node.outputs[1:]):
        raise Unsupported(f"{node.op_type} that is not 2-D with one output")
    suffix = row_suffix(x.dtype, node.op_type)
    n, c, h, w = x.shape
    is_global = node.op_type.startswith("Global")
    kernel = (1, 1) if is_global else tuple(node.attr("kernel_shape"))
    strides = tuple(node.attr("strides", None) or (1, 1))
    dilations = tuple(node.attr("dilations", None) or (1, 1))
    pads = list(node.attr("pads", None) or (0, 0, 0, 0))
    if is_global:
        kernel = (h, w)
    elif node.attr("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        oh, ow = out.shape[2:]
        total = [max((o - 1) * s + (k - 1) * d + 1 - i, 0) for o, s, k, d, i in
                 zip((oh, ow), strides, kernel, dilations, (h, w))]
        lower = node.attr("auto_pad") == "SAME_LOWER"
        begin = [(t + 1) // 2 if lower else t // 2 for t in total]
        pads = [begin[0], begin[1], total[0] - begin[0], total[1] - begin[1]]
    ctx.layouts[node.outputs[0]] = out_layout(node, ctx, spatial=True)
    geom = PoolGeom()
    geom.xs[:] = ctx.strides(node.inputs[0])
    geom.ys[:] = ctx.strides(node.outputs[0])
    values = dict(n=n, c=c, h=h, w=w, oh=out.shape[2], ow=out.shape[3], kh=kernel[0], kw=kernel[1], sh=strides[0],
                  sw=strides[1], ph=pads[0], pw=pads[1], ph_end=pads[2], pw_end=pads[3], dh=dilations[0],
                  dw=dilations[1], channels_last=int(ctx.layouts[node.outputs[0]] == "nhwc"),
                  count_include_pad=int(node.attr("count_include_pad", 0)))
    for key, value in values.items():
        setattr(geom, key, int(value))
    total = int(np.prod(out.shape, dtype=np.int64))
    if total == 0:
        return []
    kind = "max_pool" if "Max" in node.op_type else "avg_pool"
    # the channels-last kernel: one thread per 16 bytes of contiguous channels, on arena tensors (256-byte
    # aligned; a caller's I/O address might not be 16-byte aligned)
    run = 16 // x.dtype.itemsize
    if ctx.layouts.get(node.inputs[0]) == "nhwc" and node.outputs[0] not in ctx.graph_outputs and geom.ys[1] == 1 \
            and c % run == 0 and max(int(np.prod(x.shape)), total) < 2**31:
        kind, total = f"{kind}_nhwc", total // run
    return [Launch("pool", f"{kind}_{suffix}", grid_for(total), (THREADS, 1, 1),
                   [(Ref(node.inputs[0]), ctypes.c_void_p), (Ref(node.outputs[0]), ctypes.c_void_p),
                    (geom, PoolGeom)])]
