"""`triton_python_backend_utils`: the module a Triton Python model imports (`import triton_python_backend_utils as
pb_utils`), with Triton's names, signatures and messages, for Kiln's stub (server/python_backend/stub.py).

In Triton part of this module is Python (the helpers and `ModelConfig`) and part comes from its C++ stub (`Tensor`,
`InferenceRequest`, `InferenceResponse`, `TritonError`, `TritonModelException`, `Logger`, ...). Here all of it is
Python, and tensors are numpy arrays in host memory. What needs the server (BLS `exec`/`async_exec`, logging,
`get_model_dir`, a decoupled model's response senders) goes through the stub that runs the model (`_runtime`). Not
supported yet, and said so when used: GPU tensors, request rescheduling.
"""

from __future__ import annotations

import enum
import json
import queue
import struct
import sys
import threading
from collections.abc import Awaitable, Iterable
from typing import Any, Protocol

import numpy as np

TRITON_STRING_TO_NUMPY = {
    "TYPE_BOOL": bool,
    "TYPE_UINT8": np.uint8,
    "TYPE_UINT16": np.uint16,
    "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64,
    "TYPE_INT8": np.int8,
    "TYPE_INT16": np.int16,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32,
    "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}

# TRITONSERVER_DataType numbers (Tensor.triton_dtype, triton_to_numpy_type)
_NUMPY_OF_TRITON_TYPE = {1: np.bool_, 2: np.uint8, 3: np.uint16, 4: np.uint32, 5: np.uint64, 6: np.int8, 7: np.int16,
                         8: np.int32, 9: np.int64, 10: np.float16, 11: np.float32, 12: np.float64, 13: np.object_}
_BYTES = 13

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2

_DLPACK_CPU, _DLPACK_CUDA_HOST = 1, 3  # DLDeviceType values of host memory


class _Runtime(Protocol):
    """What the stub running this model gives the module (stub.py `StubRuntime`)."""

    model_dir: str

    def exec(self, request: InferenceRequest) -> InferenceResponse: ...

    def async_exec(self, request: InferenceRequest) -> Awaitable[InferenceResponse]: ...

    def exec_decoupled(self, request: InferenceRequest) -> ResponseIterator: ...

    def control(self, op: str, **arguments: Any) -> Any: ...

    def metric(self, op: str, wait: bool, **arguments: Any) -> Any: ...

    def async_exec_decoupled(self, request: InferenceRequest) -> Awaitable[ResponseIterator]: ...

    def log(self, level: int, message: str) -> None: ...

    def send_response(self, stream: int, response: InferenceResponse | None, flags: int,
                      requested: list[str]) -> None: ...

    def is_cancelled(self, stream: int) -> bool: ...


#: set by the stub before model.py is imported; None when the module is used outside a stub
_runtime: _Runtime | None = None


def _stub() -> _Runtime:
    if _runtime is None:
        raise TritonModelException("this needs the server: it works inside a Python model that Kiln runs")
    return _runtime


def _unsupported(what: str) -> TritonModelException:
    return TritonModelException(f"{what} is not supported by Kiln's Python backend yet")


# -- errors ---------------------------------------------------------------------------------------------------------
class TritonModelException(Exception):  # noqa: N818 - Triton's name
    """Raised by the backend's API, and by model code to fail every request of an execute() call."""


class TritonError:
    """An error set on an InferenceResponse (not an exception): the request fails with `message`, its status given
    by `code` (default INTERNAL)."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        if message is None or code is None:
            raise TypeError("TritonError(): message and code must not be None")
        self._message = str(message)
        self._code = int(code)

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code

    def __repr__(self) -> str:
        return f"TritonError({self._message!r}, code={self._code})"


_CODE_NAMES = {value: name for name, value in vars(TritonError).items() if name.isupper()}


def _error_code(name: str) -> int:
    return getattr(TritonError, name, TritonError.INTERNAL)


# -- tensors --------------------------------------------------------------------------------------------------------
class Tensor:
    """A named tensor in host memory: `Tensor(name, numpy_array)`; a non-contiguous array is made contiguous, as
    Triton does. BYTES tensors are numpy object arrays (bytes, or anything `str()` turns into text)."""

    def __init__(self, name: str, numpy_array: Any) -> None:
        if not name:
            raise TritonModelException("Tensor name cannot be an empty string.")
        array = np.asarray(numpy_array)
        if _triton_type(array.dtype) is None:
            raise TritonModelException(f"tensor '{name}': numpy dtype {array.dtype} has no Triton data type")
        self._name = name
        self._array = array if array.flags.c_contiguous else np.ascontiguousarray(array)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array

    def triton_dtype(self) -> int:
        return _triton_type(self._array.dtype)  # type: ignore[return-value]

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def is_cpu(self) -> bool:
        return True

    def to_dlpack(self) -> Any:
        """A DLPack capsule of the tensor's memory (shared, not copied)."""
        if self.triton_dtype() == _BYTES:
            raise TritonModelException("DLPack does not have support for string tensors.")
        return self._array.__dlpack__()

    def __dlpack__(self, stream: Any = None, **_: Any) -> Any:
        return self.to_dlpack()

    def __dlpack_device__(self) -> tuple[int, int]:
        return _DLPACK_CPU, 0

    @staticmethod
    def from_dlpack(name: str, tensor: Any) -> Tensor:
        """A Tensor on the memory of a DLPack capsule or of an object with `__dlpack__` (a torch tensor, a numpy
        array, ...), without a copy. Host memory only."""
        if not name:
            raise TritonModelException("Tensor name cannot be an empty string.")
        if type(tensor).__name__ == "PyCapsule":
            tensor = _Capsule(tensor)
        if not hasattr(tensor, "__dlpack__") or not hasattr(tensor, "__dlpack_device__"):
            raise TritonModelException("Provided tensor is not supported. Tensor must be a DLPack capsule or have "
                                       "`__dlpack__` and `__dlpack_device__` attributes")
        device = tensor.__dlpack_device__()[0]
        if device not in (_DLPACK_CPU, _DLPACK_CUDA_HOST):
            raise _unsupported(f"a DLPack tensor on device type {device} (GPU tensors)")
        return Tensor(name, np.from_dlpack(tensor))

    def __repr__(self) -> str:
        return f"Tensor({self._name!r}, shape={self.shape()}, dtype={self._array.dtype})"


class _Capsule:
    """A bare DLPack capsule seen as an object numpy's `from_dlpack` takes (host memory: the only kind here)."""

    def __init__(self, capsule: Any) -> None:
        self._capsule = capsule

    def __dlpack__(self, stream: Any = None, **_: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return _DLPACK_CPU, 0


_TRITON_TYPE_OF_DTYPE: dict[np.dtype, int | None] = {}  # _triton_type's answers (numpy's dtypes are few)


def _triton_type(dtype: np.dtype) -> int | None:
    """TRITONSERVER_DataType of a numpy dtype; text and object arrays are BYTES."""
    try:
        return _TRITON_TYPE_OF_DTYPE[dtype]
    except (KeyError, TypeError):  # not seen yet, or not hashable as given
        pass
    found = np.dtype(dtype)
    number = _BYTES if found.kind in "OSU" else numpy_to_triton_type(found.type)
    if isinstance(dtype, np.dtype):
        _TRITON_TYPE_OF_DTYPE[dtype] = number
    return number


class PreferredMemory:
    """Where BLS outputs should be placed; Kiln's are always in host memory, so this is only recorded."""

    def __init__(self, preferred_memory_type: int, preferred_device_id: int = 0) -> None:
        self.preferred_memory_type = preferred_memory_type
        self.preferred_device_id = preferred_device_id


TRITONSERVER_MEMORY_GPU = 1
TRITONSERVER_MEMORY_CPU = 0


class InferenceTrace:
    """A request's trace context (Kiln hands none to Python models)."""

    def get_context(self) -> str | None:
        return None


# -- requests and responses -----------------------------------------------------------------------------------------
class InferenceRequest:
    """A request: the ones execute() receives, and BLS requests a model builds to call another model
    (`InferenceRequest(model_name=..., requested_output_names=[...], inputs=[...]).exec()`)."""

    def __init__(self, request_id: str = "", correlation_id: int | str = 0, inputs: list[Tensor] | None = None,
                 requested_output_names: list[str] | None = None, model_name: str | bytes | None = None,
                 model_version: int = -1, flags: int = 0, timeout: int = 0,
                 preferred_memory: PreferredMemory | None = None, trace: InferenceTrace | None = None,
                 parameters: dict[str, Any] | None = None) -> None:
        if inputs is None or requested_output_names is None or model_name is None:
            raise TypeError("InferenceRequest(): inputs, requested_output_names and model_name are required")
        if isinstance(correlation_id, bool) or not isinstance(correlation_id, (int, str)):
            raise TritonModelException("Correlation ID must be integer or string")
        self._request_id = str(request_id)
        self._correlation_id = correlation_id
        self._inputs = _tensors(inputs, "inputs")
        self._requested_output_names = [str(n) for n in requested_output_names]
        self._model_name = model_name.decode() if isinstance(model_name, bytes) else str(model_name)
        self._model_version = int(model_version)
        self._flags = int(flags)
        self._timeout = int(timeout)
        self._preferred_memory = preferred_memory or PreferredMemory(TRITONSERVER_MEMORY_CPU)
        self._trace = trace or InferenceTrace()
        self._parameters = _parameters_json(parameters or {})
        self._response_sender: InferenceResponseSender | None = None  # set by the stub for a decoupled model

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def request_id(self) -> str:
        return self._request_id

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def flags(self) -> int:
        return self._flags

    def set_flags(self, flags: int) -> None:
        self._flags = int(flags)

    def timeout(self) -> int:
        return self._timeout

    def parameters(self) -> str:
        """The request's parameters as a JSON object (a string, as Triton gives them)."""
        return self._parameters

    def trace(self) -> InferenceTrace:
        return self._trace

    def requested_output_names(self) -> list[str]:
        return self._requested_output_names

    def is_cancelled(self) -> bool:
        """Whether the client gave up on this request (decoupled models only; always False otherwise)."""
        return self._response_sender is not None and self._response_sender.is_cancelled()

    def get_response_sender(self) -> InferenceResponseSender:
        """The sender of this request's responses (every call returns the same one). A model in the default mode
        may answer through it too (Triton 24.06+): exactly one response, with the final flag or before a bare
        final flag, and execute() then returns None (or None in that request's place)."""
        if self._response_sender is None:
            self._response_sender = _DefaultModeSender()
        return self._response_sender

    def set_release_flags(self, flags: int) -> None:
        raise _unsupported("request rescheduling (set_release_flags)")

    def exec(self, decoupled: bool = False) -> Any:
        """Run this request on the model it names and wait for the response; errors come back on the response
        (`has_error()`), not raised. `decoupled=True`: a `ResponseIterator` of the responses as the model sends
        them (any number, for decoupled and ordinary models alike; the last may be empty: a bare final flag)."""
        if decoupled:
            return _stub().exec_decoupled(self)
        return _stub().exec(self)

    def async_exec(self, decoupled: bool = False) -> Awaitable[Any]:
        """Like `exec`, as an awaitable of the running event loop (in an `async def execute`)."""
        if decoupled:
            return _stub().async_exec_decoupled(self)
        return _stub().async_exec(self)

    def __repr__(self) -> str:
        return (f"InferenceRequest(model_name={self._model_name!r}, request_id={self._request_id!r}, "
                f"inputs={[t.name() for t in self._inputs]})")


class ResponseIterator:
    """The responses of `InferenceRequest.exec(decoupled=True)` as they arrive (iterating waits for the next); it
    ends after the final one, which is empty when the model sent a bare final flag. `cancel()` asks the server to
    stop the request: the iterator then ends with a CANCELLED error response."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._done = False
        self._cancel: Any = None  # set by the stub once the request is sent

    def _put(self, response: InferenceResponse, final: bool) -> None:
        self._queue.put((response, final))

    def __iter__(self) -> ResponseIterator:
        return self

    def __next__(self) -> InferenceResponse:
        if self._done:
            raise StopIteration
        response, final = self._queue.get()
        self._done = final
        return response

    def cancel(self) -> None:
        if not self._done and self._cancel is not None:
            self._cancel()


class InferenceResponse:
    """One request's response: output tensors, or an error (`TritonError`) that fails the request."""

    def __init__(self, output_tensors: list[Tensor] | None = None, error: TritonError | None = None,
                 parameters: dict[str, Any] | None = None) -> None:
        if error is not None and not isinstance(error, TritonError):
            raise TypeError(f"InferenceResponse(): error must be a TritonError, got {type(error).__name__}")
        self._output_tensors = _tensors(output_tensors or [], "output_tensors")
        self._error = error
        self._parameters = _parameters_json(parameters or {})

    def output_tensors(self) -> list[Tensor]:
        return self._output_tensors

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return self._parameters

    def __repr__(self) -> str:
        if self._error is not None:
            return f"InferenceResponse(error={self._error!r})"
        return f"InferenceResponse(output_tensors={[t.name() for t in self._output_tensors]})"


class InferenceResponseSender:
    """Sends a decoupled request's responses, any number of them, from any thread, each to the client as it is
    sent; the one with `flags=TRITONSERVER_RESPONSE_COMPLETE_FINAL` (with or without a response) ends the request,
    and the sender is closed after it (Triton's text when used again)."""

    def __init__(self, stream: int, requested_output_names: list[str]) -> None:
        self._stream = stream
        self._requested = requested_output_names
        self._closed = False

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        """Triton's checks and texts: flags 0 or final, a response with flags 0, nothing after the final one."""
        if flags not in (0, TRITONSERVER_RESPONSE_COMPLETE_FINAL):
            raise TritonModelException("Unable to send response. Unsupported flag provided.")
        if flags == 0 and response is None:
            raise TritonModelException("Inference Response object must be provided when the response flags is set "
                                       "to zero.")
        self._check_mode(response)
        if self._closed:
            raise TritonModelException("Unable to send response. Response sender has been closed.")
        if response is not None and not isinstance(response, InferenceResponse):
            raise TypeError(f"send(): response must be a pb_utils.InferenceResponse, got {type(response).__name__}")
        if flags == TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            self._closed = True
        self._deliver(response, int(flags))

    def _check_mode(self, response: InferenceResponse | None) -> None:
        """What the model's mode refuses beyond the arguments: nothing for a decoupled model (any number)."""

    def _deliver(self, response: InferenceResponse | None, flags: int) -> None:
        """To the client now, through the stub."""
        _stub().send_response(self._stream, response, flags, self._requested)

    def is_cancelled(self) -> bool:
        """Whether the client gave up on the request (its stream or connection closed): stop sending."""
        return _runtime is not None and _runtime.is_cancelled(self._stream)

    def _close(self) -> None:
        """The request failed (execute() raised): nothing more may be sent, as in Triton."""
        self._closed = True


class _DefaultModeSender(InferenceResponseSender):
    """The response sender of a request to a model in the default mode: it keeps the one response the model sends
    (Triton's checks and texts) for the stub, which answers the request with it once the final flag came."""

    def __init__(self) -> None:
        super().__init__(0, [])
        self._response: InferenceResponse | None = None
        self._sent = 0
        self._final = threading.Event()

    def _check_mode(self, response: InferenceResponse | None) -> None:
        if response is not None and self._sent:
            raise TritonModelException("Unable to send response. Non-decoupled model cannot send more than one "
                                       "response.")
        if response is None and self._sent == 0:
            raise TritonModelException("Unable to send response. Non-decoupled model cannot send complete final "
                                       "before sending a response.")

    def _deliver(self, response: InferenceResponse | None, flags: int) -> None:
        """Kept for the stub, which answers the request with it once the final flag came."""
        self._sent += 1
        if response is not None:
            self._response = response
        if flags == TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            self._final.set()

    def is_cancelled(self) -> bool:
        return False

    def _wait(self) -> InferenceResponse | None:
        """The response, once the final flag was sent (from any thread)."""
        self._final.wait()
        return self._response


def _tensors(tensors: Iterable[Any], what: str) -> list[Tensor]:
    tensors = list(tensors)
    for tensor in tensors:
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{what} must be pb_utils.Tensor objects, got {type(tensor).__name__}")
    return tensors


def _parameters_json(parameters: dict[str, Any]) -> str:
    """Triton's check of request/response parameters: string keys, values str, int or bool."""
    if not parameters and isinstance(parameters, dict):  # the usual case, for every request and response
        return "{}"
    if not isinstance(parameters, dict):
        raise TritonModelException(f"Expect parameters to be a dict, found type {type(parameters).__name__}")
    for key, value in parameters.items():
        if not isinstance(key, str):
            raise TritonModelException(f"Expect parameters keys to have type str, found type {type(key).__name__}")
        if not isinstance(value, (str, int, bool)):
            raise TritonModelException("Expect parameters values to have type bool/int/str, found type "
                                       f"{type(value).__name__}")
    return json.dumps(parameters)


# -- logging, model directory, what is not supported -----------------------------------------------------------------
class Logger:
    """Log lines in the server's log, with the model's name (Triton's Logger; VERBOSE shows with --log-verbose)."""

    class LogLevel(enum.IntEnum):
        INFO = 0
        WARNING = 1
        ERROR = 2
        VERBOSE = 3

    INFO = LogLevel.INFO
    WARNING = LogLevel.WARNING
    ERROR = LogLevel.ERROR
    VERBOSE = LogLevel.VERBOSE

    @staticmethod
    def log(message: str, level: int = LogLevel.INFO) -> None:
        if _runtime is None:
            print(f"{Logger.LogLevel(level).name}: {message}", file=sys.stderr)
            return
        _runtime.log(int(level), str(message))

    @staticmethod
    def log_info(message: str) -> None:
        Logger.log(message, Logger.LogLevel.INFO)

    @staticmethod
    def log_warn(message: str) -> None:
        Logger.log(message, Logger.LogLevel.WARNING)

    @staticmethod
    def log_error(message: str) -> None:
        Logger.log(message, Logger.LogLevel.ERROR)

    @staticmethod
    def log_verbose(message: str) -> None:
        Logger.log(message, Logger.LogLevel.VERBOSE)


def get_model_dir() -> str:
    """The directory of the model's version (where its model.py is)."""
    return _stub().model_dir


class MetricFamily:
    """A custom metric family (`COUNTER`, `GAUGE` or `HISTOGRAM`) on the server's /metrics; its `Metric`s hold the
    values, one per label set. The family lives as long as the model's instance (its stub) does."""

    COUNTER, GAUGE, HISTOGRAM = 0, 1, 2
    _KINDS = {COUNTER: "counter", GAUGE: "gauge", HISTOGRAM: "histogram"}

    def __init__(self, name: str, description: str, kind: int) -> None:
        if kind not in self._KINDS:
            raise TritonModelException("MetricFamily kind must be COUNTER, GAUGE or HISTOGRAM")
        self.name, self.description, self.kind = name, description, kind
        _stub().metric("family", True, name=name, description=description, kind=self._KINDS[kind])

    def Metric(self, labels: dict[str, str] | None = None, buckets: list[float] | None = None) -> Metric:  # noqa: N802
        return Metric(self, labels or {}, buckets)


class Metric:
    """One metric of a family: `increment` (counter, gauge), `set` (gauge), `observe` (histogram), `value`."""

    def __init__(self, family: MetricFamily, labels: dict[str, str], buckets: list[float] | None = None) -> None:
        if family.kind == MetricFamily.HISTOGRAM and not buckets:
            raise TritonModelException("a histogram metric needs buckets")
        self.family = family
        self._id = _stub().metric("metric", True, name=family.name, labels={str(k): str(v) for k, v in labels.items()},
                                  buckets=[float(b) for b in buckets] if buckets else None)

    def increment(self, value: float) -> None:
        if self.family.kind == MetricFamily.HISTOGRAM:
            raise TritonModelException("increment is not supported for a histogram; use observe")
        if self.family.kind == MetricFamily.COUNTER and value < 0:
            raise TritonModelException("a counter cannot be incremented by a negative value")
        _stub().metric("increment", False, id=self._id, value=float(value))

    def set(self, value: float) -> None:
        if self.family.kind != MetricFamily.GAUGE:
            raise TritonModelException("set is only supported for a gauge")
        _stub().metric("set", False, id=self._id, value=float(value))

    def observe(self, value: float) -> None:
        if self.family.kind != MetricFamily.HISTOGRAM:
            raise TritonModelException("observe is only supported for a histogram")
        _stub().metric("observe", False, id=self._id, value=float(value))

    def value(self) -> float:
        return float(_stub().metric("value", True, id=self._id))


def load_model(model_name: str, config: str = "", files: dict[str, bytes] | None = None) -> None:
    """Load (or reload) `model_name` on the server, optionally with a JSON config and files ("file:<path>" ->
    bytes) that override the repository's; returns once it is ready. Needs the server in explicit model control
    mode, as in Triton; a failure raises TritonModelException with the server's message."""
    _stub().control("load", name=model_name, config=config or None, files=dict(files or {}))


def unload_model(model_name: str, unload_dependents: bool = False) -> None:
    """Unload `model_name` (and, with `unload_dependents`, the composing models loaded for it)."""
    _stub().control("unload", name=model_name, unload_dependents=bool(unload_dependents))


def is_model_ready(model_name: str, model_version: str = "") -> bool:
    """Whether `model_name` (a given version, or any) is loaded and ready."""
    return bool(_stub().control("ready", name=model_name, version=str(model_version)))


# -- Triton's Python helpers ----------------------------------------------------------------------------------------
def serialize_byte_tensor(input_tensor: np.ndarray) -> bytes | tuple | None:
    """A BYTES tensor as Triton's wire form: each element's 4-byte little-endian length, then its bytes."""
    if input_tensor.size == 0:
        return ()
    if input_tensor.dtype != np.object_ and input_tensor.dtype.type != np.bytes_:
        return None
    parts = []
    for item in input_tensor.flat:
        data = item if isinstance(item, bytes) else str(item).encode("utf-8")
        parts += [struct.pack("<I", len(data)), data]
    return b"".join(parts)


def deserialize_bytes_tensor(encoded_tensor: bytes) -> np.ndarray:
    """Triton's wire form of a BYTES tensor back to a 1-D object array of bytes."""
    items, offset = [], 0
    while offset < len(encoded_tensor):
        (length,) = struct.unpack_from("<I", encoded_tensor, offset)
        offset += 4
        items.append(bytes(encoded_tensor[offset:offset + length]))
        offset += length
    return np.array(items, dtype=np.object_)


def get_input_tensor_by_name(inference_request: InferenceRequest, name: str) -> Tensor | None:
    """The request's input `name`, or None."""
    return next((t for t in inference_request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(inference_response: InferenceResponse, name: str) -> Tensor | None:
    """The response's output `name`, or None."""
    return next((t for t in inference_response.output_tensors() if t.name() == name), None)


def get_input_config_by_name(model_config: dict, name: str) -> dict | None:
    """The config's entry for input `name` (the dict of `json.loads(args["model_config"])`), or None."""
    return next((i for i in model_config.get("input", []) if i["name"] == name), None)


def get_output_config_by_name(model_config: dict, name: str) -> dict | None:
    """The config's entry for output `name`, or None."""
    return next((o for o in model_config.get("output", []) if o["name"] == name), None)


def using_decoupled_model_transaction_policy(model_config: dict) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


def triton_to_numpy_type(data_type: int) -> type | None:
    return _NUMPY_OF_TRITON_TYPE.get(data_type)


def numpy_to_triton_type(data_type: Any) -> int | None:
    if data_type == np.bytes_:
        return _BYTES
    return next((number for number, numpy_type in _NUMPY_OF_TRITON_TYPE.items() if data_type == numpy_type), None)


def triton_string_to_numpy(triton_type_string: str) -> type:
    return TRITON_STRING_TO_NUMPY[triton_type_string]


class ModelConfig:
    """The model configuration `auto_complete_config` completes: it may set max_batch_size, inputs, outputs,
    dynamic batching and the transaction policy; the returned object becomes the model's config."""

    def __init__(self, model_config: str) -> None:
        self._model_config = json.loads(model_config)

    def as_dict(self) -> dict:
        return self._model_config

    def _name(self) -> str:
        return self._model_config["name"]

    def set_max_batch_size(self, max_batch_size: int) -> None:
        if self._model_config["max_batch_size"] > max_batch_size:
            raise ValueError(f"configuration specified max_batch_size {self._model_config['max_batch_size']}, but in "
                             f"auto-complete-config function for model '{self._name()}' specified max_batch_size "
                             f"{max_batch_size}")
        self._model_config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        for scheduler in ("sequence_batching", "ensemble_scheduling"):
            if scheduler in self._model_config:
                raise ValueError(f"Configuration specified scheduling_choice as '{scheduler}', but "
                                 f"auto-complete-config function for model '{self._name()}' tries to set "
                                 "scheduling_choice as 'dynamic_batching'")
        self._model_config.setdefault("dynamic_batching", {})

    def add_input(self, input: dict) -> None:  # noqa: A002 - Triton's parameter name
        self._add_tensor(input, "input", ("name", "data_type", "dims", "optional"))

    def add_output(self, output: dict) -> None:
        self._add_tensor(output, "output", ("name", "data_type", "dims"))

    def _add_tensor(self, tensor: dict, role: str, valid: tuple[str, ...]) -> None:
        """Triton's checks and texts: known properties only, name/data_type/dims required, and a tensor the config
        already has keeps its data type and dims (they must agree), else is appended."""
        model = self._name()
        for key in tensor:
            if key not in valid:
                allowed = ", ".join(f"'{k}'" for k in valid[:-1]) + f" and '{valid[-1]}'"
                raise ValueError(f"{role} '{tensor.get('name', '')}' in auto-complete-config function for model "
                                 f"'{model}' contains property other than {allowed}.")
        if "name" not in tensor:
            raise ValueError(f"{role} in auto-complete-config function for model '{model}' is missing 'name' "
                             "property.")
        for key in ("data_type", "dims"):
            if key not in tensor:
                raise ValueError(f"{role} '{tensor['name']}' in auto-complete-config function for model '{model}' "
                                 f"is missing '{key}' property.")
        for current in self._model_config.setdefault(role, []):
            if current["name"] != tensor["name"]:
                continue
            if current.get("data_type", "TYPE_INVALID") not in ("TYPE_INVALID", tensor["data_type"]):
                raise ValueError(f"unable to load model '{model}', configuration expects datatype "
                                 f"{current['data_type']} for {role} '{tensor['name']}', model provides "
                                 f"{tensor['data_type']}")
            if current.get("dims") and list(current["dims"]) != list(tensor["dims"]):
                raise ValueError(f"model '{model}', tensor '{tensor['name']}': the model expects dims "
                                 f"{tensor['dims']} but the model configuration specifies dims {current['dims']}")
            if "optional" in current and "optional" in tensor and current["optional"] != tensor["optional"]:
                raise ValueError(f"model '{model}', tensor '{tensor['name']}': the model expects optional "
                                 f"{tensor['optional']} but the model configuration specifies optional "
                                 f"{current['optional']}")
            current["data_type"], current["dims"] = tensor["data_type"], tensor["dims"]
            if "optional" in tensor:
                current["optional"] = tensor["optional"]
            return
        self._model_config[role].append(tensor)

    def set_model_transaction_policy(self, transaction_policy_dict: dict) -> None:
        for key in transaction_policy_dict:
            if key != "decoupled":
                raise ValueError(f"model transaction property in auto-complete-config function for model "
                                 f"'{self._name()}' contains property other than 'decoupled'.")
        policy = self._model_config.setdefault("model_transaction_policy", {})
        if "decoupled" in transaction_policy_dict:
            if "decoupled" in policy and policy["decoupled"] != transaction_policy_dict["decoupled"]:
                raise ValueError(f"trying to change decoupled property in auto-complete-config for model "
                                 f"'{self._name()}', which is already set to '{policy['decoupled']}'.")
            policy["decoupled"] = transaction_policy_dict["decoupled"]
