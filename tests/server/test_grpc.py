"""The gRPC frontend, driven over the wire by the stock `tritonclient.grpc` / `tritonclient.grpc.aio` clients.

A real server process serves the example repository (examples/make_example_repository.py); every check compares
numbers computed here with numpy.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading

import grpc
import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc")
aio_client = pytest.importorskip("tritonclient.grpc.aio")
shm = pytest.importorskip("tritonclient.utils.shared_memory")  # conftest supplies its pkg_resources need
from tritonclient.grpc import service_pb2 as tpb  # noqa: E402 - after the importorskip above
from tritonclient.grpc import service_pb2_grpc as tpb_grpc  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from server.frontends.grpc import GrpcOptions  # noqa: E402
from server.protos import health_pb2, health_pb2_grpc  # noqa: E402
from tests.server.conftest import require_grpc  # noqa: E402
from tests.support.ports import free_port  # noqa: E402

pytestmark = pytest.mark.timeout(120)

ADD_SUB_INPUTS = (np.arange(16, dtype=np.int32).reshape(1, 16), np.full((1, 16), 3, dtype=np.int32))


@pytest.fixture(scope="module")
def grpc_server(kiln_server):
    """The shared server process (tests/server/conftest.py), once its gRPC port accepts calls."""
    return require_grpc(kiln_server)


@pytest.fixture(scope="module")
def url(grpc_server) -> str:
    return grpc_server.grpc_url


def _model_bytes(server, name: str) -> bytes:
    return (server.repository / name / "1" / "model.onnx").read_bytes()


@pytest.fixture
def client(url):
    with grpcclient.InferenceServerClient(url) as c:
        yield c


@pytest.fixture
def stub(url):
    """tritonclient's own generated stub, for requests its high-level API cannot express (typed contents)."""
    with grpc.insecure_channel(url) as channel:
        yield tpb_grpc.GRPCInferenceServiceStub(channel)


def _inputs(arrays: dict[str, np.ndarray], datatypes: dict[str, str] | None = None) -> list:
    inputs = []
    for name, array in arrays.items():
        datatype = (datatypes or {}).get(name) or grpcclient.np_to_triton_dtype(array.dtype)
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _add_sub_inputs(a: np.ndarray = ADD_SUB_INPUTS[0], b: np.ndarray = ADD_SUB_INPUTS[1]) -> list:
    return _inputs({"INPUT0": a, "INPUT1": b})


def _status(error: InferenceServerException) -> grpc.StatusCode:
    """tritonclient reports the status as the text "StatusCode.NOT_FOUND"."""
    return grpc.StatusCode[str(error.status()).removeprefix("StatusCode.")]


# -- health and metadata ---------------------------------------------------------------------------------------
def test_health_and_server_metadata(client) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("add_sub") and client.is_model_ready("add_sub", "1")
    assert not client.is_model_ready("add_sub", "7")
    metadata = client.get_server_metadata()
    assert metadata.name == "kiln" and "model_repository" in metadata.extensions
    assert client.get_server_metadata(as_json=True)["extensions"] == list(metadata.extensions)


def test_model_metadata_and_config(client) -> None:
    metadata = client.get_model_metadata("add_sub")
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == [
        ("INPUT0", "INT32", [-1, 16]), ("INPUT1", "INT32", [-1, 16])]
    assert client.get_model_metadata("add_sub", as_json=True)["outputs"][1]["name"] == "OUTPUT1"
    config = client.get_model_config("add_sub").config
    assert config.max_batch_size == 8 and [list(i.dims) for i in config.input] == [[16], [16]]
    assert config.instance_group[0].count == 2
    as_json = client.get_model_config("simple_cnn", as_json=True)["config"]
    assert as_json["output"][0]["label_filename"] == "labels.txt" and as_json["input"][0]["dims"] == ["3", "32", "32"]


