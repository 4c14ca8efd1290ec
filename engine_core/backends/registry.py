"""Which backends this machine can build plans for and run, and what each one's plans can promise.

The builder (default backend, the build's check), the runtime (refusing plans for a backend this machine lacks) and
compatibility (`device_arch`, hardware levels) ask here; none of them imports a backend to find out. Asking needs
the CUDA driver and NVRTC wrappers only (engine_core.cuda), not the CUDA backend's modules.
"""

from __future__ import annotations

from engine_core.cuda import is_available as device_available
from engine_core.cuda.nvrtc import nvrtc_version

#: The GPU architecture the CUDA backend compiles hardware-compatibility-level AMPERE_PLUS plans for: PTX every GPU of
#: compute capability 8.0 or later can load. None: it emits CUBINs for the build GPU only, so such builds are refused
#: (engine_core.compat.build_record).
CUDA_AMPERE_PLUS_ARCH: str | None = None


def cuda_available() -> bool:
    """True when a CUDA device and NVRTC are usable here (then builds default to "cuda")."""
    if not device_available():
        return False
    try:
        nvrtc_version()
        return True
    except Exception:
        return False


def available_backends() -> list[str]:
    """Backends this machine can build for, the default first: "cuda" once the CUDA backend is usable here, "cpu"."""
    return ["cuda", "cpu"] if cuda_available() else ["cpu"]
