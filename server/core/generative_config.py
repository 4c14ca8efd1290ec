"""The config of a generative model (`backend: "kiln_llm"`): completed and checked before anything is built.

Why its own completion: the model's ONNX inputs (input_ids, attention_mask, the KV cache) are the generation loop's,
not the client's. Clients send text, as to Triton's vLLM backend, so the served inputs and outputs are the vLLM
backend's, filled in here (a config may spell them out; they must then be exactly these), plus `messages` for chat
requests (`return_logprobs` asks for the vLLM backend's additional output `logprobs`). The model is decoupled (one
response per token delta when streaming): implied and completed.
`instance_group` places generation loops (replicas) as Triton places instances: `count` loops on each listed GPU (a
KIND_GPU group without `gpus`: every visible GPU, completed into the config at load: `place_replicas`), or `count`
on the CPU; several groups' loops together (groups of one kind). Each loop has its own engine and KV cache.
`max_batch_size` is the sequences per decode step of one loop (0 takes the server's --default-max-batch-size); a request
carries one prompt. Parameters (string values): `max_context` (prompt + generated tokens of one sequence, default 2048),
`kv_block_tokens` (tokens per KV-cache block, default 16), `kv_cache_blocks` (blocks in the pool; default: enough for
every sequence of a full batch at max_context), `max_prefill_tokens` (prompt tokens, pads included, one loop iteration
feeds; longer prompts go in chunks between decode steps; default 512), `enable_prefix_caching` (true/false, default true
as vLLM's: prompts share the KV blocks of a prefix computed before), `cuda_graph_warm_up` (true/false, default true: a
KIND_GPU model captures the CUDA graph of every decode and prefill shape bucket before it reports ready, vLLM's graph
capture at start; false loads faster and captures each bucket at its first step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from server.protos import model_config_pb2

from .errors import invalid
from .model import EXECUTION_TIMEOUT_MS, PAD_BATCH, PRECISION, PROFILE_BATCH_SIZES
from .model_config import DEFAULT_MODEL_FILENAME, ModelConfig, bool_parameter
from .placement import Devices, place_instances, visible_devices
from .warmup import WARMUP_BUCKETS

GENERATIVE_BACKEND = "kiln_llm"
MAX_CONTEXT = "max_context"
KV_CACHE_BLOCKS = "kv_cache_blocks"
KV_BLOCK_TOKENS = "kv_block_tokens"
MAX_PREFILL_TOKENS = "max_prefill_tokens"
ENABLE_PREFIX_CACHING = "enable_prefix_caching"
CUDA_GRAPH_WARM_UP = "cuda_graph_warm_up"
DEFAULT_MAX_CONTEXT = 2048
DEFAULT_MAX_PREFILL_TOKENS = 512
DEFAULT_BLOCK_TOKENS = 16

_T = model_config_pb2
#: the served inputs: (name, data type, dims, optional); text_input or messages carries the prompt
INPUTS = (("text_input", _T.TYPE_STRING, (1,), True), ("messages", _T.TYPE_STRING, (1,), True),
          ("stream", _T.TYPE_BOOL, (1,), True), ("sampling_parameters", _T.TYPE_STRING, (1,), True),
          ("exclude_input_in_output", _T.TYPE_BOOL, (1,), True), ("return_logprobs", _T.TYPE_BOOL, (1,), True))
OUTPUTS = (("text_output", _T.TYPE_STRING, (-1,)), ("finish_reason", _T.TYPE_STRING, (-1,)),
           ("num_input_tokens", _T.TYPE_UINT32, (1,)), ("num_output_tokens", _T.TYPE_UINT32, (1,)),
           ("logprobs", _T.TYPE_STRING, (-1,)))
#: Kiln parameters about the plan of an ONNX model served request by request: a generative model has none of them
_REQUEST_MODEL_PARAMETERS = (PROFILE_BATCH_SIZES, PAD_BATCH, WARMUP_BUCKETS, EXECUTION_TIMEOUT_MS)
#: what the generation loop does itself, so the config must not ask for it: field -> why
_NOT_FOR_GENERATIVE = {
    "dynamic_batching": "the generation loop batches sequences itself at every decode step (continuous batching); "
                        "set max_batch_size",
    "sequence_batching": "a generative model keeps each sequence's state in its KV cache",
    "ensemble_scheduling": "a generative model is not an ensemble",
    "model_warmup": "warm-up samples are not supported for generative models yet",
}


@dataclass(frozen=True)
class GenerationSettings:
    """What the config's parameters set for the generation loop."""

    max_batch_size: int
    max_context: int
    block_tokens: int
    num_blocks: int | None  # None: the Generator's default
    max_prefill_tokens: int  # the Generator's prefill budget per iteration (chunked prefill)
    prefix_caching: bool  # the Generator's enable_prefix_caching
    fp16: bool  # kiln_precision fp16
    tf32: bool  # TF32 tensor cores for fp32 math: off only with kiln_precision fp32 (strict), as for ONNX models
    warm_up: bool = True  # the Generator's warm_up: every shape bucket's CUDA graph captured before ready


