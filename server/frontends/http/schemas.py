"""Pydantic models of the KServe v2 / Triton JSON bodies (the schema of the HTTP API, shown in /docs).

Tensor `data` stays `Any` here: it is converted to numpy in `codec.py`, which checks it against the
datatype and shape far faster than per-element validation could.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

Parameters = dict[str, Any]


class ErrorBody(BaseModel):
    error: str


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int]


class ModelMetadata(BaseModel):
    name: str
    versions: list[str] = []
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class InferInputBody(BaseModel):
    name: str
    shape: list[int] = Field(description="dims of the tensor; data holds their product elements")
    datatype: str
    parameters: Parameters | None = None
    data: Any = None


class RequestedOutputBody(BaseModel):
    name: str
    parameters: Parameters | None = None


class InferRequestBody(BaseModel):
    """The JSON part of an inference request (the whole body, or the first Inference-Header-Content-Length
    bytes when binary tensor data follows)."""

    id: str | None = None
    parameters: Parameters | None = None
    inputs: list[InferInputBody]
    outputs: list[RequestedOutputBody] | None = None


class InferOutputBody(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    parameters: Parameters | None = None
    data: list[Any] | None = None


class InferResponseBody(BaseModel):
    model_name: str
    model_version: str | None = None
    id: str | None = None
    parameters: Parameters | None = None
    outputs: list[InferOutputBody]


class RepositoryIndexRequest(BaseModel):
    ready: bool = False


class RepositoryModel(BaseModel):
    name: str
    version: str = ""
    state: str = ""
    reason: str = ""


class LoadRequest(BaseModel):
    """`parameters.config`: a JSON model config; `parameters["file:<version>/<name>"]`: base64 file contents."""

    parameters: Parameters | None = None


class UnloadRequest(BaseModel):
    parameters: Parameters | None = None


class ModelStatisticsBody(BaseModel):
    model_stats: list[dict[str, Any]]


class SystemSharedMemoryRegisterRequest(BaseModel):
    key: str
    offset: int = Field(0, ge=0)
    byte_size: int = Field(gt=0)


class SystemSharedMemoryRegion(BaseModel):
    name: str
    key: str
    offset: int
    byte_size: int


class RawHandle(BaseModel):
    b64: str


class CudaSharedMemoryRegisterRequest(BaseModel):
    raw_handle: RawHandle
    device_id: int = Field(ge=0)
    byte_size: int = Field(gt=0)


class LogSettingsBody(BaseModel):
    """Triton's log settings; fields left out keep their value."""

    model_config = ConfigDict(extra="forbid")

    log_file: str | None = None
    log_info: bool | None = None
    log_warning: bool | None = None
    log_error: bool | None = None
    log_verbose_level: int | None = Field(None, ge=0)
    log_format: str | None = None


TraceSettingsBody = dict[str, str | int | list[str] | None]
