"""Graph passes: each checked on the graph it produces and on the numbers it computes."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

import engine_core as kiln
from engine_core.ops import TensorInfo
from engine_core.passes import eliminate_dead_code, fold_constants, fold_conv_batchnorm, infer_shapes
from tests.engine import models
from tests.engine.util import build, ort_run, parsed_graph


def _const_chain_model():
    """y = x + ((c1 * c2) - c1): the bracket is constant; 'unused' feeds nothing."""
    nodes = [
        helper.make_node("Mul", ["c1", "c2"], ["m"]),
        helper.make_node("Sub", ["m", "c1"], ["k"]),
        helper.make_node("Add", ["x", "k"], ["y"]),
        helper.make_node("Relu", ["x"], ["unused"]),
    ]
    inits = [numpy_helper.from_array(np.arange(4, dtype=np.float32), "c1"),
             numpy_helper.from_array(np.full(4, 3, np.float32), "c2")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_constant_folding_replaces_constant_subexpressions():
    graph = parsed_graph(_const_chain_model())
    assert fold_constants(graph) == 2
    assert [n.op_type for n in graph.nodes] == ["Add", "Relu"]
    np.testing.assert_array_equal(graph.constants["k"], np.arange(4, dtype=np.float32) * 2)


def test_dead_code_elimination_drops_unused_nodes_and_constants():
    graph = parsed_graph(_const_chain_model())
    fold_constants(graph)
    assert eliminate_dead_code(graph) == 1
    assert [n.op_type for n in graph.nodes] == ["Add"]
    assert set(graph.constants) == {"k"}


def test_folded_model_still_computes_the_same(rng):
    model = _const_chain_model()
    ctx = kiln.Runtime().load(build(model, {})).create_execution_context()
    x = rng.standard_normal((2, 4)).astype(np.float32)
    np.testing.assert_allclose(ctx.infer({"x": x})["y"], ort_run(model, {"x": x})[0], rtol=1e-6)


def test_shape_of_static_input_folds():
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Reshape", ["x", "s"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    g = parsed_graph(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert fold_constants(g) == 1
    np.testing.assert_array_equal(g.constants["s"], [2, 3])


def test_conv_batchnorm_folding_graph_and_numbers(rng):
    model = models.small_cnn()
    graph = parsed_graph(model)
    before = [n.op_type for n in graph.nodes]
    assert fold_conv_batchnorm(graph) == 1
    after = [n.op_type for n in graph.nodes]
    assert before.count("BatchNormalization") == 1 and "BatchNormalization" not in after
    conv = graph.nodes[0]
    assert conv.op_type == "Conv" and conv.outputs == ["bn"] and len(conv.origin) == 2
    ctx = kiln.Runtime().load(build(model, {"x": ((1, 3, 16, 16),) * 3})).create_execution_context()
    x = rng.standard_normal((1, 3, 16, 16)).astype(np.float32)
    np.testing.assert_allclose(ctx.infer({"x": x})["y"], ort_run(model, {"x": x})[0], rtol=1e-4, atol=1e-4)


def test_conv_batchnorm_folding_keeps_a_conv_output_that_a_branch_reads():
    """An If/Loop body reading the conv's output is a second reader: folding would take that tensor away."""
    model = models.small_cnn()
    branch = lambda out: helper.make_graph([helper.make_node("Identity", ["c1"], [out])], out, [],  # noqa: E731
                                           [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)])
    model.graph.node.append(helper.make_node("If", ["c"], ["z"], then_branch=branch("t"), else_branch=branch("e")))
    model.graph.input.append(helper.make_tensor_value_info("c", TensorProto.BOOL, []))
    model.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, None))
    graph = parsed_graph(model)
    assert fold_conv_batchnorm(graph) == 0
    assert [n.op_type for n in graph.nodes][:2] == ["Conv", "BatchNormalization"]


def test_shape_inference_propagates_shape_values():
    """Shape -> Reshape with a computed target resolves to a concrete shape (value propagation)."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Reshape", ["x", "s"], ["y"]),
             helper.make_node("MatMul", ["y", "w"], ["z"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", 5])],
                              [numpy_helper.from_array(np.ones((3, 5), np.float32), "w")])
    g = parsed_graph(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    infos = infer_shapes(g, {"x": TensorInfo(np.float32, (7, 3))})
    assert infos["s"].value.tolist() == [7, 3]
    assert infos["y"].shape == (7, 3) and infos["z"].shape == (7, 5)


def test_shape_inference_error_names_the_layer():
    import pytest

    model = models.mlp()
    g = parsed_graph(model)
    with pytest.raises(kiln.ShapeError, match="Gemm"):
        infer_shapes(g, {"x": TensorInfo(np.float32, (2, 15))})
