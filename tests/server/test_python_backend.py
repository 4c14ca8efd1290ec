"""Python models (Triton's Python backend: server/core/python_model.py, python_stub.py, server/python_backend/): a
real server runs Triton's own examples (add_sub, BLS sync and async, auto_complete; unmodified, in python_models/
or, for those Kiln ships, examples/triton_examples) and test models, driven by the stock tritonclient over HTTP and gRPC and checked against numpy. Dynamic
batching hands execute() several requests; a model that raises, answers an error, dies (exit, segfault) or hangs
fails only its own requests and its stub is restarted; a failing initialize fails the load with its traceback;
EXECUTION_ENV_PATH runs the stub with another interpreter. pb_utils itself is checked in-process."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from server.python_backend import triton_python_backend_utils as pb_utils
from server.python_backend import wire

from .conftest import examples, require_grpc, run_server

TRITON_EXAMPLES = Path(__file__).parent / "python_models"  # from triton-inference-server/python_backend examples/
KILN_EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "python_models"
#: Triton's examples that Kiln ships as a model repository: read from there, not kept twice
SHIPPED = {"add_sub": "add_sub", "bls_sync": "bls_sync", "repeat": "repeat_int32", "square": "square_int32"}
SHIPPED_REPOSITORY = Path(__file__).resolve().parents[2] / "examples" / "triton_examples"


def triton_example(stem: str) -> tuple[str, str | None]:
    """Triton's example `stem` (add_sub, bls_sync, repeat, square, ...): its model.py and config.pbtxt (None
    where the example has none)."""
    if stem in SHIPPED:
        directory = SHIPPED_REPOSITORY / SHIPPED[stem]
        return (directory / "1" / "model.py").read_text(), (directory / "config.pbtxt").read_text()
    config = TRITON_EXAMPLES / f"{stem}_config.pbtxt"
    return (TRITON_EXAMPLES / f"{stem}_model.py").read_text(), config.read_text() if config.is_file() else None
#: what server/python_backend may import (the standard library's modules it uses, and numpy)
STUB_IMPORTS = {"__future__", "asyncio", "collections", "enum", "importlib", "itertools", "json", "numpy", "os",
                "pathlib", "pickle", "queue", "signal", "socket", "struct", "sys", "threading", "traceback", "types",
                "typing"}

BATCHED = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            count = np.full((x.shape[0], 1), len(requests), dtype=np.int32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 2), pb_utils.Tensor("BATCH", count)]))
        return responses
'''
BATCHED_CONFIG = '''name: "batched"
backend: "python"
max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "BATCH" data_type: TYPE_INT32 dims: [ 1 ] } ]
dynamic_batching { max_queue_delay_microseconds: 300000 }
instance_group [ { kind: KIND_CPU count: 1 } ]
'''

FAILING = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if (x < 0).any():
                raise ValueError("negative input: this model takes none")
            if (x == 0).all():
                error = pb_utils.TritonError("all zeros is not a valid input", pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x + 1)]))
        return responses
'''
FP32_4 = ('backend: "python"\ninput [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
          'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]\n')

CRASHY = '''
import ctypes
import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if x[0] == 1:
                os._exit(3)
            if x[0] == 2:
                ctypes.string_at(0)  # a segfault
            pid = np.array([os.getpid()], dtype=np.int64)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("PID", pid)]))
        return responses
'''
CRASHY_CONFIG = ('backend: "python"\ninput [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
                 'output [ { name: "PID" data_type: TYPE_INT64 dims: [ 1 ] } ]\n')

SLOW = '''
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        x = pb_utils.get_input_tensor_by_name(requests[0], "X").as_numpy()
        time.sleep(float(x[0]))
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)])]
'''
SLOW_CONFIG = FP32_4 + 'parameters { key: "kiln_execution_timeout_ms" value { string_value: "1000" } }\n'

INIT_FAILS = '''
class TritonPythonModel:
    def initialize(self, args):
        raise ValueError("cannot find the weights in " + args["model_repository"])

    def execute(self, requests):
        return []
'''

TEXT = '''
import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.args = args

    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
            upper = np.array([t.upper() for t in text.reshape(-1)], dtype=object).reshape(text.shape)
            info = {"id": request.request_id(), "correlation_id": request.correlation_id(),
                    "parameters": json.loads(request.parameters()), "requested": request.requested_output_names(),
                    "args": {k: v for k, v in self.args.items() if k != "model_config"},
                    "model_dir": pb_utils.get_model_dir(), "env": __import__("os").environ.get("KILN_TEST_ENV", ""),
                    "config_name": json.loads(self.args["model_config"])["name"]}
            pb_utils.Logger.log_info("text model answered request " + request.request_id())
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("UPPER", upper),
                                                         pb_utils.Tensor("INFO", np.array([json.dumps(info)]))]))
        return responses

    def finalize(self):
        Path(self.args["model_repository"], "finalized").write_text(self.args["model_instance_name"])
'''
TEXT_CONFIG = ('backend: "python"\ninput [ { name: "TEXT" data_type: TYPE_STRING dims: [ -1 ] } ]\n'
               'output [ { name: "UPPER" data_type: TYPE_STRING dims: [ -1 ] },'
               ' { name: "INFO" data_type: TYPE_STRING dims: [ 1 ] } ]\n')

WARMUP = 'model_warmup [ {{ name: "{kind}" batch_size: 1 inputs {{ key: "X" value {{ data_type: TYPE_FP32 dims: [ 4 ] ' \
         '{kind}: true }} }} }} ]\n'
# Python models whose load fails, and a text the failure must contain.
REFUSED = {
    "py_sequence_state": (FAILING, FP32_4 + 'sequence_batching { state [ { input_name: "S" output_name: "T" '
                                            'data_type: TYPE_INT32 dims: [ 1 ] } ] }\n',
                          "Kiln does not yet keep implicit state for Python models"),
    "py_precision": (FAILING, FP32_4 + 'parameters { key: "kiln_precision" value { string_value: "fp16" } }\n',
                     "parameter kiln_precision is about the plan Kiln builds for an ONNX model"),
    "py_no_type": (FAILING, 'backend: "python"\ninput [ { name: "X" dims: [ 4 ] } ]\n', "input 'X' has no data_type"),
    "py_no_file": (None, FP32_4, "'model.py' is missing in"),
    "py_no_class": ("X = 1\n", FP32_4, "defines no class TritonPythonModel"),
    "py_warmup_fails": (FAILING, FP32_4 + WARMUP.format(kind="zero_data"),
                        "warmup sample 'zero_data' failed: all zeros is not a valid input"),
}

# The Python add_sub example, then the ONNX one on its results: S = 2A, D = 2B.
ENSEMBLE = '''name: "ens_mixed"
platform: "ensemble"
input [ { name: "A" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "B" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "S" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "D" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [
  { model_name: "add_sub" model_version: -1 input_map { key: "INPUT0" value: "A" } input_map { key: "INPUT1" value: "B" }
    output_map { key: "OUTPUT0" value: "sum" } output_map { key: "OUTPUT1" value: "diff" } },
  { model_name: "add_sub_onnx" model_version: -1 input_map { key: "INPUT0" value: "sum" }
    input_map { key: "INPUT1" value: "diff" } output_map { key: "OUTPUT0" value: "S" } output_map { key: "OUTPUT1" value: "D" } }
] }
'''

STARTUP = ["add_sub", "add_sub_onnx", "pytorch", "bls_sync", "bls_async", "batch_auto_complete",
           "nobatch_auto_complete", "batched", "failing", "crashy", "slow", "text", "in_env", "simple_cnn",
           "classify_image", "ens_mixed"]


def add_sub_4() -> onnx.ModelProto:
    """OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1 on FP32 [4], no batch dim: the shapes Triton's Python
    examples send."""
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4]) for n in ("INPUT0", "INPUT1")]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4]) for n in ("OUTPUT0", "OUTPUT1")]
    nodes = [helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
             helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"])]
    model = helper.make_model(helper.make_graph(nodes, "add_sub_4", io, outs),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def write_python_model(repo: Path, name: str, source: str, config: str | None = None) -> Path:
    directory = repo / name
    (directory / "1").mkdir(parents=True, exist_ok=True)
    (directory / "1" / "model.py").write_text(source)
    if config is not None:
        (directory / "config.pbtxt").write_text(config if "name:" in config else f'name: "{name}"\n{config}')
    return directory


def _triton_example(repo: Path, name: str, stem: str) -> None:
    write_python_model(repo, name, *triton_example(stem))


def _python_env(directory: Path, options: str = "") -> None:
    """A Python environment as EXECUTION_ENV_PATH wants one (a directory with bin/python): here a wrapper around
    this interpreter that marks the environment, so the model can tell which Python runs it."""
    python = directory / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexport KILN_TEST_ENV=wrapped\nexec "{sys.executable}" {options} "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = tmp_path_factory.mktemp("python_backend")
    repo = base / "models"
    _triton_example(repo, "add_sub", "add_sub")
    _triton_example(repo, "bls_sync", "bls_sync")
    _triton_example(repo, "bls_async", "bls_async")
    _triton_example(repo, "batch_auto_complete", "auto_complete_batch")  # no config.pbtxt at all
    _triton_example(repo, "nobatch_auto_complete", "auto_complete_nobatch")
    onnx_config = 'max_batch_size: 0\ninstance_group [ { kind: KIND_CPU } ]\n'
    examples.write_model(repo, "add_sub_onnx", add_sub_4(), f'name: "add_sub_onnx"\n{onnx_config}')
    examples.write_model(repo, "pytorch", add_sub_4(), f'name: "pytorch"\n{onnx_config}')  # BLS async calls it
    write_python_model(repo, "batched", BATCHED, BATCHED_CONFIG)
    (repo / "ens_mixed" / "1").mkdir(parents=True)
    (repo / "ens_mixed" / "config.pbtxt").write_text(ENSEMBLE)
    examples.write_model(repo, "simple_cnn", examples.cnn_model(), examples.CNN_CONFIG,
                         {"labels.txt": "\n".join(examples.CNN_LABELS) + "\n"})
    shutil.copytree(KILN_EXAMPLES / "classify_image", repo / "classify_image")
    write_python_model(repo, "failing", FAILING, FP32_4)
    write_python_model(repo, "crashy", CRASHY, CRASHY_CONFIG)
    write_python_model(repo, "slow", SLOW, SLOW_CONFIG)
    write_python_model(repo, "init_fails", INIT_FAILS, FP32_4)
    write_python_model(repo, "text", TEXT, TEXT_CONFIG)
    write_python_model(repo, "final", TEXT, TEXT_CONFIG)
    env_param = 'parameters { key: "EXECUTION_ENV_PATH" value { string_value: "$$TRITON_MODEL_DIRECTORY/env" } }\n'
    _python_env(write_python_model(repo, "in_env", TEXT, TEXT_CONFIG + env_param) / "env")
    packed = write_python_model(repo, "packed_env", TEXT, TEXT_CONFIG + env_param.replace("/env", "/env.tar.gz"))
    (packed / "env.tar.gz").write_bytes(b"")
    write_python_model(repo, "no_env", TEXT, TEXT_CONFIG + env_param.replace("/env", "/missing"))
    _python_env(write_python_model(repo, "no_numpy", TEXT, TEXT_CONFIG + env_param) / "env", "-S")  # no site-packages
    write_python_model(repo, "warm", FAILING, FP32_4 + WARMUP.format(kind="random_data"))
    for name, (source, config, _) in REFUSED.items():
        directory = write_python_model(repo, name, source or "", config)
        if source is None:
            (directory / "1" / "model.py").unlink()
    with run_server(repo, base / "server.log", STARTUP) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> httpclient.InferenceServerClient:
    with httpclient.InferenceServerClient(server.http_url) as c:
        yield c


def _url(protocol, server) -> str:
    return require_grpc(server).grpc_url if protocol is grpcclient else server.http_url


def _infer(protocol, server, model: str, arrays: dict[str, np.ndarray], outputs: list[str] | None = None, **kwargs):
    with protocol.InferenceServerClient(_url(protocol, server)) as client:
        inputs = []
        for name, array in arrays.items():
            datatype = "BYTES" if array.dtype == object else {"float32": "FP32", "int32": "INT32"}[array.dtype.name]
            inputs.append(protocol.InferInput(name, list(array.shape), datatype))
            inputs[-1].set_data_from_numpy(array)
        requested = [protocol.InferRequestedOutput(name) for name in outputs] if outputs else None
        return client.infer(model, inputs, outputs=requested, **kwargs)


def _pair(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal(4).astype(np.float32), rng.standard_normal(4).astype(np.float32)


PROTOCOLS = pytest.mark.parametrize("protocol", [httpclient, grpcclient], ids=["http", "grpc"])


# -- Triton's examples ----------------------------------------------------------------------------------------------
@PROTOCOLS
def test_add_sub_example_matches_numpy(server, protocol):
    a, b = _pair()
    result = _infer(protocol, server, "add_sub", {"INPUT0": a, "INPUT1": b})
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


@PROTOCOLS
@pytest.mark.parametrize("target", ["add_sub_onnx", "pytorch", "add_sub"])
def test_bls_sync_example_calls_the_model_it_is_told(server, protocol, target):
    """Triton's sync BLS example: exec() on the ONNX add_sub (and on the Python add_sub: Python to Python)."""
    a, b = _pair(1)
    result = _infer(protocol, server, "bls_sync", {"MODEL_NAME": np.array([target.encode()], dtype=object),
                                                   "INPUT0": a, "INPUT1": b})
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), a + b, rtol=1e-6)
    np.testing.assert_allclose(result.as_numpy("OUTPUT1"), a - b, rtol=1e-6)


