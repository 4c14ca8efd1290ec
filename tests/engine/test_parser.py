"""ONNX import: good models become IR, bad ones fail with the node, op and reason."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

import engine_core as kiln
from tests.engine import models


def _parse(model_or_bytes):
    network = kiln.Builder().create_network()
    parser = kiln.OnnxParser(network)
    data = model_or_bytes if isinstance(model_or_bytes, bytes) else model_or_bytes.SerializeToString()
    return parser.parse(data), parser, network


def test_parse_records_io_and_weights():
    ok, parser, network = _parse(models.mlp())
    assert ok and parser.num_errors == 0
    assert network.num_inputs == 1 and network.get_input(0).shape == (-1, 16)
    assert network.get_input(0).dtype == kiln.DataType.FLOAT
    assert network.num_layers == 5 and network.get_layer(0).op_type == "Gemm"
    assert network.graph.constants["W1"].shape == (32, 16)


def test_unsupported_operator_names_node_and_op():
    node = helper.make_node("NoSuchOp", ["x"], ["y"], name="mystery")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    ok, parser, _ = _parse(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert not ok
    error = parser.get_error(0)
    assert error.node_name == "mystery" and error.node_operator == "NoSuchOp" and error.node_index == 0
    assert "unsupported operator NoSuchOp" in str(error)


def test_garbage_bytes_fail_cleanly():
    ok, parser, _ = _parse(b"\x08\x01garbage that is not a protobuf \xff\xff")
    assert not ok and "not a valid ONNX model" in parser.get_error(0).desc


def test_missing_file_fails_cleanly(tmp_path):
    parser = kiln.OnnxParser(kiln.Builder().create_network())
    assert not parser.parse_from_file(tmp_path / "nope.onnx")
    assert "cannot read" in parser.get_error(0).desc


def test_unsupported_opset_is_refused():
    model = models.add_sub()
    model.opset_import[0].version = 99
    ok, parser, _ = _parse(model)
    assert not ok and "opset 99" in parser.get_error(0).desc


def test_reading_undefined_tensor_is_an_error():
    node = helper.make_node("Add", ["x", "ghost"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    ok, parser, _ = _parse(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert not ok and "ghost" in str(parser.get_error(0))


def test_cycle_is_an_error():
    nodes = [helper.make_node("Add", ["x", "b"], ["a"]), helper.make_node("Relu", ["a"], ["b"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("b", TensorProto.FLOAT, [1])])
    ok, parser, _ = _parse(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert not ok and "cycle" in str(parser.get_error(0))


def test_constant_nodes_become_weights():
    nodes = [helper.make_node("Constant", [], ["c"], value_floats=[1.0, 2.0]),
             helper.make_node("Add", ["x", "c"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    ok, _, network = _parse(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert ok and network.num_layers == 1
    np.testing.assert_array_equal(network.graph.constants["c"], [1.0, 2.0])


def test_external_data_is_loaded_from_the_model_directory(tmp_path, rng):
    import onnx

    model = models.mlp()
    path = tmp_path / "model.onnx"
    onnx.save(model, path, save_as_external_data=True, all_tensors_to_one_file=True, location="weights.bin",
              size_threshold=0)
    network = kiln.Builder().create_network()
    assert kiln.OnnxParser(network).parse_from_file(path)
    assert network.graph.constants["W1"].shape == (32, 16)


def test_old_opset_imports_when_op_unchanged_and_refuses_otherwise():
    def model(op, opset, **attrs):
        node = helper.make_node(op, ["x"], ["y"], **attrs)
        graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])

    ok, _, _ = _parse(model("Relu", 6))  # Relu-6 is the schema opset 7 still uses
    assert ok
    ok, parser, _ = _parse(model("Relu", 5))  # Relu-1 had consumed_inputs semantics
    assert not ok and "changed between opset 5 and 7" in parser.get_error(0).desc
