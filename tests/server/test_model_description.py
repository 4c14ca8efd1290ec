"""The server never parses a model file: a bounded child reads the graph's inputs and outputs
(server/core/model_description.py), a hostile file fails there with a message, and the server keeps serving."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import tritonclient.http as httpclient
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from server import plan_cache
from server.core import build_process, model_description
from server.core.build_process import BuildLimits
from server.core.errors import ServerError
from server.core.model import load_model_version
from server.core.model_config import ModelConfig, complete_config, parse_config_text
from server.core.model_description import ModelDescription, TensorDescription, describe_file
from server.repository import read_source
from tests.reliability.test_hostile_models import nested_past_protobuf  # If bodies nested past protobuf


def _model(inputs, outputs, nodes, initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "m", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def scale_model() -> onnx.ModelProto:
    """Y = X * k; k is an initializer listed as a graph input too (old exporters do that), X is [n, 4]."""
    k = helper.make_tensor("k", TensorProto.FLOAT, [], [3.0])
    return _model([helper.make_tensor_value_info("X", TensorProto.FLOAT, ["n", 4]),
                   helper.make_tensor_value_info("k", TensorProto.FLOAT, [])],
                  [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["n", 4])],
                  [helper.make_node("Mul", ["X", "k"], ["Y"])], [k])


def _repository(tmp_path: Path, name: str, data: bytes, config: str = "") -> Path:
    directory = tmp_path / "models" / name
    (directory / "1").mkdir(parents=True)
    (directory / "1" / "model.onnx").write_bytes(data)
    if config:
        (directory / "config.pbtxt").write_text(config)
    return directory


def _load(directory: Path, config_text: str = ""):
    source = read_source(directory.name, directory)
    config = parse_config_text(config_text, directory.name) if config_text else ModelConfig()
    return load_model_version(source, 1, config, 8)


@pytest.fixture(autouse=True)
def _fresh(tmp_path: Path):
    """Each test reads its models anew: its own plan cache directory, no descriptions in memory, default limits."""
    plan_cache.configure(tmp_path / "plans")
    build_process.configure(BuildLimits(build_process.default_memory_limit()))
    model_description.forget()
    yield
    model_description.forget()
    build_process.configure(BuildLimits(build_process.default_memory_limit()))
    plan_cache.configure(None)


def _refuse(*args, **kwargs):
    raise AssertionError("the server process parsed a model file")


def test_the_server_process_parses_no_model_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Every ONNX entry point refuses in this process, yet the model loads (completed config and all) and runs:
    the parse happens in the child (forked from the forkserver, which these patches do not reach)."""
    for name in ("load", "load_model", "load_from_string", "load_model_from_string"):
        monkeypatch.setattr(onnx, name, _refuse)
    directory = _repository(tmp_path, "scale", scale_model().SerializeToString())
    model = _load(directory)
    try:
        assert [(t.name, list(t.dims)) for t in model.config.input] == [("X", [4])]  # k is a weight, not an input
        assert model.config.max_batch_size == 8  # from the graph's variable first dims
        context = model.engine.create_execution_context()
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        np.testing.assert_array_equal(context.infer({"X": x})["Y"], x * 3)
    finally:
        model.close()