@PROTOCOLS
def test_bls_async_example_awaits_two_models_at_once(server, protocol):
    """Triton's async BLS example: an `async def execute` awaiting async_exec() on 'pytorch' (here the ONNX add_sub)
    and 'add_sub' (the Python example) together."""
    a, b = _pair(2)
    result = _infer(protocol, server, "bls_async", {"INPUT0": a, "INPUT1": b})
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), a + b, rtol=1e-6)
    np.testing.assert_allclose(result.as_numpy("OUTPUT1"), a - b, rtol=1e-6)


def test_bls_error_comes_back_on_the_response(server):
    """A BLS request to an unknown model answers an error response; the example raises it as
    TritonModelException, which fails the request with the core's message."""
    a, b = _pair(3)
    with pytest.raises(InferenceServerException) as failure:
        _infer(httpclient, server, "bls_sync", {"MODEL_NAME": np.array([b"missing"], dtype=object),
                                                "INPUT0": a, "INPUT1": b})
    message = str(failure.value)
    assert "Failed to process the request(s) for model 'bls_sync_0_0'" in message
    assert "Request for unknown model: 'missing' is not found" in message and "TritonModelException" in message


def test_auto_complete_config_examples(client):
    """What Triton's auto_complete client checks: max_batch_size, inputs and outputs from auto_complete_config
    (there is no config.pbtxt), and dynamic batching where the model asks for it."""
    expected_io = [{"name": f"{role}{i}", "data_type": "TYPE_FP32", "dims": [4]}
                   for role in ("INPUT", "OUTPUT") for i in (0, 1)]
    for name, batch in (("nobatch_auto_complete", 0), ("batch_auto_complete", 4)):
        config = client.get_model_config(name)
        assert config["max_batch_size"] == batch and config["backend"] == "python"
        found = [{k: t[k] for k in ("name", "data_type", "dims")} for t in config["input"] + config["output"]]
        assert found == expected_io, name
        assert ("dynamic_batching" in config) == (batch > 0)
    a, b = _pair(4)
    result = client.infer("batch_auto_complete", _http_inputs({"INPUT0": a[None], "INPUT1": b[None]}))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), (a + b)[None])


