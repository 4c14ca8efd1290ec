"""eliminate_identity_casts: a Cast to its input's own type goes (readers read the input), so transformers' eager
attention, whose ``softmax(..., dtype=float32).to(query.dtype)`` leaves a Cast between the Softmax and the weighted
sum, fuses into one Attention; casts that convert, and those whose output is a graph output, stay."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from engine_core.interpret import GraphRunner
from engine_core.passes import PIPELINE, eliminate_identity_casts
from tests.engine.util import parsed_graph

B, H, S, D = 2, 4, 6, 8


def _eager_attention() -> onnx.ModelProto:
    """softmax(Q K^T * scale + mask) V with Cast(to=FLOAT) twice after the Softmax, as the eager export writes it."""
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["scores"]),
             helper.make_node("Mul", ["scores", "scale"], ["scaled"]),
             helper.make_node("Add", ["scaled", "mask"], ["masked"]),
             helper.make_node("Softmax", ["masked"], ["p"], axis=-1),
             helper.make_node("Cast", ["p"], ["p32"], to=TensorProto.FLOAT),
             helper.make_node("Cast", ["p32"], ["p_q"], to=TensorProto.FLOAT),
             helper.make_node("MatMul", ["p_q", "v"], ["y"])]
    qkv = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [B, H, S, D]) for n in ("q", "k", "v")]
    mask = helper.make_tensor_value_info("mask", TensorProto.FLOAT, [B, 1, S, S])
    graph = helper.make_graph(nodes, "eager", [*qkv, mask], [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                                                                           [B, H, S, D])],
                              [numpy_helper.from_array(np.array(D ** -0.5, np.float32), "scale")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_the_casts_after_an_eager_softmax_go_and_the_attention_fuses():
    model = _eager_attention()
    graph = parsed_graph(model)
    for graph_pass in PIPELINE:
        graph_pass(graph)
    ops = Counter(n.op_type for n in graph.nodes)
    assert ops["Attention"] == 1 and not ops["Cast"] and not ops["Softmax"], ops
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal((B, H, S, D)).astype(np.float32) for n in ("q", "k", "v")}
    feeds["mask"] = np.triu(np.full((S, S), -1e9, np.float32), 1)[None, None].repeat(B, 0)
    want = GraphRunner(parsed_graph(model)).run(feeds)["y"]
    np.testing.assert_allclose(GraphRunner(graph).run(feeds)["y"], want, rtol=1e-5, atol=1e-5)


def test_converting_casts_and_casts_to_a_graph_output_stay():
    nodes = [helper.make_node("Cast", ["x"], ["same"], to=TensorProto.FLOAT),
             helper.make_node("Cast", ["same"], ["half"], to=TensorProto.FLOAT16),
             helper.make_node("Cast", ["x"], ["out"], to=TensorProto.FLOAT),
             helper.make_node("Relu", ["same"], ["r"])]
    info = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "casts", [info("x", TensorProto.FLOAT, [3])],
                              [info("half", TensorProto.FLOAT16, [3]), info("out", TensorProto.FLOAT, [3]),
                               info("r", TensorProto.FLOAT, [3])])
    parsed = parsed_graph(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert eliminate_identity_casts(parsed) == 1
    assert [(n.op_type, n.inputs, n.outputs) for n in parsed.nodes] == [
        ("Cast", ["x"], ["half"]), ("Cast", ["x"], ["out"]), ("Relu", ["x"], ["r"])]
