"""A real server with the reliability flags on: small body limit, an inflight limit, restricted APIs.

`guarded_server` is the example repository plus `slow` (a chain of 1024x1024 MatMuls, one instance, so
requests queue behind each other) started with:
  --http-max-body-bytes 1M --max-inflight-requests 3
  --http-restricted-api model-repository,model-config:admin-key=s3cret (same for gRPC)
  --allow-client-shm true
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.server.conftest import examples, run_server

ADMIN = {"admin-key": "s3cret"}
MAX_BODY = 1 << 20
MAX_INFLIGHT = 3
SLOW_STEPS = 24
SLOW_SIZE = 1024
GOOD_BODY = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))},
                        {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [1] * 16}]}


def slow_model(steps: int = SLOW_STEPS, size: int = SLOW_SIZE) -> onnx.ModelProto:
    """X [1, size] -> Expand to [size, size] -> `steps` x (MatMul W, Tanh) -> ReduceSum -> Y [1, 1]: slow, tiny I/O."""
    rng = np.random.default_rng(7)
    weight = numpy_helper.from_array((rng.standard_normal((size, size)) / np.sqrt(size)).astype(np.float32), "W")
    shape = numpy_helper.from_array(np.array([size, size], dtype=np.int64), "S")
    nodes = [helper.make_node("Expand", ["X", "S"], ["h0"])]
    for i in range(steps):
        nodes.append(helper.make_node("MatMul", [f"h{i}", "W"], [f"m{i}"]))
        nodes.append(helper.make_node("Tanh", [f"m{i}"], [f"h{i + 1}"]))
    nodes.append(helper.make_node("ReduceSum", [f"h{steps}"], ["Y"], keepdims=1))
    graph = helper.make_graph(nodes, "slow", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, size])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 1])], [weight, shape])
    return examples._model(graph)


SLOW_CONFIG = 'name: "slow"\nmax_batch_size: 0\ninstance_group [ { count: 1 kind: KIND_CPU } ]\n'


def slow_body(size: int = SLOW_SIZE) -> dict:
    return {"inputs": [{"name": "X", "shape": [1, size], "datatype": "FP32", "data": [0.5] * size}]}


def assert_error(response: httpx.Response, status: int, fragment: str = "") -> None:
    """A clean client error: the status, a `{"error": ...}` body naming the problem, no traceback."""
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"}, body
    assert fragment in body["error"], body["error"]
    assert "Traceback" not in body["error"]


@pytest.fixture(scope="session")
def guarded_server(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("guarded_server")
    repository = examples.make_repository(base / "models")
    examples.write_model(repository, "slow", slow_model(), SLOW_CONFIG)
    examples.write_model(repository, "victim", examples.add_sub_model(TensorProto.INT32),
                         examples.ADD_SUB_CONFIG.replace('"add_sub"', '"victim"'))
    restricted = "model-repository,model-config:admin-key=s3cret"
    limits = ["--http-max-body-bytes", "1M", "--max-inflight-requests", str(MAX_INFLIGHT),
              "--http-restricted-api", restricted, "--grpc-restricted-protocol", restricted,
              "--allow-client-shm", "true"]  # so the fuzzers reach the shared-memory registration paths
    with run_server(repository, base / "server.log", ["add_sub", "identity", "slow", "victim"], limits) as server:
        yield server
    assert "Traceback" not in server.log(), server.log()[-4000:]


@pytest.fixture()
def http(guarded_server) -> httpx.Client:
    with httpx.Client(base_url=guarded_server.base_url, timeout=30) as client:
        yield client


@dataclass
class Background:
    """Good requests sent in a loop while a test does damage; every one of them must succeed."""

    send: Callable[[], bool]
    results: list[bool] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Background:
        def loop() -> None:
            while not self._stop.is_set():
                self.results.append(self.send())

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(timeout=30)
        if exc[0] is None:
            assert self.results, "the background client sent nothing"
            assert all(self.results), f"{self.results.count(False)} of {len(self.results)} good requests failed"


@pytest.fixture()
def good_traffic(guarded_server) -> Callable[[], Background]:
    """`with good_traffic(): ...` keeps correct add_sub requests going and checks each answer."""
    client = httpx.Client(base_url=guarded_server.base_url, timeout=30)

    def send() -> bool:
        response = client.post("/v2/models/add_sub/infer", json=GOOD_BODY)
        return response.status_code == 200 and response.json()["outputs"][0]["data"] == list(range(1, 17))

    yield lambda: Background(send)
    client.close()
