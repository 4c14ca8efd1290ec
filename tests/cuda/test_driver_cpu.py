"""engine_core.cuda.driver without a GPU: what its objects ask of libcuda, through a stand-in driver module."""

from __future__ import annotations

import gc
import sys
import types

import numpy as np

from engine_core.cuda import driver


def _fake_driver(monkeypatch) -> list[tuple]:
    """``from cuda.bindings import driver`` inside engine_core.cuda.driver finds a recorder: each call is logged,
    and answers as the bindings do ((CUresult 0, value) tuples)."""
    calls: list[tuple] = []
    fake = types.SimpleNamespace(
        cuMemFree=lambda ptr: calls.append(("free", ptr)) or (0,),
        cuMemcpyHtoD=lambda dst, src, n: calls.append(("htod", dst, n)) or (0,),
        cuMemcpyDtoH=lambda dst, src, n: calls.append(("dtoh", src, n)) or (0,),
    )
    package = types.ModuleType("cuda.bindings")
    package.driver = fake  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cuda.bindings", package)
    monkeypatch.setattr(driver, "check", lambda result, what="": result[1] if len(result) > 1 else None)
    return calls


def test_a_device_buffer_frees_its_memory_when_it_goes(monkeypatch):
    calls = _fake_driver(monkeypatch)
    buffer = object.__new__(driver.DeviceBuffer)  # as __init__ leaves it, without cuMemAlloc
    buffer.nbytes, buffer.ptr = 64, 0x1000
    buffer.copy_from(np.zeros(16, np.float32))
    assert buffer.to_array(np.dtype(np.float32), (16,)).shape == (16,)
    del buffer
    gc.collect()
    assert calls == [("htod", 0x1000, 64), ("dtoh", 0x1000, 64), ("free", 0x1000)]
