"""One loaded model version: build from ONNX + config, check requests against its config, run, classify.

Loading (`load_model_version`) is blocking and runs in a background thread: the ONNX graph's inputs and outputs
(read by a bounded child process, server/core/model_description.py) -> completed config -> optimization profile
(batch 1..max_batch_size, other dims from the config) -> plan (built by a bounded child) -> engine -> one execution
context per instance. The server process itself never parses the model file. Requests are checked against the
completed config, so the client sees Triton's messages about shapes and datatypes, not engine internals.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path
from typing import Any

import numpy as np

import engine_core as kiln
from engine_core import compat
from engine_core.ops import TensorInfo
from engine_core.passes import infer_shapes
from server.plan_cache import build_description, cache_key, files_digest, server_cache, target_arch
from server.protos import model_config_pb2
from server.repository import ModelSource

from . import build_process, execution, executor, model_description, placement, warmup
from .adaptive import ProfileRanges, ShapeHistogram, variable_dims
from .batcher import BatchingSettings, DynamicBatcher, Padding
from .errors import invalid
from .latency import new_recorder
from .model_config import (
    ModelConfig,
    bool_parameter,
    complete_config,
    complete_outputs_from_engine,
    datatype_of,
    model_shape,
)
from .placement import Placement
from .scheduler import INLINE_BELOW_NS, DirectScheduler, Executor, Scheduler, Workers
from .sequence import sequence_batcher
from .sequence_config import SequenceSettings, sequence_settings, server_filled_inputs
from .statistics import ExecutionTimes, ModelStatistics
from .types import datatype_of_numpy, numpy_dtype

# The most a dim the config leaves variable (-1, other than the batch dim) may take. Triton caps nothing; a CPU
# plan runs numpy on the actual shapes, so its profile's max only bounds what is accepted and there it is the
# largest extent a 32-bit index holds (TensorRT's Dims, Triton's int32 Content-Length). A CUDA plan sizes each
# execution context's activation arena for the profile's max shapes (backends/cuda/runner.py), so on CUDA the
# max stays at CUDA_DYNAMIC_DIM_MAX; a config that needs more names the dim (fixed dims are taken as given).
DYNAMIC_DIM_MAX = (1 << 31) - 1
CUDA_DYNAMIC_DIM_MAX = 4096


@dataclass(frozen=True)
class TensorSpec:
    """One input or output as the config declares it (per item, without the batch dim)."""

    name: str
    datatype: str
    dims: tuple[int, ...]
    model_dims: tuple[int, ...]  # reshape.shape when the config has one: what the engine sees per item
    optional: bool = False  # an input a request may leave out (`optional: true`; config_fields says for which models)

    def metadata(self, max_batch_size: int) -> dict[str, Any]:
        shape = [-1, *self.dims] if max_batch_size > 0 else list(self.dims)
        return {"name": self.name, "datatype": self.datatype, "shape": shape}


def _specs(tensors) -> dict[str, TensorSpec]:
    return {t.name: TensorSpec(t.name, datatype_of(t), tuple(t.dims), tuple(model_shape(t)),
                               bool(getattr(t, "optional", False))) for t in tensors}


class ServedModel:
    """What every served version has, whether it runs a plan (`ModelVersion`) or other models (an ensemble,
    server/core/ensemble.py): the completed config, I/O specs and statistics, and the request checks and output
    shaping in the config's terms, so both answer malformed requests with the same messages."""

    #: outputs are converted to the config's data type (a Python model's go out as the model made them, as Triton)
    casts_outputs = True

    def __init__(self, name: str, version: int, config: ModelConfig, labels: dict[str, list[str]]) -> None:
        self.name = name
        self.version = version
        self.config = config
        self.labels = labels
        self.inputs = _specs(config.input)
        self.outputs = _specs(config.output)
        self.max_batch_size = config.max_batch_size
        # its model_metrics sets the buckets of its histograms (server/core/latency.py)
        self.statistics = ModelStatistics(name, str(version), latencies=new_recorder(config.model_metrics))

    #: runs its jobs: set by the versions that run them (ModelVersion, PythonVersion); an ensemble has none
    scheduler: Scheduler

    def check_inputs(self, arrays: dict[str, Any], datatypes: dict[str, str]) -> tuple[dict[str, np.ndarray], int]:
        """Validate request inputs against the config; returns engine-ready arrays and the batch size.

        Every error names the input and says what was expected, in the config's terms.
        """
        unknown = sorted(set(arrays) - set(self.inputs))
        if unknown:
            raise invalid(f"unexpected inference input {unknown} for model '{self.name}' "
                          f"(inputs: {sorted(self.inputs)})")
        missing = sorted(name for name, spec in self.inputs.items() if name not in arrays and not spec.optional)
        if missing:
            required = sum(not spec.optional for spec in self.inputs.values())
            wanted = (f"{required} inputs" if required == len(self.inputs) else  # Triton's words for optional ones
                      f"number of inputs between {required} and {len(self.inputs)}")
            raise invalid(f"expected {wanted} but got {len(arrays)} inputs for model '{self.name}': "
                          f"missing {missing}")
        batch_sizes = set()
        ready: dict[str, np.ndarray] = {}
        for name, spec in self.inputs.items():
            if name not in arrays:  # an optional input this request leaves out
                continue
            array, datatype = arrays[name], datatypes[name]
            if datatype != spec.datatype:
                raise invalid(f"inference input '{name}' data-type is '{datatype}', but model '{self.name}' "
                              f"expects '{spec.datatype}'")
            shape = tuple(array.shape)
            item_shape = shape
            if self.max_batch_size > 0:
                if not shape or not 1 <= shape[0] <= self.max_batch_size:
                    raise invalid(f"inference input '{name}' has shape {list(shape)}: the first dim is the batch "
                                  f"size and must be 1..{self.max_batch_size} for model '{self.name}'")
                batch_sizes.add(shape[0])
                item_shape = shape[1:]
            if not _matches(item_shape, spec.dims):
                expected = [-1, *spec.dims] if self.max_batch_size > 0 else list(spec.dims)
                raise invalid(f"unexpected shape for input '{name}' for model '{self.name}'. Expected "
                              f"{expected}, got {list(shape)}")
            if spec.model_dims != spec.dims:
                lead = shape[:1] if self.max_batch_size > 0 else ()
                array = _reshaped(array, lead + _resolve_reshape(spec.model_dims, item_shape, name))
            ready[name] = array
        if len(batch_sizes) > 1:
            raise invalid(f"inputs of model '{self.name}' disagree on the batch size: {sorted(batch_sizes)}")
        batch = batch_sizes.pop() if batch_sizes else 1
        return ready, batch

    def check_outputs(self, names: list[str]) -> None:
        unknown = [n for n in names if n not in self.outputs]
        if unknown:
            raise invalid(f"unexpected inference output {unknown} for model '{self.name}' "
                          f"(outputs: {sorted(self.outputs)})")

    def shape_output(self, name: str, array: np.ndarray) -> np.ndarray:
        """The engine's output in the config's terms: dtype of its datatype (unless `casts_outputs` is off), reshape
        undone."""
        spec = self.outputs[name]
        array = np.asarray(array)
        if spec.model_dims != spec.dims:
            lead = array.shape[:1] if self.max_batch_size > 0 else ()
            array = array.reshape(lead + _resolve_reshape(spec.dims, array.shape[len(lead):], name))
        dtype = numpy_dtype(spec.datatype)
        return array if array.dtype == dtype or not self.casts_outputs else array.astype(dtype)

    def classify(self, name: str, array: np.ndarray, k: int) -> np.ndarray:
        """Top-k classes per batch item as BYTES "score:index[:label]" (Triton's classification extension)."""
        if k <= 0:
            raise invalid(f"classification count for output '{name}' must be positive, got {k}")
        if array.dtype == object or array.dtype == np.bool_:
            raise invalid(f"output '{name}' is {datatype_of_numpy(array.dtype)}; classification needs numbers")
        batched = self.max_batch_size > 0
        scores = array.reshape(array.shape[0], -1) if batched else array.reshape(1, -1)
        k = min(k, scores.shape[1])
        order = np.argsort(-scores.astype(np.float64), axis=1, kind="stable")[:, :k]
        top = np.take_along_axis(scores, order, axis=1)
        labels = self.labels.get(name, [])
        result = np.empty(order.shape, dtype=object)
        for row, (indices, values) in enumerate(zip(order, top)):
            result[row] = [_class_entry(float(v), int(i), labels) for v, i in zip(values, indices)]
        return result if batched else result.reshape(k)

    def metadata(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "versions": [str(self.version)],
            "platform": self.config.platform or self.config.backend,
            "inputs": [s.metadata(self.max_batch_size) for s in self.inputs.values()],
            "outputs": [s.metadata(self.max_batch_size) for s in self.outputs.values()],
        }

    def close(self) -> None:
        """Release what the version holds (nothing here)."""


