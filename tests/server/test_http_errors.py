"""Raw HTTP against the server: bad requests get the right status and `{"error": ...}`, and it keeps serving.

Also the parts of the wire format tritonclient does not exercise: BF16/FP16 as JSON numbers, nested JSON
data, non-UTF-8 BYTES falling back to binary, version routes, and the binary layout byte by byte.
"""

from __future__ import annotations

import gzip
import json
import struct

import httpx
import ml_dtypes
import numpy as np
import pytest

ADD_SUB = "/v2/models/add_sub/infer"


@pytest.fixture(scope="module")
def http(kiln_server) -> httpx.Client:
    with httpx.Client(base_url=kiln_server.base_url, timeout=30) as client:
        yield client


def _add_sub_body(a: list[int] | None = None, shape=(1, 16), datatype: str = "INT32", **extra) -> dict:
    a = list(range(16)) if a is None else a
    return {"inputs": [{"name": "INPUT0", "shape": list(shape), "datatype": datatype, "data": a},
                       {"name": "INPUT1", "shape": list(shape), "datatype": datatype, "data": [1] * len(a)}],
            **extra}


def _assert_error(response: httpx.Response, status: int, fragment: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert fragment in body["error"], body["error"]
    assert "Traceback" not in body["error"]


def _still_serving(http: httpx.Client) -> None:
    assert http.get("/v2/health/ready").status_code == 200
    response = http.post(ADD_SUB, json=_add_sub_body())
    assert response.status_code == 200
    assert response.json()["outputs"][0]["data"] == list(range(1, 17))


# -- each bad request: status, message, and the server still answers ------------------------------------------
BAD_REQUESTS = [
    ("unknown model", "/v2/models/nope/infer", _add_sub_body(), 404, "unknown model: 'nope'"),
    ("unknown version", "/v2/models/add_sub/versions/9/infer", _add_sub_body(), 404, "no ready version '9'"),
    ("wrong shape", ADD_SUB, _add_sub_body(list(range(15)), shape=(1, 15)), 400,
     "unexpected shape for input 'INPUT0'"),
    ("batch too large", ADD_SUB, _add_sub_body(list(range(16 * 9)), shape=(9, 16)), 400, "must be 1..8"),
    ("wrong datatype", ADD_SUB, _add_sub_body(datatype="FP32"), 400, "data-type is 'FP32'"),
    ("unknown datatype", ADD_SUB, _add_sub_body(datatype="INT3"), 400, "unsupported datatype 'INT3'"),
    ("data does not fill the shape", ADD_SUB, _add_sub_body(list(range(16)), shape=(2, 16)), 400,
     "needs 32 elements, data has 16"),
    ("float data for INT32", ADD_SUB, _add_sub_body([0.5] * 16), 400, "INT32 data must be integers"),
    ("int out of range", ADD_SUB, _add_sub_body([2**40] * 16), 400, "outside the range of INT32"),
    ("string data for INT32", ADD_SUB, _add_sub_body(["a"] * 16), 400, "INT32 data must be integers"),
    ("negative dim", ADD_SUB, _add_sub_body(shape=(-1, 16)), 400, "negative dimension"),
    ("missing input", ADD_SUB, {"inputs": _add_sub_body()["inputs"][:1]}, 400, "missing ['INPUT1']"),
    ("unknown input", ADD_SUB, {"inputs": [*_add_sub_body()["inputs"],
                                          {"name": "X", "shape": [1], "datatype": "INT32", "data": [1]}]},
     400, "unexpected inference input ['X']"),
    ("unknown output", ADD_SUB, _add_sub_body(outputs=[{"name": "OUTPUT9"}]), 400,
     "unexpected inference output ['OUTPUT9']"),
    ("no data", ADD_SUB, {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32"}]}, 400,
     "has no data"),
    ("schema: shape is not a list", ADD_SUB, {"inputs": [{"name": "INPUT0", "shape": "16", "datatype": "INT32",
                                                         "data": [1]}]}, 400, "inputs.0.shape"),
    ("schema: inputs missing", ADD_SUB, {"id": "x"}, 400, "inputs: Field required"),
    ("classification of an INT32 count 0", ADD_SUB, _add_sub_body(outputs=[{"name": "OUTPUT0",
                                                                            "parameters": {"classification": 0}}]),
     400, "classification count"),
]


@pytest.mark.parametrize("path, body, status, fragment", [r[1:] for r in BAD_REQUESTS],
                         ids=[r[0] for r in BAD_REQUESTS])
def test_bad_inference_request(http, path, body, status, fragment):
    _assert_error(http.post(path, json=body), status, fragment)
    _still_serving(http)


@pytest.mark.parametrize("content", [b"{bad json", b"[1, 2]", b"", b"\xff\xfe"], ids=["syntax", "array", "empty",
                                                                                     "not-utf8"])
def test_malformed_json(http, content):
    response = http.post(ADD_SUB, content=content)
    assert response.status_code == 400 and "error" in response.json()
    _still_serving(http)


def _binary_request(header: dict, payload: bytes, header_length: int | None = None) -> tuple[bytes, dict]:
    encoded = json.dumps(header).encode()
    length = len(encoded) if header_length is None else header_length
    return encoded + payload, {"Inference-Header-Content-Length": str(length),
                               "Content-Type": "application/octet-stream"}


def _binary_add_sub_header(size0: int = 64, size1: int = 64) -> dict:
    return {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32",
                        "parameters": {"binary_data_size": size0}},
                       {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32",
                        "parameters": {"binary_data_size": size1}}],
            "parameters": {"binary_data_output": True}}


