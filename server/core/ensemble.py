"""Triton ensembles: a model (platform "ensemble") whose steps run other loaded models as a DAG of named tensors.

An ensemble has no model file: its config declares its own inputs, outputs and max_batch_size, and
`ensemble_scheduling.step` lists the composing models with `input_map` (composing input -> ensemble tensor) and
`output_map` (composing output -> ensemble tensor). At load the config is checked on its own (every tensor written
once, every step input written or given, no cycle, every output written, nothing unused: Triton's rules and
texts), then against the composing models' completed configs (names, data types, shapes, batch sizes).

A request runs in the core's process on its event loop: each step starts once all its inputs exist, steps that do
not depend on each other run at the same time, and each one is an ordinary request to its composing model through
the core's own entry point (`StepRunner`), so that model's checks, scheduler, batcher and statistics apply.
Intermediates pass between steps as the arrays the steps returned (batch dims added or dropped as views), never
serialized. Steps whose outputs nobody asked for are not run.

A decoupled composing model makes the ensemble decoupled (`decoupled_steps`, Triton's decouple labels): it is then
served as a stream (`EnsembleVersion.submit_stream`), each response of a step feeding the steps after it once, as
Triton's ensemble scheduler does.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import time
from collections.abc import Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from server.protos import model_config_pb2

from . import request_io
from .decoupled import OnPart, StreamPart, is_decoupled
from .errors import ErrorKind, ServerError, invalid
from .model import ServedModel
from .model_config import ModelConfig
from .statistics import ExecutionTimes
from .types import CONFIG_TYPE_OF_DATATYPE, InferInput, InferRequest, InferResponse, RequestedOutput

#: how an ensemble runs one step: the core's inference entry point (a request to the composing model)
StepRunner = Callable[[InferRequest], Awaitable[InferResponse]]

LATEST = -1  # a step's model_version that means the composing model's latest ready version


@dataclass(frozen=True)
class EnsembleStep:
    """One step as the config states it; `inputs`/`outputs` pair the composing model's tensor with the ensemble's."""

    index: int
    model_name: str
    model_version: int
    inputs: tuple[tuple[str, str], ...]
    outputs: tuple[tuple[str, str], ...]

    @property
    def label(self) -> str:
        return f"step {self.index}, model '{self.model_name}'"


# -- the config on its own ----------------------------------------------------------------------------------------
def complete_ensemble_config(config: ModelConfig, name: str) -> ModelConfig:
    """A checked, completed copy of an ensemble's config (version policy defaulted); INVALID_ARGUMENT with
    Triton's text where it has one, naming the step and tensor, when the config cannot run."""
    config = ModelConfig.FromString(config.SerializeToString())
    if config.name and config.name != name:
        raise invalid(f"model '{name}': config names the model '{config.name}'; the directory name must match")
    config.name = name
    _check_ensemble_fields(config)
    ensemble_steps(config)
    if not config.HasField("version_policy"):
        config.version_policy.latest.num_versions = 1
    return config


def _check_ensemble_fields(config: ModelConfig) -> None:
    """What an ensemble must and must not set (Triton: model_config_utils.cc ValidateEnsembleSchedulingConfig)."""
    name = config.name
    if not config.HasField("ensemble_scheduling"):
        raise invalid(f"ensemble scheduling must be set for ensemble '{name}'")
    if config.instance_group:
        raise invalid(f"instance group should not be specified for ensemble '{name}'")
    if config.HasField("optimization"):
        raise invalid(f"optimization should not be specified for ensemble '{name}'")
    if config.model_warmup:
        raise invalid(f"model_warmup can not be specified for ensemble '{name}'")
    if config.max_batch_size < 0:
        raise invalid(f"model '{name}': max_batch_size must be >= 0, got {config.max_batch_size}")
    for role, tensors in (("input", config.input), ("output", config.output)):
        for tensor in tensors:
            if not tensor.data_type or not tensor.dims:
                raise invalid(f"ensemble '{name}': {role} '{tensor.name}' must specify 'data_type' and 'dims' (an "
                              "ensemble has no model to complete them from)")
    if not config.output:
        raise invalid(f"ensemble '{name}' must declare at least one output")


