"""Lowering rule of float convolutions: Conv and ``kiln.FusedConv`` (2-D) through cuDNN.
"""

from __future__ import annotations

import numpy as np

from engine_core.backends.cuda.lower_rules.common import (
    gemm_dtype,
)
from engine_core.backends.cuda.lower_rules.gemm import epilogue
from engine_core.backends.cuda.lowering_context import (
    F32,
    Conv,
    LoweringContext,
    LoweringOptions,
    Ref,
    copy_launch,
    lowering_rule,
    nhwc_strides,
)
from engine_core.backends.cuda.pointwise import (
    Unsupported,
    contiguous_strides,
)
from engine_core.ir import Node
from engine_core.ops import TensorInfo


@lowering_rule("Conv", "FusedConv")
def _lower_conv(node: Node, ctx: LoweringContext) -> list:
    """Conv / ``kiln.FusedConv`` (2-D) through cuDNN, channels-last activations and KRSC filters."""
    if not ctx.options.cudnn:
        raise Unsupported("convolution needs the cuDNN frontend (pip install kiln[gpu])")
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
    bias = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2] else None
    residual = node.inputs[3] if node.op_type == "FusedConv" and len(node.inputs) > 3 and node.inputs[3] else None
    if bias and (ctx.info(bias).dtype != dtype or ctx.info(bias).shape != (out.shape[1],)):
        raise Unsupported("convolution bias of another dtype or shape")
    conv_shape = (x.shape[0], w.shape[0], *[(i + p0 + p1 - d * (k - 1) - 1) // st + 1 for i, p0, p1, d, k, st in
                                            zip(x.shape[2:], pads[:2], pads[2:], dilations, kernel, strides)])
    if tuple(conv_shape) != tuple(out.shape):  # a residual that broadcasts wider than the convolution
        raise Unsupported(f"FusedConv output {out.shape} is wider than its convolution {tuple(conv_shape)}")
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
    rest = epilogue(node, ctx, None, "" if fused_activation else activation, alpha, beta,
                     None if fused_residual else residual, y_name)
    if y_name != result:
        rest.append(copy_launch(ctx, out.dtype, Ref(result), Ref(y_name), out.shape, contiguous_strides(out.shape),
                                ctx.strides(y_name)))
    return [conv, *rest]


def conv_layout(dtype: np.dtype, options: LoweringOptions) -> str:
    """The layout a float convolution of ``dtype`` reads and writes: "nhwc" (tensor-core engines want it), or
    "linear" (NCHW) for strict fp32, whose fast cuDNN engines are FFMA kernels over NCHW."""
    strict_fp32 = np.dtype(dtype) == F32 and not options.tf32
    return "linear" if strict_fp32 and options.strict_fp32_nchw else "nhwc"
