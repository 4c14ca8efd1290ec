"""The HTTP frontend driven by the stock `tritonclient.http` (and `.aio`) against a real server process."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from .conftest import examples


@pytest.fixture(scope="module")
def client(kiln_server) -> httpclient.InferenceServerClient:
    with httpclient.InferenceServerClient(kiln_server.http_url, concurrency=4) as c:
        yield c


def _add_sub_inputs(a: np.ndarray, b: np.ndarray, binary: bool, datatype: str = "INT32"):
    inputs = [httpclient.InferInput("INPUT0", list(a.shape), datatype),
              httpclient.InferInput("INPUT1", list(b.shape), datatype)]
    inputs[0].set_data_from_numpy(a, binary_data=binary)
    inputs[1].set_data_from_numpy(b, binary_data=binary)
    return inputs


def _pair(batch: int, dtype=np.int32, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.integers(-1000, 1000, (batch, 16)).astype(dtype),
            rng.integers(-1000, 1000, (batch, 16)).astype(dtype))


# -- health and metadata ---------------------------------------------------------------------------------------
def test_health_and_server_metadata(client):
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("add_sub")
    assert client.is_model_ready("add_sub", "1")
    assert not client.is_model_ready("add_sub", "7")
    assert not client.is_model_ready("no_such_model")
    metadata = client.get_server_metadata()
    assert metadata["name"] == "kiln"
    assert {"binary_tensor_data", "classification", "model_repository", "statistics",
            "system_shared_memory", "trace", "logging"} <= set(metadata["extensions"])
    # cuda_shared_memory is listed only with a CUDA device: tests/server/test_cuda_shared_memory.py


def test_model_metadata_and_config(client):
    metadata = client.get_model_metadata("add_sub")
    assert metadata["name"] == "add_sub" and metadata["versions"] == ["1"]
    assert metadata["inputs"] == [{"name": "INPUT0", "datatype": "INT32", "shape": [-1, 16]},
                                  {"name": "INPUT1", "datatype": "INT32", "shape": [-1, 16]}]
    assert [o["name"] for o in metadata["outputs"]] == ["OUTPUT0", "OUTPUT1"]
    assert client.get_model_metadata("add_sub", "1") == metadata
    config = client.get_model_config("add_sub")
    assert config["max_batch_size"] == 8
    assert config["input"][0]["data_type"] == "TYPE_INT32" and config["input"][0]["dims"] == [16]
    assert config["instance_group"][0]["count"] == 2


def test_config_is_completed_from_the_onnx_graph(client):
    """add_sub_fp32 has no config.pbtxt: inputs, outputs, dims and max_batch_size come from the model."""
    config = client.get_model_config("add_sub_fp32")
    assert config["max_batch_size"] == 4  # the default, since the batch dim is symbolic
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [
        ("INPUT0", "TYPE_FP32", [16]), ("INPUT1", "TYPE_FP32", [16])]
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["output"]] == [
        ("OUTPUT0", "TYPE_FP32", [16]), ("OUTPUT1", "TYPE_FP32", [16])]
    assert config["version_policy"] == {"latest": {"num_versions": 1}}


# -- inference --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_infer_add_sub(client, binary):
    a, b = _pair(3)
    outputs = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("OUTPUT0", "OUTPUT1")]
    result = client.infer("add_sub", _add_sub_inputs(a, b, binary), outputs=outputs, request_id="req-42")
    assert result.get_response()["id"] == "req-42"
    assert result.get_response()["model_version"] == "1"
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    assert result.as_numpy("OUTPUT0").dtype == np.int32


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_infer_compressed_both_ways(client, algorithm):
    a, b = _pair(8, seed=1)
    result = client.infer("add_sub", _add_sub_inputs(a, b, True), request_compression_algorithm=algorithm,
                          response_compression_algorithm=algorithm)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


def test_requested_output_subset(client):
    a, b = _pair(2, seed=2)
    result = client.infer("add_sub", _add_sub_inputs(a, b, False),
                          outputs=[httpclient.InferRequestedOutput("OUTPUT1", binary_data=False)])
    assert [o["name"] for o in result.get_response()["outputs"]] == ["OUTPUT1"]
    assert result.as_numpy("OUTPUT0") is None
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


def test_infer_fp32_model_matches_numpy(client):
    a, b = _pair(4, np.float32, seed=3)
    a /= 7
    result = client.infer("add_sub_fp32", _add_sub_inputs(a, b, True, "FP32"))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


def test_async_infer_many_in_flight(client):
    pairs = [_pair(1 + i % 8, seed=10 + i) for i in range(8)]
    handles = [client.async_infer("add_sub", _add_sub_inputs(a, b, True)) for a, b in pairs]
    for (a, b), handle in zip(pairs, handles):
        result = handle.get_result()
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)


def test_aio_client(kiln_server):
    async def run() -> None:
        async with aiohttpclient.InferenceServerClient(kiln_server.http_url) as aio:
            assert await aio.is_server_ready()
            assert (await aio.get_model_metadata("add_sub"))["name"] == "add_sub"
            pairs = [_pair(2, seed=20 + i) for i in range(4)]
            requests = []
            for a, b in pairs:
                inputs = [aiohttpclient.InferInput("INPUT0", [2, 16], "INT32"),
                          aiohttpclient.InferInput("INPUT1", [2, 16], "INT32")]
                inputs[0].set_data_from_numpy(a)
                inputs[1].set_data_from_numpy(b)
                requests.append(aio.infer("add_sub", inputs, response_compression_algorithm="gzip"))
            for (a, b), result in zip(pairs, await asyncio.gather(*requests)):
                np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)

    asyncio.run(run())


def _cnn_input(batch: int) -> np.ndarray:
    return np.random.default_rng(5).standard_normal((batch, 3, 32, 32)).astype(np.float32)


def test_simple_cnn_matches_onnxruntime(client, kiln_server):
    x = _cnn_input(3)
    inputs = [httpclient.InferInput("INPUT", list(x.shape), "FP32")]
    inputs[0].set_data_from_numpy(x)
    probabilities = client.infer("simple_cnn", inputs).as_numpy("PROBABILITIES")
    model = onnx.load(kiln_server.repository / "simple_cnn" / "1" / "model.onnx")
    expected = ort.InferenceSession(model.SerializeToString()).run(None, {"INPUT": x})[0]
    assert probabilities.shape == (3, 10)
    np.testing.assert_allclose(probabilities, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-5)


def test_classification_extension_with_labels(client, kiln_server):
    x = _cnn_input(2)
    inputs = [httpclient.InferInput("INPUT", list(x.shape), "FP32")]
    inputs[0].set_data_from_numpy(x)
    plain = client.infer("simple_cnn", inputs).as_numpy("PROBABILITIES")
    outputs = [httpclient.InferRequestedOutput("PROBABILITIES", binary_data=False, class_count=3)]
    classes = client.infer("simple_cnn", inputs, outputs=outputs).as_numpy("PROBABILITIES")
    assert classes.shape == (2, 3)
    for row in range(2):
        top = np.argsort(-plain[row], kind="stable")[:3]
        entries = [c.decode() if isinstance(c, bytes) else c for c in classes[row]]
        parsed = [e.split(":") for e in entries]
        assert [int(p[1]) for p in parsed] == top.tolist()
        assert [p[2] for p in parsed] == [examples.CNN_LABELS[i] for i in top]
        np.testing.assert_allclose([float(p[0]) for p in parsed], plain[row][top], rtol=1e-5)


IDENTITY_NUMPY = {
    "BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
    "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "FP16": np.float16,
    "FP32": np.float32, "FP64": np.float64, "BF16": np.float32, "BYTES": np.object_,
}


def _identity_values(datatype: str) -> np.ndarray:
    if datatype == "BYTES":
        return np.array([b"kiln", "ünïcode".encode(), b"", b"x" * 40], dtype=np.object_)
    if datatype == "BOOL":
        return np.array([True, False, True, True])
    if datatype == "BF16":
        return np.array([1.5, -2.25, 0.0, 1024.0], dtype=np.float32)  # exact in bfloat16
    info = np.iinfo(IDENTITY_NUMPY[datatype]) if np.dtype(IDENTITY_NUMPY[datatype]).kind in "iu" else None
    values = [info.min, 0, 1, info.max] if info else [0.5, -3.25, 1e3, 6.0]
    return np.array(values, dtype=IDENTITY_NUMPY[datatype])


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_every_datatype_round_trips(client, binary):
    inputs, expected = [], {}
    for datatype in examples.IDENTITY_TYPES:
        values = _identity_values(datatype)
        tensor = httpclient.InferInput(f"IN_{datatype}", [4], datatype)
        # tritonclient sends BF16 only as binary; the JSON form is covered by the raw HTTP tests.
        tensor.set_data_from_numpy(values, binary_data=binary or datatype == "BF16")
        inputs.append(tensor)
        expected[f"OUT_{datatype}"] = values
    outputs = [httpclient.InferRequestedOutput(name, binary_data=binary or name == "OUT_BF16") for name in expected]
    result = client.infer("identity", inputs, outputs=outputs)
    for name, values in expected.items():
        got = result.as_numpy(name)
        if name == "OUT_BYTES":
            assert [bytes(v) if isinstance(v, bytes) else v.encode() for v in got] == list(values)
        else:
            np.testing.assert_array_equal(got, values)
            assert got.dtype == values.dtype, name


# -- statistics and metrics -------------------------------------------------------------------------------------
def _stats(client, model: str) -> dict:
    (stat,) = client.get_inference_statistics(model)["model_stats"]
    return stat


def test_statistics_count_requests_and_batches(client):
    before = _stats(client, "add_sub_fp32")
    for batch in (1, 3, 3):
        a, b = _pair(batch, np.float32)
        client.infer("add_sub_fp32", _add_sub_inputs(a, b, True, "FP32"))
    with pytest.raises(InferenceServerException):
        bad = httpclient.InferInput("INPUT0", [1, 15], "FP32")
        bad.set_data_from_numpy(np.zeros((1, 15), np.float32))
        client.infer("add_sub_fp32", [bad, _add_sub_inputs(*_pair(1, np.float32), True, "FP32")[1]])
    after = _stats(client, "add_sub_fp32")
    assert after["name"] == "add_sub_fp32" and after["version"] == "1"
    assert after["inference_count"] - before["inference_count"] == 7
    assert after["execution_count"] - before["execution_count"] == 3
    stats, old = after["inference_stats"], before["inference_stats"]
    assert stats["success"]["count"] - old["success"]["count"] == 3
    assert stats["fail"]["count"] - old["fail"]["count"] == 1
    for key in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert stats[key]["count"] - old[key]["count"] == 3
        assert stats[key]["ns"] > old[key]["ns"]
    batch3 = next(s for s in after["batch_stats"] if s["batch_size"] == 3)
    assert batch3["compute_infer"]["count"] >= 2
    assert after["last_inference"] >= int(time.time() * 1000) - 60_000
    everything = client.get_inference_statistics()["model_stats"]
    assert {"add_sub", "add_sub_fp32", "simple_cnn", "identity"} <= {s["name"] for s in everything}
    assert client.get_inference_statistics("add_sub_fp32", "1")["model_stats"][0]["version"] == "1"


def _metric(text: str, name: str, model: str) -> float:
    prefix = f'{name}{{model="{model}",version="1"}} '
    line = next(line for line in text.splitlines() if line.startswith(prefix))
    return float(line[len(prefix):])


def test_prometheus_metrics_follow_statistics(client, kiln_server):
    a, b = _pair(2, seed=7)
    client.infer("add_sub", _add_sub_inputs(a, b, True))
    text = httpx.get(kiln_server.metrics_url, timeout=5).text
    stat = _stats(client, "add_sub")
    assert "# TYPE nv_inference_request_success counter" in text
    assert _metric(text, "nv_inference_request_success", "add_sub") == stat["inference_stats"]["success"]["count"]
    assert _metric(text, "nv_inference_count", "add_sub") == stat["inference_count"]
    assert _metric(text, "nv_inference_exec_count", "add_sub") == stat["execution_count"]
    assert _metric(text, "nv_inference_compute_infer_duration_us", "add_sub") == \
        stat["inference_stats"]["compute_infer"]["ns"] // 1000
    for name in ("nv_inference_request_failure", "nv_inference_request_duration_us",
                 "nv_inference_queue_duration_us", "nv_inference_compute_input_duration_us",
                 "nv_inference_compute_output_duration_us"):
        assert _metric(text, name, "add_sub") >= 0
    assert _metric(text, "nv_inference_pending_request_count", "add_sub") == 0  # idle: nothing waits
    from prometheus_client.parser import text_string_to_metric_families

    families = {family.name: family for family in text_string_to_metric_families(text)}
    assert families["nv_inference_pending_request_count"].type == "gauge"
    assert {s.labels["priority"] for s in families["kiln_queue_depth"].samples} == {"1"}
    utilization = families["nv_cpu_utilization"].samples[0].value
    total = families["nv_cpu_memory_total_bytes"].samples[0].value
    assert 0.0 <= utilization <= 1.0 and 0 < families["nv_cpu_memory_used_bytes"].samples[0].value < total


# -- repository -------------------------------------------------------------------------------------------------
def _index(client) -> dict[str, dict]:
    return {m["name"]: m for m in client.get_model_repository_index()}


def test_repository_index(client):
    index = _index(client)
    assert index["add_sub"]["state"] == "READY" and index["add_sub"]["version"] == "1"
    assert {"add_sub", "add_sub_fp32", "simple_cnn", "identity"} <= set(index)


def test_load_with_config_override_and_unload(client, kiln_server):
    """Reload add_sub_fp32 under a config override (max_batch_size 2), then restore it."""
    override = {"max_batch_size": 2, "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [16]},
                                               {"name": "INPUT1", "data_type": "TYPE_FP32", "dims": [16]}]}
    try:
        client.load_model("add_sub_fp32", config=json.dumps(override))
        assert client.get_model_config("add_sub_fp32")["max_batch_size"] == 2
        with pytest.raises(InferenceServerException, match="batch"):
            client.infer("add_sub_fp32", _add_sub_inputs(*_pair(3, np.float32), True, "FP32"))
    finally:
        client.load_model("add_sub_fp32")
    assert client.get_model_config("add_sub_fp32")["max_batch_size"] == 4


def test_upload_load_infer_unload(client):
    """Load a model that exists only in the request (config + file contents), use it, unload it."""
    model = examples.add_sub_model(onnx.TensorProto.INT32).SerializeToString()
    client.load_model("uploaded_add", config=json.dumps({"max_batch_size": 8}),
                      files={"file:1/model.onnx": model})
    assert client.is_model_ready("uploaded_add")
    a, b = _pair(5, seed=9)
    result = client.infer("uploaded_add", _add_sub_inputs(a, b, True))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    assert _index(client)["uploaded_add"]["state"] == "READY"
    client.unload_model("uploaded_add")
    assert not client.is_model_ready("uploaded_add")
    assert _index(client)["uploaded_add"]["state"] == "UNAVAILABLE"
    with pytest.raises(InferenceServerException):
        client.infer("uploaded_add", _add_sub_inputs(a, b, True))


def test_invalid_model_load_fails_with_reason(client):
    with pytest.raises(InferenceServerException, match="not a valid ONNX model") as failure:
        client.load_model("broken_upload", config="{}", files={"file:1/model.onnx": b"this is not onnx"})
    assert failure.value.status() == "400"
    entry = _index(client)["broken_upload"]
    assert entry["state"] == "UNAVAILABLE" and "not a valid ONNX model" in entry["reason"]
    assert not client.is_model_ready("broken_upload")
    assert client.is_server_ready()  # a bad model loaded later does not take readiness away
    with pytest.raises(InferenceServerException, match="not in the model repository"):
        client.load_model("model_that_does_not_exist")


# -- shared memory ----------------------------------------------------------------------------------------------
def test_system_shared_memory_inputs_and_outputs(client):
    a, b = _pair(2, seed=11)
    size = a.nbytes
    handles = {}
    try:
        for name in ("kiln_in", "kiln_out"):
            handles[name] = shm.create_shared_memory_region(name, f"/{name}_{id(client)}", 2 * size)
        shm.set_shared_memory_region(handles["kiln_in"], [a, b])
        client.register_system_shared_memory("kiln_in", f"/kiln_in_{id(client)}", 2 * size)
        client.register_system_shared_memory("kiln_out", f"/kiln_out_{id(client)}", 2 * size)
        status = {r["name"]: r for r in client.get_system_shared_memory_status()}
        assert status["kiln_in"]["byte_size"] == 2 * size
        assert client.get_system_shared_memory_status("kiln_out")[0]["key"] == f"/kiln_out_{id(client)}"
        inputs = [httpclient.InferInput("INPUT0", [2, 16], "INT32"), httpclient.InferInput("INPUT1", [2, 16], "INT32")]
        inputs[0].set_shared_memory("kiln_in", size)
        inputs[1].set_shared_memory("kiln_in", size, offset=size)
        outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
                   httpclient.InferRequestedOutput("OUTPUT1", binary_data=True)]
        outputs[0].set_shared_memory("kiln_out", size)
        outputs[1].set_shared_memory("kiln_out", size, offset=size)
        result = client.infer("add_sub", inputs, outputs=outputs)
        written = result.get_output("OUTPUT0")
        assert "data" not in written and written["parameters"]["shared_memory_region"] == "kiln_out"
        np.testing.assert_array_equal(shm.get_contents_as_numpy(handles["kiln_out"], np.int32, [2, 16]), a + b)
        np.testing.assert_array_equal(
            shm.get_contents_as_numpy(handles["kiln_out"], np.int32, [2, 16], offset=size), a - b)
        with pytest.raises(InferenceServerException, match="already registered"):
            client.register_system_shared_memory("kiln_in", f"/kiln_in_{id(client)}", size)
    finally:
        client.unregister_system_shared_memory()
        for handle in handles.values():
            shm.destroy_shared_memory_region(handle)
    assert client.get_system_shared_memory_status() == []


# -- trace and log settings -------------------------------------------------------------------------------------
def test_trace_settings_trace_requests(client, tmp_path):
    trace_file = tmp_path / "trace.jsonl"
    settings = client.update_trace_settings("add_sub", {"trace_file": str(trace_file),
                                                        "trace_level": ["TIMESTAMPS"], "trace_rate": "1"})
    assert settings["trace_level"] == ["TIMESTAMPS"] and settings["trace_rate"] == "1"
    assert client.get_trace_settings()["trace_level"] == ["OFF"]  # global settings untouched
    try:
        for seed in range(2):
            client.infer("add_sub", _add_sub_inputs(*_pair(1, seed=seed), True), request_id=f"t{seed}")
    finally:
        cleared = client.update_trace_settings("add_sub", {"trace_file": None, "trace_level": None,
                                                           "trace_rate": None})
    assert cleared["trace_level"] == ["OFF"]
    records = [json.loads(line) for line in trace_file.read_text().splitlines()]
    assert [r["request_id"] for r in records] == ["t0", "t1"]
    names = [t["name"] for t in records[0]["timestamps"]]
    assert names[0] == "REQUEST_START" and names[-1] == "REQUEST_END"
    stamps = [t["ns"] for t in records[0]["timestamps"]]
    assert stamps == sorted(stamps)


def test_log_settings_are_applied(client, tmp_path):
    log_file = tmp_path / "server.log"
    original = client.get_log_settings()
    assert original["log_info"] is True
    updated = client.update_log_settings({"log_file": str(log_file), "log_verbose_level": 1})
    assert updated["log_file"] == str(log_file) and updated["log_verbose_level"] == 1
    try:
        client.load_model("add_sub_fp32")  # logs "successfully loaded" at INFO
        assert "successfully loaded model 'add_sub_fp32'" in Path(log_file).read_text()
        client.update_log_settings({"log_info": False, "log_verbose_level": 0})
        client.load_model("add_sub_fp32")
        assert Path(log_file).read_text().count("successfully loaded model 'add_sub_fp32'") == 1
    finally:
        client.update_log_settings({k: original[k] for k in ("log_file", "log_info", "log_verbose_level")})
    with pytest.raises(InferenceServerException):
        client.update_log_settings({"log_verbose_level": "loud"})


def _versioned_files() -> dict[str, bytes]:
    """Version 1 adds, version 2 multiplies (OUTPUT0), so the answer says which version ran."""
    v1 = examples.add_sub_model(onnx.TensorProto.INT32)
    v2 = examples.add_sub_model(onnx.TensorProto.INT32)
    v2.graph.node[0].op_type = "Mul"
    return {"file:1/model.onnx": v1.SerializeToString(), "file:2/model.onnx": v2.SerializeToString()}


@pytest.mark.parametrize("policy, served", [({}, ["2"]), ({"all": {}}, ["1", "2"]),
                                            ({"specific": {"versions": [1]}}, ["1"])],
                         ids=["latest", "all", "specific"])
def test_version_policy(client, policy, served):
    config = {"max_batch_size": 8, **({"version_policy": policy} if policy else {})}
    client.load_model("versioned", config=json.dumps(config), files=_versioned_files())
    try:
        assert client.get_model_metadata("versioned")["versions"] == served
        a, b = _pair(1, seed=12)
        for version in ("1", "2"):
            if version not in served:
                assert not client.is_model_ready("versioned", version)
                continue
            result = client.infer("versioned", _add_sub_inputs(a, b, True), model_version=version)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b if version == "1" else a * b)
        latest = client.infer("versioned", _add_sub_inputs(a, b, True))
        assert latest.get_response()["model_version"] == served[-1]
        assert [s["version"] for s in client.get_inference_statistics("versioned")["model_stats"]] == served
    finally:
        client.unload_model("versioned")