def test_binary_request_and_response_layout(http):
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 3, dtype=np.int32)
    body, headers = _binary_request(_binary_add_sub_header(), a.tobytes() + b.tobytes())
    response = http.post(ADD_SUB, content=body, headers=headers)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/octet-stream"
    length = int(response.headers["Inference-Header-Content-Length"])
    header = json.loads(response.content[:length])
    sizes = [o["parameters"]["binary_data_size"] for o in header["outputs"]]
    assert sizes == [64, 64] and all("data" not in o for o in header["outputs"])
    raw = response.content[length:]
    assert len(raw) == 128
    np.testing.assert_array_equal(np.frombuffer(raw[:64], np.int32), (a + b).ravel())
    np.testing.assert_array_equal(np.frombuffer(raw[64:], np.int32), (a - b).ravel())


@pytest.mark.parametrize("case", ["header-longer-than-body", "header-not-a-number", "size-beyond-body",
                                  "unclaimed-bytes", "size-wrong-for-shape"])
def test_lying_binary_header(http, case):
    payload = bytes(128)
    if case == "header-longer-than-body":
        body, headers = _binary_request(_binary_add_sub_header(), payload, header_length=10_000)
        fragment = "Inference-Header-Content-Length is 10000"
    elif case == "header-not-a-number":
        body, headers = _binary_request(_binary_add_sub_header(), payload)
        headers["Inference-Header-Content-Length"] = "abc"
        fragment = "must be an integer"
    elif case == "size-beyond-body":
        body, headers = _binary_request(_binary_add_sub_header(64, 640), payload)
        fragment = "only 64 bytes of binary data remain"
    elif case == "unclaimed-bytes":
        body, headers = _binary_request(_binary_add_sub_header(), payload + b"extra")
        fragment = "5 bytes of binary data that no input claims"
    else:
        body, headers = _binary_request(_binary_add_sub_header(60, 68), payload)
        fragment = "expected 64 bytes for INT32 [1, 16], got 60"
    _assert_error(http.post(ADD_SUB, content=body, headers=headers), 400, fragment)
    _still_serving(http)


