"""Hostile gRPC calls: malformed messages, broken raw tensors, unknown names, restricted APIs — each a clear
status code (never INTERNAL/UNKNOWN), while good calls made between them keep succeeding."""

from __future__ import annotations

import struct

import grpc
import numpy as np
import pytest

from server.protos import grpc_service_pb2 as pb
from server.protos import grpc_service_pb2_grpc
from tests.server.conftest import require_grpc

SERVICE = "/inference.GRPCInferenceService/"
ADMIN = (("triton-grpc-protocol-admin-key", "s3cret"),)  # Triton prefixes the configured key over gRPC


@pytest.fixture(scope="module")
def channel(guarded_server):
    with grpc.insecure_channel(require_grpc(guarded_server).grpc_url) as channel:
        yield channel


@pytest.fixture(scope="module")
def stub(channel):
    return grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)


def _good_request() -> pb.ModelInferRequest:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    request = pb.ModelInferRequest(model_name="add_sub")
    for name in ("INPUT0", "INPUT1"):
        tensor = request.inputs.add(name=name, datatype="INT32")
        tensor.shape.extend([1, 16])
    request.raw_input_contents.extend([a.tobytes(), np.ones_like(a).tobytes()])
    return request


def _assert_good(stub) -> None:
    response = stub.ModelInfer(_good_request(), timeout=30)
    np.testing.assert_array_equal(np.frombuffer(response.raw_output_contents[0], np.int32), np.arange(1, 17))


def _code(call, *args, **kwargs) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, timeout=30, **kwargs)
    return info.value.code(), info.value.details()


GARBAGE = [b"\x0a\xff\xff\xff\xff\x0f", b"\xff" * 64, b"\x0a\x05ab", b"\x12\x03\x0a\x01", b"\x08" + b"\xff" * 11]


@pytest.mark.parametrize("method", ["ModelInfer", "ModelMetadata", "ServerLive", "RepositoryModelLoad"])
@pytest.mark.parametrize("payload", GARBAGE, ids=["huge-length", "all-ff", "short-string", "short-nested",
                                                  "long-varint"])
def test_malformed_messages_are_invalid_argument(channel, stub, method, payload):
    raw = channel.unary_unary(SERVICE + method, request_serializer=None, response_deserializer=None)
    code, details = _code(raw, payload, metadata=ADMIN)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert "does not parse" in details
    _assert_good(stub)


def test_malformed_message_in_a_stream(channel, stub):
    """Repeated, because the abort once raced the stream's reader task and left ~10% of calls hanging."""
    stream = channel.stream_stream(SERVICE + "ModelStreamInfer", request_serializer=None,
                                   response_deserializer=pb.ModelStreamInferResponse.FromString)
    good = _good_request().SerializeToString()
    for messages in [[good, b"\xff" * 8, good], [b"\xff" * 8], [good, good, b"\x0a\xff"]] * 10:
        with pytest.raises(grpc.RpcError) as info:
            list(stream(iter(messages), timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (info.value.code(), info.value.details())
    answers = list(stream(iter([good, good]), timeout=10))  # a clean stream still works
    assert len(answers) == 2 and not any(a.error_message for a in answers)
    _assert_good(stub)


@pytest.mark.parametrize("payload, fragment", [
    (struct.pack("<I", 100) + b"abc", "claims 100 bytes"),
    (struct.pack("<I", 3) + b"abc!", "after its 1 elements"),
    (b"\x01", "cannot hold 1 elements"),
])
def test_broken_bytes_raw_contents(stub, payload, fragment):
    request = pb.ModelInferRequest(model_name="identity")
    tensor = request.inputs.add(name="IN_BYTES", datatype="BYTES")
    tensor.shape.append(1)
    request.raw_input_contents.append(payload)
    code, details = _code(stub.ModelInfer, request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and fragment in details, details
    _assert_good(stub)


def test_wrong_raw_sizes_and_names(stub):
    request = _good_request()
    request.raw_input_contents[0] = b"\x00" * 63
    assert _code(stub.ModelInfer, request)[0] == grpc.StatusCode.INVALID_ARGUMENT
    request = _good_request()
    request.raw_input_contents.append(b"extra")
    assert _code(stub.ModelInfer, request)[0] == grpc.StatusCode.INVALID_ARGUMENT
    request = _good_request()
    request.inputs[0].shape[:] = [-1, 16]
    assert _code(stub.ModelInfer, request)[0] == grpc.StatusCode.INVALID_ARGUMENT
    for shape in ([2**32, 2**32], [1] * 65, [2**62, 4]):  # int64 products that wrap, too many dims
        request = _good_request()
        request.inputs[0].shape[:] = shape
        request.raw_input_contents[0] = b""
        code, details = _code(stub.ModelInfer, request)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "input 'INPUT0'" in details, details
    request = _good_request()
    request.model_name = "nope"
    assert _code(stub.ModelInfer, request)[0] == grpc.StatusCode.NOT_FOUND
    request = _good_request()
    request.model_version = "12"
    assert _code(stub.ModelInfer, request)[0] == grpc.StatusCode.NOT_FOUND
    request = _good_request()
    request.outputs.add(name="NOPE")
    assert _code(stub.ModelInfer, request)[0] == grpc.StatusCode.INVALID_ARGUMENT
    _assert_good(stub)


def test_restricted_apis_need_metadata(stub):
    for call, request in [(stub.ModelConfig, pb.ModelConfigRequest(name="add_sub")),
                          (stub.RepositoryIndex, pb.RepositoryIndexRequest()),
                          (stub.RepositoryModelUnload, pb.RepositoryModelUnloadRequest(model_name="add_sub"))]:
        code, details = _code(call, request)
        assert code == grpc.StatusCode.UNAVAILABLE and "triton-grpc-protocol-admin-key" in details  # as Triton
        code, _ = _code(call, request, metadata=(("triton-grpc-protocol-admin-key", "wrong"),))
        assert code == grpc.StatusCode.UNAVAILABLE
        code, _ = _code(call, request, metadata=(("admin-key", "s3cret"),))  # Triton reads the prefixed name only
        assert code == grpc.StatusCode.UNAVAILABLE
    assert stub.ModelConfig(pb.ModelConfigRequest(name="add_sub"), metadata=ADMIN).config.name == "add_sub"
    assert stub.RepositoryIndex(pb.RepositoryIndexRequest(), metadata=ADMIN).models
    assert stub.ModelMetadata(pb.ModelMetadataRequest(name="add_sub")).name == "add_sub"  # not restricted
    _assert_good(stub)  # inference is open


@pytest.mark.parametrize("name, files, config, fragment", [
    ("../evil", {}, None, "invalid model name"),
    (".hidden", {}, None, "invalid model name"),
    ("x", {"file:../../etc/cron.d/x": b"1"}, "{}", "without '..'"),
    ("x", {"file:/etc/passwd": b"1"}, "{}", "without '..'"),
    ("x", {"file:1/model\x00.onnx": b"1"}, "{}", "control characters"),
    ("x", {}, '{"output": [{"name": "y", "label_filename": "../../../../etc/passwd"}]}', "config file name"),
    ("add_sub", {}, '{"default_model_filename": "/etc/passwd"}', "config file name"),
])
def test_repository_load_confinement(stub, name, files, config, fragment):
    request = pb.RepositoryModelLoadRequest(model_name=name)
    if config is not None:
        request.parameters["config"].string_param = config
    for key, content in files.items():
        request.parameters[key].bytes_param = content
    code, details = _code(stub.RepositoryModelLoad, request, metadata=ADMIN)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and fragment in details, details
    _assert_good(stub)
