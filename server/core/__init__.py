"""The protocol-neutral server core: models, inference, repository, statistics, shared memory, settings.

Frontends (`server/frontends/http`, `server/frontends/grpc`) translate their protocol into calls on one
`ServerCore` and map `ServerError.kind` to their status codes:

    kind               HTTP  gRPC
    INVALID_ARGUMENT   400   INVALID_ARGUMENT
    NOT_FOUND          404   NOT_FOUND
    UNAVAILABLE        503   UNAVAILABLE     (a restricted API without its credential: 403, as Triton)
    RESOURCE_EXHAUSTED 429   RESOURCE_EXHAUSTED
    ALREADY_EXISTS     409   ALREADY_EXISTS
    INTERNAL           500   INTERNAL
    UNIMPLEMENTED      501   UNIMPLEMENTED   (a feature the server was started without, e.g. client shm)

Core API (all `async`; versions are strings, "" = latest ready):
    live(), ready(), server_metadata(), model_ready(name, version), model_metadata(name, version),
    model_config(name, version), infer(InferRequest) -> InferResponse, repository_index(ready=False),
    load_model(name, config_json | None, files {path: bytes}), unload_model(name, unload_dependents=False),
    model_statistics(name="", version=""), system_shared_memory_status/register/unregister,
    cuda_shared_memory_status/register/unregister (CUDA IPC; INVALID_ARGUMENT "no CUDA device on this server" without a GPU), trace_settings(model, updates),
    log_settings(updates).

Frontend processes reach the same API through `remote.RemoteCore` (server/frontend_processes.py).
"""

from .core import CoreOptions, ModelState, ServerCore
from .errors import ErrorKind, ServerError
from .types import (
    NUMPY_OF_DATATYPE,
    InferInput,
    InferOutput,
    InferRequest,
    InferResponse,
    RequestedOutput,
    datatype_of_numpy,
    numpy_dtype,
)

__all__ = [
    "NUMPY_OF_DATATYPE", "CoreOptions", "ErrorKind", "InferInput", "InferOutput", "InferRequest", "InferResponse",
    "ModelState", "RequestedOutput", "ServerCore", "ServerError", "datatype_of_numpy", "numpy_dtype",
]
