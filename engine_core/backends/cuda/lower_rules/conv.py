"""Lowering rule of float convolutions: Conv and ``kiln.FusedConv`` (2-D) through cuDNN, and depthwise
convolutions through Kiln's direct kernel (cuda_kernels/depthwise_conv.cu).
"""

from __future__ import annotations

import ctypes

import numpy as np

from engine_core.backends.cuda.lower_rules.common import (
    gemm_dtype,
    row_suffix,
)
from engine_core.backends.cuda.lower_rules.gemm import epilogue
from engine_core.backends.cuda.lowering_context import (
    F32,
    THREADS,
    Conv,
    Launch,
    LoweringContext,
    LoweringOptions,
    Ref,
    copy_launch,
    grid_for,
    lowering_rule,
    nhwc_strides,
)
from engine_core.backends.cuda.pointwise import (
    Unsupported,
    contiguous_strides,
)
from engine_core.ir import Node
from engine_core.ops import TensorInfo

#: depthwise convolutions (group == C_in == C_out) on channels-last activations run Kiln's direct kernel
#: (``_lower_depthwise``); False sends them to cuDNN like every other convolution. Why a switch: benchmarks compare
#: the two. It is read when a graph is lowered, and the runner lowers again per set of input shapes: set it before
#: building an engine and keep it while that engine runs
DEPTHWISE_KERNEL = True
#: FusedConv activations the depthwise kernel applies in registers -> its code (KilnDwGeom.activation); others
#: follow as a generated epilogue kernel
DEPTHWISE_ACTIVATIONS = {"": 0, "Relu": 1, "Clip": 2, "LeakyRelu": 3, "Sigmoid": 4}
#: filter sizes the depthwise kernel takes (each side); larger ones stay with cuDNN
DEPTHWISE_MAX_TAPS = 7


class DepthwiseGeom(ctypes.Structure):
    """Mirror of ``struct KilnDwGeom`` (cuda_kernels/depthwise_conv.cu)."""

    _fields_ = [(name, ctypes.c_int) for name in ("n", "c", "h", "w", "oh", "ow", "kh", "kw", "sh", "sw", "ph", "pw",
                                                  "dh", "dw", "activation")] + \
        [("alpha", ctypes.c_float), ("beta", ctypes.c_float)]


