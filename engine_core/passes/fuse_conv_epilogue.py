"""Conv (+ per-channel constant add) (+ residual add) (+ activation) -> one ``kiln.FusedConv``.

Why: cuDNN runs the convolution, its bias, the residual add of a ResNet block and the ReLU as one kernel;
unfused, the add and the activation each read and write the whole activation tensor again. Applies when
every intermediate tensor has the next layer as its only reader and is not a graph output.
"""

from __future__ import annotations

import numpy as np

from engine_core.ir import Graph, Node
from engine_core.passes.pattern import Match, Uses, fuse_matches, is_op, origins, other_input, scalar

_CONV_ATTRS = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")


def _channel_bias(graph: Graph, name: str, weight: np.ndarray) -> np.ndarray | None:
    """A constant adding one value per output channel, flattened: shape [1, C, 1, ...] or [C, 1, ...]
    with the conv output's rank (or one less), so that adding it neither widens nor reorders the output."""
    value = graph.constants.get(name)
    rank, channels = weight.ndim, weight.shape[0]
    if not isinstance(value, np.ndarray) or value.size != channels or value.dtype != weight.dtype:
        return None
    spatial = (1,) * (rank - 2)
    if value.shape not in ((1, channels, *spatial), (channels, *spatial)):
        return None
    return value.reshape(-1)


def _activation(graph: Graph, node: Node) -> tuple[str, float, float] | None:
    if is_op(node, "Relu"):
        return "Relu", 0.0, 0.0
    if is_op(node, "Sigmoid"):
        return "Sigmoid", 0.0, 0.0
    if is_op(node, "LeakyRelu"):
        return "LeakyRelu", float(node.attr("alpha", 0.01)), 0.0
    if is_op(node, "Clip") and node.opset >= 11:
        lo = scalar(graph, node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] else -np.inf
        hi = scalar(graph, node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else np.inf
        if lo is not None and hi is not None:
            return "Clip", lo, hi
    return None


def _fused_conv(graph: Graph, uses: Uses, conv: Node, taken: set[int]) -> Match | None:
    """The ``FusedConv`` for ``conv`` (constant weight) with the bias Add, residual Add and activation after it that
    it can absorb, in the place of its last node; None when there is nothing to absorb."""
    if len(conv.inputs) < 2 or conv.inputs[1] not in graph.constants:
        return None
    weight = graph.constants[conv.inputs[1]]
    bias = conv.inputs[2] if len(conv.inputs) > 2 and conv.inputs[2] else ""
    covered, tail, residual = [conv], conv.outputs[0], ""
    step = uses.sole_reader(tail)
    if step is not None and id(step) in taken:  # already part of another fused layer
        return None
    if is_op(step, "Add") and not bias and (extra := _channel_bias(graph, other_input(step, tail) or "", weight)) \
            is not None:
        bias = graph.add_constant(f"{conv.name}_bias", extra)
        covered.append(step)
        tail = step.outputs[0]
        step = uses.sole_reader(tail)
    if is_op(step, "Add") and (other := other_input(step, tail)) and other not in graph.constants and other != tail:
        residual = other
        covered.append(step)
        tail = step.outputs[0]
        step = uses.sole_reader(tail)
    activation = _activation(graph, step) if step is not None and id(step) not in taken else None
    if activation is not None:
        covered.append(step)
        tail = step.outputs[0]
    if len(covered) == 1:
        return None
    attrs = {k: v for k, v in conv.attrs.items() if k in _CONV_ATTRS}
    name, alpha, beta = activation or ("", 0.0, 0.0)
    attrs.update(activation=name, activation_alpha=alpha, activation_beta=beta)
    node = Node("FusedConv", [conv.inputs[0], conv.inputs[1], bias, residual], [tail], attrs,
                conv.name, "kiln", 1, origins(covered))
    return node, covered


def fuse_conv_epilogue(graph: Graph) -> int:
    """Fuse every eligible Conv chain in place; returns how many FusedConv layers were made."""
    uses = Uses(graph)
    return fuse_matches(graph, ("Conv",), lambda conv, taken: _fused_conv(graph, uses, conv, taken))
