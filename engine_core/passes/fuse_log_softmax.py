"""Softmax followed by Log -> one ``LogSoftmax`` over the same axis.

Why: besides saving a layer, log(softmax(x)) underflows to -inf where softmax rounds to 0, while
LogSoftmax computes x - max - log(sum(exp(x - max))) and stays finite.
"""

from __future__ import annotations

from engine_core.ir import Graph, Node
from engine_core.passes.pattern import Uses, is_op, origins, replace_nodes


def fuse_log_softmax(graph: Graph) -> int:
    """Replace every Softmax whose only reader is a Log; returns how many."""
    uses = Uses(graph)
    fused: dict[int, Node] = {}
    removed: set[int] = set()
    for softmax in list(graph.nodes):
        log = uses.sole_reader(softmax.outputs[0]) if is_op(softmax, "Softmax") else None
        if not is_op(log, "Log"):
            continue
        node = Node("LogSoftmax", list(softmax.inputs), list(log.outputs), dict(softmax.attrs),
                    f"{softmax.name}_log", "", softmax.opset, origins([softmax, log]))
        fused[id(log)] = node
        removed.update((id(softmax), id(log)))
    replace_nodes(graph, fused, removed)
    return len(fused)