@lowering_rule("Conv", "FusedConv")
def _lower_conv(node: Node, ctx: LoweringContext) -> list:
    """Conv / ``kiln.FusedConv`` (2-D) through cuDNN, channels-last activations and KRSC filters; a depthwise one
    through Kiln's kernel (``_lower_depthwise``), which needs no cuDNN."""
    x, w, out = ctx.info(node.inputs[0]), ctx.info(node.inputs[1]), ctx.info(node.outputs[0])
    dtype = gemm_dtype([x.dtype, w.dtype, out.dtype], node.op_type)
    if len(x.shape) != 4 or node.inputs[1] not in ctx.constants:
        raise Unsupported("convolution that is not 2-D with constant weights")
    activation = node.attr("activation", "") if node.op_type == "FusedConv" else ""
    kernel = w.shape[2:]
    strides = tuple(node.attr("strides", None) or (1, 1))
    dilations = tuple(node.attr("dilations", None) or (1, 1))
    pads = list(node.attr("pads", None) or (0, 0, 0, 0))
    auto_pad = node.attr("auto_pad", "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        total = [max((o - 1) * s + (k - 1) * d + 1 - i, 0) for o, s, k, d, i in
                 zip(out.shape[2:], strides, kernel, dilations, x.shape[2:])]
        begin = [(t + 1) // 2 if auto_pad == "SAME_LOWER" else t // 2 for t in total]
        pads = [begin[0], begin[1], total[0] - begin[0], total[1] - begin[1]]
    elif auto_pad == "VALID":
        pads = [0, 0, 0, 0]
    group = int(node.attr("group", 1))
    if w.shape[1] * group != x.shape[1]:
        raise Unsupported("convolution whose group does not match its shapes")
    bias = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2] else None
    residual = node.inputs[3] if node.op_type == "FusedConv" and len(node.inputs) > 3 and node.inputs[3] else None
    if bias and (ctx.info(bias).dtype != dtype or ctx.info(bias).shape != (out.shape[1],)):
        raise Unsupported("convolution bias of another dtype or shape")
    conv_shape = (x.shape[0], w.shape[0], *[(i + p0 + p1 - d * (k - 1) - 1) // st + 1 for i, p0, p1, d, k, st in
                                            zip(x.shape[2:], pads[:2], pads[2:], dilations, kernel, strides)])
    if tuple(conv_shape) != tuple(out.shape):  # a residual that broadcasts wider than the convolution
        raise Unsupported(f"FusedConv output {out.shape} is wider than its convolution {tuple(conv_shape)}")
    if takes_depthwise_kernel(x.shape, w.shape, out.shape, group, dtype, ctx.options):
        return _lower_depthwise(node, ctx, dtype, (pads[0], pads[1]), strides, dilations, bias, residual,
                                activation)
    if not ctx.options.cudnn:
        raise Unsupported("convolution needs the cuDNN frontend (pip install kiln[gpu])")
    nchw = conv_layout(dtype, ctx.options) == "linear"
    xin = ctx.as_layout(node.inputs[0], "linear" if nchw else "nhwc")
    # channels-last: a graph output (linear) gets cuDNN's result through a step-local buffer and a reformat
    result = node.outputs[0]
    y_name = result
    if result in ctx.graph_outputs and not nchw:
        y_name = ctx.new_scratch(f"{node.name}#conv", out.dtype, tuple(out.shape)).tensor
    wname = node.inputs[1]
    if not nchw:
        ctx.layouts[y_name] = "nhwc"
        wname = f"{node.inputs[1]}#krsc"
        ctx.weight_transforms[wname] = (node.inputs[1], "krsc")
        ctx.infos[wname] = TensorInfo(w.dtype, w.shape)
    # cuDNN fuses a same-shape residual and ReLU; anything else follows as one generated epilogue kernel
    fused_residual = residual if residual and ctx.info(residual).shape == out.shape and \
        ctx.info(residual).dtype == dtype else None
    fused_activation = activation if activation in ("", "Relu") and (fused_residual or not residual) else ""
    ctx.renamed[node.inputs[0]] = xin
    if int(np.prod(out.shape)) == 0:
        return []
    alpha, beta = float(node.attr("activation_alpha", 0.01)), float(node.attr("activation_beta", 0.0))
    conv = Conv(Ref(xin), Ref(wname), Ref(y_name), Ref(bias) if bias else None,
                Ref(fused_residual) if fused_residual else None, tuple(x.shape), tuple(w.shape), tuple(out.shape),
                ctx.strides(xin), contiguous_strides(w.shape) if nchw else nhwc_strides(w.shape), ctx.strides(y_name),
                ctx.strides(fused_residual) if fused_residual else None, (pads[0], pads[1]), (pads[2], pads[3]),
                strides, dilations, dtype, fused_activation, tf32=ctx.options.tf32)
    if bias or fused_residual or fused_activation:
        conv.fallback = epilogue(node, ctx, bias, fused_activation, alpha, beta, fused_residual, y_name,
                                  bias_axis=1)
    if fused_residual or fused_activation:
        conv.rest = epilogue(node, ctx, None, fused_activation, alpha, beta, fused_residual, y_name)
    return [conv, *_unfused_rest(node, ctx, activation, fused_activation, alpha, beta, residual, fused_residual,
                                 y_name, result)]


def _unfused_rest(node: Node, ctx: LoweringContext, activation: str, fused_activation: str, alpha: float, beta: float,
                  residual: str | None, fused_residual: str | None, y_name: str, result: str) -> list:
    """What follows a convolution (cuDNN's or the depthwise kernel's): the activation and residual it did not fuse,
    as one epilogue kernel, then the copy to a graph output when the conv wrote a step-local buffer."""
    rest = epilogue(node, ctx, None, "" if fused_activation else activation, alpha, beta,
                    None if fused_residual else residual, y_name)
    if y_name != result:
        out = ctx.info(result)
        rest.append(copy_launch(ctx, out.dtype, Ref(result), Ref(y_name), out.shape, contiguous_strides(out.shape),
                                ctx.strides(y_name)))
    return rest


def takes_depthwise_kernel(x_shape: tuple[int, ...], w_shape: tuple[int, ...], out_shape: tuple[int, ...],
                           group: int, dtype: np.dtype, options: LoweringOptions) -> bool:
    """Whether a 2-D float convolution runs Kiln's depthwise kernel: one filter per channel (group == C_in == C_out,
    channel multiplier 1), channels-last (not strict fp32 over NCHW), filters up to DEPTHWISE_MAX_TAPS a side, and
    tensors the kernel's 32-bit index math reaches."""
    channels = x_shape[1]
    return DEPTHWISE_KERNEL and conv_layout(dtype, options) == "nhwc" and channels > 1 and \
        group == channels == w_shape[0] == out_shape[1] and w_shape[1] == 1 and \
        max(w_shape[2:]) <= DEPTHWISE_MAX_TAPS and \
        max(int(np.prod(x_shape, dtype=np.int64)), int(np.prod(out_shape, dtype=np.int64))) < 2**31


