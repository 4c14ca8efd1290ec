"""Decoupled Python models (`model_transaction_policy { decoupled: true }`) on a real server: Triton's repeat and
square examples (python_models/, unchanged from triton-inference-server/python_backend examples/decoupled) through
the stock tritonclient's gRPC stream, HTTP generate / generate_stream, errors, statistics, and the refusal of a
single-response call. Run with KILN_TEST_FRONTEND_PROCESSES=2 too (the stream then crosses server/core/remote.py).
"""

from __future__ import annotations

import json
import queue

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from server.python_backend import triton_python_backend_utils as pb_utils

from .conftest import require_grpc, run_server
from .test_python_backend import triton_example, write_python_model

# One response, an error response, then the last response with the final flag; a negative input raises in execute().
ERRORS = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            if n < 0:
                raise ValueError("negative input")
            sender = request.get_response_sender()
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([1], np.int32))]))
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("second response failed")))
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([3], np.int32))]),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''
ERRORS_CONFIG = ('backend: "python"\nmax_batch_size: 0\nmodel_transaction_policy { decoupled: true }\n'
                 'input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
                 'output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]\n')
# decoupled set by auto_complete_config, as Triton's ModelConfig allows
AUTO = ERRORS.replace("class TritonPythonModel:", '''class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.set_model_transaction_policy({"decoupled": True})
        return config
''')
AUTO_CONFIG = ERRORS_CONFIG.replace("model_transaction_policy { decoupled: true }\n", "")
# BLS with decoupled models (exec(decoupled=True)): what the iterator yields for MODE 0: the "errors" model (an
# output, an error, the final output), 1: repeat_int32 sending 5 responses 100 ms apart, cancelled after two, 2: an
# unknown model
BLS_PROBE = '''
import json

import numpy as np
import triton_python_backend_utils as pb_utils


def describe(response):
    if response.has_error():
        return "error: " + response.error().message()
    tensors = response.output_tensors()
    return [int(t.as_numpy()[0]) for t in tensors] if tensors else "empty"


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            mode = int(pb_utils.get_input_tensor_by_name(request, "MODE").as_numpy()[0])
            target = {0: "errors", 1: "repeat_int32", 2: "missing"}[mode]
            inputs = [pb_utils.Tensor("IN", np.array([1], np.int32))]
            if mode == 1:
                inputs = [pb_utils.Tensor("IN", np.arange(5, dtype=np.int32) + 5),
                          pb_utils.Tensor("DELAY", np.full(5, 100, np.uint32)),
                          pb_utils.Tensor("WAIT", np.array([0], np.uint32))]
            bls = pb_utils.InferenceRequest(model_name=target, requested_output_names=["OUT"], inputs=inputs)
            seen = []
            iterator = bls.exec(decoupled=True)
            for response in iterator:
                seen.append(describe(response))
                if mode == 1 and len(seen) == 2:
                    iterator.cancel()
            text = np.array([json.dumps(seen).encode()], dtype=object)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("SEEN", text)]))
        return responses
'''
BLS_PROBE_CONFIG = ('backend: "python"\nmax_batch_size: 0\n'
                    'input [ { name: "MODE" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
                    'output [ { name: "SEEN" data_type: TYPE_STRING dims: [ 1 ] } ]\n')
