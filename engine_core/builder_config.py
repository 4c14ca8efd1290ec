"""What a build is asked for: BuilderConfig (IBuilderConfig), OptimizationProfile (IOptimizationProfile) and the
progress-monitor hook. Plain settings, read by the builder, the graph passes and INT8 calibration; `engine_core.builder`
re-exports them.

Kiln's own build switches (``BuilderConfig.int8_gemm`` and the others of ``BuildKnobs``) take their defaults from the
``KILN_*`` environment variables once, when the config is made, and are settable in code. The builder hands them to
the graph passes and the CUDA backend as a ``BuildKnobs`` for the whole build (``building_with``); code that runs
outside a build (a pass called on its own, the ONNX parser) reads ``build_knobs()``: the environment's, as before.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass, fields
from typing import Any, Protocol

from engine_core.compat import device_arch
from engine_core.errors import BuildError
from engine_core.timing_cache import TimingCache
from engine_core.types import BuilderFlag, HardwareCompatibilityLevel, MemoryPoolType, ProfilingVerbosity

ShapeTriple = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


class OptimizationProfile:
    """Min/opt/max shapes for each dynamic input (IOptimizationProfile)."""

    def __init__(self) -> None:
        self.shapes: dict[str, ShapeTriple] = {}
        #: shape-tensor inputs (int tensors whose *values* are shapes): min/opt/max values
        self.shape_values: dict[str, ShapeTriple] = {}

    def set_shape(self, input: str, min: Sequence[int], opt: Sequence[int], max: Sequence[int]) -> None:
        mn, op, mx = tuple(map(int, min)), tuple(map(int, opt)), tuple(map(int, max))
        if not len(mn) == len(op) == len(mx):
            raise ValueError(f"profile shapes for '{input}' have different ranks: {mn}, {op}, {mx}")
        if not all(a <= b <= c for a, b, c in zip(mn, op, mx)):
            raise ValueError(f"profile shapes for '{input}' must satisfy min <= opt <= max: {mn}, {op}, {mx}")
        if any(d < 0 for d in mn):
            raise ValueError(f"profile shapes for '{input}' must not be negative: {mn}")
        self.shapes[input] = (mn, op, mx)

    def get_shape(self, input: str) -> list[tuple[int, ...]]:
        return list(self.shapes.get(input, ()))

    def set_shape_input(self, input: str, min: Sequence[int], opt: Sequence[int], max: Sequence[int]) -> None:
        """Value ranges of a shape-tensor input (e.g. a Reshape target fed at run time), elementwise."""
        mn, op, mx = tuple(map(int, min)), tuple(map(int, opt)), tuple(map(int, max))
        if not len(mn) == len(op) == len(mx):
            raise ValueError(f"shape-input values for '{input}' have different lengths: {mn}, {op}, {mx}")
        if not all(a <= b <= c for a, b, c in zip(mn, op, mx)):
            raise ValueError(f"shape-input values for '{input}' must satisfy min <= opt <= max: {mn}, {op}, {mx}")
        self.shape_values[input] = (mn, op, mx)

    def get_shape_input(self, input: str) -> list[tuple[int, ...]]:
        return list(self.shape_values.get(input, ()))

    def __bool__(self) -> bool:
        return bool(self.shapes or self.shape_values)


#: Default bound on one constant tensor (imported or computed from constants): 16 GiB.
MAX_CONSTANT_BYTES = 1 << 34


@dataclass(frozen=True)
class BuildKnobs:
    """Kiln's build switches, as one build's passes and backend read them (``build_knobs()``). The user sets them
    on ``BuilderConfig`` (same names; each documented there); ``KNOB_ENVIRONMENT`` names the variable that gives
    each its default."""

    int8_gemm: bool = True
    int8_conv: bool | None = None
    qgemm: bool = True
    max_constant_bytes: int = MAX_CONSTANT_BYTES
    cuda_graphs: bool = True
    cudnn_heuristic_conv_plans: bool = False
    cudnn_attention: bool = True

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> BuildKnobs:
        """The knobs the ``KILN_*`` variables ask for (each unset, or not understood: its default), with the
        meanings the variables always had: ``KILN_INT8_GEMM=0``, ``KILN_QGEMM=0``, ``KILN_CUDA_GRAPHS=0`` turn
        off, ``KILN_INT8_CONV=1`` / ``0`` force, ``KILN_CUDNN_HEURISTIC=1`` turns on, ``KILN_CUDNN_ATTENTION=0``
        turns off, ``KILN_MAX_CONSTANT_BYTES`` is a byte count."""
        env = os.environ if environ is None else environ
        forced = env.get("KILN_INT8_CONV", "")
        size = env.get("KILN_MAX_CONSTANT_BYTES", "")
        return cls(int8_gemm=env.get("KILN_INT8_GEMM", "") != "0",
                   int8_conv=forced == "1" if forced in ("0", "1") else None,
                   qgemm=env.get("KILN_QGEMM", "1") != "0",
                   max_constant_bytes=int(size) if size.strip().isdigit() else MAX_CONSTANT_BYTES,
                   cuda_graphs=env.get("KILN_CUDA_GRAPHS", "1") != "0",
                   cudnn_heuristic_conv_plans=env.get("KILN_CUDNN_HEURISTIC", "0") == "1",
                   cudnn_attention=env.get("KILN_CUDNN_ATTENTION", "1") != "0")

    def changed(self) -> dict[str, Any]:
        """The knobs that differ from their built-in defaults, by name (what a plan records)."""
        default = BuildKnobs()
        return {name: value for name, value in asdict(self).items() if value != getattr(default, name)}


#: the environment variable that gives each knob its default
KNOB_ENVIRONMENT = {"int8_gemm": "KILN_INT8_GEMM", "int8_conv": "KILN_INT8_CONV", "qgemm": "KILN_QGEMM",
                    "max_constant_bytes": "KILN_MAX_CONSTANT_BYTES", "cuda_graphs": "KILN_CUDA_GRAPHS",
                    "cudnn_heuristic_conv_plans": "KILN_CUDNN_HEURISTIC", "cudnn_attention": "KILN_CUDNN_ATTENTION"}

#: ``Plan.build_info`` entry: the knobs of the build that differ from their defaults (``BuildKnobs.changed``)
KNOBS_KEY = "knobs"

def recorded_knob(build_info: Mapping[str, Any] | None, name: str) -> Any:
    """A knob that acts when a plan runs (``cuda_graphs``, ``cudnn_heuristic_conv_plans``, ``cudnn_attention``): its
    environment variable if set now (the override: a plan's runs can be changed without rebuilding it), else what the plan
    recorded (``build_info[KNOBS_KEY]``), else the default."""
    if KNOB_ENVIRONMENT[name] in os.environ:
        return getattr(BuildKnobs.from_environment(), name)
    recorded = (build_info or {}).get(KNOBS_KEY, {})
    return recorded.get(name, getattr(BuildKnobs(), name))


#: the knobs of the build running in this context (None: no build is running)
_ACTIVE: ContextVar[BuildKnobs | None] = ContextVar("kiln_build_knobs", default=None)


def build_knobs() -> BuildKnobs:
    """The knobs of the build running in this context; outside a build (a pass or the ONNX parser called on its
    own) those of the environment, read now."""
    knobs = _ACTIVE.get()
    return knobs if knobs is not None else BuildKnobs.from_environment()


@contextmanager
def building_with(knobs: BuildKnobs) -> Iterator[BuildKnobs]:
    """Within the block, ``build_knobs()`` is ``knobs`` (the builder wraps each build in it)."""
    token = _ACTIVE.set(knobs)
    try:
        yield knobs
    finally:
        _ACTIVE.reset(token)


class ProgressMonitor(Protocol):
    """IProgressMonitor: build phases and steps (the CLI draws its progress display from these)."""

    def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None: ...
    def step_complete(self, phase_name: str, step: int) -> bool: ...
    def phase_finish(self, phase_name: str) -> None: ...


#: the flags a new BuilderConfig has set (the reference's defaults)
DEFAULT_FLAGS = 1 << int(BuilderFlag.TF32)


class BuilderConfig:
    """Build options (IBuilderConfig)."""

    def __init__(self, default_backend: str) -> None:
        #: TF32 starts set, as in the reference ("allows the use of TF32 Tensor Cores by default"): a user moving
        #: from TensorRT gets the speed they had; ``clear_flag(BuilderFlag.TF32)`` asks for strict fp32 math
        self.flags = DEFAULT_FLAGS
        self.backend = default_backend
        self.builder_optimization_level = 3
        self.profiling_verbosity = ProfilingVerbosity.LAYER_NAMES_ONLY
        self.progress_monitor: ProgressMonitor | None = None
        self.profiles: list[OptimizationProfile] = []
        self._pool_limits: dict[MemoryPoolType, int] = {}
        self.timing_cache: Any = None
        #: IInt8Calibrator for implicit INT8 (BuilderFlag.INT8 on a model without Q/DQ)
        self.int8_calibrator: Any = None
        self._hardware_compatibility_level = 0  # HardwareCompatibilityLevel.NONE

        # Kiln's build switches (no TensorRT counterpart): defaults from the KILN_* variables, read once, here
        env = BuildKnobs.from_environment()
        #: Q/DQ MatMul/Gemm chains become INT8 (FP8) GEMMs, ``kiln.QMatMul`` (passes/fuse_qdq_matmul.py); False keeps
        #: them float GEMMs of the dequantized weights, the alternative to measure against. Default: on, off with
        #: ``KILN_INT8_GEMM=0``.
        self.int8_gemm: bool = env.int8_gemm
        #: Q/DQ convolutions become INT8 convolutions, ``kiln.QConv`` (passes/fuse_qdq_conv.py): True / False forces
        #: it; None leaves it to the build (on for CUDA builds whose cuDNN runs INT8 graphs, off on the CPU
        #: backend). Default: ``KILN_INT8_CONV=1`` / ``0``, else None.
        self.int8_conv: bool | None = env.int8_conv
        #: INT8 MatMuls on sm_90 may use Kiln's wgmma INT8 GEMM (backends/cuda/qgemm.py); False keeps them on
        #: cuBLASLt IMMA + a dequantizing kernel (for comparing the two). Default: on, off with ``KILN_QGEMM=0``.
        self.qgemm: bool = env.qgemm
        #: Bound on one constant tensor in bytes: a layer computed from constants only whose output would be
        #: larger fails the build (every run would have to allocate it). Default: ``KILN_MAX_CONSTANT_BYTES``,
        #: else 16 GiB. (The ONNX parser, which has no config, bounds imported constants by the variable.)
        self.max_constant_bytes: int = env.max_constant_bytes
        #: CUDA builds: contexts capture each binding's launches into a CUDA graph and replay it; False launches
        #: layer by layer (recorded in the plan; ``KILN_CUDA_GRAPHS`` set when the plan is loaded overrides it).
        #: Default: on, off with ``KILN_CUDA_GRAPHS=0``.
        self.cuda_graphs: bool = env.cuda_graphs
        #: CUDA builds: run every convolution with cuDNN's first heuristic plan instead of the one autotuned at
        #: build time, for telling a tuning problem from a kernel problem (recorded in the plan;
        #: ``KILN_CUDNN_HEURISTIC`` set when the plan is loaded overrides it). Default: ``KILN_CUDNN_HEURISTIC=1``.
        self.cudnn_heuristic_conv_plans: bool = env.cudnn_heuristic_conv_plans
        #: CUDA builds: attention layers cuDNN takes run its fused SDPA (backends/cuda/cudnn_attention.py); False
        #: runs Kiln's flash kernel for every one, e.g. to rule cuDNN in or out of a numerical difference (recorded
        #: in the plan; ``KILN_CUDNN_ATTENTION`` set when the plan is loaded overrides it). Default: on, off with
        #: ``KILN_CUDNN_ATTENTION=0``.
        self.cudnn_attention: bool = env.cudnn_attention

    @property
    def hardware_compatibility_level(self) -> int:
        """Which GPUs the plan may run on (recorded in the plan, checked at load: engine_core.compat)."""
        return HardwareCompatibilityLevel(self._hardware_compatibility_level)

    @hardware_compatibility_level.setter
    def hardware_compatibility_level(self, level: int) -> None:
        try:
            self._hardware_compatibility_level = HardwareCompatibilityLevel(level)
        except ValueError:
            raise ValueError(f"unknown hardware compatibility level {level!r}; use one of "
                             f"{[m.name for m in HardwareCompatibilityLevel]}") from None

    def set_flag(self, flag: BuilderFlag) -> None:
        self.flags |= 1 << int(flag)

    def clear_flag(self, flag: BuilderFlag) -> None:
        self.flags &= ~(1 << int(flag))

    def get_flag(self, flag: BuilderFlag) -> bool:
        return bool(self.flags & (1 << int(flag)))

    def set_memory_pool_limit(self, pool: MemoryPoolType, size: int) -> None:
        if size < 0:
            raise ValueError("memory pool limit must be >= 0")
        self._pool_limits[MemoryPoolType(pool)] = int(size)

    def get_memory_pool_limit(self, pool: MemoryPoolType) -> int:
        return self._pool_limits.get(MemoryPoolType(pool), 1 << 62)

    def add_optimization_profile(self, profile: OptimizationProfile) -> int:
        if not profile:
            return -1
        self.profiles.append(profile)
        return len(self.profiles) - 1

    @property
    def num_optimization_profiles(self) -> int:
        return len(self.profiles)

    def create_timing_cache(self, serialized: bytes = b"") -> TimingCache:
        """A timing cache from ``TimingCache.serialize()`` bytes (empty: a new cache)."""
        return TimingCache.deserialize(serialized)

    def set_timing_cache(self, cache: Any, ignore_mismatch: bool = False) -> bool:
        """Use ``cache`` for tactic timings (read and extended by builds); False if it was measured on
        another GPU architecture and ``ignore_mismatch`` is not set."""
        if cache is not None and ignore_mismatch is False and getattr(cache, "arch", None):
            arch = device_arch()  # None without a usable CUDA backend: nothing to compare with
            if arch is not None and cache.arch != arch:
                return False
        self.timing_cache = cache
        return True

    def get_timing_cache(self) -> Any:
        return self.timing_cache

    def knobs(self) -> BuildKnobs:
        """This config's Kiln build switches, checked (BuildError for a value of the wrong type), as the build
        hands them to the passes and the backend."""
        values = {f.name: getattr(self, f.name) for f in fields(BuildKnobs)}
        size = values["max_constant_bytes"]
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise BuildError(f"max_constant_bytes must be a byte count (an int >= 0), not {size!r}")
        if values["int8_conv"] is not None and not isinstance(values["int8_conv"], bool):
            raise BuildError(f"int8_conv must be True, False or None, not {values['int8_conv']!r}")
        for name in ("int8_gemm", "qgemm", "cuda_graphs", "cudnn_heuristic_conv_plans", "cudnn_attention"):
            if not isinstance(values[name], bool):
                raise BuildError(f"{name} must be True or False, not {values[name]!r}")
        return BuildKnobs(**values)

    @property
    def enabled_flags(self) -> list[str]:
        return [f.name for f in BuilderFlag if self.get_flag(f)]
