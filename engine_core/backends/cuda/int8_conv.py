"""``kiln.QConv`` on the GPU: an implicit GEMM on the INT8 cuBLASLt step (``Int8Gemm``) plus one epilogue.

Lowering, with activations channels-last (NHWC) int8:

1. the GEMM operand ``cols`` [N*OH*OW, R*S*C]: a 1x1 stride-1 unpadded convolution reads the input itself
   (NHWC *is* [N*H*W, C]); otherwise (when the convolution pads) a zero-filled scratch [N, Hp, Wp, C] gets
   the input copied into its interior, from any layout, and one strided copy reads it (or the NHWC input) as
   the 6-D view [N, OH, OW, R, S, C] (strides Hp*Wp*C, sh*Wp*C, sw*C, dh*Wp*C, dw*C, 1) into ``cols``:
   im2col with the generated pointwise copy kernel, no new kernel;
2. ``Int8Gemm``: acc[N*OH*OW, K] (int32) = cols @ W^T with W as [K, R*S*C] rows (the existing "krsc"
   weight transform);
3. one generated pointwise program: ``act(float(acc) * x_scale * w_scale[k] + bias[k] + residual)``, with
   ``y_scale`` a Cast to the float type and QuantizeLinear to int8, written in the output's layout
   (NHWC unless a graph output): the CPU op's order and rounding (engine_core/ops/fused.py).

**The int8-output GEMM** (``LoweringOptions.int8_requant``, on when the build's probe finds cuBLASLt's int8-output
IMMA algorithms): a requantizing layer with constant scales and bias, ReLU or no activation, replaces steps 2-3
by one ``Int8GemmRequant`` call writing the int8 NHWC output (alpha = x_scale * w_scale[k] / y_scale as a device
vector, bias / y_scale through the bias epilogue, an int8 residual through C with beta = its scale / y_scale).
The int32 accumulators then never reach memory: for ResNet-50 at batch 128 that is ~11 GB of traffic less than
steps 2-3. It rounds once where the CPU op rounds at each step, so outputs may differ by one quantization step.

**The cuDNN INT8 graph** (``LoweringOptions.cudnn_int8``, on when the build's probe builds one) runs the whole
layer, requantization included, as one cuDNN convolution (``_cudnn_conv``); it is tried first.

cuBLASLt's IMMA kernels (and cuDNN's INT8 ones) need C and K to be multiples of 4; fuse_qdq_conv fuses no
convolution with other input channels (an RGB stem stays a float convolution), and K % 4 != 0 or a residual
that widens the output raise Unsupported: the layer then runs on the host, visibly.
"""

from __future__ import annotations

import numpy as np

from engine_core.backends.cuda.int8_gemm import INT8, INT32, Int8Gemm, Int8GemmRequant, dequant_program
from engine_core.backends.cuda.lowering_context import (
    Conv,
    Launch,
    LoweringContext,
    Ref,
    copy_launch,
    launch_program,
    lowering_rule,
    nhwc_strides,
    optional_input,
    same_bytes_in_both_layouts,
)
from engine_core.backends.cuda.pointwise import (
    FLOATS,
    Unsupported,
    broadcast_strides,
    contiguous_strides,
    program_kernel,
)
from engine_core.ir import Node
from engine_core.ops import TensorInfo
from engine_core.ops.fused import _conv_node
from engine_core.ops.nn import Window, window_geometry

#: cuBLASLt IMMA: the reduction and the output columns must be multiples of this
ALIGN = 4


def _geometry(node: Node, x: TensorInfo, w: TensorInfo) -> Window:
    return window_geometry(_conv_node(node), x.shape[2:], w.shape[2:])


#: copy word types by size: int8 data moves as the widest word that its innermost run and offsets allow
_WORDS = {8: np.dtype(np.int64), 4: np.dtype(np.int32), 2: np.dtype(np.int16)}


