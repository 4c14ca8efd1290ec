"""Triton's CUDA shared-memory extension against a real server: error paths everywhere, data paths on a GPU.

Without a CUDA device (CI) the server refuses registration with a clear 400 / INVALID_ARGUMENT, lists no
regions and does not advertise the extension. With one, the stock `tritonclient.utils.cuda_shared_memory`
(tritonclient >= 2.5x: it imports `cuda.bindings.runtime`, which cuda-bindings 13 has; 2.41 imports the
removed `cuda.cudart`) allocates regions in this process that the server process opens through CUDA IPC,
over HTTP and gRPC alike.
"""

from __future__ import annotations

import base64
import contextlib
import os
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from server.core import cuda_ipc
from server.core.errors import ErrorKind, ServerError
from server.core.shared_memory import SHM_ROOT, SharedMemory
from tests.server.conftest import require_grpc

grpc = pytest.importorskip("grpc")
grpcclient = pytest.importorskip("tritonclient.grpc")

HANDLE = base64.b64encode(bytes(cuda_ipc.IPC_HANDLE_SIZE))  # get_raw_handle's form: base64 of the handle bytes
HAS_GPU = cuda_ipc.available()
without_gpu = pytest.mark.skipif(HAS_GPU, reason="checks what a server without a CUDA device answers")
A = np.arange(16, dtype=np.int32).reshape(1, 16)
B = np.full((1, 16), 3, dtype=np.int32)


@pytest.fixture(scope="module")
def http(kiln_server) -> httpclient.InferenceServerClient:
    with httpclient.InferenceServerClient(kiln_server.http_url) as client:
        yield client


@pytest.fixture(scope="module")
def grpc_client(kiln_server):
    with grpcclient.InferenceServerClient(require_grpc(kiln_server).grpc_url) as client:
        yield client


def _grpc_code(error: InferenceServerException) -> grpc.StatusCode:
    """tritonclient reports the status as the text "StatusCode.NOT_FOUND"."""
    return grpc.StatusCode[str(error.status()).removeprefix("StatusCode.")]


def _cuda_status(client) -> dict[str, tuple[int, int]]:
    """Registered CUDA regions as {name: (device_id, byte_size)}, from either client."""
    status = client.get_cuda_shared_memory_status()
    if isinstance(status, list):
        return {r["name"]: (r["device_id"], r["byte_size"]) for r in status}
    return {name: (r.device_id, r.byte_size) for name, r in status.regions.items()}


def _written_bytes(output) -> int:
    """An output's `shared_memory_byte_size` parameter (a dict from tritonclient.http, protobuf from grpc)."""
    if isinstance(output, dict):
        assert "data" not in output
        return output["parameters"]["shared_memory_byte_size"]
    return output.parameters["shared_memory_byte_size"].int64_param


# -- the region table itself (no server) ------------------------------------------------------------------------
def test_handle_must_be_the_64_ipc_bytes() -> None:
    with pytest.raises(ServerError, match=r"region 'r': raw_handle must be the 64 bytes .* got 10") as info:
        SharedMemory().register_cuda("r", b"x" * 10, 0, 64)
    assert info.value.kind == ErrorKind.INVALID_ARGUMENT
    with pytest.raises(ServerError, match="byte_size must be > 0"):
        SharedMemory().register_cuda("r", bytes(64), 0, 0)
    with pytest.raises(ServerError, match="needs a name"):
        SharedMemory().register_cuda("", bytes(64), 0, 64)


@without_gpu
def test_register_without_a_device_names_the_problem() -> None:
    with pytest.raises(ServerError, match="region 'r': no CUDA device on this server") as info:
        SharedMemory().register_cuda("r", bytes(64), 0, 64)
    assert info.value.kind == ErrorKind.INVALID_ARGUMENT


