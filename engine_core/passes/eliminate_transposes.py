"""Transpose clean-up: consecutive Transposes merge into one, identity Transposes disappear.

Why: exporters split heads with one Transpose and transpose K with another (and the attention fusion
may leave a third); each is a full copy of the tensor on the GPU. Runs after fuse_attention, which
matches the two-Transpose form of K.
"""

from __future__ import annotations

from engine_core.ir import Graph
from engine_core.passes.pattern import Uses, is_op


def _perm(node) -> list[int] | None:
    """The explicit permutation (None when the attribute is absent: reversal of an unknown rank)."""
    perm = node.attr("perm")
    return [int(p) for p in perm] if perm is not None and len(perm) else None


def _merge_pairs(graph: Graph) -> int:
    """Make every Transpose of a Transpose read the first one's input with the composed permutation."""
    producers = graph.producers()
    merged = 0
    for node in graph.nodes:
        inner = producers.get(node.inputs[0]) if is_op(node, "Transpose") else None
        if not is_op(inner, "Transpose"):
            continue
        outer_perm, inner_perm = _perm(node), _perm(inner)
        if outer_perm is None or inner_perm is None or len(outer_perm) != len(inner_perm):
            continue
        node.inputs = [inner.inputs[0]]
        node.attrs = {**node.attrs, "perm": [inner_perm[p] for p in outer_perm]}
        node.origin = [*inner.origin, *node.origin]
        merged += 1
    return merged


def _drop_identities(graph: Graph) -> int:
    """Readers of an identity Transpose read its input instead (graph outputs keep their Transpose)."""
    uses = Uses(graph)
    dropped = 0
    for node in list(graph.nodes):
        perm = _perm(node) if is_op(node, "Transpose") else None
        if perm is None or perm != list(range(len(perm))) or node.outputs[0] in uses.outputs:
            continue
        if any(node.outputs[0] not in n.inputs for n in uses.consumers.get(node.outputs[0], [])):
            continue  # a Loop/If/Scan body reads it from the enclosing scope: the name must stay
        graph.rename_tensor_uses(node.outputs[0], node.inputs[0])
        graph.nodes.remove(node)
        dropped += 1
    return dropped


def _drop_unread(graph: Graph) -> None:
    """Remove Transposes that merging left without readers (the count already has them as merged)."""
    uses = Uses(graph)
    graph.nodes = [n for n in graph.nodes if not is_op(n, "Transpose") or n.outputs[0] in uses.outputs
                   or uses.consumers.get(n.outputs[0])]


def eliminate_transposes(graph: Graph) -> int:
    """Merge and drop Transposes in place; returns how many were merged or dropped."""
    merged = _merge_pairs(graph)
    if merged:
        _drop_unread(graph)
    return merged + _drop_identities(graph)
