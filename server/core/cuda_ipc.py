"""CUDA IPC for Triton's CUDA shared-memory extension: the server's checks and errors over the engine's mapping.

A client allocates device memory, exports it with `cudaIpcGetMemHandle` and sends the 64 opaque handle bytes;
`engine_core.cuda.ipc.open_ipc_handle` maps that allocation into the device's primary context here (the
context the CUDA backend also uses, so pointers are shared). This module adds what the protocol needs on top:
the registered `byte_size` checked against the allocation, spans checked against it, and every failure as
INVALID_ARGUMENT naming the reason. No driver calls here: the engine owns them.

`read`/`write` copy through the host (synchronously). The zero-copy path is `IpcMapping.view`: a
`DeviceView` that `ExecutionContext.infer_batch` reads inputs from or writes outputs to on the device.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache

import numpy as np

from engine_core.cuda import device_count as engine_device_count
from engine_core.cuda.ipc import IPC_HANDLE_SIZE, open_ipc_handle
from engine_core.cuda.ipc import IpcMapping as DeviceMapping
from engine_core.cuda.view import DeviceView
from engine_core.errors import KilnError

from .errors import invalid

__all__ = ["IPC_HANDLE_SIZE", "NO_DEVICE", "IpcMapping", "available", "device_count", "open_handle"]

NO_DEVICE = "no CUDA device on this server"


@cache
def device_count() -> int:
    """CUDA devices this process can use; 0 when cuda.bindings or the driver is missing (CPU-only hosts).

    Cached: the answer decides what `GET /v2` advertises and cannot change while the server runs.
    """
    return engine_device_count()


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
    mapping: DeviceMapping

    @property
    def ptr(self) -> int:
        return self.mapping.ptr

    def read(self, offset: int, nbytes: int) -> bytes:
        """A host copy of `nbytes` at `offset` (the client's writes are complete before it sent the request)."""
        self._check_span(offset, nbytes)
        with _as_invalid():
            return self.mapping.read(offset, nbytes)

    def write(self, offset: int, data: bytes) -> None:
        """Copy `data` to `offset` and wait until it has landed: the client reads the region from another
        process as soon as the response arrives, so a copy still in flight would be a race."""
        self._check_span(offset, len(data))
        with _as_invalid():
            self.mapping.write(offset, data)

    def view(self, offset: int, shape: Sequence[int], dtype: np.dtype) -> DeviceView:
        """The tensor at `offset` in place, for the engine (zero-copy inputs and outputs)."""
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        self._check_span(offset, nbytes)
        with _as_invalid():
            return self.mapping.view(offset, shape, dtype)

    def close(self) -> None:
        """Unmap the allocation; the client still owns and frees the memory."""
        if self.mapping.closed:
            return
        with _as_invalid():
            self.mapping.close()

    def _check_span(self, offset: int, nbytes: int) -> None:
        if self.mapping.closed:
            raise invalid("CUDA shared memory region was unregistered")
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
    with _as_invalid():
        mapping = open_ipc_handle(raw_handle, device_id)
    if byte_size > mapping.nbytes:
        with _as_invalid():
            mapping.close()
        raise invalid(f"byte_size {byte_size} exceeds the {mapping.nbytes} bytes of the CUDA allocation")
    return IpcMapping(device_id, byte_size, mapping)


@contextmanager
def _as_invalid() -> Iterator[None]:
    """The engine's CUDA errors (and its span checks) as INVALID_ARGUMENT with the same message."""
    try:
        yield
    except (KilnError, ValueError) as e:
        raise invalid(str(e)) from None
