"""Conv + BatchNormalization folding: the BN's affine transform goes into the conv's weights.

y = gamma * (conv(x, W) + b - mean) / sqrt(var + eps) + beta
  = conv(x, W * s) + (b - mean) * s + beta,   with s = gamma / sqrt(var + eps) per output channel.
Applies when the conv's only reader is the BN and all parameters are constants.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from engine_core.ir import Graph, Node
from engine_core.passes.pattern import Match, Uses, fuse_matches


def _folded(graph: Graph, uses: Uses, bn: Node) -> Match | None:
    """The conv of ``bn``'s input with the BN folded into its weights, writing the BN's output in the conv's place;
    None when the BN trains, the conv has other readers or a parameter is not a constant float."""
    if len([o for o in bn.outputs if o]) != 1 or bn.attr("training_mode", 0):
        return None
    conv = uses.producer(bn.inputs[0], "Conv")
    if conv is None or uses.sole_reader(bn.inputs[0]) is not bn:
        return None
    params = bn.inputs[1:5]
    weights = [conv.inputs[1]] + ([conv.inputs[2]] if len(conv.inputs) > 2 and conv.inputs[2] else [])
    if not all(p in graph.constants for p in params + weights):
        return None
    gamma, beta, mean, var = (graph.constants[p].astype(np.float64) for p in params)
    w = graph.constants[conv.inputs[1]]
    if not np.issubdtype(w.dtype, np.floating):
        return None
    c_out = w.shape[0]
    b = graph.constants[weights[1]].astype(np.float64) if len(weights) > 1 else np.zeros(c_out)
    scale = gamma / np.sqrt(var + bn.attr("epsilon", 1e-5))
    new_w = (w.astype(np.float64) * scale.reshape(-1, *([1] * (w.ndim - 1)))).astype(w.dtype)
    new_b = ((b - mean) * scale + beta).astype(w.dtype)
    inputs = [conv.inputs[0], graph.add_constant(f"{conv.name}_W_bn", new_w),
              graph.add_constant(f"{conv.name}_B_bn", new_b)]
    folded = dataclasses.replace(conv, inputs=inputs, outputs=[bn.outputs[0]], origin=conv.origin + bn.origin)
    return folded, [bn, conv]


def fold_conv_batchnorm(graph: Graph) -> int:
    """Fold every eligible Conv -> BatchNormalization pair in place; returns how many were folded."""
    uses = Uses(graph)
    return fuse_matches(graph, ("BatchNormalization",), lambda bn, _: _folded(graph, uses, bn))