def is_generative(config: ModelConfig) -> bool:
    return config.backend == GENERATIVE_BACKEND


def complete_generative_config(config: ModelConfig, name: str, default_max_batch_size: int) -> ModelConfig:
    """A checked, completed copy of a generative model's config; INVALID_ARGUMENT naming the model and the field."""
    config = ModelConfig.FromString(config.SerializeToString())
    if config.name and config.name != name:
        raise invalid(f"model '{name}': config names the model '{config.name}'; the directory name must match")
    config.name = name
    if config.platform:
        raise invalid(f"model '{name}': a {GENERATIVE_BACKEND} model has no platform (got '{config.platform}')")
    present = {descriptor.name for descriptor, _ in config.ListFields()}
    for field, why in _NOT_FOR_GENERATIVE.items():
        if field in present:
            raise invalid(f"model '{name}': {field} is not for a {GENERATIVE_BACKEND} model: {why}. Remove it")
    if config.response_cache.enable:
        raise invalid(f"model '{name}': a {GENERATIVE_BACKEND} model's responses are not cached (it is decoupled). "
                      "Remove response_cache")
    for key in _REQUEST_MODEL_PARAMETERS:
        if key in config.parameters:
            raise invalid(f"model '{name}': parameter {key} is not read for a {GENERATIVE_BACKEND} model. Remove it")
    if config.max_batch_size < 0:
        raise invalid(f"model '{name}': max_batch_size must be >= 0, got {config.max_batch_size}")
    config.max_batch_size = config.max_batch_size or default_max_batch_size
    _complete_inputs(config)
    _complete_outputs(config)
    config.model_transaction_policy.decoupled = True
    config.default_model_filename = config.default_model_filename or DEFAULT_MODEL_FILENAME
    if not config.HasField("version_policy"):
        config.version_policy.latest.num_versions = 1
    if not config.instance_group:
        config.instance_group.add(kind=_T.ModelInstanceGroup.KIND_AUTO)
    if len({group.kind for group in config.instance_group}) > 1:
        raise invalid(f"model '{name}': instance groups of different kinds are not supported (a model runs on one "
                      "backend); give every group the same kind")
    for index, group in enumerate(config.instance_group):
        if group.count < 0:
            raise invalid(f"model '{name}': instance group '{group.name or index}' count must be >= 0 (0 means 1), "
                          f"got {group.count}")
        group.name, group.count = group.name or f"{name}_{index}", group.count or 1
    generation_settings(config)  # the parameters checked now, with the config's other errors
    return config


def place_replicas(config: ModelConfig, backend: str, devices: Callable[[], Devices] = visible_devices
                   ) -> list[int | None]:
    """Where each generation loop of a completed config runs, as Triton places instances: `count` loops on each of a
    group's `gpus` (a KIND_GPU group without gpus: every visible GPU, listed in the config in place), or on the CPU
    (None) for the cpu backend. Replicas of different GPUs alternate in the list, so requests that tie on the load
    spread over the GPUs. INVALID_ARGUMENT as `placement.place_instances` says (an id past the visible GPUs, GPUs
    of different architectures, gpus on the cpu backend)."""
    placements = place_instances(config, backend, "", devices)
    rounds = max(p.count for p in placements)
    return [p.device for r in range(rounds) for p in placements if r < p.count]


