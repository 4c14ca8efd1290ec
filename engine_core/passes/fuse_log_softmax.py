"""Softmax followed by Log -> one ``LogSoftmax`` over the same axis.

Why: besides saving a layer, log(softmax(x)) underflows to -inf where softmax rounds to 0, while
LogSoftmax computes x - max - log(sum(exp(x - max))) and stays finite.
"""

from __future__ import annotations

from engine_core.ir import Graph, Node
from engine_core.passes.pattern import Match, Uses, fuse_matches, is_op, origins


def _log_softmax(uses: Uses, softmax: Node) -> Match | None:
    """The ``LogSoftmax`` for ``softmax`` and the Log that is its only reader, in the Log's place."""
    log = uses.sole_reader(softmax.outputs[0])
    if not is_op(log, "Log"):
        return None
    node = Node("LogSoftmax", list(softmax.inputs), list(log.outputs), dict(softmax.attrs),
                f"{softmax.name}_log", "", softmax.opset, origins([softmax, log]))
    return node, [softmax, log]


def fuse_log_softmax(graph: Graph) -> int:
    """Replace every Softmax whose only reader is a Log; returns how many."""
    uses = Uses(graph)
    return fuse_matches(graph, ("Softmax",), lambda softmax, _: _log_softmax(uses, softmax))
