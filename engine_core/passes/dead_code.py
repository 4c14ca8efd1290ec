"""Dead-code elimination: drop nodes (and constants) that no graph output depends on."""

from __future__ import annotations

from engine_core.ir import Graph, subgraph_reads


def eliminate_dead_code(graph: Graph) -> int:
    """Remove unused nodes and constants in place; returns the number of nodes removed."""
    needed = set(graph.output_names)
    kept = []
    for node in reversed(graph.nodes):
        if any(o in needed for o in node.outputs if o):
            kept.append(node)
            needed.update(i for i in node.inputs if i)
            needed.update(subgraph_reads(node))
    removed = len(graph.nodes) - len(kept)
    graph.nodes = kept[::-1]
    for name in [c for c in graph.constants if c not in needed]:
        del graph.constants[name]
    return removed

