"""Casts that convert nothing (to the type their input already has) -> their input.

Exporters write them (transformers' eager attention: ``softmax(scores, dtype=float32).to(query.dtype)`` on a float32
model is Softmax -> Cast(to=FLOAT)), and the precision pass makes more: it turns every internal Cast(to=FLOAT) into
a cast to the reduced type, most of them on tensors that are already of it. Such a Cast between the Softmax and the
weighted sum hid Llama's attention from fuse_attention, which matches ONNX ops, so a decoder with a KV cache ran its
attention as two batched GEMMs around a softmax, over K and V copied once per query head. Run first among the
fusions, after the precision pass; a Cast whose output is a graph output or read inside a body stays.
"""

from __future__ import annotations

import numpy as np

from engine_core.ir import Graph, has_subgraph, subgraph_reads
from engine_core.passes.shape_inference import stand_in_infos
from engine_core.types import onnx_to_np


def eliminate_identity_casts(graph: Graph) -> int:
    """Drop every Cast to its input's own type in place (readers read the input); returns how many."""
    casts = {id(n) for n in graph.nodes if n.op_type == "Cast" and not n.domain}
    if not casts:
        return 0
    infos = stand_in_infos(graph, values=False)
    if infos is None:
        return 0
    dtypes = {name: info.dtype for name, info in infos.items()}
    kept_names = set(graph.output_names)
    for node in graph.nodes:
        if has_subgraph(node):
            kept_names |= subgraph_reads(node)
    source: dict[str, str] = {}  # a dropped Cast's output -> the tensor it passed on
    nodes = []
    for node in graph.nodes:
        node.inputs = [source.get(i, i) for i in node.inputs]
        if id(node) in casts and node.outputs[0] not in kept_names and node.inputs[0] in dtypes \
                and dtypes[node.inputs[0]] == np.dtype(onnx_to_np(node.attr("to"))):
            source[node.outputs[0]] = node.inputs[0]
            continue
        nodes.append(node)
    graph.nodes = nodes
    return len(source)
