"""Model control from a Python model (`pb_utils.load_model`, `unload_model`, `is_model_ready`, as Triton's Python
backend has them since 23.07): a real Kiln server in explicit mode, a Python model that loads, checks and unloads
an ONNX model through the server, and the stock tritonclient watching the repository from outside."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tritonclient.http as httpclient
from onnx import TensorProto

from .conftest import examples, run_server
from .test_python_backend import write_python_model

# OP "ready" / "load" / "load_override" / "unload" / "load_missing" on model TARGET; answers the op's result or error
CONTROLLER = '''
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.directory = args["model_repository"]

    def execute(self, requests):
        responses = []
        for request in requests:
            op = pb_utils.get_input_tensor_by_name(request, "OP").as_numpy()[0].decode()
            try:
                if op == "ready":
                    result = pb_utils.is_model_ready("target")
                elif op == "load":
                    result = pb_utils.load_model(model_name="target")
                elif op == "load_override":  # the repository's ONNX file under another config, as a file upload
                    with open(self.directory + "/../target/1/model.onnx", "rb") as file:
                        data = file.read()
                    config = json.dumps({"backend": "onnxruntime", "max_batch_size": 4})
                    result = pb_utils.load_model("target", config=config, files={"file:1/model.onnx": data})
                elif op == "unload":
                    result = pb_utils.unload_model("target")
                else:
                    result = pb_utils.load_model("missing")
                text = json.dumps({"result": result})
            except pb_utils.TritonModelException as e:
                text = json.dumps({"error": str(e)})
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("RESULT", np.array([text.encode()],
                                                                                           dtype=object))]))
        return responses
'''
CONTROLLER_CONFIG = ('backend: "python"\nmax_batch_size: 0\n'
                     'input [ { name: "OP" data_type: TYPE_STRING dims: [ 1 ] } ]\n'
                     'output [ { name: "RESULT" data_type: TYPE_STRING dims: [ 1 ] } ]\n')


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("model_control") / "models"
    write_python_model(repo, "controller", CONTROLLER, CONTROLLER_CONFIG)
    examples.write_model(repo, "target", examples.add_sub_model(TensorProto.INT32),
                         examples.ADD_SUB_CONFIG.replace('"add_sub"', '"target"'))
    with run_server(repo, repo.parent / "server.log", ["controller"]) as running:  # explicit mode: target not loaded
        yield running


def _op(server, op: str) -> dict:
    client = httpclient.InferenceServerClient(server.http_url)
    tensor = httpclient.InferInput("OP", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([op.encode()], dtype=object))
    return json.loads(client.infer("controller", [tensor]).as_numpy("RESULT")[0])


def test_a_python_model_loads_checks_and_unloads_another_model(server):
    client = httpclient.InferenceServerClient(server.http_url)
    assert _op(server, "ready") == {"result": False} and not client.is_model_ready("target")
    assert _op(server, "load") == {"result": None}
    assert _op(server, "ready") == {"result": True} and client.is_model_ready("target")
    assert _op(server, "unload") == {"result": None}
    assert _op(server, "ready") == {"result": False} and not client.is_model_ready("target")


def test_load_with_a_config_and_files_overrides_the_repository(server):
    client = httpclient.InferenceServerClient(server.http_url)
    assert _op(server, "load_override") == {"result": None}
    assert client.get_model_config("target")["max_batch_size"] == 4  # the override's, not the repository's 8
    _op(server, "unload")


def test_a_failed_load_raises_the_servers_message_in_the_model(server):
    assert _op(server, "load_missing") == {"error": "failed to load 'missing', failed to poll from model repository: "
                                                    "model 'missing' is not in the model repository"}
