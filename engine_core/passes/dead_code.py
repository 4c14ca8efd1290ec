"""Dead-code elimination: drop nodes (and constants) that no graph output depends on."""

from __future__ import annotations

from engine_core.ir import Graph


def eliminate_dead_code(graph: Graph) -> int:
    """Remove unused nodes and constants in place; returns the number of nodes removed."""
    needed = set(graph.output_names)
    kept = []
    for node in reversed(graph.nodes):
        if any(o in needed for o in node.outputs if o):
            kept.append(node)
            needed.update(i for i in node.inputs if i)
            needed.update(_subgraph_reads(node))
    removed = len(graph.nodes) - len(kept)
    graph.nodes = kept[::-1]
    for name in [c for c in graph.constants if c not in needed]:
        del graph.constants[name]
    return removed


def _subgraph_reads(node) -> set[str]:
    """Names a Loop/If/Scan body reads from the enclosing scope (they keep their producers alive)."""
    reads: set[str] = set()
    for value in node.attrs.values():
        for sub in value if isinstance(value, list) else [value]:
            if isinstance(sub, Graph):
                produced = set(sub.constants) | set(sub.input_names) | {o for n in sub.nodes for o in n.outputs}
                for n in sub.nodes:
                    reads.update(i for i in n.inputs if i and i not in produced)
                    reads.update(_subgraph_reads(n))
                reads.update(o for o in sub.output_names if o not in produced)
    return reads