# -- inference ---------------------------------------------------------------------------------------------------
def test_infer_raw_add_sub(client) -> None:
    a, b = ADD_SUB_INPUTS
    result = client.infer("add_sub", _add_sub_inputs(), request_id="req-1",
                          outputs=[grpcclient.InferRequestedOutput("OUTPUT1")])
    response = result.get_response()
    assert response.id == "req-1" and response.model_name == "add_sub" and response.model_version == "1"
    assert [o.name for o in response.outputs] == ["OUTPUT1"]
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


def test_infer_every_datatype_raw(client) -> None:
    """The identity model echoes one tensor per KServe datatype; raw bytes must survive both directions."""
    rng = np.random.default_rng(0)
    arrays = {
        "BOOL": np.array([True, False, True]),
        "UINT8": np.array([0, 7, 255], np.uint8), "UINT16": np.array([1, 65535, 2], np.uint16),
        "UINT32": np.array([3, 2**32 - 1, 0], np.uint32), "UINT64": np.array([2**64 - 1, 0, 5], np.uint64),
        "INT8": np.array([-128, 0, 127], np.int8), "INT16": np.array([-32768, 1, 32767], np.int16),
        "INT32": np.array([-(2**31), 0, 2**31 - 1], np.int32), "INT64": np.array([-(2**63), 1, 2**63 - 1], np.int64),
        "FP16": rng.standard_normal(3).astype(np.float16), "FP32": rng.standard_normal(3).astype(np.float32),
        "FP64": rng.standard_normal(3), "BF16": np.array([1.5, -2.0, 3.140625], np.float32),
        "BYTES": np.array([b"kiln", b"", "\u00e9t\u00e9".encode()], dtype=np.object_),
    }
    inputs = _inputs({f"IN_{k}": v for k, v in arrays.items()}, {f"IN_{k}": k for k in arrays})
    result = client.infer("identity", inputs)
    for datatype, expected in arrays.items():
        got = result.as_numpy(f"OUT_{datatype}")
        assert result.get_output(f"OUT_{datatype}").datatype == datatype
        if datatype == "BYTES":
            assert list(got) == list(expected)
        else:  # BF16 comes back as float32 (tritonclient widens it); the values are exact in bfloat16
            np.testing.assert_array_equal(got, expected)
            assert datatype == "BF16" or got.dtype == expected.dtype


def test_infer_typed_contents(stub) -> None:
    """`contents` (typed fields) instead of raw bytes: what non-tritonclient clients often send."""
    a, b = ADD_SUB_INPUTS
    request = tpb.ModelInferRequest(model_name="add_sub", id="typed")
    for name, array in (("INPUT0", a), ("INPUT1", b)):
        tensor = request.inputs.add(name=name, datatype="INT32", shape=list(array.shape))
        tensor.contents.int_contents.extend(array.reshape(-1).tolist())
    response = stub.ModelInfer(request)
    names = [o.name for o in response.outputs]
    total = np.frombuffer(response.raw_output_contents[names.index("OUTPUT0")], np.int32).reshape(1, 16)
    np.testing.assert_array_equal(total, a + b)
    assert response.id == "typed"


@pytest.mark.parametrize("datatype,field,values,fragment", [
    ("FP16", None, None, "raw_input_contents"),
    ("INT8", "int_contents", [1, 300, 2], "outside the range"),
    ("INT32", "fp32_contents", [1.0, 2.0, 3.0], "int_contents"),
    ("INT32", "int_contents", [1, 2], "expected 3 values"),
])
def test_typed_contents_errors(stub, datatype, field, values, fragment) -> None:
    request = tpb.ModelInferRequest(model_name="identity")
    tensor = request.inputs.add(name=f"IN_{datatype}", datatype=datatype, shape=[3])
    if field:
        getattr(tensor.contents, field).extend(values)
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and fragment in info.value.details()


