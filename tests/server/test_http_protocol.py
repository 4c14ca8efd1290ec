"""The HTTP protocol's own inference road (server/frontends/http/protocol.py): the same answers as the FastAPI
route, everything it does not own still reaches FastAPI, and HTTP/1.1's corners (keep-alive, pipelining,
`Expect: 100-continue`, chunked bodies, HTTP/1.0, a client that leaves) hold on a raw socket."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
import pytest

from .conftest import examples, run_server

ADD_SUB = "/v2/models/add_sub/infer"
BODY = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))},
                   {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [1] * 16}]}


@pytest.fixture(scope="module")
def http(kiln_server) -> httpx.Client:
    with httpx.Client(base_url=kiln_server.base_url, timeout=30) as client:
        yield client


def test_success_headers_and_both_paths(http):
    for path in (ADD_SUB, "/v2/models/add_sub/versions/1/infer"):
        response = http.post(path, json=BODY, headers={"Accept-Encoding": "identity"})
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/json"
        assert int(response.headers["content-length"]) == len(response.content)
        assert response.json()["model_version"] == "1"
        assert response.json()["outputs"][0]["data"] == list(range(1, 17))


def test_errors_keep_their_status_and_body(http):
    response = http.post("/v2/models/nope/infer", json=BODY)
    assert response.status_code == 404 and set(response.json()) == {"error"}
    assert response.headers["content-type"] == "application/json"
    response = http.post(ADD_SUB, content=b"{not json")
    assert response.status_code == 400 and "failed to parse the request JSON" in response.json()["error"]
    response = http.post("/v2/models/add_sub/versions/9/infer", json=BODY)
    assert response.status_code == 404 and set(response.json()) == {"error"}


def test_other_methods_and_paths_reach_fastapi(http):
    assert http.get(ADD_SUB).status_code == 405  # the route exists for POST only
    assert http.post("/v2/models/add_sub/infer/extra", json=BODY).status_code == 404
    assert http.get("/v2/models/add_sub").status_code == 200  # metadata is FastAPI's


def _request(path: str, body: bytes, extra: str = "", version: str = "1.1") -> bytes:
    return (f"POST {path} HTTP/{version}\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


def _read_response(sock: socket.socket, buffer: bytearray) -> tuple[int, dict[str, str], bytes]:
    """One response from `sock` (bytes past it stay in `buffer`): status, headers (lower-case names), body."""
    while b"\r\n\r\n" not in buffer:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response; got {bytes(buffer)!r}"
        buffer += chunk
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed inside a body"
        rest += chunk
    buffer[:] = rest[length:]
    return int(lines[0].split()[1]), headers, rest[:length]


def _connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.http_port), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _sums(body: bytes) -> list[int]:
    return json.loads(body)["outputs"][0]["data"]


def test_keep_alive_and_pipelined_requests_answer_in_order(kiln_server):
    """Several requests in one write: each answered, in order, on the one connection, inference and metadata
    mixed (a request behind one in flight waits for it, whichever road each takes)."""
    other = {"inputs": [{**BODY["inputs"][0], "data": [5] * 16}, BODY["inputs"][1]]}
    payload = (_request(ADD_SUB, json.dumps(BODY).encode()) + _request(ADD_SUB, json.dumps(other).encode())
               + b"GET /v2/models/add_sub HTTP/1.1\r\nHost: x\r\n\r\n" + _request(ADD_SUB, json.dumps(BODY).encode()))
    with _connect(kiln_server) as sock:
        sock.sendall(payload)
        buffer = bytearray()
        answers = [_read_response(sock, buffer) for _ in range(4)]
    assert [status for status, _, _ in answers] == [200, 200, 200, 200]
    assert _sums(answers[0][2]) == list(range(1, 17)) and _sums(answers[1][2]) == [6] * 16
    assert json.loads(answers[2][2])["name"] == "add_sub" and _sums(answers[3][2]) == list(range(1, 17))
    assert all(headers.get("connection") != "close" for _, headers, _ in answers)


def test_expect_continue_chunked_bodies_and_http_1_0(kiln_server):
    body = json.dumps(BODY).encode()
    with _connect(kiln_server) as sock:  # Expect: 100-continue: the body is sent once the server asks for it
        sock.sendall(_request(ADD_SUB, b"", "Expect: 100-continue\r\n").replace(b"Content-Length: 0",
                                                                                  f"Content-Length: {len(body)}".encode()))
        assert sock.recv(1024).startswith(b"HTTP/1.1 100")
        sock.sendall(body)
        status, _, answer = _read_response(sock, bytearray())
        assert status == 200 and _sums(answer) == list(range(1, 17))
    with _connect(kiln_server) as sock:  # a chunked body, in pieces
        head = (f"POST {ADD_SUB} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
        pieces = [body[:10], body[10:]]
        sock.sendall(head + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n")
        status, _, answer = _read_response(sock, bytearray())
        assert status == 200 and _sums(answer) == list(range(1, 17))
    with _connect(kiln_server) as sock:  # HTTP/1.0: answered, then the server closes the connection
        sock.sendall(_request(ADD_SUB, body, version="1.0"))
        buffer = bytearray()
        status, headers, answer = _read_response(sock, buffer)
        assert status == 200 and headers["connection"] == "close" and _sums(answer) == list(range(1, 17))
        assert sock.recv(1024) == b""


def test_a_client_that_leaves_gives_its_slot_back_and_limits_hold(tmp_path: Path):
    """With one in-flight slot: a client that sends headers and leaves mid-body frees it (the next requests run);
    a chunked body over --http-max-body-bytes is 413; a second request while one holds the slot is 429. In the
    server process (frontend processes count the slots in the core, once a request reaches it)."""
    repository = examples.make_repository(tmp_path / "models")
    body = json.dumps(BODY).encode()
    with run_server(repository, tmp_path / "server.log", ["add_sub"],
                    ["--max-inflight-requests", "1", "--http-max-body-bytes", str(len(body) + 10),
                     "--frontend-processes", "0"]) as server:
        with _connect(server) as sock:
            sock.sendall(_request(ADD_SUB, body)[:-20])  # the body's end never comes
            time.sleep(0.3)
            with _connect(server) as second:  # the first holds the only slot meanwhile
                second.sendall(_request(ADD_SUB, body))
                status, _, answer = _read_response(second, bytearray())
                assert status == 429, answer
        for _ in range(3):  # the slot came back when the first client left
            with httpx.Client(base_url=server.base_url, timeout=30) as client:
                response = client.post(ADD_SUB, content=body, headers={"Content-Type": "application/json"})
                assert response.status_code == 200 and response.json()["outputs"][0]["data"] == list(range(1, 17))
        with _connect(server) as sock:
            head = f"POST {ADD_SUB} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
            sock.sendall(head + b"%x\r\n%s\r\n" % (len(body) + 40, body + b" " * 40) + b"0\r\n\r\n")
            status, _, answer = _read_response(sock, bytearray())
            assert status == 413 and "exceeds the limit" in json.loads(answer)["error"]
        assert httpx.get(f"{server.base_url}/v2/health/ready").status_code == 200
