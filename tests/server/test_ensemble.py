"""Triton ensembles (server/core/ensemble.py): a real server runs ensembles of the example add_sub model, driven by
the stock tritonclient over HTTP and gRPC and checked against numpy; load failures name what is wrong; composing
models load with their ensemble and unloading one takes its ensembles down cleanly. The DAG runner's concurrency,
pruning and cancellation are checked in-process with a stand-in step runner."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient
import tritonclient.utils.shared_memory as shm
from google.protobuf import text_format
from onnx import TensorProto
from tritonclient.utils import InferenceServerException

from server.core.ensemble import EnsembleVersion, _fit_batching
from server.core.errors import ErrorKind, ServerError
from server.core.model import ServedModel
from server.core.types import InferInput, InferOutput, InferRequest, InferResponse
from server.protos import model_config_pb2

from .conftest import examples, require_grpc, run_server
from .test_python_backend import triton_example, write_python_model

STARTUP = ["ens_chain", "ens_diamond", "ens_loose"]


def _step(model: str, inputs: dict[str, str], outputs: dict[str, str], version: int = -1) -> str:
    maps = "".join(f' input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items())
    maps += "".join(f' output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items())
    return f'{{ model_name: "{model}" model_version: {version}{maps} }}'


def _tensors(names: list[str], data_type: str = "TYPE_INT32", dims: str = "16") -> str:
    return ", ".join(f'{{ name: "{n}" data_type: {data_type} dims: [ {dims} ] }}' for n in names)


def ensemble_config(name: str, steps: list[str], inputs: str | None = None, outputs: str | None = None,
                    max_batch_size: int = 8, extra: str = "") -> str:
    return (f'name: "{name}"\nplatform: "ensemble"\nmax_batch_size: {max_batch_size}\n'
            f'input [ {inputs if inputs is not None else _tensors(["A", "B"])} ]\n'
            f'output [ {outputs if outputs is not None else _tensors(["S", "D"])} ]\n'
            f'ensemble_scheduling {{ step [ {", ".join(steps)} ] }}\n{extra}')


# Triton's example: add_sub(A, B) -> (A+B, A-B), then add_sub(sum, diff) -> (2A, 2B).
CHAIN = [_step("add_sub", {"INPUT0": "A", "INPUT1": "B"}, {"OUTPUT0": "sum", "OUTPUT1": "diff"}),
         _step("add_sub", {"INPUT0": "sum", "INPUT1": "diff"}, {"OUTPUT0": "S", "OUTPUT1": "D"})]
# Two independent steps, then one reading both: S = (A+B) + (B-A) = 2B, D = (A+B) - (B-A) = 2A; X = A-B, Y = B+A.
DIAMOND = [_step("add_sub", {"INPUT0": "A", "INPUT1": "B"}, {"OUTPUT0": "ab_sum", "OUTPUT1": "X"}),
           _step("add_sub", {"INPUT0": "B", "INPUT1": "A"}, {"OUTPUT0": "Y", "OUTPUT1": "ba_diff"}),
           _step("add_sub", {"INPUT0": "ab_sum", "INPUT1": "ba_diff"}, {"OUTPUT0": "S", "OUTPUT1": "D"})]
ADD_ONLY = [_step("add_sub", {"INPUT0": "A", "INPUT1": "B"}, {"OUTPUT0": "S", "OUTPUT1": "D"})]

# Ensembles whose load must fail, and a text the failure must contain.
INVALID = {
    "bad_unknown_model": (ensemble_config("bad_unknown_model", [
        _step("no_such_model", {"INPUT0": "A", "INPUT1": "B"}, {"OUTPUT0": "S", "OUTPUT1": "D"})]),
        "ensemble bad_unknown_model contains models that are not available or ambiguous: no_such_model"),
    "bad_written_twice": (ensemble_config("bad_written_twice", [
        _step("add_sub", {"INPUT0": "A", "INPUT1": "B"}, {"OUTPUT0": "S", "OUTPUT1": "D"}),
        _step("add_sub", {"INPUT0": "A", "INPUT1": "B"}, {"OUTPUT0": "S", "OUTPUT1": "E"})]),
        "ensemble tensor 'S' can appear in an output map only once for ensemble 'bad_written_twice' step 1"),
    "bad_unwritten_input": (ensemble_config("bad_unwritten_input", [
        _step("add_sub", {"INPUT0": "A", "INPUT1": "B"}, {"OUTPUT0": "S", "OUTPUT1": "D"}),
        _step("add_sub", {"INPUT0": "A", "INPUT1": "nobody"}, {"OUTPUT0": "E", "OUTPUT1": "F"})],
        outputs=_tensors(["S", "D", "E", "F"])),
        "ensemble tensor 'nobody' is unused in ensemble 'bad_unwritten_input': step 1, model 'add_sub' reads it as "
        "input 'INPUT1', but no step writes it and it is not an ensemble input"),
    "bad_unwritten_output": (ensemble_config("bad_unwritten_output", ADD_ONLY, outputs=_tensors(["S", "D", "Z"])),
                             "ensemble output 'Z' for ensemble 'bad_unwritten_output' is not used: no step writes it"),
    "bad_cycle": (ensemble_config("bad_cycle", [
        _step("add_sub", {"INPUT0": "A", "INPUT1": "t1"}, {"OUTPUT0": "t0", "OUTPUT1": "S"}),
        _step("add_sub", {"INPUT0": "t0", "INPUT1": "B"}, {"OUTPUT0": "t1", "OUTPUT1": "D"})]),
        "ensemble 'bad_cycle' has a cycle: steps 0 ('add_sub'), 1 ('add_sub') wait on each other's outputs"),
    "bad_self": (ensemble_config("bad_self", [_step("bad_self", {"A": "A", "B": "B"}, {"S": "S", "D": "D"})]),
                 "ensemble 'bad_self' has a cycle: it runs bad_self, which runs it again"),
    "bad_dtype": (ensemble_config("bad_dtype", ADD_ONLY, inputs=_tensors(["A", "B"], "TYPE_FP32")),
                  "in ensemble bad_dtype, ensemble tensor A: inconsistent data type: TYPE_FP32 is inferred from model "
                  "bad_dtype while TYPE_INT32 is inferred from model add_sub"),
    "bad_shape": (ensemble_config("bad_shape", ADD_ONLY, outputs=_tensors(["S", "D"], dims="8")),
                  "in ensemble bad_shape, ensemble tensor S: inconsistent shape: [-1, 8] is inferred from model "
                  "bad_shape while [-1, 16] is inferred from model add_sub"),
    "bad_input_name": (ensemble_config("bad_input_name", [
        _step("add_sub", {"INPUT0": "A", "INPUTX": "B"}, {"OUTPUT0": "S", "OUTPUT1": "D"})]),
        "in ensemble bad_input_name, ensemble tensor B is mapping to non-existing input INPUTX in model add_sub"),
    "bad_batch": (ensemble_config("bad_batch", ADD_ONLY, max_batch_size=16),
                  "ensemble bad_batch allows maximum batch size 16, but it contains model add_sub which only allows "
                  "maximum batch size to be 8"),
    "bad_instance_group": (ensemble_config("bad_instance_group", ADD_ONLY, extra="instance_group [ { count: 2 } ]"),
                           "instance group should not be specified for ensemble 'bad_instance_group'"),
    "bad_backend": (ensemble_config("bad_backend", ADD_ONLY, extra='backend: "onnxruntime"'),
                    "an ensemble has no backend"),
    "bad_broken_step": (ensemble_config("bad_broken_step", [
        _step("broken", {"INPUT0": "A", "INPUT1": "B"}, {"OUTPUT0": "S", "OUTPUT1": "D"})]),
        "ensemble 'bad_broken_step' depends on 'broken' which has no loaded version. Model 'broken' loading failed "
        "with error: model 'broken' version 1: model.onnx is not a valid ONNX model"),
}


def _ensemble(repo, name: str, config: str) -> None:
    (repo / name / "1").mkdir(parents=True)  # an ensemble's version directory is empty, as in Triton's repositories
    (repo / name / "config.pbtxt").write_text(config)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Explicit mode with only ensembles asked for at start: their composing models load with them."""
    base = tmp_path_factory.mktemp("ensemble")
    repo = base / "models"
    add_sub = examples.add_sub_model(TensorProto.INT32)
    examples.write_model(repo, "add_sub", add_sub, examples.ADD_SUB_CONFIG)
    examples.write_model(repo, "add_sub_solo", add_sub, examples.ADD_SUB_CONFIG.replace('"add_sub"', '"add_sub_solo"'))
    write_python_model(repo, "square_int32", *triton_example("square"))  # decoupled: ensembles refuse it (for now)
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "1" / "model.onnx").write_bytes(b"not an onnx file")
    _ensemble(repo, "ens_chain", ensemble_config("ens_chain", CHAIN))
    _ensemble(repo, "ens_diamond", ensemble_config("ens_diamond", DIAMOND, outputs=_tensors(["S", "D", "X", "Y"])))
    # variable dims: a request the ensemble accepts but add_sub refuses fails inside the step
    _ensemble(repo, "ens_loose", ensemble_config("ens_loose", ADD_ONLY, inputs=_tensors(["A", "B"], dims="-1"),
                                                 outputs=_tensors(["S", "D"], dims="-1")))
    _ensemble(repo, "ens_solo", ensemble_config("ens_solo", [
        _step("add_sub_solo", {"INPUT0": "A", "INPUT1": "B"}, {"OUTPUT0": "S", "OUTPUT1": "D"})]))
    _ensemble(repo, "ens_outer", ensemble_config("ens_outer", [_step("ens_chain", {"A": "A", "B": "B"},
                                                                     {"S": "S", "D": "D"})]))
    for name, (config, _) in INVALID.items():
        _ensemble(repo, name, config)
    with run_server(repo, base / "server.log", STARTUP, ["--allow-client-shm", "true"]) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> httpclient.InferenceServerClient:
    with httpclient.InferenceServerClient(server.http_url) as c:
        yield c


