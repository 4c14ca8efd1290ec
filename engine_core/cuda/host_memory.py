"""Host memory someone else allocated (a mapped POSIX shared-memory object), page-locked and mapped for the device.

Why: a client's system shared-memory region otherwise reaches the device through two copies, one into the run's
pinned staging mirror on the host (in a server worker thread, holding the interpreter lock for ~11 MB a ResNet-50
batch of 19) and one DMA. Once registered with ``cuMemHostRegister`` (portable, device-mapped), the device reads
inputs from and writes outputs to those host addresses itself: ``HostRegistration.view`` gives the ``DeviceView``
that ``ExecutionContext.infer_batch`` gathers from and delivers to, as it does for CUDA shared memory.

Lifetime: views keep their registration alive (``MappedHostView.owner``), and the registration unpins the range only
when it is closed and no view is left, so memory a queued run will read is never unpinned under it. Whoever owns
the mapping must keep it mapped until ``on_release`` is called.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine_core.cuda.driver import DEVICE_LOCK, check, primary_context
from engine_core.cuda.view import DeviceView


@dataclass(frozen=True)
class MappedHostView(DeviceView):
    """A ``DeviceView`` of page-locked host memory (the device address of a host range), holding the
    registration it came from so the range stays pinned while the view lives."""

    owner: Any = field(default=None, compare=False, repr=False)


class HostRegistration:
    """``[address, address + nbytes)`` of host memory, page-locked and mapped into every context
    (``CU_MEMHOSTREGISTER_PORTABLE | DEVICEMAP``) until ``close`` and the last view are gone."""

    def __init__(self, address: int, nbytes: int, on_release: Callable[[], None] | None = None) -> None:
        from cuda.bindings import driver

        self._registered = False  # what __del__ undoes; an __init__ that raised leaves nothing to undo
        if address <= 0 or nbytes <= 0:
            raise ValueError(f"cannot page-lock {nbytes} bytes at address {address:#x}")
        primary_context()
        flags = (driver.CU_MEMHOSTREGISTER_PORTABLE | driver.CU_MEMHOSTREGISTER_DEVICEMAP)
        with DEVICE_LOCK:
            check(driver.cuMemHostRegister(address, nbytes, flags), "cuMemHostRegister")
        try:
            self.device_address = int(check(driver.cuMemHostGetDevicePointer(address, 0),
                                            "cuMemHostGetDevicePointer"))
        except Exception:
            with DEVICE_LOCK:
                driver.cuMemHostUnregister(address)
            raise
        self.address, self.nbytes = int(address), int(nbytes)
        self._on_release = on_release
        self._closed = False
        self._registered = True

    def view(self, offset: int, shape: Sequence[int], dtype: np.dtype | type | str) -> MappedHostView:
        """The tensor of ``shape`` and ``dtype`` at ``offset`` (row-major), by its device address."""
        view = MappedHostView(self.device_address + offset, tuple(shape), np.dtype(dtype), self)
        if self._closed:
            raise ValueError("the host memory registration is closed")
        if offset < 0 or offset + view.nbytes > self.nbytes:
            raise ValueError(f"[{offset}, {offset + view.nbytes}) is outside the {self.nbytes} registered bytes")
        return view

    def close(self) -> None:
        """No new views; the range is unpinned (and ``on_release`` called) once the views still alive are gone
        (at once when there are none: this object is then only referenced by its caller)."""
        self._closed = True

    def __del__(self) -> None:
        """The last reference (the owner's and every view's) is gone: unpin, then let the owner unmap."""
        if not self._registered:
            return
        try:
            from cuda.bindings import driver

            primary_context()
            with DEVICE_LOCK:
                driver.cuMemHostUnregister(self.address)
        except Exception:
            pass
        if self._on_release is not None:
            self._on_release()
