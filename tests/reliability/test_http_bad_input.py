"""Hostile and broken HTTP requests: each gets a clear 4xx while good requests running beside it succeed.

Counted: every request sent here is a bad input; the background client checks every good answer.
"""

from __future__ import annotations

import gzip
import json
import struct
import zlib

import numpy as np
import pytest

from .conftest import GOOD_BODY, MAX_BODY, assert_error

ADD_SUB = "/v2/models/add_sub/infer"
IDENTITY = "/v2/models/identity/infer"


def _binary(header: dict, payload: bytes, header_length: int | str | None = None) -> tuple[bytes, dict]:
    encoded = json.dumps(header).encode()
    length = len(encoded) if header_length is None else header_length
    return encoded + payload, {"Inference-Header-Content-Length": str(length),
                               "Content-Type": "application/octet-stream"}


SMALL_TYPES = ("UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP64", "BF16")


def _other_identity_inputs(n: int) -> list[dict]:
    """The identity model's inputs other than FP32 (all its inputs share one length `n`)."""
    inputs = [{"name": f"IN_{t}", "shape": [n], "datatype": t, "data": [1] * n} for t in SMALL_TYPES]
    return [*inputs, {"name": "IN_BOOL", "shape": [n], "datatype": "BOOL", "data": [True] * n},
            {"name": "IN_BYTES", "shape": [n], "datatype": "BYTES", "data": ["x"] * n}]


def _bytes_input(payload: bytes, count: int = 1) -> tuple[bytes, dict]:
    header = {"inputs": [{"name": "IN_BYTES", "shape": [count], "datatype": "BYTES",
                          "parameters": {"binary_data_size": len(payload)}}], "outputs": [{"name": "OUT_BYTES"}]}
    return _binary(header, payload)


def test_oversize_body_is_413_before_it_is_read(http, good_traffic):
    with good_traffic():
        assert_error(http.post(ADD_SUB, content=b"x" * (MAX_BODY + 1)), 413, "exceeds the limit of 1048576")

        def chunks():  # no Content-Length: counted as it arrives
            for _ in range(40):
                yield b" " * 65536

        assert_error(http.post(ADD_SUB, content=chunks()), 413, "exceeds the limit")
        # other JSON endpoints are bounded too
        assert_error(http.post("/v2/logging", content=b"{" + b" " * MAX_BODY + b"}"), 413, "exceeds the limit")


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_compression_bomb_is_413(http, good_traffic, encoding):
    bomb = b"[" + b" " * (32 << 20) + b"]"  # 32 MiB of spaces in ~32 KiB: never inflated past the 1 MiB limit
    body = gzip.compress(bomb, 9) if encoding == "gzip" else zlib.compress(bomb, 9)
    assert len(body) < MAX_BODY
    with good_traffic():
        assert_error(http.post(ADD_SUB, content=body, headers={"Content-Encoding": encoding}), 413,
                     "decompressed request body exceeds")


def test_truncated_and_valid_compressed_bodies(http):
    whole = gzip.compress(json.dumps(GOOD_BODY).encode())
    assert_error(http.post(ADD_SUB, content=whole[: len(whole) // 2], headers={"Content-Encoding": "gzip"}), 400,
                 "truncated gzip")
    response = http.post(ADD_SUB, content=whole, headers={"Content-Encoding": "gzip"})
    assert response.status_code == 200 and response.json()["outputs"][0]["data"] == list(range(1, 17))


@pytest.mark.parametrize("body, fragment", [
    (b"[" * 100_000 + b"]" * 100_000, "failed to parse"),
    (b'{"inputs": [], "id": ' + b"[" * 5000 + b"]" * 5000 + b"}", "failed to parse"),
    (b'{"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "INT32", "data": [' + b"9" * 5000 + b"]}]}",
     "failed to parse"),
    (b'{"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": '
     + b"[" * 70 + b"1" + b"]" * 70 + b"}]}", "not a rectangular array"),
], ids=["nesting-100k", "nesting-5k-in-id", "5000-digit-int", "nesting-70-in-data"])
def test_deep_nesting_and_huge_numbers(http, good_traffic, body, fragment):
    with good_traffic():
        assert_error(http.post(ADD_SUB, content=body), 400, fragment)
        if fragment == "failed to parse":  # every JSON endpoint parses the same way
            assert_error(http.post("/v2/repository/index", content=body, headers={"admin-key": "s3cret"}), 400,
                         "failed to parse the request JSON")


def test_nesting_70_in_data_message(http):
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": [[[[[[[1]]]]]]]}]}
    assert_error(http.post(ADD_SUB, json=body), 400, "needs 16 elements")


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_literals_are_refused(http, token):
    body = json.dumps({"inputs": [{"name": "IN_FP32", "shape": [1], "datatype": "FP32", "data": [0.0]}]})
    body = body.replace("0.0", token)
    assert_error(http.post(IDENTITY, content=body.encode()), 400, f"contains '{token}', which JSON cannot carry")


def test_non_finite_outputs_fall_back_to_binary(http):
    values = np.array([1.0, np.nan, np.inf, -np.inf], dtype=np.float32)
    body, headers = _binary({"inputs": [*_other_identity_inputs(4),
                                        {"name": "IN_FP32", "shape": [4], "datatype": "FP32",
                                         "parameters": {"binary_data_size": 16}}],
                             "outputs": [{"name": "OUT_FP32"}]}, values.tobytes())
    response = http.post(IDENTITY, content=body, headers=headers)
    assert response.status_code == 200, response.text
    length = int(response.headers["Inference-Header-Content-Length"])
    (output,) = json.loads(response.content[:length])["outputs"]  # strict JSON: no NaN token in it
    assert output["parameters"]["binary_data_size"] == 16
    np.testing.assert_array_equal(np.frombuffer(response.content[length:], np.float32), values)


@pytest.mark.parametrize("payload, count, fragment", [
    (struct.pack("<I", 100) + b"abc", 1, "claims 100 bytes, only 3 remain"),
    (struct.pack("<I", 0xFFFFFFFF) + b"abc", 1, "claims 4294967295 bytes"),
    (struct.pack("<I", 3) + b"abc" + b"\x01", 1, "1 bytes after its 1 elements"),
    (struct.pack("<I", 3) + b"abc" + b"\x01\x00", 2, "ends after 1 of 2 elements"),
    (b"\x01\x00", 1, "cannot hold 1 elements"),
    (b"", 1, "cannot hold 1 elements"),
], ids=["length-beyond", "length-max", "trailing", "short-prefix", "no-prefix", "empty"])
def test_broken_bytes_length_prefixes(http, good_traffic, payload, count, fragment):
    with good_traffic():
        body, headers = _bytes_input(payload, count)
        assert_error(http.post(IDENTITY, content=body, headers=headers), 400, fragment)


@pytest.mark.parametrize("length, fragment", [
    ("-5", "is -5 but"), ("99999999999999999999", "is 99999999999999999999 but"), ("0x10", "must be an integer"),
    ("", "must be an integer"), ("3", "failed to parse"),
])
def test_lying_header_lengths(http, length, fragment):
    a = np.arange(16, dtype=np.int32).tobytes()
    header = {"inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32", "parameters": {"binary_data_size": 64}}
                         for n in ("INPUT0", "INPUT1")]}
    body, headers = _binary(header, a + a, header_length=length)
    assert_error(http.post(ADD_SUB, content=body, headers=headers), 400, fragment)


