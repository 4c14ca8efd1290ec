"""Property tests (hypothesis, derandomized so CI runs the same cases every time) for the parsers that face
untrusted bytes: raw/binary tensors, the HTTP inference body, gRPC messages, config.pbtxt, plan files.

The property is the same everywhere: a parser returns a well-formed result or raises its one documented
error (ServerError INVALID_ARGUMENT / PlanFormatError) — never another exception, never a crash.
"""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

import engine_core as kiln
from engine_core import PlanFormatError
from engine_core.plan import _HEADER, ALIGN, deserialize_plan, read_plan_metadata
from server.core import ErrorKind, ServerError
from server.core.model_config import parse_config_text
from server.core.tensors import deserialize_bytes, from_raw, serialize_bytes, to_raw
from server.frontends.grpc import convert
from server.frontends.http.codec import decode_request
from server.protos import grpc_service_pb2 as pb

CI = settings(derandomize=True, database=None, max_examples=150, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
DATATYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32",
             "FP64", "BF16", "BYTES"]
shapes = st.lists(st.integers(-2, 6), max_size=4)


def _client_error(error: ServerError) -> None:
    assert error.kind == ErrorKind.INVALID_ARGUMENT, error


# -- raw tensors ----------------------------------------------------------------------------------------------
@CI
@given(raw=st.binary(max_size=256), datatype=st.sampled_from(DATATYPES), shape=shapes)
def test_from_raw_decodes_or_refuses(raw, datatype, shape):
    try:
        array = from_raw(raw, datatype, shape)
    except ServerError as e:
        _client_error(e)
        return
    assert array.shape == tuple(shape)
    assert to_raw(array, datatype) == raw  # what parsed re-encodes to the same bytes: nothing dropped or invented


@CI
@given(items=st.lists(st.binary(max_size=40), max_size=12), cut=st.integers(0, 600), extra=st.binary(max_size=8))
def test_bytes_tensors_round_trip_and_damaged_ones_are_refused(items, cut, extra):
    array = np.empty(len(items), dtype=object)
    array[:] = items
    raw = serialize_bytes(array)
    assert list(deserialize_bytes(raw, len(items))) == items
    damaged = raw[:cut] + extra
    assume(damaged != raw)
    try:
        decoded = deserialize_bytes(damaged, len(items))
    except ServerError as e:
        _client_error(e)
        return
    assert serialize_bytes(decoded) == damaged


# -- the HTTP inference body ----------------------------------------------------------------------------------
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                        max_size=4), max_leaves=20)
tensor_headers = st.fixed_dictionaries(
    {"name": st.sampled_from(["INPUT0", "INPUT1", "X"]), "shape": st.one_of(shapes, json_values),
     "datatype": st.one_of(st.sampled_from(DATATYPES), st.text(max_size=5))},
    optional={"data": json_values, "parameters": st.one_of(
        st.fixed_dictionaries({"binary_data_size": st.one_of(st.integers(-4, 80), json_values)}), json_values)})
bodies = st.fixed_dictionaries({"inputs": st.one_of(st.lists(tensor_headers, max_size=3), json_values)},
                               optional={"id": json_values, "outputs": json_values, "parameters": json_values})


@settings(CI, max_examples=60)
@given(document=bodies, binary=st.binary(max_size=96), length_delta=st.one_of(st.none(), st.integers(-8, 8)))
def test_http_body_decodes_or_refuses(document, binary, length_delta):
    header = json.dumps(document).encode()
    length = None if length_delta is None else str(len(header) + length_delta)
    try:
        request = decode_request(header + binary, length, "m", "")
    except ServerError as e:
        _client_error(e)
        return
    for tensor in request.inputs:
        assert tensor.data is None or tuple(tensor.data.shape) == tuple(tensor.shape)


