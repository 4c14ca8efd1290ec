"""ONNX import: good models become IR, bad ones fail with the node, op and reason."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

import engine_core as kiln
from tests.engine import models
from tests.engine.util import ort_run


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


def _save_external(tmp_path, model, **kwargs):
    import onnx

    path = tmp_path / "model.onnx"
    onnx.save(model, path, save_as_external_data=True, all_tensors_to_one_file=True, location="weights.bin",
              size_threshold=0, **kwargs)
    return path


def _mapped_file(array: np.ndarray) -> bool:
    """Whether `array` is a view of a memory map (its chain of bases ends in one)."""
    import mmap

    base = array
    while isinstance(base, np.ndarray | memoryview):
        base = base.obj if isinstance(base, memoryview) else base.base
    return isinstance(base, mmap.mmap)


def test_external_weights_are_read_only_views_of_the_file(tmp_path):
    """Weights kept beside the model are mapped, not read and copied: a 5 GB model imports in megabytes. The
    views are read-only (as arrays of in-file weights are), so nothing can write through them into the file."""
    import onnx

    model = models.mlp()
    expected = {t.name: onnx.numpy_helper.to_array(t).copy() for t in model.graph.initializer}
    path = _save_external(tmp_path, model)
    network = kiln.Builder().create_network()
    assert kiln.OnnxParser(network).parse_from_file(path)
    for name, value in expected.items():
        weight = network.graph.constants[name]
        assert _mapped_file(weight) and not weight.flags.writeable
        np.testing.assert_array_equal(weight, value)
    builder = kiln.Builder()
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    profile.set_shape("x", (1, 16), (3, 16), (4, 16))
    config.add_optimization_profile(profile)
    engine = kiln.Runtime().load(kiln.build_plan(network, config))
    for name, value in expected.items():  # the build shared the weights (read-only): the network's are unchanged
        assert _mapped_file(network.graph.constants[name])
        np.testing.assert_array_equal(network.graph.constants[name], value)
    x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    got = engine.create_execution_context().infer({"x": x})["y"]
    np.testing.assert_allclose(got, ort_run(models.mlp(), {"x": x})[0], rtol=1e-5, atol=1e-6)


def test_parsing_leaves_the_callers_model_external(tmp_path):
    """parse(model, path=) maps the weights without loading them into the caller's ModelProto."""
    import onnx

    path = _save_external(tmp_path, models.mlp())
    model = onnx.load(path, load_external_data=False)
    network = kiln.Builder().create_network()
    assert kiln.OnnxParser(network).parse(model, path=str(path))
    assert all(t.data_location == TensorProto.EXTERNAL and not t.raw_data for t in model.graph.initializer)
    assert network.graph.constants["W1"].shape == (32, 16)


def test_external_weights_at_misaligned_offsets_are_read(tmp_path):
    """A tensor at an offset its element size does not divide is read (copied): consumers get aligned arrays."""
    import onnx

    values = np.arange(6, dtype=np.float32).reshape(2, 3)
    (tmp_path / "weights.bin").write_bytes(b"\0" * 2 + values.tobytes())
    weight = TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[2, 3], data_location=TensorProto.EXTERNAL)
    for key, value in (("location", "weights.bin"), ("offset", "2"), ("length", "24")):
        entry = weight.external_data.add()
        entry.key, entry.value = key, value
    graph = helper.make_graph([helper.make_node("Add", ["x", "W"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], [weight])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "model.onnx")
    network = kiln.Builder().create_network()
    parser = kiln.OnnxParser(network)
    assert parser.parse_from_file(tmp_path / "model.onnx"), [str(e) for e in parser.errors]
    weight = network.graph.constants["W"]
    assert not _mapped_file(weight) and weight.flags.aligned
    np.testing.assert_array_equal(weight, values)


def test_mapped_external_data_stays_confined_to_the_model_directory(tmp_path):
    """A link inside the directory that points out is refused, and so is a Constant inside a local function
    whose tensor names a file outside (functions are inlined after the up-front check: the map checks too)."""
    import onnx

    outside = tmp_path / "secret.bin"
    outside.write_bytes(np.arange(4, dtype=np.float32).tobytes())
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "weights.bin").symlink_to(outside)
    weight = TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[4], data_location=TensorProto.EXTERNAL)
    entry = weight.external_data.add()
    entry.key, entry.value = "location", "weights.bin"
    io = ([helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    graph = helper.make_graph([helper.make_node("Add", ["x", "W"], ["y"])], "g", *io, [weight])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), model_dir / "linked.onnx")
    parser = kiln.OnnxParser(kiln.Builder().create_network())
    assert not parser.parse_from_file(model_dir / "linked.onnx")
    assert "outside the model's directory" in str(parser.get_error(0))

    value = TensorProto(name="c", data_type=TensorProto.FLOAT, dims=[4], data_location=TensorProto.EXTERNAL)
    entry = value.external_data.add()
    entry.key, entry.value = "location", "../secret.bin"
    body = [helper.make_node("Constant", [], ["c"], value=value), helper.make_node("Add", ["a", "c"], ["b"])]
    function = helper.make_function("local", "AddSecret", ["a"], ["b"], body, [helper.make_opsetid("", 17)])
    graph = helper.make_graph([helper.make_node("AddSecret", ["x"], ["y"], domain="local")], "g", *io)
    model = helper.make_model(graph, functions=[function],
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("local", 1)])
    onnx.save(model, model_dir / "function.onnx")
    parser = kiln.OnnxParser(kiln.Builder().create_network())
    assert not parser.parse_from_file(model_dir / "function.onnx")
    assert "outside the model's directory" in str(parser.get_error(0))
