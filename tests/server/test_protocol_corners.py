"""Issue #34's protocol corners: cases Triton handles that Kiln answered differently, each against a real server.

Requests go through the stock tritonclient (HTTP and gRPC) or raw HTTP, as Triton's own qa tests send them
(qa/L0_http/http_test.py, qa/L0_shared_memory); the expected texts are Triton's, which client code compares.
`kiln_server` is the session server (explicit mode, client shared memory allowed); `plain_server` runs with
Triton's defaults (model control mode none, client shared memory off) and restricted model-config APIs.
"""

from __future__ import annotations

import base64
import gzip
import json
import socket
import struct
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from tests.server.conftest import examples, require_grpc, run_server

grpc = pytest.importorskip("grpc")
grpcclient = pytest.importorskip("tritonclient.grpc")

RESTRICTED = "model-config:admin-key=s3cret"


MIB = 1 << 20


def _one_input_model(name: str, elem_type: int, shape: list, op: str, **attrs) -> object:
    """INPUT0 -> `op` -> OUTPUT0 (Mul by 2 takes a constant second input)."""
    inputs = ["INPUT0"]
    initializers = []
    if op == "Mul":
        initializers.append(helper.make_tensor("two", elem_type, [], [2.0]))
        inputs.append("two")
    out_shape = [1] if op == "ReduceSum" else shape
    graph = helper.make_graph([helper.make_node(op, inputs, ["OUTPUT0"], **attrs)], name,
                              [helper.make_tensor_value_info("INPUT0", elem_type, shape)],
                              [helper.make_tensor_value_info("OUTPUT0", elem_type, out_shape)], initializers)
    return examples._model(graph)


def _config(name: str, datatype: str, dims: list[int], max_batch_size: int, out_dims: list[int] | None = None) -> str:
    out = out_dims or dims
    return (f'name: "{name}"\nmax_batch_size: {max_batch_size}\n'
            f'input [ {{ name: "INPUT0" data_type: {datatype} dims: {dims} }} ]\n'
            f'output [ {{ name: "OUTPUT0" data_type: {datatype} dims: {out} }} ]\n'
            'instance_group [ { kind: KIND_CPU } ]\n')


def write_corner_models(repository: Path) -> None:
    """Single-input models: what a raw binary request, empty tensors and large variable dims need."""
    write = examples.write_model
    write(repository, "add_sub", examples.add_sub_model(TensorProto.INT32), examples.ADD_SUB_CONFIG)
    write(repository, "scale", _one_input_model("scale", TensorProto.FLOAT, ["batch", "n"], "Mul"),
          _config("scale", "TYPE_FP32", [-1], 8))
    write(repository, "total", _one_input_model("total", TensorProto.FLOAT, ["n"], "ReduceSum", keepdims=1),
          _config("total", "TYPE_FP32", [-1], 0, [1]))
    write(repository, "text", _one_input_model("text", TensorProto.STRING, [1], "Identity"),
          _config("text", "TYPE_STRING", [1], 0))
    write(repository, "texts", _one_input_model("texts", TensorProto.STRING, ["n"], "Identity"),
          _config("texts", "TYPE_STRING", [-1], 0))
    write(repository, "grid", _one_input_model("grid", TensorProto.FLOAT16, ["h", "w"], "Identity"),
          _config("grid", "TYPE_FP16", [-1, -1], 0))


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory: pytest.TempPathFactory):
    """A server with Triton's defaults for what these tests look at, and restricted model-config APIs."""
    base = tmp_path_factory.mktemp("corners")
    repository = base / "models"
    write_corner_models(repository)
    with run_server(repository, base / "server.log", None,
                    ["--http-restricted-api", RESTRICTED, "--grpc-restricted-protocol", RESTRICTED]) as server:
        yield server


