"""The request and response types every frontend translates to and from, and the datatype tables.

Tensors are numpy arrays tagged with their KServe datatype name ("FP32", "BYTES", ...). BYTES tensors are
object arrays of `bytes`. A tensor whose data lives in a shared-memory region has `data=None` and names the
region in its parameters (`shared_memory_region`, `shared_memory_offset`, `shared_memory_byte_size`); the
core reads and writes regions, so frontends never touch them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

from .errors import invalid

# KServe v2 datatype name -> numpy dtype (little-endian, as on the wire).
NUMPY_OF_DATATYPE: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "BYTES": np.dtype(np.object_),
}

# Triton model-config data_type ("TYPE_FP32") <-> KServe datatype ("FP32"); TYPE_STRING is BYTES.
CONFIG_TYPE_OF_DATATYPE: dict[str, str] = {
    name: ("TYPE_STRING" if name == "BYTES" else f"TYPE_{name}") for name in NUMPY_OF_DATATYPE
}
DATATYPE_OF_CONFIG_TYPE: dict[str, str] = {v: k for k, v in CONFIG_TYPE_OF_DATATYPE.items()}


def numpy_dtype(datatype: str) -> np.dtype:
    """numpy dtype of a KServe datatype; INVALID_ARGUMENT for unknown names."""
    try:
        return NUMPY_OF_DATATYPE[datatype]
    except KeyError:
        raise invalid(f"unsupported datatype '{datatype}'") from None


def datatype_of_numpy(dtype: np.dtype) -> str:
    """KServe datatype of a numpy dtype (strings/bytes/objects are BYTES)."""
    dtype = np.dtype(dtype)
    if dtype.kind in "OSU":
        return "BYTES"
    for name, candidate in NUMPY_OF_DATATYPE.items():
        if candidate == dtype:
            return name
    raise invalid(f"numpy dtype {dtype} has no KServe datatype")


@dataclass
class InferInput:
    """One input tensor. `data` has `shape` and the dtype of `datatype`, or is None when in shared memory."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: np.ndarray | None = None
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass
class RequestedOutput:
    """An output the client asked for. Parameters the core reads: `classification` (top-k as int),
    `shared_memory_region` / `shared_memory_offset` / `shared_memory_byte_size`. Others (e.g. `binary_data`)
    are for the frontend and come back unchanged on the matching `InferOutput`."""

    name: str
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass
class InferRequest:
    """An inference request. `model_version` "" means the latest ready version; no `outputs` means all."""

    model_name: str
    inputs: list[InferInput]
    model_version: str = ""
    id: str = ""
    outputs: list[RequestedOutput] = field(default_factory=list)
    parameters: dict[str, Any] = field(default_factory=dict)
    #: Triton's raw binary request: the bytes of the model's single input, whose name, datatype and shape the
    #: core deduces from the model (`inputs` is then empty)
    raw_input: bytes | memoryview | None = None
    #: the client's W3C trace context (HTTP header / gRPC metadata `traceparent`), continued by OpenTelemetry traces
    traceparent: str = ""


@dataclass
class InferOutput:
    """One output tensor. `data` is None when it was written to a shared-memory region (see parameters)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: np.ndarray | None = None
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass
class InferResponse:
    model_name: str
    model_version: str
    outputs: list[InferOutput]
    id: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
