"""Constant folding: nodes whose inputs are all constants become constants.

Ops that are not deterministic (random) are kept; so are folds whose result would be much larger
than their inputs (an Expand or Tile of a small constant is cheaper to run than to store).
Each fold's output size is predicted by the op's (cheap) shape inference before anything runs, so a
hostile ConstantOfShape/Expand/Tile never allocates its output here; one whose constant output would
exceed `max_constant_bytes()` (``BuilderConfig.max_constant_bytes``) fails the build, since every run of the
plan would have to allocate it.
"""

from __future__ import annotations

import numpy as np

from engine_core.builder_config import MAX_CONSTANT_BYTES as MAX_CONSTANT_BYTES  # re-exported: it lived here
from engine_core.builder_config import build_knobs
from engine_core.errors import BuildError
from engine_core.interpret import run_node
from engine_core.ir import Graph, Node, has_subgraph
from engine_core.ops import TensorInfo, get_op
from engine_core.passes.fuse_qdq_conv import keeps_int8_conv_weight
from engine_core.passes.fuse_qdq_matmul import keeps_int8_weight
from engine_core.passes.pattern import Uses
from engine_core.passes.shape_inference import VALUE_LIMIT

#: Never store a folded result larger than this many bytes unless its inputs were as large.
GROWTH_LIMIT_BYTES = 1 << 20


def max_constant_bytes() -> int:
    """The bound on one constant tensor: the build's ``BuilderConfig.max_constant_bytes``; outside a build
    `KILN_MAX_CONSTANT_BYTES` if set, else MAX_CONSTANT_BYTES."""
    return build_knobs().max_constant_bytes


def fold_constants(graph: Graph) -> int:
    """Fold constant subexpressions in place; returns the number of nodes folded."""
    static_shapes = {v.name: v.shape for v in graph.inputs if not v.is_dynamic}
    folded = 0
    kept = []
    uses = Uses(graph)
    limit = max_constant_bytes()
    for node in graph.nodes:
        op = get_op(node.op_type, node.domain)
        present = [i for i in node.inputs if i]
        if node.op_type == "Shape" and not node.domain and present and present[0] in static_shapes:
            # only the shape is read: a zero-stride view, so a huge declared input shape allocates nothing
            args = [np.broadcast_to(np.zeros((), np.uint8), static_shapes[present[0]])]
        elif op is None or not op.deterministic or not present or not all(i in graph.constants for i in present) \
                or keeps_int8_weight(graph, node, uses) or keeps_int8_conv_weight(graph, node, uses):  # read as int8
            kept.append(node)
            continue
        else:
            args = [graph.constants[i] if i else None for i in node.inputs]
        if has_subgraph(node):
            kept.append(node)
            continue
        in_bytes = sum(a.nbytes for a in args if isinstance(a, np.ndarray) and a.strides != (0,) * a.ndim)
        predicted = _predicted_bytes(node, args)
        if predicted is not None and predicted > limit:
            raise BuildError(f"layer {node}: its output, computed from constants only, would take {predicted} "
                             f"bytes, over the limit of {limit} (BuilderConfig.max_constant_bytes, "
                             "KILN_MAX_CONSTANT_BYTES)")
        # a type conversion (DequantizeLinear int8 -> fp32 weights, Cast) grows bytes, not elements: fold it
        elements = max((a.size for a in args if isinstance(a, np.ndarray) and a.strides != (0,) * a.ndim), default=0)
        growth_limit = max(GROWTH_LIMIT_BYTES, 2 * in_bytes, 8 * elements)
        if predicted is not None and predicted > growth_limit:
            kept.append(node)  # cheaper to run than to store; and running it here could exhaust memory
            continue
        try:
            outputs = run_node(node, args)
        except Exception:
            kept.append(node)  # the error surfaces, with its layer name, when the plan runs
            continue
        if any(not isinstance(o, np.ndarray) for o in outputs) or sum(o.nbytes for o in outputs) > growth_limit:
            kept.append(node)
            continue
        for name, value in zip(node.outputs, outputs):
            if name:
                graph.constants[name] = value
        folded += 1
    graph.nodes = kept
    return folded


def _info(array: np.ndarray) -> TensorInfo:
    """What shape inference sees of a constant: values only for small ones, as in the shape-inference pass."""
    return TensorInfo.of(array) if array.size <= VALUE_LIMIT else TensorInfo(array.dtype, array.shape)


def _predicted_bytes(node: Node, args: list) -> int | None:
    """Total bytes of the node's outputs by its shape inference, or None when that cannot tell."""
    op = get_op(node.op_type, node.domain)
    try:
        infos = op.infer(node, *(_info(a) if isinstance(a, np.ndarray) else None for a in args))
    except Exception:  # noqa: BLE001 - no prediction: fall back to running the node
        return None
    total = 0
    for info in infos if isinstance(infos, (list, tuple)) else [infos]:
        if info is None or info.shape is None:
            return None
        count = 1
        for d in info.shape:
            count *= int(d)
        total += count * info.dtype.itemsize
    return total
