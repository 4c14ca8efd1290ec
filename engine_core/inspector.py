"""Engine inspection and debugging: EngineInspector with ProfilingVerbosity, and debug tensors.

ProfilingVerbosity is chosen at build time (``config.profiling_verbosity``) and recorded in the
plan; the inspector never shows more than it allows:

- NONE: no per-layer information (layer count, I/O and profiles only);
- LAYER_NAMES_ONLY (default): each layer's name, type and chosen implementation (tactic);
- DETAILED: also inputs, outputs, origin (ONNX nodes fused into it) and output shapes at the opt
  point — and, with ``inspector.execution_context`` set, the shapes at that context's input shapes.

Debug tensors: ``network.mark_debug(name)`` keeps an intermediate tensor alive through the graph
passes and records it in the plan (the build side: engine_core/build_extras.py); a context then reports each one whose debug state is on to its
``IDebugListener`` after the layer producing it ran (CPU backend).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from engine_core.compat import requirements
from engine_core.errors import ExecutionError
from engine_core.interpret import GraphRunner, LayerTimer
from engine_core.ir import Graph, Value
from engine_core.plan import Plan
from engine_core.types import (
    BuilderFlag,
    HardwareCompatibilityLevel,
    LayerInformationFormat,
    ProfilingVerbosity,
    TensorLocation,
    datatype_of,
)

if TYPE_CHECKING:
    from engine_core.builder_config import BuilderConfig


class InspectedEngine(Protocol):
    """What the inspector reads of an engine: the runtime's CudaEngine, which hands itself to these hooks (the
    runtime imports this module, so this module describes what it uses instead of importing the runtime)."""

    plan: Plan


class InspectedContext(Protocol):
    """What the inspector reads of an execution context (the runtime's ExecutionContext)."""

    engine: InspectedEngine
    profiler: Any  # IProfiler | None
    _inferred: dict[str, Any] | None  # every tensor's info at the current input shapes, once inferred

    def infer_shapes(self) -> list[str]: ...


_NAMES_ONLY_KEYS = ("name", "type", "tactic")
DEBUG_KEY = "debug_tensors"
VERBOSITY_KEY = "profiling_verbosity"


# -- inspector ----------------------------------------------------------------------------------


def engine_summary(plan: Plan) -> dict[str, Any]:
    """JSON-ready description of a plan: requirements, I/O, profiles, layers (`kiln inspect` too)."""
    try:
        needs: dict[str, Any] = requirements(plan.compat_meta()).as_dict()
    except ValueError as e:
        needs = {"error": str(e)}
    return {
        "name": plan.name,
        "engine_version": plan.engine_version,
        "backend": plan.backend,
        "arch": plan.arch,
        "requirements": needs,
        "device_memory_size": plan.device_memory_size,
        "io": [{"name": t.name, "mode": t.mode.name, "dtype": datatype_of(t.dtype).name, "shape": list(t.shape),
                "format": t.format} for t in plan.io],
        "profiles": [{k: {"min": list(v[0]), "opt": list(v[1]), "max": list(v[2])} for k, v in p.items()}
                     for p in plan.profiles],
        "layers": plan.layers,
        "build_info": plan.build_info,
    }


def engine_verbosity(engine: InspectedEngine) -> ProfilingVerbosity:
    """The verbosity the plan was built with (plans from before it was recorded: LAYER_NAMES_ONLY)."""
    return ProfilingVerbosity[engine.plan.build_info.get(VERBOSITY_KEY, "LAYER_NAMES_ONLY")]


class EngineInspector:
    """Layer information of an engine (IEngineInspector), limited by the build's ProfilingVerbosity."""

    def __init__(self, engine: InspectedEngine) -> None:
        self.engine = engine
        self.execution_context: InspectedContext | None = None
        self.error_recorder = getattr(engine, "error_recorder", None)

    @property
    def verbosity(self) -> ProfilingVerbosity:
        return engine_verbosity(self.engine)

    def _record(self, layer_index: int) -> dict[str, Any]:
        layer = self.engine.plan.layers[layer_index]
        if self.verbosity == ProfilingVerbosity.NONE:
            return {}
        if self.verbosity == ProfilingVerbosity.LAYER_NAMES_ONLY:
            return {k: layer[k] for k in _NAMES_ONLY_KEYS if k in layer}
        record = dict(layer)
        shapes = self._context_shapes()
        if shapes is not None:
            record["output_shapes"] = [list(shapes[o]) if o in shapes else None for o in layer["outputs"]]
        return record

    def _context_shapes(self) -> dict[str, tuple[int, ...]] | None:
        """Output shapes of every layer at the attached context's current input shapes."""
        ctx = self.execution_context
        if ctx is None or ctx.infer_shapes() or not ctx._inferred:
            return None
        return {name: info.shape for name, info in ctx._inferred.items() if info is not None and info.shape is not None}

    def get_layer_information(self, layer_index: int, format: LayerInformationFormat) -> str:
        if not 0 <= layer_index < len(self.engine.plan.layers):
            raise IndexError(f"layer {layer_index} does not exist (engine has {len(self.engine.plan.layers)})")
        record = self._record(layer_index)
        if format == LayerInformationFormat.JSON:
            return json.dumps(record)
        return _one_line(record)

    def get_engine_information(self, format: LayerInformationFormat) -> str:
        records = [self._record(i) for i in range(len(self.engine.plan.layers))]
        if format == LayerInformationFormat.JSON:
            summary = engine_summary(self.engine.plan)
            summary["layers"] = [r for r in records if r]
            summary["num_layers"] = len(records)
            summary[VERBOSITY_KEY] = self.verbosity.name
            return json.dumps(summary, indent=2)
        return "\n".join(_one_line(r) for r in records if r)


def _one_line(record: dict[str, Any]) -> str:
    if not record:
        return ""
    text = f"{record['name']} [{record['type']}] tactic={record['tactic']}"
    if "origin" in record:
        text += f" origin={','.join(record['origin'])}"
    if record.get("output_shapes") is not None:
        text += f" shapes={record['output_shapes']}"
    return text


# -- debug tensors at run time ------------------------------------------------------------------


class IDebugListener:
    """Receives debug tensors while a context runs (host memory on the CPU backend)."""

    def process_debug_tensor(self, addr: int, location: TensorLocation, type: Any, shape: tuple[int, ...],
                             name: str, stream: int) -> bool:
        raise NotImplementedError


class DebugState:
    """One context's debug listener and per-tensor debug switches."""

    def __init__(self, engine: InspectedEngine) -> None:
        self.engine = engine
        self.listener: IDebugListener | None = None
        self.enabled: set[str] = set()

    @property
    def debug_tensors(self) -> list[str]:
        return list(self.engine.plan.build_info.get(DEBUG_KEY, []))

    def set_state(self, name: str, flag: bool) -> bool:
        if name not in self.debug_tensors:
            return False
        (self.enabled.add if flag else self.enabled.discard)(name)
        return True

    def set_all(self, flag: bool) -> bool:
        self.enabled = set(self.debug_tensors) if flag else set()
        return True

    @property
    def active(self) -> bool:
        return self.listener is not None and bool(self.enabled)


def debug_state(ctx: InspectedContext) -> DebugState:
    """The context's DebugState, created on first use."""
    state = ctx.__dict__.get("_debug_state")
    if state is None:
        state = ctx.__dict__["_debug_state"] = DebugState(ctx.engine)
    return state


def active_debug(ctx: InspectedContext) -> tuple[IDebugListener, tuple[str, ...]] | None:
    """The context's debug listener and enabled debug tensors, when both exist (what the CUDA backend reports to)."""
    state = ctx.__dict__.get("_debug_state")
    if state is None or not state.active:
        return None
    return state.listener, tuple(sorted(state.enabled))


def run_with_debug(ctx: InspectedContext, feeds: Mapping[str, np.ndarray],
                   timer: LayerTimer | None, runner: GraphRunner) -> dict[str, np.ndarray]:
    """Run the engine's graph with ``runner`` (the CPU backend's, over the plan's graph); with a listener and
    enabled debug tensors, report them in layer order."""
    timer = deferred_timer(ctx, timer)
    state = ctx.__dict__.get("_debug_state")
    if state is None or not state.active:
        return runner.run(feeds, timer=timer)
    graph = ctx.engine.plan.graph
    wanted = sorted(state.enabled)
    runner = _debug_runner(ctx.engine, tuple(wanted))
    results = runner.run(feeds, timer=timer)
    for name in _in_layer_order(graph, wanted):
        _report(state.listener, name, results[name])
    return {name: results[name] for name in graph.output_names}


def _debug_runner(engine: InspectedEngine, names: tuple[str, ...]) -> GraphRunner:
    """A runner whose graph also returns ``names`` (the plan's graph, constants shared: refit-safe)."""
    cache = engine.__dict__.setdefault("_debug_runners", {})
    if names not in cache:
        graph = engine.plan.graph
        extra = [Value(n, np.dtype(np.float32), None) for n in names if n not in set(graph.output_names)]
        cache[names] = GraphRunner(dataclasses.replace(graph, outputs=graph.outputs + extra))
    return cache[names]


def _in_layer_order(graph: Graph, names: list[str]) -> list[str]:
    position = {o: i for i, n in enumerate(graph.nodes) for o in n.outputs if o}
    return sorted(names, key=lambda n: (position.get(n, -1), n))


def _report(listener: IDebugListener, name: str, value: Any) -> None:
    array = np.ascontiguousarray(value)
    if array.dtype.kind in "OSU":
        raise ExecutionError(f"debug tensor '{name}' holds strings, which have no tensor address")
    address = array.ctypes.data
    listener.process_debug_tensor(address, TensorLocation.HOST, datatype_of(array.dtype), tuple(array.shape), name, 0)


# -- profiler: enqueue_emits_profile / report_to_profiler ---------------------------------------


def deferred_timer(ctx: InspectedContext, timer: LayerTimer | None) -> LayerTimer | None:
    """With ``ctx.enqueue_emits_profile`` False, a run's layer times wait for ``report_to_profiler``."""
    if timer is None or getattr(ctx, "enqueue_emits_profile", True):
        return timer
    pending: list[tuple[str, float]] = []
    ctx.__dict__["_pending_layer_times"] = pending  # the reference reports the latest run only

    def keep(layer_name: str, ms: float) -> None:
        pending.append((layer_name, ms))

    return keep


class _DeferredProfiler:
    """IProfiler stand-in for backends that take a profiler object (CUDA): defers like deferred_timer."""

    def __init__(self, timer: LayerTimer) -> None:
        self.report_layer_time = timer


def profiler_for(ctx: InspectedContext) -> Any:
    """The profiler a backend should report to: the context's, or a deferring one (see deferred_timer)."""
    if ctx.profiler is None:
        return None
    timer = deferred_timer(ctx, ctx.profiler.report_layer_time)
    return ctx.profiler if timer == ctx.profiler.report_layer_time else _DeferredProfiler(timer)


def report_to_profiler(ctx: InspectedContext) -> bool:
    """Hand the latest run's deferred layer times to the context's profiler (False without one)."""
    if ctx.profiler is None:
        return False
    for layer_name, ms in ctx.__dict__.pop("_pending_layer_times", []):
        ctx.profiler.report_layer_time(layer_name, ms)
    return True


# -- CLI ----------------------------------------------------------------------------------------

VERBOSITY_CHOICES = [v.name.lower() for v in ProfilingVerbosity]
COMPAT_CHOICES = [v.name.lower() for v in HardwareCompatibilityLevel]


def add_build_arguments(parser: Any) -> None:
    """`kiln build` options: --profiling-verbosity, --dump-layer-info, --refit, compatibility, weight streaming."""
    parser.add_argument("--profiling-verbosity", choices=VERBOSITY_CHOICES, default="layer_names_only",
                        help="layer detail kept in the plan for the inspector (default: layer_names_only)")
    parser.add_argument("--dump-layer-info", action="store_true",
                        help="print the engine inspector's JSON layer information after the build")
    parser.add_argument("--refit", action="store_true", help="build a refittable plan (BuilderFlag.REFIT)")
    parser.add_argument("--hardware-compatibility-level", choices=COMPAT_CHOICES, default="none",
                        help="GPUs the plan may run on: none (the build GPU's compute capability), "
                             "same_compute_capability, ampere_plus (compute 8.0 and later)")
    parser.add_argument("--version-compatible", action="store_true",
                        help="let later Kiln versions of the same major version run the plan (BuilderFlag.VERSION_COMPATIBLE)")
    parser.add_argument("--weight-streaming", action="store_true",
                        help="allow weights to be streamed from host memory at run time (BuilderFlag.WEIGHT_STREAMING)")


def apply_build_arguments(config: BuilderConfig, args: Any) -> None:
    config.profiling_verbosity = ProfilingVerbosity[args.profiling_verbosity.upper()]
    config.hardware_compatibility_level = HardwareCompatibilityLevel[args.hardware_compatibility_level.upper()]
    for switch, flag in (("refit", BuilderFlag.REFIT), ("version_compatible", BuilderFlag.VERSION_COMPATIBLE),
                         ("weight_streaming", BuilderFlag.WEIGHT_STREAMING)):
        if getattr(args, switch):
            config.set_flag(flag)
