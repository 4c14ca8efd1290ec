"""Triton's own examples (examples/triton_examples: the Python-backend add_sub, an ensemble of it, the sync BLS
example, the sequence batcher's simple_sequence accumulator, the decoupled repeat and square models and BLS with
decoupled models, sync and async) served by a real Kiln
server and driven by the stock tritonclient the way Triton's example clients drive them, asserting Triton's
answers. Where the real Triton (../shared/tools/triton-peer/serve.sh, the nvidia-pytriton wheel) can run, the very
same tests run against it too, on the very same repository: the answers are Triton's own, not recalled ones.
"""

from __future__ import annotations

import os
import queue
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from load_tests import harness, peers
from tests.support.servers import run_server

REPOSITORY = harness.ROOT / "examples" / "triton_examples"
MODELS = ["add_sub", "ensemble_add_sub", "bls_sync", "accumulator", "repeat_int32", "square_int32",
          "bls_decoupled_sync", "bls_decoupled_async"]
# Triton's example clients: simple_{http,grpc}_sequence_*_client.py send these to two sequences (the second one
# negated, after a first request of 0 and 100), the decoupled repeat_client.py these IN / DELAY / WAIT
SEQUENCE_VALUES = [11, 7, 5, 3, 2, 0, 1]
REPEAT_IN = np.array([4, 2, 0, 1], dtype=np.int32)
REPEAT_DELAY = np.array([1, 2, 3, 4], dtype=np.uint32)
REPEAT_WAIT = np.array([5], dtype=np.uint32)


class Urls:
    def __init__(self, name: str, http_port: int, grpc_port: int, metrics_port: int = 0) -> None:
        self.name = name
        self.http = f"127.0.0.1:{http_port}"
        self.grpc = f"127.0.0.1:{grpc_port}"
        self.metrics = f"http://127.0.0.1:{metrics_port}/metrics"


def triton_server(tmp: Path, repository: Path = REPOSITORY) -> Iterator[Urls]:
    """The real Triton (../shared/tools/triton-peer) serving `repository`; the test is skipped where it is missing."""
    why = peers.available("triton")
    if why:
        pytest.skip(f"no Triton here: {why}")
    ports = harness.free_ports(3)
    command = ["bash", str(peers.TRITON_SERVE), *map(str, ports), str(repository)]
    with harness.serving(command, tmp / "triton.log", harness.http_ready(f"http://127.0.0.1:{ports[0]}/v2/health/ready"),
                         env={**os.environ, "PYTRITON_VENV": str(peers.TRITON_VENV)}, timeout_s=120,
                         interval_s=0.3, stop_timeout_s=20, name="tritonserver"):
        yield Urls("triton", *ports)


def kiln_or_triton(which: str, tmp: Path, repository: Path, models: list[str]) -> Iterator[Urls]:
    """A Kiln server loading `models` of `repository`, or (`which` "triton") the real Triton on it: what the
    module fixtures parametrized ["kiln", "triton"] yield."""
    if which == "triton":
        yield from triton_server(tmp, repository)
        return
    with run_server(repository, tmp / "kiln.log", models) as kiln:
        yield Urls("kiln", kiln.http_port, kiln.grpc_port, kiln.metrics_port)


@pytest.fixture(scope="module", params=["kiln", "triton"])
def server(request, tmp_path_factory) -> Iterator[Urls]:
    yield from kiln_or_triton(request.param, tmp_path_factory.mktemp(f"triton_examples_{request.param}"), REPOSITORY,
                              MODELS)


def _client(protocol, server: Urls):
    return protocol.InferenceServerClient(server.http if protocol is httpclient else server.grpc)


def _inputs(protocol, arrays: dict[str, np.ndarray]) -> list:
    inputs = []
    for name, array in arrays.items():
        datatype = "BYTES" if array.dtype == object else {np.float32: "FP32", np.int32: "INT32",
                                                            np.uint32: "UINT32"}[array.dtype.type]
        tensor = protocol.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _infer(protocol, server: Urls, model: str, arrays: dict[str, np.ndarray], outputs: list[str], **kwargs):
    client = _client(protocol, server)
    try:
        requested = [protocol.InferRequestedOutput(name) for name in outputs]
        result = client.infer(model, _inputs(protocol, arrays), outputs=requested, **kwargs)
        return {name: result.as_numpy(name) for name in outputs}
    finally:
        client.close()


PROTOCOLS = pytest.mark.parametrize("protocol", [httpclient, grpcclient], ids=["http", "grpc"])


@PROTOCOLS
def test_add_sub(server, protocol):
    """python_backend/examples/add_sub/client.py: OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1."""
    a, b = np.random.rand(4).astype(np.float32), np.random.rand(4).astype(np.float32)
    got = _infer(protocol, server, "add_sub", {"INPUT0": a, "INPUT1": b}, ["OUTPUT0", "OUTPUT1"])
    np.testing.assert_array_equal(got["OUTPUT0"], a + b)
    np.testing.assert_array_equal(got["OUTPUT1"], a - b)


