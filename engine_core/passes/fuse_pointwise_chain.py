"""Connected pointwise layers -> one ``kiln.PointwiseChain`` (its ``body`` holds the original nodes).

Why: each pointwise layer reads and writes whole tensors; a chain of them (a mask computation, the casts
at a precision boundary, residual add + activation, an activation's per-tensor QuantizeLinear ->
DequantizeLinear) becomes one generated kernel that reads every input once and keeps intermediates in
registers. A layer joins its reader's group when that reader is its only
reader, the tensor between them is not a graph output, and the group keeps at most MAX_INPUTS inputs.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from engine_core.ir import Graph, Node, Value
from engine_core.passes.pattern import Match, Uses, fuse_matches, origins
from engine_core.types import np_to_onnx


@cache
def chain_ops() -> tuple[frozenset[str], int]:
    """(ops a chain may contain, most inputs of one chain): what the CUDA backend generates code for.

    Imported on first use, so importing the passes does not load the CUDA backend. A pass importing a backend
    goes up the layers: tools/import_graph.py allows this one (UPWARD), since the op set is the generator's own.
    """
    from engine_core.backends.cuda.pointwise import MAX_INPUTS, POINTWISE_OPS

    return frozenset(POINTWISE_OPS) | {"Gelu", "LeakyRelu"}, MAX_INPUTS


#: zero-point / output types of the QuantizeLinear / DequantizeLinear a chain may hold (the generated kernels'
#: 8-bit integer quantization; other types and blocked scales lower on their own)
_QDQ_TYPES = (np.dtype(np.int8), np.dtype(np.uint8))


def _per_tensor_qdq(node: Node, graph: Graph, uses: Uses) -> bool:
    """A QuantizeLinear (saturating) or DequantizeLinear with one constant scale (and zero point) over 8-bit
    integers: a pointwise op. Why chain them: an explicitly quantized model run in float (Q/DQ convolutions
    on fp16 cuDNN) holds a Q -> DQ pair per activation; as one kernel it reads and writes the float tensor once
    and the int8 value stays in registers."""
    if node.attr("block_size", 0) or node.attr("saturate", 1) != 1 or len(node.inputs) < 2:
        return False
    scale = graph.constants.get(node.inputs[1])
    zero = graph.constants.get(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
    if scale is None or np.size(scale) != 1 or (len(node.inputs) > 2 and node.inputs[2] and zero is None):
        return False
    if zero is not None:
        return np.size(zero) == 1 and zero.dtype in _QDQ_TYPES
    if node.op_type == "QuantizeLinear":
        return node.attr("output_dtype", 0) in (0, np_to_onnx(np.dtype(np.int8)), np_to_onnx(np.dtype(np.uint8)))
    producer = uses.producers.get(node.inputs[0])  # a DequantizeLinear without a zero point: its input's type
    return producer is not None and producer.op_type == "QuantizeLinear" and _per_tensor_qdq(producer, graph, uses)


def _chainable(node: Node, graph: Graph, uses: Uses) -> bool:
    if node.domain not in ("", "ai.onnx") or len(node.outputs) != 1:
        return False
    if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
        return _per_tensor_qdq(node, graph, uses)
    if node.op_type not in chain_ops()[0]:
        return False
    return not (node.op_type == "Clip" and node.opset < 11)


def _external_inputs(group: list[Node]) -> list[str]:
    produced = {n.outputs[0] for n in group}
    seen: dict[str, None] = {}
    for node in group:
        for name in node.inputs:
            if name and name not in produced:
                seen.setdefault(name)
    return list(seen)


def _groups(graph: Graph, uses: Uses) -> list[list[Node]]:
    """The chains, each in graph order: groups of two or more chainable layers, each layer joined to its reader's
    group as described above."""
    group_of: dict[int, list[Node]] = {}
    for node in graph.nodes:  # topological order: a node's producers were seen before it
        if not _chainable(node, graph, uses):
            continue
        group = [node]
        for name in dict.fromkeys(n for n in node.inputs if n):
            producer = uses.producers.get(name)
            if producer is None or id(producer) not in group_of or uses.sole_reader(name) is not node:
                continue
            candidate = group_of[id(producer)]
            if candidate is group or len(_external_inputs(candidate + group)) > chain_ops()[1]:
                continue
            group = candidate + group
        for member in group:
            group_of[id(member)] = group
    order = {id(n): i for i, n in enumerate(graph.nodes)}
    groups = {id(g): g for g in group_of.values()}.values()
    return [sorted(g, key=lambda n: order[id(n)]) for g in groups if len(g) >= 2]


def _chain(graph: Graph, members: list[Node]) -> Match:
    """The ``PointwiseChain`` holding a chain's layers (copied, in graph order) as its body, in the place of its last
    layer."""
    last = members[-1]
    inputs = _external_inputs(members)
    body = Graph(f"{last.name}_body", [Value(n, _dtype_hint(graph, n)) for n in inputs],
                 [Value(last.outputs[0], _dtype_hint(graph, last.outputs[0]))], [_copy(n) for n in members], {},
                 dict(graph.opsets))
    node = Node("PointwiseChain", inputs, [last.outputs[0]], {"body": body}, last.name, "kiln", 1, origins(members))
    return node, members


def fuse_pointwise_chain(graph: Graph) -> int:
    """Group and replace every chain of two or more pointwise layers; returns how many chains were made."""
    chains = {id(members[-1]): members for members in _groups(graph, Uses(graph))}  # by the layer each replaces

    def match(node: Node, _: set[int]) -> Match | None:
        members = chains.get(id(node))
        return None if members is None else _chain(graph, members)

    return fuse_matches(graph, (*chain_ops()[0], "QuantizeLinear", "DequantizeLinear"), match)


def _copy(node: Node) -> Node:
    return Node(node.op_type, list(node.inputs), list(node.outputs), dict(node.attrs), node.name, node.domain,
                node.opset, list(node.origin))


def _dtype_hint(graph: Graph, name: str):
    """A declared dtype for a body value (the shapes and exact types are inferred at each use)."""
    if name in graph.constants:
        return graph.constants[name].dtype
    for value in (*graph.inputs, *graph.outputs):
        if value.name == name:
            return value.dtype
    return "float32"
