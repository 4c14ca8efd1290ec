"""Network IR (see graph.py)."""

from engine_core.ir.graph import Dim, Graph, Node, Value, has_subgraph, subgraph_reads

__all__ = ["Dim", "Graph", "Node", "Value", "has_subgraph", "subgraph_reads"]
