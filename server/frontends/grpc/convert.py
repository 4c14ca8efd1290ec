"""Protobuf messages <-> the core's request/response types and JSON-able dicts.

The core speaks Triton's JSON field names (as the HTTP protocol does), so most responses are a `ParseDict`
into the matching message. Tensor data goes through the core's raw codec (`server.core.tensors`) or, for
typed `contents`, through `contents`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from google.protobuf import json_format
from google.protobuf.message import Message

from server.core import tensors
from server.core.errors import invalid
from server.core.limits import check_shape
from server.core.types import InferInput, InferOutput, InferRequest, InferResponse, RequestedOutput
from server.protos import grpc_service_pb2 as pb
from server.protos import model_config_pb2

from . import contents

M = TypeVar("M", bound=Message)

FILE_PREFIX = "file:"
SHM_REGION = "shared_memory_region"


def from_dict(data: Mapping, message_type: type[M]) -> M:
    """A core result (Triton JSON names) as `message_type`; fields the message lacks are ignored."""
    return json_format.ParseDict(data, message_type(), ignore_unknown_fields=True)


def model_config(config: Mapping) -> model_config_pb2.ModelConfig:
    return from_dict(config, model_config_pb2.ModelConfig)


def oneof_value(message: Message, oneof: str = "parameter_choice"):
    """The Python value held by a `parameter_choice`-style oneof (None when unset)."""
    field = message.WhichOneof(oneof)
    return None if field is None else getattr(message, field)


def parameters_from_proto(parameters: Mapping[str, pb.InferParameter]) -> dict[str, bool | int | float | str]:
    if not parameters:  # the usual case, and far cheaper than iterating an empty protobuf map
        return {}
    return {key: oneof_value(value) for key, value in parameters.items()}


def parameters_to_proto(parameters: Mapping[str, object], target) -> None:
    """Fill a `map<string, InferParameter>`; bools before ints, since bool is an int in Python."""
    for key, value in parameters.items():
        slot = target[key]
        if isinstance(value, bool):
            slot.bool_param = value
        elif isinstance(value, int):
            if value >= 1 << 63:
                slot.uint64_param = value
            else:
                slot.int64_param = value
        elif isinstance(value, float):
            slot.double_param = value
        else:
            slot.string_param = str(value)


def load_parameters(parameters: Mapping[str, pb.ModelRepositoryParameter]) -> tuple[str | None, dict[str, bytes]]:
    """RepositoryModelLoad parameters: an optional JSON `config` (string) and `file:<path>` contents (bytes)."""
    config: str | None = None
    files: dict[str, bytes] = {}
    for key, value in parameters.items():
        kind = value.WhichOneof("parameter_choice")
        if key == "config":
            if kind != "string_param":
                raise invalid("load parameter 'config' must be a string holding the model configuration as JSON")
            config = value.string_param
        elif key.startswith(FILE_PREFIX):
            if kind != "bytes_param":
                raise invalid(f"load parameter '{key}' must carry the file's content as bytes")
            files[key] = value.bytes_param
        else:
            raise invalid(f"unknown load parameter '{key}' (expected 'config' or 'file:<path>')")
    return config, files


def unload_parameters(parameters: Mapping[str, pb.ModelRepositoryParameter]) -> dict[str, bool]:
    """RepositoryModelUnload parameters: only `unload_dependents` (bool) is defined."""
    options: dict[str, bool] = {}
    for key, value in parameters.items():
        if key != "unload_dependents" or value.WhichOneof("parameter_choice") != "bool_param":
            raise invalid(f"unknown unload parameter '{key}' (expected bool 'unload_dependents')")
        options[key] = value.bool_param
    return options


def trace_settings_from_proto(settings: Mapping[str, pb.TraceSettingRequest.SettingValue]) -> dict[str, list[str] | None]:
    """A setting with no values means "reset to default" (None), as in Triton."""
    return {key: list(value.value) or None for key, value in settings.items()}


def trace_settings_to_proto(settings: Mapping[str, object]) -> pb.TraceSettingResponse:
    response = pb.TraceSettingResponse()
    for key, value in settings.items():
        values = value if isinstance(value, list | tuple) else [value]
        response.settings[key].value.extend(str(v) for v in values)
    return response


def log_settings_to_proto(settings: Mapping[str, object]) -> pb.LogSettingsResponse:
    response = pb.LogSettingsResponse()
    for key, value in settings.items():
        slot = response.settings[key]
        if isinstance(value, bool):
            slot.bool_param = value
        elif isinstance(value, int):
            slot.uint32_param = value
        else:
            slot.string_param = str(value)
    return response


def infer_request(message: pb.ModelInferRequest) -> InferRequest:
    """A ModelInferRequest as the core's InferRequest.

    Each input's data comes from exactly one place: a shared-memory region (named in its parameters), its typed
    `contents`, or the next unused `raw_input_contents` entry (entries follow the order of the inputs that use
    them, which is how tritonclient sends them). Runs for every gRPC inference request: field reads are few and
    cheap ones first (`HasField` before looking into `contents`).
    """
    raw = message.raw_input_contents
    count = len(raw)
    used = 0
    inputs = []
    for tensor in message.inputs:
        name = tensor.name
        parameters = parameters_from_proto(tensor.parameters)
        shape = tuple(tensor.shape)
        check_shape(shape, name)
        typed = tensor.HasField("contents") and contents.has_data(tensor.contents)
        if typed and count:
            raise invalid("inputs must not use typed 'contents' when the request has raw_input_contents")
        if SHM_REGION in parameters:
            if typed:
                raise invalid(f"input '{name}' has both shared-memory and typed contents data")
            data = None
        elif not count:
            if not typed and tensors.element_count(shape):
                raise invalid(f"input '{name}' has no data (no contents, raw_input_contents or shared memory)")
            data = contents.from_contents(tensor.contents, tensor.datatype, shape)
        elif used < count:
            data = tensors.from_raw(raw[used], tensor.datatype, shape)
            used += 1
        else:
            raise invalid(f"input '{name}' has no data: {count} raw_input_contents for more inputs")
        inputs.append(InferInput(name, tensor.datatype, shape, data, parameters))
    if used != count:
        raise invalid(f"request has {count} raw_input_contents but only {used} inputs take raw data")
    outputs = [RequestedOutput(out.name, parameters_from_proto(out.parameters)) for out in message.outputs]
    return InferRequest(model_name=message.model_name, inputs=inputs, model_version=message.model_version,
                        id=message.id, outputs=outputs, parameters=parameters_from_proto(message.parameters))


def _output_tensor(output: InferOutput, target: pb.ModelInferResponse.InferOutputTensor) -> bytes:
    """Fill one InferOutputTensor and return its raw data (empty when it went to shared memory)."""
    target.name, target.datatype = output.name, output.datatype
    target.shape.extend(output.shape)
    parameters_to_proto(output.parameters, target.parameters)
    return b"" if output.data is None else tensors.to_raw(output.data, output.datatype)


def infer_response(response: InferResponse) -> pb.ModelInferResponse:
    """The core's InferResponse as a ModelInferResponse; all data as raw_output_contents, as Triton sends it.

    Every output gets one raw entry (empty for shared-memory outputs) so entries line up with `outputs`.
    """
    message = pb.ModelInferResponse(model_name=response.model_name, model_version=response.model_version,
                                    id=response.id)
    parameters_to_proto(response.parameters, message.parameters)
    message.raw_output_contents.extend(_output_tensor(out, message.outputs.add()) for out in response.outputs)
    return message
