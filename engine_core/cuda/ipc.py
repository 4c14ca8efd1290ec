"""CUDA IPC: a device allocation another process exported (``cudaIpcGetMemHandle``), mapped into this one.

``cuIpcOpenMemHandle`` maps the allocation into the device's primary context, the context the CUDA backend
runs in, so ``IpcMapping.view`` gives a ``DeviceView`` that ``ExecutionContext.infer_batch`` reads inputs from
or writes outputs to without a host copy. ``read``/``write`` copy through the host for callers that need
bytes. Copies run on a non-blocking stream of the mapping: a copy on the legacy default stream would be an
error while any context of this process captures a CUDA graph.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

from engine_core.cuda.driver import CudaError, check, primary_context
from engine_core.cuda.view import DeviceView

IPC_HANDLE_SIZE = 64  # bytes in a cudaIpcMemHandle_t / CUipcMemHandle


class IpcMapping:
    """``[ptr, ptr + nbytes)`` on ``device_id``: another process's allocation, open here until ``close``.

    Not locked: callers serialize copies and close (the exporting process still owns and frees the memory).
    """

    def __init__(self, ptr: int, nbytes: int, device_id: int) -> None:
        self.ptr, self.nbytes, self.device_id = int(ptr), int(nbytes), int(device_id)
        self.closed = False
        self._stream: int | None = None

    def read(self, offset: int, nbytes: int) -> bytes:
        """A host copy of ``nbytes`` at ``offset``; the exporter's writes must be complete (synchronized)."""
        from cuda.bindings import driver

        self._check_span(offset, nbytes)
        if nbytes == 0:
            return b""
        out = ctypes.create_string_buffer(nbytes)
        stream = self._copy_stream()
        check(driver.cuMemcpyDtoHAsync(ctypes.addressof(out), self.ptr + offset, nbytes, stream), "cuMemcpyDtoHAsync")
        check(driver.cuStreamSynchronize(stream), "cuStreamSynchronize")
        return out.raw

    def write(self, offset: int, data: bytes | bytearray | memoryview | np.ndarray) -> None:
        """Copy ``data`` to ``offset`` and wait until it has landed: the exporter may read the memory as
        soon as this returns."""
        from cuda.bindings import driver

        source = np.ascontiguousarray(data).reshape(-1).view(np.uint8) if isinstance(data, np.ndarray) \
            else np.frombuffer(data, np.uint8)  # no copy; alive until the synchronize below
        self._check_span(offset, source.nbytes)
        if source.nbytes == 0:
            return
        stream = self._copy_stream()
        check(driver.cuMemcpyHtoDAsync(self.ptr + offset, source.ctypes.data, source.nbytes, stream),
              "cuMemcpyHtoDAsync")
        check(driver.cuStreamSynchronize(stream), "cuStreamSynchronize")

    def view(self, offset: int, shape: Sequence[int], dtype: np.dtype | type | str) -> DeviceView:
        """The tensor of ``shape`` and ``dtype`` at ``offset`` (row-major), for the engine to use in place."""
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        view = DeviceView(self.ptr + offset, tuple(shape), np.dtype(dtype))
        self._check_span(offset, view.nbytes)
        return view

    def close(self) -> None:
        """Unmap the allocation (cuIpcCloseMemHandle); a second close does nothing."""
        from cuda.bindings import driver

        if self.closed:
            return
        primary_context(self.device_id)
        self.closed = True
        if self._stream is not None:
            driver.cuStreamDestroy(self._stream)
            self._stream = None
        check(driver.cuIpcCloseMemHandle(self.ptr), "cuIpcCloseMemHandle")

    def _copy_stream(self) -> int:
        """The mapping's non-blocking stream, with the device's primary context made current on this thread."""
        from cuda.bindings import driver

        primary_context(self.device_id)
        if self._stream is None:
            flags = int(driver.CUstream_flags.CU_STREAM_NON_BLOCKING)
            self._stream = int(check(driver.cuStreamCreate(flags), "cuStreamCreate"))
        return self._stream

    def _check_span(self, offset: int, nbytes: int) -> None:
        if self.closed:
            raise ValueError("the CUDA IPC mapping is closed")
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"[{offset}, {offset + nbytes}) is outside the {self.nbytes} bytes of the mapping")


def open_ipc_handle(raw: bytes, device_id: int) -> IpcMapping:
    """Map the allocation behind ``raw`` (the 64 bytes of a CUDA IPC handle) on ``device_id``, whole.

    Raises ValueError for a handle of the wrong size and CudaError naming the call when the driver refuses
    (no such device, a stale or foreign handle, a handle exported by this same process).
    """
    from cuda.bindings import driver

    raw = bytes(raw)
    if len(raw) != IPC_HANDLE_SIZE:
        raise ValueError(f"a CUDA IPC handle is {IPC_HANDLE_SIZE} bytes, got {len(raw)}")
    try:
        primary_context(device_id)
    except CudaError as e:
        raise CudaError(f"CUDA device {device_id}: {e}") from None
    handle = driver.CUipcMemHandle()
    ctypes.memmove(handle.getPtr(), raw, IPC_HANDLE_SIZE)  # the binding exposes the bytes only by address
    flags = driver.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
    ptr = int(check(driver.cuIpcOpenMemHandle(handle, flags), "cannot open the CUDA IPC handle"))
    try:
        _, size = check(driver.cuMemGetAddressRange(ptr), "cuMemGetAddressRange")
    except Exception:
        driver.cuIpcCloseMemHandle(ptr)
        raise
    return IpcMapping(ptr, int(size), device_id)