def ensemble_steps(config: ModelConfig) -> list[EnsembleStep]:
    """The steps in an order that runs every step after the ones it reads from; INVALID_ARGUMENT when the data
    flow is broken (Triton: BuildEnsembleGraph and the flow check after it)."""
    name = config.name
    if not config.ensemble_scheduling.step:
        raise invalid(f"must specify 'step' for ensemble '{name}'")
    inputs = {t.name for t in config.input}
    steps: list[EnsembleStep] = []
    writer: dict[str, int] = {}
    for index, step in enumerate(config.ensemble_scheduling.step):
        for field_name in ("model_name", "input_map", "output_map"):
            if not getattr(step, field_name):
                raise invalid(f"must specify '{field_name}' in step {index} of ensemble '{name}'")
        for tensor in step.output_map.values():
            if tensor in writer:
                raise invalid(f"ensemble tensor '{tensor}' can appear in an output map only once for ensemble "
                              f"'{name}' step {index} (step {writer[tensor]} writes it too)")
            if tensor in inputs:
                raise invalid(f"ensemble tensor '{tensor}' can appear in an output map only once for ensemble "
                              f"'{name}' step {index} (it is an input of the ensemble)")
            writer[tensor] = index
        steps.append(EnsembleStep(index, step.model_name, step.model_version, tuple(sorted(step.input_map.items())),
                                  tuple(sorted(step.output_map.items()))))
    read = {tensor for step in steps for _, tensor in step.inputs}
    for tensor in config.input:
        if tensor.name not in read:
            raise invalid(f"ensemble input '{tensor.name}' for ensemble '{name}' is not used")
    for step in steps:
        for model_input, tensor in step.inputs:
            if tensor not in writer and tensor not in inputs:
                raise invalid(f"ensemble tensor '{tensor}' is unused in ensemble '{name}': {step.label} reads it "
                              f"as input '{model_input}', but no step writes it and it is not an ensemble input")
    ordered = _dependency_order(steps, writer, name)
    outputs = {t.name for t in config.output}
    for tensor in config.output:
        if tensor.name not in writer and tensor.name not in inputs:
            raise invalid(f"ensemble output '{tensor.name}' for ensemble '{name}' is not used: no step writes it")
    for tensor, index in writer.items():
        if tensor not in read and tensor not in outputs:
            raise invalid(f"ensemble tensor '{tensor}' is unused in ensemble '{name}': step {index} writes it, but no "
                          "step reads it and it is not an ensemble output")
    return ordered


def _dependency_order(steps: list[EnsembleStep], writer: dict[str, int], name: str) -> list[EnsembleStep]:
    """Kahn's order of the steps by the tensors they read; the steps left over wait on each other: a cycle."""
    waits_on = {s.index: {writer[t] for _, t in s.inputs if t in writer} for s in steps}
    done: set[int] = set()
    ordered: list[EnsembleStep] = []
    while len(ordered) < len(steps):
        ready = [s for s in steps if s.index not in done and waits_on[s.index] <= done]
        if not ready:
            stuck = ", ".join(f"{s.index} ('{s.model_name}')" for s in steps if s.index not in done)
            raise invalid(f"ensemble '{name}' has a cycle: steps {stuck} wait on each other's outputs, so none can "
                          "run")
        ordered.extend(ready)
        done.update(s.index for s in ready)
    return ordered


def dependency_path(edges: dict[str, set[str]], start: str, target: str) -> list[str] | None:
    """A path start -> ... -> target through `edges` (ensemble -> the models its steps name), or None: a load
    that would close one is a cycle of ensembles, which would never finish loading nor running."""
    paths = collections.deque([[start]])
    seen = {start}
    while paths:
        path = paths.popleft()
        if path[-1] == target:
            return path
        for following in sorted(edges.get(path[-1], ())):
            if following not in seen:
                seen.add(following)
                paths.append([*path, following])
    return None


# -- the config against its composing models ---------------------------------------------------------------------
@dataclass(frozen=True)
class _TensorType:
    """An ensemble tensor's type as one side states it (Triton: ensemble_utils.cc TensorNode)."""

    model: str
    batching: bool
    data_type: str  # TYPE_INT32
    dims: tuple[int, ...]

    @property
    def full_dims(self) -> tuple[int, ...]:
        return (-1, *self.dims) if self.batching else self.dims


def _config_type(datatype: str) -> str:
    return CONFIG_TYPE_OF_DATATYPE.get(datatype, datatype)


def _dims_match(a: Iterable[int], b: Iterable[int]) -> bool:
    a, b = tuple(a), tuple(b)
    return len(a) == len(b) and all(x == y or x == -1 or y == -1 for x, y in zip(a, b))