def _concurrently(server, calls: list[tuple[str, dict[str, np.ndarray]]]) -> list:
    """The calls (model, FP32 inputs) in flight together over HTTP (tritonclient's asyncio client)."""
    async def scenario():
        async with aiohttpclient.InferenceServerClient(server.http_url) as client:
            return await asyncio.gather(*(client.infer(model, _http_inputs(arrays, aiohttpclient))
                                          for model, arrays in calls))

    return asyncio.run(scenario())


def _http_inputs(arrays: dict[str, np.ndarray], protocol=httpclient) -> list:
    inputs = []
    for name, array in arrays.items():
        inputs.append(protocol.InferInput(name, list(array.shape), "FP32"))
        inputs[-1].set_data_from_numpy(array)
    return inputs


@PROTOCOLS
def test_a_python_model_as_an_ensemble_step(server, protocol):
    a, b = _pair(8)
    result = _infer(protocol, server, "ens_mixed", {"A": a, "B": b})
    np.testing.assert_allclose(result.as_numpy("S"), (a + b) + (a - b), rtol=1e-6)
    np.testing.assert_allclose(result.as_numpy("D"), (a + b) - (a - b), rtol=1e-6)


def test_the_preprocessing_example_in_front_of_simple_cnn(client):
    """examples/python_models/classify_image: uint8 images, normalized in Python, classified by the ONNX simple_cnn
    through BLS; the same as preprocessing them with numpy and asking simple_cnn directly."""
    images = np.random.default_rng(7).integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
    tensor = httpclient.InferInput("IMAGE", list(images.shape), "UINT8")
    tensor.set_data_from_numpy(images)
    result = client.infer("classify_image", [tensor])
    normalized = ((images.astype(np.float32) / 255.0 - 0.5) / 0.25).transpose(0, 3, 1, 2)
    probabilities = client.infer("simple_cnn", _http_inputs({"INPUT": np.ascontiguousarray(normalized)})) \
        .as_numpy("PROBABILITIES")
    top = probabilities.argmax(axis=1)
    assert [label.decode() for label in result.as_numpy("LABEL")[:, 0]] == [examples.CNN_LABELS[i] for i in top]
    np.testing.assert_allclose(result.as_numpy("SCORE")[:, 0], probabilities.max(axis=1), rtol=1e-6)


