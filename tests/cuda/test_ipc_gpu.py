"""engine_core.cuda.ipc on the device: another process exports an allocation, this one maps it, copies through
it and hands views of it to infer_batch as inputs and output destinations (zero-copy); the exporter sees the
writes. Opening a handle needs a second process: the driver refuses handles this process exported itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine_core.cuda.ipc import open_ipc_handle
from tests.cuda.models import build_engine, mlp

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
FLOATS = 16 * 64  # the exported allocation: float32 [16, 64]

EXPORTER = f"""
import ctypes, sys
import numpy as np
from cuda.bindings import driver
from engine_core.cuda.driver import DeviceBuffer, check, synchronize

buf = DeviceBuffer({FLOATS} * 4)
buf.copy_from(np.arange({FLOATS}, dtype=np.float32).reshape(16, 64) / {FLOATS})
synchronize()
handle = check(driver.cuIpcGetMemHandle(buf.ptr), "cuIpcGetMemHandle")
print(ctypes.string_at(handle.getPtr(), 64).hex(), flush=True)
sys.stdin.readline()  # the other process has written
print(buf.to_array(np.float32, (16, 64)).tobytes().hex(), flush=True)
"""


def test_a_mapped_allocation_feeds_infer_batch_in_place():
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    child = subprocess.Popen([sys.executable, "-c", EXPORTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    try:
        mapping = open_ipc_handle(bytes.fromhex(child.stdout.readline().decode().strip()), 0)
        assert mapping.nbytes >= FLOATS * 4
        start = np.arange(FLOATS, dtype=np.float32).reshape(16, 64) / FLOATS
        assert mapping.read(64 * 4, 64 * 4) == start[1].tobytes()
        mapping.write(0, np.full(64, 0.5, np.float32).tobytes())  # row 0
        engine = build_engine(mlp(), "cuda", {"x": ((1, 64), (8, 64), (32, 64))})
        context = engine.create_execution_context()
        rows = np.concatenate([np.full((1, 64), 0.5, np.float32), start[1:4]])
        want = context.infer({"x": rows})["y"]
        out = mapping.view(8 * 64 * 4, (4, 32), np.float32)  # rows 8.. of the allocation receive y
        for _ in range(3):  # eager, captured, replayed
            (result,) = context.infer_batch([{"x": mapping.view(0, (4, 64), np.float32)}], destinations=[{"y": out}])
            assert result == {}
            np.testing.assert_array_equal(np.frombuffer(mapping.read(out.ptr - mapping.ptr, out.nbytes), np.float32)
                                          .reshape(4, 32), want)
        with pytest.raises(ValueError, match="outside the"):
            mapping.view(mapping.nbytes - 4, (2,), np.float32)
        mapping.close()
        mapping.close()
        with pytest.raises(ValueError, match="closed"):
            mapping.read(0, 4)
        child.stdin.write(b"done\n")
        child.stdin.flush()
        seen = np.frombuffer(bytes.fromhex(child.stdout.readline().decode().strip()), np.float32).reshape(16, 64)
        assert child.wait(timeout=60) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    np.testing.assert_array_equal(seen[0], np.full(64, 0.5, np.float32))
    np.testing.assert_array_equal(seen[1:8], start[1:8])
    np.testing.assert_array_equal(seen[8:12].reshape(-1)[:4 * 32].reshape(4, 32), want)


def test_a_bad_handle_or_device_is_refused():
    from engine_core.cuda.driver import CudaError

    with pytest.raises(CudaError, match="cannot open the CUDA IPC handle"):
        open_ipc_handle(bytes(64), 0)  # no allocation behind it
    with pytest.raises(CudaError, match="CUDA device 99"):
        open_ipc_handle(bytes(64), 99)
