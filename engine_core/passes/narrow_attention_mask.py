"""An ``Attention`` mask computed elementwise from an ``Expand`` of a smaller tensor -> the same ops on that tensor.

Pattern (Hugging Face exports of BERT-style encoders: ``_prepare_4d_attention_mask`` expands the [batch, 1, 1,
keys] padding mask to [batch, 1, queries, keys], then inverts it with Cast / Sub / Where): Attention's
``attn_mask`` is the output of elementwise ops whose inputs are constants or outputs of ``Expand`` nodes, and
each Expand keeps the last (key) dim of its input. The ops then read each Expand's input instead, and the mask
keeps the smaller shape, which Attention broadcasts to the scores itself: the same values.

Why: the expanded mask costs kernels of its own over batch x queries x keys elements, and the fused attention
kernel must then stream a mask value per query row and key instead of staging one bias row per key tile
(cuda_kernels/flash_attention.cu; BERT-base at batch 64 on the H100: 49 against 38 us a layer).
The Expand must keep the key dim (proved by symbolic shapes): a mask shorter than the keys means "pad with
-inf" to Attention, not "broadcast".
"""

from __future__ import annotations

from engine_core.ir import Graph, Node
from engine_core.passes.pattern import Uses, is_op
from engine_core.passes.symbolic import Symbols, symbolic_shapes

#: Elementwise ops (one output; multidirectional broadcasting for the binary ones) a mask may be computed with.
ELEMENTWISE = frozenset(("Identity", "Cast", "Not", "Neg", "Abs", "Add", "Sub", "Mul", "Div", "Where", "Equal",
                         "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor", "Max", "Min"))


def _mask_cone(graph: Graph, uses: Uses, mask: str) -> tuple[list[Node], list[Node]]:
    """(the elementwise nodes computing ``mask``, the Expand nodes they read), or ([], []) when anything else
    feeds it (a full-size input, a non-elementwise op) or a cone tensor has a reader outside the cone."""
    cone: list[Node] = []
    expands: list[Node] = []
    pending, seen = [mask], set()
    while pending:
        tensor = pending.pop()
        if tensor in seen or tensor in graph.constants:
            continue
        seen.add(tensor)
        node = uses.producers.get(tensor)
        if is_op(node, "Expand"):
            if all(node is not e for e in expands):
                expands.append(node)
            continue
        if not is_op(node, *ELEMENTWISE) or len(node.outputs) != 1 or tensor in uses.outputs:
            return [], []
        cone.append(node)
        pending += [name for name in node.inputs if name]
    inside = {id(node) for node in cone}
    for node in cone:  # the mask itself is read by Attention nodes only (as their mask), the rest inside
        readers = uses.consumers.get(node.outputs[0], [])
        if node.outputs[0] == mask:
            if any(not is_op(r, "Attention") or r.inputs.index(mask) != 3 for r in readers):
                return [], []
        elif any(id(r) not in inside for r in readers):
            return [], []
    return cone, expands


def _keeps_key_dim(sym: Symbols, expand: Node) -> bool:
    source, result = sym.shape(expand.inputs[0]), sym.shape(expand.outputs[0])
    return bool(source) and bool(result) and source[-1] == result[-1] and len(source) <= len(result)


def narrow_attention_mask(graph: Graph) -> int:
    """Rewire each eligible mask computation to read the Expands' inputs; returns how many masks changed."""
    uses = Uses(graph)
    sym: Symbols | None = None
    changed = 0
    for attention in graph.nodes:
        if not is_op(attention, "Attention") or len(attention.inputs) < 4 or not attention.inputs[3]:
            continue
        cone, expands = _mask_cone(graph, uses, attention.inputs[3])
        if not expands:
            continue
        sym = sym or symbolic_shapes(graph)
        if not all(_keeps_key_dim(sym, expand) for expand in expands):
            continue
        sources = {expand.outputs[0]: expand.inputs[0] for expand in expands}
        for node in cone:
            node.inputs = [sources.get(name, name) for name in node.inputs]
        changed += 1
    return changed
