"""engine_core.cuda.host_memory without a GPU, through a stand-in driver module: a registration is undone exactly
once, when its last view goes, and one the driver refused leaves nothing to undo (no error at collection)."""

from __future__ import annotations

import gc
import sys
import types

import numpy as np
import pytest

from engine_core.cuda import host_memory
from engine_core.cuda.driver import CudaError


def _fake_driver(monkeypatch, refuse: bool = False) -> list[tuple]:
    calls: list[tuple] = []

    def register(address: int, nbytes: int, flags: int):
        calls.append(("register", address, nbytes))
        if refuse:
            raise CudaError("cuMemHostRegister: CUDA_ERROR_NOT_PERMITTED")
        return (0,)

    fake = types.SimpleNamespace(
        CU_MEMHOSTREGISTER_PORTABLE=1, CU_MEMHOSTREGISTER_DEVICEMAP=2, cuMemHostRegister=register,
        cuMemHostGetDevicePointer=lambda address, flags: (0, address + 0x100000),
        cuMemHostUnregister=lambda address: calls.append(("unregister", address)) or (0,))
    package = types.ModuleType("cuda.bindings")
    package.driver = fake  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cuda.bindings", package)
    monkeypatch.setattr(host_memory, "primary_context", lambda ordinal=0: None)
    monkeypatch.setattr(host_memory, "check", lambda result, what="": result[1] if len(result) > 1 else None)
    return calls


def test_the_range_is_unpinned_once_closed_and_its_last_view_gone(monkeypatch):
    calls = _fake_driver(monkeypatch)
    released: list[bool] = []
    registration = host_memory.HostRegistration(0x1000, 4096, on_release=lambda: released.append(True))
    view = registration.view(64, (2, 8), np.float32)
    assert view.ptr == 0x1000 + 0x100000 + 64 and view.owner is registration
    with pytest.raises(ValueError, match="outside the 4096 registered bytes"):
        registration.view(4096 - 16, (8,), np.float32)
    registration.close()
    with pytest.raises(ValueError, match="closed"):
        registration.view(0, (1,), np.float32)
    del registration
    gc.collect()
    assert calls == [("register", 0x1000, 4096)] and not released  # the view still holds it
    del view
    gc.collect()
    assert calls == [("register", 0x1000, 4096), ("unregister", 0x1000)] and released == [True]


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_a_refused_registration_raises_and_leaves_nothing_to_undo(monkeypatch):
    calls = _fake_driver(monkeypatch, refuse=True)
    with pytest.raises(CudaError, match="NOT_PERMITTED"):
        host_memory.HostRegistration(0x2000, 4096)
    gc.collect()
    assert calls == [("register", 0x2000, 4096)]
