"""server/frontends/grpc/wire.py: a ModelInferRequest read with its raw tensor bytes left in place converts to the
same request as the protobuf parser's message, and malformed bytes still fail as the parser says."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf.message import DecodeError

from server.frontends.grpc import convert
from server.frontends.grpc.wire import InferWire, read_infer_request
from server.protos import grpc_service_pb2 as pb


def _request() -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name="resnet50", model_version="2", id="r-1")
    message.parameters["priority"].uint64_param = 3
    for name, array in (("image", np.arange(12, dtype=np.float32).reshape(1, 12)),
                        ("mask", np.array([[1, 0, 1]], np.int64))):
        tensor = message.inputs.add(name=name, datatype="FP32" if array.dtype == np.float32 else "INT64")
        tensor.shape.extend(array.shape)
        message.raw_input_contents.append(array.tobytes())
    typed = message.inputs.add(name="scale", datatype="FP32")  # typed contents beside raw ones
    typed.shape.extend([1, 1])
    message.outputs.add(name="logits").parameters["classification"].int64_param = 2
    return message


def test_raw_contents_stay_views_and_the_request_converts_as_from_the_parser() -> None:
    message = _request()
    message.inputs[2].ClearField("contents")
    message.inputs[2].parameters["shared_memory_region"].string_param = "r"
    message.inputs[2].parameters["shared_memory_byte_size"].int64_param = 4
    wire = message.SerializeToString()
    read = read_infer_request(wire)
    assert isinstance(read, InferWire) and all(isinstance(v, memoryview) for v in read.raw_input_contents)
    assert [bytes(v) for v in read.raw_input_contents] == list(message.raw_input_contents)
    ours, theirs = convert.infer_request(read), convert.infer_request(pb.ModelInferRequest.FromString(wire))
    assert (ours.model_name, ours.model_version, ours.id, ours.parameters) == \
        (theirs.model_name, theirs.model_version, theirs.id, theirs.parameters)
    assert [o.name for o in ours.outputs] == [o.name for o in theirs.outputs]
    for a, b in zip(ours.inputs, theirs.inputs, strict=True):
        assert (a.name, a.datatype, a.shape, a.parameters) == (b.name, b.datatype, b.shape, b.parameters)
        assert (a.data is None) == (b.data is None) and (a.data is None or np.array_equal(a.data, b.data))


def test_a_request_without_raw_contents_is_the_parser_s_message() -> None:
    message = pb.ModelInferRequest(model_name="m")
    message.inputs.add(name="x", datatype="INT32").contents.int_contents.extend([1, 2])
    assert read_infer_request(message.SerializeToString()) == message


@pytest.mark.parametrize("cut", [3, 30, -5])
def test_truncated_bytes_fail_as_the_parser_fails(cut: int) -> None:
    wire = _request().SerializeToString()[:cut]
    with pytest.raises(DecodeError):
        pb.ModelInferRequest.FromString(wire)
    with pytest.raises(DecodeError):
        read_infer_request(wire)
