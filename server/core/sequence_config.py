"""Triton's `sequence_batching` config, read and checked once at load, and a request's sequence parameters.

What the sequence batcher (server/core/sequence.py) needs from a config: the strategy (direct or oldest) and its
knobs, how many sequence slots an instance has, the idle timeout, the control inputs it fills per batch row
(START / END / READY as a false-true pair of INT32, FP32 or BOOL; CORRID as the correlation ID in the control's
data type) and the implicit states it keeps per sequence (input read and output written by the model each step,
initial value at START). Checks and their texts are Triton's (model_config_utils.cc, sequence_batch_scheduler.cc),
plus Kiln's own against the ONNX graph, which Triton leaves to its backends: every control and state tensor must be
a graph input (or, for state outputs, output) of the right data type.

Control tensors have one element per batch row, shape [1] per item (Triton's); a row with no request in a direct
batch gets every control false and CORRID 0 (or "" for a string CORRID), as in Triton.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from engine_core.types import onnx_to_np
from server.protos import model_config_pb2

from .errors import invalid
from .model_config import SEQUENCE_IDLE_DEFAULT_US, ModelConfig
from .tensors import from_raw
from .types import DATATYPE_OF_CONFIG_TYPE, datatype_of_numpy, numpy_dtype

if TYPE_CHECKING:
    from .model_description import ModelDescription, TensorDescription

SequenceBatching = model_config_pb2.ModelSequenceBatching
Control = SequenceBatching.Control
#: data types a CORRID control may have (model_config_utils.cc)
CORRID_TYPES = ("TYPE_UINT64", "TYPE_INT64", "TYPE_UINT32", "TYPE_INT32", "TYPE_STRING")
#: folder of a model's initial state files (Triton's kInitialStateFolder)
INITIAL_STATE_FOLDER = "initial_state"
_FALSE_TRUE = {"int32_false_true": "INT32", "fp32_false_true": "FP32", "bool_false_true": "BOOL"}
_BOOL_KINDS = (Control.CONTROL_SEQUENCE_START, Control.CONTROL_SEQUENCE_END, Control.CONTROL_SEQUENCE_READY)

CorrelationId = int | str


@dataclass(frozen=True)
class BoolControl:
    """A START, END or READY control input: its tensor, data type and the values meaning false and true."""

    name: str
    datatype: str
    false: Any
    true: Any

    def column(self, values: list[bool], batched: bool) -> np.ndarray:
        """One element per batch row ([rows, 1]; [1] for a model that does not batch)."""
        array = np.array([self.true if v else self.false for v in values], dtype=numpy_dtype(self.datatype))
        return array.reshape(len(values), 1) if batched else array


@dataclass(frozen=True)
class CorridControl:
    """The CORRID control input: the sequence's correlation ID in the control's data type (an integer ID is
    truncated to a 32-bit type as Triton copies its low bytes; a string ID is a BYTES element)."""

    name: str
    datatype: str

    def column(self, ids: list[CorrelationId], batched: bool) -> np.ndarray:
        if self.datatype == "BYTES":
            array = np.array([str(i).encode() if i != 0 else b"" for i in ids], dtype=object)
        else:
            words = np.array([int(i) for i in ids], dtype=np.uint64)
            dtype = numpy_dtype(self.datatype)
            array = (words & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(dtype) if dtype.itemsize == 4 \
                else words.view(dtype)
        return array.reshape(len(ids), 1) if batched else array


@dataclass(frozen=True)
class StateSpec:
    """One implicit state: the model reads `input_name` and writes `output_name`; `initial` is its value at START
    (one item, with the batch dim of 1 when the model batches)."""

    input_name: str
    output_name: str
    datatype: str
    dims: tuple[int, ...]
    initial: np.ndarray


@dataclass(frozen=True)
class SequenceSettings:
    """The parts of `sequence_batching` the sequence batcher reads, checked and with Triton's defaults resolved."""

    model: str
    max_batch_size: int
    oldest: bool
    slots: int  # sequence slots per instance: max_batch_size (direct), max_candidate_sequences (oldest)
    idle_ns: int
    max_queue_delay_ns: int
    minimum_slot_utilization: float = 0.0  # direct
    preferred_sizes: tuple[int, ...] = ()  # oldest
    preserve_ordering: bool = False  # oldest: answers in arrival order across sequences
    start: BoolControl | None = None
    end: BoolControl | None = None
    ready: BoolControl | None = None
    corrid: CorridControl | None = None
    states: tuple[StateSpec, ...] = ()

    @property
    def batched(self) -> bool:
        return self.max_batch_size > 0

    @property
    def server_inputs(self) -> set[str]:
        """Inputs the batcher fills, which requests do not carry."""
        controls = {c.name for c in (self.start, self.end, self.ready, self.corrid) if c is not None}
        return controls | {s.input_name for s in self.states}

    def controls(self, rows: list[tuple[CorrelationId, bool, bool] | None]) -> dict[str, np.ndarray]:
        """The control tensors of one batch: per row (correlation ID, start, end) of its request, or None for a
        row without one (every control false, CORRID 0)."""
        tensors = {}
        for control, values in ((self.start, [r is not None and r[1] for r in rows]),
                                (self.end, [r is not None and r[2] for r in rows]),
                                (self.ready, [r is not None for r in rows])):
            if control is not None:
                tensors[control.name] = control.column(values, self.batched)
        if self.corrid is not None:
            tensors[self.corrid.name] = self.corrid.column([r[0] if r is not None else 0 for r in rows],
                                                           self.batched)
        return tensors

    def initial_states(self) -> dict[str, np.ndarray]:
        """Every state's value at START, by state input name (shared arrays: never written)."""
        return {s.input_name: s.initial for s in self.states}


