"""Binding: one set of input shapes -> everything its runs need: the lowering, folded values on the device, derived
weights, prepared kernel parameter blocks (``_PreparedLaunch``), the arena sized for it, and the resolver from
tensor references to device pointers (``BindingMixin``).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine_core.backends.cuda.lowering import lower_split
from engine_core.backends.cuda.lowering_context import (
    Conv,
    Host,
    Launch,
    Lowered,
    Ref,
    TensorMap,
)
from engine_core.backends.cuda.pointwise import Unsupported
from engine_core.backends.cuda.runner_schedule import RunSchedule, run_schedule
from engine_core.cuda.driver import (
    DeviceBuffer,
    check,
    encode_tensor_map,
)
from engine_core.errors import ExecutionError
from engine_core.ops import TensorInfo
from engine_core.passes import infer_shapes

Shapes = Mapping[str, tuple[int, ...]]


class UserMemory:
    """Caller-owned device memory used as a context's arena (not freed by Kiln)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr, self.nbytes = ptr, nbytes


class HostValueNotTensor(ExecutionError):
    """A host layer produced a sequence / optional / map: only a whole-graph host run can carry it."""


class ShapesNeedValues(ExecutionError):
    """Some tensor shapes depend on input values the binding was not given."""


@dataclass
class _EncodedMap:
    """A TensorMap launch argument: the 128-byte descriptor passed by value, and the address it was last encoded
    for (re-encoded when the tensor moves)."""

    descriptor: Any
    tensor_map: TensorMap
    encoded_for: int | None = None


class _PreparedLaunch:
    """A launch whose parameter block is built once; only pointer slots change between runs."""

    def __init__(self, launch: Launch, function: Any) -> None:
        self.launch = launch
        self.function = function
        self.objects: list[Any] = []
        self.refs: list[tuple[ctypes.c_void_p, Ref]] = []
        self.maps: list[_EncodedMap] = []
        for value, ctype in launch.args:
            if isinstance(value, Ref):
                obj = ctypes.c_void_p(0)
                self.refs.append((obj, value))
            elif isinstance(value, TensorMap):
                obj = (ctypes.c_uint64 * 16)()
                self.maps.append(_EncodedMap(obj, value))
            elif isinstance(value, ctypes.Structure):
                obj = value
            else:
                obj = ctype(value)
            self.objects.append(obj)
        self.params = (ctypes.c_void_p * len(self.objects))(*[ctypes.addressof(o) for o in self.objects])
        if launch.shared_bytes > 48 * 1024:  # the default dynamic shared memory limit
            from cuda.bindings import driver

            attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            check(driver.cuFuncSetAttribute(function, attribute, launch.shared_bytes), f"shared memory of {launch.function}")

    def run(self, resolve, stream: int) -> None:
        from cuda.bindings import driver

        for obj, ref in self.refs:
            obj.value = resolve(ref)
        for entry in self.maps:
            tensor_map = entry.tensor_map
            address = resolve(tensor_map.ref)
            if address % 16:  # cuTensorMapEncodeTiled would only say "invalid value"
                raise ExecutionError(f"{self.launch.function} reads '{tensor_map.ref.tensor}' through TMA, which needs "
                                     f"a 16-byte-aligned address; got {address:#x}")
            if address != entry.encoded_for:  # first run, or the tensor moved
                ctypes.memmove(entry.descriptor, encode_tensor_map(address, tensor_map.rows, tensor_map.cols,
                                                                   tensor_map.box), 128)
                entry.encoded_for = address
        grid, block = self.launch.grid, self.launch.block
        check(driver.cuLaunchKernel(self.function, *grid, *block, self.launch.shared_bytes, stream,
                                    ctypes.addressof(self.params), 0), f"launch {self.launch.function}")