# -- batching, requests, tensors ------------------------------------------------------------------------------------
def test_dynamic_batching_gives_execute_several_requests(server, client):
    before = client.get_inference_statistics("batched")["model_stats"][0]
    rows = [np.full((1 + i % 2, 4), i, dtype=np.float32) for i in range(6)]
    results = _concurrently(server, [("batched", {"X": x}) for x in rows])
    for x, result in zip(rows, results):
        np.testing.assert_array_equal(result.as_numpy("Y"), x * 2)  # each request gets its own rows back
    assert max(int(r.as_numpy("BATCH").max()) for r in results) > 1  # one execute() saw several requests
    stats = client.get_inference_statistics("batched")["model_stats"][0]
    requests = stats["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"]
    executions = stats["execution_count"] - before["execution_count"]
    assert requests == len(rows) and 0 < executions < len(rows)
    assert stats["inference_count"] - before["inference_count"] == sum(len(x) for x in rows)


@PROTOCOLS
def test_bytes_request_id_parameters_and_requested_outputs(server, protocol):
    text = np.array([b"kiln", b"py \x00 bytes"], dtype=object)
    result = _infer(protocol, server, "text", {"TEXT": text}, request_id="r-17", parameters={"answer": 42})
    assert list(result.as_numpy("UPPER")) == [b"KILN", b"PY \x00 BYTES"]
    info = json.loads(result.as_numpy("INFO")[0])
    assert info["id"] == "r-17" and info["parameters"] == {"answer": 42}
    assert info["requested"] == ["UPPER", "INFO"] and info["correlation_id"] == 0
    assert info["args"]["model_name"] == "text" and info["args"]["model_version"] == "1"
    assert info["args"]["model_instance_kind"] == "CPU" and info["args"]["model_instance_name"] == "text_0_0"  # Triton: <model>_<group>_<n>
    assert info["args"]["model_instance_device_id"] == "0" and info["config_name"] == "text"
    assert info["args"]["model_repository"].endswith("/text") and info["model_dir"].endswith("/text/1")
    only = _infer(protocol, server, "text", {"TEXT": text}, outputs=["UPPER"])
    assert only.as_numpy("INFO") is None and list(only.as_numpy("UPPER")) == [b"KILN", b"PY \x00 BYTES"]


