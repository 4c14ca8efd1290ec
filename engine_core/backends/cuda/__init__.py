"""The CUDA backend (v0): memory planner, lowering to kernels/cuBLAS/copies, tactic choice, runner.

``prepare_plan`` is the build step (tactics, CUBINs, arena size); ``CudaEngineState`` runs plans with
``backend == "cuda"``. Whether this machine can use the backend at all is ``engine_core.backends.registry``'s
answer (``is_available`` here is the same function).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from engine_core.backends.cuda.host_tail import DATA_DEPENDENT_OPS as DATA_DEPENDENT_OPS  # lived here
from engine_core.backends.cuda.host_tail import data_dependent_layers
from engine_core.backends.cuda.lowering import (
    F32,
    GEMM_TACTICS,
    Conv,
    Gemm,
    Launch,
    Lowered,
    LoweringOptions,
    lower_graph,
    lower_split,
)
from engine_core.backends.cuda.lowering_context import KERNEL_FILES, ON_DEMAND_KERNEL_FILES
from engine_core.backends.cuda.memory import MemoryPlan, plan_memory
from engine_core.backends.cuda.pointwise import POINTWISE_OPTIONS, pointwise_source
from engine_core.backends.cuda.tactics import Timer, choose_tactic
from engine_core.backends.registry import cuda_available as is_available
from engine_core.ir import Graph
from engine_core.ops import TensorInfo
from engine_core.timing_cache import TimingCache

#: layers whose GEMM tactic is timed (attention's GEMMs and non-fp32 GEMMs always use cuBLAS)
TIMED_GEMM_LAYERS = frozenset({"MatMul", "Gemm", "FusedMatMul"})


@dataclass
class CudaBuild:
    """What the builder records in a CUDA plan."""

    tactics: dict[str, str]
    kernels: dict[str, bytes]
    device_memory_size: int
    arch: str
    info: dict[str, Any] = field(default_factory=dict)


def gemm_signature(op: Gemm, arch: str) -> str:
    """The timing-cache key of a GEMM: everything its tactics' speed depends on."""
    return (f"{arch}|gemm|m{op.m}n{op.n}k{op.k}b{op.batch}|ta{int(op.trans_a)}tb{int(op.trans_b)}"
            f"|{op.a_strides[2]},{op.b_strides[2]}|{op.dtype}|tf32={int(op.tf32)}")


def select_gemm_tactics(lowered: Lowered, timer_for: Any, cache: TimingCache | None = None,
                        arch: str = "") -> tuple[dict[str, str], dict[str, dict[str, float]]]:
    """For every timed GEMM layer: time each GEMM tactic (``timer_for(op) -> Timer``) and keep the
    fastest; timings found in ``cache`` are reused, new ones recorded there."""
    choice, timings = {}, {}
    for step in lowered.steps:
        gemm = next((op for op in step.ops if isinstance(op, Gemm)), None)
        if gemm is None or gemm.dtype != F32 or gemm.epilogue or step.node.op_type not in TIMED_GEMM_LAYERS:
            continue
        key = gemm_signature(gemm, arch)
        known = cache.query(key) if cache is not None else None
        if known is not None and all(t in known for t in GEMM_TACTICS):
            best = min(GEMM_TACTICS, key=lambda t: (known[t], GEMM_TACTICS.index(t)))
            choice[step.node.name], timings[step.node.name] = best, dict(known)
            continue
        timer: Timer = timer_for(gemm)
        choice[step.node.name], timings[step.node.name] = choose_tactic(GEMM_TACTICS, timer)
        if cache is not None:
            cache.update(key, timings[step.node.name])
    return choice, timings


