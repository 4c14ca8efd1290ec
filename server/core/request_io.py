"""A request's tensors between the protocol and the engine: inputs read (from the request or shared memory) and
checked, outputs converted, classified or written to shared memory, and what stays on the device.

Why a module of its own: these are the same for every model kind and scheduler, need only the model's config-level
view and the shared-memory registry, and are the part of the core that most changes with the protocol's options.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

import engine_core as kiln

from .errors import invalid
from .model import ModelVersion, ServedModel
from .shared_memory import SharedMemory
from .tensors import from_raw, raw_size, to_raw
from .types import InferInput, InferOutput, InferRequest, RequestedOutput, datatype_of_numpy, numpy_dtype


def raw_input(model: ServedModel, data: bytes | memoryview) -> InferInput:
    """The one input of Triton's raw binary request (HTTP `Inference-Header-Content-Length: 0`), its name,
    datatype and shape taken from the model: batch 1 when the model batches, the one variable dim (if any)
    from the byte count, a BYTES input must have shape [1] and gets the whole body as its element.
    Triton's rules and texts: core/src/infer_request.cc InferenceRequest::Normalize."""
    if len(model.inputs) != 1:
        raise invalid(f"Raw request must only have 1 input (found 1) to be deduced but got {len(model.inputs)} "
                      f"inputs in '{model.name}' model configuration")
    spec = next(iter(model.inputs.values()))
    dims = list(spec.dims)
    if dims.count(-1) > 1:
        raise invalid(f"The shape of the raw input '{spec.name}' can not be deduced because there are more "
                      "than one variable-sized dimension")
    batch = [1] if model.max_batch_size > 0 else []
    if spec.datatype == "BYTES":
        if dims.count(-1) or math.prod(dims) != 1:
            raise invalid(f"For BYTE datatype raw input '{spec.name}', the model must have input shape [1]")
        array = np.empty(1, dtype=np.object_)
        array[0] = bytes(data)
        shape = tuple(batch + dims)
        return InferInput(spec.name, spec.datatype, shape, array.reshape(shape))
    if -1 in dims:
        per_step = math.prod(d for d in dims if d != -1) * numpy_dtype(spec.datatype).itemsize
        dims[dims.index(-1)] = len(data) // per_step if per_step else 0
    shape = tuple(batch + dims)
    return InferInput(spec.name, spec.datatype, shape, from_raw(data, spec.datatype, shape))

def input_array(shm: SharedMemory, tensor: InferInput, model: ServedModel) -> np.ndarray | kiln.DeviceView:
    """The input's data, read from its shared-memory region when it names one; shape checked. An input in
    CUDA shared memory (or page-locked system shared memory, `host_regions`) for a CUDA model that batches stays
    where it is: the engine reads it on the device."""
    region = tensor.parameters.get("shared_memory_region")
    if region is not None:
        if tensor.data is not None:
            raise invalid(f"input '{tensor.name}' has both data and a shared memory region")
        offset = int(tensor.parameters.get("shared_memory_offset", 0))
        size = tensor.parameters.get("shared_memory_byte_size")
        if size is None:
            raise invalid(f"input '{tensor.name}': shared_memory_byte_size is required with a region")
        if reads_in_place(model, tensor.datatype):
            dtype = numpy_dtype(tensor.datatype)
            if math.prod(tensor.shape) * dtype.itemsize != int(size):
                raise invalid(f"input '{tensor.name}': shared_memory_byte_size {size} does not match shape "
                              f"{list(tensor.shape)} of {tensor.datatype}")
            view = shm.device_view(str(region), offset, int(size), tensor.shape, dtype, host_regions(model))
            if view is not None:
                return view
        raw = shm.read(str(region), offset, int(size))
        return from_raw(raw, tensor.datatype, tensor.shape)
    if tensor.data is None:
        raise invalid(f"input '{tensor.name}' has no data")
    numpy_dtype(tensor.datatype)
    if tuple(tensor.data.shape) != tuple(tensor.shape):
        raise invalid(f"input '{tensor.name}': data has {tensor.data.size} elements, shape "
                      f"{list(tensor.shape)} needs {math.prod(tensor.shape)}")
    return tensor.data

def output_views(shm: SharedMemory, model: ModelVersion, requested: list[RequestedOutput],
                  inputs: dict[str, Any]) -> dict[str, kiln.DeviceView]:
    """Outputs the engine can write straight into the client's shared memory: a CUDA model that batches, a CUDA
    region or a page-locked system one (`host_regions`), no classification, and the engine's own dtype and shape
    (`writes_in_place`: no conversion or reshape)."""
    if not device_io(model):
        return {}
    views: dict[str, kiln.DeviceView] = {}
    shapes = None
    for output in requested:
        params = output.parameters
        if (params.get("shared_memory_region") is None or params.get("classification") not in (None, False)
                or not writes_in_place(model, output.name)):
            continue
        if shapes is None:
            shapes = model.output_shapes({name: tuple(a.shape) for name, a in inputs.items()})
        if shapes is None:
            return {}  # shapes the engine cannot tell before running: the host path writes them afterwards
        view = output_view(shm, model, output.name, params, shapes[output.name])
        if view is not None:
            views[output.name] = view
    return views


def writes_in_place(model: ModelVersion, name: str) -> bool:
    """What `output_views` asks of the model alone for output `name` (besides `device_io`): the engine makes it
    in the config's dtype and shape, so nothing is left to convert or reshape on the host, and its size follows
    from its shape (not BYTES)."""
    spec = model.outputs[name]
    return (spec.model_dims == spec.dims and spec.datatype != "BYTES"
            and model.engine_output_dtype(name) == numpy_dtype(spec.datatype))


