"""Triton model configuration: parsed from config.pbtxt / JSON, completed from the ONNX graph, shown as a dict.

Configs are `inference.ModelConfig` messages (server/protos/model_config_pb2.py), so field names, enums and
defaults are exactly Triton's. Completion follows Triton's `--strict-model-config=false`: whatever the
config leaves out (inputs, outputs, dims, max_batch_size, version policy, instance group) comes from the model,
as a child process read it (server/core/model_description.py: the server never parses a model file).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from google.protobuf import json_format, text_format

from server.protos import model_config_pb2

from .errors import invalid
from .types import CONFIG_TYPE_OF_DATATYPE, DATATYPE_OF_CONFIG_TYPE, datatype_of_numpy

if TYPE_CHECKING:
    from .model_description import ModelDescription, TensorDescription

ModelConfig = model_config_pb2.ModelConfig

# Platforms/backends whose models are ONNX files Kiln can build ("" = not stated).
ACCEPTED_PLATFORMS = {"", "kiln_onnx", "onnxruntime_onnx", "onnx"}
ACCEPTED_BACKENDS = {"", "kiln", "onnxruntime", "onnx"}
ENSEMBLE_PLATFORM = "ensemble"  # Triton's: runs other models (server/core/ensemble.py), has no model file
PYTHON_BACKEND = "python"  # Triton's Python backend: model.py in stub processes (server/core/python_model.py)
DEFAULT_PLATFORM = "kiln_onnx"
DEFAULT_BACKEND = "kiln"
DEFAULT_MODEL_FILENAME = "model.onnx"
SEQUENCE_IDLE_DEFAULT_US = 1_000_000  # Triton's max_sequence_idle_microseconds when unset (1 s)


def parse_config_text(text: str, model_name: str) -> ModelConfig:
    """A config.pbtxt in protobuf text format; INVALID_ARGUMENT naming the model on syntax errors."""
    config = ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as e:
        raise invalid(f"model '{model_name}': config.pbtxt: {e}") from None
    return config


def parse_config_json(text: str, model_name: str) -> ModelConfig:
    """A config given as JSON (the `config` parameter of a load request)."""
    config = ModelConfig()
    try:
        json_format.Parse(text, config)
    except json_format.ParseError as e:
        raise invalid(f"model '{model_name}': invalid config JSON: {e}") from None
    return config


def config_to_dict(config: ModelConfig) -> dict[str, Any]:
    """The JSON form Triton serves at /config: proto field names, every field present, int64 as numbers."""
    return json_format.MessageToDict(config, always_print_fields_with_no_presence=True,
                                     preserving_proto_field_name=True, unquote_int64_if_possible=True)


def datatype_of(tensor: model_config_pb2.ModelInput | model_config_pb2.ModelOutput) -> str:
    """KServe datatype ("FP32") of a config tensor's data_type (TYPE_FP32)."""
    return DATATYPE_OF_CONFIG_TYPE.get(model_config_pb2.DataType.Name(tensor.data_type), "INVALID")


def _onnx_config_type(value: TensorDescription, model_name: str) -> int:
    if value.elem_type is None:
        raise invalid(f"model '{model_name}': I/O '{value.name}' is not a tensor; the server serves tensors only")
    from engine_core.types import onnx_to_np

    datatype = datatype_of_numpy(onnx_to_np(value.elem_type))
    return model_config_pb2.DataType.Value(CONFIG_TYPE_OF_DATATYPE[datatype])


def is_ensemble(config: ModelConfig) -> bool:
    """Whether `config` is an ensemble's; INVALID_ARGUMENT when its platform, backend and scheduling disagree."""
    _check_platform(config)
    return config.platform == ENSEMBLE_PLATFORM