@dataclass(frozen=True)
class SequenceRequest:
    """What one request says about its sequence: the correlation ID (0 or "" = none) and its flags."""

    corrid: CorrelationId
    start: bool
    end: bool


#: the request parameters that make a request a step of a sequence (Triton's names)
SEQUENCE_PARAMETERS = ("sequence_id", "sequence_start", "sequence_end")


def request_of(parameters: dict[str, Any]) -> SequenceRequest:
    """A request's `sequence_id`, `sequence_start`, `sequence_end` parameters (KServe JSON; gRPC int64_param /
    string_param / bool_param). A negative integer ID is the uint64 it stands for (gRPC carries uint64 IDs as
    int64_param, and Triton reads them back as uint64)."""
    corrid = parameters.get("sequence_id", 0)
    if isinstance(corrid, bool) or not isinstance(corrid, (int, str)):
        raise invalid(f"Unable to parse 'sequence_id': expected an unsigned integer or a string, got {corrid!r}")
    if isinstance(corrid, int):
        if not -(1 << 63) <= corrid < (1 << 64):
            raise invalid(f"Unable to parse 'sequence_id': {corrid} does not fit in 64 bits")
        corrid &= (1 << 64) - 1
    return SequenceRequest(corrid, _flag(parameters, "sequence_start"), _flag(parameters, "sequence_end"))


def _flag(parameters: dict[str, Any], name: str) -> bool:
    value = parameters.get(name, False)
    if not isinstance(value, bool):
        raise invalid(f"Unable to parse '{name}': expected a boolean, got {value!r}")
    return value


def check_corrid_type(request: SequenceRequest, settings: SequenceSettings) -> None:
    """A string ID for a numeric CORRID control, or the reverse: Triton's text (infer_request.cc
    ValidateCorrelationId)."""
    control = settings.corrid
    if control is None or request.corrid in (0, ""):
        return
    given = "BYTES" if isinstance(request.corrid, str) else "UINT64"
    if (given == "BYTES") != (control.datatype == "BYTES"):
        raise invalid(f"sequence batching control '{control.name}' data-type is '{given}', but model "
                      f"'{settings.model}' expects '{control.datatype}'")


def server_filled_inputs(config: ModelConfig) -> list[model_config_pb2.ModelInput]:
    """The inputs the sequence batcher fills, as config inputs (name, data type, per-item dims): control inputs
    ([1]) and state inputs (the state's dims). Profiles and batch-bucket warm-up cover them like client inputs.
    Reads the config as it is (checked or not): names without a data type are left out."""
    if not config.HasField("sequence_batching"):
        return []
    tensors = []
    for control_input in config.sequence_batching.control_input:
        for control in control_input.control[:1]:
            data_type = _control_config_type(control)
            if control_input.name and data_type:
                tensors.append(model_config_pb2.ModelInput(name=control_input.name, dims=[1],
                                                           data_type=model_config_pb2.DataType.Value(data_type)))
    for state in config.sequence_batching.state:
        if state.input_name and state.data_type != model_config_pb2.TYPE_INVALID:
            tensors.append(model_config_pb2.ModelInput(name=state.input_name, data_type=state.data_type,
                                                       dims=list(state.dims)))
    return tensors


