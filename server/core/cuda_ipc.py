"""CUDA IPC: open a client's device allocation in this process and copy tensors to and from it.

A client of Triton's CUDA shared-memory extension allocates device memory, exports it with
`cudaIpcGetMemHandle` and sends the 64 opaque handle bytes; `cuIpcOpenMemHandle` maps that allocation
into the device's primary context here (the context the CUDA backend also uses, so pointers are shared).

Today the server core hands numpy arrays to the engine, so inputs are copied device -> host and outputs
host -> device with synchronous cuMemcpy: correct, not zero-copy. The zero-copy hook is `IpcMapping.ptr`:
a CUDA backend context can take `ptr + offset` directly through `set_tensor_address` (engine_core's
TensorRT-style API) once the core passes device addresses instead of arrays.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from .errors import invalid

IPC_HANDLE_SIZE = 64  # bytes in a cudaIpcMemHandle_t / CUipcMemHandle
NO_DEVICE = "no CUDA device on this server"


@cache
def device_count() -> int:
    """CUDA devices this process can use; 0 when cuda.bindings or the driver is missing (CPU-only hosts).

    Cached: the answer decides what `GET /v2` advertises and cannot change while the server runs.
    """
    try:
        from engine_core.cuda.driver import device_count as driver_device_count

        return driver_device_count()
    except Exception:  # ImportError, no libcuda, CUDA_ERROR_NO_DEVICE...: all mean "no GPU path here"
        return 0


def available() -> bool:
    """True when CUDA shared-memory regions can be registered (a device exists)."""
    return device_count() > 0


@dataclass
class IpcMapping:
    """A client's device allocation opened in this process: `[ptr, ptr + byte_size)` on `device_id`.

    Not locked itself: `SharedMemory` serializes reads, writes and close, so a region is never unmapped
    while a copy is in flight.
    """

    device_id: int
    byte_size: int
    ptr: int
    _closed: bool = False

    def read(self, offset: int, nbytes: int) -> bytes:
        """A host copy of `nbytes` at `offset` (synchronous: the client's writes are complete before it sent
        the request, and cuMemcpyDtoH orders after all prior work on the legacy stream)."""
        from cuda.bindings import driver

        self._check_span(offset, nbytes)
        if nbytes == 0:
            return b""
        out = ctypes.create_string_buffer(nbytes)
        self._current()
        _check(driver.cuMemcpyDtoH(ctypes.addressof(out), self.ptr + offset, nbytes), "cuMemcpyDtoH")
        return out.raw

    def write(self, offset: int, data: bytes) -> None:
        """Copy `data` to `offset` and wait until it has landed: the client reads the region from another
        process as soon as the response arrives, so a copy still in flight would be a race."""
        from cuda.bindings import driver

        self._check_span(offset, len(data))
        if not data:
            return
        src = np.frombuffer(data, np.uint8)  # no copy; kept alive until the synchronize below
        self._current()
        _check(driver.cuMemcpyHtoD(self.ptr + offset, src.ctypes.data, src.nbytes), "cuMemcpyHtoD")
        _check(driver.cuStreamSynchronize(driver.CUstream(0)), "cuStreamSynchronize")

    def close(self) -> None:
        """Unmap the allocation (cuIpcCloseMemHandle); the client still owns and frees the memory."""
        from cuda.bindings import driver

        if self._closed:
            return
        _context(self.device_id)
        self._closed = True
        _check(driver.cuIpcCloseMemHandle(self.ptr), "cuIpcCloseMemHandle")

    def _current(self) -> None:
        if self._closed:
            raise invalid("CUDA shared memory region was unregistered")
        _context(self.device_id)

    def _check_span(self, offset: int, nbytes: int) -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.byte_size:
            raise invalid(f"[{offset}, {offset + nbytes}) is outside the {self.byte_size} bytes of the region")


def open_handle(raw_handle: bytes, device_id: int, byte_size: int) -> IpcMapping:
    """Open a client's IPC handle on `device_id`, checking that the allocation holds `byte_size` bytes.

    Every failure is INVALID_ARGUMENT with the reason (the client sent something this server cannot map).
    """
    if len(raw_handle) != IPC_HANDLE_SIZE:
        raise invalid(f"raw_handle must be the {IPC_HANDLE_SIZE} bytes of a CUDA IPC handle, got {len(raw_handle)}")
    if byte_size <= 0:
        raise invalid(f"byte_size must be > 0, got {byte_size}")
    count = device_count()
    if count == 0:
        raise invalid(NO_DEVICE)
    if not 0 <= device_id < count:
        raise invalid(f"device_id {device_id} does not exist (this server has {count} CUDA device(s))")
    from cuda.bindings import driver

    _context(device_id)
    handle = driver.CUipcMemHandle()
    ctypes.memmove(handle.getPtr(), raw_handle, IPC_HANDLE_SIZE)  # the binding exposes the bytes only by address
    flags = driver.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
    ptr = int(_check(driver.cuIpcOpenMemHandle(handle, flags), "cannot open the CUDA IPC handle"))
    try:
        _, allocated = _check(driver.cuMemGetAddressRange(ptr), "cuMemGetAddressRange")
    except Exception:
        driver.cuIpcCloseMemHandle(ptr)
        raise
    if byte_size > int(allocated):
        driver.cuIpcCloseMemHandle(ptr)
        raise invalid(f"byte_size {byte_size} exceeds the {int(allocated)} bytes of the CUDA allocation")
    return IpcMapping(device_id, byte_size, ptr)


def _check(result: Any, what: str) -> Any:
    """cuda.bindings' (err, *values) as a value, or INVALID_ARGUMENT naming the call and the CUDA error."""
    from engine_core.cuda.driver import CudaError, check

    try:
        return check(result, what)
    except CudaError as e:
        raise invalid(str(e)) from None


def _context(device_id: int) -> None:
    """Make the device's primary context current on this thread (server threads change between calls)."""
    from engine_core.cuda.driver import CudaError, primary_context

    try:
        primary_context(device_id)
    except CudaError as e:
        raise invalid(f"CUDA device {device_id}: {e}") from None