def test_system_and_cuda_regions_share_one_namespace(tmp_path: Path) -> None:
    """As in Triton: a name is taken whatever the kind, and each kind's calls see only their own regions."""
    key = f"kiln_cuda_ns_{os.getpid()}"
    path = Path(SHM_ROOT) / key
    path.write_bytes(bytes(128))
    regions = SharedMemory()
    try:
        regions.register("shared", key, 0, 128)
        with pytest.raises(ServerError, match="'shared' already in manager .already registered as system") as info:
            regions.register_cuda("shared", bytes(64), 0, 128)
        assert info.value.kind == ErrorKind.ALREADY_EXISTS
        assert regions.cuda_status() == []
        with pytest.raises(ServerError, match="The region named 'shared' is registered as system shared memory, not CUDA shared memory") as info:
            regions.cuda_status("shared")
        assert info.value.kind == ErrorKind.NOT_FOUND
        regions.unregister_cuda("shared")  # a system region: left alone
        regions.unregister_cuda()
        assert [r["name"] for r in regions.status()] == ["shared"]
        with pytest.raises(ServerError, match=r"Invalid offset \+ byte size for shared memory region: 'shared' \(\[120, 136\) is outside its 128"):
            regions.read("shared", 120, 16)
    finally:
        regions.close()
        path.unlink()
    assert regions.status() == []


# -- HTTP -------------------------------------------------------------------------------------------------------
def test_extension_is_advertised_only_with_a_device(http) -> None:
    assert ("cuda_shared_memory" in http.get_server_metadata()["extensions"]) == HAS_GPU


@without_gpu
def test_http_register_without_a_device_is_a_clear_400(http) -> None:
    with pytest.raises(InferenceServerException, match="'r': no CUDA device on this server") as info:
        http.register_cuda_shared_memory("r", HANDLE, 0, 64)
    assert info.value.status() == "400"
    assert _cuda_status(http) == {}


def test_http_bad_registrations_are_400(kiln_server) -> None:
    url = f"{kiln_server.base_url}/v2/cudasharedmemory/region/bad/register"
    cases = {"not valid base64": {"raw_handle": {"b64": "!!not base64!!"}, "device_id": 0, "byte_size": 64},
             "must be the 64 bytes": {"raw_handle": {"b64": base64.b64encode(b"short").decode()},
                                      "device_id": 0, "byte_size": 64},
             "device_id": {"raw_handle": {"b64": HANDLE.decode()}, "device_id": -1, "byte_size": 64},
             "byte_size": {"raw_handle": {"b64": HANDLE.decode()}, "device_id": 0, "byte_size": 0}}
    for problem, body in cases.items():
        response = httpx.post(url, json=body, timeout=10)
        assert response.status_code == 400, (problem, response.text)
        assert problem in response.json()["error"]
    assert "bad" not in _cuda_status_over_http(kiln_server)


def _cuda_status_over_http(kiln_server) -> list[str]:
    response = httpx.get(f"{kiln_server.base_url}/v2/cudasharedmemory/status", timeout=10)
    assert response.status_code == 200
    return [r["name"] for r in response.json()]


def test_http_status_and_unregister_of_unknown_regions(http) -> None:
    with pytest.raises(InferenceServerException, match="Unable to find cuda shared memory region: 'nope'") as e:
        http.get_cuda_shared_memory_status("nope")
    assert e.value.status() == "404"
    http.unregister_cuda_shared_memory("nope")  # Triton ignores unknown names
    http.unregister_cuda_shared_memory()


# -- gRPC -------------------------------------------------------------------------------------------------------
@without_gpu
def test_grpc_register_without_a_device_is_invalid_argument(grpc_client) -> None:
    with pytest.raises(InferenceServerException, match="no CUDA device on this server") as info:
        grpc_client.register_cuda_shared_memory("r", HANDLE, 0, 64)
    assert _grpc_code(info.value) == grpc.StatusCode.INVALID_ARGUMENT
    assert _cuda_status(grpc_client) == {}


def test_grpc_errors(grpc_client) -> None:
    with pytest.raises(InferenceServerException, match="must be the 64 bytes") as info:
        grpc_client.register_cuda_shared_memory("r", base64.b64encode(b"short"), 0, 64)
    assert _grpc_code(info.value) == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(InferenceServerException, match="Unable to find cuda shared memory region: 'nope'") as info:
        grpc_client.get_cuda_shared_memory_status("nope")
    assert _grpc_code(info.value) == grpc.StatusCode.NOT_FOUND
    grpc_client.unregister_cuda_shared_memory("nope")