def _check_platform(config: ModelConfig) -> None:
    """Kiln builds ONNX models, runs ensembles (platform "ensemble", no backend: Triton's rule) and Python models
    (backend "python", no platform)."""
    if config.platform == ENSEMBLE_PLATFORM:
        if config.backend:
            raise invalid(f"model '{config.name}': an ensemble has no backend (platform 'ensemble', backend "
                          f"'{config.backend}')")
        return
    if config.HasField("ensemble_scheduling"):  # Triton's text (model_config_utils.cc)
        raise invalid(f"ensemble scheduling cannot be set for model '{config.name}' whose platform is not "
                      f"{ENSEMBLE_PLATFORM}")
    if config.backend == PYTHON_BACKEND and not config.platform:
        return
    if config.platform not in ACCEPTED_PLATFORMS or config.backend not in ACCEPTED_BACKENDS:
        raise invalid(f"model '{config.name}': platform '{config.platform}' / backend '{config.backend}' is not "
                      f"served by Kiln (ONNX models: platform {sorted(ACCEPTED_PLATFORMS - {''})}, "
                      f"backend {sorted(ACCEPTED_BACKENDS - {''})}; or platform '{ENSEMBLE_PLATFORM}'; or backend "
                      f"'{PYTHON_BACKEND}')")


def _supports_batching(model: ModelDescription) -> bool:
    """Every input and output has a first dim that is not fixed: the model takes a batch dimension."""
    values = [*model.inputs, *model.outputs]
    return bool(values) and all(v.shape[:1] in ([-1], []) and len(v.shape) >= 1 for v in values)


def complete_config(config: ModelConfig, model: ModelDescription, name: str,
                    default_max_batch_size: int) -> ModelConfig:
    """A completed copy of `config` for the ONNX model `model` describes; INVALID_ARGUMENT when they disagree.

    Output dims that ONNX leaves unknown stay -1 here; `complete_outputs_from_engine` fills them after the build.
    """
    config = ModelConfig.FromString(config.SerializeToString())
    if config.name and config.name != name:
        raise invalid(f"model '{name}': config names the model '{config.name}'; the directory name must match")
    config.name = name
    _check_platform(config)
    if not config.platform and not config.backend:
        config.platform, config.backend = DEFAULT_PLATFORM, DEFAULT_BACKEND
    if not config.default_model_filename:
        config.default_model_filename = DEFAULT_MODEL_FILENAME
    declares_io = bool(config.input) or bool(config.output)
    if config.max_batch_size < 0:
        raise invalid(f"model '{name}': max_batch_size must be >= 0, got {config.max_batch_size}")
    if not declares_io and config.max_batch_size == 0 and _supports_batching(model):
        config.max_batch_size = default_max_batch_size
    server_inputs, _ = sequence_io_names(config)  # the sequence batcher fills these; requests do not carry them
    for tensor in config.input:
        if tensor.name in server_inputs:
            raise invalid(f"model '{name}': '{tensor.name}' is a sequence batching control or state input, which the "
                          "server fills; remove it from the config's input list")
    _complete_tensors(config.input, [v for v in model.inputs if v.name not in server_inputs], config,
                      "input", add_missing=True)
    _complete_tensors(config.output, list(model.outputs), config, "output", add_missing=False)
    _complete_sequence_batching(config)
    if not config.HasField("version_policy"):
        config.version_policy.latest.num_versions = 1
    if not config.instance_group:
        group = config.instance_group.add()
        group.kind, group.count = model_config_pb2.ModelInstanceGroup.KIND_AUTO, 1
    kinds = {group.kind for group in config.instance_group}
    if len(kinds) > 1:
        raise invalid(f"model '{name}': instance groups of different kinds are not supported")
    for index, group in enumerate(config.instance_group):
        group.name = group.name or f"{name}_{index}"  # Triton's name for an unnamed group: <model>_<group index>
        group.count = group.count or 1
    return config


def sequence_io_names(config: ModelConfig) -> tuple[set[str], set[str]]:
    """The graph inputs the sequence batcher fills (control and state inputs) and the state outputs it keeps:
    neither is a client's input or output (server/core/sequence_config.py)."""
    if not config.HasField("sequence_batching"):
        return set(), set()
    batching = config.sequence_batching
    inputs = {c.name for c in batching.control_input} | {s.input_name for s in batching.state}
    return inputs, {s.output_name for s in batching.state}