def test_huge_claimed_shape_is_refused_without_allocating(http):
    inputs = [{"name": f"IN_{t}", "shape": [1], "datatype": t, "data": [1]}
              for t in ("UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32",
                        "FP64", "BF16")]
    inputs.append({"name": "IN_BOOL", "shape": [1], "datatype": "BOOL", "data": [True]})
    inputs.append({"name": "IN_BYTES", "shape": [10**12], "datatype": "BYTES", "parameters": {"binary_data_size": 8}})
    body, headers = _binary_request({"inputs": inputs}, bytes(8))
    _assert_error(http.post("/v2/models/identity/infer", content=body, headers=headers), 400,
                  "cannot hold 1000000000000 elements")
    _assert_error(http.post(ADD_SUB, json=_add_sub_body(shape=(10**9, 10**9))), 400, "needs 1000000000000000000")
    _still_serving(http)


def test_bad_compression_is_a_client_error(http):
    response = http.post(ADD_SUB, content=b"definitely not gzip", headers={"Content-Encoding": "gzip"})
    _assert_error(response, 400, "not valid gzip data")
    response = http.post(ADD_SUB, content=b"{}", headers={"Content-Encoding": "br"})
    _assert_error(response, 400, "unsupported Content-Encoding 'br'")
    body = gzip.compress(json.dumps(_add_sub_body()).encode())
    response = http.post(ADD_SUB, content=body, headers={"Content-Encoding": "gzip", "Accept-Encoding": "gzip"})
    assert response.status_code == 200 and response.headers["content-encoding"] == "gzip"
    assert response.json()["outputs"][1]["data"] == list(range(-1, 15))  # httpx decompresses


def test_other_endpoints_errors(http):
    _assert_error(http.get("/v2/models/nope"), 404, "unknown model")
    _assert_error(http.get("/v2/models/nope/config"), 404, "unknown model")
    # Triton's codes and texts (checked against tritonserver 2.51): readiness is a 400 "not ready", statistics of a
    # model or version it does not serve a 400, and inference on an unknown model 404 whatever the body holds
    _assert_error(http.get("/v2/models/nope/stats"), 400, "requested model 'nope' is not available")
    _assert_error(http.get("/v2/models/add_sub/versions/9/stats"), 400,
                  "requested model version is not available for model 'add_sub'")
    _assert_error(http.get("/v2/models/nope/ready"), 400, "Model version not ready")
    _assert_error(http.get("/v2/models/add_sub/versions/9/ready"), 400, "Model version not ready")
    _assert_error(http.post("/v2/models/nope/infer", content=b'{"inputs":'), 404,
                  "Request for unknown model: 'nope' is not found")
    _assert_error(http.post("/v2/models/nope/infer", json={"inputs": [{"name": "INPUT0", "shape": [1, 16],
                                                                       "datatype": "FP32"}]}), 404, "unknown model")
    _assert_error(http.get("/v2/no/such/route"), 404, "Not Found")
    _assert_error(http.post("/v2/systemsharedmemory/region/r/register", json={"key": "/nope", "byte_size": 8}),
                  400, "cannot open key '/nope'")
    _assert_error(http.post("/v2/systemsharedmemory/region/r/register", json={"key": "/x"}), 400, "byte_size")
    _assert_error(http.get("/v2/systemsharedmemory/region/never/status"), 404, "not registered")
    _assert_error(http.post("/v2/trace/setting", json={"trace_level": ["LOUD"]}), 400, "trace_level")
    _assert_error(http.post("/v2/trace/setting", json={"bogus": "1"}), 400, "unknown trace setting")
    _assert_error(http.post("/v2/logging", json={"log_format": "xml"}), 400, "log_format")
    _assert_error(http.post("/v2/logging", json={"bogus": True}), 400, "bogus")
    _assert_error(http.post("/v2/repository/models/x/load", json={"parameters": {"file:1/model.onnx": "AAAA"}}),
                  400, "need a 'config' parameter")
    _assert_error(http.post("/v2/repository/models/x/load",
                            json={"parameters": {"config": "{}", "file:../evil": "AAAA"}}), 400, "without '..'")
    _assert_error(http.post("/v2/repository/models/nope/unload"), 404, "unknown model")
    _still_serving(http)