# -- with a GPU: real regions from tritonclient.utils.cuda_shared_memory ----------------------------------------
def _cudashm():
    try:
        import tritonclient.utils.cuda_shared_memory as cudashm
    except (ImportError, RuntimeError) as e:  # 2.41 raises ImportError (cuda.cudart) or RuntimeError
        pytest.skip(f"tritonclient's cuda_shared_memory does not work with this CUDA Python: {e}")
    return cudashm


@contextlib.contextmanager
def _regions(cudashm, names: list[str], byte_size: int):
    """Device allocations on GPU 0 made and freed by tritonclient, as a user's code would."""
    handles = {}
    try:
        for name in names:
            handles[name] = cudashm.create_shared_memory_region(name, byte_size, 0)
        yield handles
    finally:
        for handle in handles.values():
            cudashm.destroy_shared_memory_region(handle)


@pytest.mark.gpu
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_inference_with_inputs_and_outputs_in_cuda_memory(protocol: str, request) -> None:
    cudashm = _cudashm()
    client = request.getfixturevalue("http" if protocol == "http" else "grpc_client")
    module = httpclient if protocol == "http" else grpcclient
    nbytes = A.nbytes
    name_in, name_out, small = f"{protocol}_cuda_in", f"{protocol}_cuda_out", f"{protocol}_cuda_small"
    with _regions(cudashm, [name_in, name_out, small], 2 * nbytes) as handles:
        try:
            cudashm.set_shared_memory_region(handles[name_in], [A, B])
            for name in (name_in, name_out):
                client.register_cuda_shared_memory(name, cudashm.get_raw_handle(handles[name]), 0, 2 * nbytes)
            assert _cuda_status(client) == {name_in: (0, 2 * nbytes), name_out: (0, 2 * nbytes)}
            with pytest.raises(InferenceServerException, match="already registered"):
                client.register_cuda_shared_memory(name_in, cudashm.get_raw_handle(handles[name_in]), 0, nbytes)
            with pytest.raises(InferenceServerException, match="exceeds the .* bytes of the CUDA allocation"):
                client.register_cuda_shared_memory(small, cudashm.get_raw_handle(handles[small]), 0, 1 << 30)
            assert small not in _cuda_status(client)

            inputs = [module.InferInput("INPUT0", [1, 16], "INT32"), module.InferInput("INPUT1", [1, 16], "INT32")]
            inputs[0].set_shared_memory(name_in, nbytes)
            inputs[1].set_shared_memory(name_in, nbytes, offset=nbytes)
            outputs = [module.InferRequestedOutput("OUTPUT0"), module.InferRequestedOutput("OUTPUT1")]
            outputs[0].set_shared_memory(name_out, nbytes)
            outputs[1].set_shared_memory(name_out, nbytes, offset=nbytes)
            result = client.infer("add_sub", inputs, outputs=outputs)
            assert _written_bytes(result.get_output("OUTPUT1")) == nbytes  # in the region, not the response
            written = cudashm.get_contents_as_numpy(handles[name_out], np.int32, [2, 1, 16])
            np.testing.assert_array_equal(written[0], A + B)
            np.testing.assert_array_equal(written[1], A - B)

            outputs[1].set_shared_memory(name_out, nbytes, offset=2 * nbytes)  # past the end: bounds checked
            with pytest.raises(InferenceServerException, match=rf"Invalid offset \+ byte size for shared memory region: '{name_out}' \(\[128, 192\) is outside"):
                client.infer("add_sub", inputs, outputs=outputs)
            client.unregister_cuda_shared_memory(name_in)
            assert set(_cuda_status(client)) == {name_out}
            with pytest.raises(InferenceServerException, match=f"Unable to find shared memory region: '{name_in}'"):
                client.infer("add_sub", inputs, outputs=outputs[:1])
        finally:
            client.unregister_cuda_shared_memory()
    assert _cuda_status(client) == {}
