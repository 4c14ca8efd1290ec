"""INT8 ``kiln.QMatMul`` layers reading one input -> one QMatMul of their concatenated weights and a ``Split``.

Pattern (a transformer's Q, K and V projections of one quantized input): two or three QMatMuls with the same x and
x_scale, int8 constant weights of one K and equal widths N (a multiple of ``WIDTH_MULTIPLE``), constant per-tensor or
per-channel weight scales, all with or all without a constant bias, and the same attributes and output scale. They
become one QMatMul of N_total = sum N columns (weights, scales and biases concatenated along N; a per-tensor scale
repeated per column) followed by ``Split(axis=-1)`` into the original outputs. The int32 sums and each column's
epilogue are the same operations, so the outputs are bit for bit the same.

Why: the three 768 x 768 GEMMs of a BERT-base layer each run ~3 tiles a block on the H100's 132 SMs, their pipeline
fill and last epilogue unhidden (docs/cuda-backend.md, "Sessions 11 and 12"); one 768 x 2304 GEMM runs 9. The CUDA
backend's INT8 GEMM writes the Split's parts itself (``qgemm.lower``: the output pointer chosen per tile column, as
the widths are whole tiles), so the Split costs nothing there; elsewhere it is a copy of the outputs.
Runs after the Q/DQ fusions (which make the QMatMuls) and before anything that reads QMatMul outputs by position.
"""

from __future__ import annotations

import numpy as np

from engine_core.ir import Graph, Node

#: the part widths that merge: whole output tiles of the CUDA backend's INT8 GEMM (qgemm.TILE_N)
WIDTH_MULTIPLE = 128
#: the most parts a merged layer writes (the kernel takes three output pointers)
MAX_PARTS = 3


def _key(graph: Graph, node: Node) -> tuple | None:
    """What siblings must share to merge (input, scale, attributes, output scale, K, width, bias or not), or None
    when ``node`` cannot merge at all."""
    inputs = list(node.inputs) + [""] * (6 - len(node.inputs))
    w, w_scale = graph.constants.get(inputs[2]), graph.constants.get(inputs[3])
    bias = graph.constants.get(inputs[4]) if inputs[4] else None
    if w is None or w_scale is None or w.dtype != np.int8 or w.ndim != 2 or inputs[4] and bias is None:
        return None
    n, k = w.shape if node.attr("transB", 0) else w.shape[::-1]
    if n % WIDTH_MULTIPLE or w_scale.size not in (1, n) or bias is not None and bias.size != n:
        return None
    y_scale = graph.constants.get(inputs[5]) if inputs[5] else None
    if inputs[5] and y_scale is None:
        return None
    attrs = tuple(sorted((key, str(value)) for key, value in node.attrs.items()))
    out_scale = None if y_scale is None else (y_scale.dtype.str, y_scale.tobytes())
    return (inputs[0], inputs[1], attrs, out_scale, k, n, bias is None, w_scale.dtype.str,
            None if bias is None else bias.dtype.str)


def _merged(graph: Graph, group: list[Node]) -> list[Node]:
    """The QMatMul over the group's concatenated constants and the Split into the group's outputs."""
    first = group[0]
    trans_b = bool(first.attr("transB", 0))
    weights = [graph.constants[node.inputs[2]] for node in group]
    widths = [w.shape[0] if trans_b else w.shape[1] for w in weights]
    w = np.concatenate(weights, axis=0 if trans_b else 1)
    scales = [np.broadcast_to(graph.constants[node.inputs[3]].reshape(-1), (n,)) for node, n in zip(group, widths)]
    inputs = [first.inputs[0], first.inputs[1], graph.add_constant(f"{first.name}_merged_w", w),
              graph.add_constant(f"{first.name}_merged_w_scale", np.concatenate(scales))]
    if len(first.inputs) > 4 and first.inputs[4]:
        inputs.append(graph.add_constant(f"{first.name}_merged_bias",
                                         np.concatenate([graph.constants[node.inputs[4]].reshape(-1) for node in group])))
    if len(first.inputs) > 5 and first.inputs[5]:
        inputs += [""] * (5 - len(inputs)) + [first.inputs[5]]
    merged_out = graph.unique_name(f"{first.outputs[0]}_merged")
    origin = [o for node in group for o in node.origin]
    gemm = Node("QMatMul", inputs, [merged_out], dict(first.attrs), f"{first.name}_merged", first.domain,
                first.opset, origin)
    split = Node("Split", [merged_out, graph.add_constant(f"{first.name}_merged_split", np.array(widths, np.int64))],
                 [node.outputs[0] for node in group], {"axis": -1}, f"{first.name}_merged_split", "", 18, origin)
    return [gemm, split]


def merge_parallel_qmatmuls(graph: Graph) -> int:
    """Merge every group of sibling INT8 QMatMuls (see the module docstring); returns how many groups merged."""
    groups: dict[tuple, list[Node]] = {}
    for node in graph.nodes:
        if node.op_type == "QMatMul" and len(node.outputs) == 1 and (key := _key(graph, node)) is not None:
            groups.setdefault(key, []).append(node)
    merged = 0
    for group in groups.values():
        # in graph order, at most MAX_PARTS at a time; the merged layer goes where the first was (its input and
        # scale exist there, the rest are constants)
        for start in range(0, len(group) - 1, MAX_PARTS):
            part = group[start:start + MAX_PARTS]
            if len(part) < 2:
                continue
            at = next(i for i, n in enumerate(graph.nodes) if n is part[0])
            ids = {id(node) for node in part}
            graph.nodes = [*graph.nodes[:at], *_merged(graph, part),
                           *[n for n in graph.nodes[at:] if id(n) not in ids]]
            merged += 1
    return merged
