"""Lowering rule of pooling: Max/Average pooling and their global forms, 2-D (pool.cu; long linear global pools
run as reduce.cu's row reductions).
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
    nhwc_strides,
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


#: a channels-last global pool with fewer blocks than this (two per SM of an H100, which has 132) splits its rows
#: into bands pooled by blocks of their own, then pools the bands (a second launch of the same kernel): one block
#: pooling EfficientNet-B0's first 112x112 squeeze-and-excitation input at batch 1 reads 12,544 positions, and a
#: few blocks an SM keep too few loads in flight to reach the memory's bandwidth
_SPLIT_BELOW_BLOCKS = 264
#: the bands aim for this many blocks in all (four per H100 SM)
_SPLIT_TARGET_BLOCKS = 528
#: and split only where each position lane would otherwise load at least this many runs (short windows finish in
#: about the time of the second launch)
_SPLIT_MIN_LOADS = 16
#: a linear (NCHW) global pool over at least this many positions runs as a row reduction (reduce.cu, one block per
#: (n, c) row, coalesced); shorter windows keep pool2d, whose thread per (n, c) costs less than a block
_ROWS_MIN_POSITIONS = 256


@lowering_rule("MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool")
def _lower_pool(node: Node, ctx: LoweringContext) -> list:
    x, out = ctx.info(node.inputs[0]), ctx.info(node.outputs[0])
    if len(x.shape) != 4 or any(node.outputs[1:]):
        raise Unsupported(f"{node.op_type} that is not 2-D with one output")
    suffix = row_suffix(x.dtype, node.op_type)
    ctx.layouts[node.outputs[0]] = out_layout(node, ctx, spatial=True)
    geom = _pool_geom(node, ctx)
    total = int(np.prod(out.shape, dtype=np.int64))
    if total == 0:
        return []
    kind = "max_pool" if "Max" in node.op_type else "avg_pool"
    if _whole_window(geom):
        launches = _global_pool(node, ctx, geom, kind, suffix)
        if launches:
            return launches
    # the channels-last kernel: one thread per 16 bytes of contiguous channels, on arena tensors (256-byte
    # aligned; a caller's I/O address might not be 16-byte aligned)
    run = 16 // x.dtype.itemsize
    if ctx.layouts.get(node.inputs[0]) == "nhwc" and node.outputs[0] not in ctx.graph_outputs and geom.ys[1] == 1 \
            and geom.c % run == 0 and max(int(np.prod(x.shape)), total) < 2**31:
        kind, total = f"{kind}_nhwc", total // run
    return [Launch("pool", f"{kind}_{suffix}", grid_for(total), (THREADS, 1, 1), _args(node.inputs[0],
                                                                                        node.outputs[0], geom))]


def _pool_geom(node: Node, ctx: LoweringContext) -> PoolGeom:
    """The node's window, padding and tensor strides (the output's layout already chosen)."""
    n, c, h, w = ctx.info(node.inputs[0]).shape
    out = ctx.info(node.outputs[0])
    is_global = node.op_type.startswith("Global")
    kernel = (h, w) if is_global else tuple(node.attr("kernel_shape"))
    strides = tuple(node.attr("strides", None) or (1, 1))
    dilations = tuple(node.attr("dilations", None) or (1, 1))
    pads = list(node.attr("pads", None) or (0, 0, 0, 0))
    if not is_global and node.attr("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        oh, ow = out.shape[2:]
        total = [max((o - 1) * s + (k - 1) * d + 1 - i, 0) for o, s, k, d, i in
                 zip((oh, ow), strides, kernel, dilations, (h, w))]
        lower = node.attr("auto_pad") == "SAME_LOWER"
        begin = [(t + 1) // 2 if lower else t // 2 for t in total]
        pads = [begin[0], begin[1], total[0] - begin[0], total[1] - begin[1]]
    return _geom(ctx.strides(node.inputs[0]), ctx.strides(node.outputs[0]), n=n, c=c, h=h, w=w, oh=out.shape[2],
                 ow=out.shape[3], kh=kernel[0], kw=kernel[1], sh=strides[0], sw=strides[1], ph=pads[0], pw=pads[1],
                 ph_end=pads[2], pw_end=pads[3], dh=dilations[0], dw=dilations[1],
                 channels_last=int(ctx.layouts[node.outputs[0]] == "nhwc"),
                 count_include_pad=int(node.attr("count_include_pad", 0)))


def _geom(xs: tuple[int, ...], ys: tuple[int, ...], **values: int) -> PoolGeom:
    geom = PoolGeom()
    geom.xs[:] = xs
    geom.ys[:] = ys
    for key, value in values.items():
        setattr(geom, key, int(value))
    return geom


def _args(x: str, y: str, geom: PoolGeom) -> list:
    return [(Ref(x), ctypes.c_void_p), (Ref(y), ctypes.c_void_p), (geom, PoolGeom)]


def _whole_window(g: PoolGeom) -> bool:
    """A window that covers the whole unpadded input (global pools, and Max/AveragePool of the input's size): one
    output per (n, c), the same computation as GlobalMax/AveragePool."""
    return (g.kh, g.kw, g.oh, g.ow, g.dh, g.dw) == (g.h, g.w, 1, 1, 1, 1) and not (g.ph or g.pw or g.ph_end or g.pw_end)


def _global_pool(node: Node, ctx: LoweringContext, g: PoolGeom, kind: str, suffix: str) -> list:
    """The launches of a whole-window pool: pool_band_nhwc for channels-last input, reduce.cu's row reduction for a
    long linear one; [] where neither fits (pool2d then runs it)."""
    x, y = node.inputs[0], node.outputs[0]
    if ctx.layouts.get(x) == "nhwc":
        # the grid's y dimension counts images (at most 65,535); the kernel indexes within an image in 32 bits
        if (g.xs[1], g.xs[2], g.ys[1]) != (1, g.w * g.xs[3], 1) or g.h * g.w * g.c >= 2**31 or g.n > 65535:
            return []
        return _global_nhwc(node, ctx, g, kind, suffix)
    rows = g.n * g.c
    if g.h * g.w < _ROWS_MIN_POSITIONS or tuple(g.xs) != (g.c * g.h * g.w, g.h * g.w, g.w, 1) \
            or (g.ys[0], g.ys[1]) != (g.c, 1):
        return []
    function = "reduce_rows" if kind == "avg_pool" else "reduce_max_rows"
    cols = g.h * g.w
    return [Launch("reduce", f"{function}_{suffix}", (rows, 1, 1), (THREADS, 1, 1),
                   [(Ref(x), ctypes.c_void_p), (Ref(y), ctypes.c_void_p), (cols, ctypes.c_longlong),
                    (1.0 / cols, ctypes.c_float)])]


def _global_nhwc(node: Node, ctx: LoweringContext, g: PoolGeom, kind: str, suffix: str) -> list:
    """pool_band_nhwc over the whole image, or (few blocks: batch 1) over bands of rows into a step-local
    [N, C, bands, 1] channels-last buffer (the storage type, as a pool's output), then over the bands."""
    x, y = node.inputs[0], node.outputs[0]
    dtype = ctx.info(x).dtype
    vec = 16 // dtype.itemsize
    if g.c % vec:
        vec, kind = 1, f"{kind}_global_nhwc_scalar"
    else:
        kind = f"{kind}_global_nhwc"
    function = f"{kind}_{suffix}"
    runs = g.c // vec
    groups = -(-runs // 32)
    bx = -(-runs // groups)  # groups of equal size (144 runs: 5 of 29, not 4 of 32 and one of 16)
    bands = _bands(g.n * groups, g.h, g.w, THREADS // bx)
    if bands == 1:
        return [_band_launch(function, x, y, g, groups, bx)]
    band_shape = (g.n, g.c, bands, 1)
    band_strides = nhwc_strides(band_shape)
    partial = ctx.new_scratch(f"{node.name}#bands", dtype, band_shape).tensor
    rows = g.h // bands
    first = _geom(tuple(g.xs), band_strides, n=g.n, c=g.c, h=g.h, w=g.w, oh=bands, ow=1, kh=rows, kw=g.w, sh=rows,
                  sw=1, ph=0, pw=0, ph_end=0, pw_end=0, dh=1, dw=1, channels_last=1, count_include_pad=0)
    second = _geom(band_strides, tuple(g.ys), n=g.n, c=g.c, h=bands, w=1, oh=1, ow=1, kh=bands, kw=1, sh=1, sw=1,
                   ph=0, pw=0, ph_end=0, pw_end=0, dh=1, dw=1, channels_last=1, count_include_pad=0)
    return [_band_launch(function, x, partial, first, groups, bx),
            _band_launch(function, partial, y, second, groups, bx)]


def _bands(blocks: int, h: int, w: int, lanes: int) -> int:
    """How many bands of rows a channels-last global pool of ``blocks`` blocks (images x channel groups) splits
    into: 1 (no split) with blocks enough for the GPU or a short window, else the fewest bands (a divisor of ``h``:
    equal bands, so the mean of their means is the mean) that reach _SPLIT_TARGET_BLOCKS, at most ``h``."""
    if blocks >= _SPLIT_BELOW_BLOCKS or h < 2 or h * w < _SPLIT_MIN_LOADS * lanes:
        return 1
    want = -(-_SPLIT_TARGET_BLOCKS // blocks)
    return next((d for d in range(want, h) if h % d == 0), h)


def _band_launch(function: str, x: str, y: str, g: PoolGeom, groups: int, bx: int) -> Launch:
    """pool_band_nhwc: grid (channel groups, images, bands), block (bx runs, position lanes) of at most THREADS."""
    lanes = max(1, min(THREADS // bx, g.kh * g.w))
    return Launch("pool", function, (groups, g.n, g.oh), (bx, lanes, 1), _args(x, y, g))