def test_logger_lines_reach_the_server_log(server):
    _infer(httpclient, server, "text", {"TEXT": np.array([b"log me"], dtype=object)}, request_id="logged-1")
    deadline = time.monotonic() + 5
    while "text_0_0: text model answered request logged-1" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "text_0_0: text model answered request logged-1" in server.log()


def test_statistics_and_metrics_count_python_models(server, client):
    a, b = _pair(5)
    before = client.get_inference_statistics("add_sub")["model_stats"][0]["inference_stats"]["success"]["count"]
    for _ in range(3):
        client.infer("add_sub", _http_inputs({"INPUT0": a, "INPUT1": b}))
    stats = client.get_inference_statistics("add_sub")["model_stats"][0]
    assert stats["inference_stats"]["success"]["count"] == before + 3 and stats["execution_count"] >= 3
    assert stats["inference_stats"]["compute_infer"]["ns"] > 0
    metrics = httpx.get(server.metrics_url).text
    assert 'nv_inference_request_success{model="add_sub",version="1"}' in metrics
    metadata = client.get_model_metadata("add_sub")
    assert metadata["platform"] == "python" and [i["name"] for i in metadata["inputs"]] == ["INPUT0", "INPUT1"]


# -- failures -------------------------------------------------------------------------------------------------------
@PROTOCOLS
def test_exception_in_execute_fails_that_request_and_the_server_serves_on(server, protocol):
    with pytest.raises(InferenceServerException) as failure:
        _infer(protocol, server, "failing", {"X": -np.ones(4, np.float32)})
    message = str(failure.value)
    assert "Failed to process the request(s) for model 'failing_0_0', message: ValueError: negative input" \
           in message
    assert "model.py" in message and "execute" in message  # the traceback's frames, as Triton gives them
    x = np.arange(4, dtype=np.float32) + 1
    np.testing.assert_array_equal(_infer(protocol, server, "failing", {"X": x}).as_numpy("Y"), x + 1)


def test_error_response_fails_its_request_with_its_code(server):
    response = httpx.post(f"{server.base_url}/v2/models/failing/infer", json={
        "inputs": [{"name": "X", "shape": [4], "datatype": "FP32", "data": [0, 0, 0, 0]}]})
    assert response.status_code == 400 and response.json() == {"error": "all zeros is not a valid input"}


def _pid(server, protocol=httpclient) -> int:
    return int(_infer(protocol, server, "crashy", {"X": np.array([0], np.int32)}).as_numpy("PID")[0])


@pytest.mark.parametrize(("trigger", "how"), [(1, "exited with code 3"), (2, "was killed by SIGSEGV")],
                         ids=["exit", "segfault"])
