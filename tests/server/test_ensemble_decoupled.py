"""Decoupled ensembles (Triton's ensemble_scheduler.cc): a decoupled step makes the ensemble decoupled, and the
steps after it run once per response. Served by a real Kiln server and, where it can run, by the real Triton
(../shared/tools/triton-peer) on the very same repository, driven by the stock tritonclient over a gRPC stream:
Triton's repeat example, then a Python model that negates each value it gets."""

from __future__ import annotations

import shutil
import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from server.core.ensemble import EnsembleStep, decoupled_steps
from server.core.errors import ServerError

from .test_decoupled import generate_stream_events
from .test_triton_examples import REPOSITORY, Urls, _inputs, kiln_or_triton, stream_results

NEGATE = '''import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", (-x).astype(np.int32))]))
        return responses
'''
NEGATE_CONFIG = '''name: "negate_int32"
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU } ]
'''
ENSEMBLE_CONFIG = '''name: "repeat_negate"
platform: "ensemble"
max_batch_size: 0
input [
  { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] },
  { name: "DELAY" data_type: TYPE_UINT32 dims: [ -1 ] },
  { name: "WAIT" data_type: TYPE_UINT32 dims: [ 1 ] }
]
output [
  { name: "NEG" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "IDX" data_type: TYPE_UINT32 dims: [ 1 ] }
]
ensemble_scheduling { step [
  { model_name: "repeat_int32" model_version: -1
    input_map { key: "IN" value: "IN" } input_map { key: "DELAY" value: "DELAY" } input_map { key: "WAIT" value: "WAIT" }
    output_map { key: "OUT" value: "value" } output_map { key: "IDX" value: "IDX" } },
  { model_name: "negate_int32" model_version: -1
    input_map { key: "X" value: "value" } output_map { key: "Y" value: "NEG" } }
] }
'''
MODELS = ["repeat_int32", "negate_int32", "repeat_negate"]


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("decoupled_ensemble")
    shutil.copytree(REPOSITORY / "repeat_int32", root / "repeat_int32")
    for name, files in {"negate_int32": {"1/model.py": NEGATE, "config.pbtxt": NEGATE_CONFIG},
                        "repeat_negate": {"config.pbtxt": ENSEMBLE_CONFIG}}.items():
        (root / name / "1").mkdir(parents=True)
        for path, text in files.items():
            (root / name / path).write_text(text)
    return root


@pytest.fixture(scope="module", params=["kiln", "triton"])
def server(request, repository, tmp_path_factory) -> Iterator[Urls]:
    yield from kiln_or_triton(request.param, tmp_path_factory.mktemp(f"decoupled_ensemble_{request.param}"),
                              repository, MODELS)


def _stream(server: Urls, requests: list[dict[str, np.ndarray]]) -> list[list[tuple[int, int]]]:
    """Per request its answers (NEG, IDX) in order (Triton's last answer carries the final flag when no step is left
    running; an answer-less request gets it alone)."""
    return [[(int(a["NEG"][0]), int(a["IDX"][0])) for a in answers]
            for answers in stream_results(server, "repeat_negate", requests)]


def test_each_response_of_the_decoupled_step_runs_the_next_step_and_answers(server):
    values = np.array([4, 2, 0, 1], dtype=np.int32)
    got = _stream(server, [{"IN": values, "DELAY": np.array([1, 2, 3, 4], np.uint32), "WAIT": np.array([5], np.uint32)},
                           {"IN": np.array([], np.int32), "DELAY": np.array([], np.uint32),
                            "WAIT": np.array([0], np.uint32)}])
    assert got == [[(-int(v), i) for i, v in enumerate(values)], []]  # an empty IN: the final flag only


def test_the_ensemble_is_decoupled_and_single_response_calls_are_refused(server):
    client = httpclient.InferenceServerClient(server.http)
    try:
        assert client.get_model_config("repeat_negate")["model_transaction_policy"]["decoupled"] is True
        arrays = {"IN": np.array([1], np.int32), "DELAY": np.array([1], np.uint32), "WAIT": np.array([1], np.uint32)}
        with pytest.raises(InferenceServerException, match="HTTP end point doesn't support models with decoupled "
                                                           "transaction policy"):
            client.infer("repeat_negate", _inputs(httpclient, arrays))
    finally:
        client.close()
    grpc_client = grpcclient.InferenceServerClient(server.grpc)
    try:
        with pytest.raises(InferenceServerException, match="ModelInfer RPC doesn't support models with decoupled "
                                                           "transaction policy"):
            grpc_client.infer("repeat_negate", _inputs(grpcclient, arrays))
    finally:
        grpc_client.close()


def _step(index: int, model: str, inputs: list[str], outputs: list[str]) -> EnsembleStep:
    return EnsembleStep(index, model, -1, tuple((t, t) for t in inputs), tuple((t, t) for t in outputs))


def test_a_step_fed_by_two_decoupled_steps_is_refused_with_tritons_text():
    decoupled, plain = types.SimpleNamespace(decoupled=True), types.SimpleNamespace(decoupled=False)
    steps = [_step(0, "a", ["IN"], ["x"]), _step(1, "b", ["IN"], ["y"]), _step(2, "c", ["x", "y"], ["OUT"])]
    assert decoupled_steps("e", steps[:1], {0: decoupled}) is True
    assert decoupled_steps("e", steps[:1], {0: plain}) is False
    with pytest.raises(ServerError, match="in ensemble e, step of model 'c' receives inputs originated from "
                                          "different decoupled models"):
        decoupled_steps("e", steps, {0: decoupled, 1: decoupled, 2: plain})
    with pytest.raises(ServerError, match="receives inputs originated from different decoupled models"):
        decoupled_steps("e", steps, {0: decoupled, 1: plain, 2: plain})  # label 1 and the inputs' label 0


def test_http_generate_stream_sends_each_answer_as_an_event(server):
    events = generate_stream_events(f"http://{server.http}/v2/models/repeat_negate/generate_stream",
                                    {"IN": [4, 2, 0, 1], "DELAY": [1, 2, 3, 4], "WAIT": 5})
    # Triton's also carry the sequence_id / sequence_start / sequence_end its Python steps' responses hold
    # (ensemble_scheduler.cc's parameter override); Kiln's do not (docs/server.md)
    assert [{key: event[key] for key in ("model_name", "model_version", "NEG", "IDX")} for event in events] == [
        {"model_name": "repeat_negate", "model_version": "1", "NEG": -value, "IDX": index}
        for index, value in enumerate([4, 2, 0, 1])]