def _check_consistent(known: _TensorType, other: _TensorType, ensemble: str, tensor: str) -> None:
    """Triton's ValidateTensorConsistency: same data type, and dims that agree (wildcards allowed), with or without
    the batch dim so a tensor may pass between a batching and a non-batching model."""
    prefix = f"in ensemble {ensemble}, ensemble tensor {tensor}: "
    if known.data_type != other.data_type:
        raise invalid(f"{prefix}inconsistent data type: {known.data_type} is inferred from model {known.model} "
                      f"while {other.data_type} is inferred from model {other.model}")
    if not _dims_match(known.dims, other.dims) and not _dims_match(known.full_dims, other.full_dims):
        raise invalid(f"{prefix}inconsistent shape: {list(known.full_dims)} is inferred from model {known.model} "
                      f"while {list(other.full_dims)} is inferred from model {other.model}")


def check_composing(config: ModelConfig, steps: list[EnsembleStep], models: dict[int, ServedModel]) -> None:
    """The steps against the models they run (`models[step.index]`, completed configs): every input mapped, only
    existing inputs and outputs named, data types and shapes consistent, batch sizes that fit (Triton:
    ensemble_utils.cc ValidateEnsembleConfig, its texts)."""
    name = config.name
    batching = config.max_batch_size > 0
    known: dict[str, _TensorType] = {}
    for tensor in [*config.input, *config.output]:
        dims = tuple(tensor.reshape.shape) if tensor.HasField("reshape") else tuple(tensor.dims)
        known[tensor.name] = _TensorType(name, batching, model_config_pb2.DataType.Name(tensor.data_type), dims)
    for step in steps:
        model = models[step.index]
        if 0 < model.max_batch_size < config.max_batch_size:
            raise invalid(f"ensemble {name} allows maximum batch size {config.max_batch_size}, but it contains model "
                          f"{step.model_name} which only allows maximum batch size to be {model.max_batch_size}")
        model_batching = model.max_batch_size > 0
        mapped = dict(step.inputs)
        for model_input, tensor in step.inputs:
            if model_input not in model.inputs:
                raise invalid(f"in ensemble {name}, ensemble tensor {tensor} is mapping to non-existing input "
                              f"{model_input} in model {step.model_name}")
        for model_input, spec in model.inputs.items():
            if model_input not in mapped:
                raise invalid(f"in ensemble {name}, input {model_input} in model {step.model_name} is not mapped to "
                              "any ensemble tensors")
            _meet(known, mapped[model_input], _TensorType(step.model_name, model_batching,
                                                          _config_type(spec.datatype), spec.dims), name)
        for model_output, tensor in step.outputs:
            output_spec = model.outputs.get(model_output)
            if output_spec is None:
                raise invalid(f"in ensemble {name}, ensemble tensor {tensor} is mapped from non-existing output "
                              f"{model_output} in model {step.model_name}")
            _meet(known, tensor, _TensorType(step.model_name, model_batching, _config_type(output_spec.datatype),
                                             output_spec.dims), name)


def decoupled_steps(name: str, steps: list[EnsembleStep], models: dict[int, ServedModel]) -> bool:
    """Whether a step of the ensemble is decoupled, which makes the ensemble decoupled (its later steps run once per
    response: ensemble_stream.py). Each decoupled step starts a label its outputs and their readers carry; a step
    whose inputs come from different labels is refused, with Triton's text (ensemble_utils.cc)."""
    labels: dict[str, int] = {}  # tensor -> label; ensemble inputs and what only they feed carry 0
    count = 0
    for step in steps:  # in dependency order: every input's writer came first
        seen = {labels.get(tensor, 0) for _, tensor in step.inputs}
        if len(seen) > 1:
            raise invalid(f"in ensemble {name}, step of model '{step.model_name}' receives inputs originated from "
                          "different decoupled models")
        label = seen.pop() if seen else 0
        if is_decoupled(models[step.index]):
            count += 1
            label = count
        for _, tensor in step.outputs:
            labels[tensor] = label
    return count > 0


def _meet(known: dict[str, _TensorType], tensor: str, side: _TensorType, ensemble: str) -> None:
    """Record what `side` says of `tensor`, or check it against what was said first."""
    if tensor in known:
        _check_consistent(known[tensor], side, ensemble, tensor)
    else:
        known[tensor] = side