def select_conv_plans(lowered: list[Lowered], tuner: Any, cache: TimingCache | None = None,
                      arch: str = "") -> tuple[dict[str, int], dict[str, dict[str, float]]]:
    """For every distinct convolution: time cuDNN's candidate execution plans (``tuner(conv) ->
    (best index, {index: ms})``) and keep the fastest; cached timings are reused."""
    from engine_core.backends.cuda.cudnn_conv import signature

    choice: dict[str, int] = {}
    timings: dict[str, dict[str, float]] = {}
    for low in lowered:
        for step in low.steps:
            for op in step.ops:
                if not isinstance(op, Conv) or signature(op) in choice:
                    continue
                sig = signature(op)
                key = f"{arch}|{sig}"
                known = cache.query(key) if cache is not None else None
                if not known:
                    _, measured = tuner(op)
                    known = {str(i): ms for i, ms in measured.items()}
                    if cache is not None and known:
                        cache.update(key, known)
                choice[sig] = int(min(known, key=known.__getitem__)) if known else 0
                timings[step.node.name] = known
    return choice, timings


def prepare_plan(graph: Graph, inferred: Mapping[tuple[int, int], Mapping[str, TensorInfo]],
                 arch: str | None = None, timer_for: Any = None, options: LoweringOptions | None = None,
                 cache: TimingCache | None = None, conv_tuner: Any = None) -> CudaBuild:
    """Tactics (timed at profile 0's opt shapes), CUBINs for every kernel used, the arena's peak size.

    ``timer_for(gemm) -> Timer`` times GEMM candidates; by default CUDA events on this machine's GPU.
    ``cache`` (the builder config's timing cache) supplies and receives timings.
    """
    from engine_core.cuda.nvrtc import compile_cubin, compile_kernel_files

    if arch is None:
        from engine_core.cuda.driver import compute_capability

        major, minor = compute_capability()
        arch = f"sm_{major}{minor}"
    options = options or LoweringOptions()
    cubins = compile_kernel_files(KERNEL_FILES, arch)
    if timer_for is None:
        timer_for = gpu_gemm_timer_factory(cubins["gemm"])
    if cache is not None and cache.arch is None:
        cache.arch = arch
    choice: dict[str, str] = {}
    timings: dict[str, dict[str, float]] = {}
    opt = _lower_or_none(graph, inferred[(0, 1)], {}, options)
    if opt is not None:
        choice, timings = select_gemm_tactics(opt, timer_for, cache, arch)

    def lower_all(options: LoweringOptions) -> dict[tuple[int, int], Lowered]:
        return {point: low for point, infos in inferred.items()
                if (low := _lower_or_none(graph, infos, choice, options)) is not None}

    lowered = lower_all(options)
    int8_fallbacks: dict[str, str] = {}
    for option, unrunnable in _probed_options():  # every such step must run here, or the option is off
        if getattr(options, option):
            missing = unrunnable([op for low in lowered.values() for s in low.steps for op in s.ops])
            if missing:
                int8_fallbacks[option] = missing[0]
                options = replace(options, **{option: False})
                lowered = lower_all(options)
    deferred = not lowered
    if deferred:  # shapes depend on input values: the runner lowers (and compiles) per binding
        lowered = {(0, 1): lower_graph(Graph(graph.name, [], [], [], {}), {}, {}, options)}
    conv_plans: dict[str, int] = {}
    conv_timings: dict[str, dict[str, float]] = {}
    if any(isinstance(op, Conv) for low in lowered.values() for s in low.steps for op in s.ops):
        if conv_tuner is None:
            from engine_core.backends.cuda.cudnn_conv import CudnnConvs

            conv_tuner = CudnnConvs().autotune
        at_opt = [low for (p, which), low in lowered.items() if which == 1]
        conv_plans, conv_timings = select_conv_plans(at_opt, conv_tuner, cache, arch)
    kernels = list(dict.fromkeys(k for low in lowered.values() for k in low.kernels))
    used = {op.module for low in lowered.values() for s in low.steps for op in s.ops if isinstance(op, Launch)}
    cubins.update(compile_kernel_files([stem for stem in ON_DEMAND_KERNEL_FILES if stem in used], arch))
    cubins["pointwise"] = compile_cubin(pointwise_source(kernels), "pointwise_generated.cu", arch, POINTWISE_OPTIONS)
    plans: list[MemoryPlan] = [low.memory for low in lowered.values()]
    at_opt = lowered[(0, 1)] if (0, 1) in lowered else next(iter(lowered.values()))
    tactics = at_opt.tactics()
    host_tail = at_opt.tail.info() if at_opt.tail is not None else _deferred_host_tail(graph) if deferred else None
    if host_tail and at_opt.tail is None:  # deferred: the runner splits at run time (a lowered tail's layers are
        tactics.update({name: "host" for name in host_tail["layers"]})  # "host" in tactics() already)
    return CudaBuild(
        tactics=tactics,
        kernels=cubins,
        device_memory_size=max(p.size for p in plans),
        arch=arch,
        info={"activation_bytes_unshared": max(p.total_unshared for p in plans),
              "host_layers": sorted(n for n, t in tactics.items() if t == "host"),
              "host_tail": host_tail,
              "gemm_timings_ms": timings, "pointwise_kernels": len(kernels),
              "conv_plans": conv_plans, "conv_timings_ms": conv_timings,
              "device_memory_per_profile": [max(low.memory.size for (p, _), low in lowered.items() if p == profile)
                                            for profile in sorted({p for p, _ in lowered})],
              "lowering": asdict(options),
              "int8_requant_fallback": int8_fallbacks.get("int8_requant"),
              "cudnn_int8_fallback": int8_fallbacks.get("cudnn_int8"),
              "reformat_layers": sorted({s.node.name for low in lowered.values() for s in low.steps
                                         if s.tactic.startswith("reformat")}),
              "timing_cache": {"hits": cache.hits, "misses": cache.misses} if cache is not None else None},
    )


