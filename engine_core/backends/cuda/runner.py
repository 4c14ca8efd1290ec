"""The CUDA runner: lowered steps -> kernel launches, cuBLAS calls and copies on one stream.

``CudaEngineState`` holds what all contexts of an engine share (loaded CUBINs, weights uploaded
once); ``CudaContextState`` holds one context's arena and its per-input-shape bindings (lowering,
folded shape values on the device, prepared kernel parameter blocks).

Weight streaming (``engine_core.weight_streaming``): weights the engine's budget does not keep
resident live in pinned host memory; each run uploads them on a second (copy) stream into two
scratch slots per context, ordered by events (a layer waits for its slot's upload, an upload waits
for the slot's previous reader). What a run enqueues, in host order, is a pure ``RunSchedule``
(``run_schedule``) that the device path interprets and the CPU tests check without a GPU; it also
places the input-consumed event and the debug-listener callbacks.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import weakref
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine_core.backends.cpu import GraphRunner, run_node, run_scoped
from engine_core.backends.cuda.gemm import run_kiln_gemm
from engine_core.backends.cuda.int8_gemm import Int8Gemm
from engine_core.backends.cuda.lowering import lower_graph
from engine_core.backends.cuda.lowering_context import (
    ON_DEMAND_KERNEL_FILES,
    Conv,
    Copy,
    Gemm,
    Host,
    Launch,
    Lowered,
    LoweringOptions,
    Ref,
    Step,
    TensorMap,
    transform_weight,
)
from engine_core.backends.cuda.pointwise import Unsupported
from engine_core.batching import Span, check_destination, gather_rows, is_batched, part_shape, split_outputs
from engine_core.cuda.driver import (
    DEVICE_LOCK,
    DeviceBuffer,
    Module,
    check,
    encode_tensor_map,
    launch_graph,
    primary_context,
)
from engine_core.cuda.view import DeviceView
from engine_core.errors import ExecutionError
from engine_core.ir import Value
from engine_core.ir.graph import has_subgraph, subgraph_reads
from engine_core.logger import DEFAULT_LOGGER, Severity
from engine_core.ops import TensorInfo
from engine_core.passes import infer_shapes
from engine_core.plan import Plan
from engine_core.refittable import refittable_names
from engine_core.types import TensorLocation, datatype_of
from engine_core.weight_streaming import LayerWeights, StreamingPlan, plan_streaming

Shapes = Mapping[str, tuple[int, ...]]
#: captured graphs kept per input-shape binding (one per distinct set of I/O addresses)
MAX_GRAPHS_PER_SHAPE = 4
#: KILN_CUDNN_HEURISTIC=1: run every convolution with cuDNN's first heuristic plan (ignore the autotuned
#: choice): for telling a tuning problem from a kernel problem
HEURISTIC_CONV_PLANS = os.environ.get("KILN_CUDNN_HEURISTIC", "0") == "1"
#: integer inputs up to this many elements may key a binding when shapes depend on their values
MAX_SHAPE_VALUES = 4096
#: runs warm_up may take to capture and verify a graph: eager, captured; again if cuDNN's epilogue did not
#: reproduce (see execute); and slack for a workspace that grew meanwhile
MAX_WARM_UP_RUNS = 6
#: the legacy default stream (0, CU_STREAM_LEGACY) and the per-thread one (CU_STREAM_PER_THREAD): runs given these
#: fork onto the context's own stream, where CUDA graphs can be captured and replayed
DEFAULT_STREAMS = frozenset({0, 1, 2})


class UserMemory:
    """Caller-owned device memory used as a context's arena (not freed by Kiln)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr, self.nbytes = ptr, nbytes


class HostValueNotTensor(ExecutionError):
    """A host layer produced a sequence / optional / map: only a whole-graph host run can carry it."""


class ShapesNeedValues(ExecutionError):
    """Some tensor shapes depend on input values the binding was not given."""


# -- what one run enqueues (pure: no driver, checked on CPU) -------------------------------------------

#: the two streams a run uses: the context's (compute) stream and its copy stream
COMPUTE, COPY = "compute", "copy"
#: one enqueue action, in host order:
#:   ("step", i)                      run lowered step i on the compute stream
#:   ("record", stream, event)        record an internal event ("start", "ready<k>", "done<i>")
#:   ("wait", stream, event)          make ``stream`` wait for an internal event
#:   ("upload", k)                    copy streaming step k's weights into its slot (copy stream)
#:   ("consumed",)                    record the user's input-consumed event (compute stream)
#:   ("debug", name)                  hand debug tensor ``name`` to the debug listener
Action = tuple


@dataclass(frozen=True)
class RunSchedule:
    """One run's actions in host order, and where each step finds its streamed weights."""

    actions: tuple[Action, ...]
    #: step index -> {weight key: (slot, byte offset in the slot)} for the weights it reads streamed
    streamed: dict[int, dict[str, tuple[int, int]]]
    #: the upload schedule over lowered steps (its layer indices are step indices)
    streaming: StreamingPlan
    #: internal events the actions record, by name
    events: tuple[str, ...]

    @property
    def uses_copy_stream(self) -> bool:
        return self.streaming.streaming


def step_reads(step: Step) -> list[str]:
    """Tensors a step addresses on the device (outputs too, harmlessly): every Ref of its ops, and a
    host layer's inputs (it fetches them itself)."""
    names = [n for n in step.node.inputs if n] if any(isinstance(op, Host) for op in step.ops) else []
    for op in step.ops:
        if isinstance(op, Launch):
            names += [r.tensor for r in op.refs()]
        elif isinstance(op, Gemm):
            names += [r.tensor for r in (op.a, op.b, op.y, op.bias) if r is not None]
        elif isinstance(op, Conv):
            names += [r.tensor for r in op.refs()]
            names += [r.tensor for launch in op.fallback for r in launch.refs()]
        elif isinstance(op, Copy):
            names.append(op.src.tensor)
        elif isinstance(op, Int8Gemm):
            names += [r.tensor for r in op.refs()]
    return names


def _located(lowered: Lowered, step: Step, kind: str) -> list[str]:
    """Keys of the given location kind ("weight", "io") that a step reads, in first-use order."""
    keys = []
    for name in step_reads(step):
        location = lowered.locations.get(name)
        if location is not None and location[0] == kind:
            keys.append(location[1])
    return list(dict.fromkeys(keys))


def streamed_reads(lowered: Lowered, streamed: Mapping[str, int]) -> list[LayerWeights]:
    """Per lowered step (named by its index), the streamed weights it reads: ``(key, nbytes)``."""
    return [(str(index), [(key, streamed[key]) for key in _located(lowered, step, "weight") if key in streamed])
            for index, step in enumerate(lowered.steps)]


def last_input_reader(lowered: Lowered, inputs: Collection[str]) -> int:
    """Index of the last step that reads a graph input (views of inputs included); -1 when none does."""
    last = -1
    for index, step in enumerate(lowered.steps):
        if any(key in inputs for key in _located(lowered, step, "io")):
            last = index
    return last


def debug_positions(lowered: Lowered, names: Iterable[str]) -> dict[int, list[str]]:
    """Step index after which each debug tensor is reported: its (last) producer; -1 (before the first
    step) for tensors no step writes (inputs, weights, values known on the host)."""
    producer: dict[str, int] = {}
    for index, step in enumerate(lowered.steps):
        for name in step.node.outputs:
            if name:
                producer[name] = index
    positions: dict[int, list[str]] = {}
    for name in sorted(names, key=lambda n: (producer.get(n, -1), n)):
        positions.setdefault(producer.get(name, -1), []).append(name)
    return positions