def test_a_stub_that_dies_fails_its_requests_and_is_restarted(server, trigger, how):
    first = _pid(server)
    pending = ThreadPoolExecutor(1).submit(  # another model's request in flight meanwhile is not lost
        httpx.post, f"{server.base_url}/v2/models/batched/infer", timeout=30,
        json={"inputs": [{"name": "X", "shape": [1, 4], "datatype": "FP32", "data": [1, 1, 1, 1]}]})
    with pytest.raises(InferenceServerException) as failure:
        _infer(httpclient, server, "crashy", {"X": np.array([trigger], np.int32)})
    message = str(failure.value)
    assert f"Stub process 'crashy_0_0' is not healthy: it {how}" in message and "restarted" in message
    second = _pid(server)  # waits for the restart if it is still under way
    assert second != first
    outputs = {o["name"]: o["data"] for o in pending.result(timeout=30).json()["outputs"]}
    assert outputs["Y"] == [2, 2, 2, 2]
    assert _infer(httpclient, server, "add_sub", dict(zip(("INPUT0", "INPUT1"), _pair()))).as_numpy("OUTPUT0") \
        is not None
    assert f"model instance 'crashy_0_0': its stub {how}" in server.log()


def test_a_stub_that_dies_while_idle_is_restarted_before_the_next_request(server):
    """Killed between requests (as the OOM killer would): restarted at once, and the next request succeeds."""
    first = _pid(server)
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while "its stub was killed by SIGKILL" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "model instance 'crashy_0_0': its stub was killed by SIGKILL (signal 9); restarting it" in server.log()
    assert _pid(server) != first


def test_an_execution_past_its_timeout_kills_the_stub_and_the_next_one_runs(server):
    started = time.monotonic()
    with pytest.raises(InferenceServerException) as failure:
        _infer(httpclient, server, "slow", {"X": np.full(4, 30, np.float32)})
    assert time.monotonic() - started < 20
    assert "ran execute longer than 1000 ms (kiln_execution_timeout_ms) and was killed" in str(failure.value)
    x = np.zeros(4, np.float32)
    np.testing.assert_array_equal(_infer(httpclient, server, "slow", {"X": x}).as_numpy("Y"), x)


def test_initialize_raising_fails_the_load_with_its_traceback(client):
    with pytest.raises(InferenceServerException) as failure:
        client.load_model("init_fails")
    message = str(failure.value)
    assert "load failed for model 'init_fails'" in message and "initialize of instance 'init_fails_0_0' failed" in message
    assert "ValueError: cannot find the weights in " in message and "model.py(4): initialize" in message
    entry = next(m for m in client.get_model_repository_index() if m["name"] == "init_fails")
    assert entry["state"] == "UNAVAILABLE" and "ValueError: cannot find the weights" in entry["reason"]
    assert client.is_server_ready() and client.is_model_ready("add_sub")


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_python_config_kiln_cannot_serve_fails_the_load_with_the_reason(client, name):
    with pytest.raises(InferenceServerException) as failure:
        client.load_model(name)
    assert f"load failed for model '{name}'" in str(failure.value) and REFUSED[name][2] in str(failure.value)
    assert client.is_server_ready()


def test_model_warmup_runs_before_the_model_is_ready(client):
    client.load_model("warm")
    stats = client.get_inference_statistics("warm")["model_stats"][0]
    assert stats["inference_count"] == 0  # warm-up is not counted, as in Triton
    x = np.full(4, 2, np.float32)
    np.testing.assert_array_equal(client.infer("warm", _http_inputs({"X": x})).as_numpy("Y"), x + 1)


# -- environments, unloading ----------------------------------------------------------------------------------------
def test_execution_env_path_runs_the_stub_with_that_python(server):
    info = json.loads(_infer(httpclient, server, "in_env", {"TEXT": np.array([b"x"], dtype=object)})
                      .as_numpy("INFO")[0])
    assert info["env"] == "wrapped"


@pytest.mark.parametrize(("name", "text"), [
    ("packed_env", "EXECUTION_ENV_PATH '{models}/packed_env/env.tar.gz' is a packed environment"),
    ("no_env", "EXECUTION_ENV_PATH '{models}/no_env/missing' has no bin/python"),
    ("no_numpy", "the stub could not import triton_python_backend_utils with {python}"),
])
def test_execution_env_path_that_cannot_run_fails_the_load(server, client, name, text):
    with pytest.raises(InferenceServerException) as failure:
        client.load_model(name)
    assert text.format(models=server.repository.resolve(), python=sys.executable) in str(failure.value)
    if name == "no_numpy":
        assert "No module named 'numpy'" in str(failure.value)


def test_unload_runs_finalize_and_stops_the_stubs(server, client):
    client.load_model("final")
    marker = server.repository / "final" / "finalized"
    assert client.infer("final", [_text_input("hello")]).as_numpy("UPPER")[0] == b"HELLO"
    client.unload_model("final")
    deadline = time.monotonic() + 15
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.read_text() == "final_0_0"


