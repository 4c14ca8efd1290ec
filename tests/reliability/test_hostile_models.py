"""Hostile and broken ONNX files (issue 13): each fails its build with a reason, within bounded memory and
time, and a real server keeps serving its other models while they fail.

The first group runs the build worker's own code (`build_process.parse_and_build`, what the child process
runs) in this process: every guard answers before anything large is allocated. The last test sends the same
files to a real server through the repository API while a client keeps inferring on a good model.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import engine_core as kiln
from server.core import build_process
from tests.server.conftest import examples, run_server
from tests.server.test_build_process import cpu_config, scale_model, slow_build_model

TERA = 10**12  # elements: 4 TB of float32


def _model(nodes, inputs, outputs, initializers=(), functions=(), **graph_fields) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "hostile", inputs, outputs, list(initializers), **graph_fields)
    opsets = [helper.make_opsetid("", 17), *([helper.make_opsetid("local", 1)] if functions else [])]
    model = helper.make_model(graph, opset_imports=opsets, functions=list(functions))
    model.ir_version = 8
    return model


def _io(shape=(1,)):
    return ([helper.make_tensor_value_info("X", TensorProto.FLOAT, list(shape))],
            [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])


def _huge_shape() -> onnx.TensorProto:
    return helper.make_tensor("shape", TensorProto.INT64, [2], [10**6, 10**6])


def cycle() -> onnx.ModelProto:
    return _model([helper.make_node("Add", ["X", "B"], ["A"]), helper.make_node("Relu", ["A"], ["B"]),
                   helper.make_node("Identity", ["A"], ["Y"])], *_io())


def constant_of_shape_tera() -> onnx.ModelProto:
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    return _model([helper.make_node("ConstantOfShape", ["shape"], ["C"], value=one),
                   helper.make_node("Add", ["C", "X"], ["Y"])], *_io(), [_huge_shape()])


def expand_constant_tera() -> onnx.ModelProto:
    k = helper.make_tensor("k", TensorProto.FLOAT, [1], [2.0])
    return _model([helper.make_node("Expand", ["k", "shape"], ["C"]), helper.make_node("Add", ["C", "X"], ["Y"])],
                  *_io(), [k, _huge_shape()])


def expand_input_tera() -> onnx.ModelProto:
    return _model([helper.make_node("Expand", ["X", "shape"], ["Y"])], *_io(), [_huge_shape()])


def _external(location: str, dims=(4,)) -> onnx.ModelProto:
    weight = TensorProto(name="W", data_type=TensorProto.FLOAT, dims=list(dims))
    weight.data_location = TensorProto.EXTERNAL
    entry = weight.external_data.add()
    entry.key, entry.value = "location", location
    return _model([helper.make_node("Add", ["X", "W"], ["Y"])], *_io((4,)), [weight])


def gigantic_ints_attribute() -> onnx.ModelProto:
    return _model([helper.make_node("Transpose", ["X"], ["Y"], perm=list(range(2_000_000)))], *_io())


def gigantic_string_attribute() -> onnx.ModelProto:
    return _model([helper.make_node("Identity", ["X"], ["Y"], note="x" * (20 << 20))], *_io())


def sparse_tera() -> onnx.ModelProto:
    values = helper.make_tensor("S", TensorProto.FLOAT, [1], [1.0])
    indices = helper.make_tensor("S_indices", TensorProto.INT64, [1], [0])
    sparse = helper.make_sparse_tensor(values, indices, [10**6, 10**6])
    return _model([helper.make_node("Add", ["X", "S"], ["Y"])], *_io(), sparse_initializer=[sparse])


def lying_initializer() -> onnx.ModelProto:
    weight = helper.make_tensor("W", TensorProto.FLOAT, [4], [1.0] * 4)
    del weight.dims[:]
    weight.dims.extend([10**6, 10**6])  # 4 values, dims of 4 TB
    return _model([helper.make_node("Add", ["X", "W"], ["Y"])], *_io(), [weight])


def nested_bodies(depth: int = 20) -> onnx.ModelProto:
    """If inside If `depth` deep (each then-branch holds the next level)."""
    out = [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)]
    leaf = helper.make_graph([helper.make_node("Identity", ["X"], ["Y"])], "leaf", [], out)
    body = leaf
    for level in range(depth):
        flag = helper.make_tensor("flag", TensorProto.BOOL, [], [True])
        node = helper.make_node("If", ["flag"], ["Y"], then_branch=body, else_branch=leaf)
        body = helper.make_graph([helper.make_node("Constant", [], ["flag"], value=flag), node], f"b{level}", [], out)
    return _model(list(body.node), *_io())


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def _field(tag: int, payload: bytes) -> bytes:
    return bytes([tag]) + _varint(len(payload)) + payload


def nested_past_protobuf(depth: int = 80) -> bytes:
    """Raw protobuf bytes nesting If bodies deeper than any generator would let us build (graph.node = 1,
    node.op_type = 4, node.attribute = 5, attribute.name = 1, attribute.g = 6, attribute.type = 20)."""
    graph = b""
    for _ in range(depth):
        attribute = _field(0x0A, b"then_branch") + _field(0x32, graph) + b"\xa0\x01\x05"
        graph = _field(0x0A, _field(0x22, b"If") + _field(0x2A, attribute))
    return b"\x08\x08" + _field(0x3A, graph) + _field(0x42, b"\x10\x11")  # ir_version 8, graph, opset 17


def recursive_function() -> onnx.ModelProto:
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("local", 1)]
    function = helper.make_function("local", "F", ["a"], ["b"], [helper.make_node("F", ["a"], ["b"], domain="local")],
                                    opsets)
    return _model([helper.make_node("F", ["X"], ["Y"], domain="local")], *_io(), functions=[function])


def _write(directory: Path, content: onnx.ModelProto | bytes) -> Path:
    path = directory / "1" / "model.onnx"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.SerializeToString())
    return path


def _with_secret_outside(directory: Path, model: onnx.ModelProto) -> Path:
    """A 16-byte file beside the model directory: exactly what a [4] float tensor would read."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory.parent / "secret.bin").write_bytes(b"0123456789abcdef")
    return _write(directory, model)


