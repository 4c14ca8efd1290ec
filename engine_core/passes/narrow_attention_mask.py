"""An ``Attention`` mask computed elementwise from an ``Expand`` of a smaller tensor -> the same ops on that tensor.

Pattern (Hugging Face exports of BERT-style encoders: ``_prepare_4d_attention_mask`` expands the [batch, 1, 1,
keys] padding mask to [batch, 1, queries, keys], then inverts it with Cast / Sub / Where; transformers' newer
masking_utils builds the [batch, 1, 1, keys] padding mask with And / Cast, Expands it and makes it additive with
Where): Attention's ``attn_mask`` is the output of elementwise ops whose inputs are constants or outputs of
``Expand`` nodes, and each Expand keeps the last (key) dim of its input. The ops then read each Expand's input
instead, and the mask keeps the smaller shape, which Attention broadcasts to the scores itself: the same values.
The key-count Expand fuse_attention puts in front of a mask whose key dim the shapes do not prove (one per layer
when the mask is computed from ``attention_mask`` and the keys from ``input_ids``) is part of the computation, not
an end of it: it then copies [batch, 1, 1, keys] instead of [batch, 1, queries, keys]. Behind such an Expand the key
dim needs no proof (symbolic shapes cannot follow masking_utils' index arithmetic): it sets the last dim itself.

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
    """An Expand to a one-dim shape (``Shape(x, start, end)`` of one dim, or a one-element constant):
    fuse_attention's Expand of a mask to the key count (fold_attention_heads moves its dims to the 3-D form). It only
    widens a last dim of 1, so it reads a narrower mask as well and still ends in the same last dim."""
    shape_name = node.inputs[1] if len(node.inputs) > 1 else ""
    constant = uses.graph.constants.get(shape_name)
    if constant is not None:
        return constant.size == 1
    shape = uses.producers.get(shape_name)
    if not is_op(shape, "Shape"):
        return False
    start, end = int(shape.attr("start", 0)), shape.attr("end", None)
    return end is not None and (start < 0) == (int(end) < 0) and int(end) - start == 1


def _mask_cone(graph: Graph, uses: Uses, masks: list[str]) -> tuple[list[Node], list[Node], set[int]]:
    """(the elementwise nodes computing the ``masks``, the Expand nodes they read, the ids of those Expands every
    path from which to an Attention passes a key-count Expand), or ([], [], set()) when anything else feeds them (a
    full-size input, a non-elementwise op) or a cone tensor has a reader outside the cone. Key-count Expands
    (``_key_count_expand``) are part of the cone: they keep working on the narrowed mask."""
    cone: list[Node] = []
    expands: list[Node] = []
    unguarded: set[int] = set()
    pending, seen = [(mask, False) for mask in masks], set()
    while pending:
        tensor, guarded = pending.pop()
        if (tensor, guarded) in seen or tensor in graph.constants:
            continue
        seen.add((tensor, guarded))
        node = uses.producers.get(tensor)
        if is_op(node, "Expand") and _key_count_expand(uses, node) and tensor not in uses.outputs:
            if all(node is not c for c in cone):
                cone.append(node)
            pending.append((node.inputs[0], True))
            continue
        if is_op(node, "Expand"):
            if all(node is not e for e in expands):
                expands.append(node)
            if not guarded:
                unguarded.add(id(node))
            continue
        if not is_op(node, *ELEMENTWISE) or len(node.outputs) != 1 or tensor in uses.outputs:
            return [], [], set()
        if all(node is not c for c in cone):
            cone.append(node)
        pending += [(name, guarded) for name in node.inputs if name]
    inside = {id(node) for node in cone}
    for node in cone:  # a mask is read by Attention nodes (as their mask) or inside the cone; the rest inside only
        readers = uses.consumers.get(node.outputs[0], [])
        if node.outputs[0] in masks:
            if any(id(r) not in inside and (not is_op(r, "Attention") or r.inputs.index(node.outputs[0]) != 3)
                   for r in readers):
                return [], [], set()
        elif any(id(r) not in inside for r in readers):
            return [], [], set()
    return cone, expands, {id(e) for e in expands} - unguarded


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
    symbols: list[Symbols] = []  # computed once, when an Expand outside a key-count Expand needs the proof

    def keeps_key_dim(expand: Node) -> bool:
        symbols[:] = symbols or [symbolic_shapes(graph)]
        return _keeps_key_dim(symbols[0], expand)

    def narrow(roots: list[str]) -> bool:
        cone, expands, guarded = _mask_cone(graph, uses, roots)
        if not expands or not all(id(expand) in guarded or keeps_key_dim(expand) for expand in expands):
            return False
        sources = {expand.outputs[0]: expand.inputs[0] for expand in expands}
        for node in cone:
            node.inputs = [sources.get(name, name) for name in node.inputs]
        return True

    if narrow(sorted(set(masks.values()))):
        return len(masks)
    return sum(narrow([mask]) for mask in masks.values())
