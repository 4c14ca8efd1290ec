"""Executors answering frontend processes directly (server/core/direct_replies.py): a routed part's rows reach its
frontend as the response the core would have sent, a part without a route (or whose inbox is gone) comes back to the
core, and through a real server every request gets its own rows, a request the core must post-process (here
classification) still goes through the core, and the statistics count every request.

Without a GPU the executor runs the CPU plan (KILN_EXECUTOR_CPU=1): the same processes and sockets as for CUDA plans.
"""

from __future__ import annotations

import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import tritonclient.http as httpclient

from server.core.direct_replies import Inboxes, Route, deliver, route_for
from server.core.framing import FrameDecoder
from server.core.types import InferResponse, RequestedOutput

from .conftest import examples, run_server
from .test_executor_process import EXECUTOR_ENV
from .test_tensor_arena import CONFIG, WIDTH, _wide_add

grpcclient = pytest.importorskip("tritonclient.grpc")


def _route(inbox: int, call_id: int, request_id: str) -> Route:
    return Route(inbox, call_id, "m", "1", request_id, (("Y", "FP32", {"binary_data": True}),))


def _decoded(sock: socket.socket) -> list:
    messages: list = []
    decoder = FrameDecoder(messages.extend)
    sock.settimeout(5)
    while not messages:
        decoder.feed(sock.recv(1 << 16))
    return messages


def test_routed_parts_get_their_rows_as_responses_and_the_rest_return_to_the_core(tmp_path: Path) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "inbox"))
    listener.listen()
    inboxes = Inboxes()
    inboxes.connect(7, str(tmp_path / "inbox"))
    theirs, _ = listener.accept()
    listener.close()
    outputs = {"Y": np.arange(12, dtype=np.float32).reshape(6, 2)}
    delivered = deliver(inboxes, [_route(7, 10, "a"), None, _route(7, 11, "b")], [1, 2, 3], outputs)
    assert delivered == [0, 2]
    (first, second) = _decoded(theirs)
    assert first[0] == 10 and second[0] == 11 and first[2] is None and second[2] is None
    response: InferResponse = second[1]
    assert (response.model_name, response.model_version, response.id) == ("m", "1", "b")
    (output,) = response.outputs
    assert (output.name, output.datatype, output.shape, output.parameters) == ("Y", "FP32", (3, 2), {"binary_data": True})
    np.testing.assert_array_equal(output.data, outputs["Y"][3:])
    np.testing.assert_array_equal(first[1].outputs[0].data, outputs["Y"][:1])

    theirs.close()  # the frontend is gone: nothing is delivered, and the inbox is forgotten
    for _ in range(3):  # the first send after the peer closed may still be taken by the kernel
        delivered = deliver(inboxes, [_route(7, 12, "c")], [6], outputs)
        if not delivered:
            break
    assert delivered == []
    assert deliver(inboxes, [_route(7, 12, "c")], [6], outputs) == [], "forgotten after the failed send"
    assert deliver(inboxes, [_route(8, 13, "d")], [6], outputs) == [], "an inbox never connected"


def test_an_output_without_the_batch_rows_is_left_to_the_core() -> None:
    inboxes = Inboxes()
    assert deliver(inboxes, [_route(7, 1, "a")], [2], {"Y": np.zeros(3, np.float32)}) == []


def test_only_plain_outputs_of_models_in_executors_are_routed() -> None:
    model = SimpleNamespace(executors=[object()], name="m", version=3,
                            outputs={"Y": SimpleNamespace(datatype="FP16"), "Z": SimpleNamespace(datatype="FP32")})

    def in_place(_model, name: str) -> bool:
        return name == "Y"

    route = route_for(model, [RequestedOutput("Y", {"binary_data": False})], "id", 4, 9, in_place)
    assert route == Route(4, 9, "m", "3", "id", (("Y", "FP16", {"binary_data": False}),))
    assert route_for(model, [RequestedOutput("Z")], "id", 4, 9, in_place) is None  # converted on the host
    assert route_for(model, [RequestedOutput("Y", {"classification": 2})], "id", 4, 9, in_place) is None
    assert route_for(model, [RequestedOutput("Y", {"shared_memory_region": "r"})], "id", 4, 9, in_place) is None
    model.executors = []
    assert route_for(model, [RequestedOutput("Y")], "id", 4, 9, in_place) is None  # runs in the core


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("direct_replies")
    examples.write_model(base / "models", "wide_add", _wide_add(), CONFIG)
    return base


def test_a_server_s_executor_answers_its_frontends_and_the_core_counts_every_request(repository: Path) -> None:
    env = {**EXECUTOR_ENV, "KILN_HOP_STATS_S": "0.2"}
    log_path = repository / "server.log"
    with run_server(repository / "models", log_path, ["wide_add"], ["--frontend-processes", "2"], env=env) as server:
        grpc = grpcclient.InferenceServerClient(server.grpc_url)
        http = httpclient.InferenceServerClient(server.http_url)
        rng = np.random.default_rng(3)
        cases = [(rng.standard_normal((1 + i % 3, WIDTH)).astype(np.float32),
                  np.full((1 + i % 3, 4), float(i), np.float32)) for i in range(48)]

        def one(index: int, module=grpcclient, client=grpc) -> None:
            a, b = cases[index % len(cases)]
            inputs = [module.InferInput("A", list(a.shape), "FP32"), module.InferInput("B", list(b.shape), "FP32")]
            inputs[0].set_data_from_numpy(a)
            inputs[1].set_data_from_numpy(b)
            if index % 8 == 5:  # classification: the core post-processes it, beside routed requests
                top = client.infer("wide_add", inputs, outputs=[module.InferRequestedOutput("SUM", class_count=1)])
                best = (a + b[:, :1]).argmax(axis=1)
                assert [int(entry.decode().split(":")[1]) for entry in top.as_numpy("SUM").reshape(-1)] == list(best)
                return
            result = client.infer("wide_add", inputs, request_id=f"r{index}")
            response = result.get_response()
            assert (response["id"] if module is httpclient else response.id) == f"r{index}"
            np.testing.assert_array_equal(result.as_numpy("SUM"), a + b[:, :1])

        sent = 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until the core logs the span of a request its executor answered
            with ThreadPoolExecutor(12) as pool:  # concurrent requests: groups and batches of several jobs
                list(pool.map(one, range(sent, sent + len(cases))))
            for index in range(sent, sent + 6):  # HTTP too (one client, one request at a time)
                one(index, httpclient, http)
            sent += len(cases) + 6
            if re.search(r"call in -> executor replied [0-9.]+ ms x \d+", log_path.read_text(errors="replace")):
                break
        else:
            pytest.fail("no request was answered by the executor directly (no 'call in -> executor replied' span)")
        rows = sum(len(cases[i % len(cases)][0]) for i in range(sent))
        while time.monotonic() < deadline:  # the core counts a delivered request once its executor's reply is in
            stats = http.get_inference_statistics("wide_add")["model_stats"][0]
            if stats["inference_count"] == rows:
                break
            time.sleep(0.05)
        assert (stats["inference_count"], stats["inference_stats"]["success"]["count"]) == (rows, sent)
