"""Typed `InferTensorContents`, the request/response translation and the status mapping, without a server.

Requests are built with tritonclient's own generated messages and serialized, so the bytes are what a stock
client sends; the expected arrays come from numpy.
"""

from __future__ import annotations

import grpc
import ml_dtypes
import numpy as np
import pytest

from server.core import ErrorKind, InferOutput, InferResponse, ServerError
from server.frontends.grpc import contents, convert
from server.frontends.grpc.errors import status_of
from server.protos import grpc_service_pb2 as pb

tpb = pytest.importorskip("tritonclient.grpc.service_pb2")
grpcclient = pytest.importorskip("tritonclient.grpc")

TYPED = {
    "BOOL": np.array([[True, False], [False, True]]),
    "UINT8": np.array([[0, 255], [1, 2]], np.uint8),
    "UINT16": np.array([[0, 65535], [1, 2]], np.uint16),
    "UINT32": np.array([[0, 2**32 - 1], [1, 2]], np.uint32),
    "UINT64": np.array([[0, 2**64 - 1], [1, 2]], np.uint64),
    "INT8": np.array([[-128, 127], [0, -1]], np.int8),
    "INT16": np.array([[-32768, 32767], [0, -1]], np.int16),
    "INT32": np.array([[-(2**31), 2**31 - 1], [0, -1]], np.int32),
    "INT64": np.array([[-(2**63), 2**63 - 1], [0, -1]], np.int64),
    "FP32": np.array([[0.5, -1.25], [3.0e38, -0.0]], np.float32),
    "FP64": np.array([[0.1, -1e300], [2.0, np.inf]]),
    "BYTES": np.array([[b"a", b""], [b"\x00\xff", "\u00fc".encode()]], dtype=np.object_),
}


def _ours(message) -> pb.ModelInferRequest:
    """tritonclient's message, re-read by our generated code (as the server receives it)."""
    return pb.ModelInferRequest.FromString(message.SerializeToString())


@pytest.mark.parametrize("datatype", sorted(TYPED))
def test_typed_contents_decode_to_the_exact_array(datatype: str) -> None:
    expected = TYPED[datatype]
    request = tpb.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="x", datatype=datatype, shape=list(expected.shape))
    getattr(tensor.contents, contents.CONTENTS_FIELDS[datatype]).extend(expected.reshape(-1).tolist())
    decoded = convert.infer_request(_ours(request)).inputs[0]
    assert decoded.shape == expected.shape and decoded.data.dtype == expected.dtype
    if datatype == "BYTES":
        assert decoded.data.tolist() == expected.tolist()
    else:
        np.testing.assert_array_equal(decoded.data, expected)


def test_raw_inputs_follow_tritonclient_order_with_shared_memory_in_between() -> None:
    """tritonclient sends raw entries only for inputs that are not in shared memory, in input order."""
    a = np.arange(6, dtype=np.float16).reshape(2, 3)
    b = np.array([1.5, -2.0], ml_dtypes.bfloat16)
    inputs = [grpcclient.InferInput("A", [2, 3], "FP16"), grpcclient.InferInput("S", [4], "INT32"),
              grpcclient.InferInput("B", [2], "BF16")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_shared_memory("region", 16, offset=8)
    inputs[2].set_data_from_numpy(b.astype(np.float32))
    message = grpcclient._utils._get_inference_request(  # the exact request tritonclient.infer() sends
        model_name="m", inputs=inputs, model_version="2", request_id="r", outputs=None, sequence_id=0,
        sequence_start=False, sequence_end=False, priority=0, timeout=None, parameters={"custom": 5})
    request = convert.infer_request(_ours(message))
    assert (request.model_version, request.id, request.parameters) == ("2", "r", {"custom": 5})
    first, shared, last = request.inputs
    np.testing.assert_array_equal(first.data, a)
    assert shared.data is None and shared.parameters == {
        "shared_memory_region": "region", "shared_memory_byte_size": 16, "shared_memory_offset": 8}
    assert last.data.dtype == ml_dtypes.bfloat16 and last.data.tolist() == b.tolist()


def test_response_has_one_raw_entry_per_output() -> None:
    """Shared-memory outputs get an empty entry so the positions tritonclient indexes by stay aligned."""
    response = InferResponse("m", "1", [
        InferOutput("in_shm", "FP32", (2,), None, {"shared_memory_region": "r", "shared_memory_byte_size": 8}),
        InferOutput("text", "BYTES", (2,), np.array([b"ab", b"c"], dtype=np.object_)),
        InferOutput("half", "FP16", (1, 2), np.array([[1.0, -0.5]], np.float16)),
    ], id="7", parameters={"sequence_end": True})
    message = convert.infer_response(response)
    result = grpcclient.InferResult(tpb.ModelInferResponse.FromString(message.SerializeToString()))
    assert result.as_numpy("text").tolist() == [b"ab", b"c"]
    np.testing.assert_array_equal(result.as_numpy("half"), np.array([[1.0, -0.5]], np.float16))
    assert message.raw_output_contents[0] == b""
    assert message.outputs[0].parameters["shared_memory_byte_size"].int64_param == 8
    assert message.parameters["sequence_end"].bool_param and message.id == "7"


@pytest.mark.parametrize("build,fragment", [
    (lambda t: t.contents.int_contents.extend([1, 2]), "typed 'contents'"),
    (lambda t: None, "has no data"),
])
def test_ambiguous_or_missing_input_data(build, fragment) -> None:
    request = pb.ModelInferRequest(model_name="m")
    build(request.inputs.add(name="x", datatype="INT32", shape=[2]))
    if fragment == "typed 'contents'":
        request.raw_input_contents.append(bytes(8))
    with pytest.raises(ServerError, match=fragment) as info:
        convert.infer_request(request)
    assert info.value.kind == ErrorKind.INVALID_ARGUMENT


def test_every_error_kind_has_a_status_code() -> None:
    for kind in ErrorKind:
        assert status_of(ServerError(kind, "why")) == (grpc.StatusCode[kind.name], "why")
    assert status_of(KeyError("secret detail")) == (grpc.StatusCode.INTERNAL, "internal error")


def test_load_parameters() -> None:
    request = pb.RepositoryModelLoadRequest(model_name="m")
    request.parameters["config"].string_param = "{}"
    request.parameters["file:1/model.onnx"].bytes_param = b"onnx"
    assert convert.load_parameters(request.parameters) == ("{}", {"file:1/model.onnx": b"onnx"})
    request.parameters["config"].bytes_param = b"{}"
    with pytest.raises(ServerError, match="must be a string"):
        convert.load_parameters(request.parameters)
    with pytest.raises(ServerError, match="unknown load parameter"):
        convert.load_parameters({"colour": pb.ModelRepositoryParameter(string_param="red")})
