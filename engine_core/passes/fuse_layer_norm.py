"""Layer normalization written out op by op (pre-opset-17 exports) -> one ONNX ``LayerNormalization``.

    mu = ReduceMean(x, -1); d = x - mu; var = ReduceMean(d^2, -1)
    y = d / Sqrt(var + eps) [* gamma] [+ beta]

Why: nine layers that each read and write the whole activation (two of them reductions) become one
kernel that reads x once; the node carries opset 17 so the registry accepts it in older models.
"""

from __future__ import annotations

import numpy as np

from engine_core.ir import Graph, Node
from engine_core.passes.pattern import (
    Match,
    Uses,
    as_vector,
    fuse_matches,
    is_op,
    last_axis_mean,
    origins,
    other_input,
    scalar,
    squared,
    vector,
)


def _normalized(graph: Graph, uses: Uses, mean: Node) -> tuple[str, list[Node], float] | None:
    """(x, covered nodes, normalized tensor) for the chain starting at the first ReduceMean."""
    x, mu = mean.inputs[0], mean.outputs[0]
    sub = uses.sole_reader(mu)
    if not is_op(sub, "Sub") or sub.inputs != [x, mu]:
        return None
    d = sub.outputs[0]
    readers = uses.consumers.get(d, [])
    if d in uses.outputs or len(readers) != 2:
        return None
    square = next((n for n in readers if squared(graph, n) == d), None)
    div = next((n for n in readers if is_op(n, "Div") and n.inputs[0] == d), None)
    if square is None or div is None:
        return None
    var = uses.sole_reader(square.outputs[0])
    if not last_axis_mean(graph, var):
        return None
    add = uses.sole_reader(var.outputs[0])
    eps = scalar(graph, other_input(add, var.outputs[0]) or "") if is_op(add, "Add") else None
    sqrt = uses.sole_reader(add.outputs[0]) if eps is not None else None
    if not is_op(sqrt, "Sqrt") or uses.sole_reader(sqrt.outputs[0]) is not div or div.inputs[1] != sqrt.outputs[0]:
        return None
    return x, [mean, sub, square, var, add, sqrt, div], eps


def _affine(graph: Graph, uses: Uses, tensor: str, op: str) -> tuple[Node, str, np.ndarray] | None:
    """(node, constant name, its 1-D value) when the only reader of ``tensor`` is ``op`` by a per-feature
    constant."""
    node = uses.sole_reader(tensor)
    if not is_op(node, op):
        return None
    name = other_input(node, tensor) or ""
    value = vector(graph, name)
    return None if value is None else (node, name, value)


def _layer_norm(graph: Graph, uses: Uses, mean: Node) -> Match | None:
    """The ``LayerNormalization`` for the chain starting at ``mean`` (the first ReduceMean), in the place of its last
    node; None without the chain or its gamma."""
    match = _normalized(graph, uses, mean) if last_axis_mean(graph, mean) else None
    if match is None:
        return None
    x, covered, eps = match
    tail = covered[-1].outputs[0]
    scale = _affine(graph, uses, tail, "Mul")
    if scale is None:  # LayerNormalization needs a scale; without gamma there is no width to make one
        return None
    covered.append(scale[0])
    tail = scale[0].outputs[0]
    inputs = [x, as_vector(graph, scale[1], scale[2])]
    shift = _affine(graph, uses, tail, "Add")
    if shift is not None and shift[2].shape == scale[2].shape and shift[2].dtype == scale[2].dtype:
        covered.append(shift[0])
        tail = shift[0].outputs[0]
        inputs.append(as_vector(graph, shift[1], shift[2]))
    node = Node("LayerNormalization", inputs, [tail], {"axis": -1, "epsilon": eps},
                f"{mean.name}_layernorm", "", 17, origins(covered))
    return node, covered


def fuse_layer_norm(graph: Graph) -> int:
    """Replace every decomposed layer normalization over the last axis; returns how many."""
    uses = Uses(graph)
    return fuse_matches(graph, ("ReduceMean",), lambda mean, _: _layer_norm(graph, uses, mean))
