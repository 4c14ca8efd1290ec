"""The passes match computations, not names (#36): every model of tools/make_models.py (ResNet-50, MobileNetV2,
BERT, GPT-2, a YOLO-style detector, QDQ forms), with every node and internal tensor renamed to opaque names, comes out
of the optimization pipeline with the same layers, op for op, as under the names its builder gave."""

from __future__ import annotations

from collections import Counter

import onnx
import pytest

from engine_core.passes import PIPELINE
from tests.engine.util import parsed_graph
from tools.make_models import MODELS

SMALL = {name: small for name, (_, small) in MODELS.items()}


def _renamed(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with every node renamed, and every tensor other than the graph's inputs and outputs too (initializers
    included): names that say nothing (`t17`, `n3`), in an order unrelated to the original."""
    renamed = onnx.ModelProto()
    renamed.CopyFrom(model)
    graph = renamed.graph
    keep = {v.name for v in graph.input} | {v.name for v in graph.output}
    names = sorted({n for node in graph.node for n in [*node.input, *node.output] if n and n not in keep}
                   | {init.name for init in graph.initializer} - keep, key=lambda n: hash(n) % 100_003)
    new = {name: f"t{index}" for index, name in enumerate(names)}
    for index, node in enumerate(graph.node):
        node.name = f"n{len(graph.node) - index}"
        node.input[:] = [new.get(n, n) for n in node.input]
        node.output[:] = [new.get(n, n) for n in node.output]
    for init in graph.initializer:
        init.name = new.get(init.name, init.name)
    for info in graph.value_info:
        info.name = new.get(info.name, info.name)
    return renamed


def _layers(model: onnx.ModelProto) -> Counter[str]:
    graph = parsed_graph(model)
    for graph_pass in PIPELINE:
        graph_pass(graph)
    return Counter(node.op_type for node in graph.nodes)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_the_pipeline_fuses_the_same_layers_whatever_the_names(name: str) -> None:
    model = SMALL[name]()
    renamed = _renamed(model)
    assert {n.name for n in renamed.graph.node}.isdisjoint({n.name for n in model.graph.node})
    assert {i.name for i in renamed.graph.initializer}.isdisjoint({i.name for i in model.graph.initializer})
    original = _layers(model)
    assert original == _layers(renamed)
    fused = set(original) - {node.op_type for node in model.graph.node}
    assert fused, original  # the pipeline made layers of its own (SkipLayerNorm, QMatMul, PointwiseChain, ...)