def test_raw_size_mismatch_and_stray_raw_entries(stub) -> None:
    request = tpb.ModelInferRequest(model_name="add_sub")
    request.inputs.add(name="INPUT0", datatype="INT32", shape=[1, 16])
    request.inputs.add(name="INPUT1", datatype="INT32", shape=[1, 16])
    request.raw_input_contents.extend([bytes(64), bytes(60)])
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "expected 64 bytes" in info.value.details()
    request.raw_input_contents[1] = bytes(64)
    request.raw_input_contents.append(bytes(4))
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "3 raw_input_contents" in info.value.details()


def test_gzip_compression_and_classification(client, grpc_server) -> None:
    image = np.linspace(-1, 1, 3 * 32 * 32, dtype=np.float32).reshape(1, 3, 32, 32)
    probabilities = client.infer("simple_cnn", _inputs({"INPUT": image}),
                                 compression_algorithm="gzip").as_numpy("PROBABILITIES")[0]
    assert probabilities.shape == (10,) and abs(float(probabilities.sum()) - 1.0) < 1e-5
    top = client.infer("simple_cnn", _inputs({"INPUT": image}),
                       outputs=[grpcclient.InferRequestedOutput("PROBABILITIES", class_count=3)])
    entries = [e.decode().split(":") for e in top.as_numpy("PROBABILITIES")[0]]
    assert [int(e[1]) for e in entries] == list(np.argsort(-probabilities, kind="stable")[:3])
    np.testing.assert_allclose([float(e[0]) for e in entries], np.sort(probabilities)[::-1][:3], atol=5e-7)
    labels = (grpc_server.repository / "simple_cnn" / "labels.txt").read_text().split()
    assert [e[2] for e in entries] == [labels[int(e[1])] for e in entries]


def test_async_infer_callbacks(client) -> None:
    done = threading.Event()
    results: dict[int, object] = {}

    def callback(i, result, error):
        results[i] = error or result
        if len(results) == 8:
            done.set()

    for i in range(8):
        a = np.full((1, 16), i, np.int32)
        client.async_infer("add_sub", _add_sub_inputs(a, a), lambda result, error, i=i: callback(i, result, error))
    assert done.wait(30)
    for i, result in results.items():
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full((1, 16), 2 * i, np.int32))


def test_aio_client_concurrent(url) -> None:
    async def run() -> list[np.ndarray]:
        async with aio_client.InferenceServerClient(url) as c:
            assert await c.is_server_ready()
            calls = [c.infer("add_sub", _add_sub_inputs(np.full((2, 16), i, np.int32), np.ones((2, 16), np.int32)))
                     for i in range(16)]
            return [r.as_numpy("OUTPUT1") for r in await asyncio.gather(*calls)]

    for i, out in enumerate(asyncio.run(run())):
        np.testing.assert_array_equal(out, np.full((2, 16), i - 1, np.int32))


def test_stream_many_in_flight_with_errors(client) -> None:
    """40 requests on one stream; every 5th names a missing model. Errors arrive in-band, the rest complete."""
    received: list = []
    finished = threading.Event()

    def callback(result, error):
        received.append((result, error))
        if len(received) == 40:
            finished.set()

    client.start_stream(callback)
    try:
        for i in range(40):
            a = np.full((1, 16), i, np.int32)
            model = "missing_model" if i % 5 == 0 else "add_sub"
            client.async_stream_infer(model, _add_sub_inputs(a, a), request_id=str(i))
        assert finished.wait(30), f"only {len(received)} of 40 responses"
    finally:
        client.stop_stream()
    errors = [e for _, e in received if e is not None]
    assert len(errors) == 8 and all("unknown model" in e.message() for e in errors)
    for result, error in received:
        if error is None:
            i = int(result.get_response().id)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full((1, 16), 2 * i, np.int32))
    assert client.is_server_ready()


