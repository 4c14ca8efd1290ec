"""Data-dependent outputs (NonZero, NonMaxSuppression) through execute_async_v3 on the CUDA backend: the run goes to
the host as a whole (as ``infer`` does) and each such output lands in the memory its output allocator returns for
the size it turned out to have; a fixed address for one is refused with a message saying what to do."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import engine_core as kiln

pytestmark = pytest.mark.gpu


def _nonzero_model() -> onnx.ModelProto:
    """y = Relu(x) (a plain output) and nz = NonZero(y) (rows known only after running)."""
    nodes = [helper.make_node("Relu", ["x"], ["y"], name="relu"), helper.make_node("NonZero", ["y"], ["nz"], name="nz")]
    graph = helper.make_graph(nodes, "nonzero", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5]),
                               helper.make_tensor_value_info("nz", TensorProto.INT64, [2, None])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _engine(backend: str):
    builder = kiln.Builder()
    net = builder.create_network()
    assert kiln.OnnxParser(net).parse(_nonzero_model())
    config = builder.create_builder_config()
    config.backend = backend
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
