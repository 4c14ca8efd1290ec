"""Constant folding: nodes whose inputs are all constants become constants.

Ops that are not deterministic (random) are kept; so are folds whose result would be much larger
than their inputs (an Expand or Tile of a small constant is cheaper to run than to store).
"""

from __future__ import annotations

import numpy as np

from engine_core.backends.cpu import run_node
from engine_core.ir import Graph, has_subgraph
from engine_core.ops import get_op

#: Never store a folded result larger than this many bytes unless its inputs were as large.
GROWTH_LIMIT_BYTES = 1 << 20


def fold_constants(graph: Graph) -> int:
    """Fold constant subexpressions in place; returns the number of nodes folded."""
    static_shapes = {v.name: v.shape for v in graph.inputs if not v.is_dynamic}
    folded = 0
    kept = []
    for node in graph.nodes:
        op = get_op(node.op_type, node.domain)
        present = [i for i in node.inputs if i]
        if node.op_type == "Shape" and not node.domain and present and present[0] in static_shapes:
            args = [np.empty(static_shapes[present[0]], dtype=np.uint8)]  # only the shape is read
        elif op is None or not op.deterministic or not present or not all(i in graph.constants for i in present):
            kept.append(node)
            continue
        else:
            args = [graph.constants[i] if i else None for i in node.inputs]
        if has_subgraph(node):
            kept.append(node)
            continue
        try:
            outputs = run_node(node, args)
        except Exception:
            kept.append(node)  # the error surfaces, with its layer name, when the plan runs
            continue
        in_bytes = sum(a.nbytes for a in args if isinstance(a, np.ndarray))
        if any(not isinstance(o, np.ndarray) for o in outputs) or (
            sum(o.nbytes for o in outputs) > max(GROWTH_LIMIT_BYTES, 2 * in_bytes)
        ):
            kept.append(node)
            continue
        for name, value in zip(node.outputs, outputs):
            if name:
                graph.constants[name] = value
        folded += 1
    graph.nodes = kept
    return folded