def _add_sub_inputs(module, a: np.ndarray) -> list:
    inputs = [module.InferInput(name, list(a.shape), "INT32") for name in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(a)
    return inputs


def _grpc_code(error: InferenceServerException) -> grpc.StatusCode:
    return grpc.StatusCode[str(error.status()).removeprefix("StatusCode.")]


# -- 3. an output asked for twice -------------------------------------------------------------------------------
def test_duplicate_output_names_are_refused_over_http(kiln_server) -> None:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    with httpclient.InferenceServerClient(kiln_server.http_url) as client:
        outputs = [httpclient.InferRequestedOutput("OUTPUT0") for _ in range(2)]
        with pytest.raises(InferenceServerException, match="output 'OUTPUT0' already exists in request") as info:
            client.infer("add_sub", _add_sub_inputs(httpclient, a), outputs=outputs)
        assert info.value.status() == "400"
        assert client.infer("add_sub", _add_sub_inputs(httpclient, a)).as_numpy("OUTPUT0").tolist() == (a + a).tolist()


def test_duplicate_output_and_input_names_are_refused_over_grpc(kiln_server) -> None:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    with grpcclient.InferenceServerClient(require_grpc(kiln_server).grpc_url) as client:
        outputs = [grpcclient.InferRequestedOutput("OUTPUT1") for _ in range(2)]
        with pytest.raises(InferenceServerException, match="output 'OUTPUT1' already exists in request") as info:
            client.infer("add_sub", _add_sub_inputs(grpcclient, a), outputs=outputs)
        assert _grpc_code(info.value) == grpc.StatusCode.INVALID_ARGUMENT
        inputs = _add_sub_inputs(grpcclient, a)
        with pytest.raises(InferenceServerException, match="input 'INPUT0' already exists in request"):
            client.infer("add_sub", [*inputs, inputs[0]])
        assert client.infer("add_sub", inputs).as_numpy("OUTPUT1").tolist() == np.zeros_like(a).tolist()


# -- 7. a `file:` name longer than a file name may be -----------------------------------------------------------
@pytest.mark.parametrize("path", ["A" * 256, "1/" + "b" * 300 + ".onnx"])
def test_overlong_uploaded_file_name_is_a_400(kiln_server, path: str) -> None:
    """Triton's qa test_load_oversized_file_parameter: the load fails, the server stays up (Triton: 500, with
    a TODO for 400; Kiln answers 400 with Triton's text)."""
    body = {"parameters": {f"file:{path}": base64.b64encode(b"a").decode(), "config": "{}"}}
    with httpx.Client(base_url=kiln_server.base_url, timeout=30) as http:
        response = http.post("/v2/repository/models/long_names/load", json=body)
        assert response.status_code == 400, response.text
        assert "failed to poll from model repository" in response.json()["error"]
        assert http.get("/v2/health/ready").status_code == 200
    with grpcclient.InferenceServerClient(require_grpc(kiln_server).grpc_url) as client:
        with pytest.raises(InferenceServerException, match="failed to poll from model repository") as info:
            client.load_model("long_names", config="{}", files={f"file:{path}": b"a"})
        assert _grpc_code(info.value) == grpc.StatusCode.INVALID_ARGUMENT


# -- 8. client shared memory is off unless --allow-client-shm true ----------------------------------------------
def test_client_shm_is_disabled_by_default_over_http(plain_server) -> None:
    """Triton's qa test_client_shm_disabled_by_default: register/unregister refused, status answered (empty)."""
    with httpclient.InferenceServerClient(plain_server.http_url) as client:
        assert client.get_system_shared_memory_status() == []
        for call in (lambda: client.register_system_shared_memory("dummy_data", "/dummy_data", 8),
                     lambda: client.unregister_system_shared_memory("dummy_data"),
                     lambda: client.register_cuda_shared_memory("dummy", base64.b64encode(bytes(64)), 0, 8),
                     lambda: client.unregister_cuda_shared_memory()):
            with pytest.raises(InferenceServerException, match="Client shared memory is disabled") as info:
                call()
            assert info.value.status() == "501"
        assert client.get_system_shared_memory_status() == []
        assert client.get_cuda_shared_memory_status() == []


def test_client_shm_is_disabled_by_default_over_grpc(plain_server) -> None:
    with grpcclient.InferenceServerClient(require_grpc(plain_server).grpc_url) as client:
        assert len(client.get_system_shared_memory_status().regions) == 0
        with pytest.raises(InferenceServerException, match="--allow-client-shm=true' to enable") as info:
            client.register_system_shared_memory("dummy_data", "/dummy_data", 8)
        assert _grpc_code(info.value) == grpc.StatusCode.UNIMPLEMENTED
        with pytest.raises(InferenceServerException, match="Client shared memory is disabled") as info:
            client.unregister_system_shared_memory()
        assert _grpc_code(info.value) == grpc.StatusCode.UNIMPLEMENTED


# -- 9. Triton's error texts ------------------------------------------------------------------------------------
def test_unknown_model_and_version_texts(kiln_server) -> None:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    with httpclient.InferenceServerClient(kiln_server.http_url) as client:
        with pytest.raises(InferenceServerException, match="Request for unknown model: 'nope' is not found"):
            client.infer("nope", _add_sub_inputs(httpclient, a))
        with pytest.raises(InferenceServerException, match="Request for unknown model: 'add_sub' version 9 is not"):
            client.infer("add_sub", _add_sub_inputs(httpclient, a), model_version="9")
        with pytest.raises(InferenceServerException, match="Request for unknown model: 'nope' is not found"):
            client.get_model_metadata("nope")
    with grpcclient.InferenceServerClient(require_grpc(kiln_server).grpc_url) as client:
        with pytest.raises(InferenceServerException, match="Request for unknown model: 'nope' is not found"):
            client.get_model_config("nope")
        with pytest.raises(InferenceServerException, match="failed to load 'nope', failed to poll from model repo"):
            client.load_model("nope")


def test_load_and_unload_in_mode_none_say_polling_is_enabled(plain_server) -> None:
    with httpclient.InferenceServerClient(plain_server.http_url) as client:
        for call in (lambda: client.load_model("add_sub"), lambda: client.unload_model("add_sub")):
            with pytest.raises(InferenceServerException,
                               match="explicit model load / unload is not allowed if polling is enabled"):
                call()
        assert client.is_model_ready("add_sub")
    with grpcclient.InferenceServerClient(require_grpc(plain_server).grpc_url) as client:
        with pytest.raises(InferenceServerException, match="not allowed if polling is enabled") as info:
            client.unload_model("add_sub")
        assert _grpc_code(info.value) == grpc.StatusCode.UNAVAILABLE


def test_restricted_api_and_protocol_texts(plain_server) -> None:
    with httpclient.InferenceServerClient(plain_server.http_url) as client:
        with pytest.raises(InferenceServerException, match="This API is restricted, expecting header 'admin-key'"):
            client.get_model_config("add_sub")
        assert client.get_model_config("add_sub", headers={"admin-key": "s3cret"})["name"] == "add_sub"
    with grpcclient.InferenceServerClient(require_grpc(plain_server).grpc_url) as client:
        with pytest.raises(InferenceServerException,
                           match="This protocol is restricted, expecting header 'triton-grpc-protocol-admin-key'"):
            client.get_model_config("add_sub")
        config = client.get_model_config("add_sub", headers={"triton-grpc-protocol-admin-key": "s3cret"})
        assert config.config.name == "add_sub"


def test_shared_memory_registration_texts(kiln_server) -> None:
    with httpclient.InferenceServerClient(kiln_server.http_url) as client:
        with pytest.raises(InferenceServerException, match="Unable to open shared memory region: '/kiln_no_such'"):
            client.register_system_shared_memory("r", "/kiln_no_such", 8)
        with pytest.raises(InferenceServerException, match="Unable to find system shared memory region: 'r'"):
            client.get_system_shared_memory_status("r")


# -- 1. Triton's raw binary request ----------------------------------------------------------------------------
def _raw(http: httpx.Client, model: str, body: bytes, **headers: str) -> httpx.Response:
    return http.post(f"/v2/models/{model}/infer", content=body,
                     headers={"Inference-Header-Content-Length": "0", **headers})


def _binary_outputs(response: httpx.Response) -> tuple[dict, bytes]:
    assert response.status_code == 200, response.text
    length = int(response.headers["Inference-Header-Content-Length"])
    return json.loads(response.content[:length]), response.content[length:]


@pytest.fixture(scope="module")
def http(plain_server) -> httpx.Client:
    with httpx.Client(base_url=plain_server.base_url, timeout=120) as client:
        yield client


@pytest.mark.parametrize("count", [8, 32])
def test_raw_binary_request(http, count: int) -> None:
    """qa test_raw_binary: the body is the one input's bytes; batch 1, the variable dim from the byte count,
    every output binary."""
    data = np.arange(count, dtype=np.float32)
    header, raw = _binary_outputs(_raw(http, "scale", data.tobytes()))
    (output,) = header["outputs"]
    assert output["name"] == "OUTPUT0" and output["shape"] == [1, count] and output["datatype"] == "FP32"
    assert output["parameters"]["binary_data_size"] == 4 * count
    np.testing.assert_array_equal(np.frombuffer(raw, np.float32), data * 2)


def test_raw_binary_bytes_input(http) -> None:
    """qa test_byte: a BYTES input of shape [1] gets the whole body as its element (length prefixed back)."""
    header, raw = _binary_outputs(_raw(http, "text", b"427"))
    assert header["outputs"][0]["shape"] == [1]
    assert raw == struct.pack("<I", 3) + b"427"


@pytest.mark.parametrize("model, body, text", [
    ("texts", b"427", "For BYTE datatype raw input 'INPUT0', the model must have input shape [1]"),
    ("grid", bytes(8), "The shape of the raw input 'INPUT0' can not be deduced because there are more than one "
                       "variable-sized dimension"),
    ("add_sub", bytes(96), "Raw request must only have 1 input (found 1) to be deduced but got 2 inputs in"),
    ("scale", bytes(6), "expected 4 bytes for FP32 [1, 1], got 6"),
])
def test_raw_binary_refusals(http, model: str, body: bytes, text: str) -> None:
    """qa test_byte_too_many_elements, test_multi_variable_dimensions, test_multi_inputs; the server goes on."""
    response = _raw(http, model, body)
    assert response.status_code == 400 and text in response.json()["error"], response.text
    assert _raw(http, "scale", bytes(4)).status_code == 200


# -- 2. a zero-length variable dim ------------------------------------------------------------------------------
def test_empty_tensor_request_returns_empty_outputs(plain_server) -> None:
    with httpclient.InferenceServerClient(plain_server.http_url) as client:
        tensor = httpclient.InferInput("INPUT0", [1, 0], "FP32")
        tensor.set_data_from_numpy(np.zeros((1, 0), np.float32))
        result = client.infer("scale", [tensor])
        assert result.as_numpy("OUTPUT0").shape == (1, 0)
        assert result.get_output("OUTPUT0")["shape"] == [1, 0]
    with grpcclient.InferenceServerClient(require_grpc(plain_server).grpc_url) as client:
        tensor = grpcclient.InferInput("INPUT0", [0], "BYTES")
        tensor.set_data_from_numpy(np.zeros((0,), np.object_))
        assert client.infer("texts", [tensor]).as_numpy("OUTPUT0").shape == (0,)


# -- 4. variable dims far beyond 4096 ---------------------------------------------------------------------------
def test_large_variable_dims_are_served(plain_server) -> None:
    """A config's -1 dims are not capped at 4096 (the old automatic profile's max) on the CPU backend."""
    with grpcclient.InferenceServerClient(require_grpc(plain_server).grpc_url) as client:
        values = np.ones(10_485_760, np.float32)
        tensor = grpcclient.InferInput("INPUT0", list(values.shape), "FP32")
        tensor.set_data_from_numpy(values)
        assert client.infer("total", [tensor]).as_numpy("OUTPUT0").tolist() == [10_485_760.0]
        words = np.array([b"w%d" % i for i in range(100_000)], dtype=np.object_)
        tensor = grpcclient.InferInput("INPUT0", list(words.shape), "BYTES")
        tensor.set_data_from_numpy(words)
        assert client.infer("texts", [tensor]).as_numpy("OUTPUT0").tolist() == words.tolist()


# -- 5. Triton's --http-max-input-size instead of a 1 GiB body cap ----------------------------------------------
def test_binary_tensor_data_is_not_capped(http) -> None:
    """Triton bounds what it parses (the JSON header), not the binary tensor data after it: 80 MiB of tensor data
    behind a small header is served although --http-max-input-size is 64 MiB."""
    count = 20 * MIB
    header = json.dumps({"inputs": [{"name": "INPUT0", "shape": [count], "datatype": "FP32",
                                     "parameters": {"binary_data_size": 4 * count}}]}).encode()
    response = http.post("/v2/models/total/infer", content=header + np.ones(count, np.float32).tobytes(),
                         headers={"Inference-Header-Content-Length": str(len(header))})
    assert response.status_code == 200, response.text
    assert response.json()["outputs"][0]["data"] == [float(count)]


def test_a_1_9_gb_body_is_not_refused_up_front(plain_server) -> None:
    """The old default refused any body declaring more than 1 GiB with 413 before reading it; Triton has no body
    cap, and now neither does Kiln by default: the server waits for the body instead of answering."""
    with socket.create_connection(("127.0.0.1", plain_server.http_port), timeout=2) as connection:
        connection.sendall(b"POST /v2/models/total/infer HTTP/1.1\r\nHost: x\r\n"
                           b"Inference-Header-Content-Length: 100\r\nContent-Length: 1900000000\r\n\r\n"
                           + bytes(MIB))
        with pytest.raises(TimeoutError):
            connection.recv(1024)  # an early 413 would arrive here


def test_what_the_server_parses_is_capped_at_64_mib(http) -> None:
    limit = 64 * MIB
    response = http.post("/v2/models/scale/infer", content=b" " * (limit + 1))
    assert response.status_code == 400
    assert response.json()["error"].startswith(f"request JSON size of {limit + 1} bytes exceeds the maximum allowed "
                                               f"input size of {limit} bytes. Use --http-max-input-size")
    response = _raw(http, "scale", bytes(limit + 4))
    assert response.status_code == 400 and "Raw input has a byte_size (67108868 bytes)" in response.json()["error"]
    bomb = gzip.compress(b"{" + b" " * (limit + MIB) + b"}")
    response = http.post("/v2/models/scale/infer", content=bomb, headers={"Content-Encoding": "gzip"})
    assert response.status_code == 400
    assert response.json()["error"].startswith("Decompressed data size exceeds the maximum allowed value of 67108864")
    response = http.post("/v2/repository/index", content=b"{" + b" " * limit + b"}")
    assert response.status_code == 400 and "request JSON size of" in response.json()["error"]
    assert _raw(http, "scale", bytes(4)).status_code == 200


def test_limit_flags() -> None:
    import argparse

    from server.cli import add_serve_arguments
    from server.core.limits import limits_from_args

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    defaults = limits_from_args(parser.parse_args(["--model-repository", "."]))
    assert defaults.max_input_bytes == 64 * MIB and defaults.max_body_bytes is None
    chosen = limits_from_args(parser.parse_args(["--model-repository", ".", "--http-max-input-size", "2G",
                                                 "--http-max-body-bytes", "3G"]))
    assert chosen.max_input_bytes == 2 << 30 and chosen.max_body_bytes == 3 << 30
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-repository", ".", "--http-max-input-size", "0"])


# -- 6. tensor data nested 100 deep or more ---------------------------------------------------------------------
def _nested(depth: int, value: object) -> object:
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("model, datatype, shape, value", [("texts", "BYTES", [1], "hello"),
                                                           ("scale", "FP32", [1, 1], 1.5)])
def test_json_nesting_limit(http, model: str, datatype: str, shape: list[int], value: object) -> None:
    """qa test_json_recursion_depth_limit: 120 deep is refused with Triton's text, 50 deep is served."""
    def body(depth: int) -> dict:
        return {"inputs": [{"name": "INPUT0", "datatype": datatype, "shape": shape, "data": _nested(depth, value)}]}

    response = http.post(f"/v2/models/{model}/infer", json=body(120))
    assert response.status_code == 400
    assert "JSON nesting depth exceeds maximum allowed limit (100)" in response.json()["error"]
    response = http.post(f"/v2/models/{model}/infer", json=body(50))
    assert response.status_code == 200, response.text