@CI
@given(raw=st.binary(max_size=200))
def test_http_body_from_raw_bytes(raw):
    for length in (None, "0", str(len(raw) // 2)):
        try:
            decode_request(raw, length, "m", "")
        except ServerError as e:
            _client_error(e)


# -- gRPC messages --------------------------------------------------------------------------------------------
def _valid_grpc_bytes() -> bytes:
    request = pb.ModelInferRequest(model_name="add_sub", id="x")
    for name in ("INPUT0", "INPUT1"):
        tensor = request.inputs.add(name=name, datatype="INT32")
        tensor.shape.extend([1, 4])
        tensor.contents.int_contents.extend([1, 2, 3, 4])
    request.outputs.add(name="OUTPUT0").parameters["classification"].int64_param = 2
    return request.SerializeToString()


@CI
@given(position=st.integers(0, 200), replacement=st.binary(min_size=1, max_size=4), cut=st.integers(0, 200))
def test_grpc_request_mutations_parse_or_refuse(position, replacement, cut):
    raw = bytearray(_valid_grpc_bytes())
    position %= len(raw)
    raw[position:position + len(replacement)] = replacement
    try:
        message = pb.ModelInferRequest.FromString(bytes(raw[: max(cut, 1)] if cut < len(raw) else raw))
    except Exception:  # noqa: BLE001 - the interceptor turns any parse failure into INVALID_ARGUMENT
        return
    try:
        request = convert.infer_request(message)
    except ServerError as e:
        _client_error(e)
        return
    for tensor in request.inputs:
        assert tensor.data is None or tuple(tensor.data.shape) == tuple(tensor.shape)


# -- config.pbtxt ---------------------------------------------------------------------------------------------
CONFIG_TOKENS = ["name:", '"m"', "max_batch_size:", "8", "-1", "input", "output", "[", "]", "{", "}", "dims:",
                 "data_type:", "TYPE_FP32", "TYPE_NOPE", "instance_group", "count:", "kind:", "KIND_CPU",
                 "dynamic_batching", "max_queue_delay_microseconds:", "99999999999999999999", "label_filename:",
                 '"../x"', "version_policy", "specific", "versions:", "#", "\n", ",", ":", "<", ">", "'", "\\", "é"]


@CI
@given(tokens=st.lists(st.sampled_from(CONFIG_TOKENS), max_size=40))
def test_config_text_parses_or_refuses(tokens):
    try:
        parse_config_text(" ".join(tokens), "m")
    except ServerError as e:
        _client_error(e)


@CI
@given(text=st.text(max_size=200))
def test_config_random_text(text):
    try:
        parse_config_text(text, "m")
    except ServerError as e:
        _client_error(e)


def test_config_deep_nesting_is_refused():
    with pytest.raises(ServerError) as info:
        parse_config_text("input " + "{ dims: 1 " * 10_000 + "}" * 10_000, "m")
    _client_error(info.value)


# -- plan files -----------------------------------------------------------------------------------------------
def _plan_bytes() -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Add", ["r", "x"], ["y"])]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 17)])
    builder = kiln.Builder()
    network = builder.create_network()
    kiln.OnnxParser(network).parse(model.SerializeToString())
    return kiln.build_plan(network, builder.create_builder_config())


@pytest.fixture(scope="module")
def plan_bytes() -> bytes:
    plan = _plan_bytes()
    return plan if isinstance(plan, bytes | bytearray) else kiln.plan.serialize_plan(plan)


def _reframe(meta: dict, blob: bytes) -> bytes:
    """A plan with `meta` and a correct digest: what an attacker who can write plan files produces."""
    meta_bytes = json.dumps(meta).encode()
    pad = b"\0" * ((-(_HEADER.size + len(meta_bytes))) % ALIGN)
    digest = hashlib.sha256(meta_bytes + pad + blob).digest()
    return _HEADER.pack(b"KILNPLAN", struct.unpack_from("<I", PLAN_VERSION)[0], 0, len(meta_bytes), len(blob),
                        digest) + meta_bytes + pad + blob


PLAN_VERSION = struct.pack("<I", kiln.plan.PLAN_FORMAT_VERSION)
FLAGS = range(12, 16)  # the header's reserved flags word: must be zero


def _run(data: bytes) -> None:
    context = kiln.Runtime().load(data).create_execution_context()
    out = context.infer({"x": np.ones((2, 3), np.float32)})
    np.testing.assert_array_equal(out["y"], np.full((2, 3), 2, np.float32))


@settings(derandomize=True, database=None, max_examples=60, deadline=None)
@given(cut=st.integers(0, 10**6))
def test_truncated_plans_are_refused(plan_bytes, cut):
    cut %= len(plan_bytes)
    with pytest.raises(PlanFormatError):
        read_plan_metadata(plan_bytes[:cut])
    with pytest.raises(PlanFormatError):
        deserialize_plan(plan_bytes[:cut])


@settings(derandomize=True, database=None, max_examples=150, deadline=None)
@given(position=st.integers(0, 10**6), flip=st.integers(1, 255))
def test_corrupted_plans_never_load(plan_bytes, position, flip):
    position %= len(plan_bytes)
    data = bytearray(plan_bytes)
    data[position] ^= flip
    with pytest.raises(PlanFormatError):
        deserialize_plan(bytes(data))


def test_valid_plan_runs_and_nonzero_flags_are_refused(plan_bytes):
    _run(plan_bytes)
    data = bytearray(plan_bytes)
    data[FLAGS.start] ^= 0xFF
    with pytest.raises(PlanFormatError, match="unknown flags"):  # not in the digest, so checked on their own
        deserialize_plan(bytes(data))


@settings(derandomize=True, database=None, max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_hostile_metadata_with_a_valid_digest_fails_cleanly(plan_bytes, data):
    """A re-signed plan with damaged metadata: deserialize_plan raises PlanFormatError or gives a Plan."""
    meta, blob = read_plan_metadata(plan_bytes)
    meta = json.loads(json.dumps(meta))
    paths = []

    def walk(node, path):
        paths.append(path)
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, (*path, k))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, (*path, i))

    walk(meta, ())
    path = data.draw(st.sampled_from(paths[1:]))
    parent = meta
    for key in path[:-1]:
        parent = parent[key]
    if data.draw(st.booleans()) and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = data.draw(json_values)
    try:
        deserialize_plan(_reframe(meta, bytes(blob)))
    except PlanFormatError:
        pass


# -- the whole HTTP API, from its OpenAPI schema ---------------------------------------------------------------
def test_seeded_openapi_fuzz_has_no_server_errors(guarded_server):
    """300 generated (mostly broken) requests over every route: no 5xx but 503, no dropped connection.

    Sent without the admin key, so the repository routes answer 401 and the models the other tests use stay
    loaded; `python -m load_tests.fuzz` (its own server, no auth) covers load/unload too.
    """
    from load_tests.fuzz import run_fuzz

    report = run_fuzz(guarded_server.base_url, 300, seed=13)
    assert report.requests == 300 and report.transport_errors == 0, report
    assert report.server_errors == 0, report.examples_5xx
    assert report.alive_after
    assert int(report.statuses.get("400", 0)) > 50  # most of them were refused as bad input, as intended
