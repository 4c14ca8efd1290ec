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

``CudaContextState`` is composed of units, one module each: runner_binding.py (input shapes -> lowering, folded
values, prepared launches, arena, pointer resolver), runner_graphs.py (CUDA graph capture, verification and replay),
runner_launch.py (layer-by-layer launching: eager, profiled, debug tensors, weight uploads), runner_staging.py (pinned
mirrors, ``_Stage``, gathering a batch and delivering its outputs), runner_schedule.py (the pure ``RunSchedule``) and
runner_context.py (the ExecutionContext's operations, the backend interface's ``ContextState``).
This module keeps the engine state and the context's entry points (execute, infer, infer_batch, warm_up, the host
tail after a binding's device part (host_tail.py), the whole-graph host fallback) and re-exports the names that lived
here.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from engine_core.backends.cuda import cudnn_plan_cache
from engine_core.backends.cuda.lowering_context import (
    ON_DEMAND_KERNEL_FILES,
    LoweringOptions,
    transform_weight,
)

# the units CudaContextState is composed of; names re-exported here (tests and users import them from this module)
from engine_core.backends.cuda.runner_binding import BindingMixin, Shapes
from engine_core.backends.cuda.runner_binding import HostValueNotTensor as HostValueNotTensor
from engine_core.backends.cuda.runner_binding import ShapesNeedValues as ShapesNeedValues
from engine_core.backends.cuda.runner_binding import UserMemory as UserMemory
from engine_core.backends.cuda.runner_binding import _Binding as _Binding
from engine_core.backends.cuda.runner_binding import _EncodedMap as _EncodedMap
from engine_core.backends.cuda.runner_binding import _Events as _Events
from engine_core.backends.cuda.runner_binding import _PreparedLaunch as _PreparedLaunch
from engine_core.backends.cuda.runner_context import ContextOpsMixin
from engine_core.backends.cuda.runner_graphs import MAX_GRAPHS_PER_SHAPE as MAX_GRAPHS_PER_SHAPE
from engine_core.backends.cuda.runner_graphs import GraphsMixin, graph_key
from engine_core.backends.cuda.runner_graphs import _Graph as _Graph
from engine_core.backends.cuda.runner_launch import LaunchMixin
from engine_core.backends.cuda.runner_schedule import COMPUTE as COMPUTE
from engine_core.backends.cuda.runner_schedule import COPY as COPY
from engine_core.backends.cuda.runner_schedule import Action as Action
from engine_core.backends.cuda.runner_schedule import RunSchedule as RunSchedule
from engine_core.backends.cuda.runner_schedule import debug_positions as debug_positions
from engine_core.backends.cuda.runner_schedule import last_input_reader as last_input_reader
from engine_core.backends.cuda.runner_schedule import run_schedule as run_schedule
from engine_core.backends.cuda.runner_schedule import step_reads as step_reads
from engine_core.backends.cuda.runner_schedule import streamed_reads as streamed_reads
from engine_core.backends.cuda.runner_staging import (
    STAGING_SLOTS,
    CopyTable,
    IoSlots,
    PinnedBuffer,
    StagingMixin,
    _gather,
    _synchronize,
    _synchronized_on_error,
    _wait,
)
from engine_core.backends.cuda.runner_staging import StagedCopies as StagedCopies
from engine_core.backends.cuda.runner_staging import _copy_out as _copy_out
from engine_core.backends.cuda.runner_staging import _memcpy_dtod as _memcpy_dtod
from engine_core.backends.cuda.runner_staging import _read_view as _read_view
from engine_core.backends.cuda.runner_staging import _Stage as _Stage
from engine_core.batching import Span, check_destination, part_shape
from engine_core.builder_config import recorded_knob
from engine_core.cuda.driver import (
    DEVICE_LOCK,
    DeviceBuffer,
    Module,
    check,
    memory_info,
    memset_d8_async,
    primary_context,
)
from engine_core.cuda.view import DeviceRows, DeviceView
from engine_core.errors import DeviceMemoryError, ExecutionError
from engine_core.interpret import GraphRunner
from engine_core.ir import Value
from engine_core.logger import DEFAULT_LOGGER, Severity
from engine_core.plan import Plan
from engine_core.refittable import refittable_names
from engine_core.types import TensorLocation, datatype_of

#: integer inputs up to this many elements may key a binding when shapes depend on their values
MAX_SHAPE_VALUES = 4096
#: runs warm_up may take to capture and verify a graph: eager, captured; again if cuDNN's epilogue did not
#: reproduce (see execute); and slack for a workspace that grew meanwhile
MAX_WARM_UP_RUNS = 6
#: the legacy default stream (0, CU_STREAM_LEGACY) and the per-thread one (CU_STREAM_PER_THREAD): runs given these
#: fork onto the context's own stream, where CUDA graphs can be captured and replayed
DEFAULT_STREAMS = frozenset({0, 1, 2})