def output_view(shm: SharedMemory, model: ModelVersion, name: str, params: Mapping[str, Any],
                shape: tuple[int, ...]) -> kiln.DeviceView | None:
    """Output `name` of `shape` in the region `params` names, for the engine to write there (None: a system
    region the device cannot reach); INVALID_ARGUMENT when the request gives no byte size or too few."""
    size = params.get("shared_memory_byte_size")
    if size is None:
        raise invalid(f"output '{name}': shared_memory_byte_size is required with a region")
    dtype = numpy_dtype(model.outputs[name].datatype)
    needed = math.prod(shape) * dtype.itemsize
    if needed > int(size):
        raise invalid(f"shared memory size specified with the request for output '{name}' "
                      f"({size} bytes) should be at least {needed} bytes to hold the results")
    return shm.device_view(str(params["shared_memory_region"]), int(params.get("shared_memory_offset", 0)),
                           int(size), shape, dtype, host_regions(model))

def uses_cuda_memory(shm: SharedMemory, request: InferRequest, requested: list[RequestedOutput]) -> bool:
    """Whether an input or requested output of `request` names a CUDA shared-memory region."""
    tensors = [*(t.parameters for t in request.inputs), *(o.parameters for o in requested)]
    return any(shm.is_cuda(str(p["shared_memory_region"])) for p in tensors if "shared_memory_region" in p)


def output_on_device(requested: RequestedOutput, view: kiln.DeviceView) -> InferOutput:
    """An output the engine already wrote into CUDA shared memory: only its description goes back."""
    params = dict(requested.parameters)
    params["shared_memory_byte_size"] = view.nbytes
    return InferOutput(requested.name, datatype_of_numpy(view.dtype), view.shape, None, params)

def outputs(shm: SharedMemory, model: ServedModel, requested: list[RequestedOutput], arrays: Mapping[str, Any],
            destinations: Mapping[str, kiln.DeviceView]) -> list[InferOutput]:
    """A job's requested outputs for its response: those the engine wrote into CUDA shared memory described, the
    others post-processed from `arrays` (`output`)."""
    return [output_on_device(o, destinations[o.name]) if o.name in destinations
            else output(shm, model, o, arrays[o.name]) for o in requested]


def output(shm: SharedMemory, model: ServedModel, requested: RequestedOutput, array: np.ndarray) -> InferOutput:
    """One output: converted to the config's datatype, classified if asked, written to shm if asked."""
    params = dict(requested.parameters)
    array = model.shape_output(requested.name, array)
    datatype = model.outputs[requested.name].datatype
    if not model.casts_outputs and array.dtype != object and array.dtype != numpy_dtype(datatype):
        datatype = datatype_of_numpy(array.dtype)  # a Python model's output as the model made it (Triton)
    k = params.pop("classification", None)
    if k is not None and k is not False:
        array = model.classify(requested.name, array, int_param(k, "classification"))
        datatype = "BYTES"
    region = params.get("shared_memory_region")
    if region is not None:
        offset = int(params.get("shared_memory_offset", 0))
        size = params.get("shared_memory_byte_size")
        if size is None:
            raise invalid(f"output '{requested.name}': shared_memory_byte_size is required with a region")
        data = to_raw(array, datatype)
        shm.write(str(region), offset, int(size), data)
        params["shared_memory_byte_size"] = raw_size(array, datatype)
        return InferOutput(requested.name, datatype, tuple(array.shape), None, params)
    return InferOutput(requested.name, datatype, tuple(array.shape), array, params)


def execution_error(model: ModelVersion, error: Exception) -> Exception:
    """What the caller hears for `error`: server errors as they are; the engine refusing the request's data as
    INVALID_ARGUMENT naming the model; anything else unchanged (an internal error)."""
    if isinstance(error, (kiln.KilnError, TypeError, ValueError)):
        return invalid(f"inference failed for model '{model.name}': {error}")
    return error


def device_io(model: ServedModel) -> bool:
    """Whether requests of `model` may keep tensors in device memory (CUDA shared memory, zero-copy): CUDA
    models that batch, whose jobs the engine gathers along the batch dim (ExecutionContext.infer_batch).
    Ensembles and sequence models (whose batcher stacks rows with their controls and state) read and write them
    through the host for now. A model run by an executor process (`executor.py`, also CPU models in tests) takes
    region tensors by reference, whatever its backend."""
    return (isinstance(model, ModelVersion) and model.max_batch_size > 0 and model.sequence is None
            and (model.engine.backend == "cuda" or bool(model.executors)))


def reads_in_place(model: ServedModel, datatype: str) -> bool:
    """Whether the engine may read an input of `datatype` where its region is (`input_array`): `device_io`, and a
    size that follows from the shape (not BYTES)."""
    return device_io(model) and datatype != "BYTES"


def host_regions(model: ServedModel) -> bool:
    """Whether the device may also read and write page-locked *system* shared memory of `model`'s requests in
    place: not for a model that caches responses, whose cache reads inputs and stores outputs on the host (Triton
    caches system shared memory, so those requests must not bypass it as CUDA ones do)."""
    return not model.config.response_cache.enable


def check_unique_outputs(outputs: list[RequestedOutput]) -> None:
    """An output asked for twice is refused, as Triton does (core/src/infer_request.cc AddOriginalRequestedOutput)."""
    seen: set[str] = set()
    for output in outputs:
        if output.name in seen:
            raise invalid(f"output '{output.name}' already exists in request")
        seen.add(output.name)


def int_param(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise invalid(f"parameter '{name}' must be an integer, got {value!r}")
    try:
        return int(value)
    except ValueError:
        raise invalid(f"parameter '{name}' must be an integer, got {value!r}") from None
