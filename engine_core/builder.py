"""Builder and build_plan: network + BuilderConfig -> serialized plan.

The build: validate profiles -> graph passes (constant folding, Conv+BN folding, dead code) ->
shape inference at every profile's min/opt/max -> per-layer implementation choice -> memory
estimate -> plan bytes. ``Builder.build_serialized_network`` follows the reference (returns None
and logs on failure); ``build_plan`` raises ``BuildError`` with the reason instead.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Iterator
from functools import partial

import numpy as np

from engine_core.backends.base import Backend
from engine_core.backends.registry import available_backends, get_backend
from engine_core.build_extras import build_extras
from engine_core.builder_config import (
    KNOB_ENVIRONMENT,
    KNOBS_KEY,
    BuilderConfig,
    BuildKnobs,
    OptimizationProfile,
    ShapeTriple,
    building_with,
)
from engine_core.builder_config import ProgressMonitor as ProgressMonitor  # re-exported: the config classes lived here
from engine_core.calibration import calibrate
from engine_core.error_recorder import ErrorCode, RecorderSlot, report_error
from engine_core.errors import BuildError, KilnError
from engine_core.ir import Graph
from engine_core.logger import DEFAULT_LOGGER, Logger, Severity
from engine_core.network import NetworkDefinition
from engine_core.ops import TensorInfo
from engine_core.passes import FUSION_PASSES, PRE_PASSES, infer_shapes
from engine_core.passes.fuse_qdq_conv import int8_convolutions
from engine_core.passes.quantize_implicit import int8_policy, quantize_implicit
from engine_core.passes.reduce_precision import precision_policy, reduce_precision
from engine_core.plan import IOTensor, Plan, serialize_plan
from engine_core.plugins import plugin_kernels
from engine_core.timing_cache import TimingCache
from engine_core.types import BuilderFlag, MemoryPoolType, TensorIOMode


class Builder:
    """Creates networks, configs and profiles, and builds plans (IBuilder)."""

    error_recorder = RecorderSlot()  # IErrorRecorder hook

    def __init__(self, logger: Logger | None = None) -> None:
        self.logger = logger or DEFAULT_LOGGER

    def create_network(self, flags: int = 0) -> NetworkDefinition:
        return NetworkDefinition(flags)

    def create_builder_config(self) -> BuilderConfig:
        return BuilderConfig(available_backends()[0])

    def create_optimization_profile(self) -> OptimizationProfile:
        return OptimizationProfile()

    @property
    def platform_has_fast_fp16(self) -> bool:
        return "cuda" in available_backends()

    @property
    def platform_has_tf32(self) -> bool:
        return "cuda" in available_backends()

    def build_serialized_network(self, network: NetworkDefinition, config: BuilderConfig) -> bytes | None:
        try:
            return build_plan(network, config, self.logger)
        except KilnError as e:
            report_error(self, ErrorCode.INVALID_CONFIG, f"build failed: {e}")
            return None

    def is_network_supported(self, network: NetworkDefinition, config: BuilderConfig) -> bool:
        try:
            build_plan(network, config, self.logger)
            return True
        except KilnError:
            return False


# -- the build ----------------------------------------------------------------------------------


class _Progress:
    def __init__(self, monitor: ProgressMonitor | None) -> None:
        self.monitor = monitor

    def start(self, phase: str, steps: int, parent: str | None = None) -> None:
        if self.monitor:
            self.monitor.phase_start(phase, parent, steps)

    def step(self, phase: str, index: int) -> None:
        if self.monitor and self.monitor.step_complete(phase, index) is False:
            raise BuildError("build cancelled by the progress monitor")

    def finish(self, phase: str) -> None:
        if self.monitor:
            self.monitor.phase_finish(phase)


def _profiles_for(graph: Graph, config: BuilderConfig) -> list[dict[str, ShapeTriple]]:
    """Validated profiles; a network without dynamic inputs gets one fixed profile."""
    dynamic = [v for v in graph.inputs if v.is_dynamic]
    if not config.profiles:
        if dynamic:
            names = ", ".join(f"'{v.name}' {_fmt_shape(v.shape)}" for v in dynamic)
            raise BuildError(f"inputs {names} have dynamic shapes: add an optimization profile "
                             "(builder.create_optimization_profile().set_shape(name, min, opt, max))")
        return [{v.name: (tuple(v.shape),) * 3 for v in graph.inputs if v.is_tensor}]  # type: ignore[misc]
    result = []
    for index, profile in enumerate(config.profiles):
        unknown = set(profile.shapes) - set(graph.input_names)
        if unknown:
            raise BuildError(f"optimization profile {index} names {sorted(unknown)}, which are not network inputs")
        shapes: dict[str, ShapeTriple] = {}
        for v in graph.inputs:
            if not v.is_tensor:
                continue  # sequences/optionals carry no shape
            if v.name not in profile.shapes and v.name in profile.shape_values:
                shapes[v.name] = ((len(profile.shape_values[v.name][0]),),) * 3
                continue
            if v.name not in profile.shapes:
                if v.is_dynamic:
                    raise BuildError(f"optimization profile {index} has no shape for dynamic input '{v.name}' "
                                     f"{_fmt_shape(v.shape)}")
                shapes[v.name] = (tuple(v.shape),) * 3  # type: ignore[arg-type]
                continue
            triple = profile.shapes[v.name]
            if v.shape is not None:
                for which, s in zip(("min", "opt", "max"), triple):
                    if len(s) != len(v.shape) or any(isinstance(d, int) and d >= 0 and d != e
                                                     for d, e in zip(v.shape, s)):
                        raise BuildError(f"optimization profile {index}: {which} shape {s} of '{v.name}' does "
                                         f"not match its declared shape {_fmt_shape(v.shape)}")
            shapes[v.name] = triple
        result.append(shapes)
    return result


def _fmt_shape(shape) -> str:
    return "(?)" if shape is None else "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"


def _profile_values(graph: Graph, config: BuilderConfig) -> list[dict[str, ShapeTriple]]:
    """Validated shape-tensor value ranges per profile (integer 0-D/1-D inputs only)."""
    result = []
    for index, profile in enumerate(config.profiles or [OptimizationProfile()]):
        for name, (lo, _, _) in profile.shape_values.items():
            v = next((i for i in graph.inputs if i.name == name), None)
            if v is None or v.dtype.kind not in "iu":
                raise BuildError(f"optimization profile {index}: shape input '{name}' must be an integer network input")
            if v.shape is not None and (len(v.shape) > 1 or (len(v.shape) == 1 and isinstance(v.shape[0], int)
                                                              and v.shape[0] != len(lo))):
                raise BuildError(f"optimization profile {index}: shape input '{name}' {_fmt_shape(v.shape)} does not "
                                 f"hold {len(lo)} values")
        result.append(dict(profile.shape_values))
    return result


def _infos_for(graph: Graph, shapes: dict[str, tuple[int, ...]],
               values: dict[str, tuple[int, ...]] | None = None) -> dict[str, TensorInfo]:
    """Input infos at one profile point; shape-tensor inputs carry their values."""
    values = values or {}
    infos = {}
    for v in graph.inputs:
        shape = shapes.get(v.name) if v.is_tensor else None
        value = np.array(values[v.name], v.dtype).reshape(shape) if v.name in values else None
        infos[v.name] = TensorInfo(v.dtype, shape, value)
    return infos


def _activation_peak_bytes(graph: Graph, infos: dict[str, TensorInfo]) -> int:
    """Peak bytes of live intermediate tensors when layers run in order (the memory plan's size)."""
    last_use = {}
    for index, node in enumerate(graph.nodes):
        for name in node.inputs:
            last_use[name] = index
    io = set(graph.input_names) | set(graph.output_names) | set(graph.constants)
    live = peak = 0
    for index, node in enumerate(graph.nodes):
        for name in node.outputs:
            info = infos.get(name)
            if name and name not in io and info is not None and info.shape is not None and info.dtype.kind not in "OSU":
                live += int(np.prod(info.shape)) * info.dtype.itemsize
        peak = max(peak, live)
        for name in node.inputs:
            if last_use.get(name) == index and name not in io:
                info = infos.get(name)
                if info is not None and info.shape is not None and info.dtype.kind not in "OSU":
                    live -= int(np.prod(info.shape)) * info.dtype.itemsize
    return peak


#: environment variables that give the defaults of the build knobs (BuilderConfig.int8_gemm and the others)
BUILD_ENVIRONMENT = tuple(sorted(KNOB_ENVIRONMENT.values()))


def build_environment(config: BuilderConfig) -> dict[str, str]:
    """The config's build knobs that change its plan, as text by environment-variable name (the server's plan
    cache keys on them): each knob that differs from its built-in default, or whose variable is set now, with
    the config's value ("1" / "0" for switches). With every knob at its default and no variable set it is
    empty, so plan-cache keys stay those of before the knobs. A variable set now counts even where the config
    was made before it was set: the ONNX parser, which has no config, still reads KILN_MAX_CONSTANT_BYTES."""
    knobs = config.knobs()
    changed = knobs.changed()
    return {variable: _knob_text(getattr(knobs, name)) for name, variable in sorted(KNOB_ENVIRONMENT.items())
            if name in changed or variable in os.environ}


def _knob_text(value: object) -> str:
    """A knob's value as its environment variable would say it."""
    if value is None:
        return ""
    return ("1" if value else "0") if isinstance(value, bool) else str(value)


def build_plan(network: NetworkDefinition, config: BuilderConfig, logger: Logger | None = None) -> bytes:
    """Build ``network`` with ``config`` into plan bytes; raises BuildError with the reason. The passes and the
    backend read the config's Kiln build knobs (``BuilderConfig.knobs``) for the whole build."""
    with building_with(config.knobs()) as knobs:
        return _build_plan(network, config, logger, knobs)


def _build_plan(network: NetworkDefinition, config: BuilderConfig, logger: Logger | None, knobs: BuildKnobs) -> bytes:
    logger = logger or DEFAULT_LOGGER
    started = time.perf_counter()
    if config.backend not in available_backends():
        raise BuildError(f"backend '{config.backend}' is not available on this machine "
                         f"(available: {', '.join(available_backends())})")
    backend: Backend = get_backend(config.backend)  # the build step after the passes (engine_core.backends.base)
    graph = _working_copy(network.graph)
    if not graph.outputs:
        raise BuildError("network has no outputs")
    progress = _Progress(config.progress_monitor)
    profiles = _profiles_for(graph, config)
    profile_values = _profile_values(graph, config)

    policy = precision_policy(config, network, logger)
    int8 = int8_policy(config, network, logger)  # implicit INT8: calibrate on the fp32 graph, insert Q/DQ
    ranges = calibrate(network.graph, config) if int8 is not None and int8.implicit else {}
    quantize = [partial(quantize_implicit, ranges=ranges)] if ranges else []
    # optimization level 0: no layer fusions (every ONNX layer stays a layer: for debugging numerics)
    fusions = FUSION_PASSES if config.builder_optimization_level > 0 else FUSION_PASSES[-1:]
    stages = [*PRE_PASSES, partial(reduce_precision, policy=policy), *quantize, *fusions]
    progress.start("Optimizing graph", len(stages))
    pass_counts: dict[str, int] = {}
    # refit, debug tensors, plugins, verbosity; whether Q/DQ convolutions (explicit or calibrated) run in INT8
    with build_extras(graph, network, config) as extra_info, \
            int8_convolutions(_int8_convolutions(graph, config, calibrated=bool(ranges), backend=backend)):
        for index, graph_pass in enumerate(stages):  # folding, precision (reformat layers), fusions, DCE
            name = getattr(graph_pass, "__name__", None) or graph_pass.func.__name__
            pass_counts[name] = graph_pass(graph)
            progress.step("Optimizing graph", index)
    progress.finish("Optimizing graph")
    logger.log(Severity.INFO, f"graph passes: {pass_counts}; {len(graph.nodes)} layers remain")

    points = [(p, which) for p in range(len(profiles)) for which in range(3)]
    progress.start("Shape inference", len(points))
    inferred: dict[tuple[int, int], dict[str, TensorInfo]] = {}
    for step, (p, which) in enumerate(points):
        shapes = {name: triple[which] for name, triple in profiles[p].items()}
        try:
            values = {name: triple[which] for name, triple in profile_values[p].items()}
            inferred[(p, which)] = infer_shapes(graph, _infos_for(graph, shapes, values))
        except KilnError as e:
            label = ("min", "opt", "max")[which]
            raise BuildError(f"optimization profile {p} ({label} shapes {shapes}): {e}") from None
        progress.step("Shape inference", step)
    progress.finish("Shape inference")

    io = [IOTensor(v.name, TensorIOMode.INPUT, v.dtype,
                   _io_dims([profiles[p][v.name][w] for p, w in points]) if v.is_tensor else (), v.kind)
          for v in graph.inputs]
    for v in graph.outputs:
        if not v.is_tensor:
            io.append(IOTensor(v.name, TensorIOMode.OUTPUT, v.dtype, (), v.kind))
            continue
        infos = [inferred[pt].get(v.name) for pt in points]
        dtype = infos[0].dtype if infos[0] is not None else v.dtype
        shapes = [i.shape if i is not None else None for i in infos]
        if any(s is None for s in shapes):  # data-dependent: keep the dims the model declares static
            if v.shape is not None:
                dims: tuple[int, ...] = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in v.shape)
            else:
                dims = (-1,) * next((len(s) for s in shapes if s is not None), 0)
        else:
            dims = _io_dims(shapes)  # type: ignore[arg-type]
        io.append(IOTensor(v.name, TensorIOMode.OUTPUT, dtype, dims))

    for p in range(len(profiles)):  # a model that cannot run even at its smallest shapes fails here
        size, name, shape = _largest_tensor(graph, inferred[(p, 0)])
        if size > _physical_memory_bytes():
            raise BuildError(f"tensor '{name}' {list(shape)} would take {size / 2**30:.1f} GiB even at the smallest "
                             f"input shapes (optimization profile {p}), more than this machine's memory: "
                             "no request could run")
    memory = max(_activation_peak_bytes(graph, inferred[(p, 2)]) for p in range(len(profiles)))
    limit = config.get_memory_pool_limit(MemoryPoolType.WORKSPACE)
    if memory > limit and backend.workspace_limited:
        raise BuildError(f"the plan needs {memory} bytes of activation memory, over the workspace limit of {limit}")

    opt = inferred[(0, 1)]
    layers = [
        {
            "name": n.name,
            "type": n.op_type,
            "inputs": n.inputs,
            "outputs": n.outputs,
            "origin": n.origin,
            "tactic": f"{config.backend}:numpy",
            "output_shapes_opt": [list(opt[o].shape) if o in opt and opt[o].shape is not None else None
                                  for o in n.outputs],
            "precision": str(opt[n.outputs[0]].dtype) if n.outputs and n.outputs[0] in opt else None,
        }
        for n in graph.nodes
    ]
    # the backend's tactics, kernels (CUBINs) and planned arena size; the timing cache only for a backend that times
    built = backend.compile(graph, inferred, config, _timing_cache_for(config) if backend.uses_timing_cache else None)
    for layer in layers:
        layer["tactic"] = built.tactics.get(layer["name"], layer["tactic"])
    kernels, arch = built.kernels, built.arch
    if built.device_memory_size is not None:
        memory = built.device_memory_size
    kernels.update(plugin_kernels(graph, config.backend, arch))  # plugin hook: their CUDA source, via NVRTC
    plan = Plan(
        name=network.name,
        backend=config.backend,
        arch=arch,
        kernels=kernels,
        graph=graph,
        io=io,
        profiles=[{k: v for k, v in p.items() if k in {i.name for i in graph.inputs}} for p in profiles],
        profile_values=profile_values,
        device_memory_size=memory,
        layers=layers,
        build_info={
            "flags": config.enabled_flags,
            "optimization_level": config.builder_optimization_level,
            "passes": pass_counts,
            **({"precision": {"warnings": list(policy.warnings)}} if policy is not None else {}),
            **({"int8": {"mode": int8.mode, "calibrated_tensors": len(ranges), "warnings": int8.warnings}}
               if int8 is not None else {}),
            "build_seconds": round(time.perf_counter() - started, 4),
            # Kiln build knobs off their defaults (the CUDA runner reads cuda_graphs, cudnn_heuristic_conv_plans,
            # cudnn_attention)
            **({KNOBS_KEY: changed} if (changed := knobs.changed()) else {}),
            **extra_info,
            **({backend.name: built.info} if built.info else {}),
        },
    )
    return serialize_plan(plan)


