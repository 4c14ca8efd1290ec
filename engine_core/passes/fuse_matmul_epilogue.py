"""MatMul / Gemm with a constant weight (+ bias add) (+ activation) -> one ``kiln.FusedMatMul``.

Why: the GEMM library runs the bias add and the activation in its epilogue (cuBLASLt), so a linear layer
costs one pass over its output instead of two or three. A Transpose swapping the last two dims of an
operand becomes transA / transB. Applies when every intermediate tensor is read only by the next layer.
"""

from __future__ import annotations

import numpy as np

from engine_core.ir import Graph, Node
from engine_core.passes.pattern import Match, Uses, as_vector, fuse_matches, is_op, known_rank, origins, other_input

#: ONNX activation op -> FusedMatMul activation name
_ACTIVATIONS = {"Relu": "Relu", "Sigmoid": "Sigmoid", "Tanh": "Tanh"}


def _activation(node: Node | None) -> str | None:
    if node is None:
        return None
    if is_op(node, "Gelu"):
        return "GeluTanh" if node.attr("approximate", "none") == "tanh" else "Gelu"
    return _ACTIVATIONS.get(node.op_type) if is_op(node, *_ACTIVATIONS) else None


def _bias(graph: Graph, name: str, columns: int, out_rank: int | None) -> str | None:
    """``name`` (or a 1-D copy) when it is a constant adding one value per output column: shape [N], or
    [1, ..., 1, N] when the GEMM output is known to have at least that rank (else Add would widen it)."""
    value = graph.constants.get(name)
    if not isinstance(value, np.ndarray) or value.ndim == 0 or value.shape[-1] != columns:
        return None
    if any(d != 1 for d in value.shape[:-1]) or (value.ndim > 1 and (out_rank or 0) < value.ndim):
        return None
    return as_vector(graph, name, value.reshape(-1))


def _swapped(uses: Uses, name: str) -> Node | None:
    """The Transpose producing ``name`` when it swaps only the last two dims and nothing else reads it."""
    node = uses.producers.get(name)
    perm = list(node.attr("perm", []) or []) if is_op(node, "Transpose") else []
    if len(perm) < 2 or perm[:-2] != list(range(len(perm) - 2)) or perm[-2:] != [len(perm) - 1, len(perm) - 2]:
        return None
    return node if uses.sole_reader(name) is not None else None


def _operands(graph: Graph, mm: Node) -> tuple[str, str, int, int, float, str, int] | None:
    """(a, b, transA, transB, alpha, bias, output columns) of a Gemm or MatMul with a constant weight (2-D for a
    MatMul, so the GEMM library's epilogue applies), else None."""
    if is_op(mm, "Gemm"):
        if mm.attr("beta", 1.0) != 1.0 or len(mm.inputs) < 2 or mm.inputs[1] not in graph.constants:
            return None
        trans_b = int(mm.attr("transB", 0))
        columns = graph.constants[mm.inputs[1]].shape[0 if trans_b else 1]
        bias = _bias(graph, mm.inputs[2], columns, 2) if len(mm.inputs) > 2 and mm.inputs[2] else ""
        if bias is None:
            return None
        return mm.inputs[0], mm.inputs[1], int(mm.attr("transA", 0)), trans_b, float(mm.attr("alpha", 1.0)), bias, \
            columns
    if mm.inputs[1] in graph.constants and graph.constants[mm.inputs[1]].ndim == 2:
        return mm.inputs[0], mm.inputs[1], 0, 0, 1.0, "", graph.constants[mm.inputs[1]].shape[1]
    return None


def _fused_matmul(graph: Graph, uses: Uses, mm: Node, taken: set[int]) -> Match | None:
    """The ``FusedMatMul`` for ``mm`` with the bias Add, activation and operand Transpose around it that it can
    absorb, in the place of its last node; None for a plain MatMul (nothing to gain) or a variable weight."""
    operands = _operands(graph, mm)
    if operands is None:
        return None
    a, b, trans_a, trans_b, alpha, bias, columns = operands
    covered, tail = [mm], mm.outputs[0]
    step = uses.sole_reader(tail)
    out_rank = 2 if is_op(mm, "Gemm") else known_rank(graph, uses, a)
    found = _bias(graph, other_input(step, tail) or "", columns, out_rank) if is_op(step, "Add") and not bias \
        else None
    if found:
        bias = found
        covered.append(step)
        tail = step.outputs[0]
        step = uses.sole_reader(tail)
    activation = _activation(step)
    if activation is not None:
        covered.append(step)
        tail = step.outputs[0]
    if not trans_a and (transpose := _swapped(uses, a)) is not None and id(transpose) not in taken:
        a, trans_a = transpose.inputs[0], 1  # Gemm's A is 2-D: its Transpose swaps the last two dims too
        covered.insert(0, transpose)
    elif len(covered) == 1 and not is_op(mm, "Gemm"):
        return None  # a plain MatMul gains nothing
    attrs = {"transA": trans_a, "transB": trans_b, "alpha": alpha, "activation": activation or ""}
    node = Node("FusedMatMul", [a, b, bias], [tail], attrs, mm.name, "kiln", 1, origins(covered))
    return node, covered


def fuse_matmul_epilogue(graph: Graph) -> int:
    """Fuse every eligible MatMul/Gemm chain in place; returns how many FusedMatMul layers were made."""
    uses = Uses(graph)
    return fuse_matches(graph, ("MatMul", "Gemm"), lambda mm, taken: _fused_matmul(graph, uses, mm, taken))