def _probed_options() -> list[tuple[str, Any]]:
    """LoweringOptions the builder turns on from a small probe, each with ``(ops) -> [why a step cannot run]``:
    when some step of the real lowering cannot run on this GPU, the option goes off and the graph is lowered
    again (the plan records why)."""
    from engine_core.backends.cuda.cudnn_conv import unbuildable_convs
    from engine_core.backends.cuda.int8_gemm import unplanned_requant_gemms

    return [("int8_requant", unplanned_requant_gemms), ("cudnn_int8", unbuildable_convs)]


def _deferred_host_tail(graph: Graph) -> dict[str, Any] | None:
    """The host tail of a plan lowered per binding (shapes wait for input values), as far as the graph alone tells:
    the data-dependent layers and every layer after them (the runner may cut earlier, where input values leave
    other shapes unknown)."""
    layers = data_dependent_layers(graph)
    if not layers:
        return None
    firsts = [f"{n.op_type} '{n.name}'" for n in layers if n.op_type in DATA_DEPENDENT_OPS]
    return {"layers": [n.name for n in layers], "boundary": None,
            "reason": f"data-dependent output shapes from {', '.join(firsts)} on (cut per binding at run time)"}


def _lower_or_none(graph: Graph, infos: Mapping[str, TensorInfo], choice: Mapping[str, str],
                   options: LoweringOptions) -> Lowered | None:
    """The lowering at one profile point (the device part, when data-dependent layers leave a host tail), or None
    when some tensor shape waits for an input's value (known only at run time)."""
    from engine_core.backends.cuda.pointwise import Unsupported

    try:
        return lower_split(graph, infos, choice, options)
    except Unsupported:
        return None


def gpu_gemm_timer_factory(gemm_cubin: bytes):
    """``timer_for`` for prepare_plan on a machine with a GPU: CUDA-event timings of each tactic."""
    from engine_core.backends.cuda.tactics import gemm_timer
    from engine_core.cuda.driver import Module

    module = Module(gemm_cubin)
    function = module.function("gemm_f32")

    def timer_for(op: Gemm) -> Timer:
        return gemm_timer(op, function)

    timer_for.module = module  # type: ignore[attr-defined]  # keep the module loaded
    return timer_for


def engine_state(plan: Any) -> Any:
    """The per-engine runner state for a CUDA plan (imported lazily: needs the driver)."""
    from engine_core.backends.cuda.runner import CudaEngineState

    return CudaEngineState(plan)


__all__ = ["CudaBuild", "select_gemm_tactics", "is_available", "plan_memory", "prepare_plan", "engine_state", "gpu_gemm_timer_factory"]
