"""The reference API end to end: parse -> build -> serialize -> deserialize -> execute, vs onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest

import engine_core as kiln
from engine_core.types import DataType, TensorIOMode
from tests.engine import models
from tests.engine.util import build, ort_run


def _engine(model, shapes) -> kiln.CudaEngine:
    engine = kiln.Runtime().deserialize_cuda_engine(build(model, shapes))
    assert engine is not None
    return engine


@pytest.mark.parametrize("batch", [1, 5, 16])
def test_mlp_matches_onnxruntime(rng, batch):
    model = models.mlp()
    engine = _engine(model, {"x": ((1, 16), (8, 16), (16, 16))})
    x = rng.standard_normal((batch, 16)).astype(np.float32)
    out = engine.create_execution_context().infer({"x": x})
    np.testing.assert_allclose(out["y"], ort_run(model, {"x": x})[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("batch", [1, 3])
def test_small_cnn_matches_onnxruntime(rng, batch):
    model = models.small_cnn()
    engine = _engine(model, {"x": ((1, 3, 16, 16), (2, 3, 16, 16), (4, 3, 16, 16))})
    x = rng.standard_normal((batch, 3, 16, 16)).astype(np.float32)
    out = engine.create_execution_context().infer({"x": x})
    np.testing.assert_allclose(out["y"], ort_run(model, {"x": x})[0], rtol=1e-4, atol=1e-4)
    # Conv+BN folded (then fused with its activation): no BatchNormalization layer left, and the conv layer
    # records the ONNX nodes it covers
    types = [layer["type"] for layer in engine.plan.layers]
    assert "BatchNormalization" not in types
    assert any(len(layer["origin"]) >= 2 for layer in engine.plan.layers if layer["type"] in ("Conv", "FusedConv"))


def test_engine_describes_io_and_profiles():
    engine = _engine(models.add_sub(), {"a": ((1, 4), (2, 4), (8, 4)), "b": ((1, 4), (2, 4), (8, 4))})
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    assert names == ["a", "b", "sum", "diff"]
    assert engine[0] == "a" and engine["diff"] == 3
    assert [engine.get_tensor_mode(n) for n in names] == [TensorIOMode.INPUT] * 2 + [TensorIOMode.OUTPUT] * 2
    assert engine.get_tensor_mode("nope") == TensorIOMode.NONE
    assert engine.get_tensor_shape("sum") == (-1, 4)
    assert engine.get_tensor_dtype("a") == DataType.FLOAT
    assert engine.num_optimization_profiles == 1
    assert engine.get_tensor_profile_shape("a", 0) == [(1, 4), (2, 4), (8, 4)]
    assert engine.device_memory_size == 0  # no intermediate tensors
    assert kiln.Runtime().deserialize_cuda_engine(engine.serialize()) is not None


def test_pointer_execution_and_shapes(rng):
    engine = _engine(models.add_sub(), {"a": ((1, 4), (2, 4), (8, 4)), "b": ((1, 4), (2, 4), (8, 4))})
    ctx = engine.create_execution_context()
    a = rng.standard_normal((3, 4)).astype(np.float32)
    b = rng.standard_normal((3, 4)).astype(np.float32)
    assert not ctx.all_binding_shapes_specified
    assert ctx.set_input_shape("a", a.shape) and ctx.set_input_shape("b", b.shape)
    assert ctx.all_binding_shapes_specified and ctx.infer_shapes() == []
    assert ctx.get_tensor_shape("sum") == (3, 4)
    out_sum, out_diff = np.empty((3, 4), np.float32), np.empty((3, 4), np.float32)
    for name, array in {"a": a, "b": b, "sum": out_sum, "diff": out_diff}.items():
        assert ctx.set_tensor_address(name, array.ctypes.data)
    assert ctx.execute_async_v3(0)
    np.testing.assert_array_equal(out_sum, a + b)
    np.testing.assert_array_equal(out_diff, a - b)


def test_output_shapes_are_inferred_once_per_set_of_input_shapes(monkeypatch):
    """get_tensor_shape is asked for every output of every run: shapes seen before (a server's buckets, a generation
    loop's decode shapes) come from the context's cache, not from inferring the graph again (milliseconds for a
    large decoder)."""
    import engine_core.runtime as runtime

    engine = _engine(models.add_sub(), {"a": ((1, 4), (2, 4), (8, 4)), "b": ((1, 4), (2, 4), (8, 4))})
    ctx = engine.create_execution_context()
    calls = []
    real = runtime.infer_shapes
    monkeypatch.setattr(runtime, "infer_shapes", lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
    for rows in (3, 5, 3, 5, 3):
        assert ctx.set_input_shape("a", (rows, 4)) and ctx.set_input_shape("b", (rows, 4))
        assert [ctx.get_tensor_shape(n) for n in ("sum", "diff", "sum")] == [(rows, 4)] * 3
    assert len(calls) == 2
    assert ctx.set_optimization_profile_async(0)  # drops the current shapes; the cache is keyed by profile too
    assert ctx.get_tensor_shape("sum") == (3, 4) and len(calls) == 2


def test_out_of_profile_shape_is_refused_with_range(rng):
    engine = _engine(models.add_sub(), {"a": ((1, 4), (2, 4), (8, 4)), "b": ((1, 4), (2, 4), (8, 4))})
    ctx = engine.create_execution_context()
    assert ctx.set_input_shape("a", (9, 4)) is False
    with pytest.raises(kiln.ShapeError, match=r"min \[1, 4\], max \[8, 4\]"):
        ctx.infer({"a": np.zeros((9, 4), np.float32), "b": np.zeros((9, 4), np.float32)})
    with pytest.raises(TypeError, match="dtype"):
        ctx.infer({"a": np.zeros((2, 4), np.float64), "b": np.zeros((2, 4), np.float32)})
    with pytest.raises(kiln.ShapeError, match="missing inputs"):
        ctx.infer({"a": np.zeros((2, 4), np.float32)})
    # the context still works after the errors
    out = ctx.infer({"a": np.ones((2, 4), np.float32), "b": np.ones((2, 4), np.float32)})
    np.testing.assert_array_equal(out["sum"], np.full((2, 4), 2, np.float32))


def test_output_allocator_receives_shape_and_memory(rng):
    class Allocator(kiln.IOutputAllocator):
        def __init__(self) -> None:
            self.buffers: dict[str, np.ndarray] = {}
            self.shapes: dict[str, tuple] = {}

        def reallocate_output(self, tensor_name, memory, size, alignment):
            self.buffers[tensor_name] = np.empty(size, np.uint8)
            return self.buffers[tensor_name].ctypes.data

        def notify_shape(self, tensor_name, shape):
            self.shapes[tensor_name] = tuple(shape)

    engine = _engine(models.add_sub(), {"a": ((1, 4), (2, 4), (8, 4)), "b": ((1, 4), (2, 4), (8, 4))})
    ctx = engine.create_execution_context()
    a = rng.standard_normal((2, 4)).astype(np.float32)
    allocator = Allocator()
    ctx.set_input_shape("a", a.shape)
    ctx.set_input_shape("b", a.shape)
    ctx.set_tensor_address("a", a.ctypes.data)
    ctx.set_tensor_address("b", a.ctypes.data)
    assert ctx.set_output_allocator("sum", allocator) and ctx.set_output_allocator("diff", allocator)
    assert ctx.execute_async_v3(0)
    assert allocator.shapes == {"sum": (2, 4), "diff": (2, 4)}
    np.testing.assert_array_equal(allocator.buffers["sum"].view(np.float32).reshape(2, 4), a + a)


def test_two_profiles_select_by_index(rng):
    builder = kiln.Builder()
    network = builder.create_network()
    assert kiln.OnnxParser(network).parse(models.mlp().SerializeToString())
    config = builder.create_builder_config()
    for lo, hi in [(1, 4), (5, 64)]:
        profile = builder.create_optimization_profile()
        profile.set_shape("x", (lo, 16), (hi, 16), (hi, 16))
        config.add_optimization_profile(profile)
    engine = kiln.Runtime().load(kiln.build_plan(network, config))
    assert engine.num_optimization_profiles == 2
    ctx = engine.create_execution_context()
    assert not ctx.set_input_shape("x", (32, 16))
    assert ctx.set_optimization_profile_async(1, 0)
    assert ctx.active_optimization_profile == 1
    x = rng.standard_normal((32, 16)).astype(np.float32)
    np.testing.assert_allclose(ctx.infer({"x": x})["y"], ort_run(models.mlp(), {"x": x})[0], rtol=1e-4, atol=1e-5)
    assert not ctx.set_optimization_profile_async(2, 0)


def test_dynamic_input_without_profile_fails_with_reason():
    builder = kiln.Builder()
    network = builder.create_network()
    assert kiln.OnnxParser(network).parse(models.mlp().SerializeToString())
    with pytest.raises(kiln.BuildError, match="'x' .*dynamic shapes"):
        kiln.build_plan(network, builder.create_builder_config())
    assert builder.build_serialized_network(network, builder.create_builder_config()) is None


def test_profile_shape_mismatch_with_model_fails():
    builder = kiln.Builder()
    network = builder.create_network()
    assert kiln.OnnxParser(network).parse(models.mlp().SerializeToString())
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    profile.set_shape("x", (1, 15), (1, 15), (1, 15))
    config.add_optimization_profile(profile)
    with pytest.raises(kiln.BuildError, match="does not match its declared shape"):
        kiln.build_plan(network, config)
    with pytest.raises(ValueError, match="min <= opt <= max"):
        builder.create_optimization_profile().set_shape("x", (4, 16), (2, 16), (8, 16))


def test_profiler_reports_every_layer(rng):
    engine = _engine(models.mlp(), {"x": ((1, 16), (1, 16), (4, 16))})

    class Profiler(kiln.IProfiler):
        def __init__(self) -> None:
            self.layers: list[str] = []

        def report_layer_time(self, layer_name, ms):
            assert ms >= 0
            self.layers.append(layer_name)

    ctx = engine.create_execution_context()
    ctx.profiler = Profiler()
    ctx.infer({"x": rng.standard_normal((2, 16)).astype(np.float32)})
    assert ctx.profiler.layers == [layer["name"] for layer in engine.plan.layers]


def test_network_definition_api_builds_without_onnx(rng):
    builder = kiln.Builder()
    network = builder.create_network()
    x = network.add_input("x", DataType.FLOAT, (-1, 3))
    network.add_layer("Relu", [x.name], ["y"])
    network.mark_output("y", DataType.FLOAT)
    assert network.num_inputs == 1 and network.num_layers == 1 and network.num_outputs == 1
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    profile.set_shape("x", (1, 3), (2, 3), (4, 3))
    config.add_optimization_profile(profile)
    ctx = kiln.Runtime().load(kiln.build_plan(network, config)).create_execution_context()
    x_val = rng.standard_normal((2, 3)).astype(np.float32)
    np.testing.assert_array_equal(ctx.infer({"x": x_val})["y"], np.maximum(x_val, 0))


def _reshape_by_input_model():
    """y = Reshape(x, target): the target shape is a runtime input (a shape tensor)."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "target"], ["y"])], "reshape_by_input",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6]),
         helper.make_tensor_value_info("target", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b"])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_shape_tensor_input_values_decide_output_shape(rng):
    builder = kiln.Builder()
    network = builder.create_network()
    assert kiln.OnnxParser(network).parse(_reshape_by_input_model().SerializeToString())
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    profile.set_shape_input("target", (1, -1), (4, -1), (24, -1))
    config.add_optimization_profile(profile)
    engine = kiln.Runtime().load(kiln.build_plan(network, config))
    assert engine.is_shape_inference_io("target") and not engine.is_shape_inference_io("x")
    assert engine.get_tensor_profile_values("target", 0) == [(1, -1), (4, -1), (24, -1)]
    assert engine.get_tensor_location("target") == kiln.TensorLocation.HOST

    ctx = engine.create_execution_context()
    x = rng.standard_normal((4, 6)).astype(np.float32)
    target = np.array([3, -1], np.int64)
    ctx.set_tensor_address("target", target.ctypes.data)  # shape tensors are read on the host
    ctx.set_tensor_address("x", x.ctypes.data)
    assert ctx.infer_shapes() == []
    assert ctx.get_tensor_shape("y") == (3, 8)
    y = np.empty((3, 8), np.float32)
    ctx.set_tensor_address("y", y.ctypes.data)
    assert ctx.execute_async_v3(0)
    np.testing.assert_array_equal(y, x.reshape(3, 8))

    out = ctx.infer({"x": x, "target": np.array([2, -1], np.int64)})
    assert out["y"].shape == (2, 12)
    with pytest.raises(kiln.ShapeError, match=r"shape input 'target' values \[48, -1\] are outside"):
        ctx.infer({"x": x, "target": np.array([48, -1], np.int64)})


def test_empty_tensors_flow_end_to_end():
    """A zero-size batch builds (min batch 0) and runs through every layer of the MLP."""
    model = models.mlp()
    engine = _engine(model, {"x": ((0, 16), (2, 16), (8, 16))})
    out = engine.create_execution_context().infer({"x": np.zeros((0, 16), np.float32)})
    assert out["y"].shape == (0, 4) and out["y"].dtype == np.float32


def test_data_dependent_output_through_output_allocator(rng):
    """NonZero's output size is known only while running: the allocator gets size and shape."""
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("NonZero", ["x"], ["idx"])], "nz",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
                              [helper.make_tensor_value_info("idx", TensorProto.INT64, [1, "k"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    engine = _engine(model, {"x": ((1,), (8,), (64,))})
    assert engine.get_tensor_shape("idx") == (1, -1)

    class Allocator(kiln.IOutputAllocator):
        def reallocate_output(self, tensor_name, memory, size, alignment):
            self.buffer = np.empty(max(size, 1), np.uint8)
            return self.buffer.ctypes.data

        def notify_shape(self, tensor_name, shape):
            self.shape = tuple(shape)

    ctx = engine.create_execution_context()
    x = np.array([0, 1.5, 0, 2, 3, 0], np.float32)
    allocator = Allocator()
    ctx.set_input_shape("x", x.shape)
    ctx.set_tensor_address("x", x.ctypes.data)
    ctx.set_output_allocator("idx", allocator)
    assert ctx.get_tensor_shape("idx") == (1, -1)  # unknown until it runs
    assert ctx.execute_async_v3(0)
    assert allocator.shape == (1, 3)
    np.testing.assert_array_equal(allocator.buffer[: 3 * 8].view(np.int64), [1, 3, 4])
    np.testing.assert_array_equal(ctx.infer({"x": x})["idx"], [[1, 3, 4]])
