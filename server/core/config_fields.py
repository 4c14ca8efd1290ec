"""Every field of Triton's `inference.ModelConfig`, honoured or refused: one table, and the check run at load.

Why: a Triton model repository moved to Kiln must get Triton's behaviour or a clear refusal, never a field that
loads READY and silently does nothing (issue #30). `FIELDS` names every field of model_config.proto (nested ones
too; `tests/server/test_config_fields.py` walks the descriptor, so a proto update cannot add a field the table
leaves out). A field is HONOURED (the note says where it takes effect), REFUSED (any value but the default fails
the model's load, with the note as the reason and what to do instead) or PARTLY (some values are honoured, the
others refused, as the note says). `ConfigFieldCheck` runs at every load; `kiln serve --lenient-config` turns a
refusal into one logged warning per model and field and loads the model with the field ignored (except where
Triton refuses the value too: `Rule.lenient`).

A field counts as set as protobuf tells it (`ListFields`): a scalar other than its default, a non-empty list or
map, a message that is present. So `decoupled: false` or `response_cache { enable: false }` are accepted, while
`sequence_batching { }` (present, so Triton runs the sequence batcher) is refused.

`python -m server.core.config_fields` prints the table that docs/server.md carries.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from server.protos import model_config_pb2

from . import repository_agents
from .errors import invalid
from .latency import HISTOGRAM_FAMILIES, valid_buckets

log = logging.getLogger("kiln.server.config")

ModelConfig = model_config_pb2.ModelConfig
InstanceGroup = model_config_pb2.ModelInstanceGroup


class Status(enum.Enum):
    HONOURED = "honoured"
    REFUSED = "refused"
    PARTLY = "partly"  # some values honoured, the others refused: the note says which


#: values of a PARTLY field that are honoured: (the field's value, the whole config) -> bool
Accepts = Callable[[Any, ModelConfig], bool]


@dataclass(frozen=True)
class Rule:
    """What Kiln does with one config field."""

    status: Status
    note: str  # honoured: where it takes effect; refused: why, and what the user can do instead
    accepts: Accepts | None = None  # PARTLY: the values that are honoured
    refusal: str = ""  # PARTLY: the reason and what to do, for the values that are not (REFUSED: the note)
    whole: bool = False  # the rule covers every field inside this one (a refused message, an ensemble's steps)
    container: bool = False  # a message that only groups the fields below it: present and empty, it does nothing
    lenient: bool = True  # False: Triton refuses the value too, so --lenient-config cannot load the model with it

    def honours(self, value: Any, config: ModelConfig) -> bool:
        if self.status is Status.HONOURED:
            return True
        return self.accepts is not None and self.accepts(value, config)


def honoured(where: str) -> Rule:
    return Rule(Status.HONOURED, where)


def refused(why_and_instead: str, whole: bool = False) -> Rule:
    return Rule(Status.REFUSED, why_and_instead, whole=whole)


def partly(note: str, accepts: Accepts, refusal: str, whole: bool = False, lenient: bool = True) -> Rule:
    return Rule(Status.PARTLY, note, accepts, refusal, whole=whole, lenient=lenient)


def container() -> Rule:
    return Rule(Status.HONOURED, "groups the fields below; present and empty it changes nothing, as in Triton",
                container=True)


_NOT_YET = "Kiln does not yet support"
_HISTOGRAMS = ", ".join(HISTOGRAM_FAMILIES)
_CUDA_BACKEND = "Kiln's CUDA backend"


def _pinned(side: str) -> Rule:
    """input/output_pinned_memory: Triton reads a missing message as enabled, a present one by its `enable`."""
    return partly(f"enable: true honoured ({_CUDA_BACKEND} always stages {side} through pinned host buffers, "
                  "engine_core/backends/cuda/runner.py); enable: false refused",
                  lambda value, _: bool(value.enable),
                  "Kiln cannot turn pinned staging off (enable: false, or the message without enable, which Triton "
                  "reads as false). Remove it or set enable: true", whole=True)


def _cacheable(_: Any, config: ModelConfig) -> bool:
    """response_cache.enable with a model Triton caches: not one of the sequence batcher, not decoupled
    (core/src/model_config_utils.cc ValidateModelConfig)."""
    return not config.HasField("sequence_batching") and not config.model_transaction_policy.decoupled


# Model config parameters Kiln reads, and where (each reader checks its value when the model loads).
KNOWN_PARAMETERS: dict[str, str] = {
    "kiln_precision": "builder precision flags (model.apply_precision)",
    "kiln_profile_batch_sizes": "one optimization profile per batch size (model.profile_batch_sizes)",
    "kiln_pad_batch": "the dynamic batcher zero-pads requests of different shapes (model.pad_batch)",
    "kiln_execution_timeout_ms": "how long one execution may run (model.execution_timeout_s)",
    "kiln_warmup_buckets": "bind and capture every batch bucket at load (warmup.warm_up_buckets)",
    "EXECUTION_ENV_PATH": "a Python model's environment: its stubs run that directory's bin/python "
                          "(python_model.stub_interpreter)",
    "max_context": "a generative model's tokens per sequence (generative_config.generation_settings)",
    "kv_cache_blocks": "a generative model's KV-cache blocks (generative_config.generation_settings)",
    "kv_block_tokens": "a generative model's tokens per KV-cache block (generative_config.generation_settings)",
    "max_prefill_tokens": "a generative model's prompt tokens per loop iteration, longer prompts in chunks "
                          "(generative_config.generation_settings)",
    "enable_prefix_caching": "a generative model shares the KV blocks of prompt prefixes computed before "
                             "(generative_config.generation_settings)",
    "cuda_graph_warm_up": "a generative model on the GPU captures every shape bucket's CUDA graph before it is ready "
                          "(generative_config.generation_settings)",
}

# One entry per field of model_config.proto, by its path from ModelConfig ("instance_group.gpus"; a map's value
# fields as "parameters.string_value"). Notes name the code that reads a field; refused notes end with what to do.
FIELDS: dict[str, Rule] = {
    "name": honoured("must match the model's directory name (model_config.complete_config)"),
    "platform": honoured("ONNX platforms (kiln_onnx, onnxruntime_onnx, onnx) and ensemble (a Python model has "
                         "none); others refused at load (model_config._check_platform)"),
    "backend": honoured("ONNX backends (kiln, onnxruntime, onnx), python (model.py in stub processes, "
                        "server/core/python_model.py) and kiln_llm (generative models, server/core/generative.py); "
                        "others refused at load (model_config._check_platform)"),
    "runtime": refused("Kiln runs ONNX models with its own engine and loads no backend library. Remove runtime"),
    "version_policy": honoured("which versions load (repository.select_versions); default latest 1"),
    "version_policy.latest": honoured("the newest num_versions versions (repository.select_versions)"),
    "version_policy.latest.num_versions": honoured("repository.select_versions"),
    "version_policy.all": honoured("every version in the repository (repository.select_versions)"),
    "version_policy.specific": honoured("the listed versions; a missing one fails the load "
                                        "(repository.select_versions)"),
    "version_policy.specific.versions": honoured("repository.select_versions"),
    "max_batch_size": honoured("batch dim, profiles and request checks (model_config.complete_config, "
                               "model.check_inputs)"),
    "input": honoured("checked against the ONNX graph, missing ones added (model_config._complete_tensors)"),
    "input.name": honoured("must name an ONNX graph input (model_config._complete_tensors)"),
    "input.data_type": honoured("must match the graph; requests are checked against it (model.check_inputs)"),
    "input.format": honoured("informational, as for Triton's ONNX Runtime backend: served at /config for clients "
                             "(the engine takes the ONNX graph's layout)"),
    "input.dims": honoured("request shapes are checked against it; -1 is variable (model.check_inputs)"),
    "input.reshape": honoured("requests are reshaped to it before execution (model.model_shape, check_inputs)"),
    "input.reshape.shape": honoured("model.model_shape"),
    "input.is_shape_tensor": refused(f"{_NOT_YET} shape-tensor inputs in the server (a TensorRT feature; an ONNX "
                                     "model's shape inputs are ordinary INT64 inputs). Remove is_shape_tensor"),
    "input.allow_ragged_batch": refused(f"{_NOT_YET} ragged batching: requests of different shapes are batched "
                                        "only with kiln_pad_batch (zero-padding). Remove allow_ragged_batch"),
    "input.optional": partly("optional: true honoured for Python models (a request may leave the input out; "
                             "pb_utils.get_input_tensor_by_name then gives None, as in Triton) and a generative "
                             "model's inputs (backend: \"kiln_llm\", generative_config.INPUTS, all optional); "
                             "refused for ONNX models",
                             lambda _, config: config.backend in ("kiln_llm", "python"),
                             f"{_NOT_YET} optional inputs of ONNX models: every request must carry every input. "
                             "Remove optional and send the input with every request"),
    "input.is_non_linear_format_io": refused(f"{_NOT_YET} non-linear I/O formats (a TensorRT feature). Remove it"),
    "output": honoured("checked against the built engine, missing ones added (model_config.complete_outputs_from_"
                       "engine)"),
    "output.name": honoured("must name an output the model produces (model._check_declared_outputs)"),
    "output.data_type": honoured("must match the engine's output (model._check_declared_outputs)"),
    "output.dims": honoured("the output's shape in metadata and /config; with reshape, what outputs are reshaped "
                            "back to (model.shape_output)"),
    "output.reshape": honoured("outputs are reshaped back to dims (model.shape_output)"),
    "output.reshape.shape": honoured("model.model_shape"),
    "output.label_filename": honoured("labels of the classification extension (model._read_labels, classify)"),
    "output.is_shape_tensor": refused(f"{_NOT_YET} shape-tensor outputs in the server (a TensorRT feature). Remove "
                                      "is_shape_tensor"),
    "output.is_non_linear_format_io": refused(f"{_NOT_YET} non-linear I/O formats (a TensorRT feature). Remove it"),
    "batch_input": refused(f"{_NOT_YET} batch inputs (tensors the batcher makes from a batch, e.g. for ragged "
                           "batching). Remove batch_input", whole=True),
    "batch_output": refused(f"{_NOT_YET} batch outputs (outputs scattered back per request by the batcher). "
                            "Remove batch_output", whole=True),
    "optimization": container(),
    "optimization.graph": container(),
    "optimization.graph.level": refused("Kiln always applies its own graph optimizations (the builder's passes); "
                                        "there is no per-model level. Remove optimization.graph.level"),
    "optimization.priority": refused(f"{_NOT_YET} model priorities (CUDA stream priorities): every model's work "
                                     "runs at one priority. Remove optimization.priority, or use dynamic_batching "
                                     "priority_levels for request priorities"),
    "optimization.cuda": container(),
    "optimization.cuda.graphs": honoured(f"true asks for what {_CUDA_BACKEND} always does: it replays captured "
                                         "CUDA graphs (engine_core/backends/cuda/runner.py), every batch bucket "
                                         "captured at load (server/core/warmup.py)"),
    "optimization.cuda.busy_wait_events": honoured("the executor processes of a CUDA model wait for their runs by "
                                                   "spinning instead of sleeping (KILN_BLOCKING_SYNC=0 there); "
                                                   "refused at load for a CUDA model that runs in the server "
                                                   "process, with the reason (model.load_model_version); no CUDA "
                                                   "events on the CPU backend, as in Triton"),
    "optimization.cuda.graph_spec": refused("Kiln captures CUDA graphs for its own batch buckets (powers of two and "
                                            "the midpoints between them, server/core/execution.py), not for listed "
                                            "shapes. Remove graph_spec", whole=True),
    "optimization.cuda.output_copy_stream": refused(f"{_CUDA_BACKEND} schedules its copies itself, inside the "
                                                    "captured graph. Remove output_copy_stream"),
    "optimization.execution_accelerators": container(),
    "optimization.execution_accelerators.gpu_execution_accelerator": refused(
        "Kiln builds its own engine and runs no TensorRT or other accelerator. Remove the accelerator; for reduced "
        'precision use parameters { key: "kiln_precision" value { string_value: "fp16" } }', whole=True),
    "optimization.execution_accelerators.cpu_execution_accelerator": refused(
        "Kiln builds its own engine and runs no OpenVINO or other accelerator. Remove the accelerator", whole=True),
    "optimization.input_pinned_memory": _pinned("inputs"),
    "optimization.output_pinned_memory": _pinned("outputs"),
    "optimization.gather_kernel_buffer_threshold": refused(
        f"{_CUDA_BACKEND} gathers a batch's requests itself, straight into pinned staging "
        "(ExecutionContext.infer_batch). Remove gather_kernel_buffer_threshold"),
    "optimization.eager_batching": refused(f"{_NOT_YET} eager batching. Remove eager_batching"),
    "dynamic_batching": honoured("present, requests are batched by the dynamic batcher (model._scheduler, "
                                 "server/core/batcher.py) when max_batch_size > 0"),
    "dynamic_batching.preferred_batch_size": honoured("batcher.BatchingSettings; a batch of a preferred size is "
                                                      "sent at once"),
    "dynamic_batching.max_queue_delay_microseconds": honoured("how long a batch may wait to fill "
                                                              "(batcher.BatchingSettings)"),
    "dynamic_batching.preserve_ordering": honoured("answers leave in the order the requests reached the batcher, "
                                                   "whatever order their batches end in (batcher.ResponseOrder)"),
    "dynamic_batching.priority_levels": honoured("request priorities 1..N (batcher.BatchingSettings)"),
    "dynamic_batching.default_priority_level": honoured("priority of a request without one "
                                                        "(batcher.BatchingSettings)"),
    "dynamic_batching.default_queue_policy": honoured("queue policy of every level without its own (batcher._policy)"),
    "dynamic_batching.default_queue_policy.timeout_action": honoured("REJECT or DELAY a timed-out request "
                                                                     "(batcher._policy)"),
    "dynamic_batching.default_queue_policy.default_timeout_microseconds": honoured("batcher._policy"),
    "dynamic_batching.default_queue_policy.allow_timeout_override": honoured("a request's own timeout parameter "
                                                                             "(batcher._policy)"),
    "dynamic_batching.default_queue_policy.max_queue_size": honoured("beyond it 429 / RESOURCE_EXHAUSTED "
                                                                     "(batcher._policy)"),
    "dynamic_batching.priority_queue_policy": honoured("queue policy per priority level (batcher.BatchingSettings)"),
    "dynamic_batching.priority_queue_policy.timeout_action": honoured("batcher._policy"),
    "dynamic_batching.priority_queue_policy.default_timeout_microseconds": honoured("batcher._policy"),
    "dynamic_batching.priority_queue_policy.allow_timeout_override": honoured("batcher._policy"),
    "dynamic_batching.priority_queue_policy.max_queue_size": honoured("batcher._policy"),
    "sequence_batching": honoured("present, requests run through the sequence batcher (model._scheduler, "
                                  "server/core/sequence.py): correlation IDs, slots, control inputs, implicit state"),
    "sequence_batching.direct": honoured("the direct strategy, the default: one slot per batch row "
                                         "(sequence.DirectSequenceBatcher)"),
    "sequence_batching.direct.max_queue_delay_microseconds": honoured(
        "with minimum_slot_utilization, how long a batch waits for more slots (sequence.DirectSequenceBatcher)"),
    "sequence_batching.direct.minimum_slot_utilization": honoured(
        "share of ready slots that starts a batch before the queue delay (sequence.DirectSequenceBatcher)"),
    "sequence_batching.oldest": honoured("the oldest strategy: the next request of each sequence goes to a dynamic "
                                         "batcher (sequence.OldestSequenceBatcher)"),
    "sequence_batching.oldest.max_candidate_sequences": honoured("sequence slots per instance "
                                                                 "(sequence_config._strategy)"),
    "sequence_batching.oldest.preferred_batch_size": honoured("the batcher's preferred sizes; default "
                                                              "[max_batch_size] (model_config, batcher)"),
    "sequence_batching.oldest.max_queue_delay_microseconds": honoured("how long a batch may wait to fill "
                                                                      "(batcher.BatchingSettings)"),
    "sequence_batching.oldest.preserve_ordering": honoured("answers leave in the order the requests reached the "
                                                           "sequence batcher, across sequences "
                                                           "(batcher.ResponseOrder)"),
    "sequence_batching.max_sequence_idle_microseconds": honoured("an idle sequence's slot and state are released; "
                                                                 "default 1 s (sequence.SequenceBatcher)"),
    "sequence_batching.control_input": honoured("tensors the batcher fills per batch row (sequence_config)"),
    "sequence_batching.control_input.name": honoured("a graph input; not a client input "
                                                     "(sequence_config._check_against_graph)"),
    "sequence_batching.control_input.control": honoured("sequence_config._bool_control, _corrid_control"),
    "sequence_batching.control_input.control.kind": honoured("START, END, READY and CORRID "
                                                             "(sequence_config.SequenceSettings.controls)"),
    "sequence_batching.control_input.control.int32_false_true": honoured("sequence_config.BoolControl"),
    "sequence_batching.control_input.control.fp32_false_true": honoured("sequence_config.BoolControl"),
    "sequence_batching.control_input.control.bool_false_true": honoured("sequence_config.BoolControl"),
    "sequence_batching.control_input.control.data_type": honoured("CORRID's type: UINT64, INT64, UINT32, INT32 or "
                                                                  "STRING (sequence_config.CorridControl)"),
    "sequence_batching.state": honoured("implicit state kept per sequence between steps (sequence_config.StateSpec, "
                                        "sequence.SequenceBatcher)"),
    "sequence_batching.state.input_name": honoured("the graph input the state is fed to"),
    "sequence_batching.state.output_name": honoured("the graph output that becomes the next step's state"),
    "sequence_batching.state.data_type": honoured("checked against the graph (sequence_config._check_against_graph)"),
    "sequence_batching.state.dims": honoured("the state's shape; variable dims start at 1 (sequence_config._state)"),
    "sequence_batching.state.initial_state": honoured("the state at START; without it zeros "
                                                      "(sequence_config._initial_value)"),
    "sequence_batching.state.initial_state.data_type": honoured("must equal the state's "
                                                                "(sequence_config._initial_value)"),
    "sequence_batching.state.initial_state.dims": honoured("sequence_config._initial_value"),
    "sequence_batching.state.initial_state.zero_data": honoured("sequence_config._initial_value"),
    "sequence_batching.state.initial_state.data_file": honoured("raw bytes from <model>/initial_state/ "
                                                                "(sequence_config._initial_value)"),
    "sequence_batching.state.initial_state.name": honoured("required, as in Triton (sequence_config._initial_value)"),
    "sequence_batching.state.use_same_buffer_for_input_output": honoured(
        "Kiln keeps the array the model wrote as the next input, without copies, either way"),
    "sequence_batching.state.use_growable_memory": refused(
        f"{_NOT_YET} growable state memory (a GPU memory feature; Kiln keeps states as host arrays). Remove "
        "use_growable_memory"),
    "sequence_batching.iterative_sequence": refused(
        f"{_NOT_YET} iterative sequences (a decoupled model re-running one request). Remove iterative_sequence"),
    "ensemble_scheduling": partly('honoured for platform "ensemble" (server/core/ensemble.py); refused with any '
                                  "other platform", lambda _, config: config.platform == "ensemble",
                                  'ensemble_scheduling is only for platform "ensemble". Remove it, or set platform: '
                                  '"ensemble" for an ensemble (Triton refuses it too, and so does --lenient-config)',
                                  whole=True, lenient=False),
    "instance_group": honoured("one execution context per instance; groups of different kinds are refused "
                               "(model_config.complete_config, model.ModelVersion)"),
    "instance_group.name": honoured("a label, served at /config (as in Triton)"),
    "instance_group.kind": partly("KIND_AUTO / KIND_CPU / KIND_GPU pick the engine backend (model._backend_for); "
                                  "KIND_MODEL refused", lambda value, _: value != InstanceGroup.KIND_MODEL,
                                  f"{_NOT_YET} KIND_MODEL (models that place themselves). Use KIND_GPU, KIND_CPU or "
                                  "KIND_AUTO"),
    "instance_group.count": honoured("execution contexts serving requests concurrently (model.ModelVersion); on "
                                     "the GPU two worker lanes each, one gathering while the other's run is on "
                                     "the device (kiln_workers counts lanes), except under the sequence batcher; "
                                     "generative models: generation loops (generation_replicas)"),
    "instance_group.rate_limiter": container(),
    "instance_group.rate_limiter.resources": refused(
        f"{_NOT_YET} a rate limiter (Triton's --rate-limit=execution_count). Remove rate_limiter (Triton's default, "
        "--rate-limit=off, ignores it too)", whole=True),
    "instance_group.rate_limiter.priority": refused(
        f"{_NOT_YET} a rate limiter (Triton's --rate-limit=execution_count). Remove rate_limiter (Triton's default, "
        "--rate-limit=off, ignores it too)"),
    "instance_group.gpus": honoured("count instances on each listed GPU; left out, every visible GPU (KIND_GPU, and "
                                    "KIND_AUTO on a GPU); the completed config lists them. ONNX models: each GPU's "
                                    "instances in an executor process of its own (placement.place_instances). "
                                    "Generative models: count generation loops per GPU, each in a process that sees "
                                    "its GPU as device 0 (generative_config.place_replicas). Python models: "
                                    "model_instance_device_id set (python_model._instances). Refused at load: an id "
                                    "past the visible devices, GPUs of different compute capabilities, gpus on the "
                                    "cpu backend, and GPUs other than 0 for ONNX models that run in the server "
                                    "process (max_batch_size 0, sequence models, --gpu-executor thread), with the "
                                    "reason"),
    "instance_group.secondary_devices": refused(f"{_NOT_YET} secondary devices (NVDLA). Remove secondary_devices",
                                                whole=True),
    "instance_group.profile": refused("Kiln picks the optimization profile for each request itself "
                                      "(execution.select_profile); profiles come from kiln_profile_batch_sizes. "
                                      "Remove profile"),
    "instance_group.passive": refused(f"{_NOT_YET} passive instances: every instance takes requests. Remove "
                                      "passive"),
    "instance_group.host_policy": refused(f"{_NOT_YET} host policies (NUMA placement). Remove host_policy"),
    "default_model_filename": honoured("the file each version loads (model.load_model_version, "
                                       "python_model.load_python_version); default model.onnx, model.py for a "
                                       "Python model"),
    "cc_model_filenames": partly("honoured for ONNX models: a version on a GPU loads the file named for that GPU's "
                                 "compute capability (\"9.0\"), else default_model_filename, as Triton chooses "
                                 "(model.model_filename); refused for Python and generative models",
                                 lambda _, config: config.backend not in ("python", "kiln_llm"),
                                 "Python and generative models load one file (model.py, the decoder's ONNX file). "
                                 "Remove cc_model_filenames"),
    "metric_tags": refused(f"{_NOT_YET} metric tags: /metrics labels series by model and version only. Remove "
                           "metric_tags"),
    "parameters": honoured(f"per key: {', '.join(KNOWN_PARAMETERS)} (server/core/model.py, warmup.py, "
                           "python_model.py); other keys are kept and logged as not read (Triton hands them to its "
                           "backend; a Python model reads them in args['model_config']), an unknown kiln_* key with "
                           "a warning"),
    "parameters.string_value": honoured("the value of a known key, checked when the model loads"),
    "model_warmup": honoured("samples run on every instance before READY (warmup.run_model_warmup; a Python model's "
                             "as requests to its stubs: python_model.PythonVersion.warm_up)"),
    "model_warmup.name": honoured("names the sample in logs and errors (warmup.run_model_warmup)"),
    "model_warmup.batch_size": honoured("warmup.sample_inputs"),
    "model_warmup.inputs": honoured("warmup.sample_inputs"),
    "model_warmup.inputs.data_type": honoured("warmup.sample_inputs"),
    "model_warmup.inputs.dims": honoured("warmup._item"),
    "model_warmup.inputs.zero_data": honoured("warmup._item"),
    "model_warmup.inputs.random_data": honoured("warmup._item"),
    "model_warmup.inputs.input_data_file": honoured("raw bytes from <model>/warmup/ (warmup._item)"),
    "model_warmup.count": honoured("runs per instance, 0 = once (warmup.run_model_warmup)"),
    "model_operations": container(),
    "model_operations.op_library_filename": refused("Kiln loads no operation libraries; custom ops are Kiln plugins "
                                                    "(examples/plugins). Remove model_operations"),
    "model_transaction_policy": container(),
    "model_transaction_policy.decoupled": partly("decoupled: true honoured for Python models (backend: "
                                                 "\"python\"): zero, one or many responses per request through its "
                                                 "response sender, over gRPC ModelStreamInfer and HTTP generate / "
                                                 "generate_stream (server/core/decoupled.py), and for generative "
                                                 "models (backend: \"kiln_llm\", where it is implied); refused for "
                                                 "other models",
                                                 lambda _, config: config.backend in ("python", "kiln_llm"),
                                                 "Only a Python model (backend: \"python\") or a generative model "
                                                 "(backend: \"kiln_llm\") can send zero or many responses per "
                                                 "request; an ONNX model answers each request once. "
                                                 "Remove decoupled or set it to false"),
    "model_repository_agents": container(),
    "model_repository_agents.agents": partly("Triton's checksum agent: each MD5:<file> parameter's file must have "
                                             "that digest, else the load fails (repository_agents.run_agents); "
                                             "other agents refused",
                                             lambda _, config: repository_agents.supported(config),
                                             f"{_NOT_YET} repository agents other than checksum (e.g. decryption). "
                                             "Remove model_repository_agents, or keep only the checksum agent",
                                             whole=True),
    "response_cache": container(),
    "response_cache.enable": partly("enable: true honoured: with the server's --cache-config local,size=BYTES, "
                                    "repeated requests are answered from the response cache without running the "
                                    "model (server/core/response_cache.py); without that flag the model loads and "
                                    "runs uncached, as in Triton (a warning says so). Refused with sequence_batching "
                                    "or decoupled", _cacheable,
                                    "Response Cache does not currently support models with the sequence batching "
                                    "scheduler or a 'decoupled' transaction policy (Triton refuses them too, and so "
                                    "does --lenient-config). Remove response_cache or set enable: false",
                                    lenient=False),
    "model_metrics": container(),
    "model_metrics.metric_control": partly("per-model histogram buckets, as in Triton 2.5x: each control's "
                                           "histogram_options.buckets replace --metrics-config's for that model's "
                                           "versions (server/core/latency.py model_buckets; a later control for the "
                                           "same family wins); they take effect with --metrics-config "
                                           "histogram_latencies=true, without it nothing is exported",
                                           lambda value, _: all(c.metric_identifier.family for c in value),
                                           "A metric_control without metric_identifier { family: ... } customises "
                                           f"nothing. Use family: \"{_HISTOGRAMS}\" or remove it"),
    "model_metrics.metric_control.metric_identifier": container(),
    "model_metrics.metric_control.metric_identifier.family": partly(
        f"the histogram families Kiln exports ({_HISTOGRAMS}) honoured; others refused",
        lambda value, _: value in HISTOGRAM_FAMILIES,
        f"model_metrics applies only to the histogram families Kiln exports: {_HISTOGRAMS} (Triton customises only "
        "its histograms and ignores any other family). Remove this metric_control or name one of those families"),
    "model_metrics.metric_control.histogram_options": honoured(
        "its buckets replace the family's for this model; present without buckets (or a control without "
        "histogram_options) leaves only the +Inf bucket, as in Triton"),
    "model_metrics.metric_control.histogram_options.buckets": partly(
        "finite, strictly increasing upper bounds in milliseconds honoured (+Inf is always added)",
        lambda value, _: valid_buckets(value),
        "Histogram buckets must be finite and strictly increasing (Triton's prometheus-cpp refuses unsorted "
        "ones). Remove the bad bounds or sort them"),
}

LENIENT_FLAG = "--lenient-config"


@dataclass(frozen=True)
class Refusal:
    """One set field the table refuses, as found in one config."""

    path: str
    shown: str  # the value as the config spells it ("" for a message)
    rule: Rule

    def describe(self) -> str:
        value = f" ({self.shown})" if self.shown else ""
        return f"config field '{self.path}'{value} is refused: {self.rule.refusal or self.rule.note}"


def refusals(config: ModelConfig) -> list[Refusal]:
    """The set fields of `config` that the table refuses, in proto order. KeyError for a field missing from the
    table (the descriptor test keeps that from happening)."""
    return list(_walk(config, "", config))


def _walk(message: Message, prefix: str, config: ModelConfig) -> Iterator[Refusal]:
    for field, value in message.ListFields():
        path = prefix + field.name
        rule = FIELDS[path]
        if not rule.honours(value, config):
            yield Refusal(path, _shown(field, value), rule)
        if rule.whole or field.message_type is None:
            continue
        for item in _messages_in(field, value):
            yield from _walk(item, path + ".", config)


def _messages_in(field: FieldDescriptor, value: Any) -> list[Message]:
    """The messages inside a set message field: itself, a list's items, or a map's message values."""
    if field.message_type.GetOptions().map_entry:
        holds_messages = field.message_type.fields_by_name["value"].message_type is not None
        return list(value.values()) if holds_messages else []
    return list(value) if field.is_repeated else [value]


def _shown(field: FieldDescriptor, value: Any) -> str:
    """A scalar value as the config spells it: enum names, lists in brackets; messages and maps show nothing."""
    if field.message_type is not None:
        return ""
    name = (lambda v: field.enum_type.values_by_number[v].name) if field.enum_type is not None else repr
    if field.is_repeated:
        return "[" + ", ".join(name(v) for v in value) + "]"
    return name(value)


class ConfigFieldCheck:
    """Run at every model load: refused fields fail the load (Triton-style: the model is UNAVAILABLE with the
    reason, the server serves on), or with `lenient` are logged once per model and field and ignored. Parameters
    are looked at per key (`KNOWN_PARAMETERS`)."""

    def __init__(self, lenient: bool = False) -> None:
        self.lenient = lenient
        self._logged: set[tuple[str, str]] = set()  # (model, field or parameter): said once

    def check(self, config: ModelConfig, model: str) -> None:
        """INVALID_ARGUMENT naming the model and every refused field (lenient: those Triton refuses as well)."""
        found = refusals(config)
        self._look_at_parameters(config, model)
        fatal = [r for r in found if not (self.lenient and r.rule.lenient)]
        if fatal:
            hint = (f" (or start the server with {LENIENT_FLAG} to load it with such fields ignored)"
                    if any(r.rule.lenient for r in fatal) else "")
            raise invalid(f"model '{model}': " + "; ".join(r.describe() for r in fatal) + hint)
        for refusal in found:
            self._once(model, refusal.path, logging.WARNING, "model '%s': %s; loading it with the field ignored "
                       "(%s)", model, refusal.describe(), LENIENT_FLAG)

    def _look_at_parameters(self, config: ModelConfig, model: str) -> None:
        """Unknown keys stay in the config, as Triton hands every parameter to its backend; said once, with a
        warning for an unknown kiln_* key (most likely a misspelt one)."""
        for key in sorted(config.parameters):  # a protobuf map has no order of its own
            if key in KNOWN_PARAMETERS:
                continue
            if key.startswith("kiln_"):
                self._once(model, key, logging.WARNING, "model '%s': parameter '%s' is not a Kiln parameter and is "
                           "not read (known: %s)", model, key, ", ".join(KNOWN_PARAMETERS))
            else:
                self._once(model, key, logging.INFO, "model '%s': parameter '%s' is not read by Kiln (kept in the "
                           "config, as Triton hands parameters to its backend)", model, key)

    def _once(self, model: str, what: str, level: int, message: str, *args: Any) -> None:
        if (model, what) not in self._logged:
            self._logged.add((model, what))
            log.log(level, message, *args)


def doc_rows() -> list[tuple[str, str, str]]:
    """(field, status, note) per entry, containers left out: what docs/server.md shows."""
    rows = []
    for path, rule in FIELDS.items():
        if rule.container:
            continue
        field = f"`{path}`" + (" (and every field inside)" if rule.whole else "")
        note = f"{rule.note}. {rule.refusal}" if rule.status is Status.PARTLY else rule.note
        rows.append((field, rule.status.value, note))
    return rows


def markdown_table() -> str:
    """The docs/server.md table, generated from `FIELDS`."""
    lines = ["| field | status | note |", "|---|---|---|"]
    lines += [f"| {field} | {status} | {note.replace('|', '/')} |" for field, status, note in doc_rows()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
