"""The HTTP codec's JSON: orjson and the plain field check (the fast path) and the standard library with pydantic
(the reference, and the fallback) must read every request and write every response alike, so which one ran never
shows to a client."""

from __future__ import annotations

import json

import numpy as np
import pytest

from server.core import InferResponse
from server.core.types import InferOutput
from server.frontends.http import codec

pytest.importorskip("orjson")

HEADERS = [
    b'{"inputs":[{"name":"INPUT0","shape":[1,6],"datatype":"FP32","data":[0.1,0.2,1e-7,3e38,-0,3]}]}',
    b'{"id":"caf\\u00e9","inputs":[{"name":"x","shape":[2],"datatype":"BYTES","data":["\xc3\xa9t\xc3\xa9","\\u2028"]}]}',
    b'{"inputs":[{"name":"x","shape":[1],"datatype":"UINT64","data":[18446744073709551615]}]}',
    b'{"inputs":[{"name":"x","shape":[1],"datatype":"UINT64","data":[18446744073709551616]}]}',  # beyond 64 bits
    b'{"inputs":[{"name":"x","shape":[1180591620717411303424],"datatype":"INT32","data":[1]}]}',
    b'{"inputs":[{"name":"x","shape":[1],"datatype":"FP64","data":[0.30000001192092895508]}]}',
    b'{"a":1,"a":2,"inputs":[],"parameters":{"sequence_id":12345678901234567890}}',
    b'{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[[[[[[[[[[1]]]]]]]]]]}]}',
    b'{"inputs":[{"name":"x","shape":[2],"datatype":"INT8","data":[1,300]}]}',
    b'{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[NaN]}]}',
    b'{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[Infinity]}]}',
    b'\xef\xbb\xbf{"inputs":[]}',
    b'{"inputs":[{"name":"x","shape":[1],"datatype":"FP64","data":[1e400]}]}',
    b'[1,',
    b'[1]',
    # what pydantic coerces or refuses, read without it only when every field has exactly its type
    b'{"inputs":[{"name":"x","shape":[true,1.0,"1"],"datatype":"FP32","data":[1]}]}',
    b'{"id":1,"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}]}',
    b'{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1],"parameters":[]}]}',
    b'{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}],"outputs":{"name":"y"}}',
    b'{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}],"outputs":[{"name":"y","parameters":'
    b'{"binary_data":true}}],"parameters":{"binary_data_output":false}}',
    b'{"inputs":[{"name":"x","datatype":"FP32","data":[1]}]}',
    b'{"inputs":{}}',
    '{"inputs":[]}'.encode("utf-16"),
]


def _outcome(header: bytes) -> object:
    """What `decode_request` makes of `header`: the request's contents, or the refusal in its words."""
    try:
        request = codec.decode_request(header, None, "m", "1")
    except Exception as e:  # noqa: BLE001 - the refusal and its words are what is compared
        return f"{type(e).__name__}: {e}"
    return (request.id, request.parameters, [(t.name, t.datatype, t.shape, t.data.dtype.str, t.data.tolist(),
                                              t.parameters) for t in request.inputs],
            [(o.name, o.parameters) for o in request.outputs])


@pytest.mark.parametrize("header", HEADERS)
def test_requests_read_and_refused_as_the_standard_library_does(header: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    fast = _outcome(header)
    monkeypatch.setattr(codec, "_orjson", None)
    monkeypatch.setattr(codec, "_plain", lambda document: None)  # every document through pydantic
    assert fast == _outcome(header)


def _response(*outputs: InferOutput, parameters: dict | None = None) -> InferResponse:
    return InferResponse("m", "1", list(outputs), id="r1", parameters=parameters or {})


def _both(response: InferResponse, monkeypatch: pytest.MonkeyPatch) -> tuple[tuple, tuple]:
    fast = codec.encode_response(response, False)
    monkeypatch.setattr(codec, "_orjson", None)
    reference = codec.encode_response(response, False)
    monkeypatch.undo()
    return fast, reference


def test_float_responses_are_byte_identical(monkeypatch: pytest.MonkeyPatch) -> None:
    data = (np.random.default_rng(0).random((4, 16), dtype=np.float32) * 100).astype(np.float32)
    response = _response(InferOutput("OUTPUT0", "FP32", (4, 16), data),
                         InferOutput("I", "INT64", (2,), np.array([-(2**62), 7])),
                         InferOutput("B", "BOOL", (2,), np.array([True, False])))
    fast, reference = _both(response, monkeypatch)
    assert fast == reference
    assert np.array_equal(np.array(json.loads(fast[0])["outputs"][0]["data"], dtype=np.float32), data.reshape(-1))


def test_non_finite_floats_still_go_binary_and_nulls_stay_nulls(monkeypatch: pytest.MonkeyPatch) -> None:
    values = np.array([1.0, np.nan, np.inf], dtype=np.float32)
    response = _response(InferOutput("X", "FP32", (3,), values), parameters={"note": None})
    fast, reference = _both(response, monkeypatch)
    assert fast == reference
    body, length = fast
    header = json.loads(body[:length])
    assert header["parameters"] == {"note": None}
    assert header["outputs"][0]["parameters"]["binary_data_size"] == 12
    assert np.array_equal(np.frombuffer(body[length:], dtype=np.float32), values, equal_nan=True)


def test_text_outputs_read_back_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    response = _response(InferOutput("S", "BYTES", (2,), np.array([b"\xc3\xa9t\xc3\xa9", b"plain"], dtype=object)))
    fast, reference = _both(response, monkeypatch)
    assert json.loads(fast[0]) == json.loads(reference[0])  # UTF-8 against \\u escapes: the same text