@PROTOCOLS
def test_ensemble_of_add_sub(server, protocol):
    """Two add_sub steps: (a + b) + (a - b) = 2a and (a + b) - (a - b) = 2b (exact in FP32 for these values)."""
    a = np.array([1.5, -2.25, 3.0, 0.125], dtype=np.float32)
    b = np.array([0.5, 4.0, -1.75, 8.0], dtype=np.float32)
    got = _infer(protocol, server, "ensemble_add_sub", {"INPUT0": a, "INPUT1": b}, ["OUTPUT0", "OUTPUT1"])
    np.testing.assert_array_equal(got["OUTPUT0"], 2 * a)
    np.testing.assert_array_equal(got["OUTPUT1"], 2 * b)
    assert got["OUTPUT0"].dtype == np.float32 and got["OUTPUT0"].shape == (4,)


@PROTOCOLS
def test_bls_sync_calls_the_model_it_is_named(server, protocol):
    """python_backend/examples/bls/sync_client.py: MODEL_NAME picks the model the BLS request goes to (add_sub, or
    the ensemble of it); an unknown one fails the request with the model's exception."""
    a, b = np.random.rand(4).astype(np.float32), np.random.rand(4).astype(np.float32)
    s, d = a + b, a - b
    for target, expected in (("add_sub", (s, d)), ("ensemble_add_sub", (s + d, s - d))):  # FP32, step by step
        got = _infer(protocol, server, "bls_sync", {"MODEL_NAME": np.array([target.encode()], dtype=object),
                                                    "INPUT0": a, "INPUT1": b}, ["OUTPUT0", "OUTPUT1"])
        np.testing.assert_array_equal(got["OUTPUT0"], expected[0])
        np.testing.assert_array_equal(got["OUTPUT1"], expected[1])
    with pytest.raises(InferenceServerException) as failure:
        _infer(protocol, server, "bls_sync", {"MODEL_NAME": np.array([b"undefined_model"], dtype=object),
                                              "INPUT0": a, "INPUT1": b}, ["OUTPUT0", "OUTPUT1"])
    # Triton 2.51 names the instance of an unnamed group '<model>_<group>_<index>' and says so
    message = failure.value.message()
    assert message.startswith("Failed to process the request(s) for model 'bls_sync_0_0', message: "), message
    assert "TritonModelException" in message and "undefined_model" in message


def _sequence_expected() -> tuple[list[int], list[int]]:
    """What Triton's sequence clients check: sequence 0 starts at 0 and adds each value, sequence 1 starts at 100
    and subtracts it."""
    first, second = [0], [100]
    for value in SEQUENCE_VALUES:
        first.append(first[-1] + value)
        second.append(second[-1] - value)
    return first, second


def _steps(offset: int) -> list[tuple[int, int, bool, bool]]:
    """(sequence id, value, start, end) in the clients' order: the two sequences interleaved."""
    ids = (1000 + offset * 2, 1001 + offset * 2)
    steps = [(ids[0], 0, True, False), (ids[1], 100, True, False)]
    for value in SEQUENCE_VALUES:
        steps += [(ids[0], value, False, value == 1), (ids[1], -value, False, value == 1)]
    return steps


@PROTOCOLS
def test_accumulator_sync_sequences(server, protocol):
    """simple_{http,grpc}_sequence_sync_infer_client.py: two sequences sent one request at a time, interleaved,
    with sequence_id / sequence_start / sequence_end; each answer is its sequence's running sum."""
    client = _client(protocol, server)
    offset = 0 if protocol is httpclient else 1
    results: dict[int, list[int]] = {}
    try:
        for sequence_id, value, start, end in _steps(offset):
            inputs = _inputs(protocol, {"INPUT": np.array([[value]], dtype=np.int32)})
            result = client.infer("accumulator", inputs, outputs=[protocol.InferRequestedOutput("OUTPUT")],
                                  sequence_id=sequence_id, sequence_start=start, sequence_end=end)
            output = result.as_numpy("OUTPUT")
            assert output.shape == (1, 1) and output.dtype == np.int32
            results.setdefault(sequence_id, []).append(int(output[0][0]))
    finally:
        client.close()
    assert list(results.values()) == list(_sequence_expected())