def _control_config_type(control: Control) -> str:
    """The config data type ("TYPE_INT32") a control's tensor has ("" when the control does not say)."""
    if control.kind == Control.CONTROL_SEQUENCE_CORRID:
        return model_config_pb2.DataType.Name(control.data_type) if control.data_type else ""
    for field, datatype in _FALSE_TRUE.items():
        if getattr(control, field):
            return f"TYPE_{datatype}"
    return ""


# -- reading and checking a config --------------------------------------------------------------------------
def sequence_settings(config: ModelConfig, model: ModelDescription | None, directory: Path) -> SequenceSettings | None:
    """The settings of a completed config with `sequence_batching` (None without it), checked against the config
    and the ONNX graph (`model`; None for a Python model, which has none); INVALID_ARGUMENT with Triton's text (or
    Kiln's, for the graph) when they disagree."""
    if not config.HasField("sequence_batching"):
        return None
    batching, name = config.sequence_batching, config.name
    controls = {kind: _bool_control(batching, name, kind) for kind in _BOOL_KINDS}
    corrid = _corrid_control(batching, name)
    states = tuple(_state(state, config, directory) for state in _unique_states(batching.state))
    settings = SequenceSettings(name, config.max_batch_size, **_strategy(batching, config),
                                idle_ns=int(batching.max_sequence_idle_microseconds or SEQUENCE_IDLE_DEFAULT_US) * 1000,
                                start=controls[Control.CONTROL_SEQUENCE_START], end=controls[Control.CONTROL_SEQUENCE_END],
                                ready=controls[Control.CONTROL_SEQUENCE_READY], corrid=corrid, states=states)
    if model is not None:
        _check_against_graph(settings, config, model)
    return settings


def _strategy(batching: SequenceBatching, config: ModelConfig) -> dict[str, Any]:
    """The strategy's fields of `SequenceSettings`: slots per instance (max_batch_size, at least 1; oldest:
    max_candidate_sequences when set) and its batching knobs, checked with Triton's texts."""
    batch = max(1, config.max_batch_size)
    if batching.HasField("oldest"):
        oldest = batching.oldest
        _check_preferred(list(oldest.preferred_batch_size), config)
        return {"oldest": True, "slots": oldest.max_candidate_sequences or batch,
                "max_queue_delay_ns": int(oldest.max_queue_delay_microseconds) * 1000,
                "preferred_sizes": tuple(sorted(set(oldest.preferred_batch_size))),
                "preserve_ordering": bool(oldest.preserve_ordering)}
    direct = batching.direct
    utilization = float(direct.minimum_slot_utilization)
    if not 0.0 <= utilization <= 1.0:
        raise invalid(f"sequence batching minimum slot utilization must be in range (0.0, 1.0] for {config.name}")
    return {"oldest": False, "slots": batch, "max_queue_delay_ns": int(direct.max_queue_delay_microseconds) * 1000,
            "minimum_slot_utilization": utilization}


def _check_preferred(sizes: list[int], config: ModelConfig) -> None:
    for size in sizes:
        if size <= 0:
            raise invalid(f"sequence batching preferred batch size must be positive for {config.name}")
        if size > config.max_batch_size:
            raise invalid(f"sequence batching preferred batch size must be <= max batch size for {config.name}")


def _controls_of(batching: SequenceBatching, model: str, kind: int) -> list[tuple[str, Control]]:
    """(tensor name, control) for every control of `kind`; Triton's checks on names and repeats."""
    seen, found = set(), []
    for control_input in batching.control_input:
        if not control_input.name:
            raise invalid(f"sequence batching control tensor must have a name for {model}")
        if control_input.name in seen:
            raise invalid(f"sequence batching control tensor '{control_input.name}' is specified for multiple "
                          f"control kinds for {model}")
        seen.add(control_input.name)
        found += [(control_input.name, c) for c in control_input.control if c.kind == kind]
    if len(found) > 1:
        raise invalid(f"sequence batching specifies multiple {Control.Kind.Name(kind)} tensors for {model}")
    return found


