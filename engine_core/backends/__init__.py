"""Execution backends: each turns plan layers into runnable steps (the interface: ``engine_core.backends.base``).

The built-in backends register here, whenever ``engine_core.backends.registry`` is first imported: each factory
imports its backend only when the builder or the runtime first asks for it, so knowing the registered backends
loads none of them (the CUDA backend's modules stay unloaded on machines that never build or run a CUDA plan).
"""

from __future__ import annotations

from typing import Any

from engine_core.backends.registry import register_backend


def _cpu() -> Any:
    """The CPU backend: plans through the reference interpreter."""
    from engine_core.backends.cpu import CpuBackend

    return CpuBackend()


def _cuda() -> Any:
    """The CUDA backend: lowering, tactics and CUBINs at build time, the runner at run time."""
    from engine_core.backends.cuda.backend import CudaBackend

    return CudaBackend()


register_backend("cpu", _cpu)
register_backend("cuda", _cuda)
