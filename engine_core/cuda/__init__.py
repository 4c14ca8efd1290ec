"""CUDA layer: NVRTC compilation of `cuda_kernels/*.cu` and a thin driver API wrapper (cuda.bindings).

Compilation works without a GPU (CI compiles every kernel for sm_90); running needs one.
"""

from engine_core.cuda.nvrtc import KERNEL_DIR, CompileError, compile_cubin, kernel_sources

__all__ = ["KERNEL_DIR", "CompileError", "compile_cubin", "is_available", "kernel_sources"]


def is_available() -> bool:
    """True when the CUDA driver loads and reports at least one device."""
    from engine_core.cuda.driver import device_count

    try:
        return device_count() > 0
    except Exception:
        return False