class ModelVersion(ServedModel):
    """A ready model version built from a plan: engine, execution contexts, scheduler."""

    def __init__(self, name: str, version: int, config: ModelConfig, engine: kiln.CudaEngine,
                 labels: dict[str, list[str]], sequence: SequenceSettings | None = None,
                 remote: bool = False, placements: Sequence[Placement] | None = None,
                 device_count: int = 0) -> None:
        super().__init__(name, version, config, labels)
        self.engine = engine
        self.sequence = sequence  # the sequence batcher's settings (None: not a sequence model)
        self.plan_origin = "built"  # or "cache hit" / "rebuilt (...)": how the plan was obtained
        self.build_seconds = 0.0  # how long building the plan took; 0.0 when it came from the plan cache
        self.source: ModelSource | None = None  # what it was built from, so it can be rebuilt (adaptive profiles)
        self.requested_config: ModelConfig | None = None
        self.profile_rebuilds = 0  # plans swapped in by adaptive profiles since the version was loaded
        self.traffic_at_fit = 0  # traffic.requests when profiles were last fitted
        self._restarts_before = 0  # worker restarts of the plans this one replaced
        batched = config.max_batch_size > 0
        #: output shapes per job before it runs: CUDA shm outputs and the batcher's padding
        self.output_shapes = ShapeOracle(engine).output_shapes
        self.traffic = ShapeHistogram(variable_dims(_profile_ranges(config, max(config.max_batch_size, 1)), batched))
        count = sum(group.count for group in config.instance_group) or 1
        placements = list(placements or [Placement(None, count)])
        #: the executor processes its executions run in, one per device (`remote`: the engine is then only described
        #: here); empty when they run in this process
        self.executors = (_start_executors(f"model '{name}' version {version}", engine, config.SerializeToString(),
                                           placements, device_count) if remote else [])
        contexts: list[object] = (_interleaved([e.lanes for e in self.executors]) if self.executors
                                  else [engine.create_execution_context() for _ in range(count)])
        #: runs one job on a context: padded to its batch bucket on CUDA models that batch (execution.py)
        self.execute = execution.execute_bucketed if _bucketed(config, engine) else execution.execute
        try:
            self.scheduler: Scheduler = _scheduler(config, contexts, f"kiln-{name}-{version}",
                                                   self._record_execution, engine, self.execute, self.output_shapes,
                                                   sequence, remote)
        except BaseException:
            self._close_executors()
            raise
        if self.executors:
            self.workers.on_retire = self._close_executors  # once the scheduler's last execution returned

    def _close_executors(self) -> None:
        for process in self.executors:
            process.close()

    def warm_up(self, directory: Path) -> None:
        """Bind and capture every batch bucket, then run the config's model_warmup samples, on every instance
        (blocking: part of loading). Raises ServerError naming a sample that does not fit the model."""
        if self.executors:  # each executor binds the buckets itself (executor_main.py); one lane per context
            lanes = [lane for e in self.executors for lane in e.lanes[::len(e.lanes) // e.instances]]
            warmup.run_model_warmup(self, lanes, directory)
            return
        contexts = list(dict.fromkeys(self.workers.initial))  # a pipelined context is in the pool twice
        warmup.warm_up_buckets(self.config, contexts, self.engine)
        warmup.run_model_warmup(self, contexts, directory)
        warmup.prime_inline(self, contexts)

    def _record_execution(self, batch_size: int, times: ExecutionTimes) -> None:
        """Executions go to whatever statistics this version has now (a rebuilt plan adopts its predecessor's)."""
        self.statistics.record_execution(batch_size, times)

    @property
    def workers(self) -> Workers:
        return self.scheduler.workers  # type: ignore[attr-defined]

    @property
    def worker_restarts(self) -> int:
        """Execution contexts replaced after a fault, over this version's life (metrics)."""
        return self._restarts_before + self.workers.restarts

    @property
    def profiles_matter(self) -> bool:
        """Whether profiles fitted to traffic can pay off: on the GPU (kernels and graphs per profile), or when the
        batcher pads (requests are padded only within a profile). The CPU backend runs numpy on actual shapes,
        so without padding a rebuild would buy nothing. Never for a sequence model: a swapped-in plan would start
        without its live sequences."""
        return bool(self.traffic.counts) and self.sequence is None and (
            self.engine.backend == "cuda" or getattr(self.scheduler, "padding", None) is not None)

    def profile_ranges(self) -> ProfileRanges:
        """The base profile (every dim's full range) adaptive profiles are fitted within."""
        return _profile_ranges(self.config, max(self.max_batch_size, 1))

    def current_profiles(self) -> list[ProfileRanges]:
        return [{name: tuple(list(s) for s in shapes) for name, shapes in profile.items()}  # type: ignore[misc]
                for profile in self.engine.plan.profiles]

    def adopt(self, old: ModelVersion) -> None:
        """Take over `old`'s statistics, traffic and counters: this is the same version on a rebuilt plan."""
        self.statistics = old.statistics
        self.traffic.adopt(old.traffic)
        self._restarts_before = old.worker_restarts
        self.profile_rebuilds = old.profile_rebuilds + 1

    def engine_output_dtype(self, name: str) -> np.dtype:
        """The dtype the engine produces for output `name` (before `shape_output` converts it)."""
        return np.dtype(kiln.nptype(self.engine.get_tensor_dtype(name)))

    def close(self) -> None:
        self.scheduler.close()


def _scheduler(config: ModelConfig, contexts: list[object], thread_name: str, record, engine,
               execute: Executor, output_shapes, sequence: SequenceSettings | None = None,
               remote: bool = False) -> Scheduler:
    """The sequence batcher for a sequence model (`sequence`); the dynamic batcher when the config asks for it
    and the model batches; else one job per execution (`execute`). Each replaces a faulted context with a fresh
    one from `engine` (`remote`: the executor process replaces its own). `output_shapes`: the version's shape
    oracle, which padding needs too."""
    label = f"model '{config.name}'"
    pad = pad_batch(config)  # checked first: a model that cannot pad must not load with the parameter set
    timeout_s = execution_timeout_s(config)
    execute_parts = functools.partial(execution.execute_parts, bucketed=_bucketed(config, engine))
    create = None if remote else engine.create_execution_context
    if sequence is not None:
        scheduler: Scheduler = sequence_batcher(contexts, execute, thread_name, sequence, record,
                                                create_context=create, execute_parts=execute_parts)
    elif config.HasField("dynamic_batching") and config.max_batch_size > 0:
        settings = BatchingSettings.from_config(config.dynamic_batching, config.max_batch_size, config.name)
        padding = Padding(output_shapes, _bucket(engine)) if pad else None
        on_loop = (functools.partial(execution.execute_parts_async, bucketed=_bucketed(config, engine))
                   if remote and executor.loop_io() else None)  # executor I/O on the event loop (executor.py)
        scheduler = DynamicBatcher(_lanes(contexts), execute, thread_name, settings, record,
                                   create_context=create, padding=padding, execute_parts=execute_parts,
                                   execute_parts_async=on_loop)
    else:
        scheduler = DirectScheduler(_lanes(contexts), execute, thread_name, record,
                                    create_context=create, execute_parts=execute_parts)
    workers = scheduler.workers  # type: ignore[attr-defined]
    workers.label, workers.timeout_s = label, timeout_s
    if engine.backend == "cpu" and timeout_s is None and not remote:  # an inline one could not be abandoned
        workers.inline_below_ns = INLINE_BELOW_NS
    return scheduler


def _start_executors(label: str, engine: kiln.CudaEngine, config_bytes: bytes, placements: list[Placement],
                     device_count: int) -> list[executor.ExecutorProcess]:
    """One executor process per placement, started together (each loads the plan and binds every bucket on its
    own GPU); if one fails, the others are stopped and the first failure is raised."""
    def start(place: Placement) -> executor.ExecutorProcess:
        where = "" if place.device is None else f" on GPU {place.device}"
        return executor.ExecutorProcess(label + where, engine, config_bytes, place.count, place.device, device_count)

    def stop(processes: list[executor.ExecutorProcess]) -> None:
        for process in processes:
            process.close()

    return placement.start_all([functools.partial(start, place) for place in placements], stop,
                               "kiln-executor-start")


def _interleaved(lanes: Sequence[Sequence[object]]) -> list[object]:
    """Every executor's lanes, alternating between executors (GPUs), so that the scheduler's free list, which
    hands out the lane freed last, spreads a burst over the GPUs instead of filling one first."""
    return [lane for group in zip_longest(*lanes) for lane in group if lane is not None]


def _lanes(contexts: list[object]) -> list[object]:
    """The scheduler's workers: each instance's context as many times as it runs at once. A CUDA context runs
    two (`ExecutionContext.concurrent_runs`): one worker gathers the next batch and copies out the last while
    the other's run is on the device, as Triton's TensorRT backend overlaps an instance's batches. The sequence
    batcher keeps one worker per context (a sequence's state lives in its slot of one context's batch)."""
    return [context for context in contexts for _ in range(getattr(context, "concurrent_runs", 1))]


def _bucketed(config: ModelConfig, engine: kiln.CudaEngine) -> bool:
    """CUDA models that batch run at bucketed batch sizes (execution.py says why)."""
    return engine.backend == "cuda" and config.max_batch_size > 0


# Model config parameter: how long one execution may run, in milliseconds, e.g. parameters { key:
# "kiln_execution_timeout_ms" value { string_value: "5000" } }. Past it the requests it was running get
# UNAVAILABLE and its worker is out of service until the execution returns (a stuck plugin or driver call cannot
# be interrupted safely); the other workers keep serving. Unset: no limit.
EXECUTION_TIMEOUT_MS = "kiln_execution_timeout_ms"


def with_default_execution_timeout(config: ModelConfig, milliseconds: float | None) -> None:
    """Give ``config`` the server's default (``--execution-timeout-ms``) unless it sets its own: the model config
    API then shows the limit a model runs under."""
    if milliseconds and EXECUTION_TIMEOUT_MS not in config.parameters:
        config.parameters[EXECUTION_TIMEOUT_MS].string_value = f"{milliseconds:g}"


def execution_timeout_s(config: ModelConfig) -> float | None:
    """The config's execution timeout in seconds (None: none); anything but a positive number of milliseconds is
    INVALID_ARGUMENT naming the model."""
    parameter = config.parameters.get(EXECUTION_TIMEOUT_MS)
    text = parameter.string_value.strip() if parameter is not None else ""
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise invalid(f"model '{config.name}': parameter {EXECUTION_TIMEOUT_MS} must be a positive number of "
                      f"milliseconds, got '{parameter.string_value}'")
    return value / 1000


# Model config parameter: "true" lets the dynamic batcher pad requests of different shapes into one batch.
PAD_BATCH = "kiln_pad_batch"


def pad_batch(config: ModelConfig) -> bool:
    """Whether the config turns padding on; anything but true/false is INVALID_ARGUMENT naming the model."""
    if not bool_parameter(config, PAD_BATCH, default=False):
        return False
    if config.max_batch_size <= 0 or not config.HasField("dynamic_batching"):
        raise invalid(f"model '{config.name}': {PAD_BATCH} needs dynamic_batching and max_batch_size > 0")
    return True


# Model config parameter: the engine precision, e.g. parameters { key: "kiln_precision" value { string_value:
# "fp16" } }. Unset: the engine's default (as a new BuilderConfig: TF32 tensor cores allowed for fp32 math);
# fp32: strict fp32 (TF32 cleared); tf32; fp16 / bf16 (reduced precision with fp32 I/O and accumulation, TF32 for
# the layers that stay fp32).
PRECISION = "kiln_precision"
_PRECISION_FLAGS = {"fp32": (), "tf32": (kiln.BuilderFlag.TF32,),
                    "fp16": (kiln.BuilderFlag.FP16, kiln.BuilderFlag.TF32),
                    "bf16": (kiln.BuilderFlag.BF16, kiln.BuilderFlag.TF32)}
#: the flags `kiln_precision` decides, set or cleared; a builder config's other flags are left alone
_PRECISION_MANAGED = (kiln.BuilderFlag.FP16, kiln.BuilderFlag.BF16, kiln.BuilderFlag.TF32)


def precision_flags(config: ModelConfig) -> tuple[kiln.BuilderFlag, ...]:
    """The precision flags the config's `kiln_precision` asks for (the others of _PRECISION_MANAGED are cleared);
    unset, those a new BuilderConfig has, so the server builds what the engine would. An unknown value is
    INVALID_ARGUMENT naming the model."""
    parameter = config.parameters.get(PRECISION)
    text = parameter.string_value.strip().lower() if parameter is not None else ""
    if text == "":
        default = kiln.BuilderConfig("cpu")
        return tuple(flag for flag in _PRECISION_MANAGED if default.get_flag(flag))
    if text not in _PRECISION_FLAGS:
        raise invalid(f"model '{config.name}': parameter {PRECISION} must be one of "
                      f"{', '.join(_PRECISION_FLAGS)}, got '{parameter.string_value}'")
    return _PRECISION_FLAGS[text]


def apply_precision(config: ModelConfig, builder_config: kiln.BuilderConfig) -> None:
    """Make ``builder_config``'s precision flags exactly those of `kiln_precision`: setting alone cannot give
    strict fp32, since a new config has TF32 set."""
    wanted = set(precision_flags(config))
    for flag in _PRECISION_MANAGED:
        if flag in wanted:
            builder_config.set_flag(flag)
        else:
            builder_config.clear_flag(flag)


class ShapeOracle:
    """Output shapes for given input shapes, from the plan's shape inference (no execution), cached: what the
    batcher cuts padded outputs back to. None when inference cannot tell (data-dependent or failing shapes)."""

    CACHE_SIZE = 4096

    def __init__(self, engine: kiln.CudaEngine) -> None:
        self._graph = engine.plan.graph
        self._dtypes = {v.name: v.dtype for v in self._graph.inputs}
        self._outputs = list(self._graph.output_names)
        self._cache: dict[tuple, dict[str, tuple[int, ...]] | None] = {}
        self._lock = threading.Lock()

    def output_shapes(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]] | None:
        key = tuple(sorted(shapes.items()))
        with self._lock:
            if key in self._cache:
                return self._cache[key]
        try:
            infos = infer_shapes(self._graph, {n: TensorInfo(self._dtypes[n], tuple(s)) for n, s in shapes.items()},
                                 values=True)
            result = {name: tuple(int(d) for d in infos[name].shape) for name in self._outputs}  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001 - any failure means "cannot tell": the batcher then does not pad
            result = None
        with self._lock:
            if len(self._cache) >= self.CACHE_SIZE:
                self._cache.clear()
            self._cache[key] = result
        return result


def _bucket(engine: kiln.CudaEngine):
    """A job's bucket for padding: the optimization profile its own shapes select."""
    profiles = engine.plan.profiles
    if len(profiles) <= 1:
        return lambda shapes: 0
    return lambda shapes: execution.select_profile(profiles, shapes)


def _class_entry(value: float, index: int, labels: list[str]) -> bytes:
    text = f"{value:f}:{index}"
    if index < len(labels):
        text += f":{labels[index]}"
    return text.encode()


def _matches(shape: tuple[int, ...], dims: tuple[int, ...]) -> bool:
    return len(shape) == len(dims) and all(d == -1 or d == s for s, d in zip(shape, dims))


def _reshaped(array, shape: tuple[int, ...]):
    """`array` seen with `shape` (same elements): a numpy reshape, or the same device memory (DeviceView)."""
    if isinstance(array, kiln.DeviceView):
        return dataclasses.replace(array, shape=shape)  # a RegionView stays one
    return array.reshape(shape)


def _resolve_reshape(target: tuple[int, ...], item_shape: tuple[int, ...], name: str) -> tuple[int, ...]:
    """A reshape target with its -1 dims (at most one) resolved against the item's element count."""
    count = math.prod(item_shape)
    if target.count(-1) > 1:
        raise invalid(f"tensor '{name}': reshape {list(target)} has more than one variable dim")
    known = math.prod([d for d in target if d != -1])
    resolved = tuple(count // known if d == -1 and known else d for d in target)
    if math.prod(resolved) != count:
        raise invalid(f"tensor '{name}' with shape {list(item_shape)} cannot be reshaped to {list(target)}")
    return resolved


# Model config parameter: opt batch sizes, one optimization profile each (e.g. "2,8,32"); profile i covers
# batch 1..size_i. Without it a model gets one profile, batch 1..max_batch_size.
PROFILE_BATCH_SIZES = "kiln_profile_batch_sizes"


def profile_batch_sizes(config: ModelConfig) -> list[int]:
    """The opt (= max) batch size of each profile to build, ascending, ending at max_batch_size."""
    if config.max_batch_size <= 0:
        return [0]
    parameter = config.parameters.get(PROFILE_BATCH_SIZES)
    if parameter is None or not parameter.string_value.strip():
        return [config.max_batch_size]
    try:
        sizes = sorted({int(s) for s in parameter.string_value.split(",") if s.strip()})
    except ValueError:
        raise invalid(f"model '{config.name}': parameter {PROFILE_BATCH_SIZES} must be comma-separated batch "
                      f"sizes, got '{parameter.string_value}'") from None
    if any(not 1 <= s <= config.max_batch_size for s in sizes):
        raise invalid(f"model '{config.name}': {PROFILE_BATCH_SIZES} {sizes} must lie in 1..{config.max_batch_size}")
    return sizes if sizes[-1] == config.max_batch_size else [*sizes, config.max_batch_size]


def _profile_ranges(config: ModelConfig, batch: int) -> dict[str, tuple[list[int], list[int], list[int]]]:
    """min/opt/max per input: batch 1..`batch` (opt = `batch`), fixed dims as given, variable dims (opt 1)
    0..DYNAMIC_DIM_MAX on the CPU backend, which runs empty tensors (Triton serves a [1, 0] request), and
    1..CUDA_DYNAMIC_DIM_MAX on CUDA, whose lowering refuses some layers of empty tensors (a refusal at the min
    shapes would move those layers to the host) and whose arena is sized by the max."""
    cuda = _backend_for(config) == "cuda"
    smallest, largest = (1, CUDA_DYNAMIC_DIM_MAX) if cuda else (0, DYNAMIC_DIM_MAX)
    ranges = {}
    for tensor in [*config.input, *server_filled_inputs(config)]:  # sequence controls and states too
        dims = model_shape(tensor)
        low = [smallest if d == -1 else d for d in dims]
        high = [largest if d == -1 else d for d in dims]
        opt = [1 if d == -1 else d for d in dims]
        if config.max_batch_size > 0:
            low, opt, high = [1, *low], [batch, *opt], [batch, *high]
        ranges[tensor.name] = (low, opt, high)
    return ranges


def _read_labels(source: ModelSource, config: ModelConfig) -> dict[str, list[str]]:
    labels = {}
    for tensor in config.output:
        if tensor.label_filename:
            path = source.directory / tensor.label_filename
            if not path.resolve().is_relative_to(source.directory.resolve()):
                raise invalid(f"model '{config.name}': label file '{tensor.label_filename}' is outside the model directory")
            if not path.is_file():
                raise invalid(f"model '{config.name}': label file '{tensor.label_filename}' of output "
                              f"'{tensor.name}' does not exist")
            labels[tensor.name] = path.read_text().splitlines()
    return labels


def load_model_version(source: ModelSource, version: int, config: ModelConfig,
                       default_max_batch_size: int, profiles: list[ProfileRanges] | None = None) -> ModelVersion:
    """Build one version (blocking). Raises ServerError / kiln errors with the reason the model cannot load.
    `profiles` replaces the profiles the config implies (adaptive profiles fitted to traffic)."""
    requested_config = config
    filename, field = model_filename(config)
    path: Path = source.model_file(version, filename, field)
    if not path.is_file():
        raise invalid(f"model '{source.name}' version {version}: '{filename}' is missing in {path.parent}")
    digest = files_digest(path.parent)  # keys the description here and the plan below
    label = f"model '{source.name}' version {version}"
    try:  # parsed in a child process under the build limits; cached by digest (memory and the plan cache dir)
        description = model_description.describe(path, digest, label, server_cache().directory)
    except build_process.TaskFailed as e:
        raise invalid(f"model '{source.name}' version {version}: {filename} is not a valid ONNX model: {e}") from None
    except kiln.BuildError as e:  # a limit it ran into, or how the child ended
        raise invalid(f"model '{source.name}' version {version}: {filename} cannot be read: {e}") from None
    config = complete_config(config, description, source.name, default_max_batch_size)
    sequence = sequence_settings(config, description, source.directory)
    builder = kiln.Builder()  # the ONNX import itself runs in the build process (bounded memory and time)
    builder_config = kiln.BuilderConfig(_backend_for(config))
    apply_precision(config, builder_config)
    for ranges in profiles or [_profile_ranges(config, batch) for batch in profile_batch_sizes(config)]:
        profile = builder.create_optimization_profile()
        for name, (low, opt, high) in ranges.items():
            profile.set_shape(name, low, opt, high)
        builder_config.add_optimization_profile(profile)
    key = cache_key(digest, build_description(builder_config), target_arch(builder_config.backend), path.name)
    in_core = executor.why_in_core(builder_config.backend, config.max_batch_size, sequence is not None)
    if config.optimization.cuda.busy_wait_events and in_core and builder_config.backend == "cuda":
        raise invalid(f"model '{source.name}': optimization.cuda.busy_wait_events is honoured for models whose "
                      f"executions run in executor processes, and {in_core}. Remove busy_wait_events")
    devices = placement.visible_devices() if builder_config.backend == "cuda" else placement.Devices(0, str)
    placements = placement.place_instances(config, builder_config.backend, in_core, lambda: devices)
    remote = not in_core
    cached = server_cache().load_or_build(key, lambda: build_process.build_plan(path, builder_config, label), label,
                                          source.name, describe=remote)
    engine = cached.engine
    complete_outputs_from_engine(config, _engine_outputs(engine))
    _check_declared_outputs(config, engine)
    labels = _read_labels(source, config)
    try:
        model = ModelVersion(source.name, version, config, engine, labels, sequence, remote, placements, devices.count)
    except executor.RemoteError as e:
        raise invalid(f"{label}: {e}") from None
    try:
        model.warm_up(source.directory)
    except BaseException:
        model.close()
        raise
    model.plan_origin = cached.origin
    model.build_seconds = cached.build_s
    model.source, model.requested_config = source, requested_config
    return model


def model_filename(config: ModelConfig) -> tuple[str, str]:
    """The file a version loads and the config field that names it: for a model that runs on a GPU,
    cc_model_filenames' entry for that GPU's compute capability ("9.0"), where there is one, as Triton chooses for
    GPU instances; else default_model_filename (model.onnx)."""
    default = (config.default_model_filename or "model.onnx", "default_model_filename")
    if not config.cc_model_filenames or _backend_for(config) != "cuda":
        return default
    group = config.instance_group[0] if config.instance_group else None
    arch = compat.parse_arch(compat.device_arch(group.gpus[0] if group is not None and group.gpus else 0) or "")
    capability = f"{arch[0]}.{arch[1]}" if arch else ""  # one architecture per version: placement refuses mixes
    chosen = config.cc_model_filenames.get(capability)
    return (chosen, f"cc_model_filenames['{capability}']") if chosen else default


def _backend_for(config: ModelConfig) -> str:
    """The engine backend the instance group asks for: KIND_CPU -> cpu, KIND_GPU -> cuda, else the default."""
    kind = config.instance_group[0].kind if config.instance_group else model_config_pb2.ModelInstanceGroup.KIND_AUTO
    if kind == model_config_pb2.ModelInstanceGroup.KIND_CPU:
        return "cpu"
    available = kiln.available_backends()
    if kind == model_config_pb2.ModelInstanceGroup.KIND_GPU:
        if "cuda" not in available:
            raise invalid(f"model '{config.name}': instance_group kind KIND_GPU needs a GPU; this machine has "
                          f"backends {available} (use KIND_CPU or KIND_AUTO)")
        return "cuda"
    return available[0]


def _engine_outputs(engine: kiln.CudaEngine) -> dict[str, tuple[str, tuple[int, ...]]]:
    outputs = {}
    for index in range(engine.num_io_tensors):
        name = engine.get_tensor_name(index)
        if engine.get_tensor_mode(name) == kiln.TensorIOMode.OUTPUT:
            dtype = np.dtype(kiln.nptype(engine.get_tensor_dtype(name)))
            outputs[name] = (datatype_of_numpy(dtype), tuple(engine.get_tensor_shape(name)))
    return outputs


def _check_declared_outputs(config: ModelConfig, engine: kiln.CudaEngine) -> None:
    outputs = _engine_outputs(engine)
    for tensor in config.output:
        if tensor.name not in outputs:
            raise invalid(f"model '{config.name}': output '{tensor.name}' is not produced by the model")
        if datatype_of(tensor) != outputs[tensor.name][0]:
            raise invalid(f"model '{config.name}': output '{tensor.name}' is {outputs[tensor.name][0]} in the "
                          f"model, the config says {model_config_pb2.DataType.Name(tensor.data_type)}")