def composing_model(ensemble: str, step: EnsembleStep, versions: dict[int, ServedModel]) -> ServedModel:
    """The loaded version of `step`'s model it would run now (its pinned version, else the latest);
    INVALID_ARGUMENT with Triton's text when that version is not loaded."""
    if step.model_version == LATEST:
        return versions[max(versions)]
    if step.model_version not in versions:
        raise invalid(f"ensemble '{ensemble}' depends on '{step.model_name}' whose required version "
                      f"{step.model_version} is not loaded (loaded: {sorted(versions)})")
    return versions[step.model_version]


# -- running -----------------------------------------------------------------------------------------------------
@dataclass
class _Tensor:
    """An ensemble tensor during one request: its data, and the batch size it carries (0: its writer does not
    batch), which decides whether a reader that batches differently gets a batch dim added or dropped."""

    datatype: str
    array: np.ndarray
    batch: int


@dataclass(frozen=True)
class _StepPlan:
    """A step with what it needs to know of its composing model at run time: whether it batches, its input dims."""

    step: EnsembleStep
    batching: bool
    input_dims: dict[str, tuple[int, ...]]

    def request(self, tensors: dict[str, _Tensor], parent: InferRequest) -> tuple[InferRequest, int]:
        """The step's request (the parent's id and parameters, such as priority and timeout, as Triton forwards
        them) and the batch size it carries."""
        inputs = []
        for model_input, tensor_name in self.step.inputs:
            tensor = tensors[tensor_name]
            array = _fit_batching(tensor.array, self.input_dims[model_input], self.batching, tensor.batch)
            inputs.append(InferInput(model_input, tensor.datatype, tuple(array.shape), array))
        batch = int(inputs[0].shape[0]) if self.batching and inputs and inputs[0].shape else 0
        version = "" if self.step.model_version == LATEST else str(self.step.model_version)
        request = InferRequest(self.step.model_name, inputs, version, id=parent.id,
                               outputs=[RequestedOutput(name) for name, _ in self.step.outputs],
                               parameters=dict(parent.parameters))
        return request, batch

    def take(self, response: InferResponse, tensors: dict[str, _Tensor], batch: int) -> None:
        """The step's outputs become the ensemble tensors its output_map names."""
        produced = {output.name: output for output in response.outputs}
        for model_output, tensor_name in self.step.outputs:
            output = produced[model_output]
            tensors[tensor_name] = _Tensor(output.datatype, output.data, batch)  # type: ignore[arg-type]


def _fit_batching(array: np.ndarray, dims: tuple[int, ...], batching: bool, batch: int) -> np.ndarray:
    """A tensor as a reader of the other batching kind takes it (Triton: ReshapeTensorDims), as a view: a
    batching reader gets a batch dim of 1 added to a non-batched tensor of its item shape; a non-batching reader
    gets a batch of 1 dropped unless the whole tensor already is its shape."""
    if batching == (batch != 0):
        return array
    if batching:
        return array[np.newaxis] if _dims_match(array.shape, dims) else array
    if batch == 1 and not _dims_match(array.shape, dims):
        return array[0]
    return array


