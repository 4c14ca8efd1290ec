"""Shared-memory regions clients register so tensors need not travel in the request (Triton's extension).

System shared memory is a POSIX object (`/dev/shm/<key>`) mapped here; inputs are read from and outputs
written to `[offset, offset + byte_size)` of a region. CUDA shared memory needs CUDA IPC, which this server
does not have: those calls fail with UNAVAILABLE instead of pretending to work.
"""

from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass

from .errors import ErrorKind, ServerError, invalid, not_found, unavailable

SHM_ROOT = "/dev/shm"


@dataclass
class SystemRegion:
    name: str
    key: str
    offset: int
    byte_size: int
    mapping: mmap.mmap

    def status(self) -> dict[str, object]:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}


class SystemSharedMemory:
    """The registered system shared-memory regions, by name."""

    def __init__(self) -> None:
        self._regions: dict[str, SystemRegion] = {}
        self._lock = threading.Lock()

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Map `byte_size` bytes at `offset` of the POSIX shared-memory object `key`."""
        if not name:
            raise invalid("a shared memory region needs a name")
        if offset < 0 or byte_size <= 0:
            raise invalid(f"shared memory region '{name}': offset must be >= 0 and byte_size > 0")
        with self._lock:
            if name in self._regions:
                raise ServerError(ErrorKind.ALREADY_EXISTS,
                                  f"shared memory region '{name}' is already registered")
            self._regions[name] = SystemRegion(name, key, offset, byte_size, _map(name, key, offset, byte_size))

    def unregister(self, name: str = "") -> None:
        """Unregister `name`, or every region when `name` is empty (unknown names are ignored, as in Triton)."""
        with self._lock:
            names = [name] if name else list(self._regions)
            for region_name in names:
                region = self._regions.pop(region_name, None)
                if region is not None:
                    region.mapping.close()

    def status(self, name: str = "") -> list[dict[str, object]]:
        with self._lock:
            if name:
                if name not in self._regions:
                    raise not_found(f"shared memory region '{name}' is not registered")
                return [self._regions[name].status()]
            return [r.status() for r in self._regions.values()]

    def _span(self, name: str, offset: int, byte_size: int) -> tuple[SystemRegion, int]:
        region = self._regions.get(name)
        if region is None:
            raise invalid(f"shared memory region '{name}' is not registered")
        if offset < 0 or byte_size < 0 or offset + byte_size > region.byte_size:
            raise invalid(f"shared memory region '{name}': [{offset}, {offset + byte_size}) is outside its "
                          f"{region.byte_size} bytes")
        return region, region.offset + offset

    def read(self, name: str, offset: int, byte_size: int) -> bytes:
        """A copy of `byte_size` bytes at `offset` (relative to the registered offset) of region `name`."""
        with self._lock:
            region, start = self._span(name, offset, byte_size)
            return bytes(region.mapping[start:start + byte_size])

    def write(self, name: str, offset: int, byte_size: int, data: bytes) -> None:
        """Write `data` into a span of `byte_size` bytes; INVALID_ARGUMENT if it does not fit."""
        if len(data) > byte_size:
            raise invalid(f"output needs {len(data)} bytes, shared memory region '{name}' span has {byte_size}")
        with self._lock:
            region, start = self._span(name, offset, byte_size)
            region.mapping[start:start + len(data)] = data

    def close(self) -> None:
        self.unregister("")


def _map(name: str, key: str, offset: int, byte_size: int) -> mmap.mmap:
    """mmap the whole object (offsets into it need not be page-aligned) after checking it is big enough."""
    path = os.path.join(SHM_ROOT, key.lstrip("/"))
    if "/" in key.strip("/") or not key.strip("/"):
        raise invalid(f"shared memory region '{name}': invalid key '{key}'")
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as e:
        raise invalid(f"shared memory region '{name}': cannot open key '{key}': {e.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        if offset + byte_size > size:
            raise invalid(f"shared memory region '{name}': offset {offset} + byte_size {byte_size} exceeds the "
                          f"{size} bytes of '{key}'")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def cuda_unavailable() -> ServerError:
    """The error every CUDA shared-memory call gets: no CUDA IPC here, so nothing is registered."""
    return unavailable("CUDA shared memory is not supported by this server (no CUDA IPC support); "
                       "use system shared memory instead")