def test_accumulator_stream_sequences(server):
    """simple_grpc_sequence_stream_infer_client.py: the same two sequences over one gRPC stream
    (async_stream_infer with sequence_id / sequence_start / sequence_end), answers matched by request id."""
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc)
    steps = _steps(2)
    try:
        client.start_stream(callback=partial(lambda q, result, error: q.put((result, error)), answers))
        for index, (sequence_id, value, start, end) in enumerate(steps):
            client.async_stream_infer("accumulator", _inputs(grpcclient, {"INPUT": np.array([[value]], np.int32)}),
                                      request_id=str(index), sequence_id=sequence_id, sequence_start=start,
                                      sequence_end=end, outputs=[grpcclient.InferRequestedOutput("OUTPUT")])
        got: dict[int, int] = {}
        for _ in steps:
            result, error = answers.get(timeout=30)
            assert error is None, error
            got[int(result.get_response().id)] = int(result.as_numpy("OUTPUT")[0][0])
    finally:
        client.stop_stream()
        client.close()
    results: dict[int, list[int]] = {}
    for index, (sequence_id, *_) in enumerate(steps):
        results.setdefault(sequence_id, []).append(got[index])
    assert list(results.values()) == list(_sequence_expected())


def test_accumulator_needs_start(server):
    """A request for a sequence that never started is refused (Triton's text)."""
    with pytest.raises(InferenceServerException) as failure:
        _infer(httpclient, server, "accumulator", {"INPUT": np.array([[5]], dtype=np.int32)}, ["OUTPUT"],
               sequence_id=4242)
    assert "must specify the START flag on the first request of the sequence" in failure.value.message()


def stream_results(server: Urls, model: str, requests: list[dict[str, np.ndarray]]) -> list[list[dict[str, np.ndarray]]]:
    """Triton's decoupled example clients: `requests` on one gRPC stream; per request its responses' outputs in the
    order they came, up to the one with the final flag (alone, or with the last answer)."""
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc)
    try:
        client.start_stream(callback=partial(lambda q, result, error: q.put((result, error)), answers))
        for index, arrays in enumerate(requests):
            client.async_stream_infer(model, _inputs(grpcclient, arrays), request_id=str(index),
                                      enable_empty_final_response=True)
        got: list[list[dict[str, np.ndarray]]] = [[] for _ in requests]
        finished = 0
        while finished < len(requests):
            result, error = answers.get(timeout=30)
            assert error is None, error
            response = result.get_response()
            if response.outputs:
                got[int(response.id)].append({o.name: result.as_numpy(o.name) for o in response.outputs})
            if response.parameters["triton_final_response"].bool_param:
                finished += 1
    finally:
        client.stop_stream()
        client.close()
    return got


def _repeat(server: Urls, requests: list[dict[str, np.ndarray]]) -> list[list[tuple[int, int]]]:
    """python_backend/examples/decoupled/repeat_client.py: per request its responses (OUT, IDX) in order."""
    got = []
    for answers in stream_results(server, "repeat_int32", requests):
        assert all(a["OUT"].dtype == np.int32 and a["IDX"].dtype == np.uint32 for a in answers)
        got.append([(int(a["OUT"][0]), int(a["IDX"][0])) for a in answers])
    return got


def test_repeat_streams_one_response_per_element(server):
    """The decoupled repeat model: one response per IN element, OUT = IN[i] and IDX = i, in order."""
    got = _repeat(server, [{"IN": REPEAT_IN, "DELAY": REPEAT_DELAY, "WAIT": REPEAT_WAIT}])
    assert got == [[(int(v), i) for i, v in enumerate(REPEAT_IN)]]


def test_repeat_interleaves_requests_and_answers_an_empty_one_with_the_final_flag_only(server):
    """WAIT shorter than the DELAYs: execute() returns before the responses are sent, so a second request runs
    meanwhile; each request still gets its own responses in order. IN of shape [0] gets no response but the
    final one."""
    second = np.array([9, 8, 7], dtype=np.int32)
    got = _repeat(server, [
        {"IN": REPEAT_IN, "DELAY": np.array([20, 20, 20, 20], np.uint32), "WAIT": np.array([1], np.uint32)},
        {"IN": second, "DELAY": np.array([5, 5, 5], np.uint32), "WAIT": np.array([1], np.uint32)},
        {"IN": np.array([], np.int32), "DELAY": np.array([], np.uint32), "WAIT": np.array([0], np.uint32)},
    ])
    assert got == [[(int(v), i) for i, v in enumerate(REPEAT_IN)], [(int(v), i) for i, v in enumerate(second)], []]


@PROTOCOLS
@pytest.mark.parametrize("model", ["bls_decoupled_sync", "bls_decoupled_async"])
def test_bls_with_a_decoupled_model_sums_its_responses(server, protocol, model):
    """python_backend examples/bls_decoupled: `exec(decoupled=True)` (sync) and `async_exec(decoupled=True)` (two
    requests at once) iterate square_int32's responses, IN of them each carrying IN, and an empty final one."""
    calls = 2 if model.endswith("async") else 1
    for value in (0, 1, 4):
        got = _infer(protocol, server, model, {"IN": np.array([value], dtype=np.int32)}, ["SUM"])["SUM"]
        assert got.tolist() == [calls * value * value], (model, value, got)
        assert got.dtype == np.int64  # the model's np.array([0]), sent as made although the config says INT32