class EnsembleVersion(ServedModel):
    """A loaded ensemble version: its completed config, the steps in dependency order, and how to run them."""

    def __init__(self, name: str, version: int, config: ModelConfig,
                 composing: dict[str, dict[int, ServedModel]]) -> None:
        super().__init__(name, version, config, labels={})
        self.steps = ensemble_steps(config)
        models = {step.index: composing_model(name, step, composing[step.model_name]) for step in self.steps}
        check_composing(config, self.steps, models)
        #: a decoupled step makes the ensemble decoupled (Triton sets model_transaction_policy, /config shows it)
        self.decoupled = decoupled_steps(name, self.steps, models)
        self.config.model_transaction_policy.decoupled = self.decoupled
        self._plans = [_StepPlan(step, models[step.index].max_batch_size > 0,
                                 {n: s.dims for n, s in models[step.index].inputs.items()}) for step in self.steps]

    @property
    def composing_names(self) -> set[str]:
        """The models this ensemble's steps run (unloading one makes the ensemble unavailable, as in Triton)."""
        return {step.model_name for step in self.steps}

    def _plans_for(self, requested: Collection[str]) -> list[_StepPlan]:
        """The steps some requested output depends on, in dependency order (Triton prunes the others too)."""
        needed = set(requested)
        kept = []
        for plan in reversed(self._plans):
            if any(tensor in needed for _, tensor in plan.step.outputs):
                kept.append(plan)
                needed.update(tensor for _, tensor in plan.step.inputs)
        return kept[::-1]

    async def run(self, inputs: dict[str, np.ndarray], batch: int, request: InferRequest,
                  requested: Collection[str], infer: StepRunner) -> dict[str, np.ndarray]:
        """Run the steps `requested` needs on checked `inputs` and return those outputs. A failing step fails the
        request with its error, prefixed "in ensemble '<name>', " as Triton does and its step named at the end;
        the steps still running are cancelled (queued ones leave their batcher's queue)."""
        carried = batch if self.max_batch_size > 0 else 0
        tensors = {name: _Tensor(self.inputs[name].datatype, array, carried) for name, array in inputs.items()}
        waiting = self._plans_for(requested)
        readers = collections.Counter(tensor for plan in waiting for _, tensor in plan.step.inputs)
        running: dict[asyncio.Future, tuple[_StepPlan, int]] = {}
        try:
            while waiting or running:
                ready = [p for p in waiting if all(t in tensors for _, t in p.step.inputs)]
                if len(ready) == 1 and not running:  # the only step that can run: awaited here, no task of its own
                    plan = ready[0]
                    waiting.remove(plan)
                    step_request, step_batch = plan.request(tensors, request)
                    self._release(plan, tensors, readers, requested)
                    try:
                        response = await infer(step_request)
                    except ServerError as e:
                        raise ServerError(e.kind, f"in ensemble '{self.name}', {e.message} ({plan.step.label})") \
                            from None
                    plan.take(response, tensors, step_batch)
                    continue
                for plan in ready:
                    waiting.remove(plan)
                    step_request, step_batch = plan.request(tensors, request)
                    running[asyncio.ensure_future(infer(step_request))] = (plan, step_batch)
                    self._release(plan, tensors, readers, requested)
                if not running:  # the load-time checks make this unreachable; never wait forever
                    raise invalid(f"in ensemble '{self.name}', unexpected deadlock, at least one output is not "
                                  "set while no more ensemble steps can be made")
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for future in done:
                    plan, step_batch = running.pop(future)
                    try:
                        response = future.result()
                    except ServerError as e:
                        raise ServerError(e.kind, f"in ensemble '{self.name}', {e.message} ({plan.step.label})") \
                            from None
                    plan.take(response, tensors, step_batch)
        finally:
            for future in running:
                future.cancel()
        return {name: tensors[name].array for name in requested}

    # -- a decoupled ensemble (a decoupled step): streamed ------------------------------------------------------
    def submit_stream(self, core: Any, request: InferRequest, on_part: OnPart) -> asyncio.Future | None:
        """`decoupled.submit_stream` for a decoupled ensemble: checked like any request, then its steps run as a
        task that sends a response whenever every requested output has a value of one iteration, and the final
        flag once no step is left running. Returns what to cancel to withdraw it (None when answered at once)."""
        started = time.perf_counter_ns()
        try:
            inputs, batch, requested = core._checked(self, request)
        except Exception as e:  # noqa: BLE001 - answered, as a request that never ran
            self.statistics.record_failure(time.perf_counter_ns() - started)
            on_part(StreamPart(error=e, final=True))
            return None
        task = asyncio.ensure_future(self._stream(core, inputs, batch, request, requested, on_part))
        task.add_done_callback(functools.partial(self._streamed, on_part=on_part, batch=batch, started=started))
        return task

    def _streamed(self, done: asyncio.Future, on_part: OnPart, batch: int, started: int) -> None:
        """The stream's steps are done: the final flag (or the error that ended them) and the statistics."""
        if done.cancelled():
            return  # the caller withdrew: it hears nothing more
        error = done.exception()
        if error is not None:
            self.statistics.record_failure(time.perf_counter_ns() - started)
            on_part(StreamPart(error=error, final=True))
            return
        self.statistics.record_success(batch, time.perf_counter_ns() - started, ExecutionTimes())
        self.statistics.record_execution(batch, ExecutionTimes())
        if not done.result():  # no answer carried the final flag
            on_part(StreamPart(final=True))

    async def _stream(self, core: Any, inputs: dict[str, np.ndarray], batch: int, request: InferRequest,
                      requested: list[RequestedOutput], on_part: OnPart) -> bool:
        """Triton's decoupled ensemble (ensemble_scheduler.cc): every response of a step gives its output tensors
        a value of the next iteration (per tensor, counted from 0; the ensemble inputs are iteration 0); a step
        runs once per iteration all its inputs have; a response of the ensemble goes out for an iteration every
        requested output has. Steps go through the core's stream entry (a step that is not decoupled answers once).
        The answer made when no step is left running carries the final flag, as Triton's does; True when one did
        (else the final flag goes alone)."""
        carried = batch if self.max_batch_size > 0 else 0
        plans = self._plans_for([o.name for o in requested])
        names = [o.name for o in requested]
        readers: dict[str, list[_StepPlan]] = collections.defaultdict(list)
        for plan in plans:
            for _, tensor in plan.step.inputs:
                readers[tensor].append(plan)
        values: dict[str, dict[int, _Tensor]] = collections.defaultdict(dict)
        unread: dict[tuple[str, int], int] = {}  # (tensor, iteration) -> readers still to take it (then dropped)

        def put(tensor: str, value: _Tensor) -> int:
            iteration = next_iteration[tensor]
            next_iteration[tensor] += 1
            values[tensor][iteration] = value
            unread[(tensor, iteration)] = len(readers.get(tensor, ())) + (tensor in names)
            return iteration

        def taken(tensor: str, iteration: int) -> None:
            key = (tensor, iteration)
            unread[key] -= 1
            if not unread[key]:  # every reader took it: a long stream keeps only what is still to be read
                del unread[key], values[tensor][iteration]

        next_iteration: collections.Counter[str] = collections.Counter()
        for name, array in inputs.items():
            put(name, _Tensor(self.inputs[name].datatype, array, carried))
        parts: asyncio.Queue[tuple[int, _StepPlan, int, StreamPart]] = asyncio.Queue()
        handles: dict[int, Any] = {}  # the steps still running, to cancel when the stream ends early
        began: set[tuple[int, int]] = set()  # (step index, iteration): each step runs once per iteration

        def start(plan: _StepPlan, iteration: int) -> None:
            began.add((plan.step.index, iteration))
            step_request, step_batch = plan.request({t: values[t][iteration] for _, t in plan.step.inputs}, request)
            for _, tensor in plan.step.inputs:
                taken(tensor, iteration)
            key = len(began)  # its parts come back with it (a final one ends the step)
            handles[key] = core.submit_stream(step_request, lambda part: parts.put_nowait((key, plan, step_batch, part)))

        def ready(plan: _StepPlan, iteration: int) -> bool:
            return ((plan.step.index, iteration) not in began
                    and all(iteration in values.get(t, {}) for _, t in plan.step.inputs))

        for plan in plans:
            if ready(plan, 0):
                start(plan, 0)
        try:
            while handles:
                key, plan, step_batch, part = await parts.get()
                if part.final:
                    handles.pop(key, None)
                if part.error is not None:
                    error = part.error if isinstance(part.error, ServerError) else ServerError(
                        ErrorKind.INTERNAL, f"{type(part.error).__name__}: {part.error}")
                    raise ServerError(error.kind, f"in ensemble '{self.name}', {error.message} ({plan.step.label})")
                if part.response is None:
                    continue  # a decoupled step's final flag alone
                produced = {output.name: output for output in part.response.outputs}
                updated = [(tensor, put(tensor, _Tensor(produced[model_output].datatype,
                                                        produced[model_output].data,  # type: ignore[arg-type]
                                                        step_batch)))
                           for model_output, tensor in plan.step.outputs
                           if model_output in produced]  # Triton too goes on when a response leaves one out
                for tensor, iteration in updated:
                    for reader in readers.get(tensor, []):
                        if ready(reader, iteration):
                            start(reader, iteration)
                complete = sorted({i for t, i in updated if t in names
                                   and all(i in values.get(name, {}) for name in names)})
                for index, iteration in enumerate(complete):  # the last answer carries the final flag when it can
                    outputs = [request_io.output(core.system_shm, self, o, values[o.name][iteration].array)
                               for o in requested]
                    for name in names:
                        taken(name, iteration)
                    final = not handles and index == len(complete) - 1
                    on_part(StreamPart(InferResponse(self.name, str(self.version), outputs, id=request.id),
                                       final=final))
                    if final:
                        return True
            return False
        finally:
            for handle in handles.values():
                if handle is not None:
                    handle.cancel()

    @staticmethod
    def _release(plan: _StepPlan, tensors: dict[str, _Tensor], readers: collections.Counter,
                 requested: Collection[str]) -> None:
        """Drop the tensors no step still to start reads (and nobody asked for): large intermediates go early."""
        for _, tensor in plan.step.inputs:
            readers[tensor] -= 1
            if readers[tensor] == 0 and tensor not in requested:
                tensors.pop(tensor, None)
