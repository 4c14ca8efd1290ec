"""Runtime objects: Runtime -> CudaEngine -> ExecutionContext (reference names and meanings).

On the CPU backend, tensor "addresses" are host pointers (``array.ctypes.data``) and
``execute_async_v3`` runs synchronously; ``context.infer({...})`` is the numpy convenience on top.

Compatibility (``engine_core.compat``): a plan is refused (``deserialize_cuda_engine`` -> None, the
reason logged and recorded) when this Kiln version or this GPU may not run it. Weight streaming
(``engine_core.weight_streaming``): the engine keeps the budget and the schedule; on the CPU
backend weights always live in host memory, so the numbers are bookkeeping only; the CUDA runner
places weights by it when a context is made and streams the others every run.

Backends (``engine_core.backends.base``): the engine loads its plan with the backend registered under the plan's
``backend`` (``backend_state``), each context makes that backend's context state (``_backend_context``) and hands
every run to it; nothing here depends on which backend it is.
"""

from __future__ import annotations

import os
import tempfile
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from engine_core.backends.base import ContextState, EngineState
from engine_core.backends.cpu import host_array as _host_array  # shape inputs bound by address are host memory
from engine_core.backends.registry import available_backends, get_backend
from engine_core.compat import requirements
from engine_core.cuda.driver import memory_info
from engine_core.error_recorder import ErrorCode, RecorderSlot, report_error
from engine_core.errors import DeviceMemoryError, KilnError, PlanFormatError, ShapeError
from engine_core.inspector import (  # inspector / debug-tensor hooks
    DEBUG_KEY,
    EngineInspector,
    IDebugListener,
    debug_state,
    engine_verbosity,
    report_to_profiler,
)
from engine_core.inspector import engine_summary as engine_summary  # re-exported: it was defined here
from engine_core.logger import DEFAULT_LOGGER, Logger
from engine_core.ops import TensorInfo
from engine_core.passes import infer_shapes
from engine_core.plan import IOTensor, Plan, deserialize_plan
from engine_core.plugins import PluginRegistry, check_plan_plugins, get_plugin_registry
from engine_core.refittable import plan_refittable
from engine_core.runtime_batch import BatchExecution  # ExecutionContext.infer_batch and its checks
from engine_core.runtime_helpers import (  # moved from here; format_description is public
    _VECTORIZED,
    _profile_device_memory,
    _shapes_need_values,
    _streamable_weights_per_layer,
    format_description,
)
from engine_core.types import (
    DataType,
    EngineCapability,
    ExecutionContextAllocationStrategy,
    HardwareCompatibilityLevel,
    TempfileControlFlag,
    TensorFormat,
    TensorIOMode,
    TensorLocation,
    datatype_of,
)
from engine_core.weight_streaming import StreamingPlan, automatic_budget, plan_streaming

#: the reference's default: in-memory and named temporary files both allowed
#: input-shape sets whose inferred shapes a context keeps (ExecutionContext._inferred_by_shapes)
INFERRED_SHAPES_KEPT = 64
DEFAULT_TEMPFILE_FLAGS = (1 << TempfileControlFlag.ALLOW_IN_MEMORY_FILES) | (1 << TempfileControlFlag.ALLOW_TEMPORARY_FILES)


class IOutputAllocator:
    """Application hook for outputs whose size is known only while running (data-dependent)."""

    def reallocate_output(self, tensor_name: str, memory: int, size: int, alignment: int) -> int | None:
        raise NotImplementedError

    def reallocate_output_async(self, tensor_name: str, memory: int, size: int, alignment: int, stream: int) -> int | None:
        return self.reallocate_output(tensor_name, memory, size, alignment)

    def notify_shape(self, tensor_name: str, shape: tuple[int, ...]) -> None:
        raise NotImplementedError


class IProfiler:
    """Receives each layer's execution time after every run."""

    def report_layer_time(self, layer_name: str, ms: float) -> None:
        raise NotImplementedError