def _lower_depthwise(node: Node, ctx: LoweringContext, dtype: np.dtype, pads: tuple[int, int],
                     strides: tuple[int, ...], dilations: tuple[int, ...], bias: str | None, residual: str | None,
                     activation: str) -> list:
    """A depthwise convolution as one launch of cuda_kernels/depthwise_conv.cu: channels-last input and output,
    filters as [kh, kw, C] (weight transform "rskc"), bias, a same-shape channels-last residual and the activation
    applied in registers. A residual or activation the kernel does not take follows as a generated epilogue kernel
    (the activation then too: it applies after the residual add)."""
    x, out = ctx.info(node.inputs[0]), ctx.info(node.outputs[0])
    n, c, h, w = x.shape
    kh, kw = ctx.info(node.inputs[1]).shape[2:]
    xin = ctx.as_layout(node.inputs[0], "nhwc")
    ctx.renamed[node.inputs[0]] = xin
    if residual == node.inputs[0]:  # the step will list only the renamed copy: read that one (channels-last too)
        residual = xin
    # a graph output (linear) gets the kernel's channels-last result through a step-local buffer and a reformat
    result = node.outputs[0]
    y_name = ctx.new_scratch(f"{node.name}#conv", out.dtype, tuple(out.shape)).tensor \
        if result in ctx.graph_outputs else result
    ctx.layouts[y_name] = "nhwc"
    wname = f"{node.inputs[1]}#rskc"
    ctx.weight_transforms[wname] = (node.inputs[1], "rskc")
    ctx.infos[wname] = TensorInfo(dtype, (kh, kw, c, 1))
    if int(np.prod(out.shape)) == 0:
        return []
    fused_residual = residual if residual and ctx.info(residual).shape == out.shape and \
        ctx.info(residual).dtype == dtype and ctx.strides(residual) == ctx.strides(y_name) else None
    fused_activation = activation if activation in DEPTHWISE_ACTIVATIONS and (fused_residual or not residual) else ""
    alpha, beta = float(node.attr("activation_alpha", 0.01)), float(node.attr("activation_beta", 0.0))
    if fused_activation == "Clip":  # the bounds as the ONNX op compares them: in the storage type
        alpha, beta = (float(np.asarray(v, dtype).astype(np.float32)) for v in (alpha, beta))
    oh, ow = out.shape[2:]
    geom = DepthwiseGeom(n=n, c=c, h=h, w=w, oh=oh, ow=ow, kh=kh, kw=kw, sh=strides[0], sw=strides[1], ph=pads[0],
                         pw=pads[1], dh=dilations[0], dw=dilations[1],
                         activation=DEPTHWISE_ACTIVATIONS[fused_activation], alpha=alpha, beta=beta)
    run, tile = 16 // dtype.itemsize, 1
    if c % run:  # channel runs would not be 16-byte aligned: one channel per thread
        function, run = "depthwise_conv_scalar", 1
    elif kw in (3, 5, 7) and strides[1] in (1, 2) and dilations[1] == 1:
        function, tile = f"depthwise_conv_k{kw}s{strides[1]}", depthwise_tile(kw, strides[1])
    else:
        function = "depthwise_conv"
    threads = n * oh * -(-ow // tile) * (c // run)
    launch = Launch("depthwise_conv", f"{function}_{row_suffix(dtype, node.op_type)}", grid_for(threads),
                    (THREADS, 1, 1),
                    [(Ref(xin), ctypes.c_void_p), (Ref(wname), ctypes.c_void_p),
                     (Ref(bias) if bias else 0, ctypes.c_void_p),
                     (Ref(fused_residual) if fused_residual else 0, ctypes.c_void_p),
                     (Ref(y_name), ctypes.c_void_p), (geom, DepthwiseGeom)])
    return [launch, *_unfused_rest(node, ctx, activation, fused_activation, alpha, beta, residual, fused_residual,
                                   y_name, result)]


def depthwise_tile(kw: int, sw: int) -> int:
    """Output positions along W per thread of the tiled depthwise kernels (``kiln_dw_tile`` in depthwise_conv.cu):
    sizes the grid, whose grid-stride loop covers any remainder."""
    return max(1, min(4, (8 - kw) // sw + 1))


def conv_layout(dtype: np.dtype, options: LoweringOptions) -> str:
    """The layout a float convolution of ``dtype`` reads and writes: "nhwc" (tensor-core engines want it), or
    "linear" (NCHW) for strict fp32, whose fast cuDNN engines are FFMA kernels over NCHW."""
    strict_fp32 = np.dtype(dtype) == F32 and not options.tf32
    return "linear" if strict_fp32 and options.strict_fp32_nchw else "nhwc"