def run_schedule(lowered: Lowered, streamed: Mapping[str, int], inputs: Collection[str] = (),
                 consumed: bool = False, debug: Sequence[str] = ()) -> RunSchedule:
    """The actions of one run.

    ``streamed``: weight key -> nbytes of the weights that live in host memory (all > 0). Their
    uploads follow ``plan_streaming`` over the lowered steps: step k's uploads are enqueued on the copy
    stream right after the compute stream recorded "done" of the slot's previous reader (or, for the
    first two, after "start", which also orders them after the previous run), and step k waits for
    "ready<k>". The waits are also what puts the copy stream into a CUDA-graph capture (fork at
    "start") and back (every "ready" is joined by the compute stream). ``consumed``: record the
    input-consumed event after the last step reading a graph input. ``debug``: report those tensors
    right after the step producing them, while stream order still guarantees their bytes.
    """
    plan = plan_streaming(streamed_reads(lowered, streamed), 0)
    by_after: dict[int, list[int]] = {}
    for k, sstep in enumerate(plan.steps):
        by_after.setdefault(sstep.issue_after, []).append(k)
    ready_for = {sstep.layer_index: k for k, sstep in enumerate(plan.steps)}
    done_after = {sstep.issue_after for sstep in plan.steps if sstep.issue_after >= 0}
    reports = debug_positions(lowered, debug)
    consumed_after = last_input_reader(lowered, inputs) if consumed else None
    actions: list[Action] = []

    def issue(k: int) -> None:
        after = plan.steps[k].issue_after
        if after >= 0:
            actions.append(("wait", COPY, f"done{after}"))
        actions.append(("upload", k))
        actions.append(("record", COPY, f"ready{k}"))

    if plan.steps:
        actions += [("record", COMPUTE, "start"), ("wait", COPY, "start")]
        for k in by_after.get(-1, []):
            issue(k)
    if consumed_after == -1:
        actions.append(("consumed",))
    actions += [("debug", name) for name in reports.get(-1, [])]
    for index in range(len(lowered.steps)):
        if index in ready_for:
            actions.append(("wait", COMPUTE, f"ready{ready_for[index]}"))
        actions.append(("step", index))
        if index in done_after:
            actions.append(("record", COMPUTE, f"done{index}"))
        if consumed_after == index:
            actions.append(("consumed",))
        actions += [("debug", name) for name in reports.get(index, [])]
        for k in by_after.get(index, []):
            issue(k)
    placed = {s.layer_index: {u.weight: (s.slot, u.offset) for u in s.uploads} for s in plan.steps}
    events = tuple(dict.fromkeys(a[2] for a in actions if a[0] == "record"))
    return RunSchedule(tuple(actions), placed, plan, events)