def _byte_copy(ctx: LoweringContext, dst: Ref, src: Ref, shape: tuple[int, ...], dst_strides: tuple[int, ...],
               src_strides: tuple[int, ...]) -> Launch:
    """A strided int8 copy, moved in 8/4/2-byte words when the innermost dimension is contiguous on both sides
    (or a broadcast zero) and every other stride and both offsets are multiples of the word. Why: im2col copies
    whole channel runs (C is a multiple of 4 here), and one thread per byte made it the implicit GEMM's largest
    cost; the kernels index elements of the launch's type, so a word-sized view needs no new kernel."""
    inner = shape[-1]
    for size, word in _WORDS.items():
        if inner % size or dst.offset % size or src.offset % size or dst_strides[-1] != 1 \
                or src_strides[-1] not in (0, 1) or any(s % size for s in (*dst_strides[:-1], *src_strides[:-1])):
            continue
        words = (*shape[:-1], inner // size)
        scale = [(*(s // size for s in strides[:-1]), strides[-1]) for strides in (dst_strides, src_strides)]
        return copy_launch(ctx, word, dst, src, words, *scale)
    return copy_launch(ctx, INT8, dst, src, shape, dst_strides, src_strides)


def _fill_zero(node: Node, ctx: LoweringContext, target: Ref, count: int) -> Launch:
    """``count`` int8 zeros at ``target``: a copy from one folded zero word read with stride 0."""
    zero = ctx.fold(f"{node.name}#zero", np.zeros((8,), np.int8))
    return _byte_copy(ctx, target, zero, (count,), (1,), (0,))


def _nhwc_order(strides: tuple[int, ...]) -> tuple[int, ...]:
    """NCHW-indexed strides reordered to index (N, H, W, C)."""
    n, c, h, w = strides
    return n, h, w, c


def _columns(node: Node, ctx: LoweringContext, xin: str, win: Window) -> tuple[Ref, list[Launch]]:
    """The GEMM's left operand [N*OH*OW, R*S*C] (int8, row-major) and the launches that build it."""
    n, c, h, w = ctx.info(xin).shape
    (kh, kw), (sh, sw), (dh, dw) = win.kernel, win.strides, win.dilations
    (pt, pl), (oh, ow) = win.pads_begin, win.out
    pads = any(win.pads_begin) or any(win.pads_end)
    if not pads and (kh, kw, sh, sw) == (1, 1, 1, 1):
        return Ref(xin), []  # NHWC [N, H, W, C] is already [N*H*W, C]
    ops: list[Launch] = []
    if pads:
        hp = max(pt + h, (oh - 1) * sh + (kh - 1) * dh + 1)
        wp = max(pl + w, (ow - 1) * sw + (kw - 1) * dw + 1)
        source = ctx.new_scratch(f"{node.name}#padded", INT8, (n, hp, wp, c))
        ops.append(_fill_zero(node, ctx, source, n * hp * wp * c))
        interior = Ref(source.tensor, (pt * wp + pl) * c)
        ops.append(_byte_copy(ctx, interior, Ref(xin), (n, h, w, c), (hp * wp * c, wp * c, c, 1),
                              _nhwc_order(ctx.strides(xin))))
    else:
        source, hp, wp = Ref(xin), h, w
    view = (n, oh, ow, kh, kw, c)
    cols = ctx.new_scratch(f"{node.name}#cols", INT8, (n * oh * ow, kh * kw * c))
    ops.append(_byte_copy(ctx, cols, source, view, contiguous_strides(view),
                          (hp * wp * c, sh * wp * c, sw * c, dh * wp * c, dw * c, 1)))
    return cols, ops


def _weight_rows(node: Node, ctx: LoweringContext) -> Ref:
    """The weight as [K, R*S*C] int8 rows (KRSC): the engine's "krsc" weight transform."""
    name = node.inputs[2]
    w = ctx.info(name)
    derived = f"{name}#krsc"
    ctx.weight_transforms[derived] = (name, "krsc")
    ctx.infos[derived] = TensorInfo(w.dtype, tuple(w.shape))
    return Ref(derived)


def _channel_strides(ctx: LoweringContext, name: str, rank: int) -> tuple[int, ...]:
    """Strides reading a per-tensor (stride 0) or per-channel (axis 1) vector along an NCHW output."""
    size = int(np.prod(ctx.info(name).shape, dtype=np.int64))
    return tuple(1 if d == 1 and size > 1 else 0 for d in range(rank))


def _epilogue(node: Node, ctx: LoweringContext, acc: Ref, out_name: str) -> Launch:
    """One generated kernel: act(float(acc) * x_scale * w_scale[k] + bias[k] + residual) -> the output;
    with y_scale then Cast to the float type and QuantizeLinear -> int8 (the CPU op's order). An int8 residual
    is dequantized by its scale first."""
    out = ctx.info(out_name)
    bias, residual, y_scale, r_scale = (optional_input(node, i) for i in (4, 5, 6, 7))
    inputs = [acc.tensor, node.inputs[1], node.inputs[3], *[n for n in (bias, residual, r_scale, y_scale) if n]]
    dequantize = {inputs.index(residual): inputs.index(r_scale)} if r_scale else {}
    nodes = dequant_program(node, ctx, len(inputs), [inputs.index(n) for n in (bias, residual) if n], bool(y_scale),
                            INT8, dequantize)
    rank = len(out.shape)
    strides = [nhwc_strides(out.shape), (0,) * rank, _channel_strides(ctx, node.inputs[3], rank)]
    if bias:
        strides.append(_channel_strides(ctx, bias, rank))
    if residual:
        strides.append(broadcast_strides(ctx.info(residual).shape, out.shape, ctx.strides(residual)))
    strides += [(0,) * rank] * (bool(r_scale) + bool(y_scale))
    kernel = ctx.kernel(program_kernel(nodes, out.dtype, [ctx.info(n).dtype for n in inputs]))
    return launch_program(kernel, Ref(out_name), [Ref(n) for n in inputs], out.shape, ctx.strides(out_name), strides)


def _constant(ctx: LoweringContext, name: str) -> np.ndarray | None:
    value = ctx.constant(name)
    return None if value is None else np.asarray(value, np.float64)


def _constant_epilogue(node: Node, ctx: LoweringContext) -> dict[str, np.ndarray] | None:
    """The values of the layer's scales and bias when all are known at build time (the single-call lowerings
    fold them), else None."""
    names = (node.inputs[1], node.inputs[3], *(optional_input(node, i) for i in (6, 4, 7)))
    values = {name: _constant(ctx, name) for name in names if name}
    return None if any(v is None for v in values.values()) else values


def _same_memory_order(shape: tuple[int, ...], a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Whether two stride tuples address a tensor of ``shape`` identically (size-1 dims do not count)."""
    return all(x == y for d, x, y in zip(shape, a, b) if d != 1)


def _requant_gemm(node: Node, ctx: LoweringContext, cols: Ref, weight: Ref, m: int, k: int, reduction: int,
                  out_name: str) -> Int8GemmRequant | None:
    """The whole layer as one cuBLASLt call writing the int8 output channels-last (``Int8GemmRequant``), or None
    when it does not apply: the GPU's cuBLASLt lacks the algorithms (``ctx.options.int8_requant``), the layer
    does not requantize, its activation is not ReLU, a scale or the bias is computed at run time, or the
    residual is not an int8 tensor laid out like the output."""
    y_scale, residual, r_scale = (optional_input(node, i) for i in (6, 5, 7))
    if not ctx.options.int8_requant or not y_scale or node.attr("activation", "") not in ("", "Relu"):
        return None
    out = ctx.info(out_name)
    if not _same_memory_order(out.shape, ctx.strides(out_name), nhwc_strides(out.shape)):
        return None
    values = _constant_epilogue(node, ctx)
    if values is None:
        return None
    c = None
    if residual:
        if not r_scale or tuple(ctx.info(residual).shape) != tuple(out.shape):
            return None
        if not _same_memory_order(out.shape, ctx.strides(residual), nhwc_strides(out.shape)):
            # a reformat copy moves 2 bytes per element; the int32 path's epilogue moves 9
            ctx.renamed[residual] = ctx.as_layout(residual, "nhwc")
        c = Ref(ctx.renamed.get(residual, residual))
    alpha, folded_bias, beta = _folded_scales(node, ctx, values, k)
    return Int8GemmRequant(cols, weight, Ref(out_name), m, k, reduction, alpha=alpha, bias=folded_bias, c=c,
                           beta=float(beta[0]) if residual else 0.0, relu=node.attr("activation", "") == "Relu")


def _folded_scales(node: Node, ctx: LoweringContext, values: dict[str, np.ndarray],
                   k: int) -> tuple[Ref, Ref | None, np.ndarray]:
    """The requantizing epilogue's constants folded for one float32 pass over the INT32 sums: (alpha = x_scale *
    w_scale[k] / y_scale as a folded [K] vector, bias / y_scale folded or None, the residual's multiplier
    r_scale / y_scale per channel: 1 / y_scale for a float residual). Without y_scale (a float output) it is 1."""
    y_scale, bias, r_scale = (optional_input(node, i) for i in (6, 4, 7))
    out_scale = float(values[y_scale].reshape(())) if y_scale else 1.0
    alpha = float(values[node.inputs[1]].reshape(())) * np.broadcast_to(values[node.inputs[3]].reshape(-1), (k,))
    folded_alpha = ctx.fold(f"{node.name}#alpha", (alpha / out_scale).astype(np.float32))
    folded_bias = ctx.fold(f"{node.name}#bias", (values[bias].reshape(-1) / out_scale).astype(np.float32)) if bias else None
    beta = np.full((k,), (float(values[r_scale].reshape(())) if r_scale else 1.0) / out_scale, np.float32)
    return folded_alpha, folded_bias, beta


def _cudnn_conv(node: Node, ctx: LoweringContext, win: Window, out_name: str) -> Conv | None:
    """The whole layer as one cuDNN INT8 graph (``LoweringOptions.cudnn_int8``: int8 NHWC x, KRSC w, INT32 sums,
    the requantizing epilogue in float32, the output written NHWC), or None when it does not apply: no cuDNN
    INT8 here, an activation other than ReLU, a scale or the bias computed at run time, a residual of another
    shape or type, or an output that is a graph output or flat (their layouts stay linear)."""
    x, w, out = ctx.info(node.inputs[0]), ctx.info(node.inputs[2]), ctx.info(out_name)
    residual, r_scale = optional_input(node, 5), optional_input(node, 7)
    if not ctx.options.cudnn_int8 or ctx.layouts.get(out_name) != "nhwc" or node.attr("activation", "") not in ("", "Relu"):
        return None
    values = _constant_epilogue(node, ctx)
    if values is None:
        return None
    if residual and (tuple(ctx.info(residual).shape) != tuple(out.shape)
                     or (ctx.info(residual).dtype == INT8) != bool(r_scale)):
        return None
    k, c, kh, kw = w.shape
    scale, folded_bias, beta = _folded_scales(node, ctx, values, k)
    xin = ctx.as_layout(node.inputs[0], "nhwc")
    ctx.renamed[node.inputs[0]] = xin
    weight = _weight_rows(node, ctx)
    z = z_scale = None
    if residual:
        z = Ref(ctx.as_layout(residual, "nhwc"))
        ctx.renamed[residual] = z.tensor
        z_scale = ctx.fold(f"{node.name}#z_scale", beta)
    return Conv(Ref(xin), weight, Ref(out_name), folded_bias, z, tuple(x.shape), tuple(w.shape), tuple(out.shape),
                nhwc_strides(x.shape), (kh * kw * c, 1, kw * c, c), ctx.strides(out_name),
                nhwc_strides(out.shape) if residual else None, win.pads_begin, win.pads_end, win.strides,
                win.dilations, INT8, node.attr("activation", ""), scale=scale, z_scale=z_scale,
                z_dtype=ctx.info(residual).dtype if residual else None, y_dtype=out.dtype)


def _check(node: Node, ctx: LoweringContext) -> None:
    """Raise Unsupported for what this lowering does not take (the layer then runs on the host)."""
    x, w, out = ctx.info(node.inputs[0]), ctx.info(node.inputs[2]), ctx.info(node.outputs[0])
    if x.dtype != INT8 or w.dtype != INT8 or len(x.shape) != 4 or len(w.shape) != 4:
        raise Unsupported(f"QConv over {x.dtype} {x.shape} x {w.dtype} {w.shape}")
    if node.inputs[2] not in ctx.constants:
        raise Unsupported("QConv with a computed weight")
    if w.shape[0] % ALIGN or w.shape[1] % ALIGN:
        raise Unsupported(f"INT8 convolutions need input and output channels multiples of {ALIGN}, got "
                          f"{w.shape[1]} and {w.shape[0]}")
    y_scale, r_scale = optional_input(node, 6), optional_input(node, 7)
    floats = (node.inputs[1], node.inputs[3], optional_input(node, 4), "" if r_scale else optional_input(node, 5),
              y_scale, r_scale)
    for name in floats:
        if name and ctx.info(name).dtype not in FLOATS:
            raise Unsupported(f"QConv {name} is {ctx.info(name).dtype}, not a float type")
    if (out.dtype == INT8) != bool(y_scale) or (not y_scale and out.dtype not in FLOATS):
        raise Unsupported(f"QConv writing {out.dtype} ({'with' if y_scale else 'without'} an output scale)")


@lowering_rule("QConv")
def lower_qconv(node: Node, ctx: LoweringContext) -> list:
    """``kiln.QConv`` -> [im2col copies (when needed), Int8GemmRequant writing the int8 output] when
    ``_requant_gemm`` applies, else [..., Int8Gemm into a step-local int32 buffer, the epilogue]."""
    _check(node, ctx)
    x, w, out = ctx.info(node.inputs[0]), ctx.info(node.inputs[2]), ctx.info(node.outputs[0])
    win = _geometry(node, x, w)
    n, c = x.shape[:2]
    k = w.shape[0]
    if tuple(out.shape) != (n, k, *win.out):  # a residual that broadcasts wider than the convolution
        raise Unsupported(f"QConv output {out.shape} is wider than its convolution {(n, k, *win.out)}")
    out_name = node.outputs[0]
    flat = out_name in ctx.graph_outputs or same_bytes_in_both_layouts(out.shape)
    ctx.layouts[out_name] = "linear" if flat else "nhwc"
    conv = _cudnn_conv(node, ctx, win, out_name)
    if conv is not None:
        return [conv] if int(np.prod(out.shape)) else []
    xin = node.inputs[0]
    if not any(win.pads_begin) and not any(win.pads_end):  # cols read x itself: NHWC needed
        xin = ctx.as_layout(xin, "nhwc")
        ctx.renamed[node.inputs[0]] = xin
    m = n * win.out[0] * win.out[1]
    if m * k == 0:
        return []
    cols, ops = _columns(node, ctx, xin, win)
    weight = _weight_rows(node, ctx)
    requant = _requant_gemm(node, ctx, cols, weight, m, k, win.size * c, out_name)
    if requant is not None:
        return [*ops, requant]
    acc = ctx.new_scratch(f"{node.name}#acc", INT32, (m, k))
    gemm = Int8Gemm(cols, weight, acc, m, k, win.size * c)
    return [*ops, gemm, _epilogue(node, ctx, acc, out_name)]
