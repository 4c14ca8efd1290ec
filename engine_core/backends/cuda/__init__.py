"""The CUDA backend (v0): memory planner, lowering to kernels/cuBLAS/copies, tactic choice, runner.

``is_available()`` is what ``engine_core.builder.available_backends`` asks; ``prepare_plan`` is the
build step (tactics, CUBINs, arena size); ``CudaEngineState`` runs plans with ``backend == "cuda"``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine_core.backends.cuda.lowering import GEMM_TACTICS, Gemm, Lowered, lower_graph
from engine_core.backends.cuda.memory import MemoryPlan, plan_memory
from engine_core.backends.cuda.pointwise import pointwise_source
from engine_core.backends.cuda.tactics import Timer, choose_tactic
from engine_core.ir import Graph
from engine_core.ops import TensorInfo

#: Kiln's own kernel files every CUDA plan embeds (besides the generated pointwise module)
KERNEL_FILES = ("softmax", "layer_norm", "reduce", "gather", "gemm")


def is_available() -> bool:
    """True when a CUDA device and NVRTC are usable here (then builds default to "cuda")."""
    from engine_core.cuda import is_available as device_available

    if not device_available():
        return False
    try:
        from engine_core.cuda.nvrtc import nvrtc_version

        nvrtc_version()
        return True
    except Exception:
        return False


@dataclass
class CudaBuild:
    """What the builder records in a CUDA plan."""

    tactics: dict[str, str]
    kernels: dict[str, bytes]
    device_memory_size: int
    arch: str
    info: dict[str, Any] = field(default_factory=dict)


def select_gemm_tactics(lowered: Lowered, timer_for: Any) -> tuple[dict[str, str], dict[str, dict[str, float]]]:
    """For every GEMM layer: time each GEMM tactic (``timer_for(op) -> Timer``) and keep the fastest."""
    choice, timings = {}, {}
    for step in lowered.steps:
        gemm = next((op for op in step.ops if isinstance(op, Gemm)), None)
        if gemm is not None:
            timer: Timer = timer_for(gemm)
            choice[step.node.name], timings[step.node.name] = choose_tactic(GEMM_TACTICS, timer)
    return choice, timings


def prepare_plan(graph: Graph, inferred: Mapping[tuple[int, int], Mapping[str, TensorInfo]],
                 arch: str | None = None, timer_for: Any = None) -> CudaBuild:
    """Tactics (timed at profile 0's opt shapes), CUBINs for every kernel used, the arena's peak size.

    ``timer_for(gemm) -> Timer`` times GEMM candidates; by default CUDA events on this machine's GPU.
    """
    from engine_core.cuda.nvrtc import compile_cubin, compile_kernel_file

    if arch is None:
        from engine_core.cuda.driver import compute_capability

        major, minor = compute_capability()
        arch = f"sm_{major}{minor}"
    cubins = {stem: compile_kernel_file(stem, arch) for stem in KERNEL_FILES}
    opt = lower_graph(graph, inferred[(0, 1)])
    if timer_for is None:
        timer_for = gpu_gemm_timer_factory(cubins["gemm"])
    choice, timings = select_gemm_tactics(opt, timer_for)
    lowered = {point: lower_graph(graph, infos, choice) for point, infos in inferred.items()}
    kernels = list(dict.fromkeys(k for low in lowered.values() for k in low.kernels))
    cubins["pointwise"] = compile_cubin(pointwise_source(kernels), "pointwise_generated.cu", arch)
    plans: list[MemoryPlan] = [low.memory for low in lowered.values()]
    tactics = lowered[(0, 1)].tactics()
    return CudaBuild(
        tactics=tactics,
        kernels=cubins,
        device_memory_size=max(p.size for p in plans),
        arch=arch,
        info={"activation_bytes_unshared": max(p.total_unshared for p in plans),
              "host_layers": sorted(n for n, t in tactics.items() if t == "host"),
              "gemm_timings_ms": timings, "pointwise_kernels": len(kernels)},
    )


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