def _working_copy(graph: Graph) -> Graph:
    """The copy of the network the passes rewrite: its own nodes, attributes and constant tables, but the network's
    weights shared as read-only views (a deep copy held every weight twice for the whole build). Passes replace
    a constant, never write into one: the views make a pass that tried fail instead of changing the network."""
    memo: dict[int, object] = {}
    for array in _arrays(graph):
        view = array.view()
        view.flags.writeable = False
        memo[id(array)] = view
    return copy.deepcopy(graph, memo)


def _arrays(graph: Graph) -> Iterator[np.ndarray]:
    """Every ndarray of `graph` and its bodies: constants and array attributes."""
    yield from graph.constants.values()
    for node in graph.nodes:
        for value in node.attrs.values():
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, np.ndarray):
                    yield item
                elif isinstance(item, Graph):
                    yield from _arrays(item)


def _int8_convolutions(graph: Graph, config: BuilderConfig, calibrated: bool, backend: Backend | None = None) -> bool:
    """Whether this build runs Q/DQ convolutions in INT8 (fuse_qdq_conv): a build of a graph with DequantizeLinear
    layers (or Q/DQ from calibration) for a backend that runs them in INT8 here (CUDA: when cuDNN builds INT8
    graphs, faster than float convolutions of the dequantized weights: see fuse_qdq_conv)."""
    if not (calibrated or any(n.op_type == "DequantizeLinear" for n in graph.nodes)):
        return False
    return (backend or get_backend(config.backend)).int8_convolutions()