def _bool_control(batching: SequenceBatching, model: str, kind: int) -> BoolControl | None:
    """START / END / READY: exactly one false-true pair of two entries (Triton's texts)."""
    found = _controls_of(batching, model, kind)
    if not found:
        return None
    name, control = found[0]
    kind_name = Control.Kind.Name(kind)
    given = [field for field in _FALSE_TRUE if len(getattr(control, field))]
    if not given:
        raise invalid(f"sequence batching must specify either 'int32_false_true', 'fp32_false_true' or "
                      f"'bool_false_true' for {kind_name} for {model}")
    if len(given) > 1:
        raise invalid(f"sequence batching specifies more than one from 'int32_false_true', 'fp32_false_true' and "
                      f"'bool_false_true' for {kind_name} for {model}")
    values = list(getattr(control, given[0]))
    if len(values) != 2:
        raise invalid(f"sequence batching control '{given[0]}' must have exactly 2 entries for {kind_name} for "
                      f"{model}")
    return BoolControl(name, _FALSE_TRUE[given[0]], values[0], values[1])


def _corrid_control(batching: SequenceBatching, model: str) -> CorridControl | None:
    found = _controls_of(batching, model, Control.CONTROL_SEQUENCE_CORRID)
    if not found:
        return None
    name, control = found[0]
    kind_name = Control.Kind.Name(Control.CONTROL_SEQUENCE_CORRID)
    if any(len(getattr(control, field)) for field in _FALSE_TRUE):
        raise invalid(f"sequence batching must not specify either 'int32_false_true', 'fp32_false_true' or "
                      f"'bool_false_true' for {kind_name} for {model}")
    if model_config_pb2.DataType.Name(control.data_type) not in CORRID_TYPES:
        raise invalid(f"unexpected data type for control {kind_name} for {model}. Allowed data types are "
                      "TYPE_UINT64, TYPE_INT64, TYPE_UINT32, TYPE_INT32 and TYPE_STRING")
    return CorridControl(name, DATATYPE_OF_CONFIG_TYPE[model_config_pb2.DataType.Name(control.data_type)])


def _unique_states(states) -> list[SequenceBatching.State]:
    """Triton ignores a state whose input or output name repeats an earlier one (with a warning); Kiln refuses it,
    since the repeat would otherwise do nothing."""
    inputs, outputs = set(), set()
    for state in states:
        if state.input_name in inputs:
            raise invalid(f"State input name '{state.input_name}' specified more than once.")
        if state.output_name in outputs:
            raise invalid(f"state output name '{state.output_name}' specified more than once")
        inputs.add(state.input_name)
        outputs.add(state.output_name)
    return list(states)


def _state(state: SequenceBatching.State, config: ModelConfig, directory: Path) -> StateSpec:
    """One state with its initial value: initial_state's zeros or file, else zeros with variable dims as 1
    (Triton leaves that memory uninitialised; zeros make it deterministic)."""
    if not state.input_name or not state.output_name:
        raise invalid(f"model '{config.name}': a sequence batching state needs input_name and output_name")
    if state.data_type == model_config_pb2.TYPE_INVALID:
        raise invalid(f"model '{config.name}': sequence batching state '{state.input_name}' needs a data_type")
    datatype = DATATYPE_OF_CONFIG_TYPE[model_config_pb2.DataType.Name(state.data_type)]
    if len(state.initial_state) > 1:
        raise invalid(f"initial_state field for state input '{state.input_name}' must contain exactly one or zero "
                      f"element. Found '{len(state.initial_state)}' elements.")
    if state.initial_state:
        item = _initial_value(state, state.initial_state[0], datatype, directory)
    elif datatype == "BYTES":
        item = np.full([1 if d == -1 else d for d in state.dims], b"", dtype=object)
    else:
        item = np.zeros([1 if d == -1 else d for d in state.dims], dtype=numpy_dtype(datatype))
    initial = item[None] if config.max_batch_size > 0 else item
    initial.flags.writeable = False
    return StateSpec(state.input_name, state.output_name, datatype, tuple(state.dims), initial)


