"""RMS normalization written out op by op (LLaMA-style exports) -> one ONNX ``RMSNormalization`` (opset 23).

    m = ReduceMean(x^2, -1) + eps
    y = gamma * (x / Sqrt(m))    or    gamma * (x * Reciprocal(Sqrt(m)))    or    gamma * (x * (1 / Sqrt(m)))
      or    gamma * (x * Pow(m, -0.5))                                           (torch.rsqrt written as a power)

transformers' LlamaRMSNorm computes in float32 and casts back: x = Cast(x0, to=FLOAT) first, then
gamma * Cast(x * rsqrt(m), to=x0's type). A Cast between the normalization and gamma that converts nothing (its
target is the chain's own type, which ``pattern.float_type`` reads off the graph: every fp32 export, and every
fp16 build, whose precision pass turns Cast(to=FLOAT) into Cast(to=FLOAT16)) is covered; so is the pair around a
float32 chain over a 16-bit x0 cast back to x0's type, since RMSNormalization computes its statistic in float32
(stash_type 1) and stores the normalized x in x0's type before scaling, as that chain does. An input Cast that
converts nothing is read through (the fused layer reads x0, so the Cast keeps only its other readers, usually the
residual Add, and can fuse into it; with none it is covered), and a Cast after gamma to gamma's type is covered.

Why: seven to ten layers (one of them a reduction) become one kernel that reads x once.
"""

from __future__ import annotations

import numpy as np

from engine_core.ir import Graph, Node
from engine_core.passes.pattern import (
    Match,
    Uses,
    as_vector,
    feeding_only,
    float_type,
    fuse_matches,
    is_op,
    last_axis_mean,
    origins,
    other_input,
    scalar,
    squared,
    vector,
)
from engine_core.types import onnx_to_np

F32 = np.dtype(np.float32)


def _root(graph: Graph, uses: Uses, square: Node) -> tuple[str, list[Node], float, bool] | None:
    """(x, covered nodes, eps, inverted) for Sqrt(ReduceMean(x^2) + eps) (inverted False) or
    Pow(ReduceMean(x^2) + eps, -0.5) (inverted True) starting at the squaring node."""
    x = squared(graph, square)
    mean = uses.sole_reader(square.outputs[0]) if x else None
    if not last_axis_mean(graph, mean) or mean.inputs[0] != square.outputs[0]:
        return None
    add = uses.sole_reader(mean.outputs[0])
    eps = scalar(graph, other_input(add, mean.outputs[0]) or "") if is_op(add, "Add") else None
    root = uses.sole_reader(add.outputs[0]) if eps is not None else None
    if is_op(root, "Sqrt"):
        return x, [square, mean, add, root], eps, False
    if is_op(root, "Pow") and root.inputs[0] == add.outputs[0] and scalar(graph, root.inputs[1]) == -0.5:
        return x, [square, mean, add, root], eps, True
    return None


def _normalized(graph: Graph, uses: Uses, x: str, root: str, inverted: bool) -> tuple[list[Node], str] | None:
    """(covered nodes, x / root) for the ways exporters divide by the root mean square (``inverted``: ``root`` is
    already its inverse)."""
    node = uses.sole_reader(root)
    if not inverted and is_op(node, "Div") and node.inputs == [x, root]:
        return [node], node.outputs[0]
    inverse, covered = None, []
    if inverted:
        inverse = root
    elif is_op(node, "Reciprocal") or is_op(node, "Div") and node.inputs[1] == root and \
            scalar(graph, node.inputs[0]) == 1.0:
        inverse, covered = node.outputs[0], [node]
    if inverse is None:
        return None
    mul = uses.sole_reader(inverse)
    if not is_op(mul, "Mul") or other_input(mul, inverse) != x:
        return None
    return [*covered, mul], mul.outputs[0]


def _cast_target(node: Node | None) -> np.dtype | None:
    return np.dtype(onnx_to_np(node.attr("to"))) if is_op(node, "Cast") else None


def _input(graph: Graph, uses: Uses, x: str, cast_to: np.dtype | None) -> str | None:
    """The tensor the fused layer normalizes, given the type a Cast between the normalization and gamma converts to
    (None: no such Cast): x, or x0 when x = Cast(x0) and that Cast converts nothing or the pair around a float32
    chain gives back x0's type; None when the Cast may change the result."""
    chain = float_type(graph, uses, x)
    source = uses.producer(x, "Cast")
    x0 = source.inputs[0] if source is not None else ""
    x0_type = float_type(graph, uses, x0) if x0 else None
    if cast_to is not None and cast_to != chain:
        return x0 if chain == F32 and x0_type == cast_to else None
    return x0 if x0_type is not None and x0_type == chain else x


def _rms_norm(graph: Graph, uses: Uses, square: Node, taken: set[int]) -> Match | None:
    """The ``RMSNormalization`` for the chain starting at the squaring node, in the place of its gamma Mul (or of a
    Cast after it that converts nothing); None without the chain or when an earlier match took part of it."""
    root = _root(graph, uses, square)
    if root is None:
        return None
    x, covered, eps, inverted = root
    found = _normalized(graph, uses, x, covered[-1].outputs[0], inverted)
    if found is None:
        return None
    covered += found[0]
    normalized = found[1]
    scale = uses.sole_reader(normalized)
    cast_to = _cast_target(scale)
    if cast_to is not None:
        covered.append(scale)
        normalized = scale.outputs[0]
        scale = uses.sole_reader(normalized)
    source = _input(graph, uses, x, cast_to)
    gamma_name = other_input(scale, normalized) or "" if is_op(scale, "Mul") else ""
    gamma = vector(graph, gamma_name)
    if source is None or gamma is None or any(id(n) in taken for n in covered):
        return None
    covered.append(scale)
    after = uses.sole_reader(scale.outputs[0])
    if _cast_target(after) == gamma.dtype:
        covered.append(after)
    if source != x and feeding_only(uses, x, {id(n) for n in covered}) == []:  # the input Cast has no other reader
        covered.insert(0, uses.producers[x])
    node = Node("RMSNormalization", [source, as_vector(graph, gamma_name, gamma)],
                [covered[-1].outputs[0]], {"axis": -1, "epsilon": float(eps)}, f"{square.name}_rmsnorm", "", 23,
                origins(covered))
    return node, covered


def fuse_rms_norm(graph: Graph) -> int:
    """Replace every decomposed RMS normalization over the last axis; returns how many."""
    uses = Uses(graph)
    return fuse_matches(graph, ("Pow", "Mul"), lambda square, taken: _rms_norm(graph, uses, square, taken))