def test_aio_stream_infer(url) -> None:
    async def run() -> dict[str, np.ndarray]:
        async def requests():
            for i in range(12):
                a = np.full((1, 16), i, np.int32)
                yield {"model_name": "add_sub", "inputs": _add_sub_inputs(a, np.zeros_like(a)), "request_id": str(i)}

        outputs = {}
        async with aio_client.InferenceServerClient(url) as c:
            async for result, error in c.stream_infer(requests()):
                assert error is None, error
                outputs[result.get_response().id] = result.as_numpy("OUTPUT0")
                if len(outputs) == 12:
                    break
        return outputs

    outputs = asyncio.run(run())
    assert sorted(outputs, key=int) == [str(i) for i in range(12)]
    for key, value in outputs.items():
        np.testing.assert_array_equal(value, np.full((1, 16), int(key), np.int32))


# -- statistics, repository --------------------------------------------------------------------------------------
def test_inference_statistics_count_requests(client) -> None:
    before = client.get_inference_statistics("add_sub_fp32").model_stats[0]
    a = np.ones((1, 16), np.float32)
    for _ in range(3):
        client.infer("add_sub_fp32", _inputs({"INPUT0": a, "INPUT1": a}))
    with pytest.raises(InferenceServerException):
        client.infer("add_sub_fp32", _inputs({"INPUT0": a, "INPUT1": np.ones((1, 15), np.float32)}))
    after = client.get_inference_statistics("add_sub_fp32").model_stats[0]
    assert after.inference_stats.success.count == before.inference_stats.success.count + 3
    assert after.inference_count == before.inference_count + 3
    assert after.inference_stats.compute_infer.ns > before.inference_stats.compute_infer.ns
    as_json = client.get_inference_statistics(as_json=True)
    assert {s["name"] for s in as_json["model_stats"]} >= {"add_sub", "add_sub_fp32"}


def test_load_with_config_and_files_then_unload(client, grpc_server) -> None:
    model_bytes = _model_bytes(grpc_server, "add_sub_fp32")
    config = json.dumps({"name": "grpc_uploaded", "max_batch_size": 4,
                         "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [16]},
                                   {"name": "INPUT1", "data_type": "TYPE_FP32", "dims": [16]}]})
    client.load_model("grpc_uploaded", config=config, files={"file:1/model.onnx": model_bytes})
    assert client.is_model_ready("grpc_uploaded")
    assert client.get_model_config("grpc_uploaded").config.max_batch_size == 4
    a = np.arange(32, dtype=np.float32).reshape(2, 16)
    result = client.infer("grpc_uploaded", _inputs({"INPUT0": a, "INPUT1": a}))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + a)
    index = {m.name: m for m in client.get_model_repository_index().models}
    assert index["grpc_uploaded"].state == "READY" and index["grpc_uploaded"].version == "1"
    client.unload_model("grpc_uploaded")
    assert not client.is_model_ready("grpc_uploaded")
    with pytest.raises(InferenceServerException) as info:
        client.infer("grpc_uploaded", _inputs({"INPUT0": a, "INPUT1": a}))
    assert _status(info.value) == grpc.StatusCode.UNAVAILABLE
    index = {m["name"]: m for m in client.get_model_repository_index(as_json=True)["models"]}
    assert index["grpc_uploaded"]["state"] == "UNAVAILABLE" and index["grpc_uploaded"]["reason"] == "unloaded"


def test_repository_index_ready_filter(stub) -> None:
    everything = stub.RepositoryIndex(tpb.RepositoryIndexRequest()).models
    ready = stub.RepositoryIndex(tpb.RepositoryIndexRequest(ready=True)).models
    assert {m.name for m in ready} >= {"add_sub", "identity"} and all(m.state == "READY" for m in ready)
    assert [m for m in everything if m.state == "READY"] == list(ready)


