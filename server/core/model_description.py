"""What the server reads of an ONNX model's graph (its inputs and outputs), read in a bounded child process.

Completing a config (model_config.complete_config) and checking sequence batching against the graph
(sequence_config) need only the graph's inputs and outputs: names, element types and dims. The server process
never parses a model file to learn them: a child forked from the build forkserver parses it under the build limits
(server/core/build_process.py: memory, time) and answers with a small JSON description, so a hostile file (a huge
or malformed protobuf, a graph nested too deeply) fails there with a message while the server keeps serving.

Descriptions are cached by the model files' digest (the one the plan cache keys plans with) and the file's name: in
memory, and beside the plans in the plan cache directory, so a reload or a restart that hits the plan cache starts
no process at all. A description on disk is checked like one from a child; one that fails the checks is read anew.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import engine_core as kiln
from server.plan_cache import write_atomically

from . import build_process

log = logging.getLogger("kiln.server")

#: Changes whenever the description's content changes: older entries on disk are then not read.
FORMAT_VERSION = 1
#: The largest description a child may send (names and dims only: a model with a million inputs fits).
MAX_DESCRIPTION_BYTES = 64 << 20
#: Descriptions kept in memory (a few hundred bytes each for usual models).
MEMORY_ENTRIES = 1024
#: Folder of the plan cache directory that holds descriptions.
FOLDER = "descriptions"


@dataclass(frozen=True)
class TensorDescription:
    """One graph input or output. `elem_type`: the ONNX TensorProto data type (0 when the graph leaves it unset),
    None for a value that is not a tensor (a sequence, map or optional); `dims`: -1 for symbolic or unknown dims,
    None when the graph states no shape."""

    name: str
    elem_type: int | None
    dims: tuple[int, ...] | None

    @property
    def shape(self) -> list[int]:
        """The dims, [] when the graph states no shape."""
        return list(self.dims or ())


@dataclass(frozen=True)
class ModelDescription:
    """A graph's inputs (those that are not initializers: weights listed as inputs are no inputs) and outputs."""

    inputs: tuple[TensorDescription, ...]
    outputs: tuple[TensorDescription, ...]

    def to_json(self) -> bytes:
        def tensors(values: tuple[TensorDescription, ...]) -> list[list[Any]]:
            return [[v.name, v.elem_type, None if v.dims is None else list(v.dims)] for v in values]

        return json.dumps({"format": FORMAT_VERSION, "inputs": tensors(self.inputs),
                           "outputs": tensors(self.outputs)}).encode()

    @classmethod
    def from_json(cls, data: bytes) -> ModelDescription:
        """The description in `data`; ValueError unless it is exactly what `to_json` writes."""
        document = json.loads(data)
        if not isinstance(document, dict) or document.get("format") != FORMAT_VERSION:
            raise ValueError("not a model description of this format")
        return cls(_tensors(document.get("inputs")), _tensors(document.get("outputs")))


def _tensors(values: object) -> tuple[TensorDescription, ...]:
    if not isinstance(values, list):
        raise ValueError("tensors must be a list")
    tensors = []
    for value in values:
        if not isinstance(value, list) or len(value) != 3:
            raise ValueError("a tensor is [name, elem_type, dims]")
        name, elem_type, dims = value
        if not isinstance(name, str) or not (elem_type is None or _is_int(elem_type)):
            raise ValueError("a tensor's name is a string and its elem_type an integer or null")
        if dims is not None and not (isinstance(dims, list) and all(_is_int(d) for d in dims)):
            raise ValueError("a tensor's dims are integers or null")
        tensors.append(TensorDescription(name, elem_type, None if dims is None else tuple(dims)))
    return tuple(tensors)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- child side -----------------------------------------------------------------------------------------------
def describe_file(path: str) -> bytes:
    """Parse the ONNX file at `path` and describe its graph (JSON bytes): what the child runs. ParseError with
    protobuf's own text when the file is not an ONNX model."""
    import onnx

    data = Path(path).read_bytes()
    try:
        model = onnx.load_model_from_string(data)
    except Exception as e:  # noqa: BLE001 - protobuf raises several types for a corrupt file
        raise kiln.ParseError(str(e) or type(e).__name__) from None
    del data
    weights = {t.name for t in model.graph.initializer}
    inputs = tuple(_describe(v) for v in model.graph.input if v.name not in weights)
    return ModelDescription(inputs, tuple(_describe(v) for v in model.graph.output)).to_json()


def _describe(value) -> TensorDescription:
    if not value.type.HasField("tensor_type"):
        return TensorDescription(value.name, None, None)
    tensor_type = value.type.tensor_type
    dims = (tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tensor_type.shape.dim)
            if tensor_type.HasField("shape") else None)
    return TensorDescription(value.name, tensor_type.elem_type, dims)


# -- server side ----------------------------------------------------------------------------------------------
_memory: OrderedDict[str, ModelDescription] = OrderedDict()
_memory_lock = threading.Lock()


def describe(path: Path, files_digest: str, label: str, cache_directory: Path | None = None,
             limits: build_process.BuildLimits | None = None) -> ModelDescription:
    """The description of the ONNX file `path`, whose version directory's files have `files_digest`: from memory,
    from `cache_directory` (the plan cache's; None: memory only), else read by a child process. Raises
    build_process.TaskFailed with protobuf's text when the file is not an ONNX model, kiln.BuildError when reading
    it ran into the build limits. Blocking: call from a worker thread."""
    key = hashlib.sha256(f"{FORMAT_VERSION}\0{files_digest}\0{path.name}".encode()).hexdigest()
    with _memory_lock:
        found = _memory.get(key)
        if found is not None:
            _memory.move_to_end(key)
            return found
    entry = cache_directory / FOLDER / f"{key}.json" if cache_directory is not None else None
    description = _read_entry(entry) if entry is not None else None
    if description is None:
        data = build_process.run_bounded(describe_file, (str(path),), f"kiln-read {label}", build_process.READ,
                                         limits=limits, max_result_bytes=MAX_DESCRIPTION_BYTES)
        try:
            description = ModelDescription.from_json(data)
        except ValueError as e:
            raise kiln.BuildError(f"{build_process.READ.process} sent an unreadable description ({e})") from None
        if entry is not None:
            _write_entry(entry, description)
    with _memory_lock:
        _memory[key] = description
        while len(_memory) > MEMORY_ENTRIES:
            _memory.popitem(last=False)
    return description


def forget() -> None:
    """Drop the descriptions kept in memory (tests; the ones on disk stay)."""
    with _memory_lock:
        _memory.clear()


def _read_entry(entry: Path) -> ModelDescription | None:
    try:
        data = entry.read_bytes()
    except OSError:  # absent (the usual case), or unreadable: read the model instead
        return None
    try:
        return ModelDescription.from_json(data)
    except ValueError as e:  # damaged or of another format: read the model again, the write replaces it
        log.warning("model description %s is unusable (%s); reading the model again", entry, e)
        return None


def _write_entry(entry: Path, description: ModelDescription) -> None:
    """Atomically, as plans are written (a temporary file renamed into place; PlanCache removes stale temporary
    files of this folder too); failures only cost a later read."""
    try:
        write_atomically(entry, description.to_json(), entry.stem[:16])
    except OSError as e:  # a full or read-only cache must not stop the model from loading
        log.warning("cannot write model description %s: %s", entry, e)
