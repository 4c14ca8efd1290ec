"""Which layers compute rotary angles from integer positions: reduce_precision keeps them float32.

Rotary embeddings (Llama, Mistral, Qwen, GPT-NeoX, ...) are exported as ``Cos``/``Sin`` of ``positions x
inv_freq``, computed in the graph from the ``position_ids`` input. In fp16 the angle ``p * f`` carries a rounding
error of about ``p * f * 2**-11``: 0.02 rad at position 44, 0.25 rad at position 512, so queries and keys are
rotated by visibly wrong angles and greedy tokens drift from the fp32 model's (measured on a Llama-1B shape: logits
off by 0.31 in fp16 against transformers' 0.18). transformers computes these angles in float32 with autocast off
and casts only ``cos``/``sin`` to the model's type; TensorRT users pin the layers to FP32 by hand. Here the default
does it: the layers are a few small elementwise ones per network, shared by every attention layer.

A layer is a position computation when each of its inputs is an integer graph input, a value known at build time,
or the output of another position computation (and at least one is not known at build time). A lookup (``Gather``
of a table that is not itself a position computation, e.g. an embedding or a cached cos/sin table) starts data,
not a position computation. The layers kept are every ``Sin``/``Cos`` of a position computation and the position
computations feeding them; mask arithmetic from ``attention_mask`` feeds no Sin/Cos and keeps the target type.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from engine_core.ir import Graph, Node

#: ops whose first input is a table the others index: a lookup, whose output is data
_LOOKUPS = frozenset({"Gather", "GatherElements", "GatherND"})
_ANGLE_OPS = frozenset({"Sin", "Cos"})


def rotary_angle_layers(graph: Graph, known: Callable[[str], bool]) -> set[str]:
    """Names of the layers that compute Sin/Cos of integer positions, the Sin/Cos layers included (see above).
    ``known(name)``: whether the tensor's value is known at build time (a constant or a shape computation)."""
    derived = {v.name for v in graph.inputs if v.dtype is not None and np.dtype(v.dtype).kind in "iub"}
    producers: dict[str, Node] = {}
    for node in graph.nodes:
        present = [i for i in node.inputs if i]
        if node.op_type in _LOOKUPS and not node.domain and node.inputs[0] not in derived:
            continue
        if any(i in derived for i in present) and all(i in derived or known(i) for i in present):
            for out in node.outputs:
                if out:
                    derived.add(out)
                    producers[out] = node
    kept: set[str] = set()
    stack = [n for n in graph.nodes if n.op_type in _ANGLE_OPS and not n.domain and n.inputs[0] in derived]
    while stack:
        node = stack.pop()
        if node.name not in kept:
            kept.add(node.name)
            stack.extend(producers[i] for i in node.inputs if i in producers)
    return kept