def test_load_errors(client) -> None:
    with pytest.raises(InferenceServerException) as info:
        client.load_model("grpc_uploaded_bad", config=json.dumps({"max_batch_size": 1}),
                          files={"file:1/model.onnx": b"not an onnx model"})
    assert _status(info.value) == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(InferenceServerException) as info:
        client.load_model("no_such_model")
    assert _status(info.value) == grpc.StatusCode.NOT_FOUND
    index = {m.name: m for m in client.get_model_repository_index().models}
    assert index["grpc_uploaded_bad"].state == "UNAVAILABLE" and index["grpc_uploaded_bad"].reason
    assert client.is_server_live()


# -- shared memory ----------------------------------------------------------------------------------------------
def test_system_shared_memory_io(client) -> None:
    """Inputs read from and outputs written to POSIX shared memory made with tritonclient's helper."""
    a, b = ADD_SUB_INPUTS
    nbytes = a.nbytes
    handles = {name: shm.create_shared_memory_region(name, f"/{name}_{os.getpid()}", 2 * nbytes)
               for name in ("grpc_in", "grpc_out")}
    try:
        shm.set_shared_memory_region(handles["grpc_in"], [a, b])
        for name in handles:
            client.register_system_shared_memory(name, f"/{name}_{os.getpid()}", 2 * nbytes)
        with pytest.raises(InferenceServerException) as info:
            client.register_system_shared_memory("grpc_in", f"/grpc_in_{os.getpid()}", nbytes)
        assert _status(info.value) == grpc.StatusCode.ALREADY_EXISTS
        regions = client.get_system_shared_memory_status().regions
        assert {n: (r.key, r.byte_size) for n, r in regions.items() if n in handles} == {
            n: (f"/{n}_{os.getpid()}", 2 * nbytes) for n in handles}
        inputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"), grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_shared_memory("grpc_in", nbytes)
        inputs[1].set_shared_memory("grpc_in", nbytes, offset=nbytes)
        outputs = [grpcclient.InferRequestedOutput("OUTPUT0"), grpcclient.InferRequestedOutput("OUTPUT1")]
        outputs[0].set_shared_memory("grpc_out", nbytes)
        outputs[1].set_shared_memory("grpc_out", nbytes, offset=nbytes)
        response = client.infer("add_sub", inputs, outputs=outputs).get_response()
        assert [o.name for o in response.outputs] == ["OUTPUT0", "OUTPUT1"]
        assert response.outputs[1].parameters["shared_memory_byte_size"].int64_param == nbytes
        np.testing.assert_array_equal(shm.get_contents_as_numpy(handles["grpc_out"], np.int32, [1, 16]), a + b)
        np.testing.assert_array_equal(
            shm.get_contents_as_numpy(handles["grpc_out"], np.int32, [1, 16], offset=nbytes), a - b)
        client.unregister_system_shared_memory("grpc_in")
        assert "grpc_in" not in client.get_system_shared_memory_status().regions
        with pytest.raises(InferenceServerException) as info:
            client.get_system_shared_memory_status("grpc_in")
        assert _status(info.value) == grpc.StatusCode.NOT_FOUND
    finally:
        for name, handle in handles.items():
            client.unregister_system_shared_memory(name)
            shm.destroy_shared_memory_region(handle)
    assert not set(handles) & set(client.get_system_shared_memory_status().regions)


