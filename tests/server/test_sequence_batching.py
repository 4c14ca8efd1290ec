"""Triton's sequence batcher (server/core/sequence.py, sequence_config.py): stateful models whose requests come in
sequences. Triton's accumulator example runs against a real server with the stock tritonclient over HTTP and
gRPC: many sequences at once, each with its own running sum (an implicit state the server keeps), the control
inputs the model sees, uint64 and string correlation IDs, both strategies, idle release and the errors with
Triton's texts. The direct strategy's batch rows (rows without a request, queue delay, backlog, cancellation) are
checked in-process with a numpy executor."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from server.core import CoreOptions, ServerCore
from server.core.errors import ErrorKind, ServerError
from server.core.scheduler import Job
from server.core.sequence import DirectSequenceBatcher, OldestSequenceBatcher
from server.core.sequence_config import (
    BoolControl,
    CorridControl,
    SequenceRequest,
    SequenceSettings,
    StateSpec,
    request_of,
)

from .conftest import examples, require_grpc, run_server

vi = helper.make_tensor_value_info


# -- models -------------------------------------------------------------------------------------------------
def accumulator_model() -> onnx.ModelProto:
    """Triton's accumulator with an implicit state: OUTPUT = INPUT at START, else STATE_IN + INPUT; STATE_OUT =
    OUTPUT. CONTROLS = [START, END, READY] and CORRID_OUT = CORRID show what the batcher fed it."""
    inputs = [vi(name, TensorProto.INT32, ["b", 1]) for name in ("INPUT", "START", "END", "READY", "STATE_IN")]
    inputs.append(vi("CORRID", TensorProto.UINT64, ["b", 1]))
    outputs = [vi("OUTPUT", TensorProto.INT32, ["b", 1]), vi("STATE_OUT", TensorProto.INT32, ["b", 1]),
               vi("CONTROLS", TensorProto.INT32, ["b", 3]), vi("CORRID_OUT", TensorProto.UINT64, ["b", 1])]
    nodes = [helper.make_node("Cast", ["START"], ["started"], to=TensorProto.BOOL),
             helper.make_node("Add", ["STATE_IN", "INPUT"], ["sum"]),
             helper.make_node("Where", ["started", "INPUT", "sum"], ["OUTPUT"]),
             helper.make_node("Identity", ["OUTPUT"], ["STATE_OUT"]),
             helper.make_node("Concat", ["START", "END", "READY"], ["CONTROLS"], axis=1),
             helper.make_node("Identity", ["CORRID"], ["CORRID_OUT"])]
    return examples._model(helper.make_graph(nodes, "accumulator", inputs, outputs))


def string_id_model() -> onnx.ModelProto:
    """Unbatched, FP32 START, BOOL READY, STRING CORRID, FP32 state: OUTPUT = STATE_IN + INPUT (the state starts at
    the initial_state file's value), READY_OUT = READY, CORRID_OUT = CORRID."""
    inputs = [vi("INPUT", TensorProto.FLOAT, [1]), vi("START", TensorProto.FLOAT, [1]),
              vi("READY", TensorProto.BOOL, [1]), vi("CORRID", TensorProto.STRING, [1]),
              vi("STATE_IN", TensorProto.FLOAT, [1])]
    outputs = [vi("OUTPUT", TensorProto.FLOAT, [1]), vi("STATE_OUT", TensorProto.FLOAT, [1]),
               vi("START_OUT", TensorProto.FLOAT, [1]), vi("READY_OUT", TensorProto.BOOL, [1]),
               vi("CORRID_OUT", TensorProto.STRING, [1])]
    nodes = [helper.make_node("Add", ["STATE_IN", "INPUT"], ["OUTPUT"]),
             helper.make_node("Identity", ["OUTPUT"], ["STATE_OUT"]),
             helper.make_node("Identity", ["START"], ["START_OUT"]),
             helper.make_node("Identity", ["READY"], ["READY_OUT"]),
             helper.make_node("Identity", ["CORRID"], ["CORRID_OUT"])]
    return examples._model(helper.make_graph(nodes, "string_ids", inputs, outputs))


CONTROLS = """control_input [
    { name: "START" control [{ kind: CONTROL_SEQUENCE_START int32_false_true: [0, 1] }] },
    { name: "END" control [{ kind: CONTROL_SEQUENCE_END int32_false_true: [0, 1] }] },
    { name: "READY" control [{ kind: CONTROL_SEQUENCE_READY int32_false_true: [0, 1] }] },
    { name: "CORRID" control [{ kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 }] }
  ]
  state [{ input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_INT32 dims: [1] }]"""


def accumulator_config(strategy: str, max_batch_size: int = 4, instances: int = 1, extra: str = "",
                       controls: str = CONTROLS) -> str:
    return (f"max_batch_size: {max_batch_size}\ninput [{{ name: \"INPUT\" data_type: TYPE_INT32 dims: [1] }}]\n"
            f"sequence_batching {{\n  {strategy}\n  {controls}\n}}\n"
            f"instance_group [{{ kind: KIND_CPU count: {instances} }}]\n{extra}")


STRING_CONFIG = """max_batch_size: 0
sequence_batching {
  control_input [
    { name: "START" control [{ kind: CONTROL_SEQUENCE_START fp32_false_true: [0, 1] }] },
    { name: "READY" control [{ kind: CONTROL_SEQUENCE_READY bool_false_true: [false, true] }] },
    { name: "CORRID" control [{ kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_STRING }] }
  ]
  state [{ input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_FP32 dims: [1]
           initial_state [{ name: "hundred" data_type: TYPE_FP32 dims: [1] data_file: "hundred.bin" }] }]
}
instance_group [{ kind: KIND_CPU count: 2 }]
"""

ENSEMBLE_CONFIG = """platform: "ensemble"
max_batch_size: 4
input [{ name: "X" data_type: TYPE_INT32 dims: [1] }]
output [{ name: "Y" data_type: TYPE_INT32 dims: [1] }]
ensemble_scheduling { step [{ model_name: "seq_oldest" model_version: -1 input_map { key: "INPUT" value: "X" }
                              output_map { key: "OUTPUT" value: "Y" } }] }
"""

IDLE_US = 300_000
WARMUP = ('model_warmup [{ name: "ones" batch_size: 1 inputs { key: "INPUT" value: { data_type: TYPE_INT32 dims: [1] '
          "zero_data: true } } }]\n")
MODELS = {
    "seq_direct": accumulator_config("direct { }", instances=2),
    "seq_oldest": accumulator_config("oldest { max_candidate_sequences: 3 preferred_batch_size: [2] "
                                     "max_queue_delay_microseconds: 2000 }"),
    "seq_idle": accumulator_config(f"direct {{ }}\n  max_sequence_idle_microseconds: {IDLE_US}", max_batch_size=1),
    "seq_stats": accumulator_config("direct { }", extra=WARMUP),
}


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sequence_models")
    for name, config in MODELS.items():
        examples.write_model(root, name, accumulator_model(), config)
    directory = examples.write_model(root, "seq_string", string_id_model(), STRING_CONFIG)
    (directory / "initial_state").mkdir()
    (directory / "initial_state" / "hundred.bin").write_bytes(np.array([100], np.float32).tobytes())
    (root / "seq_ensemble" / "1").mkdir(parents=True)
    (root / "seq_ensemble" / "config.pbtxt").write_text(ENSEMBLE_CONFIG)
    return root


@pytest.fixture(scope="module")
def server(repository: Path, tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("sequence_server")
    with run_server(repository, base / "server.log", [*MODELS, "seq_string", "seq_ensemble"],
                    ["--plan-cache-dir", str(base / "plans")]) as process:
        yield process


def client_for(server, protocol: str):
    if protocol == "grpc":
        return grpcclient, grpcclient.InferenceServerClient(require_grpc(server).grpc_url)
    return httpclient, httpclient.InferenceServerClient(server.http_url)


def step(module, client, model: str, value: int, corrid, start: bool = False, end: bool = False, rows: int = 1):
    """One accumulator request; its outputs as numpy."""
    tensor = module.InferInput("INPUT", [rows, 1], "INT32")
    tensor.set_data_from_numpy(np.full((rows, 1), value, np.int32))
    result = client.infer(model, [tensor], sequence_id=corrid, sequence_start=start, sequence_end=end)
    return {name: result.as_numpy(name) for name in ("OUTPUT", "CONTROLS", "CORRID_OUT")}


# -- a real server ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("model", ["seq_direct", "seq_oldest"])
def test_interleaved_sequences_each_keep_their_own_running_sum(server, protocol: str, model: str):
    """10 sequences at once (more than the model's slots: some wait in the backlog), each summing its own values;
    the model sees START on the first step, END on the last, READY on all, and the sequence's ID as CORRID."""
    module, _ = client_for(server, protocol)
    big = (1 << 64) - 7 if protocol == "http" else (1 << 63) - 7  # gRPC carries IDs as int64
    ids = [big - i for i in range(10)]
    steps = 6

    def run(index: int) -> list[dict]:
        _, client = client_for(server, protocol)
        outputs = []
        for i in range(steps):
            outputs.append(step(module, client, model, index * 100 + i, ids[index], start=i == 0, end=i == steps - 1))
            time.sleep(0.001 * (index % 3))  # stagger the sequences so batches mix their steps
        return outputs

    with ThreadPoolExecutor(len(ids)) as pool:
        results = list(pool.map(run, range(len(ids))))
    for index, outputs in enumerate(results):
        values = [index * 100 + i for i in range(steps)]
        assert [int(o["OUTPUT"][0, 0]) for o in outputs] == list(np.cumsum(values))
        assert [o["CONTROLS"][0].tolist() for o in outputs] == [[1, 0, 1]] + [[0, 0, 1]] * (steps - 2) + [[0, 1, 1]]
        assert {int(o["CORRID_OUT"][0, 0]) for o in outputs} == {ids[index]}


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_string_ids_an_unbatched_model_and_a_state_from_a_file(server, protocol: str):
    """Two interleaved sequences with string IDs on a model without a batch dim (one slot per instance, two
    instances): FP32 and BOOL controls, a STRING CORRID, and a state that starts at the initial_state file's 100."""
    module, client = client_for(server, protocol)

    def send(corrid: str, value: float, start: bool = False, end: bool = False) -> dict:
        tensor = module.InferInput("INPUT", [1], "FP32")
        tensor.set_data_from_numpy(np.array([value], np.float32))
        result = client.infer("seq_string", [tensor], sequence_id=corrid, sequence_start=start, sequence_end=end)
        return {name: result.as_numpy(name) for name in ("OUTPUT", "START_OUT", "READY_OUT", "CORRID_OUT")}

    a1, b1 = send(f"alpha-{protocol}", 1, start=True), send(f"beta-{protocol}", 10, start=True)
    a2, b2 = send(f"alpha-{protocol}", 2), send(f"beta-{protocol}", 20, end=True)
    a3 = send(f"alpha-{protocol}", 3, end=True)
    assert [float(r["OUTPUT"][0]) for r in (a1, a2, a3)] == [101, 103, 106]
    assert [float(r["OUTPUT"][0]) for r in (b1, b2)] == [110, 130]
    assert [float(r["START_OUT"][0]) for r in (a1, a2, a3)] == [1, 0, 0]
    assert all(bool(r["READY_OUT"][0]) for r in (a1, a2, a3, b1, b2))
    assert {bytes(r["CORRID_OUT"][0]) for r in (a1, a2, a3)} == {f"alpha-{protocol}".encode()}
    assert {bytes(r["CORRID_OUT"][0]) for r in (b1, b2)} == {f"beta-{protocol}".encode()}


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_requests_the_sequence_batcher_refuses_get_tritons_texts(server, protocol: str):
    module, client = client_for(server, protocol)
    refusals = [
        ({}, "inference request to model 'seq_direct' must specify a non-zero or non-empty correlation ID"),
        ({"corrid": 4242}, "inference request for sequence 4242 to model 'seq_direct' must specify the START flag on "
                           "the first request of the sequence"),
        ({"corrid": 4243, "start": True, "rows": 2},
         "inference request to model 'seq_direct' must specify batch-size 1 due to requirements of sequence batcher"),
        ({"corrid": "text-id", "start": True},
         "sequence batching control 'CORRID' data-type is 'BYTES', but model 'seq_direct' expects 'UINT64'"),
    ]
    for options, text in refusals:
        with pytest.raises(InferenceServerException, match=text):
            step(module, client, "seq_direct", 1, options.get("corrid", 0), start=options.get("start", False),
                 rows=options.get("rows", 1))
    step(module, client, "seq_direct", 1, 4244, start=True, end=True)  # a whole sequence in one request
    with pytest.raises(InferenceServerException, match="sequence 4244 .* must specify the START flag"):
        step(module, client, "seq_direct", 1, 4244)  # after its END the ID is free again


def test_an_idle_sequence_is_released_and_its_slot_goes_to_the_backlog(server):
    """seq_idle has one slot: a second sequence waits in the backlog until the first has been idle for
    max_sequence_idle_microseconds; the first then needs START again, and its new sequence starts from scratch."""
    module, client = client_for(server, "http")
    assert int(step(module, client, "seq_idle", 5, 1, start=True)["OUTPUT"][0, 0]) == 5
    started = time.monotonic()
    second = step(module, httpclient.InferenceServerClient(server.http_url), "seq_idle", 7, 2, start=True)
    waited = time.monotonic() - started
    assert int(second["OUTPUT"][0, 0]) == 7 and waited >= IDLE_US / 1e6 * 0.8
    with pytest.raises(InferenceServerException, match="sequence 1 to model 'seq_idle' must specify the START flag"):
        step(module, client, "seq_idle", 1, 1)
    step(module, client, "seq_idle", 1, 2, end=True)
    assert int(step(module, client, "seq_idle", 3, 1, start=True, end=True)["OUTPUT"][0, 0]) == 3


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_an_ensemble_hands_its_sequence_parameters_to_a_sequence_model_step(server, protocol: str):
    """As Triton does: the ensemble request's sequence_id, start and end go with the step's request."""
    module, client = client_for(server, protocol)

    def send(value: int, start: bool = False, end: bool = False) -> int:
        tensor = module.InferInput("X", [1, 1], "INT32")
        tensor.set_data_from_numpy(np.array([[value]], np.int32))
        result = client.infer("seq_ensemble", [tensor], sequence_id=31337, sequence_start=start, sequence_end=end)
        return int(result.as_numpy("Y")[0, 0])

    assert [send(4, start=True), send(5), send(6, end=True)] == [4, 9, 15]
    with pytest.raises(InferenceServerException, match="must specify a non-zero or non-empty correlation ID"):
        tensor = module.InferInput("X", [1, 1], "INT32")
        tensor.set_data_from_numpy(np.array([[1]], np.int32))
        client.infer("seq_ensemble", [tensor])


def test_metadata_config_statistics_and_metrics_of_a_sequence_model(server):
    """The control and state tensors are the server's, not the client's; /config shows Triton's defaults; a
    sequence of three steps counts three requests and three executions; the warm-up sample (which names only
    INPUT) loaded; pending requests are reported per model."""
    client = httpclient.InferenceServerClient(server.http_url)
    metadata = client.get_model_metadata("seq_stats")
    assert [t["name"] for t in metadata["inputs"]] == ["INPUT"]
    assert sorted(t["name"] for t in metadata["outputs"]) == ["CONTROLS", "CORRID_OUT", "OUTPUT"]
    config = client.get_model_config("seq_stats")["sequence_batching"]
    assert config["max_sequence_idle_microseconds"] == 1_000_000
    assert client.get_model_config("seq_oldest")["sequence_batching"]["oldest"]["preferred_batch_size"] == [2]
    for i in range(3):
        step(httpclient, client, "seq_stats", i, 99, start=i == 0, end=i == 2)
    stats = client.get_inference_statistics("seq_stats")["model_stats"][0]
    assert stats["inference_count"] == 3 and stats["execution_count"] == 3
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in stats["batch_stats"]] == [(1, 3)]
    assert stats["inference_stats"]["success"]["count"] == 3
    metrics = httpx.get(server.metrics_url).text
    assert 'nv_inference_pending_request_count{model="seq_stats",version="1"} 0' in metrics


# -- load-time checks ---------------------------------------------------------------------------------------
BAD_CONTROLS = {
    "no_values": ('control_input [{ name: "START" control [{ kind: CONTROL_SEQUENCE_START }] }]',
                  "sequence batching must specify either 'int32_false_true', 'fp32_false_true' or 'bool_false_true' "
                  "for CONTROL_SEQUENCE_START for bad_no_values"),
    "three_values": ('control_input [{ name: "START" control [{ kind: CONTROL_SEQUENCE_START int32_false_true: '
                     "[0, 1, 2] }] }]", "sequence batching control 'int32_false_true' must have exactly 2 entries "
                                        "for CONTROL_SEQUENCE_START for bad_three_values"),
    "two_starts": ('control_input [{ name: "START" control [{ kind: CONTROL_SEQUENCE_START int32_false_true: [0, 1] '
                   '}] }, { name: "END" control [{ kind: CONTROL_SEQUENCE_START int32_false_true: [0, 1] }] }]',
                   "sequence batching specifies multiple CONTROL_SEQUENCE_START tensors for bad_two_starts"),
    "corrid_type": ('control_input [{ name: "CORRID" control [{ kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_FP32 '
                    "}] }]", "unexpected data type for control CONTROL_SEQUENCE_CORRID for bad_corrid_type. Allowed "
                             "data types are TYPE_UINT64, TYPE_INT64, TYPE_UINT32, TYPE_INT32 and TYPE_STRING"),
    "not_in_graph": ('control_input [{ name: "GO" control [{ kind: CONTROL_SEQUENCE_START int32_false_true: [0, 1] '
                     "}] }]", "model 'bad_not_in_graph': sequence batching control input 'GO' is not an input of "
                              "the ONNX graph"),
    "wrong_type": ('control_input [{ name: "START" control [{ kind: CONTROL_SEQUENCE_START fp32_false_true: [0, 1] '
                   "}] }]", "model 'bad_wrong_type': sequence batching control input 'START' is FP32 in the config, "
                            "but INT32 in the model"),
    "preferred": (CONTROLS + "\n  oldest { preferred_batch_size: [8] }",
                  "sequence batching preferred batch size must be <= max batch size for bad_preferred"),
    "utilization": (CONTROLS + "\n  direct { minimum_slot_utilization: 1.5 }",
                    "sequence batching minimum slot utilization must be in range (0.0, 1.0] for bad_utilization"),
    "initial_name": (CONTROLS.replace("dims: [1] }]", "dims: [1] initial_state [{ data_type: TYPE_INT32 dims: [1] "
                                                      "zero_data: true }] }]"),
                     "Field 'name' must be set when using initial_state for state input 'STATE_IN'."),
    "initial_dims": (CONTROLS.replace("dims: [1] }]", "dims: [1] initial_state [{ name: \"z\" data_type: TYPE_INT32 "
                                                      "dims: [2] zero_data: true }] }]"),
                     "'initial_state' dim for input name 'STATE_IN' doesn't match 'state' dim description. 2 != 1"),
}


@pytest.fixture(scope="module")
def bad_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bad_sequence_models")
    for name, (controls, _) in BAD_CONTROLS.items():
        examples.write_model(root, f"bad_{name}", accumulator_model(),
                             accumulator_config("", controls=controls))
    examples.write_model(root, "bad_declared", accumulator_model(),
                         accumulator_config("").replace('dims: [1] }]\n', 'dims: [1] }, { name: "START" }]\n', 1))
    flat_start = examples._model(helper.make_graph(
        [helper.make_node("Identity", ["INPUT"], ["OUTPUT"])], "flat_start",
        [vi("INPUT", TensorProto.INT32, ["b", 1]), vi("START", TensorProto.INT32, ["b"])],
        [vi("OUTPUT", TensorProto.INT32, ["b", 1])]))
    examples.write_model(root, "bad_control_rank", flat_start, accumulator_config(
        "", controls='control_input [{ name: "START" control [{ kind: CONTROL_SEQUENCE_START int32_false_true: [0, 1] '
                     "}] }]"))
    return root


OTHER_BAD = {
    "declared": "model 'bad_declared': 'START' is a sequence batching control or state input, which the server fills; "
                "remove it from the config's input list",
    "control_rank": "model 'bad_control_rank': sequence batching control input 'START' has shape [-1] in the model; "
                    "the server feeds it [batch, 1], one element per request",
}


@pytest.mark.parametrize("name", [*BAD_CONTROLS, *OTHER_BAD])
def test_a_config_the_sequence_batcher_cannot_run_fails_the_load_with_its_reason(bad_repository: Path, name: str):
    expected = BAD_CONTROLS[name][1] if name in BAD_CONTROLS else OTHER_BAD[name]

    async def load() -> ServerError:
        core = ServerCore(CoreOptions([str(bad_repository)], model_control_mode="explicit"))
        await core.start()
        try:
            with pytest.raises(ServerError) as failure:
                await core.load_model(f"bad_{name}")
            return failure.value
        finally:
            await core.stop()

    error = asyncio.run(load())
    assert error.kind is ErrorKind.INVALID_ARGUMENT and expected in error.message


# -- request parameters -------------------------------------------------------------------------------------
def test_sequence_parameters_as_the_frontends_carry_them():
    assert request_of({}) == SequenceRequest(0, False, False)
    assert request_of({"sequence_id": 7, "sequence_start": True}) == SequenceRequest(7, True, False)
    assert request_of({"sequence_id": "s-1", "sequence_end": True}) == SequenceRequest("s-1", False, True)
    assert request_of({"sequence_id": -1}).corrid == (1 << 64) - 1  # gRPC's int64_param of a large uint64 ID
    for parameters, text in [({"sequence_id": True}, "Unable to parse 'sequence_id'"),
                             ({"sequence_id": 1.5}, "Unable to parse 'sequence_id'"),
                             ({"sequence_id": 1 << 64}, "does not fit in 64 bits"),
                             ({"sequence_id": 1, "sequence_start": 1}, "Unable to parse 'sequence_start'"),
                             ({"sequence_id": 1, "sequence_end": "yes"}, "Unable to parse 'sequence_end'")]:
        with pytest.raises(ServerError, match=text):
            request_of(parameters)


def test_corrid_columns_in_each_data_type():
    ids = [(1 << 64) - 1, 5, 0]
    assert CorridControl("C", "UINT64").column(ids, True)[:, 0].tolist() == ids
    assert CorridControl("C", "INT64").column(ids, True)[:, 0].tolist() == [-1, 5, 0]
    assert CorridControl("C", "UINT32").column(ids, False).tolist() == [0xFFFFFFFF, 5, 0]  # the low 4 bytes
    assert CorridControl("C", "INT32").column(ids, False).tolist() == [-1, 5, 0]
    assert CorridControl("C", "BYTES").column(["a", 0], False).tolist() == [b"a", b""]


# -- the direct strategy in-process -------------------------------------------------------------------------
def _settings(slots: int = 4, delay_us: int = 0, utilization: float = 0.0) -> SequenceSettings:
    return SequenceSettings(
        "m", slots, False, slots, idle_ns=10**9, max_queue_delay_ns=delay_us * 1000,
        minimum_slot_utilization=utilization, start=BoolControl("START", "INT32", 0, 1),
        end=BoolControl("END", "INT32", 0, 1), ready=BoolControl("READY", "INT32", 0, 1),
        corrid=CorridControl("CORRID", "UINT64"),
        states=(StateSpec("STATE_IN", "STATE_OUT", "INT32", (1,), np.zeros((1, 1), np.int32)),))


class Accumulator:
    """The accumulator in numpy; records every execution's inputs and can hold executions on a gate."""

    def __init__(self, gated: bool = False) -> None:
        self.gate = threading.Event()
        if not gated:
            self.gate.set()
        self.executions: list[dict[str, np.ndarray]] = []

    def __call__(self, context: object, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.gate.wait(5)
        self.executions.append(inputs)
        output = np.where(inputs["START"].astype(bool), inputs["INPUT"], inputs["STATE_IN"] + inputs["INPUT"])
        return {"OUTPUT": output, "STATE_OUT": output}


def _job(value: int, corrid: int, start: bool = False, end: bool = False) -> Job:
    return Job({"INPUT": np.array([[value]], np.int32)}, 1,
               parameters={"sequence_id": corrid, "sequence_start": start, "sequence_end": end})


def test_rows_without_a_request_are_zeros_with_ready_false():
    """Three sequences hold slots 0-2; when only 0 and 2 have a request, row 1 runs as zeros with READY, START,
    END false and CORRID 0, and each sequence keeps its own sum."""
    executor = Accumulator()

    async def scenario():
        batcher = DirectSequenceBatcher([object()], executor, "t", _settings())
        first = await asyncio.gather(*(batcher.enqueue(_job(v, c, start=True)) for v, c in ((1, 11), (2, 12), (3, 13))))
        second = await asyncio.gather(batcher.enqueue(_job(10, 11)), batcher.enqueue(_job(30, 13, end=True)))
        batcher.close()
        return first, second

    first, second = asyncio.run(scenario())
    assert [int(r.outputs["OUTPUT"][0, 0]) for r in first] == [1, 2, 3]
    assert [int(r.outputs["OUTPUT"][0, 0]) for r in second] == [11, 33]
    batch = executor.executions[-1]
    assert batch["READY"][:, 0].tolist() == [1, 0, 1] and batch["START"][:, 0].tolist() == [0, 0, 0]
    assert batch["END"][:, 0].tolist() == [0, 0, 1] and batch["CORRID"][:, 0].tolist() == [11, 0, 13]
    assert batch["INPUT"][:, 0].tolist() == [10, 0, 30] and batch["STATE_IN"][:, 0].tolist() == [1, 0, 3]


def test_a_batch_waits_for_slot_utilization_or_the_queue_delay():
    """minimum_slot_utilization 0.75 of 4 slots with a 150 ms delay: one ready sequence waits the delay; three
    ready sequences run at once."""
    executor = Accumulator()

    async def scenario():
        batcher = DirectSequenceBatcher([object()], executor, "t", _settings(delay_us=150_000, utilization=0.75))
        started = time.monotonic()
        await batcher.enqueue(_job(1, 1, start=True))
        alone = time.monotonic() - started
        started = time.monotonic()
        await asyncio.gather(batcher.enqueue(_job(1, 1)), batcher.enqueue(_job(2, 2, start=True)),
                             batcher.enqueue(_job(3, 3, start=True)))
        together = time.monotonic() - started
        batcher.close()
        return alone, together

    alone, together = asyncio.run(scenario())
    assert alone >= 0.12 and together < 0.12
    assert [len(e["INPUT"]) for e in executor.executions] == [1, 3]


def test_backlog_pending_counts_and_a_cancelled_request_cancels_its_sequence():
    """With one slot a second sequence waits in the backlog; pending() counts queued requests; when a caller gives
    up on a request before it ran, its sequence's other requests fail and the slot frees."""
    executor = Accumulator(gated=True)

    async def scenario():
        batcher = DirectSequenceBatcher([object()], executor, "t", _settings(slots=1))
        running = batcher.enqueue(_job(1, 1, start=True))
        await asyncio.sleep(0.05)  # taken: executing behind the gate
        queued = batcher.enqueue(_job(2, 1))
        backlog = [batcher.enqueue(_job(5, 2, start=True)), batcher.enqueue(_job(6, 2))]
        pending = batcher.pending()
        queued.cancel()
        executor.gate.set()
        results = await asyncio.gather(running, *backlog, return_exceptions=True)
        with pytest.raises(ServerError, match="must specify the START flag"):
            batcher.enqueue(_job(3, 1))
        after = batcher.pending()
        batcher.close()
        return pending, results, after

    pending, (running, *backlog), after = asyncio.run(scenario())
    assert pending == {1: 3} and after == {1: 0}
    assert int(running.outputs["OUTPUT"][0, 0]) == 1
    assert [int(r.outputs["OUTPUT"][0, 0]) for r in backlog] == [5, 11]


class SlowSequenceAccumulator(Accumulator):
    """The accumulator on two instances; a batch holding INPUT 0 waits for `slow` (a long execution)."""

    def __init__(self) -> None:
        super().__init__()
        self.slow = threading.Event()

    def __call__(self, context: object, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if 0 in inputs["INPUT"][:, 0]:
            self.slow.wait(5)
        return super().__call__(context, inputs)


@pytest.mark.parametrize("preserve", [False, True])
def test_oldest_preserve_ordering_answers_in_arrival_order_across_sequences(preserve: bool):
    """The oldest strategy on two instances, batches of one: sequence 1's request runs long, sequence 2's after it
    is quick. With `oldest { preserve_ordering: true }` sequence 2 is answered only after sequence 1 (Triton's
    order of arrival); without, as soon as it ran."""
    executor = SlowSequenceAccumulator()
    settings = dataclasses.replace(_settings(slots=1), oldest=True, max_batch_size=1, preserve_ordering=preserve)

    async def scenario():
        batcher = OldestSequenceBatcher([object(), object()], executor, "t", settings)
        slow = batcher.enqueue(_job(0, 1, start=True, end=True))
        quick = batcher.enqueue(_job(5, 2, start=True, end=True))
        await asyncio.sleep(0.2)
        quick_first = quick.done()
        executor.slow.set()
        results = await asyncio.wait_for(asyncio.gather(slow, quick), 5)
        batcher.close()
        return quick_first, results

    quick_first, (slow, quick) = asyncio.run(scenario())
    assert quick_first is not preserve
    assert int(slow.outputs["OUTPUT"][0, 0]) == 0 and int(quick.outputs["OUTPUT"][0, 0]) == 5