def check_fits_device(weight_bytes: int, activation_bytes: int, free_bytes: int) -> None:
    """Refuse an engine whose weights cannot fit the device's free memory before uploading any of them, with the
    numbers (a bare CUDA_ERROR_OUT_OF_MEMORY halfway through the upload names neither). Only the weights decide:
    the activations (``device_memory_size``, at the profile's largest shapes) are allocated per binding, and
    smaller shapes may fit where the largest would not."""
    if weight_bytes > free_bytes:
        raise DeviceMemoryError(
            f"the engine does not fit the device: its weights need {weight_bytes:,} bytes of device memory and "
            f"{free_bytes:,} are free (its activations need up to {activation_bytes:,} more at the largest shapes); "
            "free memory on the device, use a smaller or FP16/INT8 build, or build with weight streaming")


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
        resident = {name: value for name, value in plan.graph.constants.items()
                    if isinstance(value, np.ndarray) and value.dtype.kind not in "OSU" and name not in self.streamable}
        check_fits_device(sum(value.nbytes for value in resident.values()), plan.device_memory_size,
                          memory_info()[0])
        self.weights = {name: DeviceBuffer.from_array(np.ascontiguousarray(value)) for name, value in resident.items()}
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


class CudaContextState(ContextOpsMixin, BindingMixin, GraphsMixin, LaunchMixin, StagingMixin):
    """Per execution context: the activation arena and bindings by input shapes (the ExecutionContext's operations
    on it: ``runner_context``)."""

    def __init__(self, engine: CudaEngineState) -> None:
        self.engine = engine
        self.arena: DeviceBuffer | None = None
        self._bindings: dict[tuple, _Binding] = {}
        self._user_memory = False
        self._cublas = None
        self._cublaslt = None
        self._int8 = None
        self._convs = None
        self._attentions = None  # cudnn_attention.CudnnAttentions, made on the first SdpaLaunch
        self._host_runner: GraphRunner | None = None
        #: why runs went to the host as a whole (shapes no input values settle, non-tensor I/O, debug tensors of a
        #: host tail)
        self.host_fallback: list[str] = []
        #: why runs ran a host tail after their device part (host_tail.py): its first data-dependent layers
        self.host_tails: list[str] = []
        self._stream: int | None = None
        self._copy_stream: int | None = None
        #: the two weight-streaming scratch slots (device), sized for the largest binding's schedule
        self._slots: list[DeviceBuffer | None] = [None, None]
        build_info = engine.plan.build_info if engine.plan is not None else None
        #: capture and replay CUDA graphs: BuilderConfig.cuda_graphs, recorded in the plan (KILN_CUDA_GRAPHS overrides)
        self.use_graphs: bool = recorded_knob(build_info, "cuda_graphs")
        #: cuDNN's first heuristic plan for every convolution, not the autotuned one: the plan's
        #: BuilderConfig.cudnn_heuristic_conv_plans (KILN_CUDNN_HEURISTIC overrides)
        self.heuristic_conv_plans: bool = recorded_knob(build_info, "cudnn_heuristic_conv_plans")
        #: BuilderConfig.cudnn_attention (KILN_CUDNN_ATTENTION overrides): False runs every attention's flash launch
        self.cudnn_attention: bool = recorded_knob(build_info, "cudnn_attention")
        #: "fork" / "join": order runs given a default stream against the context's own stream; "slot<i>": the
        #: end of the run in staging slot i
        self._events = _Events()
        #: runs in flight at once, each with pinned mirrors of its own (runner_staging says why)
        self._io_slots = IoSlots(STAGING_SLOTS)
        #: (slot, "gather" / "deliver") -> the copy_segments table of that slot's device copies (runner_staging)
        self._copy_tables: dict[tuple[int, str], CopyTable] = {}
        #: held while a run enqueues on the context's stream (bind, copies, launches or capture, its event)
        self._run_lock = threading.RLock()
        #: CUDA graph launches of live runs (verification replays excluded): what tests and benchmarks observe
        self.graph_replays = 0


    # -- running ----------------------------------------------------------------------------------
    def execute(self, shapes: Shapes, addresses: Mapping[str, int], stream: int, profiler: Any = None,
                values: Mapping[str, np.ndarray] | None = None, debug: tuple[Any, Sequence[str]] | None = None,
                consumed_event: Any = None, staged: StagedCopies | None = None, binding: _Binding | None = None
                ) -> None:
        """Run once on ``stream`` (any thread: the primary context is made current here). ``binding``: what
        ``bind(shapes, values)`` returned, when the caller has it (a run then builds no binding key again).

        A default stream (``DEFAULT_STREAMS``: what ``execute_async_v3(0)`` and torch's default stream give)
        cannot be captured into a CUDA graph, so the run forks onto the context's own stream and joins
        back, as the reference runtime does: an event recorded on the caller's stream is waited for by
        the context's stream, the run (graph replay, capture, profiled or debug launches) goes there, and
        an event recorded after it is waited for by the caller's stream. The input-consumed event is then
        recorded on the context's stream; it still fires once no later layer reads an input. The whole run is
        enqueued under the context's run lock: nothing of another thread's run may come between its launches.
        """
        primary_context()
        caller = int(stream)
        with self._run_lock:
            if caller not in DEFAULT_STREAMS:
                self._execute_on(shapes, addresses, caller, profiler, values, debug, consumed_event, staged, binding)
                return
            from cuda.bindings import driver

            own = self.stream()
            check(driver.cuEventRecord(self._events["fork"], caller), "cuEventRecord(fork)")
            check(driver.cuStreamWaitEvent(own, self._events["fork"], 0), "cuStreamWaitEvent(fork)")
            try:
                self._execute_on(shapes, addresses, own, profiler, values, debug, consumed_event, staged, binding)
            finally:  # whatever was enqueued, the caller's stream orders after it
                check(driver.cuEventRecord(self._events["join"], own), "cuEventRecord(join)")
                check(driver.cuStreamWaitEvent(caller, self._events["join"], 0), "cuStreamWaitEvent(join)")

    def _execute_on(self, shapes: Shapes, addresses: Mapping[str, int], stream: int, profiler: Any = None,
                    values: Mapping[str, np.ndarray] | None = None, debug: tuple[Any, Sequence[str]] | None = None,
                    consumed_event: Any = None, staged: StagedCopies | None = None, binding: _Binding | None = None
                    ) -> None:
        """Replay the captured graph when there is one; any other run (eager, capture, verification, profiled,
        debug) holds ``DEVICE_LOCK``: a library's first use or a synchronous copy on the legacy stream in one
        thread would break a capture going on in another (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)."""
        if profiler is None and not debug:
            binding = binding or self.bind(shapes, values)
            graph = binding.graphs.get(graph_key(addresses, consumed_event, staged))
            if graph is not None and self.graphs_possible(binding):
                self._replay(graph, stream)
                return
        with DEVICE_LOCK:
            self._execute_locked(shapes, addresses, stream, profiler, values, debug, consumed_event, staged, binding)

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

    def _run_tail(self, binding: _Binding, values: Mapping[str, np.ndarray], profiler: Any = None) -> dict[str, np.ndarray]:
        """``binding``'s host tail on ``values`` (its boundary tensors and the graph inputs it reads, views of pinned
        mirrors the next run of this slot refills); an output sharing a mirror's memory is copied out of it. Logged
        once per cut; with a ``profiler``, each tail layer's host time is reported."""
        tail = binding.tail
        assert tail is not None
        if tail.reason not in self.host_tails:
            self.host_tails.append(tail.reason)
            # a warning, as the whole-plan fallback: the default logger drops INFO, and a user should see this once
            DEFAULT_LOGGER.log(Severity.WARNING, f"CUDA plan '{self.engine.plan.name}' runs {len(tail.layers)} layers "
                                              f"on the host after its device part: {tail.reason}")
        results = tail.run(values, profiler.report_layer_time if profiler is not None else None)
        mirrors = list(values.values())
        return {name: np.array(value) if any(np.may_share_memory(value, m) for m in mirrors) else value
                for name, value in results.items()}

    @staticmethod
    def _tail_debugged(binding: _Binding, debug: tuple[Any, Sequence[str]] | None) -> bool:
        """Whether a run of ``binding`` reports debug tensors its host tail computes (such runs go to the host as a
        whole, which reports every tensor)."""
        return binding.tail is not None and debug is not None and bool(set(debug[1]) & binding.tail.written)

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

    def infer(self, feeds: Mapping[str, np.ndarray], profiler: Any = None,
              debug: tuple[Any, Sequence[str]] | None = None) -> dict[str, np.ndarray]:
        """Host numpy in/out: inputs through pinned mirrors to device buffers, run on the context's stream,
        outputs back through pinned mirrors, one wait; returns fresh arrays (the mirrors are reused by later
        runs). ``debug``: (IDebugListener, tensor names) as in ``execute``. Two threads may call it (or
        ``infer_batch``) at once: each takes a staging slot (runner_staging says why)."""
        primary_context()
        with self._io_slots.take() as slot:
            return self._infer_in(slot, feeds, profiler, debug)

    def _infer_in(self, slot: int, feeds: Mapping[str, np.ndarray], profiler: Any = None,
                  debug: tuple[Any, Sequence[str]] | None = None) -> dict[str, np.ndarray]:
        reason = self._host_only()
        if reason:
            return self._on_host(feeds, reason, debug)
        shapes = {name: tuple(np.shape(value)) for name, value in feeds.items()}
        values = None
        with self._run_lock:
            try:
                binding = self.bind(shapes)
            except ShapesNeedValues:
                values = {name: np.asarray(v) for name, v in feeds.items()
                          if np.asarray(v).dtype.kind in "iub" and np.asarray(v).size <= MAX_SHAPE_VALUES}
                try:
                    binding = self.bind(shapes, values)
                except ShapesNeedValues as e:  # shapes that neither input shapes nor values settle
                    return self._on_host(feeds, str(e), debug)
            if self._tail_debugged(binding, debug):
                return self._on_host(feeds, "debug tensors computed by the host tail", debug)
            stages, staged = self._staging(binding, shapes, slot)
        stream = self.stream()
        addresses = {name: stage.device.ptr for name, stage in stages.items()}
        with _synchronized_on_error(stream):
            for name, value in feeds.items():
                stages[name].fill([np.asarray(value)])
            with self._run_lock:
                try:
                    self.execute(shapes, addresses, stream, profiler, values, debug, staged=staged)
                except HostValueNotTensor as e:  # a host layer produced a sequence/optional: not for the device
                    _synchronize(stream)
                    return self._on_host(feeds, str(e), debug)
                done = self._run_done(slot, stream)
            _wait(done)
        names = self.engine.plan.graph.output_names
        if binding.tail is None:
            return {name: stages[name].array.copy() for name in names}
        tail = binding.tail  # data-dependent shapes: the layers after the device part, on its downloaded boundary
        computed = self._run_tail(binding, {**{n: stages[n].array for n in tail.boundary},
                                            **{n: np.asarray(feeds[n]) for n in tail.graph_inputs}}, profiler)
        return {name: computed[name] if name in computed else stages[name].array.copy() for name in names}

    def warm_up(self, feeds: Mapping[str, np.ndarray]) -> None:
        """Run ``feeds`` through ``infer`` in every staging slot until the CUDA graph for the slot's buffers at
        these shapes is captured and verified (eager run, capture and verification, a second capture if cuDNN's
        fused epilogue did not reproduce): the next ``infer`` / ``infer_batch`` at these shapes replays it, in
        whichever slot it takes. Plans that run on the host, shapes that need input values and bindings without
        graphs run at most once."""
        primary_context()
        if self._host_only():
            return
        try:
            self._warm_up(feeds)
        finally:
            cudnn_plan_cache.flush()  # what the binding learned, for the next process (executors skip exit hooks)

    def _warm_up(self, feeds: Mapping[str, np.ndarray]) -> None:
        shapes = {name: tuple(np.shape(value)) for name, value in feeds.items()}
        try:
            with self._run_lock:
                binding = self.bind(shapes)
        except ShapesNeedValues:
            return
        for slot in range(self._io_slots.count):
            with self._io_slots.take(slot):
                for _ in range(MAX_WARM_UP_RUNS):
                    self._infer_in(slot, feeds)
                    with self._run_lock:
                        stages, staged = self._staging(binding, shapes, slot)
                    addresses = {name: stage.device.ptr for name, stage in stages.items()}
                    if not self.graphs_possible(binding) or graph_key(addresses, None, staged) in binding.graphs:
                        break
            if not self.graphs_possible(binding):
                return
        self._warm_up_device_rows(binding, shapes)

    def _warm_up_device_rows(self, binding: _Binding, shapes: Shapes) -> None:
        """Capture the graph that batches gathered on the device replay, in every staging slot: inputs as one-row
        parts (``DeviceRows``) of zeros in scratch memory, outputs delivered to parts the same way.
        Why: such batches (requests in shared memory, a server's frontend arenas) run without ``infer``'s staged
        copies, so their graph has a key of its own; without this, the first live batch of every bucket captured it
        (ResNet-50's first request after ready took 3.35x the hundredth), and the first in each slot made that slot's
        copy tables."""
        if binding.tail is not None or not self.graphs_possible(binding):
            return
        with self._run_lock:
            stages, _ = self._staging(binding, shapes, 0)
        total = next(iter(stages[name].shape[0] for name in shapes if stages[name].shape), 0)
        if not total or any(not stages[name].shape or stages[name].shape[0] != total for name in shapes):
            return
        largest = max(stage.nbytes for stage in stages.values())
        sources, targets = DeviceBuffer(largest), DeviceBuffer(largest)
        memset_d8_async(sources.ptr, 0, largest, self.stream())  # before the gathers, on their stream

        def rows(name: str, base: int) -> DeviceRows:
            stage = stages[name]
            return DeviceRows(base + stage.row_bytes * np.arange(total, dtype=np.uint64), np.ones(total, np.int64),
                              stage.shape[1:], stage.dtype)

        inputs = {name: [rows(name, sources.ptr)] for name in shapes}
        outputs = {name: rows(name, targets.ptr) for name in self.engine.plan.graph.output_names
                   if stages[name].shape and stages[name].shape[0] == total}
        for slot in range(self._io_slots.count):
            self.infer_batch(inputs, [(0, total)], total, [outputs], slot=slot)

    def infer_batch(self, inputs: Mapping[str, Sequence[np.ndarray | DeviceView]], spans: Sequence[Span],
                    total: int, destinations: Sequence[Mapping[str, DeviceView]], profiler: Any = None,
                    debug: tuple[Any, Sequence[str]] | None = None, slot: int | None = None
                    ) -> list[dict[str, np.ndarray]]:
        """``ExecutionContext.infer_batch`` on the device (inputs checked there): each input's parts are
        gathered into its staging buffers of the binding at ``total`` rows (the ones ``infer`` uses), padding
        zeroed on the device, one run, then each part's rows go to its destination (device to device) or
        through the pinned mirror to a fresh host array. Plans the device cannot run as a whole, or whose
        shapes need input values, gather on the host and go through ``infer``'s fallbacks. Two threads may
        call it at once, as ``infer``; ``slot``: the staging slot to run in (default: the first free one)."""
        primary_context()
        shapes = {name: (total, *values[0].shape[1:]) for name, values in inputs.items()}
        reason = self._host_only()
        if reason:
            outputs = self._on_host(self._gathered_on_host(inputs, total), reason, debug)
            return self._scatter(outputs, spans, total, destinations)
        try:
            with self._run_lock:
                binding = self.bind(shapes)
        except ShapesNeedValues:  # integer inputs decide shapes: infer binds on their values, or runs on the host
            binding = None
        if binding is None or binding.tail is not None:  # a host tail runs after infer's device part
            outputs = self.infer(self._gathered_on_host(inputs, total), profiler, debug)
            return self._scatter(outputs, spans, total, destinations)
        stream = self.stream()
        with self._io_slots.take(slot) as slot:
            with self._run_lock:
                stages, staged = self._staging(binding, shapes, slot)
            for index, (span, targets) in enumerate(zip(spans, destinations)):
                for name, view in targets.items():
                    stage = stages[name]
                    if not isinstance(view, DeviceRows):  # infer_rows checked those against the batch
                        check_destination(name, index, view, part_shape(stage.shape, span, total), stage.dtype)
            if not any(destinations) and not any(isinstance(v, (DeviceView, DeviceRows))
                                                 for vs in inputs.values() for v in vs):
                return self._infer_staged(slot, stages, staged, inputs, spans, total, stream, profiler, debug)
            addresses = {name: stage.device.ptr for name, stage in stages.items()}
            with _synchronized_on_error(stream):
                with self._run_lock:  # the gathers must not interleave with another run's copies
                    copies: list[tuple[int, int, int] | np.ndarray] = []
                    for name, values in inputs.items():
                        _gather(stages[name], values, total, stream, copies)
                    self._copy_on_device(copies, stream, slot, "gather")
                    try:
                        self.execute(shapes, addresses, stream, profiler, None, debug)
                    except HostValueNotTensor as e:  # a host layer produced a sequence/optional
                        _synchronize(stream)
                        outputs = self._on_host(self._gathered_on_host(inputs, total), str(e), debug)
                        return self._scatter(outputs, spans, total, destinations)
                    on_host = self._deliver(stages, spans, total, destinations, stream, slot)
                    done = self._run_done(slot, stream)
                _wait(done)
            return self._collect(on_host, spans)


def lowering_options(plan: Plan) -> LoweringOptions:
    """The lowering choices the build recorded (TF32, cuDNN convolutions): runs must lower identically."""
    recorded = plan.build_info.get("cuda", {}).get("lowering", {})
    return LoweringOptions(**{f.name: bool(recorded.get(f.name, False)) for f in dataclasses.fields(LoweringOptions)})
