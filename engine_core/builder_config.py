"""What a build is asked for: BuilderConfig (IBuilderConfig), OptimizationProfile (IOptimizationProfile) and the
progress-monitor hook. Plain settings, read by the builder, the graph passes and INT8 calibration; `engine_core.builder`
re-exports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from engine_core.compat import device_arch
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

    @property
    def enabled_flags(self) -> list[str]:
        return [f.name for f in BuilderFlag if self.get_flag(f)]
