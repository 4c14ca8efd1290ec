"""The HTTP inference fast path (server/frontends/http/fastpath.py): same answers as the FastAPI route, and
everything it does not own still reaches FastAPI."""

from __future__ import annotations

import httpx
import pytest

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