# -- settings -----------------------------------------------------------------------------------------------------
def test_trace_and_log_settings(client) -> None:
    global_before = client.get_trace_settings(as_json=True)["settings"]
    updated = client.update_trace_settings("add_sub", {"trace_rate": "7", "trace_level": ["TIMESTAMPS"]})
    assert list(updated.settings["trace_rate"].value) == ["7"]
    assert list(updated.settings["trace_level"].value) == ["TIMESTAMPS"]
    assert client.get_trace_settings(as_json=True)["settings"] == global_before
    reset = client.update_trace_settings("add_sub", {"trace_rate": None, "trace_level": None})
    assert list(reset.settings["trace_rate"].value) == global_before["trace_rate"]["value"]
    with pytest.raises(InferenceServerException) as info:
        client.update_trace_settings("add_sub", {"trace_rate": "fast"})
    assert _status(info.value) == grpc.StatusCode.INVALID_ARGUMENT

    before = client.get_log_settings().settings["log_verbose_level"].uint32_param
    logs = client.update_log_settings({"log_verbose_level": before + 1, "log_info": True})
    assert logs.settings["log_verbose_level"].uint32_param == before + 1 and logs.settings["log_info"].bool_param
    assert client.get_log_settings(as_json=True)["settings"]["log_verbose_level"]["uint32_param"] == before + 1
    client.update_log_settings({"log_verbose_level": before})
    with pytest.raises(InferenceServerException) as info:
        client.update_log_settings({"no_such_setting": True})
    assert _status(info.value) == grpc.StatusCode.INVALID_ARGUMENT


# -- errors ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model,arrays,code", [
    ("missing_model", None, grpc.StatusCode.NOT_FOUND),
    ("add_sub", {"INPUT0": np.zeros((1, 15), np.int32), "INPUT1": np.zeros((1, 15), np.int32)},
     grpc.StatusCode.INVALID_ARGUMENT),
    ("add_sub", {"INPUT0": np.zeros((1, 16), np.float32), "INPUT1": np.zeros((1, 16), np.float32)},
     grpc.StatusCode.INVALID_ARGUMENT),
    ("add_sub", {"INPUT0": np.zeros((1, 16), np.int32)}, grpc.StatusCode.INVALID_ARGUMENT),
    ("add_sub", {"INPUT0": np.zeros((9, 16), np.int32), "INPUT1": np.zeros((9, 16), np.int32)},
     grpc.StatusCode.INVALID_ARGUMENT),
])
def test_bad_requests_map_to_status_codes(client, model, arrays, code) -> None:
    inputs = _inputs(arrays) if arrays else _add_sub_inputs()
    with pytest.raises(InferenceServerException) as info:
        client.infer(model, inputs)
    assert _status(info.value) == code, info.value.message()
    np.testing.assert_array_equal(client.infer("add_sub", _add_sub_inputs()).as_numpy("OUTPUT0"), sum(ADD_SUB_INPUTS))


def test_unknown_model_metadata_and_version(client) -> None:
    """Triton's statuses (checked against tritonserver 2.51): metadata, config and inference of an unknown model or
    version are NOT_FOUND (inference even when its tensors are malformed too), readiness is plain false, and
    statistics are INVALID_ARGUMENT."""
    for call in (lambda: client.get_model_metadata("missing_model"), lambda: client.get_model_config("add_sub", "9"),
                 lambda: client.infer("missing_model", [grpcclient.InferInput("INPUT0", [1, 16], "FP32")])):
        with pytest.raises(InferenceServerException) as info:
            call()
        assert _status(info.value) == grpc.StatusCode.NOT_FOUND
        assert "Request for unknown model: " in info.value.message()
    assert client.is_model_ready("missing_model") is False and client.is_model_ready("add_sub", "9") is False
    for call, text in ((lambda: client.get_inference_statistics("missing_model"),
                        "requested model 'missing_model' is not available"),
                       (lambda: client.get_inference_statistics("add_sub", "9"),
                        "requested model version is not available for model 'add_sub'")):
        with pytest.raises(InferenceServerException) as info:
            call()
        assert _status(info.value) == grpc.StatusCode.INVALID_ARGUMENT and info.value.message() == text