class LayerTimes(IProfiler):
    """An IProfiler that keeps every reported time (ms) by layer name, run after run (`kiln profile`,
    bench/generate_step.py --profile)."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}

    def report_layer_time(self, layer_name: str, ms: float) -> None:
        self.times.setdefault(layer_name, []).append(ms)


class Runtime:
    """Deserializes plans (IRuntime)."""

    error_recorder = RecorderSlot()  # IErrorRecorder hook

    def __init__(self, logger: Logger | None = None) -> None:
        self.logger = logger or DEFAULT_LOGGER
        #: where named temporary files go (None: $TMPDIR, else /tmp); see runtime_file()
        self.temporary_directory: str | None = None
        #: TempfileControlFlag bits: which kinds of files the runtime may create
        self.tempfile_control_flags = DEFAULT_TEMPFILE_FLAGS
        #: Kiln plans never embed host code, so this gates nothing; kept for scripts that set it
        self.engine_host_code_allowed = False

    def load_runtime(self, path: str) -> Runtime | None:
        """Not applicable: Kiln has no lean runtime libraries; every Kiln reads plans itself (None)."""
        report_error(self, ErrorCode.UNSUPPORTED_STATE,
                     f"load_runtime({path!r}): Kiln has no lean runtime libraries; use Runtime() of the Kiln "
                     "version the plan allows (see `kiln inspect`)")
        return None

    def deserialize_cuda_engine(self, serialized_engine: bytes | bytearray | memoryview | Any) -> CudaEngine | None:
        """The reference behaviour: None (and an error logged and recorded) for a bad plan or one this
        Kiln / this GPU may not run. Takes plan bytes or a stream reader (an object with ``read()``)."""
        try:
            return self.load(serialized_engine)
        except PlanFormatError as e:
            report_error(self, ErrorCode.INVALID_ARGUMENT, f"cannot deserialize plan: {e}")
            return None
        except DeviceMemoryError as e:
            report_error(self, ErrorCode.FAILED_ALLOCATION, f"cannot load the engine: {e}")
            return None

    def load(self, serialized_engine: bytes | bytearray | memoryview) -> CudaEngine:
        """Like deserialize_cuda_engine, but raises PlanFormatError (or DeviceMemoryError) saying what is wrong."""
        return self._engine(serialized_engine, load_backend=True)

    def describe(self, serialized_engine: bytes | bytearray | memoryview) -> CudaEngine:
        """The plan's engine for its description only (I/O tensors, profiles, graph, serialization): no weights
        uploaded, no kernels loaded, no device touched; it cannot create execution contexts. Why: a process that
        hands executions to another one (the server's executor processes) needs the metadata, not a second copy
        of the weights on the device."""
        return self._engine(serialized_engine, load_backend=False)

    def _engine(self, serialized_engine: bytes | bytearray | memoryview, load_backend: bool) -> CudaEngine:
        if hasattr(serialized_engine, "read"):  # IStreamReader-style: a file or any reader
            serialized_engine = serialized_engine.read()
        plan = deserialize_plan(serialized_engine)
        if plan.backend != "cpu" and plan.backend not in available_backends():
            raise PlanFormatError(f"plan was built for the '{plan.backend}' backend, which this machine lacks")
        check_plan_plugins(plan.build_info)  # plugin hook: refuse plans whose plugins are missing
        engine = CudaEngine(plan, bytes(serialized_engine), self.logger, load_backend)
        engine.error_recorder = self.error_recorder  # engines start with their runtime's recorder
        return engine

    def get_plugin_registry(self) -> PluginRegistry:
        return get_plugin_registry()


class CudaEngine:
    """A deserialized plan (ICudaEngine); shared by all its execution contexts."""

    error_recorder = RecorderSlot()  # IErrorRecorder hook
    profiling_verbosity = property(engine_verbosity)  # inspector hook
    has_implicit_batch_dimension = False  # the reference's removed implicit-batch mode
    engine_capability = EngineCapability.STANDARD
    num_aux_streams = 0  # one stream per context: no auxiliary streams

    def __init__(self, plan: Plan, serialized: bytes, logger: Logger, load_backend: bool = True) -> None:
        self.plan = plan
        self.logger = logger
        self._serialized = serialized
        self._io = {t.name: t for t in plan.io}
        self._order = [t.name for t in plan.io]
        self._contexts: weakref.WeakSet[ExecutionContext] = weakref.WeakSet()
        self._profile_memory: dict[int, int] = {}
        self._streaming_layers = _streamable_weights_per_layer(plan)
        self._budget = self.streamable_weights_size  # reference default: streaming off
        #: the plan's backend's per-engine state (weights, kernels): its contexts' states come from it; None for an
        #: engine that is only described (Runtime.describe)
        self.backend_state: EngineState | None = get_backend(plan.backend).load(plan) if load_backend else None

    # -- I/O description ------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def num_io_tensors(self) -> int:
        return len(self._order)

    @property
    def num_layers(self) -> int:
        return len(self.plan.graph.nodes)

    @property
    def num_optimization_profiles(self) -> int:
        return len(self.plan.profiles)

    @property
    def device_memory_size(self) -> int:
        """Activation memory a context needs (largest over all profiles)."""
        return self.plan.device_memory_size

    @property
    def device_memory_size_v2(self) -> int:
        """device_memory_size plus the weight-streaming scratch at the current budget."""
        return self.device_memory_size + self.weight_streaming_scratch_memory_size

    max_workspace_size = device_memory_size  # deprecated reference name for the same figure

    def get_device_memory_size_for_profile(self, profile_index: int) -> int:
        """Activation memory a context needs while ``profile_index`` is active."""
        self._check_profile(profile_index)
        if profile_index not in self._profile_memory:
            self._profile_memory[profile_index] = _profile_device_memory(self.plan, profile_index)
        return self._profile_memory[profile_index]

    def get_device_memory_size_for_profile_v2(self, profile_index: int) -> int:
        return self.get_device_memory_size_for_profile(profile_index) + self.weight_streaming_scratch_memory_size

    def _check_profile(self, profile_index: int) -> None:
        if not 0 <= profile_index < len(self.plan.profiles):
            raise IndexError(f"profile {profile_index} does not exist (engine has {len(self.plan.profiles)})")

    @property
    def hardware_compatibility_level(self) -> HardwareCompatibilityLevel:
        return requirements(self.plan.compat_meta()).level

    # -- weight streaming (engine_core.weight_streaming) ----------------------------------------
    @property
    def streamable_weights_size(self) -> int:
        """Bytes of weights that may be streamed (0 unless built with BuilderFlag.WEIGHT_STREAMING)."""
        return sum({n: b for _, ws in self._streaming_layers for n, b in ws}.values())

    @property
    def weight_streaming_budget_v2(self) -> int:
        return self._budget

    @weight_streaming_budget_v2.setter
    def weight_streaming_budget_v2(self, budget: int) -> None:
        self._set_budget(int(budget))

    def _set_budget(self, budget: int) -> None:
        problem = None
        if "WEIGHT_STREAMING" not in self.plan.build_info.get("flags", []):
            problem = f"engine '{self.name}' was not built with BuilderFlag.WEIGHT_STREAMING"
        elif budget < 0:
            problem = f"weight streaming budget must be >= 0 (0 streams the most weights), got {budget}"
        elif len(self._contexts):
            problem = "the weight streaming budget cannot change while execution contexts of the engine exist"
        if problem:
            report_error(self, ErrorCode.INVALID_ARGUMENT if budget < 0 else ErrorCode.INVALID_STATE, problem)
            raise ValueError(problem)
        self._budget = min(budget, self.streamable_weights_size)

    @property
    def weight_streaming_budget(self) -> int:
        """Deprecated v1 view: -1 when streaming is off, else the v2 budget."""
        return -1 if self._budget >= self.streamable_weights_size else self._budget

    @weight_streaming_budget.setter
    def weight_streaming_budget(self, budget: int) -> None:
        """v1 semantics: -1 disables streaming, 0 lets Kiln choose (automatic budget), else bytes."""
        budget = int(budget)
        if budget == -1:
            budget = self.streamable_weights_size
        elif budget == 0:
            budget = self.get_weight_streaming_automatic_budget()
        self._set_budget(budget)

    @property
    def minimum_weight_streaming_budget(self) -> int:
        """Deprecated v1: device bytes streaming needs at least (the scratch when streaming all)."""
        return plan_streaming(self._streaming_layers, 0).scratch_bytes

    def get_weight_streaming_automatic_budget(self) -> int:
        """A budget that fits this device's free memory (CPU backend: weights are in host memory, so all)."""
        if self.plan.backend != "cuda":
            return self.streamable_weights_size
        free, _total = memory_info()
        return automatic_budget(self._streaming_layers, int(free), self.device_memory_size)

    @property
    def weight_streaming_plan(self) -> StreamingPlan:
        """Resident weights and the per-run upload schedule at the current budget (CUDA runner hook)."""
        return plan_streaming(self._streaming_layers, self._budget)

    @property
    def weight_streaming_scratch_memory_size(self) -> int:
        return self.weight_streaming_plan.scratch_bytes

    def _streamed_weights(self) -> set[str]:
        """Weights the current budget leaves in host memory (CUDA runner hook: read per new context)."""
        plan = self.weight_streaming_plan
        return {u.weight for step in plan.steps for u in step.uploads}

    @property
    def refittable(self) -> bool:
        return plan_refittable(self.plan)

    def is_debug_tensor(self, name: str) -> bool:
        return name in self.plan.build_info.get(DEBUG_KEY, [])

    @property
    def backend(self) -> str:
        return self.plan.backend

    def get_tensor_name(self, index: int) -> str:
        return self._order[index]

    def __getitem__(self, key: int | str) -> str | int:
        return self._order[key] if isinstance(key, int) else self._order.index(key)

    def _tensor(self, name: str) -> IOTensor:
        try:
            return self._io[name]
        except KeyError:
            raise KeyError(f"'{name}' is not an input or output of this engine (it has {self._order})") from None

    def get_tensor_mode(self, name: str) -> TensorIOMode:
        return self._io[name].mode if name in self._io else TensorIOMode.NONE

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return self._tensor(name).shape

    def get_tensor_dtype(self, name: str) -> DataType:
        return datatype_of(self._tensor(name).dtype)

    def get_tensor_location(self, name: str) -> TensorLocation:
        self._tensor(name)
        host = self.plan.backend == "cpu" or self.is_shape_inference_io(name)
        return TensorLocation.HOST if host else TensorLocation.DEVICE

    # -- tensor formats: read from the plan's I/O records ("LINEAR" unless the builder set another) --
    def get_tensor_format(self, name: str, profile_index: int = 0) -> TensorFormat:
        return TensorFormat[self._tensor(name).format]

    def get_tensor_format_desc(self, name: str, profile_index: int = 0) -> str:
        return format_description(self.get_tensor_format(name), self.get_tensor_dtype(name))

    def get_tensor_vectorized_dim(self, name: str, profile_index: int = 0) -> int:
        """Index of the vectorized dimension, -1 when scalars per vector is 1 (LINEAR, HWC, ...)."""
        width, channel_from_end = _VECTORIZED.get(self.get_tensor_format(name), (1, 0))
        return -1 if width == 1 else len(self.get_tensor_shape(name)) - channel_from_end

    def get_tensor_components_per_element(self, name: str, profile_index: int = 0) -> int:
        return _VECTORIZED.get(self.get_tensor_format(name), (1, 0))[0]

    def get_tensor_bytes_per_component(self, name: str, profile_index: int = 0) -> int:
        """Bytes of one scalar (-1 for STRING tensors, which have no fixed size)."""
        dtype = self.get_tensor_dtype(name)
        return -1 if dtype == DataType.STRING else dtype.itemsize

    def get_tensor_profile_shape(self, name: str, profile_index: int) -> list[tuple[int, ...]]:
        self._check_profile(profile_index)
        if self.get_tensor_mode(name) != TensorIOMode.INPUT:
            raise KeyError(f"'{name}' is not an input tensor")
        return [tuple(s) for s in self.plan.profiles[profile_index][name]]

    def is_shape_inference_io(self, name: str) -> bool:
        """True for shape-tensor inputs: their values (read on the host) decide output shapes."""
        return any(name in values for values in self.plan.profile_values)

    def get_tensor_profile_values(self, name: str, profile_index: int) -> list[tuple[int, ...]]:
        """min/opt/max values of a shape-tensor input under a profile ([] if not set for it)."""
        if not self.is_shape_inference_io(name):
            raise KeyError(f"'{name}' is not a shape-tensor input")
        return [tuple(v) for v in self.plan.profile_values[profile_index].get(name, ())]

    def serialize(self) -> bytes:
        return self._serialized

    # -- contexts and inspection ----------------------------------------------------------------
    def create_execution_context(
        self, strategy: ExecutionContextAllocationStrategy = ExecutionContextAllocationStrategy.STATIC
    ) -> ExecutionContext:
        if self.backend_state is None:
            raise KilnError("this engine is only described (Runtime.describe): it has no device state and cannot "
                            "create execution contexts; load the plan with Runtime.load to run it")
        context = ExecutionContext(self, strategy)
        self._contexts.add(context)
        return context

    def create_execution_context_without_device_memory(self) -> ExecutionContext:
        return self.create_execution_context(ExecutionContextAllocationStrategy.USER_MANAGED)

    def create_engine_inspector(self) -> EngineInspector:
        return EngineInspector(self)


@contextmanager
def runtime_file(runtime: Runtime, data: bytes, name: str = "kiln") -> Iterator[str]:
    """A path holding ``data``, for code that can only be loaded from a file, created as the
    runtime's tempfile settings allow: an in-memory file (Linux memfd, ALLOW_IN_MEMORY_FILES) if
    permitted, else a named file in ``temporary_directory`` / $TMPDIR / /tmp (ALLOW_TEMPORARY_FILES);
    removed afterwards. Raises KilnError naming the setting when neither is allowed.
    """
    flags = runtime.tempfile_control_flags
    if flags & (1 << TempfileControlFlag.ALLOW_IN_MEMORY_FILES) and hasattr(os, "memfd_create"):
        fd = os.memfd_create(name, 0)
        try:
            os.write(fd, data)
            yield f"/proc/self/fd/{fd}"
        finally:
            os.close(fd)
        return
    if not flags & (1 << TempfileControlFlag.ALLOW_TEMPORARY_FILES):
        raise KilnError("Runtime.tempfile_control_flags allows neither in-memory files (or this platform has none) "
                        "nor temporary files, and this step must load code from a file")
    directory = runtime.temporary_directory or os.environ.get("TMPDIR") or "/tmp"
    if not os.path.isdir(directory):
        raise KilnError(f"Runtime.temporary_directory {directory!r} is not a directory")
    fd, path = tempfile.mkstemp(prefix=f"{name}-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        yield path
    finally:
        os.unlink(path)


class ExecutionContext(BatchExecution):
    """Per-request state over a shared engine (IExecutionContext): shapes, addresses, profile."""

    error_recorder = RecorderSlot("engine")  # IErrorRecorder hook: defaults to the engine's
    enqueue_emits_profile = True  # profiler hook: False defers layer times to report_to_profiler()

    def __init__(self, engine: CudaEngine, strategy: ExecutionContextAllocationStrategy) -> None:
        self.engine = engine
        self.strategy = strategy
        self.name = ""
        self.profiler: IProfiler | None = None
        self.debug_sync = False
        self._profile = 0
        self._input_shapes: dict[str, tuple[int, ...]] = {}
        self._addresses: dict[str, int] = {}
        self._allocators: dict[str, IOutputAllocator] = {}
        self._inferred: dict[str, TensorInfo] | None = None
        #: inferred shapes by (profile, input shapes, shape values): a server or a generation loop comes back to the
        #: same few shapes, and inferring a large graph's shapes again costs milliseconds (most recent last)
        self._inferred_by_shapes: OrderedDict[tuple, dict[str, TensorInfo]] = OrderedDict()
        self._shape_values: dict[str, np.ndarray] = {}
        self._device_memory: tuple[int, int] | None = None
        self._input_consumed_event = 0
        # the backend's state of this context: the budget cannot change while contexts exist, so weights are placed now
        state = engine.backend_state
        assert state is not None, "create_execution_context refuses described engines"
        self._backend_context: ContextState = state.create_context(engine._streamed_weights())
        self._input_names = [t.name for t in engine.plan.io if t.mode == TensorIOMode.INPUT]
        self._output_names = [t.name for t in engine.plan.io if t.mode == TensorIOMode.OUTPUT]
        self._shape_io_inputs = [n for n in self._input_names if engine.is_shape_inference_io(n)]
        for name in self._input_names:  # static inputs need no set_input_shape
            shape = engine.get_tensor_shape(name)
            if all(d >= 0 for d in shape):
                self._input_shapes[name] = shape

    # -- profiles and shapes --------------------------------------------------------------------
    @property
    def active_optimization_profile(self) -> int:
        return self._profile

    def set_optimization_profile_async(self, profile_index: int, stream_handle: int = 0) -> bool:
        if not 0 <= profile_index < self.engine.num_optimization_profiles:
            report_error(self, ErrorCode.INVALID_ARGUMENT, f"profile {profile_index} does not exist "
                         f"(engine has {self.engine.num_optimization_profiles})")
            return False
        self._profile = profile_index
        self._inferred = None
        return True

    def check_input_shape(self, name: str, shape: Sequence[int]) -> tuple[int, ...]:
        """Validate ``shape`` for input ``name`` against the active profile; raises ShapeError."""
        if self.engine.get_tensor_mode(name) != TensorIOMode.INPUT:
            raise ShapeError(f"'{name}' is not an input of this engine (inputs: {self._input_names})")
        shape = tuple(int(d) for d in shape)
        if self.engine._tensor(name).kind != "tensor":
            return ()
        lo, _, hi = self.engine.plan.profiles[self._profile][name]
        if len(shape) != len(lo) or not all(a <= d <= b for a, d, b in zip(lo, shape, hi)):
            raise ShapeError(f"input '{name}' shape {list(shape)} is outside optimization profile {self._profile}: "
                             f"min {list(lo)}, max {list(hi)}")
        return shape

    def set_input_shape(self, name: str, shape: Sequence[int]) -> bool:
        try:
            self._input_shapes[name] = self.check_input_shape(name, shape)
        except ShapeError as e:
            report_error(self, ErrorCode.INVALID_ARGUMENT, str(e))
            return False
        self._inferred = None
        return True

    @property
    def all_binding_shapes_specified(self) -> bool:
        return all(n in self._input_shapes for n in self._input_names)

    all_shape_inputs_specified = all_binding_shapes_specified

    def _set_shape_value(self, name: str, value: np.ndarray) -> None:
        """Record a shape-tensor input's values, checked against the active profile's ranges."""
        value = np.asarray(value)
        ranges = self.engine.plan.profile_values[self._profile].get(name)
        if ranges is not None:
            lo, _, hi = (np.array(r) for r in ranges)
            if value.size != lo.size or np.any(value.reshape(-1) < lo) or np.any(value.reshape(-1) > hi):
                raise ShapeError(f"shape input '{name}' values {value.reshape(-1).tolist()} are outside optimization "
                                 f"profile {self._profile}: min {lo.tolist()}, max {hi.tolist()}")
        self._shape_values[name] = value
        self._inferred = None

    def _read_shape_values(self) -> None:
        """Shape-tensor inputs bound with set_tensor_address are read from host memory."""
        for name in self._shape_io_inputs:
            if name in self._addresses and name in self._input_shapes:
                tensor = self.engine._tensor(name)
                host = _host_array(self._addresses[name], tensor.dtype, self._input_shapes[name])
                if name not in self._shape_values or not np.array_equal(self._shape_values[name], host):
                    self._set_shape_value(name, host.copy())

    def infer_shapes(self) -> list[str]:
        """Propagate input shapes; returns the names of inputs still lacking a shape (or shape values).
        Called for every output's shape of every run: with the shapes already inferred and no shape inputs to
        re-read it returns at once, and shapes seen before come from `_inferred_by_shapes`."""
        if self._shape_io_inputs:
            self._read_shape_values()
        elif self._inferred is not None:
            return []
        missing = [n for n in self._input_names if n not in self._input_shapes or
                   (n in self._shape_io_inputs and n not in self._shape_values)]
        if not missing and self._inferred is None:
            key = (self._profile, tuple(self._input_shapes[n] for n in self._input_names),
                   tuple(self._shape_values[n].tobytes() for n in self._shape_io_inputs))
            cached = self._inferred_by_shapes.pop(key, None)
            if cached is None:
                graph = self.engine.plan.graph
                infos = {v.name: TensorInfo(v.dtype, self._input_shapes[v.name] if v.is_tensor else None,
                                            self._shape_values.get(v.name)) for v in graph.inputs}
                cached = infer_shapes(graph, infos, values=True)
                if len(self._inferred_by_shapes) >= INFERRED_SHAPES_KEPT:
                    self._inferred_by_shapes.popitem(last=False)
            self._inferred_by_shapes[key] = cached
            self._inferred = cached
        return missing

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        """Input: the shape set; output: the inferred shape (-1 dims where data-dependent)."""
        if self.engine.get_tensor_mode(name) == TensorIOMode.INPUT:
            return self._input_shapes.get(name, self.engine.get_tensor_shape(name))
        if self.infer_shapes():
            return self.engine.get_tensor_shape(name)
        info = self._inferred.get(name) if self._inferred else None
        if info is None or info.shape is None:
            return self.engine.get_tensor_shape(name)
        return info.shape

    # -- addresses and allocators ---------------------------------------------------------------
    def set_tensor_address(self, name: str, memory: int) -> bool:
        if self.engine.get_tensor_mode(name) == TensorIOMode.NONE:
            report_error(self, ErrorCode.INVALID_ARGUMENT, f"set_tensor_address: '{name}' is not an I/O tensor")
            return False
        self._addresses[name] = int(memory)
        return True

    def get_tensor_address(self, name: str) -> int:
        return self._addresses.get(name, 0)

    def set_output_allocator(self, name: str, output_allocator: IOutputAllocator) -> bool:
        if self.engine.get_tensor_mode(name) != TensorIOMode.OUTPUT:
            return False
        self._allocators[name] = output_allocator
        return True

    def get_output_allocator(self, name: str) -> IOutputAllocator | None:
        return self._allocators.get(name)

    def get_tensor_strides(self, name: str) -> tuple[int, ...]:
        """Strides in elements of the buffer for ``name`` at the current shapes (LINEAR: row major)."""
        shape = self.get_tensor_shape(name)
        strides, step = [], 1
        for dim in reversed(shape):
            strides.append(step)
            step *= max(dim, 1)
        return tuple(reversed(strides))

    def set_aux_streams(self, aux_streams: Sequence[int]) -> None:
        """Accepted and unused: the reference uses the first ``engine.num_aux_streams`` (0 in Kiln)."""
        self._aux_streams = list(aux_streams)[: self.engine.num_aux_streams]

    def get_max_output_size(self, name: str) -> int:
        shape = self.get_tensor_shape(name)
        if any(d < 0 for d in shape):
            return -1
        return int(np.prod(shape)) * np.dtype(self.engine._tensor(name).dtype).itemsize

    # -- execution ------------------------------------------------------------------------------
    def _run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One run on host values: the backend's, with the profiler and debug listener (debug-tensor hook)."""
        return self._backend_context.infer_feeds(self, feeds)

    def execute_async_v3(self, stream_handle: int = 0) -> bool:
        """Run with the addresses set by set_tensor_address (CPU backend: synchronously). CUDA backend: a
        default stream (0) forks onto the context's own stream and joins back, so CUDA graphs replay there too."""
        try:
            self._backend_context.execute_bound(self, stream_handle)
            return True
        except KilnError as e:
            report_error(self, ErrorCode.FAILED_EXECUTION, f"execution failed: {e}")
            return False

    # -- debug tensors (engine_core.inspector) --------------------------------------------------
    def set_debug_listener(self, listener: IDebugListener | None) -> bool:
        debug_state(self).listener = listener
        return True

    def get_debug_listener(self) -> IDebugListener | None:
        return debug_state(self).listener

    def set_tensor_debug_state(self, name: str, flag: bool) -> bool:
        return debug_state(self).set_state(name, flag)

    def get_debug_state(self, name: str) -> bool:
        return name in debug_state(self).enabled

    def set_all_tensors_debug_state(self, flag: bool) -> bool:
        return debug_state(self).set_all(flag)

    def report_to_profiler(self) -> bool:
        return report_to_profiler(self)

    # -- input-consumed event -------------------------------------------------------------------
    def set_input_consumed_event(self, event: int) -> bool:
        """CUDA event (a CUevent handle as int, 0 to clear) that ``execute_async_v3`` records on its stream
        once no later layer reads an input, so the caller may refill input buffers before the run ends.
        CPU plans run synchronously: inputs are consumed when execute returns and the event is not recorded
        (a never-recorded CUDA event counts as complete)."""
        try:
            self._input_consumed_event = int(event or 0)
        except (TypeError, ValueError):
            report_error(self, ErrorCode.INVALID_ARGUMENT, f"set_input_consumed_event: {event!r} is not an event handle")
            return False
        return True

    def get_input_consumed_event(self) -> int:
        return self._input_consumed_event

    def execute_v2(self, bindings: Sequence[int]) -> bool:
        for name, address in zip(self.engine._order, bindings):
            self._addresses[name] = int(address)
        return self.execute_async_v3(0)

    # -- user-managed device memory -----------------------------------------------------------
    def set_device_memory(self, memory: int, size: int) -> None:
        """Give the context ``size`` bytes at device address ``memory`` for its activations (needed with
        the USER_MANAGED strategy; at least ``engine.device_memory_size_v2`` bytes). CPU plans record it."""
        if size < 0 or (memory == 0 and size):
            raise ValueError("set_device_memory needs an address and a non-negative size")
        self._device_memory = (int(memory), int(size))
        self._backend_context.use_memory(int(memory), int(size))

    @property
    def device_memory(self) -> int:
        """The address given by set_device_memory (0 when none); the reference's property is write-only."""
        return self._device_memory[0] if self._device_memory else 0

    @device_memory.setter
    def device_memory(self, memory: int) -> None:
        self.set_device_memory(memory, self.engine.device_memory_size)

    @property
    def concurrent_runs(self) -> int:
        """How many threads may call ``infer`` / ``infer_batch`` on this context at once (a Kiln extension): two
        on the CUDA backend, each run with pinned staging of its own, so one thread's gathering and copying out
        overlaps another's run on the device (backends/cuda/runner_staging.py); one on the CPU backend and with
        several optimization profiles (the active profile is the context's, and each run may switch it)."""
        if self.engine.num_optimization_profiles > 1:
            return 1
        return self._backend_context.concurrent_runs

    def infer(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Run on numpy inputs and return numpy outputs (sets shapes; validates dtype and profile).

        Raises ShapeError / TypeError naming the offending input; ExecutionError if a layer fails.
        """
        unknown = set(feeds) - set(self._input_names)
        if unknown:
            raise ShapeError(f"unknown inputs {sorted(unknown)}; this engine takes {self._input_names}")
        missing = [n for n in self._input_names if n not in feeds]
        if missing:
            raise ShapeError(f"missing inputs {missing}")
        arrays = {}
        for name in self._input_names:
            tensor = self.engine._tensor(name)
            if tensor.kind != "tensor":  # sequences (lists) and optionals (value or None) pass through
                arrays[name] = feeds[name]
                continue
            array = np.asarray(feeds[name])
            if array.dtype != tensor.dtype and not (array.dtype.kind in "OSU" and tensor.dtype.kind == "O"):
                raise TypeError(f"input '{name}' has dtype {array.dtype}, the engine expects {tensor.dtype}")
            self._input_shapes[name] = self.check_input_shape(name, array.shape)
            if self.engine.is_shape_inference_io(name):
                self._set_shape_value(name, array)
            arrays[name] = array
        self._inferred = None
        outputs = self._run(arrays)
        return {name: outputs[name] if self.engine._tensor(name).kind != "tensor" else np.asarray(outputs[name])
                for name in self._output_names}

    def warm_up(self, shapes: Mapping[str, Sequence[int]]) -> None:
        """Pay a shape's first-run costs before live requests: CUDA backend: bind these input shapes and run
        on zeros until the CUDA graph for the buffers ``infer`` and ``infer_batch`` use at these shapes is
        captured and verified, so the first real call replays it (no lowering, capture or verification on a
        live request); CPU backend: one run on zeros. Static inputs may be left out of ``shapes``.

        Engines whose shapes depend on input values (shape inputs, data-dependent shapes) are left as they
        are: zeros would not stand for real requests. On the CUDA backend a larger batch may grow the cuDNN
        workspace, which drops graphs captured before: warm the largest shapes first.
        Raises ShapeError for unknown or missing inputs and shapes outside the active profile.
        """
        unknown = set(shapes) - set(self._input_names)
        if unknown:
            raise ShapeError(f"unknown inputs {sorted(unknown)}; this engine takes {self._input_names}")
        zeros = {}
        for name in self._input_names:
            tensor = self.engine._tensor(name)
            if tensor.kind != "tensor" or self.engine.is_shape_inference_io(name):
                return
            static = self.engine.get_tensor_shape(name)
            if name not in shapes and any(d < 0 for d in static):
                raise ShapeError(f"warm_up needs a shape for input '{name}' (engine shape {list(static)})")
            shape = self.check_input_shape(name, shapes.get(name, static))
            zeros[name] = np.full(shape, "", object) if tensor.dtype.kind == "O" else np.zeros(shape, tensor.dtype)
        if _shapes_need_values(self.engine.plan, zeros):
            return
        self._backend_context.warm_up_feeds(self, zeros)