class PinnedBuffer:
    """Page-locked host memory (cuMemHostAlloc), freed with the object. Why pinned: only copies from
    page-locked memory run asynchronously on the copy stream (and may be captured in CUDA graphs)."""

    def __init__(self, nbytes: int) -> None:
        from cuda.bindings import driver

        primary_context()
        self.nbytes = int(nbytes)
        self.ptr = int(check(driver.cuMemHostAlloc(max(self.nbytes, 1), 0), "cuMemHostAlloc"))

    @staticmethod
    def from_array(array: np.ndarray) -> PinnedBuffer:
        buf = PinnedBuffer(np.asarray(array).nbytes)
        buf.copy_from(array)
        return buf

    def copy_from(self, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array)
        if array.nbytes != self.nbytes:
            raise ExecutionError(f"cannot write {array.nbytes} bytes into a {self.nbytes}-byte host weight buffer")
        if array.nbytes:
            ctypes.memmove(self.ptr, array.ctypes.data, array.nbytes)

    def view(self, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """A numpy array over this memory (valid while the buffer lives: keep both together)."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        if count * dtype.itemsize > self.nbytes:
            raise ExecutionError(f"a {dtype} array of shape {list(shape)} does not fit {self.nbytes} pinned bytes")
        if count == 0:
            return np.empty(shape, dtype)
        raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(self.ptr)
        return np.frombuffer(raw, dtype=dtype).reshape(shape)

    def __del__(self) -> None:
        try:
            from cuda.bindings import driver

            with DEVICE_LOCK:
                driver.cuMemFreeHost(self.ptr)
        except Exception:
            pass


class CudaEngineState:
    """Per engine: modules from the plan's CUBINs and the weights, on the device once.

    Plans built with WEIGHT_STREAMING place their streamable weights when the first context is made
    (``place_weights``, at the engine's budget then): uploading them all at load time would defeat
    streaming for models larger than the device, and the budget may only change while no context exists.
    """

    def __init__(self, plan: Plan) -> None:
        primary_context()
        self.plan = plan
        self.modules = {name: Module(cubin) for name, cubin in plan.kernels.items()}
        self._functions: dict[tuple[str, str], Any] = {}
        streaming = "WEIGHT_STREAMING" in plan.build_info.get("flags", [])
        #: weights a budget may leave in host memory (none without BuilderFlag.WEIGHT_STREAMING)
        self.streamable = frozenset(refittable_names(plan.graph)) if streaming else frozenset()
        self.weights = {name: DeviceBuffer.from_array(np.ascontiguousarray(value))
                        for name, value in plan.graph.constants.items()
                        if isinstance(value, np.ndarray) and value.dtype.kind not in "OSU" and name not in self.streamable}
        #: streamed weights (and their derived layouts) in pinned host memory, uploaded every run
        self.host_weights: dict[str, PinnedBuffer] = {}
        self.streamed: frozenset[str] = frozenset()
        self._placed = not self.streamable
        self.gemm_choice = {layer["name"]: layer["tactic"].split(":", 1)[1] for layer in plan.layers
                            if str(layer.get("tactic", "")).startswith("gemm:")}
        self.options = lowering_options(plan)
        #: cuDNN execution plan chosen at build time per convolution signature (heuristics' first otherwise)
        self.conv_plans: dict[str, int] = dict(plan.build_info.get("cuda", {}).get("conv_plans", {}))
        if self.options.cudnn:
            from engine_core.backends.cuda.cudnn_conv import available

            if not available():
                raise ExecutionError("this plan runs convolutions with cuDNN, but the cuDNN frontend is not "
                                     "installed here (pip install kiln[gpu])")
        self.contexts: weakref.WeakSet[CudaContextState] = weakref.WeakSet()

    def place_weights(self, streamed: Iterable[str]) -> None:
        """Keep ``streamed`` weights in pinned host memory and every other streamable one on the device.

        Device copies are freed before new ones are made (peak memory); derived layouts of streamable
        weights are dropped and remade by the next binding where their source now lives. Existing
        contexts (normally none: the budget cannot change while contexts exist) re-bind.
        """
        constants = self.plan.graph.constants
        wanted = frozenset(n for n in streamed if n in self.streamable and constants[n].nbytes > 0)
        if self._placed and wanted == self.streamed:
            return
        for ctx in self.contexts:
            ctx._bindings.clear()
        derived = [d for d in (*self.weights, *self.host_weights) if "#" in d and d.split("#", 1)[0] in self.streamable]
        for name in derived:
            self.weights.pop(name, None)
            self.host_weights.pop(name, None)
        for name in self.streamable:
            (self.weights if name in wanted else self.host_weights).pop(name, None)
        for name in sorted(self.streamable):
            if name in wanted and name not in self.host_weights:
                self.host_weights[name] = PinnedBuffer.from_array(constants[name])
            elif name not in wanted and name not in self.weights:
                self.weights[name] = DeviceBuffer.from_array(np.ascontiguousarray(constants[name]))
        self.streamed, self._placed = wanted, True

    @property
    def streamed_sizes(self) -> dict[str, int]:
        """Weight key -> nbytes of everything a run uploads (streamed weights and their derived layouts)."""
        return {name: buf.nbytes for name, buf in self.host_weights.items()}

    def function(self, module: str, name: str) -> Any:
        key = (module, name)
        if key not in self._functions:
            if module not in self.modules:  # an on-demand kernel file the build's shapes did not use: compile it now
                from engine_core.cuda.nvrtc import compile_kernel_file

                if module not in ON_DEMAND_KERNEL_FILES:
                    raise KeyError(f"kernel module '{module}' is not in this plan")
                self.modules[module] = Module(compile_kernel_file(module, self.plan.arch))
            self._functions[key] = self.modules[module].function(name)
        return self._functions[key]

    def ensure_pointwise(self, kernels: list) -> None:
        """Make every generated kernel of a binding launchable: one the build did not compile (shapes
        that were only known at run time, e.g. from input values) is compiled by NVRTC now."""
        missing = []
        for kernel in kernels:
            try:
                self.function("pointwise", kernel.name)
            except Exception:
                missing.append(kernel)
        if not missing:
            return
        from engine_core.backends.cuda.pointwise import POINTWISE_OPTIONS, pointwise_source
        from engine_core.cuda.nvrtc import compile_cubin

        module = Module(compile_cubin(pointwise_source(missing), "pointwise_runtime.cu", self.plan.arch,
                                      POINTWISE_OPTIONS))
        self.modules[f"pointwise#{len(self.modules)}"] = module
        for kernel in missing:
            self._functions[("pointwise", kernel.name)] = module.function(kernel.name)

    def derived_weight(self, name: str, source: str, transform: str) -> DeviceBuffer | PinnedBuffer:
        """A weight in another layout (e.g. KRSC filters), made once per engine: on the device, or in
        pinned host memory when its source is streamed (it is then streamed too)."""
        if name in self.weights:
            return self.weights[name]
        if name in self.host_weights:
            return self.host_weights[name]
        value = transform_weight(self.plan.graph.constants[source], transform)
        if source in self.streamed:
            self.host_weights[name] = PinnedBuffer.from_array(value)
            return self.host_weights[name]
        self.weights[name] = DeviceBuffer.from_array(value)
        return self.weights[name]

    def create_context(self, streamed: Iterable[str] = ()) -> CudaContextState:
        """A context's state; ``streamed``: the weights the engine's budget leaves in host memory."""
        self.place_weights(streamed)
        state = CudaContextState(self)
        self.contexts.add(state)
        return state

    def refit(self, weights: Mapping[str, np.ndarray]) -> None:
        """Overwrite weights in place, on the device or (streamed) in pinned host memory: captured CUDA
        graphs keep their addresses and upload the new bytes from their next replay on. Drops
        per-shape bindings, whose host-folded values may have read the old weights."""
        if any(key.split("#", 1)[0] in weights for key in self.host_weights):
            from engine_core.cuda.driver import synchronize

            synchronize()  # no upload may be reading a host copy while it is overwritten
        for name, value in weights.items():
            for store in (self.weights, self.host_weights):
                if name in store:
                    store[name].copy_from(np.ascontiguousarray(value))
                for derived in [d for d in store if d.startswith(f"{name}#")]:
                    transform = derived.split("#", 1)[1]
                    store[derived].copy_from(transform_weight(np.asarray(value), transform))
        for ctx in self.contexts:
            ctx._bindings.clear()


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


class _Stage:
    """One I/O tensor of a binding as ``infer`` moves it: the device buffer the plan reads or writes and a
    page-locked host mirror (with a numpy view of it). Why pinned: a copy from pageable memory is staged
    synchronously through the driver; from page-locked memory it is a DMA queued on the stream. Both are
    made once per binding, so every run of these shapes uses the same device addresses (its CUDA graph)."""

    def __init__(self, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        self.dtype, self.shape = np.dtype(dtype), tuple(int(d) for d in shape)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self.device = DeviceBuffer(self.nbytes)
        self.host = PinnedBuffer(self.nbytes)
        self.array = self.host.view(self.dtype, self.shape)
        #: bytes of one row along the leading dim (the whole tensor for scalars)
        self.row_bytes = self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.nbytes
        #: leading rows of the host mirror that may hold data; rows past it are zero (padding needs no clearing)
        self.written = self.shape[0] if self.shape else 0

    def fill(self, values: Sequence[np.ndarray]) -> None:
        """Host parts one after another into the mirror, the rows after them zero (cleared only where an
        earlier run wrote). A scalar tensor has one part, the whole value."""
        if not self.shape:
            np.copyto(self.array, values[0])
            return
        row = sum(int(value.shape[0]) for value in values)
        if len(values) == 1:
            np.copyto(self.array[:row], values[0])
        elif row:
            np.concatenate(values, out=self.array[:row])  # one C loop over the parts, not one call each
        if self.written > row:
            self.array[row:self.written] = 0
        self.written = row

    def upload(self, begin: int, end: int, stream: int) -> None:
        """Host mirror bytes [begin, end) -> the device buffer, queued on ``stream``."""
        from cuda.bindings import driver

        if end > begin:
            check(driver.cuMemcpyHtoDAsync(self.device.ptr + begin, self.host.ptr + begin, end - begin, stream),
                  "cuMemcpyHtoDAsync")

    def download(self, begin: int, end: int, stream: int) -> None:
        """Device bytes [begin, end) -> the host mirror, queued on ``stream``."""
        from cuda.bindings import driver

        if end > begin:
            check(driver.cuMemcpyDtoHAsync(self.host.ptr + begin, self.device.ptr + begin, end - begin, stream),
                  "cuMemcpyDtoHAsync")


@dataclass(frozen=True)
class StagedCopies:
    """Copies around one run, captured with it: (device, host, nbytes) uploads from pinned host mirrors before
    the run and (host, device, nbytes) downloads after it. Frozen and hashable: part of a graph's key."""

    uploads: tuple[tuple[int, int, int], ...] = ()
    downloads: tuple[tuple[int, int, int], ...] = ()

    def upload(self, stream: int) -> None:
        from cuda.bindings import driver

        for device, host, nbytes in self.uploads:
            check(driver.cuMemcpyHtoDAsync(device, host, nbytes, stream), "cuMemcpyHtoDAsync")

    def download(self, stream: int) -> None:
        from cuda.bindings import driver

        for host, device, nbytes in self.downloads:
            check(driver.cuMemcpyDtoHAsync(host, device, nbytes, stream), "cuMemcpyDtoHAsync")


class _Binding:
    """Everything one set of input shapes needs: lowering, folded values, prepared launches."""

    def __init__(self, state: CudaEngineState, lowered: Lowered) -> None:
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
        self.stages: dict[str, _Stage] = {}
        #: the whole-mirror uploads of the inputs and downloads of the outputs, captured with the run
        self.staged: StagedCopies | None = None
        self.has_host = any(isinstance(op, Host) for step in lowered.steps for op in step.ops)
        self.has_conv_epilogues = any(isinstance(op, Conv) and op.rest for step in lowered.steps for op in step.ops)
        self.graphs: dict[tuple, _Graph] = {}
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


class _Events:
    """Internal CUDA events of a binding's runs by name (timing off: they only order streams)."""

    def __init__(self) -> None:
        self._events: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        event = self._events.get(name)
        if event is None:
            from cuda.bindings import driver

            flags = int(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING)
            event = self._events[name] = check(driver.cuEventCreate(flags), "cuEventCreate")
        return event

    def __del__(self) -> None:
        try:
            from cuda.bindings import driver

            for event in self._events.values():
                driver.cuEventDestroy(event)
        except Exception:
            pass


class _Graph:
    """An instantiated CUDA graph (and the graph it came from), destroyed with the object."""

    def __init__(self, graph: Any, exec_: Any) -> None:
        self.graph, self.exec = graph, exec_

    def __del__(self) -> None:
        try:
            from cuda.bindings import driver

            driver.cuGraphExecDestroy(self.exec)
            driver.cuGraphDestroy(self.graph)
        except Exception:
            pass


class CudaContextState:
    """Per execution context: the activation arena and bindings by input shapes."""

    def __init__(self, engine: CudaEngineState) -> None:
        self.engine = engine
        self.arena: DeviceBuffer | None = None
        self._bindings: dict[tuple, _Binding] = {}
        self._user_memory = False
        self._cublas = None
        self._cublaslt = None
        self._int8 = None
        self._convs = None
        self._host_runner: GraphRunner | None = None
        #: why runs went to the host as a whole (data-dependent output shapes, non-tensor I/O)
        self.host_fallback: list[str] = []
        self._stream: int | None = None
        self._copy_stream: int | None = None
        #: the two weight-streaming scratch slots (device), sized for the largest binding's schedule
        self._slots: list[DeviceBuffer | None] = [None, None]
        self.use_graphs = os.environ.get("KILN_CUDA_GRAPHS", "1") != "0"
        #: "fork" / "join": order runs given a default stream against the context's own stream
        self._events = _Events()
        #: CUDA graph launches of live runs (verification replays excluded): what tests and benchmarks observe
        self.graph_replays = 0

    # -- binding ----------------------------------------------------------------------------------
    def bind(self, shapes: Shapes, values: Mapping[str, np.ndarray] | None = None) -> _Binding:
        """The binding for these input shapes (lowered, arena sized), made on first use.

        ``values``: host values of small integer inputs, for graphs whose shapes depend on input values
        (shape-tensor style inputs such as Reshape's shape or Squeeze's axes fed at run time); the
        binding is then keyed on those values too. Without them such graphs raise ExecutionError.
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
            unknown = [o for o in graph.output_names if inferred.get(o) is None or inferred[o].shape is None]
            try:
                if unknown:
                    raise Unsupported(f"output shapes of {unknown} depend on input values")
                lowered = lower_graph(graph, inferred, self.engine.gemm_choice, self.engine.options)
            except Unsupported as e:
                raise ShapesNeedValues(f"{e}: the CUDA backend needs every tensor shape before launching "
                                       "(feed such inputs through infer(), or declare them shape inputs)") from None
            need = max(lowered.memory.size, self.engine.plan.device_memory_size, 1)
            if self.arena is not None and self.arena.nbytes < lowered.memory.size and self._user_memory:
                raise ExecutionError(f"the device memory given to this context ({self.arena.nbytes} bytes) is "
                                     f"smaller than these shapes need ({lowered.memory.size} bytes)")
            if self.arena is None or self.arena.nbytes < lowered.memory.size:
                self.arena = DeviceBuffer(need)
                for other in self._bindings.values():  # graphs captured the old arena's addresses
                    other.graphs.clear()
            binding = self._bindings[key] = _Binding(self.engine, lowered)
        return binding

    def use_memory(self, ptr: int, size: int) -> None:
        """Activations live in caller-owned device memory from now on (USER_MANAGED strategy)."""
        self.arena = UserMemory(ptr, size)
        self._user_memory = True
        for binding in self._bindings.values():  # graphs captured the old arena's addresses
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

    # -- running ----------------------------------------------------------------------------------
    def execute(self, shapes: Shapes, addresses: Mapping[str, int], stream: int, profiler: Any = None,
                values: Mapping[str, np.ndarray] | None = None, debug: tuple[Any, Sequence[str]] | None = None,
                consumed_event: Any = None, staged: StagedCopies | None = None) -> None:
        """Run once on ``stream`` (any thread: the primary context is made current here).

        A default stream (``DEFAULT_STREAMS``: what ``execute_async_v3(0)`` and torch's default stream give)
        cannot be captured into a CUDA graph, so the run forks onto the context's own stream and joins
        back, as the reference runtime does: an event recorded on the caller's stream is waited for by
        the context's stream, the run (graph replay, capture, profiled or debug launches) goes there, and
        an event recorded after it is waited for by the caller's stream. The input-consumed event is then
        recorded on the context's stream; it still fires once no later layer reads an input.
        """
        primary_context()
        caller = int(stream)
        if caller not in DEFAULT_STREAMS:
            self._execute_on(shapes, addresses, caller, profiler, values, debug, consumed_event, staged)
            return
        from cuda.bindings import driver

        own = self.stream()
        check(driver.cuEventRecord(self._events["fork"], caller), "cuEventRecord(fork)")
        check(driver.cuStreamWaitEvent(own, self._events["fork"], 0), "cuStreamWaitEvent(fork)")
        try:
            self._execute_on(shapes, addresses, own, profiler, values, debug, consumed_event, staged)
        finally:  # whatever was enqueued, the caller's stream orders after it
            check(driver.cuEventRecord(self._events["join"], own), "cuEventRecord(join)")
            check(driver.cuStreamWaitEvent(caller, self._events["join"], 0), "cuStreamWaitEvent(join)")

    def _execute_on(self, shapes: Shapes, addresses: Mapping[str, int], stream: int, profiler: Any = None,
                    values: Mapping[str, np.ndarray] | None = None, debug: tuple[Any, Sequence[str]] | None = None,
                    consumed_event: Any = None, staged: StagedCopies | None = None) -> None:
        """Replay the captured graph when there is one; any other run (eager, capture, verification, profiled,
        debug) holds ``DEVICE_LOCK``: a library's first use or a synchronous copy on the legacy stream in one
        thread would break a capture going on in another (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)."""
        if profiler is None and not debug:
            binding = self.bind(shapes, values)
            graph = binding.graphs.get(graph_key(addresses, consumed_event, staged))
            if graph is not None and self.graphs_possible(binding):
                self._replay(graph, stream)
                return
        with DEVICE_LOCK:
            self._execute_locked(shapes, addresses, stream, profiler, values, debug, consumed_event, staged)

    def _execute_locked(self, shapes: Shapes, addresses: Mapping[str, int], stream: int, profiler: Any = None,
                        values: Mapping[str, np.ndarray] | None = None, debug: tuple[Any, Sequence[str]] | None = None,
                        consumed_event: Any = None, staged: StagedCopies | None = None) -> None:
        """Launch every step on ``stream`` (never a default stream); host syncs happen only around
        host-fallback layers.

        Why CUDA graphs: a layer costs ~10 us of Python to launch, more than most kernels run. The
        second run with the same shapes and I/O addresses is captured into a graph; later runs with
        those addresses replay it with one launch. Plans with host-fallback
        layers (they synchronize) and KILN_CUDA_GRAPHS=0 always launch layer by layer; with a
        ``profiler`` (IProfiler) each layer is timed with CUDA events and reported after the run.
        Streamed weights' uploads (copy stream) are part of the capture. ``debug``: (IDebugListener,
        tensor names): runs launch layer by layer (no replay) and report each tensor after its layer.
        ``consumed_event``: a CUevent recorded once no later step reads an input (captured as an
        external event node, so replays record it too). ``staged``: host <-> device copies of the I/O
        (``infer``'s pinned mirrors) enqueued before and after the run, and captured with it: a replay is then
        one launch for copies and run together (each driver call releases the interpreter lock, and with
        other threads busy getting it back costs up to a switch interval).
        """
        binding = self.bind(shapes, values)
        names = tuple(sorted(debug[1])) if debug is not None else ()
        schedule = binding.schedule(bool(consumed_event), names)
        self._ensure_slots(schedule)
        listener = debug[0] if names else None
        if profiler is not None:
            self._launch_profiled(binding, schedule, addresses, stream, profiler, consumed_event, listener, staged)
            return
        if listener is not None:
            self._launch_all(binding, schedule, addresses, stream, consumed_event, listener=listener,
                             staged=staged)
            return
        if not self.graphs_possible(binding):
            self._launch_all(binding, schedule, addresses, stream, consumed_event, staged=staged)
            return
        key = graph_key(addresses, consumed_event, staged)
        graph = binding.graphs.get(key)
        if graph is None:
            binding.runs += 1
            if binding.runs < 2:  # first run eagerly: library initialisation must not be captured
                self._launch_all(binding, schedule, addresses, stream, consumed_event, staged=staged)
                return
            graph = self._capture(binding, schedule, addresses, stream, consumed_event, staged)
            if graph is None:
                return
            if not binding.verified:
                if self._replay_matches(binding, graph, schedule, addresses, stream, consumed_event, staged):
                    binding.verified = True
                elif not binding.conv_bias_only and binding.has_conv_epilogues:
                    binding.conv_bias_only = True  # next runs: capture again with cuDNN doing conv + bias only
                    binding.runs = 0
                    # the replay was wrong
                    self._launch_all(binding, schedule, addresses, stream, consumed_event, staged=staged)
                    return
                else:
                    binding.verified = binding.graph_failed = True
                    DEFAULT_LOGGER.log(Severity.WARNING, f"CUDA plan '{self.engine.plan.name}': a captured CUDA graph "
                                       "did not reproduce the layer-by-layer results for these shapes; they run "
                                       "without graph replay")
                    # the replay was wrong
                    self._launch_all(binding, schedule, addresses, stream, consumed_event, staged=staged)
                    return
            if len(binding.graphs) >= MAX_GRAPHS_PER_SHAPE:
                binding.graphs.pop(next(iter(binding.graphs)))
            binding.graphs[key] = graph
        self._replay(graph, stream)

    def _replay(self, graph: _Graph, stream: int) -> None:
        """One launch of a captured run (counted in ``graph_replays``), keeping the interpreter lock."""
        launch_graph(graph.exec, stream)
        self.graph_replays += 1

    def graphs_possible(self, binding: _Binding) -> bool:
        """Whether runs of ``binding`` may be captured and replayed (host-fallback layers synchronize; a
        capture that failed or did not reproduce stays off; KILN_CUDA_GRAPHS=0)."""
        return self.use_graphs and not binding.has_host and not binding.graph_failed

    def _replay_matches(self, binding: _Binding, graph: _Graph, schedule: Any, addresses: Mapping[str, int],
                        stream: int, consumed_event: Any, staged: StagedCopies | None = None) -> bool:
        """Once per binding: run layer by layer, then replay the captured graph on the same inputs, and compare
        the outputs. Why: a library call that is not capture-safe (host-side argument staging, say) would
        otherwise replay wrong results silently; such bindings keep launching layer by layer."""
        from cuda.bindings import driver

        outputs = [(name, binding.lowered.infos[name]) for name in self.engine.plan.graph.output_names
                   if name in addresses and binding.lowered.infos.get(name) is not None]

        def fetch() -> list[np.ndarray]:
            check(driver.cuStreamSynchronize(stream), "cuStreamSynchronize")
            arrays = []
            for name, info in outputs:
                out = np.empty(info.shape, info.dtype)
                if out.nbytes:
                    check(driver.cuMemcpyDtoH(out.ctypes.data, addresses[name], out.nbytes), "cuMemcpyDtoH")
                arrays.append(out)
            return arrays

        self._launch_all(binding, schedule, addresses, stream, consumed_event, staged=staged)
        want = fetch()
        check(driver.cuGraphLaunch(graph.exec, stream), "cuGraphLaunch")
        got = fetch()
        for a, b in zip(want, got):
            if a.dtype.kind in "fc" or a.dtype.name == "bfloat16":
                a64, b64 = a.astype(np.float64), b.astype(np.float64)
                scale = max(1.0, float(np.nanmax(np.abs(a64)))) if a64.size else 1.0
                if a64.size and (not np.array_equal(np.isnan(a64), np.isnan(b64))
                                 or float(np.nanmax(np.abs(a64 - b64))) > 1e-3 * scale):
                    return False
            elif not np.array_equal(a, b):
                return False
        return True

    def _capture(self, binding: _Binding, schedule: RunSchedule, addresses: Mapping[str, int], stream: int,
                 consumed_event: Any, staged: StagedCopies | None = None) -> _Graph | None:
        """Capture one run into an instantiated graph; on failure, run eagerly and stop trying."""
        from cuda.bindings import driver

        mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        check(driver.cuStreamBeginCapture(stream, mode), "cuStreamBeginCapture")
        try:
            self._launch_all(binding, schedule, addresses, stream, consumed_event, capturing=True, staged=staged)
        except Exception:
            driver.cuStreamEndCapture(stream)
            binding.graph_failed = True
            raise
        graph = check(driver.cuStreamEndCapture(stream), "cuStreamEndCapture")
        try:
            return _Graph(graph, check(driver.cuGraphInstantiate(graph, 0), "cuGraphInstantiate"))
        except Exception:
            binding.graph_failed = True
            self._launch_all(binding, schedule, addresses, stream, consumed_event, staged=staged)
            return None

    def _launch_profiled(self, binding: _Binding, schedule: RunSchedule, addresses: Mapping[str, int], stream: int,
                         profiler: Any, consumed_event: Any = None, listener: Any = None,
                         staged: StagedCopies | None = None) -> None:
        from cuda.bindings import driver

        events = [check(driver.cuEventCreate(0), "cuEventCreate") for _ in range(len(binding.lowered.steps) + 1)]
        check(driver.cuEventRecord(events[0], stream), "cuEventRecord")
        self._launch_all(binding, schedule, addresses, stream, consumed_event, after_step=events[1:],
                         listener=listener, staged=staged)
        check(driver.cuEventSynchronize(events[-1]), "cuEventSynchronize")
        for step, start, stop in zip(binding.lowered.steps, events, events[1:]):
            profiler.report_layer_time(step.node.name, float(check(driver.cuEventElapsedTime(start, stop), "time")))
        for event in events:
            driver.cuEventDestroy(event)

    def _ensure_slots(self, schedule: RunSchedule) -> None:
        """Scratch slots at least as large as ``schedule`` needs; growing them invalidates captured graphs."""
        for slot, need in enumerate(schedule.streaming.slot_bytes):
            if need and (self._slots[slot] is None or self._slots[slot].nbytes < need):
                self._slots[slot] = DeviceBuffer(need)
                for binding in self._bindings.values():
                    binding.graphs.clear()

    def copy_stream(self) -> int:
        """The stream weight uploads run on (non-blocking: ordered by events only)."""
        if self._copy_stream is None:
            from cuda.bindings import driver

            flags = int(driver.CUstream_flags.CU_STREAM_NON_BLOCKING)
            self._copy_stream = int(check(driver.cuStreamCreate(flags), "cuStreamCreate"))
        return self._copy_stream

    def _launch_all(self, binding: _Binding, schedule: RunSchedule, addresses: Mapping[str, int], stream: int,
                    consumed_event: Any = None, after_step: list | None = None, capturing: bool = False,
                    listener: Any = None, staged: StagedCopies | None = None) -> None:
        """Enqueue one run: interpret ``schedule.actions`` on the compute and copy streams, between the
        ``staged`` uploads and downloads."""
        if staged is not None:
            staged.upload(stream)
        self._launch_steps(binding, schedule, addresses, stream, consumed_event, after_step, capturing, listener)
        if staged is not None:
            staged.download(stream)

    def _launch_steps(self, binding: _Binding, schedule: RunSchedule, addresses: Mapping[str, int], stream: int,
                      consumed_event: Any, after_step: list | None, capturing: bool, listener: Any) -> None:
        from cuda.bindings import driver

        resolve, current = self._resolver(binding, addresses)
        steps, events = binding.lowered.steps, binding.events
        streams = {COMPUTE: stream, COPY: self.copy_stream() if schedule.uses_copy_stream else stream}
        for action in schedule.actions:
            kind = action[0]
            if kind == "step":
                index = action[1]
                current.clear()
                for key, (slot, offset) in schedule.streamed.get(index, {}).items():
                    current[key] = self._slots[slot].ptr + offset
                self._run_step(steps[index], binding, resolve, stream)
                if after_step is not None:
                    check(driver.cuEventRecord(after_step[index], stream), "cuEventRecord")
            elif kind == "record":
                check(driver.cuEventRecord(events[action[2]], streams[action[1]]), "cuEventRecord")
            elif kind == "wait":
                check(driver.cuStreamWaitEvent(streams[action[1]], events[action[2]], 0), "cuStreamWaitEvent")
            elif kind == "upload":
                self._upload(schedule.streaming.steps[action[1]], streams[COPY])
            elif kind == "consumed":
                if capturing:  # a plain record inside a capture would only order the capture's own nodes
                    flag = int(driver.CUevent_record_flags.CU_EVENT_RECORD_EXTERNAL)
                    check(driver.cuEventRecordWithFlags(consumed_event, stream, flag), "cuEventRecordWithFlags")
                else:
                    check(driver.cuEventRecord(consumed_event, stream), "cuEventRecord(input consumed)")
            elif kind == "debug" and listener is not None:
                self._report_debug(listener, action[1], binding, resolve, stream)

    def _run_step(self, step: Step, binding: _Binding, resolve, stream: int) -> None:
        for op in step.ops:
            if isinstance(op, Launch):
                binding.prepared[id(op)].run(resolve, stream)
            elif isinstance(op, Gemm):
                self._gemm(op, resolve, stream)
            elif isinstance(op, Int8Gemm):
                self._int8_gemm(op, resolve, stream)
            elif isinstance(op, Conv):
                remaining = self._conv(op, resolve, stream, binding.conv_bias_only)
                for launch in op.fallback if remaining == "fallback" else op.rest if remaining == "rest" else []:
                    binding.prepared[id(launch)].run(resolve, stream)  # the epilogue cuDNN did not run
            elif isinstance(op, Copy):
                _memcpy_dtod(resolve(op.dst), resolve(op.src), op.nbytes, stream)
            elif isinstance(op, Host):
                self._host(op, binding, resolve, stream)

    def _upload(self, sstep: Any, copy_stream: int) -> None:
        """One streaming step's weights, pinned host -> its slot, on the copy stream."""
        from cuda.bindings import driver

        slot = self._slots[sstep.slot].ptr
        for upload in sstep.uploads:
            source = self.engine.host_weights[upload.weight]
            check(driver.cuMemcpyHtoDAsync(slot + upload.offset, source.ptr, upload.nbytes, copy_stream),
                  f"upload of streamed weight '{upload.weight}'")

    # -- debug tensors ------------------------------------------------------------------------------
    def _report_debug(self, listener: Any, name: str, binding: _Binding, resolve, stream: int) -> None:
        """Hand one debug tensor to the listener: a device pointer valid in ``stream`` order at the time of
        the call (the layers after it are not enqueued yet), in the linear layout of its logical shape."""
        info = binding.lowered.infos.get(name)
        if info is None or info.shape is None:
            raise ExecutionError(f"debug tensor '{name}' has no shape in this run")
        pointer = self._debug_pointer(name, info, binding, resolve, stream)
        listener.process_debug_tensor(pointer, TensorLocation.DEVICE, datatype_of(info.dtype), tuple(info.shape),
                                      name, stream)

    def _debug_pointer(self, name: str, info: TensorInfo, binding: _Binding, resolve, stream: int) -> int:
        """Where the listener reads ``name``: in place when it is linear and device-resident, else a copy in a
        per-binding buffer (channels-last activations, streamed weights, values known only on the host)."""
        from cuda.bindings import driver

        location = binding.lowered.locations.get(name)
        streamed = location is not None and location[0] == "weight" and location[1] not in self.engine.weights
        nhwc = binding.lowered.layouts.get(name) == "nhwc"
        if location is not None and not streamed and not nhwc:
            return resolve(Ref(name))
        nbytes = int(np.prod(info.shape, dtype=np.int64)) * info.dtype.itemsize
        if nhwc:  # the arena holds N,H,W,C: bring it to N,C,H,W
            n, c, h, w = info.shape
            raw = np.empty((n, h, w, c), info.dtype)
            check(driver.cuStreamSynchronize(stream), "cuStreamSynchronize")
            if nbytes:
                check(driver.cuMemcpyDtoH(raw.ctypes.data, resolve(Ref(name)), nbytes), "cuMemcpyDtoH")
            value = raw.transpose(0, 3, 1, 2)
        elif name in self.engine.plan.graph.constants:
            value = np.asarray(self.engine.plan.graph.constants[name])
        elif info.value is not None:
            value = np.asarray(info.value, info.dtype)
        else:
            raise ExecutionError(f"debug tensor '{name}' is not computed on the device in this run")
        buffer = binding.debug_buffers.get(name)
        if buffer is None or buffer.nbytes < nbytes:
            buffer = binding.debug_buffers[name] = DeviceBuffer(nbytes)
        if nbytes:
            array = np.ascontiguousarray(value)
            check(driver.cuMemcpyHtoDAsync(buffer.ptr, array.ctypes.data, nbytes, stream), "cuMemcpyHtoDAsync")
            check(driver.cuStreamSynchronize(stream), "cuStreamSynchronize")  # the host array is temporary
        return buffer.ptr

    def _gemm(self, op: Gemm, resolve, stream: int) -> None:
        a, b, y = resolve(op.a), resolve(op.b), resolve(op.y)
        if op.tactic == "cublaslt":
            if self._cublaslt is None:
                from engine_core.backends.cuda.cublaslt import CublasLt

                self._cublaslt = CublasLt()
            self._cublaslt.matmul(a, b, y, resolve(op.bias) if op.bias else 0, op.m, op.n, op.k, op.trans_a,
                                  op.trans_b, op.alpha, op.dtype, op.tf32, op.epilogue, stream)
            return
        if op.tactic == "cublas":
            if self._cublas is None:
                from engine_core.backends.cuda.cublas import Cublas

                self._cublas = Cublas()
            self._cublas.gemm(a, b, y, op.m, op.n, op.k, op.batch, op.trans_a, op.trans_b, op.a_strides[2],
                              op.b_strides[2], op.alpha, op.beta, stream, op.dtype, op.tf32)
            return
        run_kiln_gemm(self.engine.function("gemm", "gemm_f32"), op, a, b, y, stream)

    def _int8_gemm(self, op: Int8Gemm, resolve, stream: int) -> None:
        if self._int8 is None:
            from engine_core.backends.cuda.cublaslt import CublasLt
            from engine_core.backends.cuda.int8_gemm import Int8GemmRunner

            if self._cublaslt is None:
                self._cublaslt = CublasLt()
            self._int8 = Int8GemmRunner(self._cublaslt)  # shares the context's cuBLASLt handle and workspace
        self._int8.run(op, resolve, stream)

    def _conv(self, op: Conv, resolve, stream: int, bias_only: bool = False) -> str:
        """Run ``op`` through cuDNN; returns which of its epilogue lists the caller must run ("" / "rest" /
        "fallback", see CudnnConvs.run)."""
        if self._convs is None:
            from engine_core.backends.cuda.cudnn_conv import CudnnConvs

            self._convs = CudnnConvs()
        from engine_core.backends.cuda.cudnn_conv import signature

        before = self._convs.workspace_generation
        index = 0 if HEURISTIC_CONV_PLANS else self.engine.conv_plans.get(signature(op), 0)
        remaining = self._convs.run(op, resolve, stream, index, bias_only)
        if self._convs.workspace_generation != before:  # a new workspace: graphs captured the old one
            for binding in self._bindings.values():
                binding.graphs.clear()
        return remaining

    def _host(self, op: Host, binding: _Binding, resolve, stream: int) -> None:
        from cuda.bindings import driver

        node, infos = op.node, binding.lowered.infos
        check(driver.cuStreamSynchronize(stream), "cuStreamSynchronize")

        def fetch(name: str) -> np.ndarray:
            if name in self.engine.plan.graph.constants:
                return self.engine.plan.graph.constants[name]
            if infos.get(name) is not None and infos[name].value is not None:
                return infos[name].value
            info = infos[name]
            out = np.empty(info.shape, info.dtype)
            if out.nbytes:
                check(driver.cuMemcpyDtoH(out.ctypes.data, resolve(Ref(name)), out.nbytes), "cuMemcpyDtoH")
            return out

        args = [fetch(name) if name else None for name in node.inputs]
        try:
            if has_subgraph(node):  # bodies read enclosing tensors: hand them over as the scope
                scope = {name: fetch(name) for name in subgraph_reads(node) if name in binding.lowered.locations
                         or name in self.engine.plan.graph.constants or name in infos}
                results = run_scoped(node, args, scope)
            else:
                results = run_node(node, args)
        except Exception as e:
            raise ExecutionError(f"layer {node} (host fallback) failed: {type(e).__name__}: {e}") from e
        for name, value in zip(node.outputs, results):
            if not name:
                continue
            if value is None or isinstance(value, (list, tuple, dict)):
                raise HostValueNotTensor(f"layer {node} (host) produces a non-tensor value")
            info = infos[name]
            value = np.ascontiguousarray(np.asarray(value, dtype=info.dtype))
            if value.shape != tuple(info.shape) and value.size == int(np.prod(info.shape, dtype=np.int64)):
                value = value.reshape(info.shape)  # e.g. a (1,) result where inference says scalar
            if value.shape != tuple(info.shape):
                raise ExecutionError(f"layer {node}: host output '{name}' has shape {value.shape}, "
                                     f"shape inference said {info.shape}")
            if value.nbytes:
                check(driver.cuMemcpyHtoD(resolve(Ref(name)), value.ctypes.data, value.nbytes), "cuMemcpyHtoD")

    def _on_host(self, feeds: Mapping[str, np.ndarray], reason: str,
                 debug: tuple[Any, Sequence[str]] | None = None) -> dict[str, np.ndarray]:
        """The whole graph on the CPU backend, for runs the device path cannot plan ahead; logged once
        per reason and kept in ``host_fallback`` (the inspector's per-layer report covers planned runs).
        Debug tensors are then reported from host memory (TensorLocation.HOST), as the CPU backend does."""
        if reason not in self.host_fallback:
            self.host_fallback.append(reason)
            DEFAULT_LOGGER.log(Severity.WARNING, f"CUDA plan '{self.engine.plan.name}' runs on the host: {reason}")
        graph = self.engine.plan.graph
        if debug is not None and debug[1]:
            listener, names = debug[0], sorted(debug[1])
            extra = [Value(n, np.dtype(np.float32), None) for n in names if n not in set(graph.output_names)]
            results = GraphRunner(dataclasses.replace(graph, outputs=graph.outputs + extra)).run(feeds)
            order = {o: i for i, node in enumerate(graph.nodes) for o in node.outputs if o}
            for name in sorted(names, key=lambda n: (order.get(n, -1), n)):
                array = np.ascontiguousarray(results[name])
                listener.process_debug_tensor(array.ctypes.data, TensorLocation.HOST, datatype_of(array.dtype),
                                              tuple(array.shape), name, 0)
            return {name: results[name] for name in graph.output_names}
        if self._host_runner is None:
            self._host_runner = GraphRunner(graph)
        return self._host_runner.run(feeds)

    def stream(self) -> int:
        if self._stream is None:
            from cuda.bindings import driver

            self._stream = int(check(driver.cuStreamCreate(0), "cuStreamCreate"))
        return self._stream

    def _host_only(self) -> str:
        """Why no run of this plan can go to the device as a whole ("" when runs can)."""
        graph = self.engine.plan.graph
        if not all(v.is_tensor for v in (*graph.inputs, *graph.outputs)):
            return "sequence/optional/map inputs or outputs"
        if any(v.dtype.kind in "OSUV" for v in (*graph.inputs, *graph.outputs)):
            return "string inputs or outputs"
        return ""

    def _staging(self, binding: _Binding, shapes: Shapes) -> dict[str, _Stage]:
        """``binding``'s staging per I/O tensor (inputs at ``shapes``, outputs as inferred), made once, and
        the copies of whole mirrors that runs through them enqueue (``binding.staged``)."""
        graph, infos = self.engine.plan.graph, binding.lowered.infos
        for value in graph.inputs:
            if value.name not in binding.stages:
                binding.stages[value.name] = _Stage(value.dtype, shapes[value.name])
        for name in graph.output_names:
            if name not in binding.stages:
                binding.stages[name] = _Stage(infos[name].dtype, infos[name].shape)
        if binding.staged is None:
            stages = binding.stages
            binding.staged = StagedCopies(
                tuple((stages[v.name].device.ptr, stages[v.name].host.ptr, stages[v.name].nbytes)
                      for v in graph.inputs if stages[v.name].nbytes),
                tuple((stages[n].host.ptr, stages[n].device.ptr, stages[n].nbytes)
                      for n in graph.output_names if stages[n].nbytes))
        return binding.stages

    def infer(self, feeds: Mapping[str, np.ndarray], profiler: Any = None,
              debug: tuple[Any, Sequence[str]] | None = None) -> dict[str, np.ndarray]:
        """Host numpy in/out: inputs through pinned mirrors to device buffers, run on the context's stream,
        outputs back through pinned mirrors, one stream synchronization; returns fresh arrays (the mirrors
        are reused by the next run). ``debug``: (IDebugListener, tensor names) as in ``execute``."""
        primary_context()
        reason = self._host_only()
        if reason:
            return self._on_host(feeds, reason, debug)
        shapes = {name: tuple(np.shape(value)) for name, value in feeds.items()}
        values = None
        try:
            binding = self.bind(shapes)
        except ShapesNeedValues:
            values = {name: np.asarray(v) for name, v in feeds.items()
                      if np.asarray(v).dtype.kind in "iub" and np.asarray(v).size <= MAX_SHAPE_VALUES}
            try:
                binding = self.bind(shapes, values)
            except ShapesNeedValues as e:  # data-dependent output shapes (NonZero, NMS, Unique, ...)
                return self._on_host(feeds, str(e), debug)
        stream = self.stream()
        stages = self._staging(binding, shapes)
        addresses = {name: stage.device.ptr for name, stage in stages.items()}
        with _synchronized_on_error(stream):
            for name, value in feeds.items():
                stages[name].fill([np.asarray(value)])
            try:
                self.execute(shapes, addresses, stream, profiler, values, debug, staged=binding.staged)
            except HostValueNotTensor as e:  # a host layer produced a sequence/optional: the device cannot hold it
                _synchronize(stream)
                return self._on_host(feeds, str(e), debug)
            _synchronize(stream)
        return {name: stages[name].array.copy() for name in self.engine.plan.graph.output_names}

    def warm_up(self, feeds: Mapping[str, np.ndarray]) -> None:
        """Run ``feeds`` through ``infer`` until the CUDA graph for its staging buffers at these shapes is
        captured and verified (eager run, capture and verification, a second capture if cuDNN's fused
        epilogue did not reproduce): the next ``infer`` / ``infer_batch`` at these shapes replays it. Plans
        that run on the host, shapes that need input values and bindings without graphs run at most once."""
        primary_context()
        if self._host_only():
            return
        shapes = {name: tuple(np.shape(value)) for name, value in feeds.items()}
        try:
            binding = self.bind(shapes)
        except ShapesNeedValues:
            return
        for _ in range(MAX_WARM_UP_RUNS):
            self.infer(feeds)
            addresses = {name: stage.device.ptr for name, stage in self._staging(binding, shapes).items()}
            if not self.graphs_possible(binding) or graph_key(addresses, None, binding.staged) in binding.graphs:
                return

    def infer_batch(self, inputs: Mapping[str, Sequence[np.ndarray | DeviceView]], spans: Sequence[Span],
                    total: int, destinations: Sequence[Mapping[str, DeviceView]], profiler: Any = None,
                    debug: tuple[Any, Sequence[str]] | None = None) -> list[dict[str, np.ndarray]]:
        """``ExecutionContext.infer_batch`` on the device (inputs checked there): each input's parts are
        gathered into its staging buffers of the binding at ``total`` rows (the ones ``infer`` uses), padding
        zeroed on the device, one run, then each part's rows go to its destination (device to device) or
        through the pinned mirror to a fresh host array. Plans the device cannot run as a whole, or whose
        shapes need input values, gather on the host and go through ``infer``'s fallbacks."""
        primary_context()
        shapes = {name: (total, *values[0].shape[1:]) for name, values in inputs.items()}
        reason = self._host_only()
        if reason:
            outputs = self._on_host(self._gathered_on_host(inputs, total), reason, debug)
            return self._scatter(outputs, spans, total, destinations)
        try:
            binding = self.bind(shapes)
        except ShapesNeedValues:  # integer inputs decide shapes: infer binds on their values, or runs on the host
            outputs = self.infer(self._gathered_on_host(inputs, total), profiler, debug)
            return self._scatter(outputs, spans, total, destinations)
        stream = self.stream()
        stages = self._staging(binding, shapes)
        for index, (span, targets) in enumerate(zip(spans, destinations)):
            for name, view in targets.items():
                stage = stages[name]
                check_destination(name, index, view, part_shape(stage.shape, span, total), stage.dtype)
        addresses = {name: stage.device.ptr for name, stage in stages.items()}
        if not any(destinations) and not any(isinstance(v, DeviceView) for values in inputs.values() for v in values):
            return self._infer_staged(binding, stages, inputs, spans, total, addresses, stream, profiler, debug)
        with _synchronized_on_error(stream):
            for name, values in inputs.items():
                _gather(stages[name], values, total, stream)
            try:
                self.execute(shapes, addresses, stream, profiler, None, debug)
            except HostValueNotTensor as e:  # a host layer produced a sequence/optional: the device cannot hold it
                _synchronize(stream)
                outputs = self._on_host(self._gathered_on_host(inputs, total), str(e), debug)
                return self._scatter(outputs, spans, total, destinations)
            return self._deliver(stages, spans, total, destinations, stream)

    def _infer_staged(self, binding: _Binding, stages: Mapping[str, _Stage],
                      inputs: Mapping[str, Sequence[np.ndarray]], spans: Sequence[Span], total: int,
                      addresses: Mapping[str, int], stream: int, profiler: Any,
                      debug: tuple[Any, Sequence[str]] | None) -> list[dict[str, np.ndarray]]:
        """Host parts only: gathered into the pinned mirrors (padding zero there), then copies and run as one
        replayed graph, one sync, each part's rows copied out of the output mirrors. Two driver calls a run."""
        shapes = {name: stage.shape for name, stage in stages.items() if name in inputs}
        with _synchronized_on_error(stream):
            for name, values in inputs.items():
                stages[name].fill(values)  # type: ignore[arg-type]
            try:
                self.execute(shapes, addresses, stream, profiler, None, debug, staged=binding.staged)
            except HostValueNotTensor as e:  # a host layer produced a sequence/optional: the device cannot hold it
                _synchronize(stream)
                outputs = self._on_host(self._gathered_on_host(inputs, total), str(e), debug)
                return self._scatter(outputs, spans, total, [{} for _ in spans])
            _synchronize(stream)
        results: list[dict[str, np.ndarray]] = [{} for _ in spans]
        for name in self.engine.plan.graph.output_names:
            stage = stages[name]
            whole = _copy_out(stage.array)  # one copy out of the mirror; the parts get views of it
            batched = is_batched(stage.shape, total)
            for result, (start, stop) in zip(results, spans):
                result[name] = whole[start:stop] if batched else whole
        return results

    def _deliver(self, stages: Mapping[str, _Stage], spans: Sequence[Span], total: int,
                 destinations: Sequence[Mapping[str, DeviceView]], stream: int) -> list[dict[str, np.ndarray]]:
        """Each part's piece of every output: device to device into its destination, else one download of
        the rows parts want on the host (from the first such part's to the last's), then one sync."""
        results: list[dict[str, np.ndarray]] = [{} for _ in spans]
        on_host = []
        for name in self.engine.plan.graph.output_names:
            stage = stages[name]
            batched = is_batched(stage.shape, total)
            wanted = []
            for index, (start, stop) in enumerate(spans):
                begin, end = (start * stage.row_bytes, stop * stage.row_bytes) if batched else (0, stage.nbytes)
                view = destinations[index].get(name)
                if view is None:
                    wanted.append((index, begin, end))
                else:
                    _memcpy_dtod(view.ptr, stage.device.ptr + begin, end - begin, stream)
            if wanted:
                stage.download(wanted[0][1], wanted[-1][2], stream)
                on_host.append((name, stage, batched, [index for index, _, _ in wanted]))
        _synchronize(stream)
        for name, stage, batched, indices in on_host:
            for index in indices:
                start, stop = spans[index]
                results[index][name] = (stage.array[start:stop] if batched else stage.array).copy()
        return results

    def _gathered_on_host(self, inputs: Mapping[str, Sequence[np.ndarray | DeviceView]],
                          total: int) -> dict[str, np.ndarray]:
        """The batch as host arrays (device parts read back): for runs that go through ``infer`` or the host."""
        return {name: gather_rows([_read_view(v) if isinstance(v, DeviceView) else v for v in values], total)
                for name, values in inputs.items()}

    def _scatter(self, outputs: Mapping[str, np.ndarray], spans: Sequence[Span], total: int,
                 destinations: Sequence[Mapping[str, DeviceView]]) -> list[dict[str, np.ndarray]]:
        """Host outputs split per part; pieces with a destination are copied there (complete on return)."""
        from cuda.bindings import driver

        parts = split_outputs(outputs, spans, total)
        stream, pending = self.stream(), []
        for index, (part, targets) in enumerate(zip(parts, destinations)):
            for name, view in targets.items():
                piece = np.ascontiguousarray(part.pop(name))
                check_destination(name, index, view, piece.shape, piece.dtype)
                if piece.nbytes:
                    check(driver.cuMemcpyHtoDAsync(view.ptr, piece.ctypes.data, piece.nbytes, stream), "HtoD")
                pending.append(piece)  # alive until the copies are done
        _synchronize(stream)
        return parts


def _gather(stage: _Stage, values: Sequence[np.ndarray | DeviceView], total: int, stream: int) -> None:
    """One input's parts into its device buffer in order: host parts into the pinned mirror (one upload per
    run of consecutive host parts), device parts device to device, rows past the parts zeroed."""
    from cuda.bindings import driver

    row, pending = 0, None  # pending: first row of host parts not uploaded yet
    stage.written = stage.shape[0] if stage.shape else 0  # padding is zeroed on the device, not in the mirror
    for value in values:
        count = int(value.shape[0])
        if isinstance(value, DeviceView):
            if pending is not None:
                stage.upload(pending * stage.row_bytes, row * stage.row_bytes, stream)
                pending = None
            _memcpy_dtod(stage.device.ptr + row * stage.row_bytes, value.ptr, count * stage.row_bytes, stream)
        else:
            np.copyto(stage.array[row:row + count], value)
            pending = row if pending is None else pending
        row += count
    if pending is not None:
        stage.upload(pending * stage.row_bytes, row * stage.row_bytes, stream)
    if row < total:
        check(driver.cuMemsetD8Async(stage.device.ptr + row * stage.row_bytes, 0, (total - row) * stage.row_bytes,
                                     stream), "cuMemsetD8Async")


def _read_view(view: DeviceView) -> np.ndarray:
    """A host copy of a caller's device tensor (synchronous)."""
    from cuda.bindings import driver

    out = np.empty(view.shape, view.dtype)
    if out.nbytes:
        with DEVICE_LOCK:  # a legacy-stream copy: never during another thread's capture
            check(driver.cuMemcpyDtoH(out.ctypes.data, view.ptr, out.nbytes), "cuMemcpyDtoH")
    return out


@contextmanager
def _synchronized_on_error(stream: int) -> Iterator[None]:
    """On an exception, wait for ``stream`` before it propagates: copies queued from a pinned mirror must not
    still be reading it when the next run refills it."""
    try:
        yield
    except BaseException:
        try:
            _synchronize(stream)
        except Exception:
            pass
        raise


#: outputs up to this size leave the pinned mirror in a copy that keeps the interpreter lock (numpy's releases it,
#: and getting it back can cost more than the copy); larger ones let other threads run meanwhile
_COPY_HOLDING_LOCK_BYTES = 1 << 20


def _copy_out(array: np.ndarray) -> np.ndarray:
    """A writable copy of a pinned mirror's (contiguous) array."""
    if array.nbytes > _COPY_HOLDING_LOCK_BYTES:
        return array.copy()
    return np.frombuffer(bytearray(array.data), array.dtype).reshape(array.shape)


def _synchronize(stream: int) -> None:
    from cuda.bindings import driver

    check(driver.cuStreamSynchronize(stream), "cuStreamSynchronize")


def graph_key(addresses: Mapping[str, int], consumed_event: Any, staged: StagedCopies | None = None) -> tuple:
    """What a captured graph depends on beyond its binding: the I/O addresses, the input-consumed event and the
    staged copies captured with it."""
    return (*sorted(addresses.items()), ("#consumed", int(consumed_event or 0)), ("#staged", staged))


def lowering_options(plan: Plan) -> LoweringOptions:
    """The lowering choices the build recorded (TF32, cuDNN convolutions): runs must lower identically."""
    recorded = plan.build_info.get("cuda", {}).get("lowering", {})
    return LoweringOptions(**{f.name: bool(recorded.get(f.name, False)) for f in dataclasses.fields(LoweringOptions)})


def _memcpy_dtod(dst: int, src: int, nbytes: int, stream: int) -> None:
    from cuda.bindings import driver

    if nbytes:
        check(driver.cuMemcpyDtoDAsync(dst, src, nbytes, stream), "cuMemcpyDtoDAsync")