def _complete_inputs(config: ModelConfig) -> None:
    declared = {tensor.name: tensor for tensor in config.input}
    _check_declared(config, declared, {n for n, *_ in INPUTS}, "input")
    del config.input[:]
    for name, data_type, dims, optional in INPUTS:
        _check_tensor(config, declared.get(name), "input", name, data_type, dims)
        config.input.add(name=name, data_type=data_type, dims=dims, optional=optional)


def _complete_outputs(config: ModelConfig) -> None:
    declared = {tensor.name: tensor for tensor in config.output}
    _check_declared(config, declared, {n for n, *_ in OUTPUTS}, "output")
    del config.output[:]
    for name, data_type, dims in OUTPUTS:
        _check_tensor(config, declared.get(name), "output", name, data_type, dims)
        config.output.add(name=name, data_type=data_type, dims=dims)


def _check_declared(config: ModelConfig, declared: dict, known: set[str], role: str) -> None:
    unknown = sorted(set(declared) - known)
    if unknown:
        raise invalid(f"model '{config.name}': {role}s {unknown} are not served by a {GENERATIVE_BACKEND} model "
                      f"(its {role}s: {sorted(known)}; leave them out and they are filled in)")


def _check_tensor(config: ModelConfig, tensor, role: str, name: str, data_type: int, dims: tuple[int, ...]) -> None:
    """A declared input or output must be the one the model serves (data type and dims)."""
    if tensor is None:
        return
    type_name = _T.DataType.Name(data_type)
    if (tensor.data_type not in (_T.TYPE_INVALID, data_type) or (list(tensor.dims) and tuple(tensor.dims) != dims)
            or tensor.HasField("reshape")):
        raise invalid(f"model '{config.name}': {role} '{name}' of a {GENERATIVE_BACKEND} model is {type_name} "
                      f"dims {list(dims)}, the config says {_T.DataType.Name(tensor.data_type)} dims "
                      f"{list(tensor.dims)} (leave it out and it is filled in)")


def generation_settings(config: ModelConfig) -> GenerationSettings:
    """The generation loop's settings from a completed config's parameters."""
    max_context = _positive(config, MAX_CONTEXT, config.parameters.get(MAX_CONTEXT), DEFAULT_MAX_CONTEXT)
    block_tokens = _positive(config, KV_BLOCK_TOKENS, config.parameters.get(KV_BLOCK_TOKENS), DEFAULT_BLOCK_TOKENS)
    blocks = _positive(config, KV_CACHE_BLOCKS, config.parameters.get(KV_CACHE_BLOCKS), 0) or None
    if blocks is not None and blocks * block_tokens < max_context:
        raise invalid(f"model '{config.name}': {KV_CACHE_BLOCKS} {blocks} x {KV_BLOCK_TOKENS} {block_tokens} = "
                      f"{blocks * block_tokens} tokens, less than one sequence of {MAX_CONTEXT} {max_context}: raise "
                      f"{KV_CACHE_BLOCKS} to at least {-(-max_context // block_tokens)} or lower {MAX_CONTEXT}")
    prefill = _positive(config, MAX_PREFILL_TOKENS, config.parameters.get(MAX_PREFILL_TOKENS),
                        DEFAULT_MAX_PREFILL_TOKENS)
    precision = config.parameters.get(PRECISION)
    text = precision.string_value.strip().lower() if precision is not None else ""
    if text not in ("", "fp32", "tf32", "fp16"):
        raise invalid(f"model '{config.name}': parameter {PRECISION} of a {GENERATIVE_BACKEND} model must be fp32, "
                      f"tf32 or fp16, got '{text}'")
    prefix_caching = bool_parameter(config, ENABLE_PREFIX_CACHING, default=True)
    return GenerationSettings(config.max_batch_size, max_context, block_tokens, blocks, prefill, prefix_caching,
                              text == "fp16", text != "fp32", bool_parameter(config, CUDA_GRAPH_WARM_UP, default=True))


def _positive(config: ModelConfig, key: str, parameter, default: int) -> int:
    text = parameter.string_value.strip() if parameter is not None else ""
    if not text:
        return default
    if not text.isdigit() or int(text) < 1:
        raise invalid(f"model '{config.name}': parameter {key} must be a whole number >= 1, got '{text}'")
    return int(text)
