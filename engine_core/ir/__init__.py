"""Network IR (see graph.py)."""

from engine_core.ir.graph import Dim, Graph, Node, Value

__all__ = ["Dim", "Graph", "Node", "Value"]
