"""Honour or refuse (issue #30): every field of Triton's model config is in `server/core/config_fields.py`'s
table; a refused field set to anything but its default fails the model's load naming the field (the model is
UNAVAILABLE, the server serves on), defaults load, and `--lenient-config` turns refusals into one warning each.
The proto's descriptor is walked, so a field added to model_config.proto fails here until the table names it."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as http
from onnx import TensorProto
from tritonclient.utils import InferenceServerException

from server import plan_cache
from server.core import CoreOptions, InferInput, InferRequest, ModelState, ServerCore
from server.core.config_fields import (
    FIELDS,
    KNOWN_PARAMETERS,
    ConfigFieldCheck,
    Status,
    markdown_table,
    refusals,
)
from server.core.errors import ErrorKind, ServerError
from server.core.model_config import parse_config_json, parse_config_text
from server.protos import model_config_pb2

from .conftest import ROOT, examples, run_server

# One config per field the table refuses (or refuses some values of), setting it to a refused value.
REFUSED_EXAMPLES = {
    "runtime": 'runtime: "model.py"',
    "input.is_shape_tensor": 'input [{ name: "INPUT0" is_shape_tensor: true }]',
    "input.allow_ragged_batch": 'input [{ name: "INPUT0" allow_ragged_batch: true }]',
    "input.optional": 'input [{ name: "INPUT1" optional: true }]',
    "input.is_non_linear_format_io": 'input [{ name: "INPUT0" is_non_linear_format_io: true }]',
    "output.is_shape_tensor": 'output [{ name: "OUTPUT0" is_shape_tensor: true }]',
    "output.is_non_linear_format_io": 'output [{ name: "OUTPUT0" is_non_linear_format_io: true }]',
    "batch_input": 'batch_input [{ kind: BATCH_ELEMENT_COUNT target_name: "N" data_type: TYPE_FP32 '
                   'source_input: "INPUT0" }]',
    "batch_output": 'batch_output [{ target_name: "OUTPUT0" kind: BATCH_SCATTER_WITH_INPUT_SHAPE '
                    'source_input: "INPUT0" }]',
    "optimization.graph.level": "optimization { graph { level: 1 } }",
    "optimization.priority": "optimization { priority: PRIORITY_MAX }",
    "optimization.cuda.graph_spec": "optimization { cuda { graph_spec [{ batch_size: 4 }] } }",
    "optimization.cuda.output_copy_stream": "optimization { cuda { output_copy_stream: true } }",
    "optimization.execution_accelerators.gpu_execution_accelerator":
        'optimization { execution_accelerators { gpu_execution_accelerator [{ name: "tensorrt" '
        'parameters { key: "precision_mode" value: "FP16" } }] } }',
    "optimization.execution_accelerators.cpu_execution_accelerator":
        'optimization { execution_accelerators { cpu_execution_accelerator [{ name: "openvino" }] } }',
    "optimization.input_pinned_memory": "optimization { input_pinned_memory { enable: false } }",
    "optimization.output_pinned_memory": "optimization { output_pinned_memory { } }",
    "optimization.gather_kernel_buffer_threshold": "optimization { gather_kernel_buffer_threshold: 8 }",
    "optimization.eager_batching": "optimization { eager_batching: true }",
    "sequence_batching.state.use_growable_memory": 'sequence_batching { state [{ input_name: "INPUT0" output_name: '
                                                   '"OUTPUT0" data_type: TYPE_FP32 dims: [16] use_growable_memory: '
                                                   "true }] }",
    "sequence_batching.iterative_sequence": "sequence_batching { iterative_sequence: true }",
    "ensemble_scheduling": 'ensemble_scheduling { step [{ model_name: "add_sub" model_version: -1 }] }',
    "instance_group.kind": "instance_group [{ kind: KIND_MODEL }]",
    "instance_group.rate_limiter.resources": 'instance_group [{ rate_limiter { resources [{ name: "R1" count: 2 }] '
                                             "} }]",
    "instance_group.rate_limiter.priority": "instance_group [{ rate_limiter { priority: 2 } }]",
    "instance_group.secondary_devices": "instance_group [{ secondary_devices [{ kind: KIND_NVDLA device_id: 0 }] }]",
    "instance_group.profile": 'instance_group [{ profile: ["0"] }]',
    "instance_group.passive": "instance_group [{ passive: true }]",
    "instance_group.host_policy": 'instance_group [{ host_policy: "numa0" }]',
    "cc_model_filenames": 'backend: "python" cc_model_filenames { key: "9.0" value: "model_sm90.onnx" }',
    "metric_tags": 'metric_tags { key: "team" value: "search" }',
    "model_operations.op_library_filename": 'model_operations { op_library_filename: ["libcustom_ops.so"] }',
    "model_transaction_policy.decoupled": "model_transaction_policy { decoupled: true }",
    "model_repository_agents.agents": 'model_repository_agents { agents [{ name: "decrypt" }] }',
    "response_cache.enable": "response_cache { enable: true }\nmodel_transaction_policy { decoupled: true }",
    "model_metrics.metric_control": "model_metrics { metric_control [{ histogram_options { buckets: [1, 10] } }] }",
    "model_metrics.metric_control.metric_identifier.family":
        'model_metrics { metric_control [{ metric_identifier { family: "nv_inference_request_duration" } '
        "histogram_options { buckets: [1, 10] } }] }",
    "model_metrics.metric_control.histogram_options.buckets":
        'model_metrics { metric_control [{ metric_identifier { family: "nv_inference_first_response_histogram_ms" } '
        "histogram_options { buckets: [10, 1] } }] }",
}

# Every field Kiln refuses, at its default (or an honoured value): what a config copied from Triton's /config
# carries. JSON, as Triton serves it.
TRITON_COMPLETED_CONFIG = {
    "name": "defaults", "platform": "onnxruntime_onnx", "backend": "onnxruntime", "runtime": "",
    "version_policy": {"latest": {"num_versions": 1}}, "max_batch_size": 8,
    "input": [{"name": n, "data_type": "TYPE_FP32", "format": "FORMAT_NONE", "dims": [16], "is_shape_tensor": False,
               "allow_ragged_batch": False, "optional": False, "is_non_linear_format_io": False}
              for n in ("INPUT0", "INPUT1")],
    "output": [{"name": n, "data_type": "TYPE_FP32", "dims": [16], "label_filename": "", "is_shape_tensor": False,
                "is_non_linear_format_io": False} for n in ("OUTPUT0", "OUTPUT1")],
    "batch_input": [], "batch_output": [],
    "optimization": {"priority": "PRIORITY_DEFAULT", "input_pinned_memory": {"enable": True},
                     "output_pinned_memory": {"enable": True}, "gather_kernel_buffer_threshold": 0,
                     "eager_batching": False, "cuda": {"graphs": True, "busy_wait_events": False,
                                                       "output_copy_stream": False, "graph_spec": []}},
    "dynamic_batching": {"preferred_batch_size": [4], "max_queue_delay_microseconds": 100,
                         "preserve_ordering": False},
    "instance_group": [{"name": "defaults_0", "kind": "KIND_CPU", "count": 1, "gpus": [], "secondary_devices": [],
                        "profile": [], "passive": False, "host_policy": ""}],
    "default_model_filename": "model.onnx", "cc_model_filenames": {}, "metric_tags": {}, "parameters": {},
    "model_warmup": [], "model_transaction_policy": {"decoupled": False}, "response_cache": {"enable": False},
    "model_operations": {"op_library_filename": []}, "model_repository_agents": {"agents": []},
    "model_metrics": {"metric_control": []},
}


def _proto_paths(descriptor, prefix: str = "") -> list[str]:
    """Every field path under `descriptor`, as the table spells them (a map's message values: path.field)."""
    paths = []
    for field in descriptor.fields:
        path = prefix + field.name
        paths.append(path)
        message = field.message_type
        if message is None:
            continue
        if message.GetOptions().map_entry:
            message = message.fields_by_name["value"].message_type
            if message is None:
                continue
        paths += _proto_paths(message, path + ".")
    return paths


def _covered(path: str) -> bool:
    """In the table itself, or inside a field whose rule covers everything inside it."""
    parts = path.split(".")
    return path in FIELDS or any(FIELDS.get(".".join(parts[:i]), None) is not None
                                 and FIELDS[".".join(parts[:i])].whole for i in range(1, len(parts)))


def test_the_table_names_every_field_of_the_proto_and_nothing_else():
    paths = _proto_paths(model_config_pb2.ModelConfig.DESCRIPTOR)
    assert len(paths) > 150  # the walk went deep (sequence_batching.state.initial_state.data_file, ...)
    missing = [p for p in paths if not _covered(p)]
    assert not missing, f"model_config.proto fields missing from server/core/config_fields.py FIELDS: {missing}"
    stale = sorted(set(FIELDS) - set(paths))
    assert not stale, f"FIELDS entries that are not model_config.proto fields: {stale}"


def test_partly_rules_say_which_values_are_honoured_and_refused_ones_say_what_to_do():
    for path, rule in FIELDS.items():
        assert rule.note, path
        if rule.status is Status.PARTLY:
            assert rule.accepts is not None and rule.refusal, path
        if rule.status is not Status.HONOURED:
            assert "Remove" in (rule.refusal or rule.note) or "Use" in (rule.refusal or rule.note), path


def test_every_refused_field_has_an_example_here():
    refused = {p for p, rule in FIELDS.items() if rule.status is not Status.HONOURED}
    assert set(REFUSED_EXAMPLES) == refused


def test_known_parameters_are_the_ones_the_server_reads():
    """Every config parameter server/core reads (`config.parameters.get(NAME)`, `bool_parameter(config, NAME, ...)`)
    is in KNOWN_PARAMETERS, and nothing else."""
    text = "\n".join(source.read_text() for source in (ROOT / "server" / "core").glob("*.py"))
    constants = dict(re.findall(r'^([A-Z_]+) = "([A-Za-z_]+)"', text, re.MULTILINE))  # Triton's EXECUTION_ENV_PATH too
    read = set(re.findall(r"(?:config\.parameters\.get\(|bool_parameter\(config, )([A-Z_]+)", text))
    assert len(read) >= 5 and read <= set(constants)
    assert {constants[name] for name in read} == set(KNOWN_PARAMETERS)


# Refused fields at their defaults (and honoured values), as a config.pbtxt.
DEFAULTS_TEXT = """max_batch_size: 8
input [{ name: "INPUT0" data_type: TYPE_FP32 format: FORMAT_NONE dims: [ 16 ] optional: false }]
instance_group [{ name: "cpu" kind: KIND_CPU count: 2 passive: false host_policy: "" }]
optimization { input_pinned_memory { enable: true } cuda { graphs: true } }
model_transaction_policy { decoupled: false }
response_cache { enable: false }
dynamic_batching { preserve_ordering: false }
parameters { key: "kiln_warmup_buckets" value { string_value: "true" } }
"""
# Two refusals that --lenient-config lets load (the model then runs without them).
LENIENT_CONFIG = ('max_batch_size: 8\ninstance_group [{ kind: KIND_CPU }]\noptimization { eager_batching: true }\n'
                  "model_transaction_policy { decoupled: true }\n")


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One model per refused example (refused_<i>), one config of defaults, one with a lenient-loadable refusal."""
    root = tmp_path_factory.mktemp("config_fields")
    model = examples.add_sub_model(TensorProto.FLOAT)
    for i, snippet in enumerate(REFUSED_EXAMPLES.values()):
        examples.write_model(root, f"refused_{i}", model, snippet + "\n")
    examples.write_model(root, "defaults", model, DEFAULTS_TEXT)
    examples.write_model(root, "lenient", model, LENIENT_CONFIG)
    return root


def _with_core(repository: Path, scenario, lenient: bool = False):
    """Run `scenario(core)` against an in-process core in explicit mode (no model loaded at start)."""

    async def go():
        core = ServerCore(CoreOptions([str(repository)], model_control_mode="explicit", lenient_config=lenient))
        await core.start()
        try:
            return await scenario(core)
        finally:
            await core.stop()

    return asyncio.run(go())


@pytest.fixture
def private_plan_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plan_cache, "_default", plan_cache.PlanCache(tmp_path / "plans"))


@pytest.mark.parametrize("index, path", list(enumerate(REFUSED_EXAMPLES)), ids=list(REFUSED_EXAMPLES))
def test_a_refused_field_fails_the_load_naming_field_and_model(repository: Path, index: int, path: str):
    name = f"refused_{index}"

    async def scenario(core: ServerCore):
        with pytest.raises(ServerError) as failure:
            await core.load_model(name)
        index_entry = next(m for m in await core.repository_index() if m["name"] == name)
        return failure.value, index_entry

    error, entry = _with_core(repository, scenario)
    assert error.kind is ErrorKind.INVALID_ARGUMENT
    assert f"config field '{path}'" in error.message and f"model '{name}'" in error.message
    assert "--lenient-config" in error.message
    assert entry["state"] == ModelState.UNAVAILABLE and f"'{path}'" in entry["reason"]


def test_the_refusal_shows_the_value_and_lists_every_refused_field():
    config = parse_config_text('input [{ name: "INPUT0" is_shape_tensor: true }]\n'
                               "instance_group [{ kind: KIND_MODEL gpus: [0, 1] }]\n"
                               "sequence_batching { iterative_sequence: true }", "m")
    found = [(r.path, r.shown) for r in refusals(config)]
    assert found == [("input.is_shape_tensor", "True"), ("instance_group.kind", "KIND_MODEL"),
                     ("sequence_batching.iterative_sequence", "True")]  # in field-number order
    with pytest.raises(ServerError) as failure:
        ConfigFieldCheck().check(config, "m")
    message = failure.value.message
    assert message.startswith("model 'm': config field 'input.is_shape_tensor' (True) is refused: Kiln does not yet "
                              "support shape-tensor inputs")
    assert "'instance_group.kind' (KIND_MODEL)" in message
    assert "'sequence_batching.iterative_sequence' (True) is refused" in message


@pytest.mark.parametrize("text", [
    "instance_group [{ kind: KIND_GPU gpus: [0] count: 2 }]",
    "instance_group [{ kind: KIND_GPU gpus: [0, 1] count: 2 }]",  # an ONNX model: placed (placement.py)
    'backend: "kiln_llm"\ninstance_group [{ kind: KIND_GPU gpus: [0, 1] count: 2 }]',  # generative replicas
    "optimization { input_pinned_memory { enable: true } output_pinned_memory { enable: true } }",
    'platform: "ensemble"\nensemble_scheduling { step [{ model_name: "add_sub" model_version: -1 }] }',
    "instance_group [{ rate_limiter { } }]\nmodel_repository_agents { }\nmodel_metrics { }\nresponse_cache { }",
    'model_metrics { metric_control [{ metric_identifier { family: "nv_inference_first_response_histogram_ms" } '
    "histogram_options { buckets: [1, 10.5] } }] }",
])
def test_honoured_values_of_partly_refused_fields_and_empty_containers_pass(text: str):
    assert refusals(parse_config_text(text, "m")) == []


def test_a_config_copied_from_tritons_config_endpoint_has_nothing_refused_and_loads(repository: Path,
                                                                                   private_plan_cache):
    config = json.dumps(TRITON_COMPLETED_CONFIG)
    assert refusals(parse_config_json(config, "defaults")) == []

    async def scenario(core: ServerCore):
        await core.load_model("defaults", config=config)
        return (await core.model_config("defaults"))["dynamic_batching"]["preferred_batch_size"]

    assert _with_core(repository, scenario) == [4]


def test_defaults_of_refused_fields_load_and_serve(repository: Path, private_plan_cache):
    async def scenario(core: ServerCore):
        await core.load_model("defaults")  # its config.pbtxt: DEFAULTS_TEXT
        a = np.arange(16, dtype=np.float32).reshape(1, 16)
        request = InferRequest("defaults", [InferInput("INPUT0", "FP32", (1, 16), a),
                                            InferInput("INPUT1", "FP32", (1, 16), a)])
        response = await core.infer(request)
        return {o.name: o.data for o in response.outputs}, await core.model_config("defaults")

    outputs, config = _with_core(repository, scenario)
    np.testing.assert_array_equal(outputs["OUTPUT0"], np.arange(16, dtype=np.float32).reshape(1, 16) * 2)
    assert config["instance_group"][0]["count"] == 2 and "dynamic_batching" in config


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append((record.levelno, record.getMessage()))


@pytest.fixture
def config_log():
    logger = logging.getLogger("kiln.server.config")
    handler, level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)  # whatever the "kiln" logger was left at by earlier tests
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_lenient_loads_with_one_warning_per_model_and_field(repository: Path, private_plan_cache, config_log):
    async def scenario(core: ServerCore):
        await core.load_model("lenient")
        await core.load_model("lenient")  # a reload says nothing new
        return next(m for m in await core.repository_index() if m["name"] == "lenient")

    assert _with_core(repository, scenario, lenient=True)["state"] == ModelState.READY
    warnings = [m for level, m in config_log.messages if level == logging.WARNING]
    assert len(warnings) == 2
    assert "'optimization.eager_batching' (True) is refused" in warnings[0]
    assert "'model_transaction_policy.decoupled'" in warnings[1]
    assert all("model 'lenient'" in w and "--lenient-config" in w for w in warnings)


def test_lenient_does_not_lift_what_triton_refuses_too():
    config = parse_config_text('ensemble_scheduling { step [{ model_name: "add_sub" model_version: -1 }] }\n'
                               "response_cache { enable: true }", "m")
    with pytest.raises(ServerError) as failure:
        ConfigFieldCheck(lenient=True).check(config, "m")
    assert "'ensemble_scheduling' is refused" in failure.value.message
    assert "response_cache" not in failure.value.message  # lenient: that one alone would load


def test_parameters_known_keys_pass_unknown_ones_are_kept_and_said_once(config_log):
    text = "".join(f'parameters {{ key: "{k}" value {{ string_value: "1" }} }}\n'
                   for k in ("kiln_precision", "kiln_precison", "intra_op_thread_count"))
    config = parse_config_text(text, "m")
    check = ConfigFieldCheck()
    check.check(config, "m")
    check.check(config, "m")
    assert len(config.parameters) == 3  # nothing removed: Triton hands every parameter to its backend
    assert [(level, "kiln_precison" in m, "intra_op_thread_count" in m) for level, m in config_log.messages] == [
        (logging.INFO, False, True), (logging.WARNING, True, False)]  # by key


def test_the_docs_carry_the_table_generated_from_the_module():
    docs = (ROOT / "docs" / "server.md").read_text()
    assert markdown_table() in docs, ("docs/server.md's field table is out of date: replace it with the output of "
                                      "`python -m server.core.config_fields`")


# -- a real server ------------------------------------------------------------------------------------------
def test_server_refuses_over_http_and_serves_on(repository: Path, tmp_path: Path):
    with run_server(repository, tmp_path / "server.log", ["defaults"],
                    ["--allow-grpc", "false", "--plan-cache-dir", str(tmp_path / "plans")]) as server:
        client = http.InferenceServerClient(server.http_url)
        with pytest.raises(InferenceServerException, match="'model_transaction_policy.decoupled'") as failure:
            client.load_model("lenient")
        assert "load failed for model 'lenient'" in str(failure.value)
        entry = next(m for m in client.get_model_repository_index() if m["name"] == "lenient")
        assert entry["state"] == "UNAVAILABLE" and "'optimization.eager_batching' (True) is refused" in entry["reason"]
        assert client.is_server_ready() and client.is_model_ready("defaults")


def test_server_with_lenient_config_loads_the_model_and_warns(repository: Path, tmp_path: Path):
    with run_server(repository, tmp_path / "server.log", ["lenient"],
                    ["--allow-grpc", "false", "--lenient-config", "--plan-cache-dir", str(tmp_path / "plans")]
                    ) as server:
        client = http.InferenceServerClient(server.http_url)
        a = np.ones((2, 16), np.float32)
        inputs = [http.InferInput(n, [2, 16], "FP32") for n in ("INPUT0", "INPUT1")]
        for tensor in inputs:
            tensor.set_data_from_numpy(a)
        np.testing.assert_array_equal(client.infer("lenient", inputs).as_numpy("OUTPUT0"), a * 2)
        log = server.log()
    assert log.count("config field 'optimization.eager_batching' (True) is refused") == 1
    assert log.count("config field 'model_transaction_policy.decoupled' (True) is refused") == 1


def test_cc_model_filenames_picks_the_file_of_the_gpus_compute_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's choice for GPU instances: the entry for the device's compute capability, else the default file;
    CPU instances always load the default. A config sent with a load request may not name a file outside."""
    from engine_core import compat
    from server.core import limits, model
    from server.core.model_config import parse_config_text

    config = parse_config_text('cc_model_filenames { key: "9.0" value: "hopper.onnx" }\n'
                               'instance_group [{ kind: KIND_GPU gpus: [1] }]', "m")
    asked: list[int] = []
    monkeypatch.setattr(model, "_backend_for", lambda _: "cuda")
    monkeypatch.setattr(compat, "device_arch", lambda ordinal=0: asked.append(ordinal) or "sm_90")
    assert model.model_filename(config) == ("hopper.onnx", "cc_model_filenames['9.0']") and asked == [1]
    monkeypatch.setattr(compat, "device_arch", lambda ordinal=0: "sm_80")
    assert model.model_filename(config) == ("model.onnx", "default_model_filename")
    monkeypatch.setattr(model, "_backend_for", lambda _: "cpu")
    assert model.model_filename(config) == ("model.onnx", "default_model_filename")
    with pytest.raises(ServerError, match="config file name '../elsewhere.onnx' must be relative"):
        limits.check_load_request("m", '{"cc_model_filenames": {"9.0": "../elsewhere.onnx"}}', {})


def test_a_cpu_instance_loads_the_default_file_whatever_cc_model_filenames_names(tmp_path: Path) -> None:
    examples.write_model(tmp_path / "models", "add_sub", examples.add_sub_model(TensorProto.INT32),
                         'max_batch_size: 8\ninstance_group [{ kind: KIND_CPU }]\n'
                         'cc_model_filenames { key: "9.0" value: "hopper.onnx" }\n')  # no such file: never read here
    with run_server(tmp_path / "models", tmp_path / "server.log", ["add_sub"]) as server:
        assert http.InferenceServerClient(server.http_url).is_model_ready("add_sub")