def _text_input(text: str) -> httpclient.InferInput:
    tensor = httpclient.InferInput("TEXT", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([text.encode()], dtype=object))
    return tensor


# -- pb_utils in-process ----------------------------------------------------------------------------------------------
def test_tensor_numpy_dlpack_and_bytes():
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    tensor = pb_utils.Tensor("T", array[:, ::2])  # not contiguous: made contiguous, as Triton does
    assert tensor.name() == "T" and tensor.shape() == [2, 2] and tensor.as_numpy().flags.c_contiguous
    assert tensor.triton_dtype() == 11 and tensor.is_cpu()
    back = pb_utils.Tensor.from_dlpack("U", tensor.to_dlpack())
    np.testing.assert_array_equal(back.as_numpy(), array[:, ::2])
    shared = pb_utils.Tensor.from_dlpack("V", array)  # an object with __dlpack__: the same memory
    assert np.shares_memory(shared.as_numpy(), array)
    with pytest.raises(pb_utils.TritonModelException, match="string tensors"):
        pb_utils.Tensor("S", np.array([b"a"], dtype=object)).to_dlpack()
    with pytest.raises(pb_utils.TritonModelException, match="empty string"):
        pb_utils.Tensor("", array)
    encoded = pb_utils.serialize_byte_tensor(np.array([b"ab", "c"], dtype=object))
    assert list(pb_utils.deserialize_bytes_tensor(encoded)) == [b"ab", b"c"]


def test_requests_responses_and_errors():
    x = pb_utils.Tensor("X", np.ones(2, np.int32))
    request = pb_utils.InferenceRequest(model_name=b"m", requested_output_names=["Y"], inputs=[x],
                                        parameters={"k": "v", "n": 1})
    assert request._model_name == "m" and pb_utils.get_input_tensor_by_name(request, "X") is x
    assert json.loads(request.parameters()) == {"k": "v", "n": 1} and request.requested_output_names() == ["Y"]
    with pytest.raises(pb_utils.TritonModelException, match="bool/int/str"):
        pb_utils.InferenceRequest(model_name="m", requested_output_names=[], inputs=[], parameters={"f": 1.5})
    with pytest.raises(pb_utils.TritonModelException, match="Correlation ID"):
        pb_utils.InferenceRequest(model_name="m", requested_output_names=[], inputs=[], correlation_id=1.5)
    with pytest.raises(pb_utils.TritonModelException, match="inside a Python model"):
        request.exec()
    error = pb_utils.TritonError("nope", pb_utils.TritonError.NOT_FOUND)
    response = pb_utils.InferenceResponse(error=error)
    assert response.has_error() and response.error().message() == "nope" and response.error().code() == 2
    ok = pb_utils.InferenceResponse([x])
    assert not ok.has_error() and pb_utils.get_output_tensor_by_name(ok, "X") is x
    assert pb_utils.get_output_tensor_by_name(ok, "Z") is None


def test_model_config_helpers_follow_triton():
    config = pb_utils.ModelConfig(json.dumps({"name": "m", "max_batch_size": 0, "input": [
        {"name": "A", "data_type": "TYPE_FP32", "dims": [4]}], "output": []}))
    config.add_input({"name": "A", "data_type": "TYPE_FP32", "dims": [4]})  # the same again: kept once
    config.add_output({"name": "B", "data_type": "TYPE_INT32", "dims": [2]})
    config.set_max_batch_size(8)
    config.set_dynamic_batching()
    as_dict = config.as_dict()
    assert len(as_dict["input"]) == 1 and as_dict["output"][0]["name"] == "B" and as_dict["max_batch_size"] == 8
    assert as_dict["dynamic_batching"] == {}
    with pytest.raises(ValueError, match="configuration expects datatype TYPE_FP32 for input 'A', model provides "
                                         "TYPE_INT32"):
        config.add_input({"name": "A", "data_type": "TYPE_INT32", "dims": [4]})
    with pytest.raises(ValueError, match="contains property other than"):
        config.add_output({"name": "C", "data_type": "TYPE_INT32", "dims": [2], "optional": True})
    with pytest.raises(ValueError, match="specified max_batch_size 8"):
        config.set_max_batch_size(4)
    assert pb_utils.get_output_config_by_name(as_dict, "B")["data_type"] == "TYPE_INT32"
    assert pb_utils.triton_string_to_numpy("TYPE_FP16") is np.float16
    assert pb_utils.numpy_to_triton_type(np.int64) == 9 and pb_utils.triton_to_numpy_type(13) is np.object_


