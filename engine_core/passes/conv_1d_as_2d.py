"""1-D Conv -> Unsqueeze(axis 2) -> 2-D Conv (kernel [1, k]) -> Squeeze(axis 2).

Why: the CUDA backend runs convolutions through cuDNN as 2-D (4-D tensors) only, so a Conv1d (Whisper's and
wav2vec2's audio stems, TCNs) ran on the host: with its two stem convs there, Whisper-tiny's encoder took 310 ms
at batch 16 on an H100 (torch.compile: 2.7 ms). A 1-D convolution of [N, C, L] is exactly the 2-D one of
[N, C, 1, L] with a [1, k] kernel (height 1, no padding, stride and dilation 1 on it), and the two reshapes
around it are views.

It runs for every backend: it is a plain ONNX rewrite that needs no backend support beyond 2-D Conv, and the
CPU backend (the CUDA backend's reference) computes the same numbers either way (the same im2col matmul over a
height-1 window). The one cost: a Relu, residual Add or separate bias Add after a 1-D conv now follows the
Squeeze, so fuse_conv_epilogue leaves it a layer of its own (the conv's own bias input still goes into the conv).

It runs after fold_conv_batchnorm, which folds a BatchNormalization into a 1-D conv as into a 2-D one. A conv
whose weight is not a constant (a REFIT build hides the weights; a Q/DQ weight) stays as it is: cuDNN lowering
needs a constant weight anyway. The Unsqueeze/Squeeze take their axes as input 1, the form the parser gives them
at every opset (opset 13's schema), so they carry opset 13 or the graph's, if newer.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from engine_core.ir import Graph, Node
from engine_core.passes.pattern import Match, fuse_matches


def _as_2d(graph: Graph, conv: Node, axes: list[str], weights: dict[str, str]) -> Match | None:
    """Unsqueeze -> the 2-D form of ``conv`` -> Squeeze, writing the conv's output; None when ``conv`` is not
    1-D with a constant weight. ``axes`` holds the shared axes constant once made, ``weights`` each 1-D weight's
    2-D copy (a weight two convs share is reshaped once)."""
    if len(conv.inputs) < 2 or len(conv.outputs) != 1 or conv.inputs[1] not in graph.constants:
        return None
    weight = graph.constants[conv.inputs[1]]
    strides, dilations = conv.attr("strides", None) or [1], conv.attr("dilations", None) or [1]
    kernel, pads = conv.attr("kernel_shape", None), conv.attr("pads", None)
    if weight.ndim != 3 or len(strides) != 1 or len(dilations) != 1 or pads is not None and len(pads) != 2 \
            or kernel and list(kernel) != [weight.shape[2]]:
        return None  # not 1-D, or malformed: shape inference reports it on the original node
    if not axes:
        axes.append(graph.add_constant("conv_1d_as_2d_axes", np.array([2], np.int64)))
    if conv.inputs[1] not in weights:
        weights[conv.inputs[1]] = graph.add_constant(f"{conv.inputs[1]}_2d", weight[:, :, None, :])
    attrs = dict(conv.attrs, kernel_shape=[1, int(weight.shape[2])], strides=[1, int(strides[0])],
                 dilations=[1, int(dilations[0])])
    if pads is not None:  # absent stays absent: auto_pad SAME/VALID pads the height-1 dim by 0 as well
        attrs["pads"] = [0, int(pads[0]), 0, int(pads[1])]
    x_2d, y_2d = graph.unique_name(f"{conv.inputs[0]}_2d"), graph.unique_name(f"{conv.outputs[0]}_2d")
    opset = max(13, graph.opsets.get("", 13))
    unsqueeze = Node("Unsqueeze", [conv.inputs[0], axes[0]], [x_2d], {}, f"{conv.name}_unsqueeze", "", opset,
                     list(conv.origin))
    conv_2d = dataclasses.replace(conv, inputs=[x_2d, weights[conv.inputs[1]], *conv.inputs[2:]], outputs=[y_2d],
                                  attrs=attrs, origin=list(conv.origin))
    squeeze = Node("Squeeze", [y_2d, axes[0]], list(conv.outputs), {}, f"{conv.name}_squeeze", "", opset,
                   list(conv.origin))
    return [unsqueeze, conv_2d, squeeze], [conv]


def conv_1d_as_2d(graph: Graph) -> int:
    """Rewrite every 1-D Conv with a constant weight as a 2-D one between an Unsqueeze and a Squeeze, in place;
    returns how many were rewritten."""
    axes: list[str] = []
    weights: dict[str, str] = {}
    return fuse_matches(graph, ("Conv",), lambda conv, _: _as_2d(graph, conv, axes, weights))
