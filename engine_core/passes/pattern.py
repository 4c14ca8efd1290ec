"""Small matching helpers the fusion passes share: who reads a tensor, constant scalars, node rewiring."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from engine_core.ir import Graph, Node, has_subgraph, subgraph_reads
from engine_core.types import onnx_to_np


class Uses:
    """Producers and consumers of every tensor of a graph, and its outputs, for one pass over it.

    A control-flow node counts as a reader of every outer tensor its bodies read, so no fusion removes
    a tensor a Loop/If/Scan body still needs.
    """

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.producers = graph.producers()
        self.consumers = graph.consumers()
        for node in graph.nodes:
            if has_subgraph(node):
                for name in subgraph_reads(node) - set(node.inputs):
                    self.consumers.setdefault(name, []).append(node)
        self.outputs = set(graph.output_names)

    def sole_reader(self, tensor: str) -> Node | None:
        """The one node reading ``tensor`` when it has exactly one reader and is not a graph output."""
        readers = self.consumers.get(tensor, [])
        if tensor in self.outputs or len(readers) != 1:
            return None
        return readers[0]

    def producer(self, tensor: str, op_type: str) -> Node | None:
        node = self.producers.get(tensor)
        return node if node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx") else None


def scalar(graph: Graph, name: str) -> float | None:
    """The value of a one-element float constant, else None."""
    value = graph.constants.get(name)
    if not isinstance(value, np.ndarray) or value.size != 1 or value.dtype.kind not in "fc" and \
            value.dtype.name != "bfloat16":
        return None
    return float(value.reshape(-1)[0].astype(np.float64))


def other_input(node: Node, name: str) -> str | None:
    """The input of a binary node that is not ``name`` (None if ``name`` is not one of two inputs)."""
    if len(node.inputs) != 2 or name not in node.inputs:
        return None
    return node.inputs[1] if node.inputs[0] == name else node.inputs[0]


def is_op(node: Node | None, *op_types: str) -> bool:
    """``node`` is a standard-domain ONNX node of one of these types."""
    return node is not None and node.op_type in op_types and node.domain in ("", "ai.onnx")


#: what a match gives: (the fused node, or a run of nodes, that takes the place of the last covered node; every node
#: the match covers, that one last)
Match = tuple[Node | list[Node], list[Node]]


def replace_nodes(graph: Graph, fused: dict[int, Node | list[Node]], removed: set[int]) -> None:
    """Put each fused node (or run of nodes, in order) where the node it is keyed by (id) was, drop ``removed``
    nodes."""
    nodes: list[Node] = []
    for node in graph.nodes:
        new = fused.get(id(node))
        if new is not None:
            nodes.extend(new if isinstance(new, list) else [new])
        elif id(node) not in removed:
            nodes.append(node)
    graph.nodes = nodes


def fuse_matches(graph: Graph, op_types: tuple[str, ...], match: Callable[[Node, set[int]], Match | None],
                 domain: str = "") -> int:
    """The fusion loop every rooted pattern pass shares: for each node of ``op_types`` (in ``domain``: the standard
    one by default) in graph order that no earlier match covered, ``match(node, covered ids)`` gives a ``Match`` or
    None (the ids let a pattern refuse nodes an earlier match took). The node list changes only at the end, so every
    match sees the original one. Returns how many matches."""
    fused: dict[int, Node | list[Node]] = {}
    removed: set[int] = set()
    for node in list(graph.nodes):
        of_type = node.op_type in op_types and node.domain == domain if domain else is_op(node, *op_types)
        if id(node) in removed or not of_type:
            continue
        found = match(node, removed)
        if found is None:
            continue
        replacement, covered = found
        fused[id(covered[-1])] = replacement
        removed.update(id(n) for n in covered)
    replace_nodes(graph, fused, removed)
    return len(fused)


def last_axis_mean(graph: Graph, node: Node | None) -> bool:
    """``node`` is ReduceMean over the last axis only, keeping dims (axes are input 1 once parsed)."""
    if not is_op(node, "ReduceMean") or not node.attr("keepdims", 1):
        return False
    axes = graph.constants.get(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] else node.attr("axes")
    return axes is not None and [int(a) for a in np.asarray(axes).reshape(-1)] == [-1]


def squared(graph: Graph, node: Node | None) -> str | None:
    """x when ``node`` is Pow(x, 2) or Mul(x, x)."""
    if is_op(node, "Pow") and scalar(graph, node.inputs[1]) == 2.0:
        return node.inputs[0]
    if is_op(node, "Mul") and node.inputs[0] == node.inputs[1]:
        return node.inputs[0]
    return None


def vector(graph: Graph, name: str) -> np.ndarray | None:
    """A constant with every dim but the last equal to 1, as 1-D (a per-feature scale or shift)."""
    value = graph.constants.get(name)
    if not isinstance(value, np.ndarray) or value.ndim == 0 or any(d != 1 for d in value.shape[:-1]):
        return None
    return value.reshape(-1)


def as_vector(graph: Graph, name: str, value: np.ndarray) -> str:
    """``name`` when the constant already is ``value`` (1-D), else a new constant holding ``value``."""
    return name if graph.constants[name].ndim == 1 else graph.add_constant(f"{name}_vector", value)


def origins(nodes: list[Node]) -> list[str]:
    """The ONNX node names a fused layer covers, in graph order of ``nodes``."""
    return [o for n in nodes for o in n.origin]


#: ops whose output has the rank of their non-constant input (scaling Q, casting K and V)
_SAME_RANK = ("Mul", "Div", "Add", "Sub", "Cast", "Identity", "Relu", "Neg")


def _scalar_constant(graph: Graph, name: str) -> bool:
    """A one-element constant of rank <= 1 (combining with it never raises a tensor's rank here)."""
    value = graph.constants.get(name)
    return value is not None and value.size == 1 and value.ndim <= 1


def known_rank(graph: Graph, uses: Uses, name: str, depth: int = 4) -> int | None:
    """The rank of ``name`` when the graph states it without shape inference (the IR keeps no
    intermediate shapes): a Transpose's perm, a Reshape to a constant shape, a graph input's shape,
    through ops that keep the rank of a tensor combined with a scalar constant."""
    node = uses.producers.get(name)
    if node is None:
        value = next((v for v in graph.inputs if v.name == name), None)
        return len(value.shape) if value is not None and value.shape is not None else None
    if is_op(node, "Transpose") and node.attr("perm"):
        return len(node.attr("perm"))
    if is_op(node, "Reshape") and node.inputs[1] in graph.constants:
        return int(graph.constants[node.inputs[1]].size)
    if depth and is_op(node, *_SAME_RANK):
        tensors = [i for i in node.inputs if i and not _scalar_constant(graph, i)]
        if len(tensors) == 1:
            return known_rank(graph, uses, tensors[0], depth - 1)
    return None


def int8_per_tensor(graph: Graph, q: Node) -> bool:
    """A QuantizeLinear a kernel can do in its epilogue: one constant fp32 scale, an int8 result, zero point 0
    or none, no ``precision`` override."""
    scale = graph.constants.get(q.inputs[1]) if len(q.inputs) > 1 else None
    if not isinstance(scale, np.ndarray) or scale.size != 1 or scale.dtype != np.float32 or q.attr("precision", 0):
        return False
    zero = graph.constants.get(q.inputs[2]) if len(q.inputs) > 2 and q.inputs[2] else None
    if zero is not None:
        return isinstance(zero, np.ndarray) and zero.dtype == np.int8 and zero.size == 1 and not zero.any()
    declared = q.attr("output_dtype", 0)
    return bool(declared) and np.dtype(onnx_to_np(declared)) == np.int8


#: ops whose output has the element type of every (float) input: any input's type is the output's
_TYPE_OF_ANY = frozenset(("Add", "Sub", "Mul", "Div", "MatMul", "Max", "Min", "Sum", "Mean", "Concat"))
#: ops whose (first) output has the element type of their first input
_TYPE_OF_FIRST = frozenset(("Identity", "Neg", "Abs", "Relu", "Sigmoid", "Tanh", "Erf", "Gelu", "Sqrt", "Exp", "Log",
                            "Reciprocal", "Softmax", "Pow", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten",
                            "Expand", "Slice", "Gather", "ReduceMean", "ReduceSum", "LayerNormalization",
                            "RMSNormalization"))


def float_type(graph: Graph, uses: Uses, name: str, depth: int = 8) -> np.dtype | None:
    """The element type of ``name`` when the graph states it without type inference (the IR keeps no intermediate
    types): a constant's, a graph input's, a Cast's target, through ops that keep their inputs' type (a residual
    Add of a MatMul by a weight, a Gather from an embedding table). Why: a pass may drop a Cast only when it provably
    converts nothing."""
    if name in graph.constants:
        return np.asarray(graph.constants[name]).dtype
    value = next((v for v in graph.inputs if v.name == name), None)
    if value is not None:
        return value.dtype
    node = uses.producers.get(name)
    if node is None or depth == 0 or node.domain not in ("", "ai.onnx") or name != node.outputs[0]:
        return None
    if node.op_type == "Cast":
        return np.dtype(onnx_to_np(node.attr("to")))
    if node.op_type in _TYPE_OF_ANY:
        candidates = node.inputs
    elif node.op_type in _TYPE_OF_FIRST:
        candidates = node.inputs[:1]
    elif node.op_type in ("Where", "CastLike"):
        candidates = node.inputs[1:3] if node.op_type == "Where" else node.inputs[1:2]
    else:
        return None
    for candidate in candidates:
        found = float_type(graph, uses, candidate, depth - 1) if candidate else None
        if found is not None:
            return found
    return None


def feeding_only(uses: Uses, tensor: str, covered: set[int], limit: int = 32) -> list[Node] | None:
    """The readers of ``tensor`` outside ``covered`` (ids) and every node they feed, when all of them only feed
    covered nodes (no graph output among their results): the shape arithmetic (Shape -> Gather -> Div -> Unsqueeze)
    that computes a covered Slice's bounds, dead once the match replaces the Slice; None when any of it is read
    elsewhere, or past ``limit`` nodes. Why: a match may then drop a producer whose only other readers those are."""
    found: dict[int, Node] = {}
    pending = [tensor]
    while pending:
        name = pending.pop()
        if name in uses.outputs:
            return None
        for reader in uses.consumers.get(name, []):
            if id(reader) in covered or id(reader) in found:
                continue
            found[id(reader)] = reader
            if len(found) > limit:
                return None
            pending.extend(o for o in reader.outputs if o)
    return list(found.values())