def _pair(batch: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.integers(-1000, 1000, (batch, 16)).astype(np.int32),
            rng.integers(-1000, 1000, (batch, 16)).astype(np.int32))


def _infer(protocol, server, model: str, a: np.ndarray, b: np.ndarray, outputs: list[str] | None = None):
    """An inference over `protocol` (the tritonclient module), returning the result object."""
    url = require_grpc(server).grpc_url if protocol is grpcclient else server.http_url
    client = protocol.InferenceServerClient(url)
    inputs = [protocol.InferInput("A", list(a.shape), "INT32"), protocol.InferInput("B", list(b.shape), "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    requested = [protocol.InferRequestedOutput(name) for name in outputs] if outputs else None
    try:
        return client.infer(model, inputs, outputs=requested)
    finally:
        client.close()


def _stats(client, model: str) -> dict:
    return client.get_inference_statistics(model)["model_stats"][0]


# -- inference ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", [httpclient, grpcclient], ids=["http", "grpc"])
def test_chain_matches_numpy(server, protocol):
    a, b = _pair(3)
    result = _infer(protocol, server, "ens_chain", a, b)
    np.testing.assert_array_equal(result.as_numpy("S"), (a + b) + (a - b))
    np.testing.assert_array_equal(result.as_numpy("D"), (a + b) - (a - b))


@pytest.mark.parametrize("protocol", [httpclient, grpcclient], ids=["http", "grpc"])
def test_diamond_runs_independent_steps_and_joins_them(server, protocol):
    a, b = _pair(2, seed=1)
    result = _infer(protocol, server, "ens_diamond", a, b)
    np.testing.assert_array_equal(result.as_numpy("S"), (a + b) + (b - a))
    np.testing.assert_array_equal(result.as_numpy("D"), (a + b) - (b - a))
    np.testing.assert_array_equal(result.as_numpy("X"), a - b)
    np.testing.assert_array_equal(result.as_numpy("Y"), b + a)


@pytest.mark.parametrize("protocol", [httpclient, grpcclient], ids=["http", "grpc"])
def test_only_requested_outputs_come_back(server, protocol):
    a, b = _pair(1, seed=2)
    result = _infer(protocol, server, "ens_diamond", a, b, outputs=["X"])
    np.testing.assert_array_equal(result.as_numpy("X"), a - b)
    assert result.as_numpy("S") is None and result.as_numpy("Y") is None


def test_concurrent_requests_each_get_their_own_answer(server):
    """Concurrent requests (which a frontend may send to the core as one group) each get their own rows."""
    async def scenario():
        async with aiohttpclient.InferenceServerClient(server.http_url) as client:
            pairs = [_pair(1 + i % 3, seed=100 + i) for i in range(24)]

            async def one(a, b):
                inputs = [aiohttpclient.InferInput("A", list(a.shape), "INT32"),
                          aiohttpclient.InferInput("B", list(b.shape), "INT32")]
                inputs[0].set_data_from_numpy(a)
                inputs[1].set_data_from_numpy(b)
                return await client.infer("ens_diamond", inputs)

            return pairs, await asyncio.gather(*(one(a, b) for a, b in pairs))

    pairs, results = asyncio.run(scenario())
    for (a, b), result in zip(pairs, results):
        np.testing.assert_array_equal(result.as_numpy("S"), 2 * b)
        np.testing.assert_array_equal(result.as_numpy("X"), a - b)


def test_classification_of_an_ensemble_output(client):
    a = np.arange(16, dtype=np.int32)[None]
    b = np.zeros((1, 16), np.int32)
    inputs = [httpclient.InferInput("A", [1, 16], "INT32"), httpclient.InferInput("B", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    result = client.infer("ens_chain", inputs, outputs=[httpclient.InferRequestedOutput("S", class_count=2)])
    assert [v.decode() for v in result.as_numpy("S")[0]] == ["30.000000:15", "28.000000:14"]  # S = 2A


def test_system_shared_memory_in_and_out_of_an_ensemble(client):
    a, b = _pair(2, seed=8)
    size = a.nbytes
    key = f"/kiln_ens_{id(client)}"
    region = shm.create_shared_memory_region("kiln_ens", key, 3 * size)
    try:
        shm.set_shared_memory_region(region, [a, b])
        client.register_system_shared_memory("kiln_ens", key, 3 * size)
        inputs = [httpclient.InferInput("A", [2, 16], "INT32"), httpclient.InferInput("B", [2, 16], "INT32")]
        inputs[0].set_shared_memory("kiln_ens", size)
        inputs[1].set_shared_memory("kiln_ens", size, offset=size)
        output = httpclient.InferRequestedOutput("D", binary_data=True)
        output.set_shared_memory("kiln_ens", size, offset=2 * size)
        result = client.infer("ens_chain", inputs, outputs=[output])
        assert result.get_output("D")["parameters"]["shared_memory_region"] == "kiln_ens"
        np.testing.assert_array_equal(shm.get_contents_as_numpy(region, np.int32, [2, 16], offset=2 * size), 2 * b)
    finally:
        client.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(region)


def test_nested_ensemble(client, server):
    client.load_model("ens_outer")  # one step: the ens_chain ensemble
    a, b = _pair(2, seed=3)
    result = _infer(httpclient, server, "ens_outer", a, b)
    np.testing.assert_array_equal(result.as_numpy("S"), 2 * a)
    np.testing.assert_array_equal(result.as_numpy("D"), 2 * b)


@pytest.mark.parametrize("protocol", [httpclient, grpcclient], ids=["http", "grpc"])
def test_failing_step_fails_the_request_and_the_server_serves_on(server, protocol):
    a, b = _pair(1, seed=4)
    with pytest.raises(InferenceServerException) as failure:
        _infer(protocol, server, "ens_loose", a[:, :8], b[:, :8])
    message = failure.value.message()
    assert message.startswith("in ensemble 'ens_loose', unexpected shape for input ")
    assert "for model 'add_sub'. Expected [-1, 16], got [1, 8] (step 0, model 'add_sub')" in message
    result = _infer(protocol, server, "ens_loose", a, b)
    np.testing.assert_array_equal(result.as_numpy("S"), a + b)


def test_request_checked_against_the_ensemble_config(client):
    a = np.zeros((1, 16), np.float32)
    inputs = [httpclient.InferInput("A", [1, 16], "FP32"), httpclient.InferInput("B", [1, 16], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(a)
    with pytest.raises(InferenceServerException, match="inference input 'A' data-type is 'FP32', but model "
                                                       "'ens_chain' expects 'INT32'"):
        client.infer("ens_chain", inputs)


# -- statistics, metadata, config -------------------------------------------------------------------------------
def test_statistics_count_the_ensemble_and_its_composing_model(client, server):
    composing, ensemble = _stats(client, "add_sub"), _stats(client, "ens_chain")
    a, b = _pair(2, seed=5)
    _infer(httpclient, server, "ens_chain", a, b)
    composing_after, ensemble_after = _stats(client, "add_sub"), _stats(client, "ens_chain")
    # two steps of batch 2 on add_sub (no dynamic batching: one execution each)
    assert composing_after["inference_stats"]["success"]["count"] == composing["inference_stats"]["success"]["count"] + 2
    assert composing_after["inference_count"] == composing["inference_count"] + 4
    assert composing_after["execution_count"] == composing["execution_count"] + 2
    # the ensemble: one request of batch 2, one execution
    assert ensemble_after["inference_stats"]["success"]["count"] == ensemble["inference_stats"]["success"]["count"] + 1
    assert ensemble_after["inference_count"] == ensemble["inference_count"] + 2
    assert ensemble_after["execution_count"] == ensemble["execution_count"] + 1
    assert ensemble_after["inference_stats"]["compute_infer"]["ns"] > ensemble["inference_stats"]["compute_infer"]["ns"]


def test_metadata_and_config_of_an_ensemble(client):
    metadata = client.get_model_metadata("ens_chain")
    assert metadata["platform"] == "ensemble" and metadata["versions"] == ["1"]
    assert [t["name"] for t in metadata["inputs"]] == ["A", "B"]
    assert metadata["outputs"][0] == {"name": "S", "datatype": "INT32", "shape": [-1, 16]}
    config = client.get_model_config("ens_chain")
    assert config["platform"] == "ensemble" and config["max_batch_size"] == 8
    steps = config["ensemble_scheduling"]["step"]
    assert [s["model_name"] for s in steps] == ["add_sub", "add_sub"]
    assert steps[1]["input_map"] == {"INPUT0": "sum", "INPUT1": "diff"}
    assert client.is_model_ready("ens_chain")


def test_metrics_list_the_ensemble(server, client):
    text = httpx.get(server.metrics_url).text
    assert 'nv_inference_request_success{model="ens_chain",version="1"}' in text
    assert 'kiln_workers{model="ens_chain"' not in text  # it has no workers of its own
    assert 'kiln_workers{model="add_sub",version="1"}' in text


# -- load failures --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(INVALID))
def test_invalid_ensemble_fails_to_load_with_the_reason(client, name):
    expected = INVALID[name][1]
    with pytest.raises(InferenceServerException) as failure:
        client.load_model(name)
    assert f"load failed for model '{name}': " in failure.value.message()
    assert expected in failure.value.message()
    assert not client.is_model_ready(name)
    state = {m["name"]: m for m in client.get_model_repository_index()}[name]
    assert state["state"] == "UNAVAILABLE" and expected in state["reason"]


def test_composing_models_load_with_the_ensemble(client):
    index = {m["name"]: m["state"] for m in client.get_model_repository_index()}
    assert index["add_sub"] == "READY"  # not asked for at start: ens_chain loaded it


# -- model control ------------------------------------------------------------------------------------------------
def test_unloading_a_composing_model_takes_its_ensembles_down_cleanly(client, server):
    a, b = _pair(1, seed=6)
    client.unload_model("add_sub")
    for protocol in (httpclient, grpcclient):
        with pytest.raises(InferenceServerException) as failure:
            _infer(protocol, server, "ens_chain", a, b)
        assert ("Request for unknown model: 'ens_chain' has no available versions (not loaded: ensemble "
                "'ens_chain' depends on 'add_sub' which has no loaded version)") in failure.value.message()
    assert not client.is_model_ready("ens_diamond") and not client.is_server_ready()  # start-up models are down
    for name in STARTUP:
        client.load_model(name)  # the first one loads add_sub again
    np.testing.assert_array_equal(_infer(httpclient, server, "ens_chain", a, b).as_numpy("S"), 2 * a)
    assert client.is_server_ready()


def test_unload_dependents_takes_only_the_models_loaded_for_the_ensemble(client):
    client.load_model("ens_solo")
    assert client.is_model_ready("add_sub_solo")
    client.unload_model("ens_solo", unload_dependents=True)
    assert not client.is_model_ready("add_sub_solo")
    client.unload_model("ens_chain", unload_dependents=True)  # ens_diamond still runs add_sub
    assert client.is_model_ready("add_sub") and not client.is_model_ready("ens_chain")
    client.load_model("add_sub")  # explicitly: now it stays when its ensembles go
    client.unload_model("ens_diamond", unload_dependents=True)
    assert client.is_model_ready("add_sub")


# -- the DAG runner, in-process ---------------------------------------------------------------------------------
def _served(name: str, config_text: str) -> ServedModel:
    config = text_format.Parse(config_text, model_config_pb2.ModelConfig())
    config.name = name
    return ServedModel(name, 1, config, {})


ADD_SUB = _served("add_sub", examples.ADD_SUB_CONFIG)


def _diamond() -> EnsembleVersion:
    config = text_format.Parse(ensemble_config("ens", DIAMOND, outputs=_tensors(["S", "D", "X", "Y"])),
                               model_config_pb2.ModelConfig())
    return EnsembleVersion("ens", 1, config, {"add_sub": {1: ADD_SUB}})


class FakeAddSub:
    """A step runner standing in for the core: add_sub in numpy, each step held until `release` is set."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.started: list[InferRequest] = []
        self.cancelled = 0
        self.release = asyncio.Event()
        self.fail_on = fail_on

    async def __call__(self, request: InferRequest) -> InferResponse:
        self.started.append(request)
        if len(self.started) == self.fail_on:
            raise ServerError(ErrorKind.INVALID_ARGUMENT, "step refused")
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        x, y = (t.data for t in request.inputs)
        outputs = [InferOutput("OUTPUT0", "INT32", x.shape, x + y), InferOutput("OUTPUT1", "INT32", x.shape, x - y)]
        return InferResponse(request.model_name, "1", outputs)


def _arrays(batch: int = 2) -> dict[str, np.ndarray]:
    a, b = _pair(batch, seed=7)
    return {"A": a, "B": b}


def test_independent_steps_start_together():
    async def scenario():
        runner = FakeAddSub()
        run = asyncio.ensure_future(_diamond().run(_arrays(), 2, InferRequest("ens", [], id="r7"), ["S", "D"], runner))
        await asyncio.sleep(0.01)
        assert len(runner.started) == 2  # both first steps wait at once; the joining step waits for them
        assert all(r.id == "r7" for r in runner.started)
        runner.release.set()
        return runner, await run

    runner, outputs = asyncio.run(scenario())
    a, b = _arrays().values()
    assert len(runner.started) == 3
    np.testing.assert_array_equal(outputs["S"], 2 * b)
    np.testing.assert_array_equal(outputs["D"], 2 * a)


def test_steps_no_requested_output_needs_are_skipped():
    async def scenario():
        runner = FakeAddSub()
        runner.release.set()
        return runner, await _diamond().run(_arrays(), 2, InferRequest("ens", []), ["X"], runner)

    runner, outputs = asyncio.run(scenario())
    assert len(runner.started) == 1 and set(outputs) == {"X"}


def test_a_failing_step_cancels_the_others_and_names_the_ensemble():
    async def scenario():
        runner = FakeAddSub(fail_on=2)
        with pytest.raises(ServerError) as failure:
            await _diamond().run(_arrays(), 2, InferRequest("ens", []), ["S"], runner)
        await asyncio.sleep(0)
        return runner, failure.value

    runner, error = asyncio.run(scenario())
    assert error.kind == ErrorKind.INVALID_ARGUMENT
    assert error.message == "in ensemble 'ens', step refused (step 1, model 'add_sub')"
    assert runner.cancelled == 1


def test_batch_dims_are_added_and_dropped_as_views():
    item = np.arange(16, dtype=np.int32)
    batched = _fit_batching(item, (16,), batching=True, batch=0)
    assert batched.shape == (1, 16) and np.shares_memory(batched, item)
    one = item[np.newaxis]
    dropped = _fit_batching(one, (16,), batching=False, batch=1)
    assert dropped.shape == (16,) and np.shares_memory(dropped, one)
    whole = np.zeros((1, 16), np.int32)  # a non-batching reader whose dims are the whole tensor keeps it
    assert _fit_batching(whole, (1, 16), batching=False, batch=1) is whole


def test_step_requests_carry_the_arrays_without_copies():
    async def scenario():
        runner = FakeAddSub()
        runner.release.set()
        arrays = _arrays()
        await _diamond().run(arrays, 2, InferRequest("ens", []), ["X"], runner)
        return arrays, runner.started[0]

    arrays, request = asyncio.run(scenario())
    assert isinstance(request.inputs[0], InferInput)
    assert request.inputs[0].data is arrays["A"] and request.inputs[1].data is arrays["B"]
