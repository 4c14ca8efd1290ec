"""Shape operands computed from the graph inputs' dims -> constants and Shape slices of those inputs.

Exporters compute a Reshape's or Expand's target from ``x.shape`` with integer arithmetic (ViT's patch count
``(h // p) * (w // p)``, torch's ``expand(n, -1, -1)`` idiom ``Where(Equal(shape, -1), 1, shape)``). symbolic_shapes
tracks shape values through Shape / Gather / Concat / Unsqueeze only, so the first such target loses the shapes of
everything after it, and the passes that must prove a layout (fold_attention_heads) stop working for the whole
model. attention_facts evaluates that arithmetic; where it finds every element of the operand to be a number or a
dim of a graph input, the operand becomes that: a constant, or a Concat of constants and ``Shape(input)[i:i+1]``.
Only graph inputs are read, so no intermediate tensor gains a reader that could stop a fusion.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from engine_core.ir import Graph, Node
from engine_core.passes.attention_facts import Facts
from engine_core.passes.dead_code import eliminate_dead_code
from engine_core.passes.layout_atoms import target_tensor
from engine_core.passes.pattern import Uses, is_op
from engine_core.passes.symbolic import Sym, symbolic_shapes

#: Ops with a shape operand, and its input index.
_OPERAND = {"Reshape": 1, "Expand": 1, "ConstantOfShape": 0, "Tile": 1}


def _input_dims(graph: Graph) -> dict[Sym, tuple[str, int]]:
    """Symbol -> (graph input, axis) for every dim of a graph input: ``(input, axis)``, and ``("dim:name", -1)``
    (symbolic_shapes' symbol for a named dim, the same wherever it appears) for its first appearance."""
    found: dict[Sym, tuple[str, int]] = {}
    for value in graph.inputs:
        for axis, d in enumerate(value.shape or ()):
            found.setdefault((value.name, axis), (value.name, axis))
            if isinstance(d, str) and d:
                found.setdefault((f"dim:{d}", -1), (value.name, axis))
    return found


def resolve_shape_operands(graph: Graph) -> int:
    """Rewrite every shape operand the facts resolve to input dims; returns how many were rewritten."""
    uses = Uses(graph)
    sym = symbolic_shapes(graph)
    facts = Facts(graph, uses, sym)
    inputs = _input_dims(graph)
    replaced: dict[int, list[Node]] = {}
    for node in graph.nodes:
        index = _OPERAND.get(node.op_type) if is_op(node, *_OPERAND) else None
        name = node.inputs[index] if index is not None and len(node.inputs) > index else ""
        if index is None or not name or name in graph.constants or name in sym.values:
            continue
        value = facts.value(name)
        if value is None or not all(isinstance(v, int) or v in inputs for v in value):
            continue
        by_input: dict[str, list] = {}
        for v in value:
            if not isinstance(v, int):
                by_input.setdefault(inputs[v][0], []).append(v)
        if len(by_input) > 1:
            continue  # one Shape source per operand (target_tensor reads one tensor)
        source = next(iter(by_input), "")
        pieces = [v if isinstance(v, int) else ("", inputs[v][1]) for v in value]
        if all(isinstance(p, int) for p in pieces):
            operand, extra = graph.add_constant(f"{name}_resolved", np.array(pieces, np.int64)), list[Node]()
        else:
            operand, extra = target_tensor(graph, source, pieces, name)
        inputs_ = list(node.inputs)
        inputs_[index] = operand
        replaced[id(node)] = [*extra, dataclasses.replace(node, inputs=inputs_)]
    if replaced:
        graph.nodes = [m for n in graph.nodes for m in replaced.get(id(n), [n])]
        eliminate_dead_code(graph)
    return len(replaced)