def _symlink_out(directory: Path) -> Path:
    path = _with_secret_outside(directory, _external("weights.bin"))
    (path.parent / "weights.bin").symlink_to(directory.parent / "secret.bin")
    return path


def _truncated(directory: Path) -> Path:
    path = _write(directory, _external("weights.bin"))
    (path.parent / "weights.bin").write_bytes(b"12345678")  # 8 of the 16 bytes a [4] float tensor needs
    return path


# name -> (writes the model into a directory, fragment of the reason)
CASES: dict[str, tuple[Callable[[Path], Path], str]] = {
    "cycle": (lambda d: _write(d, cycle()), "cycle"),
    "constant_of_shape_tera": (lambda d: _write(d, constant_of_shape_tera()), "would take 4000000000000 bytes"),
    "expand_constant_tera": (lambda d: _write(d, expand_constant_tera()), "would take 4000000000000 bytes"),
    "expand_input_tera": (lambda d: _write(d, expand_input_tera()),
                          r"GiB even at the smallest input shapes.*no request could run"),
    "external_parent_dir": (lambda d: _with_secret_outside(d, _external("../../secret.bin")),
                            "outside the model's directory"),
    "external_absolute": (lambda d: _with_secret_outside(d, _external(str(d.parent / "secret.bin"))),
                          "outside the model's directory"),
    "external_symlink_out": (_symlink_out, "outside the model's directory"),
    "external_truncated": (_truncated, "holds 8 bytes from offset 0, the tensor needs 16"),
    "gigantic_ints_attribute": (lambda d: _write(d, gigantic_ints_attribute()),
                                "'perm' has 2000000 entries; Kiln accepts at most"),
    "gigantic_string_attribute": (lambda d: _write(d, gigantic_string_attribute()),
                                  "'note' holds a string of 20971520 bytes"),
    "sparse_tera": (lambda d: _write(d, sparse_tera()), "sparse tensor 'S'.*would take 4000000000000 bytes"),
    "lying_initializer": (lambda d: _write(d, lying_initializer()), "initializer 'W'.*would take"),
    "nested_bodies": (lambda d: _write(d, nested_bodies()), "nest 20 levels deep; Kiln accepts at most 16"),
    "nested_past_protobuf": (lambda d: _write(d, nested_past_protobuf()), "not a valid ONNX model"),
    "recursive_function": (lambda d: _write(d, recursive_function()), "recursive"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_model_fails_its_build_with_a_reason(name: str, tmp_path: Path):
    write, reason = CASES[name]
    path = write(tmp_path / name)
    with pytest.raises(kiln.BuildError, match=reason):
        build_process.parse_and_build(str(path), cpu_config())


@pytest.mark.parametrize(("make", "layer"), [(constant_of_shape_tera, "ConstantOfShape"),
                                             (expand_constant_tera, "Expand")])
def test_constant_folding_refuses_a_huge_constant_without_allocating_it(make, layer: str):
    """The engine's own guard (what `kiln build` hits, with no server check in front): the fold predicts the
    output's size from shape inference and fails the build instead of materializing 4 TB."""
    network = kiln.Builder().create_network()
    assert kiln.OnnxParser(network).parse(make())
    with pytest.raises(kiln.BuildError, match=f"layer {layer} .*computed from constants only, would take "
                                              "4000000000000 bytes, over the limit"):
        kiln.build_plan(network, cpu_config())


def test_external_data_is_refused_without_a_model_path(tmp_path: Path):
    """Parsed from bytes, a relative location would resolve against the process's cwd: refused."""
    parser = kiln.OnnxParser(kiln.Builder().create_network())
    assert not parser.parse(_external("secret.bin").SerializeToString())
    assert "parse the model from its file" in str(parser.get_error(0))


def test_external_data_inside_the_model_directory_still_loads(tmp_path: Path):
    path = _write(tmp_path / "ok", _external("weights.bin"))
    (path.parent / "weights.bin").write_bytes(np.arange(4, dtype=np.float32).tobytes())
    plan = build_process.parse_and_build(str(path), cpu_config())
    x = np.ones(4, np.float32)
    y = kiln.Runtime().load(plan).create_execution_context().infer({"X": x})["Y"]
    np.testing.assert_array_equal(y, x + np.arange(4, dtype=np.float32))


SERVED = ["cycle", "constant_of_shape_tera", "expand_input_tera", "external_parent_dir", "gigantic_ints_attribute",
          "sparse_tera", "nested_past_protobuf"]
GOOD_CONFIG = ('max_batch_size: 8\ninput [{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] }]\n'
               'output [{ name: "Y" data_type: TYPE_FP32 dims: [ 4 ] }]\ninstance_group [{ count: 1 kind: KIND_CPU }]\n')


def test_server_keeps_serving_while_hostile_models_fail_to_load(tmp_path: Path):
    repository = tmp_path / "models"
    examples.write_model(repository, "good", scale_model(3.0), GOOD_CONFIG)
    for name in SERVED:
        CASES[name][0](repository / name)
    _write(repository / "slow", slow_build_model())
    with run_server(repository, tmp_path / "server.log", ["good"],
                    ["--build-timeout-secs", "3", "--allow-grpc", "false", "--drain-delay", "0",
                     "--plan-cache-dir", str(tmp_path / "plans")]) as server:
        url = server.base_url
        body = {"inputs": [{"name": "X", "shape": [1, 4], "datatype": "FP32", "data": [1.0, 2.0, 3.0, 4.0]}]}
        answers: list[object] = []
        stop = threading.Event()

        def keep_inferring() -> None:
            with httpx.Client(timeout=30) as client:
                while not stop.is_set():
                    response = client.post(f"{url}/v2/models/good/infer", json=body)
                    answers.append(response.json()["outputs"][0]["data"] if response.status_code == 200
                                   else response.status_code)

        client_thread = threading.Thread(target=keep_inferring)
        client_thread.start()
        loads: dict[str, httpx.Response] = {}

        def load(name: str) -> None:
            loads[name] = httpx.post(f"{url}/v2/repository/models/{name}/load", timeout=60)

        try:
            threads = [threading.Thread(target=load, args=(name,)) for name in [*SERVED, "slow"]]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        finally:
            stop.set()
            client_thread.join()
        index = {m["name"]: m for m in httpx.post(f"{url}/v2/repository/index", json={}).json()}
        assert httpx.get(f"{url}/v2/health/live").status_code == 200
    for name in SERVED:
        reason = CASES[name][1]
        assert loads[name].status_code == 400, (name, loads[name].text)
        assert index[name]["state"] == "UNAVAILABLE"
        assert re.search(reason, index[name]["reason"]), (name, index[name])
    assert "time limit of 3 s" in index["slow"]["reason"]
    assert index["good"]["state"] == "READY"
    assert len(answers) > 0 and all(a == [3.0, 6.0, 9.0, 12.0] for a in answers), answers[:5]