MODELS = ["repeat_int32", "square_int32", "errors", "auto_decoupled", "bls_probe"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = tmp_path_factory.mktemp("decoupled")
    repo = base / "models"
    for name, stem in (("repeat_int32", "repeat"), ("square_int32", "square")):
        write_python_model(repo, name, *triton_example(stem))
    write_python_model(repo, "errors", ERRORS, ERRORS_CONFIG)
    write_python_model(repo, "auto_decoupled", AUTO, AUTO_CONFIG)
    write_python_model(repo, "bls_probe", BLS_PROBE, BLS_PROBE_CONFIG)
    model, config = triton_example("square")
    warm = 'model_warmup [ { name: "three" batch_size: 0 count: 2 inputs { key: "IN" value { data_type: TYPE_INT32 ' \
           'dims: [ 1 ] input_data_file: "three" } } } ]\n'
    directory = write_python_model(repo, "square_warm", model, config.replace('"square_int32"', '"square_warm"') + warm)
    (directory / "warmup").mkdir()
    (directory / "warmup" / "three").write_bytes(np.array([3], np.int32).tobytes())
    write_python_model(repo, "errors_warm", ERRORS, ERRORS_CONFIG + warm.replace('input_data_file: "three"',
                                                                               "zero_data: true"))
    with run_server(repo, base / "server.log", MODELS) as running:
        yield running


def _stream(server, model: str, inputs: dict[str, np.ndarray], empty_final: bool = False) -> list:
    """One request on a tritonclient gRPC stream; what its callback got, up to the request's last response (the
    one whose triton_final_response is true, or its error when that comes last)."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(require_grpc(server).grpc_url)
    tensors = []
    for name, array in inputs.items():
        tensor = grpcclient.InferInput(name, list(array.shape), "INT32" if array.dtype == np.int32 else "UINT32")
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer(model, tensors, request_id="r1", enable_empty_final_response=empty_final)
        got = []
        while True:
            result, error = results.get(timeout=30)
            got.append((result, error))
            if result is not None and result.get_response().parameters["triton_final_response"].bool_param:
                return got
            if error is not None and model == "errors" and len(got) == 1:  # execute() raised: nothing follows
                return got
    finally:
        client.stop_stream()
        client.close()


def _final(result) -> bool:
    return result.get_response().parameters["triton_final_response"].bool_param


REPEAT = {"IN": np.array([4, 2, 0, 1], np.int32), "DELAY": np.array([30, 10, 10, 10], np.uint32),
          "WAIT": np.array([5], np.uint32)}


def test_repeat_sends_each_response_in_order_from_its_thread_then_the_empty_final(server):
    """WAIT (5 ms) is shorter than the delays: execute() returns before the model's thread sends anything."""
    got = _stream(server, "repeat_int32", REPEAT, empty_final=True)
    assert all(error is None for _, error in got)
    responses, last = [r for r, _ in got[:-1]], got[-1][0]
    assert [int(r.as_numpy("IDX")[0]) for r in responses] == [0, 1, 2, 3]
    assert [int(r.as_numpy("OUT")[0]) for r in responses] == [4, 2, 0, 1]
    assert [_final(r) for r in responses] == [False] * 4
    assert _final(last) and last.as_numpy("OUT") is None and last.get_response().id == "r1"
    assert last.get_response().model_name == "repeat_int32"


def test_square_sends_n_responses_and_none_for_zero(server):
    got = _stream(server, "square_int32", {"IN": np.array([3], np.int32)}, empty_final=True)
    assert [int(r.as_numpy("OUT")[0]) for r, _ in got[:-1]] == [3, 3, 3]
    got = _stream(server, "square_int32", {"IN": np.array([0], np.int32)}, empty_final=True)
    assert len(got) == 1 and got[0][1] is None and _final(got[0][0]) and got[0][0].as_numpy("OUT") is None


def test_without_empty_final_the_stream_carries_only_responses(server):
    """Triton sends the empty final response only to a request that asks for it: square of 0 says nothing, and the
    next request on the stream is answered as usual."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(require_grpc(server).grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for n, request_id in ((0, "zero"), (2, "two")):
            tensor = grpcclient.InferInput("IN", [1], "INT32")
            tensor.set_data_from_numpy(np.array([n], np.int32))
            client.async_stream_infer("square_int32", [tensor], request_id=request_id)
        got = [results.get(timeout=30) for _ in range(2)]
    finally:
        client.stop_stream()
        client.close()
    assert [(r.get_response().id, int(r.as_numpy("OUT")[0]), _final(r)) for r, _ in got] == [
        ("two", 2, False), ("two", 2, False)]
    assert results.empty()


def test_an_error_response_mid_stream_and_the_stream_goes_on(server):
    got = _stream(server, "errors", {"IN": np.array([1], np.int32)}, empty_final=True)
    assert len(got) == 3
    (first, e1), (_, e2), (last, e3) = got
    assert e1 is None and int(first.as_numpy("OUT")[0]) == 1 and not _final(first)
    assert "second response failed" in str(e2)
    assert e3 is None and int(last.as_numpy("OUT")[0]) == 3 and _final(last)  # final with it: no empty one


def test_execute_raising_fails_the_request_with_tritons_text(server):
    got = _stream(server, "errors", {"IN": np.array([-1], np.int32)}, empty_final=True)
    assert got[0][0] is None
    assert ("Failed to process the request(s) for model 'errors_0_0', message: ValueError: negative input"
            in str(got[0][1]))


def test_decoupled_set_by_auto_complete_config(server):
    got = _stream(server, "auto_decoupled", {"IN": np.array([1], np.int32)})
    assert [int(r.as_numpy("OUT")[0]) for r, e in got if e is None] == [1, 3]


def test_single_response_calls_are_refused_with_tritons_texts(server):
    tensor = httpclient.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([2], np.int32))
    with httpclient.InferenceServerClient(server.http_url) as client:
        with pytest.raises(InferenceServerException) as failure:
            client.infer("square_int32", [tensor])
    assert "HTTP end point doesn't support models with decoupled transaction policy" in str(failure.value)
    assert failure.value.status() == "501"
    tensor = grpcclient.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([2], np.int32))
    with grpcclient.InferenceServerClient(require_grpc(server).grpc_url) as client:
        with pytest.raises(InferenceServerException) as failure:
            client.infer("square_int32", [tensor])
    assert "ModelInfer RPC doesn't support models with decoupled transaction policy" in str(failure.value)
    assert failure.value.status() == "StatusCode.UNIMPLEMENTED"


def generate_stream_events(url: str, body: dict) -> list[dict]:
    """POST `body` to a generate_stream `url`: the JSON of each server-sent event (a 200 text/event-stream)."""
    with httpx.stream("POST", url, json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return [json.loads(line[len("data: "):]) for line in response.iter_lines() if line.startswith("data: ")]


def test_http_generate_stream_sends_each_response_as_an_event(server):
    body = {"IN": [4, 2, 0, 1], "DELAY": [30, 10, 10, 10], "WAIT": 5}
    events = generate_stream_events(f"http://{server.http_url}/v2/models/repeat_int32/generate_stream", body)
    assert events == [{"model_name": "repeat_int32", "model_version": "1", "OUT": out, "IDX": idx}
                      for idx, out in enumerate([4, 2, 0, 1])]


def test_http_generate_stream_error_event_and_error_before_any_response(server):
    url = f"http://{server.http_url}/v2/models/errors/generate_stream"
    events = generate_stream_events(url, {"IN": 1})
    assert [e.get("OUT", e.get("error")) for e in events] == [1, "second response failed", 3]
    failed = httpx.post(url, json={"IN": -1}, timeout=30)
    assert failed.status_code == 500 and "ValueError: negative input" in failed.json()["error"]
    unknown = httpx.post(f"http://{server.http_url}/v2/models/nope/generate_stream", json={}, timeout=30)
    assert unknown.status_code == 404 and "Request for unknown model" in unknown.json()["error"]


def test_http_generate_returns_the_one_response(server):
    url = f"http://{server.http_url}/v2/models/square_int32/generate"
    one = httpx.post(url, json={"IN": 1}, timeout=30)
    assert one.status_code == 200 and one.json() == {"model_name": "square_int32", "model_version": "1", "OUT": 1}
    many = httpx.post(url, json={"IN": 2}, timeout=30)
    assert many.status_code == 400 and "use /generate_stream" in many.json()["error"]


def test_statistics_count_each_request_once_whatever_its_responses(server):
    with httpclient.InferenceServerClient(server.http_url) as client:
        before = client.get_inference_statistics("square_int32")["model_stats"][0]["inference_stats"]["success"]
        _stream(server, "square_int32", {"IN": np.array([3], np.int32)}, empty_final=True)
        _stream(server, "square_int32", {"IN": np.array([0], np.int32)}, empty_final=True)
        after = client.get_inference_statistics("square_int32")["model_stats"][0]
    assert after["inference_stats"]["success"]["count"] == before["count"] + 2
    assert after["execution_count"] >= 2


# -- the sender itself, without a server ----------------------------------------------------------------------
class _Runtime:
    def __init__(self) -> None:
        self.sent: list[tuple] = []

    def send_response(self, stream: int, response, flags: int, requested: list[str]) -> None:
        self.sent.append((stream, response, flags))

    def is_cancelled(self, stream: int) -> bool:
        return stream == 9


def test_response_sender_checks_as_triton(monkeypatch):
    runtime = _Runtime()
    monkeypatch.setattr(pb_utils, "_runtime", runtime)
    sender = pb_utils.InferenceResponseSender(7, ["OUT"])
    with pytest.raises(pb_utils.TritonModelException, match="Inference Response object must be provided"):
        sender.send()
    with pytest.raises(pb_utils.TritonModelException, match="Unsupported flag provided"):
        sender.send(pb_utils.InferenceResponse(), flags=2)
    sender.send(pb_utils.InferenceResponse())
    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    with pytest.raises(pb_utils.TritonModelException, match="Response sender has been closed"):
        sender.send(pb_utils.InferenceResponse())
    assert [(s, f) for s, _, f in runtime.sent] == [(7, 0), (7, 1)]
    assert not sender.is_cancelled() and pb_utils.InferenceResponseSender(9, []).is_cancelled()
    request = pb_utils.InferenceRequest(inputs=[], requested_output_names=[], model_name="m")
    default = request.get_response_sender()  # a default-mode request's (test_python_default_sender.py)
    assert isinstance(default, pb_utils._DefaultModeSender) and request.get_response_sender() is default


def _probe(server, mode: int) -> list:
    client = httpclient.InferenceServerClient(server.http_url)
    tensor = httpclient.InferInput("MODE", [1], "INT32")
    tensor.set_data_from_numpy(np.array([mode], np.int32))
    return json.loads(client.infer("bls_probe", [tensor]).as_numpy("SEEN")[0])


def test_bls_exec_decoupled_yields_each_response_and_errors_as_they_come(server):
    """An error response does not end the iteration (as on a gRPC stream); the final response ends it."""
    assert _probe(server, 0) == [[1], "error: second response failed", [3]]


def test_bls_exec_decoupled_cancel_ends_the_iteration(server):
    """cancel() withdraws the request: the responses already sent, then one CANCELLED error, then the end."""
    assert _probe(server, 1) == [[5], [6], "error: request cancelled"]


def test_bls_exec_decoupled_to_an_unknown_model_is_one_error_response(server):
    assert _probe(server, 2) == ["error: Request for unknown model: 'missing' is not found"]


def test_a_decoupled_model_warms_up_through_its_responses(server):
    """model_warmup on a decoupled model (Triton 2.51 loads it too): each sample's responses are read to the final
    flag before READY; warm-up requests are not in the statistics, and the model then serves."""
    client = httpclient.InferenceServerClient(server.http_url)
    client.load_model("square_warm")
    assert client.is_model_ready("square_warm")
    assert client.get_inference_statistics("square_warm")["model_stats"][0]["inference_stats"]["success"]["count"] == 0
    got = _stream(server, "square_warm", {"IN": np.array([2], np.int32)}, empty_final=True)
    assert [r.as_numpy("OUT").tolist() for r, _ in got if r is not None and not _final(r)] == [[2], [2]]


def test_a_decoupled_warm_up_whose_response_is_an_error_fails_the_load(server):
    client = httpclient.InferenceServerClient(server.http_url)
    with pytest.raises(InferenceServerException) as failure:
        client.load_model("errors_warm")
    assert "warmup sample 'three' failed: second response failed" in failure.value.message()

