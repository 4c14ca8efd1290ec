"""RMS normalization written out op by op (LLaMA-style exports) -> one ONNX ``RMSNormalization`` (opset 23).

    r = Sqrt(ReduceMean(x^2, -1) + eps)
    y = gamma * (x / r)    or    gamma * (x * Reciprocal(r))    or    gamma * (x * (1 / r))

Why: six or seven layers (one of them a reduction) become one kernel that reads x once.
"""

from __future__ import annotations

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


def _root(graph: Graph, uses: Uses, square: Node) -> tuple[str, list[Node], float] | None:
    """(x, covered nodes, eps) for Sqrt(ReduceMean(x^2) + eps) starting at the squaring node."""
    x = squared(graph, square)
    mean = uses.sole_reader(square.outputs[0]) if x else None
    if not last_axis_mean(graph, mean) or mean.inputs[0] != square.outputs[0]:
        return None
    add = uses.sole_reader(mean.outputs[0])
    eps = scalar(graph, other_input(add, mean.outputs[0]) or "") if is_op(add, "Add") else None
    sqrt = uses.sole_reader(add.outputs[0]) if eps is not None else None
    if not is_op(sqrt, "Sqrt"):
        return None
    return x, [square, mean, add, sqrt], eps


def _normalized(graph: Graph, uses: Uses, x: str, root: str) -> tuple[list[Node], str] | None:
    """(covered nodes, x / root) for the ways exporters divide by the root mean square."""
    node = uses.sole_reader(root)
    if is_op(node, "Div") and node.inputs == [x, root]:
        return [node], node.outputs[0]
    inverse = None
    if is_op(node, "Reciprocal"):
        inverse = node
    elif is_op(node, "Div") and node.inputs[1] == root and scalar(graph, node.inputs[0]) == 1.0:
        inverse = node
    if inverse is None:
        return None
    mul = uses.sole_reader(inverse.outputs[0])
    if not is_op(mul, "Mul") or other_input(mul, inverse.outputs[0]) != x:
        return None
    return [inverse, mul], mul.outputs[0]


def _rms_norm(graph: Graph, uses: Uses, square: Node, taken: set[int]) -> Match | None:
    """The ``RMSNormalization`` for the chain starting at the squaring node, in the place of its gamma Mul; None
    without the chain or when an earlier match took part of it."""
    root = _root(graph, uses, square)
    if root is None:
        return None
    x, covered, eps = root
    found = _normalized(graph, uses, x, covered[-1].outputs[0])
    if found is None:
        return None
    covered += found[0]
    scale = uses.sole_reader(found[1])
    gamma_name = other_input(scale, found[1]) or "" if is_op(scale, "Mul") else ""
    gamma = vector(graph, gamma_name)
    if gamma is None or any(id(n) in taken for n in covered):
        return None
    covered.append(scale)
    node = Node("RMSNormalization", [x, as_vector(graph, gamma_name, gamma)],
                [scale.outputs[0]], {"axis": -1, "epsilon": float(eps)}, f"{square.name}_rmsnorm", "", 23,
                origins(covered))
    return node, covered


def fuse_rms_norm(graph: Graph) -> int:
    """Replace every decomposed RMS normalization over the last axis; returns how many."""
    uses = Uses(graph)
    return fuse_matches(graph, ("Pow", "Mul"), lambda square, taken: _rms_norm(graph, uses, square, taken))
