"""An ``Attention`` mask computed elementwise from an ``Expand`` of a smaller tensor -> the same ops on that tensor.

Pattern (Hugging Face exports of BERT-style encoders: ``_prepare_4d_attention_mask`` expands the [batch, 1, 1,
keys] padding mask to [batch, 1, queries, keys], then inverts it with Cast / Sub / Where; transformers' newer
masking_utils builds the [batch, 1, 1, keys] padding mask with And / Cast, Expands it and makes it additive with
Where): Attention's ``attn_mask`` is the output of elementwise ops whose inputs are constants or outputs of
``Expand`` nodes, and each Expand keeps the last (key) dim of its input. The ops then read each Expand's input
instead, and the mask keeps the smaller shape, which Attention broadcasts to the scores itself: the same values.
The key-count Expand fuse_attention puts in front of a mask whose key dim the shapes do not prove (one per layer
when the mask is computed from ``attention_mask`` and the keys from ``input_ids``) is part of the computation, not
an end of it: it then copies [batch, 1, 1, keys] instead of [batch, 1, queries, keys].

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


def _key_count_expand(uses: Uses, node: Node) -> bool:
    """fuse_attention's Expand of a mask to the key count (shape ``Shape(key, start=-2, end=-1)``): one target dim,
    so it only widens a last dim of 1 and reads a narrower mask as well."""
    shape = uses.producers.get(node.inputs[1]) if len(node.inputs) > 1 else None
    return is_op(shape, "Shape") and shape.attr("start", 0) == -2 and shape.attr("end", None) == -1


def _mask_cone(graph: Graph, uses: Uses, masks: list[str]) -> tuple[list[Node], list[Node]]:
    """(the elementwise nodes computing the ``masks``, the Expand nodes they read), or ([], []) when anything else
    feeds them (a full-size input, a non-elementwise op) or a cone tensor has a reader outside the cone. Key-count
    Expands (``_key_count_expand``) are part of the cone: they keep working on the narrowed mask."""
    cone: list[Node] = []
    expands: list[Node] = []
    pending, seen = list(masks), set()
    while pending:
        tensor = pending.pop()
        if tensor in seen or tensor in graph.constants:
            continue
        seen.add(tensor)
        node = uses.producers.get(tensor)
        if is_op(node, "Expand") and _key_count_expand(uses, node) and tensor not in uses.outputs:
            cone.append(node)
            pending.append(node.inputs[0])
            continue
        if is_op(node, "Expand"):
            if all(node is not e for e in expands):
                expands.append(node)
            continue
        if not is_op(node, *ELEMENTWISE) or len(node.outputs) != 1 or tensor in uses.outputs:
            return [], []
        cone.append(node)
        pending += [name for name in node.inputs if name]
    inside = {id(node) for node in cone}
    for node in cone:  # a mask is read by Attention nodes (as their mask) or inside the cone; the rest inside only
        readers = uses.consumers.get(node.outputs[0], [])
        if node.outputs[0] in masks:
            if any(id(r) not in inside and (not is_op(r, "Attention") or r.inputs.index(node.outputs[0]) != 3)
                   for r in readers):
                return [], []
        elif any(id(r) not in inside for r in readers):
            return [], []
    return cone, expands


def _keeps_key_dim(sym: Symbols, expand: Node) -> bool:
    source, result = sym.shape(expand.inputs[0]), sym.shape(expand.outputs[0])
    return bool(source) and bool(result) and source[-1] == result[-1] and len(source) <= len(result)


def narrow_attention_mask(graph: Graph) -> int:
    """Rewire each eligible mask computation to read the Expands' inputs; returns how many Attention masks changed.
    All masks at once first (exports compute one mask every layer reads, through a key-count Expand each), then
    each on its own."""
    uses = Uses(graph)
    masks = {id(node): node.inputs[3] for node in graph.nodes
             if is_op(node, "Attention") and len(node.inputs) > 3 and node.inputs[3]}
    if not masks:
        return 0
    sym = symbolic_shapes(graph)

    def narrow(roots: list[str]) -> bool:
        cone, expands = _mask_cone(graph, uses, roots)
        if not expands or not all(_keeps_key_dim(sym, expand) for expand in expands):
            return False
        sources = {expand.outputs[0]: expand.inputs[0] for expand in expands}
        for node in cone:
            node.inputs = [sources.get(name, name) for name in node.inputs]
        return True

    if narrow(sorted(set(masks.values()))):
        return len(masks)
    return sum(narrow([mask]) for mask in masks.values())
