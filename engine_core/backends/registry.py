"""Which backends this machine can build plans for and run, and what each one's plans can promise.

The builder (default backend, the build's check), the runtime (refusing plans for a backend this machine lacks) and
compatibility (`device_arch`, hardware levels) ask here; none of them imports a backend to find out. Asking needs
the CUDA driver and NVRTC wrappers only (engine_core.cuda), not the CUDA backend's modules.

Backends register themselves here by name (``register_backend``) with a factory; the builder and the runtime get
one with ``get_backend`` and call only its interface (``engine_core.backends.base``). The built-in ones register
from the ``engine_core.backends`` package, whose factories import a backend on its first use: registering (and so
asking what is available) loads no backend module. This module sits below the backends, so it names the interface's
objects as ``Any``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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


#: backend name -> a callable making it (an ``engine_core.backends.base.Backend``), as registered
_FACTORIES: dict[str, Callable[[], Any]] = {}
#: backends made so far, by name: one object per backend and process
_MADE: dict[str, Any] = {}


def register_backend(name: str, factory: Callable[[], Any]) -> None:
    """Make ``factory()`` the backend for plans whose ``backend`` is ``name`` (called once, on first use)."""
    _FACTORIES[name] = factory
    _MADE.pop(name, None)


def registered_backends() -> list[str]:
    """Names with a registered backend (whether or not this machine can run them: ``available_backends``)."""
    return list(_FACTORIES)


def get_backend(name: str) -> Any:
    """The backend registered as ``name`` (a ``Backend``), made on first use; KeyError naming the registered ones."""
    backend = _MADE.get(name)
    if backend is None:
        if name not in _FACTORIES:
            raise KeyError(f"no backend is registered as '{name}' (registered: {', '.join(_FACTORIES)})")
        backend = _MADE[name] = _FACTORIES[name]()
    return backend
