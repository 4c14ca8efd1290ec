"""Issue #34's protocol corners: cases Triton handles that Kiln answered differently, each against a real server.

Requests go through the stock tritonclient (HTTP and gRPC) or raw HTTP, as Triton's own qa tests send them
(qa/L0_http/http_test.py, qa/L0_shared_memory); the expected texts are Triton's, which client code compares.
`kiln_server` is the session server (explicit mode, client shared memory allowed); `plain_server` runs with
Triton's defaults (model control mode none, client shared memory off) and restricted model-config APIs.
"""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from onnx import TensorProto
from tritonclient.utils import InferenceServerException

from tests.server.conftest import examples, require_grpc, run_server

grpc = pytest.importorskip("grpc")
grpcclient = pytest.importorskip("tritonclient.grpc")

RESTRICTED = "model-config:admin-key=s3cret"


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory: pytest.TempPathFactory):
    """A server with Triton's defaults for what these tests look at, and restricted model-config APIs."""
    base = tmp_path_factory.mktemp("corners")
    repository = base / "models"
    examples.write_model(repository, "add_sub", examples.add_sub_model(TensorProto.INT32), examples.ADD_SUB_CONFIG)
    with run_server(repository, base / "server.log", None,
                    ["--http-restricted-api", RESTRICTED, "--grpc-restricted-api", RESTRICTED]) as server:
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
                           match="This protocol is restricted, expecting header 'admin-key'"):
            client.get_model_config("add_sub")
        assert client.get_model_config("add_sub", headers={"admin-key": "s3cret"}).config.name == "add_sub"


def test_shared_memory_registration_texts(kiln_server) -> None:
    with httpclient.InferenceServerClient(kiln_server.http_url) as client:
        with pytest.raises(InferenceServerException, match="Unable to open shared memory region: '/kiln_no_such'"):
            client.register_system_shared_memory("r", "/kiln_no_such", 8)
        with pytest.raises(InferenceServerException, match="Unable to find system shared memory region: 'r'"):
            client.get_system_shared_memory_status("r")