def _largest_tensor(graph: Graph, infos: dict[str, TensorInfo]) -> tuple[int, str, tuple[int, ...]]:
    """(bytes, name, shape) of the largest non-constant tensor with a known shape."""
    best: tuple[int, str, tuple[int, ...]] = (0, "", ())
    for name, info in infos.items():
        if name not in graph.constants and info is not None and info.shape is not None and info.dtype is not None:
            size = int(np.prod(info.shape, dtype=np.float64)) * np.dtype(info.dtype).itemsize
            if size > best[0]:
                best = (size, name, tuple(info.shape))
    return best


def _physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: no limit
        return 1 << 62


def _timing_cache_for(config: BuilderConfig) -> TimingCache | None:
    """The config's timing cache, unless DISABLE_TIMING_CACHE; a private one when none was set."""
    if config.get_flag(BuilderFlag.DISABLE_TIMING_CACHE):
        return None
    if config.timing_cache is None:
        config.timing_cache = TimingCache()
    return config.timing_cache


def _io_dims(shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """Reference dims over all profile points: a dim that varies is -1."""
    first = shapes[0]
    if any(len(s) != len(first) for s in shapes):
        return (-1,) * len(first)
    return tuple(d if all(s[i] == d for s in shapes) else -1 for i, d in enumerate(first))
