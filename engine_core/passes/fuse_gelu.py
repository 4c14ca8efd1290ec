"""GELU as exporters write it -> one ONNX ``Gelu`` (opset 20).

* erf form ``x * 0.5 * (1 + erf(x / sqrt(2)))`` -> ``approximate="none"``;
* tanh form ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))`` (GPT-2) -> ``approximate="tanh"``.

Why: five to nine pointwise layers become one, and a GEMM before it can take it as its epilogue
(fuse_matmul_epilogue). Matches the operand orders torch and TF exporters emit around ``1 + erf|tanh``:
``(x * 0.5) * (1 + .)``, ``(x * (1 + .)) * 0.5`` and ``x * ((1 + .) * 0.5)``.
"""

from __future__ import annotations

import math

from engine_core.ir import Graph, Node
from engine_core.passes.pattern import Match, Uses, fuse_matches, is_op, origins, other_input, scalar

_SQRT2 = math.sqrt(2.0)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _close(value: float | None, want: float) -> bool:
    return value is not None and abs(value - want) <= 1e-3 * abs(want)


def _erf_argument(graph: Graph, uses: Uses, erf: Node) -> tuple[str, Node] | None:
    """(x, scaling node) when erf's input is x / sqrt(2) or x * (1 / sqrt(2))."""
    scale = uses.producers.get(erf.inputs[0])
    if is_op(scale, "Div") and _close(scalar(graph, scale.inputs[1]), _SQRT2):
        return scale.inputs[0], scale
    if is_op(scale, "Mul"):
        for x, c in (scale.inputs, scale.inputs[::-1]):
            if _close(scalar(graph, c), 1 / _SQRT2):
                return x, scale
    return None


def _scaled(graph: Graph, node: Node | None, want: float) -> str | None:
    """The non-constant operand of ``node`` when it is a Mul by ``want``."""
    if not is_op(node, "Mul"):
        return None
    for operand, c in (node.inputs, node.inputs[::-1]):
        if _close(scalar(graph, c), want):
            return operand
    return None


def _cube_of(graph: Graph, uses: Uses, name: str) -> tuple[str, list[Node]] | None:
    """(x, nodes) when ``name`` is Pow(x, 3) or x * x * x (in either grouping)."""
    node = uses.producers.get(name)
    if is_op(node, "Pow") and _close(scalar(graph, node.inputs[1]), 3.0):
        return node.inputs[0], [node]
    if is_op(node, "Mul"):
        for square, x in (node.inputs, node.inputs[::-1]):
            inner = uses.producers.get(square)
            if is_op(inner, "Mul") and inner.inputs == [x, x] and uses.sole_reader(square) is node:
                return x, [inner, node]
    return None


def _tanh_argument(graph: Graph, uses: Uses, tanh: Node) -> tuple[str, list[Node]] | None:
    """(x, nodes) when tanh's input is sqrt(2/pi) * (x + 0.044715 * x^3)."""
    outer = uses.producers.get(tanh.inputs[0])
    inner = _scaled(graph, outer, _SQRT_2_OVER_PI)
    add = uses.producers.get(inner or "")
    if not is_op(add, "Add") or uses.sole_reader(inner) is not outer:
        return None
    for x, term in (add.inputs, add.inputs[::-1]):
        cubed = _scaled(graph, uses.producers.get(term), 0.044715)
        found = _cube_of(graph, uses, cubed) if cubed and uses.sole_reader(term) is add else None
        if found is not None and found[0] == x and uses.sole_reader(cubed) is not None:
            return x, [*found[1], uses.producers[term], add, outer]
    return None


def _half_of(graph: Graph, node: Node | None, operand: str) -> bool:
    """``node`` multiplies ``operand`` by 0.5."""
    return is_op(node, "Mul") and _close(scalar(graph, other_input(node, operand) or ""), 0.5)


def _match(graph: Graph, uses: Uses, erf: Node) -> tuple[str, list[Node], str] | None:
    """(x, covered nodes, output) of one GELU around ``erf`` (an Erf or, for the tanh form, a Tanh)."""
    if uses.sole_reader(erf.inputs[0]) is not erf:
        return None
    if erf.op_type == "Erf":
        found = _erf_argument(graph, uses, erf)
        x, head = (found[0], [found[1]]) if found else ("", [])
    else:
        x, head = _tanh_argument(graph, uses, erf) or ("", [])
    if not x:
        return None
    plus = uses.sole_reader(erf.outputs[0])
    if not is_op(plus, "Add") or not _close(scalar(graph, other_input(plus, erf.outputs[0]) or ""), 1.0):
        return None
    outer = uses.sole_reader(plus.outputs[0])
    if not is_op(outer, "Mul"):
        return None
    partner = other_input(outer, plus.outputs[0])
    half = uses.producers.get(partner or "")
    if partner and _half_of(graph, half, x) and uses.sole_reader(half.outputs[0]) is outer:
        return x, [*head, erf, plus, half, outer], outer.outputs[0]  # (x * 0.5) * (1 + erf)
    if partner == x:
        last = uses.sole_reader(outer.outputs[0])
        if _half_of(graph, last, outer.outputs[0]):
            return x, [*head, erf, plus, outer, last], last.outputs[0]  # (x * (1 + erf)) * 0.5
    if _half_of(graph, outer, plus.outputs[0]):
        final = uses.sole_reader(outer.outputs[0])
        if is_op(final, "Mul") and other_input(final, outer.outputs[0]) == x:
            return x, [*head, erf, plus, outer, final], final.outputs[0]  # x * ((1 + erf) * 0.5)
    return None


def _gelu(graph: Graph, uses: Uses, erf: Node, taken: set[int]) -> Match | None:
    """The ``Gelu`` node for the GELU around ``erf``, in the place of its last node in graph order; None when there is
    none or an earlier match took one of its nodes."""
    found = _match(graph, uses, erf)
    if found is None or any(id(n) in taken for n in found[1]):
        return None
    x, nodes, output = found
    node = Node("Gelu", [x], [output], {"approximate": "none" if erf.op_type == "Erf" else "tanh"}, f"{erf.name}_gelu",
                "", 20, origins(nodes))
    return node, sorted(nodes, key=graph.nodes.index)


def fuse_gelu(graph: Graph) -> int:
    """Replace every erf- or tanh-form GELU by a ``Gelu`` node (opset 20); returns how many."""
    uses = Uses(graph)
    return fuse_matches(graph, ("Erf", "Tanh"), lambda erf, taken: _gelu(graph, uses, erf, taken))