def test_a_description_is_read_once_per_file_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A reload finds the description in memory, a restart (memory empty) in the plan cache directory: neither
    starts a child; changed content is read anew."""
    directory = _repository(tmp_path, "scale", scale_model().SerializeToString())
    started: list[str] = []
    run = build_process.run_bounded

    def counting(target, args, name, task, **kwargs):
        started.append(task.what)
        return run(target, args, name, task, **kwargs)

    monkeypatch.setattr(build_process, "run_bounded", counting)
    _load(directory).close()
    assert started == ["reading the model file", "the build"]
    _load(directory).close()
    model_description.forget()  # a restart
    _load(directory).close()
    assert started == ["reading the model file", "the build"]  # description and plan both cached
    (entry,) = (tmp_path / "plans" / model_description.FOLDER).glob("*.json")
    assert ModelDescription.from_json(entry.read_bytes()).inputs[0] == TensorDescription("X", TensorProto.FLOAT,
                                                                                         (-1, 4))
    entry.write_text("{damaged")  # a damaged entry is read anew, not trusted
    model_description.forget()
    _load(directory).close()
    assert started == ["reading the model file", "the build", "reading the model file"]
    assert json.loads(entry.read_text())["format"] == model_description.FORMAT_VERSION


def test_the_description_holds_what_config_completion_reads(tmp_path: Path):
    """Symbolic dims are -1, a graph without a shape gives None, a value that is no tensor has no elem_type,
    initializers listed as inputs are left out."""
    model = scale_model()
    model.graph.output.append(helper.make_tensor_value_info("Z", TensorProto.INT64, None))
    model.graph.output.append(helper.make_tensor_sequence_value_info("S", TensorProto.FLOAT, None))
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    description = ModelDescription.from_json(describe_file(str(path)))
    assert description == ModelDescription(
        (TensorDescription("X", TensorProto.FLOAT, (-1, 4)),),
        (TensorDescription("Y", TensorProto.FLOAT, (-1, 4)), TensorDescription("Z", TensorProto.INT64, None),
         TensorDescription("S", None, None)))


@pytest.mark.parametrize("document", [b"[]", b'{"format": 1, "inputs": [["X", true, null]], "outputs": []}',
                                      b'{"format": 1, "inputs": [["X", 1, ["n"]]], "outputs": []}',
                                      b'{"format": 99, "inputs": [], "outputs": []}', b'{"format": 1}'])
def test_descriptions_other_than_the_childs_own_are_refused(document: bytes):
    with pytest.raises(ValueError):
        ModelDescription.from_json(document)


def test_a_corrupt_file_fails_with_protobufs_text(tmp_path: Path):
    directory = _repository(tmp_path, "broken", b"\x08\x07garbage that is not protobuf")
    with pytest.raises(ServerError, match=r"model 'broken' version 1: model.onnx is not a valid ONNX model: "
                                          r"Error parsing message"):
        _load(directory)


def test_a_nesting_bomb_fails_in_the_child(tmp_path: Path):
    directory = _repository(tmp_path, "nested", nested_past_protobuf(200))
    with pytest.raises(ServerError, match="model 'nested' version 1: model.onnx is not a valid ONNX model"):
        _load(directory)


def _address_space() -> bytes:
    """The child's virtual memory size (bytes, as text): what RLIMIT_AS counts."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmSize:"))
    return str(int(line.split()[1]) * 1024).encode()


def test_a_file_too_big_for_the_memory_limit_fails_reading_with_the_limit_named(tmp_path: Path):
    """A 192 MiB protobuf under a limit 64 MiB above what a child starts with: the read stops at the limit
    (RLIMIT_AS in the child), the load fails naming it, this process is untouched."""
    baseline = int(build_process.run_bounded(_address_space, (), "vm", build_process.READ))
    count = 48 << 20
    weight = TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[count], raw_data=bytes(4 * count))
    data = _model([helper.make_tensor_value_info("X", TensorProto.FLOAT, [count])],
                  [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [count])],
                  [helper.make_node("Add", ["X", "W"], ["Y"])], [weight]).SerializeToString()
    del weight
    directory = _repository(tmp_path, "big", data)
    del data
    build_process.configure(BuildLimits(memory_bytes=baseline + (64 << 20), timeout_s=120))
    with pytest.raises(ServerError, match=r"model 'big' version 1: model.onnx cannot be read: reading the model "
                                          r"file ran out of memory: it needs more than its limit of .* "
                                          r"\(--build-memory-limit\)"):
        _load(directory)


def test_hostile_files_fail_through_the_server_which_keeps_serving(kiln_server):
    with httpclient.InferenceServerClient(kiln_server.http_url) as client:
        for name, data in (("nesting_bomb", nested_past_protobuf(200)),
                           ("garbage", b"\x0a\xff\xff\xff\xff\x0f not a length that fits")):
            with pytest.raises(InferenceServerException, match="not a valid ONNX model") as failure:
                client.load_model(name, config="{}", files={"file:1/model.onnx": data})
            assert failure.value.status() == "400"
            assert not client.is_model_ready(name)
        assert client.is_server_live() and client.is_server_ready()
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"), httpclient.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(a)
        np.testing.assert_array_equal(client.infer("add_sub", inputs).as_numpy("OUTPUT0"), a + a)


def test_unnamed_instance_groups_get_tritons_names():
    """Triton names an unnamed group <model>_<group index> (its /config shows add_sub_0); named ones keep theirs."""
    description = ModelDescription([TensorDescription("x", TensorProto.FLOAT, [-1, 4])],
                                   [TensorDescription("y", TensorProto.FLOAT, [-1, 4])])
    for text, names in (("", ["m_0"]), ('instance_group [{ kind: KIND_CPU }, { name: "b" kind: KIND_CPU }]',
                                         ["m_0", "b"])):
        config = complete_config(parse_config_text(text, "m"), description, "m", 8)
        assert [group.name for group in config.instance_group] == names