@pytest.mark.parametrize("path, body, status, fragment", [
    ("/v2/models/nope/infer", GOOD_BODY, 404, "unknown model"),
    ("/v2/models/add_sub/versions/7/infer", GOOD_BODY, 404, "no ready version '7'"),
    ("/v2/models/add_sub/versions/-1/infer", GOOD_BODY, 404, "no ready version '-1'"),
    ("/v2/models/add_sub/versions/1e3/infer", GOOD_BODY, 404, "no ready version"),
    (ADD_SUB, {**GOOD_BODY, "outputs": [{"name": "NOPE"}]}, 400, "unexpected inference output"),
    (ADD_SUB, {**GOOD_BODY, "id": 5}, 400, "id"),
    (ADD_SUB, {"inputs": GOOD_BODY["inputs"] * 2}, 400, "more than once"),
    (ADD_SUB, {"inputs": [{**GOOD_BODY["inputs"][0], "parameters": {"binary_data_size": -1}}]}, 400,
     "non-negative integer"),
    (ADD_SUB, {"inputs": [{**GOOD_BODY["inputs"][0], "shape": [2**62, 2**62]}]}, 400, "more elements than"),
    (ADD_SUB, {"inputs": [{**GOOD_BODY["inputs"][0], "shape": [2**70]}]}, 400, "more elements than"),
    (ADD_SUB, {"inputs": [{**GOOD_BODY["inputs"][0], "shape": [2**32, 2**32], "parameters": {"binary_data_size": 0}}]},
     400, "more elements than"),
    (ADD_SUB, {"inputs": [{**GOOD_BODY["inputs"][0], "shape": [1] * 65}]}, 400, "at most 64"),
    (ADD_SUB, {"inputs": [{**GOOD_BODY["inputs"][0], "data": {"a": 1}}]}, 400, "needs 16 elements"),
    (ADD_SUB, {"inputs": [{**GOOD_BODY["inputs"][0], "data": [True] * 16}]}, 400, "INT32 data must be integers"),
], ids=["model", "version", "negative-version", "float-version", "output", "id-not-string", "duplicate-input",
        "negative-binary-size", "overflowing-shape", "shape-beyond-int64", "wrapping-shape", "rank-65",
        "object-data", "bool-data"])
def test_unknown_and_ill_typed(http, path, body, status, fragment):
    assert_error(http.post(path, json=body), status, fragment)


def test_unloading_model_gives_clean_errors_and_loses_nothing(http, good_traffic):
    """Requests racing an unload get 200 or 503 (never 500, never a hang); a reload serves again."""
    admin = {"admin-key": "s3cret"}
    statuses: list[int] = []
    with good_traffic():
        for _ in range(3):
            for _ in range(5):
                statuses.append(http.post("/v2/models/victim/infer", json=GOOD_BODY).status_code)
            assert http.post("/v2/repository/models/victim/unload", headers=admin).status_code == 200
            response = http.post("/v2/models/victim/infer", json=GOOD_BODY)
            assert_error(response, 503, "not loaded")
            assert http.post("/v2/repository/models/victim/load", headers=admin).status_code == 200
    assert set(statuses) == {200}
    response = http.post("/v2/models/victim/infer", json=GOOD_BODY)
    assert response.status_code == 200 and response.json()["outputs"][0]["data"] == list(range(1, 17))