def test_model_routes_with_versions(http):
    assert http.get("/v2/models/add_sub/versions/1/ready").status_code == 200
    assert http.get("/v2/models/add_sub/versions/1").json()["versions"] == ["1"]
    assert http.get("/v2/models/add_sub/versions/1/config").json()["name"] == "add_sub"
    response = http.post("/v2/models/add_sub/versions/1/infer", json=_add_sub_body(id="abc"))
    assert response.json()["id"] == "abc" and response.json()["model_version"] == "1"


def test_json_fp16_bf16_and_nested_data(http):
    values = [1.5, -2.25, 1024.0, 0.0]
    inputs = [{"name": f"IN_{t}", "shape": [4], "datatype": t, "data": v} for t, v in [
        ("FP16", values), ("BF16", values), ("FP32", values), ("FP64", values), ("BOOL", [True, False, True, False]),
        ("BYTES", ["a", "bé", "", "zz"])]]
    for t in ("UINT8", "UINT16", "UINT32", "INT8", "INT16", "INT32", "INT64"):
        inputs.append({"name": f"IN_{t}", "shape": [4], "datatype": t, "data": [[0, 1], [2, 3]]})  # nested
    inputs.append({"name": "IN_UINT64", "shape": [4], "datatype": "UINT64", "data": [0, 1, 2, 2**64 - 1]})
    response = http.post("/v2/models/identity/infer", json={"inputs": inputs})
    assert response.status_code == 200, response.text
    outputs = {o["name"]: o for o in response.json()["outputs"]}
    assert outputs["OUT_FP16"]["data"] == values and outputs["OUT_FP16"]["datatype"] == "FP16"
    assert outputs["OUT_BF16"]["data"] == values and outputs["OUT_BF16"]["datatype"] == "BF16"
    assert outputs["OUT_BYTES"]["data"] == ["a", "bé", "", "zz"]
    assert outputs["OUT_BOOL"]["data"] == [True, False, True, False]
    assert outputs["OUT_INT16"]["data"] == [0, 1, 2, 3] and outputs["OUT_INT16"]["shape"] == [4]
    assert outputs["OUT_UINT64"]["data"] == [0, 1, 2, 2**64 - 1]
    # BF16 binary output bytes are real bfloat16 values
    inputs_bf16 = [i for i in inputs]
    response = http.post("/v2/models/identity/infer", json={"inputs": inputs_bf16, "outputs": [
        {"name": "OUT_BF16", "parameters": {"binary_data": True}}]})
    length = int(response.headers["Inference-Header-Content-Length"])
    raw = response.content[length:]
    np.testing.assert_array_equal(np.frombuffer(raw, ml_dtypes.bfloat16).astype(np.float32), values)


def test_non_utf8_bytes_output_falls_back_to_binary(http):
    blob = b"\xff\x00\xfe"
    payload = struct.pack("<I", len(blob)) + blob
    inputs = [{"name": f"IN_{t}", "shape": [1], "datatype": t, "data": [1]}
              for t in ("UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32",
                        "FP64", "BF16")]
    inputs.append({"name": "IN_BOOL", "shape": [1], "datatype": "BOOL", "data": [True]})
    inputs.append({"name": "IN_BYTES", "shape": [1], "datatype": "BYTES",
                   "parameters": {"binary_data_size": len(payload)}})
    body, headers = _binary_request({"inputs": inputs, "outputs": [{"name": "OUT_BYTES"}]}, payload)
    response = http.post("/v2/models/identity/infer", content=body, headers=headers)
    assert response.status_code == 200, response.text
    length = int(response.headers["Inference-Header-Content-Length"])
    (output,) = json.loads(response.content[:length])["outputs"]
    assert output["parameters"]["binary_data_size"] == len(payload)
    assert response.content[length:] == payload
