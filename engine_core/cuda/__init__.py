"""CUDA layer: NVRTC compilation of `cuda_kernels/*.cu` and a thin driver API wrapper (cuda.bindings).

Compilation works without a GPU (CI compiles every kernel for sm_90); running needs one.
"""

from engine_core.cuda.nvrtc import KERNEL_DIR, CompileError, compile_cubin, kernel_sources

__all__ = ["KERNEL_DIR", "CompileError", "compile_cubin", "device_count", "is_available", "kernel_sources"]


def device_count() -> int:
    """CUDA devices this process can use; 0 when cuda.bindings or the driver is missing or reports none
    (CPU-only hosts: every failure there means "no GPU path")."""
    from engine_core.cuda.driver import device_count as driver_device_count

    try:
        return driver_device_count()
    except Exception:
        return 0


def is_available() -> bool:
    """True when the CUDA driver loads and reports at least one device."""
    return device_count() > 0