def _initial_value(state: SequenceBatching.State, initial: SequenceBatching.InitialState, datatype: str,
                   directory: Path) -> np.ndarray:
    """Triton's checks and texts (sequence_batch_scheduler.cc GenerateInitialStateData)."""
    name = state.input_name
    if initial.data_type != state.data_type:
        raise invalid(f"The data type used for 'initial_state' field of state '{name}' does not match the state "
                      "data type.")
    if not initial.name:
        raise invalid(f"Field 'name' must be set when using initial_state for state input '{name}'.")
    if len(initial.dims) != len(state.dims):
        raise invalid(f"Number of dimensions in 'initial_state' doesn't match the size of 'state' dimensions for "
                      f"state input '{name}'. {len(initial.dims)} != {len(state.dims)}")
    for given, declared in zip(initial.dims, state.dims):
        if given == -1:
            raise invalid(f"'initial_state' field for state input name '{name}' contains variable dimensions.")
        if declared != -1 and given != declared:
            raise invalid(f"'initial_state' dim for input name '{name}' doesn't match 'state' dim description. "
                          f"{given} != {declared}")
    shape = tuple(initial.dims)
    which = initial.WhichOneof("state_data")
    if which == "zero_data":
        if datatype == "BYTES":
            return np.full(shape, b"", dtype=object)
        return np.zeros(shape, dtype=numpy_dtype(datatype))
    if which == "data_file":
        folder = (directory / INITIAL_STATE_FOLDER).resolve()
        path = (folder / initial.data_file).resolve()
        if not path.is_relative_to(folder) or not path.is_file():
            raise invalid(f"initial_state data file '{initial.data_file}' of state input '{name}' is not a file in "
                          f"{folder}")
        data = path.read_bytes()
        needed = math.prod(shape) * numpy_dtype(datatype).itemsize
        if datatype != "BYTES" and len(data) < needed:
            raise invalid(f"initial_state setting expects {needed} bytes, but the data provided from "
                          f"{initial.data_file}only has {len(data)} bytes.")
        return from_raw(data if datatype == "BYTES" else data[:needed], datatype, shape)
    raise invalid(f"initial_state setting expects state'{name}' to have state_data set")


def _check_against_graph(settings: SequenceSettings, config: ModelConfig, model: ModelDescription) -> None:
    """Every control and state input is a graph input, every state output a graph output, of the data type the
    config gives it (model_config.complete_config has made sure none is a client input too)."""
    inputs = {v.name: v for v in model.inputs}
    outputs = {v.name: v for v in model.outputs}
    expected = [(c.name, c.datatype, "control input") for c in (settings.start, settings.end, settings.ready,
                                                                 settings.corrid) if c is not None]
    expected += [(s.input_name, s.datatype, "state input") for s in settings.states]
    for name, datatype, role in expected:
        _check_graph_tensor(config.name, inputs, name, datatype, role, "input")
    for control in (settings.start, settings.end, settings.ready, settings.corrid):
        if control is not None:
            _check_control_shape(config, inputs[control.name])
    for state in settings.states:
        _check_graph_tensor(config.name, outputs, state.output_name, state.datatype, "state output", "output")


def _check_control_shape(config: ModelConfig, value: TensorDescription) -> None:
    """A control input takes one element per request: [batch, 1], or [1] for a model without a batch dim."""
    if value.dims is None:
        return
    dims = list(value.dims)
    rank = 2 if config.max_batch_size > 0 else 1
    if len(dims) != rank or dims[-1] not in (1, -1):
        expected = "[batch, 1]" if rank == 2 else "[1]"
        raise invalid(f"model '{config.name}': sequence batching control input '{value.name}' has shape {dims} in "
                      f"the model; the server feeds it {expected}, one element per request")


def _check_graph_tensor(model: str, values: dict[str, TensorDescription], name: str, datatype: str, role: str,
                        kind: str) -> None:
    value = values.get(name)
    if value is None:
        raise invalid(f"model '{model}': sequence batching {role} '{name}' is not an {kind} of the ONNX graph "
                      f"({kind}s: {sorted(values)})")
    actual = datatype_of_numpy(onnx_to_np(value.elem_type or 0))  # 0: not a tensor, as the graph had it
    if actual != datatype:
        raise invalid(f"model '{model}': sequence batching {role} '{name}' is {datatype} in the config, but "
                      f"{actual} in the model")
