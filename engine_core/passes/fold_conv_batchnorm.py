"""Conv + BatchNormalization folding: the BN's affine transform goes into the conv's weights.

y = gamma * (conv(x, W) + b - mean) / sqrt(var + eps) + beta
  = conv(x, W * s) + (b - mean) * s + beta,   with s = gamma / sqrt(var + eps) per output channel.
Applies when the conv's only reader is the BN and all parameters are constants.
"""

from __future__ import annotations

import numpy as np

from engine_core.ir import Graph


def fold_conv_batchnorm(graph: Graph) -> int:
    """Fold every eligible Conv -> BatchNormalization pair in place; returns how many were folded."""
    producers = graph.producers()
    consumers = graph.consumers()
    outputs = set(graph.output_names)
    removed: set[int] = set()
    folded = 0
    for bn in graph.nodes:
        if bn.op_type != "BatchNormalization" or bn.domain or len([o for o in bn.outputs if o]) != 1:
            continue
        if bn.attr("training_mode", 0):
            continue
        conv = producers.get(bn.inputs[0])
        if conv is None or conv.op_type != "Conv" or conv.domain or bn.inputs[0] in outputs:
            continue
        if len(consumers.get(bn.inputs[0], [])) != 1:
            continue
        params = bn.inputs[1:5]
        weights = [conv.inputs[1]] + ([conv.inputs[2]] if len(conv.inputs) > 2 and conv.inputs[2] else [])
        if not all(p in graph.constants for p in params + weights):
            continue
        gamma, beta, mean, var = (graph.constants[p].astype(np.float64) for p in params)
        w = graph.constants[conv.inputs[1]]
        if not np.issubdtype(w.dtype, np.floating):
            continue
        c_out = w.shape[0]
        b = graph.constants[weights[1]].astype(np.float64) if len(weights) > 1 else np.zeros(c_out)
        scale = gamma / np.sqrt(var + bn.attr("epsilon", 1e-5))
        new_w = (w.astype(np.float64) * scale.reshape(-1, *([1] * (w.ndim - 1)))).astype(w.dtype)
        new_b = ((b - mean) * scale + beta).astype(w.dtype)
        conv.inputs = [conv.inputs[0], graph.add_constant(f"{conv.name}_W_bn", new_w),
                       graph.add_constant(f"{conv.name}_B_bn", new_b)]
        conv.outputs = [bn.outputs[0]]
        conv.origin = conv.origin + bn.origin
        removed.add(id(bn))
        folded += 1
    graph.nodes = [n for n in graph.nodes if id(n) not in removed]
    return folded
