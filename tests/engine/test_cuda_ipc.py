"""engine_core.cuda.ipc and the server's cuda_ipc without a GPU: the checks made before any driver call."""

from __future__ import annotations

import pytest

from engine_core.cuda import device_count, is_available
from engine_core.cuda.ipc import IPC_HANDLE_SIZE, IpcMapping, open_ipc_handle


def test_handle_size_is_checked_first() -> None:
    with pytest.raises(ValueError, match=f"a CUDA IPC handle is {IPC_HANDLE_SIZE} bytes, got 10"):
        open_ipc_handle(b"x" * 10, 0)


def test_spans_and_close_are_checked_before_copies() -> None:
    mapping = IpcMapping(0x10000, 256, 0)
    with pytest.raises(ValueError, match=r"\[250, 258\) is outside the 256 bytes"):
        mapping.read(250, 8)
    with pytest.raises(ValueError, match="outside"):
        mapping.write(-1, b"ab")
    with pytest.raises(ValueError, match="outside"):
        mapping.view(0, (65,), "float32")
    view = mapping.view(16, (2, 8), "float32")
    assert (view.ptr, view.shape, view.nbytes) == (0x10000 + 16, (2, 8), 64)
    mapping.closed = True
    with pytest.raises(ValueError, match="closed"):
        mapping.read(0, 4)


def test_device_count_is_zero_or_more_without_raising() -> None:
    assert device_count() >= 0 and is_available() == (device_count() > 0)