def test_options_reach_the_server(grpc_server) -> None:
    """start_grpc_server options on a second, in-process server over the same repository: requests above
    max_message_size get RESOURCE_EXHAUSTED and the server keeps serving; gzip responses decode in the client;
    a stream with more requests than max_stream_inflight completes."""
    from server.core import CoreOptions, ServerCore
    from server.frontends.grpc import start_grpc_server

    limit = 1 << 20
    a = np.ones((4, 16), np.float32)
    big = np.zeros((limit // 64 + 16, 16), np.float32)

    async def run() -> np.ndarray:
        core = ServerCore(CoreOptions([str(grpc_server.repository)], model_control_mode="explicit",
                                      startup_models=["add_sub_fp32"]))
        await core.start()
        await core.wait_for_startup()
        port = free_port()
        server = await start_grpc_server(core, "127.0.0.1", port, max_message_size=limit, compression="gzip",
                                         max_stream_inflight=2)
        try:
            async with aio_client.InferenceServerClient(f"127.0.0.1:{port}") as c:
                with pytest.raises(InferenceServerException) as info:
                    await c.infer("add_sub_fp32", _inputs({"INPUT0": big, "INPUT1": big}))
                assert _status(info.value) == grpc.StatusCode.RESOURCE_EXHAUSTED

                async def requests():
                    for i in range(10):
                        yield {"model_name": "add_sub_fp32", "inputs": _inputs({"INPUT0": a * i, "INPUT1": a}),
                               "request_id": str(i)}

                seen = {}
                async for result, error in c.stream_infer(requests()):  # 10 requests through 2 slots
                    assert error is None, error
                    seen[int(result.get_response().id)] = float(result.as_numpy("OUTPUT0")[0, 0])
                    if len(seen) == 10:
                        break
                assert seen == {i: i + 1.0 for i in range(10)}
                return (await c.infer("add_sub_fp32", _inputs({"INPUT0": a, "INPUT1": a}))).as_numpy("OUTPUT0")
        finally:
            await server.stop(0)
            await core.stop()

    np.testing.assert_array_equal(asyncio.run(run()), a + a)


def test_options_are_validated() -> None:
    with pytest.raises(TypeError, match="max_msg_size"):
        GrpcOptions.from_kwargs(max_msg_size=1)
    with pytest.raises(ValueError, match="compression"):
        GrpcOptions.from_kwargs(compression="brotli")
    settings = GrpcOptions.from_kwargs(max_message_size=1024, keepalive_time_ms=5).http2_settings()
    assert settings.keepalive_time_s == 0.005


# -- standard services ----------------------------------------------------------------------------------------------
def test_health_service(url) -> None:
    with grpc.insecure_channel(url) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        serving = health_pb2.HealthCheckResponse.SERVING
        assert health.Check(health_pb2.HealthCheckRequest()).status == serving
        assert health.Check(health_pb2.HealthCheckRequest(service="inference.GRPCInferenceService")).status == serving
        with pytest.raises(grpc.RpcError) as info:
            health.Check(health_pb2.HealthCheckRequest(service="nope"))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        first = next(iter(health.Watch(health_pb2.HealthCheckRequest(), timeout=10)))
        assert first.status == serving


def test_server_reflection_lists_and_describes_services(url) -> None:
    reflection_pb2 = pytest.importorskip("grpc_reflection.v1alpha.reflection_pb2")
    reflection_grpc = pytest.importorskip("grpc_reflection.v1alpha.reflection_pb2_grpc")
    from google.protobuf import descriptor_pb2

    with grpc.insecure_channel(url) as channel:
        stub = reflection_grpc.ServerReflectionStub(channel)
        requests = [reflection_pb2.ServerReflectionRequest(list_services=""),
                    reflection_pb2.ServerReflectionRequest(file_containing_symbol="inference.GRPCInferenceService")]
        listed, described = list(stub.ServerReflectionInfo(iter(requests), timeout=10))
    names = {s.name for s in listed.list_services_response.service}
    assert {"inference.GRPCInferenceService", "grpc.health.v1.Health"} <= names
    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in described.file_descriptor_response.file_descriptor_proto]
    service = next(f for f in files if f.name == "grpc_service.proto").service[0]
    assert "ModelStreamInfer" in {m.name for m in service.method}
