"""Runtime objects: Runtime -> CudaEngine -> ExecutionContext (reference names and meanings).

On the CPU backend, tensor "addresses" are host pointers (``array.ctypes.data``) and
``execute_async_v3`` runs synchronously; ``context.infer({...})`` is the numpy convenience on top.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from engine_core.backends.cpu import GraphRunner
from engine_core.error_recorder import ErrorCode, RecorderSlot, report_error
from engine_core.errors import ExecutionError, KilnError, PlanFormatError, ShapeError
from engine_core.inspector import (  # inspector / debug-tensor hooks
    DEBUG_KEY,
    EngineInspector,
    IDebugListener,
    debug_state,
    engine_verbosity,
    profiler_for,
    report_to_profiler,
    run_with_debug,
)
from engine_core.logger import DEFAULT_LOGGER, Logger
from engine_core.ops import TensorInfo
from engine_core.passes import infer_shapes
from engine_core.plan import IOTensor, Plan, deserialize_plan
from engine_core.plugins import PluginRegistry, check_plan_plugins, get_plugin_registry
from engine_core.refit import engine_refittable
from engine_core.types import (
    DataType,
    ExecutionContextAllocationStrategy,
    TensorIOMode,
    TensorLocation,
    datatype_of,
)


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


class Runtime:
    """Deserializes plans (IRuntime)."""

    error_recorder = RecorderSlot()  # IErrorRecorder hook

    def __init__(self, logger: Logger | None = None) -> None:
        self.logger = logger or DEFAULT_LOGGER

    def deserialize_cuda_engine(self, serialized_engine: bytes | bytearray | memoryview) -> CudaEngine | None:
        """The reference behaviour: None (and an error logged) for a bad plan."""
        try:
            return self.load(serialized_engine)
        except PlanFormatError as e:
            report_error(self, ErrorCode.INVALID_ARGUMENT, f"cannot deserialize plan: {e}")
            return None

    def load(self, serialized_engine: bytes | bytearray | memoryview) -> CudaEngine:
        """Like deserialize_cuda_engine, but raises PlanFormatError saying what is wrong."""
        plan = deserialize_plan(serialized_engine)
        if plan.backend != "cpu":
            from engine_core.builder import available_backends

            if plan.backend not in available_backends():
                raise PlanFormatError(f"plan was built for the '{plan.backend}' backend, which this machine lacks")
        check_plan_plugins(plan.build_info)  # plugin hook: refuse plans whose plugins are missing
        engine = CudaEngine(plan, bytes(serialized_engine), self.logger)
        engine.error_recorder = self.error_recorder  # engines start with their runtime's recorder
        return engine

    def get_plugin_registry(self) -> PluginRegistry:
        return get_plugin_registry()


class CudaEngine:
    """A deserialized plan (ICudaEngine); shared by all its execution contexts."""

    error_recorder = RecorderSlot()  # IErrorRecorder hook
    profiling_verbosity = property(engine_verbosity)  # inspector hook

    def __init__(self, plan: Plan, serialized: bytes, logger: Logger) -> None:
        self.plan = plan
        self.logger = logger
        self._serialized = serialized
        self._io = {t.name: t for t in plan.io}
        self._order = [t.name for t in plan.io]
        self.runner = GraphRunner(plan.graph)
        self.cuda = _cuda_engine_state(plan)

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
        return self.plan.device_memory_size

    device_memory_size_v2 = device_memory_size

    @property
    def refittable(self) -> bool:
        return engine_refittable(self)

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

    def get_tensor_format_desc(self, name: str, profile_index: int = 0) -> str:
        return f"Row major linear {self.get_tensor_dtype(name).name} format"

    def get_tensor_profile_shape(self, name: str, profile_index: int) -> list[tuple[int, ...]]:
        if not 0 <= profile_index < len(self.plan.profiles):
            raise IndexError(f"profile {profile_index} does not exist (engine has {len(self.plan.profiles)})")
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
        return ExecutionContext(self, strategy)

    def create_execution_context_without_device_memory(self) -> ExecutionContext:
        return ExecutionContext(self, ExecutionContextAllocationStrategy.USER_MANAGED)

    def create_engine_inspector(self) -> EngineInspector:
        return EngineInspector(self)


def _cuda_engine_state(plan: Plan) -> Any:
    """CUDA backend hook: per-engine device state (weights, kernels) for plans built for "cuda"."""
    if plan.backend != "cuda":
        return None
    from engine_core.backends.cuda import engine_state

    return engine_state(plan)


def engine_summary(plan: Plan) -> dict[str, Any]:
    """JSON-ready description of a plan: I/O, profiles, layers (used by `kiln inspect` too)."""
    return {
        "name": plan.name,
        "engine_version": plan.engine_version,
        "backend": plan.backend,
        "arch": plan.arch,
        "device_memory_size": plan.device_memory_size,
        "io": [{"name": t.name, "mode": t.mode.name, "dtype": datatype_of(t.dtype).name, "shape": list(t.shape)}
               for t in plan.io],
        "profiles": [{k: {"min": list(v[0]), "opt": list(v[1]), "max": list(v[2])} for k, v in p.items()}
                     for p in plan.profiles],
        "layers": plan.layers,
        "build_info": plan.build_info,
    }


def _host_array(address: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """A numpy view of host memory at ``address`` (CPU-backend tensor addresses)."""
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if nbytes == 0:
        return np.empty(shape, dtype)
    buf = (ctypes.c_char * nbytes).from_address(address)
    return np.frombuffer(buf, dtype=dtype).reshape(shape)


class ExecutionContext:
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
        self._shape_values: dict[str, np.ndarray] = {}
        self._cuda = engine.cuda.create_context() if engine.cuda is not None else None  # CUDA backend hook
        self._input_names = [t.name for t in engine.plan.io if t.mode == TensorIOMode.INPUT]
        self._output_names = [t.name for t in engine.plan.io if t.mode == TensorIOMode.OUTPUT]
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
        for name in self._input_names:
            if self.engine.is_shape_inference_io(name) and name in self._addresses and name in self._input_shapes:
                tensor = self.engine._tensor(name)
                host = _host_array(self._addresses[name], tensor.dtype, self._input_shapes[name])
                if name not in self._shape_values or not np.array_equal(self._shape_values[name], host):
                    self._set_shape_value(name, host.copy())

    def infer_shapes(self) -> list[str]:
        """Propagate input shapes; returns the names of inputs still lacking a shape (or shape values)."""
        self._read_shape_values()
        missing = [n for n in self._input_names if n not in self._input_shapes or
                   (self.engine.is_shape_inference_io(n) and n not in self._shape_values)]
        if not missing and self._inferred is None:
            graph = self.engine.plan.graph
            infos = {v.name: TensorInfo(v.dtype, self._input_shapes[v.name] if v.is_tensor else None,
                                        self._shape_values.get(v.name)) for v in graph.inputs}
            self._inferred = infer_shapes(graph, infos, values=True)
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

    def get_max_output_size(self, name: str) -> int:
        shape = self.get_tensor_shape(name)
        if any(d < 0 for d in shape):
            return -1
        return int(np.prod(shape)) * np.dtype(self.engine._tensor(name).dtype).itemsize

    # -- execution ------------------------------------------------------------------------------
    def _run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._cuda is not None:  # CUDA backend hook: host arrays in and out
            return self._cuda.infer(feeds, profiler_for(self))
        timer = self.profiler.report_layer_time if self.profiler is not None else None
        return run_with_debug(self, feeds, timer)  # debug-tensor hook (plain run without a listener)

    def execute_async_v3(self, stream_handle: int = 0) -> bool:
        """Run with the addresses set by set_tensor_address (CPU backend: synchronously)."""
        try:
            if self._cuda is not None:  # CUDA backend hook: device addresses, launches on the stream
                self._execute_cuda(stream_handle)
                return True
            self._execute_bound()
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

    def execute_v2(self, bindings: Sequence[int]) -> bool:
        for name, address in zip(self.engine._order, bindings):
            self._addresses[name] = int(address)
        return self.execute_async_v3(0)

    def _execute_bound(self) -> None:
        missing = self.infer_shapes()
        if missing:
            raise ShapeError(f"set_input_shape was not called for inputs {missing}")
        feeds = {}
        for name in self._input_names:
            if name not in self._addresses:
                raise ExecutionError(f"no address set for input '{name}'")
            tensor = self.engine._tensor(name)
            feeds[name] = _host_array(self._addresses[name], tensor.dtype, self._input_shapes[name]).copy()
        outputs = self._run(feeds)
        for name in self._output_names:
            self._deliver(name, np.asarray(outputs[name], dtype=self.engine._tensor(name).dtype))

    def _execute_cuda(self, stream_handle: int) -> None:
        missing = [n for n in self._input_names if n not in self._input_shapes]
        if missing:
            raise ShapeError(f"set_input_shape was not called for inputs {missing}")
        self._cuda.execute(self._input_shapes, self._addresses, int(stream_handle), profiler_for(self))

    def _deliver(self, name: str, value: np.ndarray) -> None:
        """Copy one output to its bound address, or to memory its output allocator provides."""
        allocator = self._allocators.get(name)
        address = self._addresses.get(name)
        if allocator is not None:
            address = allocator.reallocate_output_async(name, address or 0, value.nbytes, 256, 0)
            if address is None or (address == 0 and value.nbytes):
                raise ExecutionError(f"output allocator returned no memory for '{name}' ({value.nbytes} bytes)")
            allocator.notify_shape(name, tuple(value.shape))
        elif address is None:
            raise ExecutionError(f"no address or output allocator set for output '{name}'")
        if value.nbytes:
            np.copyto(_host_array(address, value.dtype, value.shape), value)

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
