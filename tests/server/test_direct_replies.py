"""Executors answering frontend processes directly (server/core/direct_replies.py): a routed part's rows reach its
frontend as the response the core would have sent, and a part without a route (or whose inbox is gone) comes back to
the core. Through a real server: tests/server/test_executor_process.py.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from server.core import direct_replies
from server.core.direct_replies import Inboxes, Route, deliver, route_for
from server.core.framing import FrameDecoder
from server.core.types import InferResponse, RequestedOutput


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


def test_a_frontend_that_stops_reading_is_given_up_after_the_send_timeout(tmp_path: Path, monkeypatch) -> None:
    """A stuck frontend must not hold a GPU lane: once its inbox takes nothing for SEND_TIMEOUT_S, the send fails,
    the parts go back to the core and the inbox is dropped (the frontend never decodes the partial frame)."""
    monkeypatch.setattr(direct_replies, "SEND_TIMEOUT_S", 0.2)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "inbox"))
    listener.listen()
    inboxes = Inboxes()
    inboxes.connect(3, str(tmp_path / "inbox"))
    stuck, _ = listener.accept()  # accepted, never read
    outputs = {"Y": np.zeros((1, 1 << 20), np.float32)}  # 4 MB a response: the socket's buffers fill at once
    started = time.monotonic()
    results = [deliver(inboxes, [_route(3, call, "s")], [1], outputs) for call in range(8)]
    assert [] in results and results[-1] == [], "the stuck inbox stopped taking responses and was dropped"
    assert time.monotonic() - started < 5, "given up after the send timeout, not hung"
    stuck.close()
    listener.close()