def _complete_sequence_batching(config: ModelConfig) -> None:
    """Triton's defaults, so /config shows what runs: max_sequence_idle_microseconds 1 s, and the oldest
    strategy's preferred_batch_size [max_batch_size] (model_config_utils.cc NormalizeModelConfig)."""
    if not config.HasField("sequence_batching"):
        return
    batching = config.sequence_batching
    if not batching.max_sequence_idle_microseconds:
        batching.max_sequence_idle_microseconds = SEQUENCE_IDLE_DEFAULT_US
    if batching.HasField("oldest") and not batching.oldest.preferred_batch_size and config.max_batch_size > 0:
        batching.oldest.preferred_batch_size.append(config.max_batch_size)


def _complete_tensors(declared, values: list[TensorDescription], config: ModelConfig, role: str,
                      add_missing: bool) -> None:
    """Check the declared inputs/outputs against the graph and (for inputs) add the ones left out.

    Outputs left out are added after the build from the engine, which knows shapes ONNX may not state.
    """
    by_name = {v.name: v for v in values}
    batched = config.max_batch_size > 0
    for tensor in declared:
        value = by_name.get(tensor.name)
        if value is None:
            raise invalid(f"model '{config.name}': {role} '{tensor.name}' is not in the ONNX graph "
                          f"({role}s: {sorted(by_name)})")
        expected = _onnx_config_type(value, config.name)
        if tensor.data_type == model_config_pb2.TYPE_INVALID:
            tensor.data_type = expected
        elif tensor.data_type != expected:
            raise invalid(f"model '{config.name}': {role} '{tensor.name}' is "
                          f"{model_config_pb2.DataType.Name(expected)} in the model, the config says "
                          f"{model_config_pb2.DataType.Name(tensor.data_type)}")
        dims = value.shape
        if batched and dims and dims[0] not in (-1,) and dims[0] < config.max_batch_size:
            raise invalid(f"model '{config.name}': {role} '{tensor.name}' has a fixed first dim {dims[0]}, "
                          f"which cannot hold max_batch_size {config.max_batch_size}")
        if not tensor.dims and not tensor.HasField("reshape"):
            tensor.dims.extend(dims[1:] if batched else dims)
    names = {t.name for t in declared}
    for value in values if add_missing else []:
        if value.name in names:
            continue
        tensor = declared.add()
        tensor.name = value.name
        tensor.data_type = _onnx_config_type(value, config.name)
        dims = value.shape
        tensor.dims.extend(dims[1:] if batched else dims)


def complete_outputs_from_engine(config: ModelConfig, outputs: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """Add the outputs the config left out, from the built engine's (datatype, shape) per output name."""
    declared = {t.name for t in config.output} | sequence_io_names(config)[1]  # state outputs are the server's
    for name, (datatype, shape) in outputs.items():
        if name in declared:
            continue
        tensor = config.output.add()
        tensor.name = name
        tensor.data_type = model_config_pb2.DataType.Value(CONFIG_TYPE_OF_DATATYPE[datatype])
        tensor.dims.extend(shape[1:] if config.max_batch_size > 0 else shape)


def bool_parameter(config: ModelConfig, key: str, default: bool) -> bool:
    """A true/false config parameter (`default` when unset); anything else is INVALID_ARGUMENT naming the model."""
    parameter = config.parameters.get(key)
    text = parameter.string_value.strip().lower() if parameter is not None else ""
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    if text == "":
        return default
    raise invalid(f"model '{config.name}': parameter {key} must be 'true' or 'false', got '{parameter.string_value}'")


def model_shape(tensor) -> list[int]:
    """The shape the model itself sees for one request item: `reshape.shape` when given, else `dims`."""
    return list(tensor.reshape.shape) if tensor.HasField("reshape") else list(tensor.dims)
