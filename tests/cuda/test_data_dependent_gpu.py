"""Data-dependent outputs (NonZero, NonMaxSuppression) on the CUDA backend: the layers before them run on the device
(a CUDA graph once warm), the layers from them on as the plan's host tail (host_tail.py), through ``infer`` and
through execute_async_v3, where each such output lands in the memory its output allocator returns for the size it
turned out to have; a fixed address for one is refused with a message saying what to do."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import engine_core as kiln
from engine_core.types import LayerInformationFormat
from tests.cuda.test_host_tail_cpu import TAIL, conv_nms_feeds, conv_nms_model

pytestmark = pytest.mark.gpu


def _nonzero_model() -> onnx.ModelProto:
    """y = Relu(x) (a plain output) and nz = NonZero(y) (rows known only after running)."""
    nodes = [helper.make_node("Relu", ["x"], ["y"], name="relu"), helper.make_node("NonZero", ["y"], ["nz"], name="nz")]
    graph = helper.make_graph(nodes, "nonzero", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5]),
                               helper.make_tensor_value_info("nz", TensorProto.INT64, [2, None])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _engine(backend: str, model: onnx.ModelProto | None = None):
    builder = kiln.Builder()
    net = builder.create_network()
    assert kiln.OnnxParser(net).parse(model if model is not None else _nonzero_model())
    config = builder.create_builder_config()
    config.backend = backend
    config.clear_flag(kiln.BuilderFlag.TF32)  # strict fp32: the selections compare exactly with the CPU backend's
    return kiln.Runtime().load(kiln.build_plan(net, config))


class _Allocator(kiln.IOutputAllocator):
    def __init__(self) -> None:
        super().__init__()
        self.buffers: dict = {}
        self.shapes: dict = {}

    def reallocate_output_async(self, name, memory, size, alignment, stream):
        from engine_core.cuda.driver import DeviceBuffer

        self.buffers[name] = DeviceBuffer(max(size, 1))
        return self.buffers[name].ptr

    def notify_shape(self, name, shape):
        self.shapes[name] = tuple(shape)


def test_a_data_dependent_output_reaches_its_allocator_with_its_shape():
    from engine_core.cuda.driver import DeviceBuffer, Stream

    x = np.random.default_rng(4).standard_normal((3, 5)).astype(np.float32)
    want = _engine("cpu").create_execution_context().infer({"x": x})
    context = _engine("cuda").create_execution_context()
    dx, dy, allocator, stream = DeviceBuffer.from_array(x), DeviceBuffer(x.nbytes), _Allocator(), Stream()
    context.set_input_shape("x", x.shape)
    context.set_tensor_address("x", dx.ptr)
    context.set_tensor_address("y", dy.ptr)  # a plain output at a fixed address
    context.set_output_allocator("nz", allocator)
    for _ in range(2):  # the second run reuses the path (the host fallback is logged once)
        assert context.execute_async_v3(stream.handle)
        stream.synchronize()
        rows = want["nz"].shape
        assert allocator.shapes["nz"] == rows
        np.testing.assert_array_equal(allocator.buffers["nz"].to_array(np.int64, rows), want["nz"])
        np.testing.assert_array_equal(dy.to_array(np.float32, x.shape), want["y"])


def test_a_fixed_address_for_a_data_dependent_output_is_refused_clearly():
    from engine_core.cuda.driver import DeviceBuffer, Stream

    x = np.ones((3, 5), np.float32)
    context = _engine("cuda").create_execution_context()
    recorder = kiln.ErrorRecorder()
    context.error_recorder = recorder
    dx, dy, dnz = DeviceBuffer.from_array(x), DeviceBuffer(x.nbytes), DeviceBuffer(2 * 15 * 8)
    context.set_input_shape("x", x.shape)
    for name, buffer in (("x", dx), ("y", dy), ("nz", dnz)):
        context.set_tensor_address(name, buffer.ptr)
    assert not context.execute_async_v3(Stream().handle)
    assert recorder.num_errors() == 1 and "set_output_allocator" in recorder.get_error_desc(0)


def _scores_input_nms_model() -> onnx.ModelProto:
    """boxes = Abs(x) computed on the device; NonMaxSuppression reads them and ``scores``, a graph input: the host tail
    reads an input itself (execute_async_v3 copies it from its device address after the run)."""
    nodes = [helper.make_node("Abs", ["x"], ["boxes"], name="abs"),
             helper.make_node("NonMaxSuppression", ["boxes", "scores", "limit"], ["selected"], name="nms")]
    graph = helper.make_graph(
        nodes, "scores_input", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6, 4]),
                                helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, 2, 6])],
        [helper.make_tensor_value_info("selected", TensorProto.INT64, [None, 3])],
        [onnx.numpy_helper.from_array(np.array([3], np.int64), "limit")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_conv_nms_plan_keeps_its_convolution_on_the_device_and_runs_only_its_tail_on_the_host():
    engine, reference = _engine("cuda", conv_nms_model()), _engine("cpu", conv_nms_model()).create_execution_context()
    info = engine.plan.build_info["cuda"]
    assert sorted(info["host_layers"]) == sorted(TAIL) and info["host_tail"]["boundary"] == ["boxes", "scores"]
    layers = json.loads(engine.create_engine_inspector().get_engine_information(LayerInformationFormat.JSON))["layers"]
    tactics = {layer["name"]: layer["tactic"] for layer in layers}
    assert tactics["conv"].startswith("conv:") and all(tactics[name] == "host" for name in TAIL)
    context = engine.create_execution_context()
    for seed in (1, 1, 1, 2, 2):  # a binding's runs: eager, captured and checked, replayed
        feeds = conv_nms_feeds(seed=seed)
        got, want = context.infer(feeds), reference.infer(feeds)
        np.testing.assert_allclose(got["boxes"], want["boxes"], rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(got["selected"], want["selected"])
        np.testing.assert_allclose(got["picked"], want["picked"], rtol=1e-4, atol=1e-4)
    state = context._backend_context
    (binding,) = state._bindings.values()
    assert binding.tail is not None and binding.tail.layers == TAIL and not binding.has_host
    assert state.host_fallback == [] and len(state.host_tails) == 1
    assert binding.verified and binding.graphs and state.graph_replays >= 3


def test_execute_async_v3_runs_the_device_part_from_device_memory_and_the_tail_into_allocators():
    from engine_core.cuda.driver import DeviceBuffer, Stream

    engine, reference = _engine("cuda", conv_nms_model()), _engine("cpu", conv_nms_model()).create_execution_context()
    context, allocator, stream = engine.create_execution_context(), _Allocator(), Stream()
    feeds = conv_nms_feeds(seed=3)
    want = reference.infer(feeds)
    dx, dboxes = DeviceBuffer.from_array(feeds["x"]), DeviceBuffer(want["boxes"].nbytes)
    context.set_input_shape("x", feeds["x"].shape)
    context.set_tensor_address("x", dx.ptr)
    context.set_tensor_address("boxes", dboxes.ptr)  # a device-computed output at a fixed address
    for name in ("selected", "picked"):
        context.set_output_allocator(name, allocator)
    for _ in range(4):
        assert context.execute_async_v3(stream.handle)
        stream.synchronize()
        rows = want["selected"].shape[0]
        assert allocator.shapes == {"selected": (rows, 3), "picked": (rows, 4)}
        np.testing.assert_array_equal(allocator.buffers["selected"].to_array(np.int64, (rows, 3)), want["selected"])
        np.testing.assert_allclose(allocator.buffers["picked"].to_array(np.float32, (rows, 4)), want["picked"],
                                   rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(dboxes.to_array(np.float32, want["boxes"].shape), want["boxes"], rtol=1e-4,
                                   atol=1e-4)
    state = context._backend_context
    assert state.host_fallback == [], "the inputs made a round trip through a whole-graph host run"
    assert state.graph_replays >= 2, "the device part was not replayed as a CUDA graph"


def test_a_host_tail_reading_a_graph_input_gets_it_from_its_device_address():
    from engine_core.cuda.driver import DeviceBuffer, Stream

    rng = np.random.default_rng(5)
    feeds = {"x": rng.uniform(0, 4, (1, 6, 4)).astype(np.float32), "scores": rng.random((1, 2, 6)).astype(np.float32)}
    want = _engine("cpu", _scores_input_nms_model()).create_execution_context().infer(feeds)
    engine = _engine("cuda", _scores_input_nms_model())
    assert engine.plan.build_info["cuda"]["host_layers"] == ["nms"]
    context, allocator, stream = engine.create_execution_context(), _Allocator(), Stream()
    np.testing.assert_array_equal(context.infer(feeds)["selected"], want["selected"])
    buffers = {name: DeviceBuffer.from_array(value) for name, value in feeds.items()}
    for name, buffer in buffers.items():
        context.set_input_shape(name, feeds[name].shape)
        context.set_tensor_address(name, buffer.ptr)
    context.set_output_allocator("selected", allocator)
    for _ in range(3):
        assert context.execute_async_v3(stream.handle)
        stream.synchronize()
        rows = want["selected"].shape
        np.testing.assert_array_equal(allocator.buffers["selected"].to_array(np.int64, rows), want["selected"])
    assert context._backend_context.host_fallback == []