def test_the_stub_side_imports_nothing_of_kiln():
    """What runs in a stub (server/python_backend) needs only the standard library and numpy: a model's own
    environment (EXECUTION_ENV_PATH) has no Kiln packages."""
    for module in Path(pb_utils.__file__).parent.glob("*.py"):
        imports = [line.split()[1] for line in module.read_text().splitlines() if line.startswith(("import ", "from "))]
        assert {name.split(".")[0] for name in imports} <= STUB_IMPORTS, module.name


def test_stub_process_round_trip_without_a_server(tmp_path):
    """The stub end to end over a socket pair, driven by hand: initialize, execute, finalize."""
    model = write_python_model(tmp_path, "m", triton_example("add_sub")[0]) / "1" / "model.py"
    ours, theirs = socket.socketpair()
    stub = subprocess.Popen([sys.executable, str(Path(wire.__file__).parent / "stub.py"), str(theirs.fileno())],
                            pass_fds=(theirs.fileno(),), env={**os.environ, "PYTHONPATH": ""})
    theirs.close()
    try:
        config = {"name": "m", "output": [{"name": n, "data_type": "TYPE_FP32", "dims": [4]}
                                          for n in ("OUTPUT0", "OUTPUT1")]}
        wire.send(ours, (wire.INITIALIZE, 1, {"model_file": str(model), "model_name": "m",
                                              "args": {"model_config": json.dumps(config)}}))
        assert wire.receive(ours) == (wire.REPLY, 1, (None, None))
        a, b = _pair(6)
        body = {"request_id": "", "correlation_id": 0, "inputs": [("INPUT0", a), ("INPUT1", b)],
                "outputs": ["OUTPUT0"], "model_version": 1, "flags": 0, "parameters": "{}"}
        wire.send(ours, (wire.EXECUTE, 2, [body]))
        kind, call_id, (value, error) = wire.receive(ours)
        assert (kind, call_id, error) == (wire.REPLY, 2, None)
        assert [name for name, _ in value[0]["outputs"]] == ["OUTPUT0"]  # pruned to the requested outputs
        np.testing.assert_array_equal(value[0]["outputs"][0][1], a + b)
        wire.send(ours, (wire.FINALIZE, 3, None))
        assert wire.receive(ours) == (wire.REPLY, 3, (None, None))
    finally:
        ours.close()
        assert stub.wait(timeout=10) == 0


def test_concurrent_clients_get_their_own_answers(server):
    """Sixteen requests in flight, to the async BLS example and the Python add_sub it calls: no answer is mixed up."""
    pairs = [_pair(100 + i) for i in range(16)]
    calls = [("bls_async" if i % 2 else "add_sub", {"INPUT0": a, "INPUT1": b}) for i, (a, b) in enumerate(pairs)]
    for (a, b), result in zip(pairs, _concurrently(server, calls)):
        np.testing.assert_allclose(result.as_numpy("OUTPUT0"), a + b, rtol=1e-6)
        np.testing.assert_allclose(result.as_numpy("OUTPUT1"), a - b, rtol=1e-6)


OPTIONAL_SUM = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            bias = pb_utils.get_input_tensor_by_name(request, "BIAS")  # optional: None when left out
            y = x + (bias.as_numpy() if bias is not None else 0)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y.astype(np.float32))]))
        return responses
'''
OPTIONAL_CONFIG = ('backend: "python"\nmax_batch_size: 4\ndynamic_batching { }\n'
                   'input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] },'
                   ' { name: "BIAS" data_type: TYPE_FP32 dims: [ 4 ] optional: true } ]\n'
                   'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]\n')


def test_an_optional_input_may_be_left_out_and_the_model_sees_none(tmp_path: Path):
    """`optional: true` on a Python model's input (as in Triton): requests with and without it are served, the
    model gets None for the missing one, and leaving out a required input still names what is missing."""
    write_python_model(tmp_path / "models", "optional_sum", OPTIONAL_SUM, OPTIONAL_CONFIG)
    with run_server(tmp_path / "models", tmp_path / "server.log", ["optional_sum"]) as server:
        client = httpclient.InferenceServerClient(server.http_url)
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        inputs = [httpclient.InferInput("X", [2, 4], "FP32"), httpclient.InferInput("BIAS", [2, 4], "FP32")]
        inputs[0].set_data_from_numpy(x)
        inputs[1].set_data_from_numpy(np.full((2, 4), 10, np.float32))
        np.testing.assert_array_equal(client.infer("optional_sum", inputs).as_numpy("Y"), x + 10)
        np.testing.assert_array_equal(client.infer("optional_sum", inputs[:1]).as_numpy("Y"), x)
        with pytest.raises(InferenceServerException, match=r"expected number of inputs between 1 and 2 but got 1 "
                                                           r"inputs for model 'optional_sum': missing \['X'\]"):
            client.infer("optional_sum", inputs[1:])
