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
An Expand's input that is an ``And`` with an operand true everywhere is read as its other operand: masking_utils
ands the [batch, 1, 1, keys] padding mask with ``q_idx >= 0`` ([1, 1, queries, 1], a Range from 0 compared with 0),
which makes the mask full-size before its Expand though it never masks anything.

Why: the expanded mask costs kernels of its own over batch x queries x keys elements, and the fused attention
kernel must then stream a mask value per query row and key instead of staging one bias row per key tile
(cuda_kernels/flash_attention.cu; BERT-base at batch 64 on the H100: 49 against 38 us a layer).
The Expand must keep the key dim (proved by symbolic shapes): a mask shorter than the keys means "pad with
-inf" to Attention, not "broadcast".
"""

from __future__ import annotations

import numpy as np

from engine_core.ir import Graph, Node
from engine_core.passes.pattern import Uses, is_op
from engine_core.passes.symbolic import Symbols, symbolic_shapes
from engine_core.types import onnx_to_np

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


#: Ops that keep each element's value (and so an everywhere-true or bounded-below tensor stays one).
_VALUE_VIEWS = ("Identity", "Unsqueeze", "Reshape", "Squeeze", "Flatten", "Expand")


def _lower_bound(graph: Graph, uses: Uses, name: str) -> float | None:
    """A number no element of ``name`` is below, where a constant, ``Range(start, limit, delta > 0)`` or a view of
    one shows it; else None."""
    if name in graph.constants:
        value = graph.constants[name]
        return float(value.min()) if value.size and value.dtype.kind in "iuf" else None
    node = uses.producers.get(name)
    if is_op(node, *_VALUE_VIEWS):
        return _lower_bound(graph, uses, node.inputs[0])
    if is_op(node, "Range"):
        start, delta = (graph.constants.get(n) for n in (node.inputs[0], node.inputs[2]))
        if start is not None and delta is not None and start.size == delta.size == 1 and float(delta) > 0:
            return float(start)
    return None


def _all_true(graph: Graph, uses: Uses, name: str) -> bool:
    """Whether every element of the boolean ``name`` is provably true: a constant, ``x >= c`` / ``x > c`` with x
    bounded below (``_lower_bound``), an And of such, a bool Cast or a view of one."""
    if name in graph.constants:
        value = graph.constants[name]
        return value.dtype == bool and bool(value.all())
    node = uses.producers.get(name)
    if is_op(node, *_VALUE_VIEWS) or is_op(node, "Cast") and onnx_to_np(node.attr("to")) == np.bool_:
        return _all_true(graph, uses, node.inputs[0])
    if is_op(node, "And"):
        return all(_all_true(graph, uses, n) for n in node.inputs)
    if is_op(node, "GreaterOrEqual", "Greater") and node.inputs[1] in graph.constants:
        low, bound = _lower_bound(graph, uses, node.inputs[0]), graph.constants[node.inputs[1]]
        if low is None or bound.size != 1 or bound.dtype.kind not in "iuf":
            return False
        return low >= float(bound) if node.op_type == "GreaterOrEqual" else low > float(bound)
    return False


def _without_true_terms(graph: Graph, uses: Uses, name: str) -> str:
    """``name``, or for ``And(x, t)`` with t true everywhere, x (recursively): the same values wherever both are
    broadcast to one shape, which the mask's Expand and Attention do; x may have fewer dims of size > 1."""
    node = uses.producers.get(name)
    if not is_op(node, "And") or len(node.inputs) != 2:
        return name
    for keep, drop in (node.inputs, reversed(node.inputs)):
        if _all_true(graph, uses, drop) and not _all_true(graph, uses, keep):
            return _without_true_terms(graph, uses, keep)
    return name


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


def _keeps_key_dim(sym: Symbols, source_name: str, expand: Node) -> bool:
    """Whether ``source_name`` (the Expand's input, or what it reads as that) has the Expand's last dim."""
    source, result = sym.shape(source_name), sym.shape(expand.outputs[0])
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

    def keeps_key_dim(source: str, expand: Node) -> bool:
        symbols[:] = symbols or [symbolic_shapes(graph)]
        return _keeps_key_dim(symbols[0], source, expand)

    def narrow(roots: list[str]) -> bool:
        cone, expands, guarded = _mask_cone(graph, uses, roots)
        sources = {expand.outputs[0]: _without_true_terms(graph, uses, expand.inputs[0]) for expand in expands}
        if not expands or not all(id(expand) in guarded or keeps_key_dim(sources[expand.outputs[0]], expand)
                                  for expand in expands):
            return False
        for node in cone:
            node.inputs = [sources.get(name, name) for name in node.inputs]
        return True

    if narrow(sorted(set(masks.values()))):
        return len(masks)
    return sum(narrow([mask]) for mask in masks.values())