class _Binding:
    """Everything one set of input shapes needs: lowering, folded values, prepared launches."""

    def __init__(self, state: Any, lowered: Lowered) -> None:  # state: runner.CudaEngineState
        self.lowered = lowered
        for name, (source, transform) in lowered.weight_transforms.items():
            state.derived_weight(name, source, transform)
        self.folded = {name: DeviceBuffer.from_array(v) for name, v in lowered.folded.items()}
        state.ensure_pointwise(lowered.kernels)
        self.prepared: dict[int, _PreparedLaunch] = {}
        for step in lowered.steps:
            for op in step.ops:
                for launch in [op] if isinstance(op, Launch) else op.fallback + op.rest if isinstance(op, Conv) else []:
                    self.prepared[id(launch)] = _PreparedLaunch(launch, state.function(launch.module, launch.function))
        #: infer's device buffers and pinned host mirrors per I/O tensor (made on first use)
        self.stages: dict[str, Any] = {}  # runner_staging._Stage
        #: the whole-mirror uploads of the inputs and downloads of the outputs, captured with the run
        self.staged: Any = None  # runner_staging.StagedCopies
        #: the same per staging slot above 0: (stages over the same device buffers, their copies)
        self.twins: dict[int, tuple[dict[str, Any], Any]] = {}
        self.has_host = any(isinstance(op, Host) for step in lowered.steps for op in step.ops)
        #: the layers run on the host after the device part (host_tail.py), or None
        self.tail = lowered.tail
        #: the tensors the device part writes to I/O memory: the graph outputs it computes, and the boundary
        #: tensors its host tail reads
        self.output_names: list[str] = (lowered.tail.device if lowered.tail is not None
                                        else state.plan.graph).output_names
        self.has_conv_epilogues = any(isinstance(op, Conv) and op.rest for step in lowered.steps for op in step.ops)
        self.graphs: dict[tuple, Any] = {}  # runner_graphs._Graph by graph_key
        self.graph_failed = False
        #: the first captured graph was replayed against a layer-by-layer run (``_replay_matches``)
        self.verified = False
        #: cuDNN runs only conv + bias (residual and activation as kernels): set when a capture with the full
        #: epilogue in cuDNN did not reproduce; the capture is then tried once more this way
        self.conv_bias_only = False
        self.runs = 0
        self.streamed = state.streamed_sizes  # fixed for the binding's life (place_weights drops bindings)
        self.inputs = frozenset(v.name for v in state.plan.graph.inputs)
        self._schedules: dict[tuple, RunSchedule] = {}
        self.events = _Events()
        #: device copies of debug tensors the arena does not hold as the listener expects (see _debug_pointer)
        self.debug_buffers: dict[str, DeviceBuffer] = {}

    def schedule(self, consumed: bool = False, debug: tuple[str, ...] = ()) -> RunSchedule:
        """The run schedule for these options, made once per binding."""
        key = (consumed, debug)
        if key not in self._schedules:
            self._schedules[key] = run_schedule(self.lowered, self.streamed, self.inputs, consumed, debug)
        return self._schedules[key]


def blocking_waits() -> bool:
    """Whether a thread waiting for a run sleeps (``CU_EVENT_BLOCKING_SYNC``) rather than spins on a core:
    ``KILN_BLOCKING_SYNC=0`` spins. Why sleep by default: a server's worker lanes wait for most of each run, and
    spinning took a core each from the frontends, the core and clients on the same host (``load_tests/
    execution_path.py`` reached 21k ResNet-50 img/s from mapped host memory alone, the served path 8-9k)."""
    return os.environ.get("KILN_BLOCKING_SYNC", "1") not in ("0", "")


class _Events:
    """Internal CUDA events of a binding's runs by name (timing off: they only order streams; blocking sync:
    a host wait sleeps, `blocking_waits`)."""

    def __init__(self) -> None:
        self._events: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        event = self._events.get(name)
        if event is None:
            from cuda.bindings import driver

            flags = int(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING)
            if blocking_waits():
                flags |= int(driver.CUevent_flags.CU_EVENT_BLOCKING_SYNC)
            event = self._events[name] = check(driver.cuEventCreate(flags), "cuEventCreate")
        return event

    def __del__(self) -> None:
        try:
            from cuda.bindings import driver

            for event in self._events.values():
                driver.cuEventDestroy(event)
        except Exception:
            pass


class BindingMixin:
    """CudaContextState's bindings by input shapes, its arena and the pointer resolver."""

    def bind(self, shapes: Shapes, values: Mapping[str, np.ndarray] | None = None) -> _Binding:
        """The binding for these input shapes (lowered, arena sized), made on first use.

        ``values``: host values of small integer inputs, for graphs whose shapes depend on input values
        (shape-tensor style inputs such as Reshape's shape or Squeeze's axes fed at run time); the
        binding is then keyed on those values too. Without them such graphs raise ShapesNeedValues. Layers whose
        output shapes depend on data (and, once ``values`` are given, any whose shape is still unknown) and the
        layers after them are the binding's host tail (``_Binding.tail``).
        """
        key = tuple(sorted((k, tuple(v)) for k, v in shapes.items()))
        if values:
            key += tuple(sorted((k, v.dtype.str, tuple(v.shape), v.tobytes()) for k, v in values.items()))
        binding = self._bindings.get(key)
        if binding is None:
            graph = self.engine.plan.graph
            infos = {v.name: TensorInfo(v.dtype, tuple(shapes[v.name]) if v.is_tensor else None,
                                        (values or {}).get(v.name)) for v in graph.inputs}
            inferred = infer_shapes(graph, infos, values=True)
            try:  # data-dependent shapes leave a host tail (host_tail.py); with values given, any unknown shape does
                lowered = lower_split(graph, inferred, self.engine.gemm_choice, self.engine.options, values is not None)
            except Unsupported as e:
                raise ShapesNeedValues(f"{e}: the CUDA backend needs every tensor shape before launching "
                                       "(feed such inputs through infer(), or declare them shape inputs)") from None
            need = max(lowered.memory.size, self.engine.plan.device_memory_size, 1)
            if self.arena is not None and self.arena.nbytes < lowered.memory.size and self._user_memory:
                raise ExecutionError(f"the device memory given to this context ({self.arena.nbytes} bytes) is "
                                     f"smaller than these shapes need ({lowered.memory.size} bytes)")
            if self.arena is None or self.arena.nbytes < lowered.memory.size:
                self.arena = DeviceBuffer(need)
                self.forget_graphs()  # they captured the old arena's addresses
            binding = self._bindings[key] = _Binding(self.engine, lowered)
        return binding

    def use_memory(self, ptr: int, size: int) -> None:
        """Activations live in caller-owned device memory from now on (USER_MANAGED strategy)."""
        self.arena = UserMemory(ptr, size)
        self._user_memory = True
        self.forget_graphs()  # they captured the old arena's addresses

    def forget_graphs(self) -> None:
        """Drop every binding's captured CUDA graphs: memory they captured (the activation arena, a scratch slot, a
        library's workspace) was replaced; the next runs capture again."""
        for binding in self._bindings.values():
            binding.graphs.clear()

    def _resolver(self, binding: _Binding, addresses: Mapping[str, int]) -> tuple[Any, dict[str, int]]:
        """``resolve(Ref) -> device pointer`` and the dict of streamed weights' slot addresses that the
        run loop refills before each step (a streamed weight has an address only in its step)."""
        locations, weights, folded = binding.lowered.locations, self.engine.weights, binding.folded
        base = self.arena.ptr if self.arena is not None else 0
        current: dict[str, int] = {}

        def resolve(ref: Ref) -> int:
            kind, key = locations[ref.tensor]
            if kind == "arena":
                return base + key + ref.offset
            if kind == "io":
                if key not in addresses:
                    raise ExecutionError(f"no device address set for '{key}'")
                return addresses[key] + ref.offset
            if kind == "weight":
                buffer = weights.get(key)
                if buffer is not None:
                    return buffer.ptr + ref.offset
                if key not in current:
                    raise ExecutionError(f"weight '{key}' is streamed but this step has no upload of it")
                return current[key] + ref.offset
            return folded[key].ptr + ref.offset

        return resolve, current
