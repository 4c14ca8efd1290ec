"""Shared-memory regions clients register so tensors need not travel in the request (Triton's extensions).

Error texts are Triton's (server/src/shared_memory_manager.cc, common.cc), our details follow in parentheses,
since client code compares them.

System shared memory is a POSIX object (`/dev/shm/<key>`) mapped here; on a server with a CUDA device the mapping
is also page-locked and mapped for the device (`engine_core.cuda.host_memory`), so CUDA models read inputs from it
and write outputs into it on the device, with no copy through a staging buffer (`device_view`). CUDA shared memory
is a client's device allocation opened through CUDA IPC (`cuda_ipc.py`). As in Triton, both kinds share one
namespace of region names, and inputs are read from and outputs written to `[offset, offset + byte_size)` of a
region whatever its kind, with the same checks.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import math
import mmap
import os
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from engine_core.cuda.view import DeviceView

from . import cuda_ipc, executor
from .errors import ErrorKind, ServerError, invalid, not_found, unavailable
from .executor_wire import RegionMap, RegionView
from .tensor_arena import ARENA_PREFIX

SHM_ROOT = "/dev/shm"
LOG = logging.getLogger("kiln.shared_memory")


SYSTEM = "system"
CUDA = "cuda"
#: registration ids: how executor processes name a region (a name can be registered again for other memory)
_REGION_IDS = itertools.count(1)


class Region(Protocol):
    """What inference needs of a registered region, whatever memory backs it."""

    name: str
    kind: str
    byte_size: int
    internal: bool  # the server's own (a frontend's tensor arena): clients neither see nor remove it

    def read(self, offset: int, nbytes: int) -> bytes | memoryview: ...
    def write(self, offset: int, data: bytes) -> None: ...
    def device_view(self, offset: int, shape: Sequence[int], dtype: np.dtype) -> DeviceView | None: ...
    def close(self) -> None: ...
    def status(self) -> dict[str, object]: ...


@dataclass
class SystemRegion:
    name: str
    key: str
    offset: int
    byte_size: int
    mapping: mmap.mmap
    kind: str = SYSTEM
    #: the whole mapping page-locked for the device (`engine_core.cuda.host_memory.HostRegistration`); None on
    #: servers without a CUDA device or where the driver refused
    pinned: Any = None
    #: a frontend process's tensor arena (tensor_arena.py): not a client's, so clients neither see nor remove it
    internal: bool = False
    #: a descriptor of the object, kept for executor processes (`executor.py`), which map the region themselves
    #: and get it with the first batch that names it; -1 when executors do not run here
    fd: int = -1
    region_id: int = field(default_factory=lambda: next(_REGION_IDS))

    def __post_init__(self) -> None:
        if self.fd >= 0:  # executors unmap it, and the descriptor closes, once no queued job names the region
            weakref.finalize(self, _released, self.region_id, self.fd)

    @property
    def in_place(self) -> bool:
        """Whether jobs may name its tensors in place (page-locked here, or mapped by executors) rather than
        reading them into host arrays."""
        return self.pinned is not None or self.fd >= 0

    def executor_map(self, fd_index: int) -> tuple[RegionMap, int]:
        return RegionMap(self.region_id, SYSTEM, len(self.mapping), fd_index), self.fd

    def read(self, offset: int, nbytes: int) -> memoryview:
        """The bytes in place, read-only: the engine copies them once, into its staging buffer, when the request
        executes (Triton's contract too: the client leaves a region alone until the response arrives). A copy
        here cost the core's event loop ~15% of its time with 600 KB images."""
        start = self.offset + offset
        return memoryview(self.mapping).toreadonly()[start:start + nbytes]

    def write(self, offset: int, data: bytes) -> None:
        start = self.offset + offset
        self.mapping[start:start + len(data)] = data

    def device_view(self, offset: int, shape: Sequence[int], dtype: np.dtype) -> DeviceView | None:
        """The tensor at `offset` by its device address when the mapping is page-locked, by reference for executor
        processes, else None."""
        if self.fd >= 0:
            return RegionView(-1, tuple(shape), np.dtype(dtype), self.region_id, self.offset + offset, self)
        if self.pinned is None:
            return None
        return self.pinned.view(self.offset + offset, shape, dtype)  # type: ignore[no-any-return]

    def close(self) -> None:
        """Unmap; a page-locked mapping is unpinned and unmapped once the views queued runs hold are gone."""
        if self.pinned is not None:
            self.pinned.close()
            self.pinned = None  # the registration's last reference may go here: it then unpins and unmaps now
            return
        _close_mapping(self.mapping)

    def status(self) -> dict[str, object]:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}


@dataclass
class CudaRegion:
    name: str
    device_id: int
    byte_size: int
    ipc: cuda_ipc.IpcMapping
    kind: str = CUDA
    internal: bool = False
    #: the client's IPC handle, for executor processes (they open it themselves); empty when none run here
    raw_handle: bytes = b""
    region_id: int = field(default_factory=lambda: next(_REGION_IDS))

    def __post_init__(self) -> None:
        if self.raw_handle:
            weakref.finalize(self, _released, self.region_id, -1)

    def executor_map(self, fd_index: int) -> tuple[RegionMap, None]:
        return RegionMap(self.region_id, CUDA, self.byte_size, ipc_handle=self.raw_handle,
                         device_id=self.device_id), None

    def read(self, offset: int, nbytes: int) -> bytes:
        return self.ipc.read(offset, nbytes)

    def write(self, offset: int, data: bytes) -> None:
        self.ipc.write(offset, data)

    def device_view(self, offset: int, shape: Sequence[int], dtype: np.dtype) -> DeviceView:
        if self.raw_handle:
            view = self.ipc.view(offset, shape, dtype)  # checks the span
            return RegionView(-1, view.shape, view.dtype, self.region_id, offset, self)
        return self.ipc.view(offset, shape, dtype)

    def close(self) -> None:
        self.ipc.close()

    def status(self) -> dict[str, object]:
        return {"name": self.name, "device_id": self.device_id, "byte_size": self.byte_size}


class SharedMemory:
    """The registered shared-memory regions of both kinds, by name (one namespace, as in Triton).

    `register`/`unregister`/`status` are the system extension, the `*_cuda` methods the CUDA one; each
    kind's calls see only regions of that kind. `read`/`write` serve inference for either kind.
    """

    def __init__(self, remote: bool | None = None) -> None:
        self._regions: dict[str, Region] = {}
        self._lock = threading.Lock()
        #: regions go to executor processes by reference (`executor.remote_regions`), not page-locked here
        self.remote = executor.remote_regions(cuda_ipc.available()) if remote is None else remote

    # -- system shared memory ---------------------------------------------------------------------------
    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Map `byte_size` bytes at `offset` of the POSIX shared-memory object `key`."""
        _check_name(name)
        if name.startswith(ARENA_PREFIX):
            raise invalid(f"failed to register shared memory region '{name}': names starting with "
                          f"'{ARENA_PREFIX}' are reserved for the server's own regions")
        if offset < 0 or byte_size <= 0:
            raise invalid(f"failed to register shared memory region '{name}': invalid args (offset must be >= 0 "
                          "and byte_size > 0)")
        self._add_system(name, key, offset, byte_size)

    def unregister(self, name: str = "") -> None:
        """Unregister `name`, or every system region when `name` is empty (unknown names are ignored)."""
        self._unregister(SYSTEM, name)

    def register_arena(self, name: str, key: str, byte_size: int) -> None:
        """A frontend process's tensor arena (tensor_arena.py): a system region clients do not see."""
        if not name.startswith(ARENA_PREFIX):
            raise invalid(f"a tensor arena's name must start with '{ARENA_PREFIX}', got '{name}'")
        self._add_system(name, key, 0, byte_size, internal=True)

    def _add_system(self, name: str, key: str, offset: int, byte_size: int, internal: bool = False) -> None:
        """Map (and page-lock) outside the lock: pinning a large region takes a while, and inference on the event
        loop resolves regions under the same lock. The name is checked before and again when the region goes in."""
        with self._lock:
            self._check_free(name)
        mapping, fd = _map(name, key, offset, byte_size, keep_fd=self.remote)
        region = SystemRegion(name, key, offset, byte_size, mapping, internal=internal, fd=fd,
                              pinned=None if self.remote else _pinned(name, mapping))
        with self._lock:
            try:
                self._check_free(name)  # another registration of this name won meanwhile
            except ServerError:
                region.close()
                raise
            self._regions[name] = region
        if internal and region.fd >= 0:  # a frontend's arena: executors map it now, not on its first batch
            executor.arena_registered(region)

    def unregister_arena(self, name: str) -> None:
        """Forget a frontend's arena (its connection closed); runs still reading it keep it mapped until done."""
        with self._lock:
            region = self._regions.pop(name, None)
        if region is not None:
            region.close()

    def status(self, name: str = "") -> list[dict[str, object]]:
        return self._status(SYSTEM, name)

    # -- CUDA shared memory -----------------------------------------------------------------------------
    def register_cuda(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        """Open the client's CUDA IPC handle (64 raw bytes) of an allocation of >= `byte_size` on `device_id`."""
        _check_name(name)
        with self._lock:
            self._check_free(name)
            try:
                ipc = cuda_ipc.open_handle(bytes(raw_handle), int(device_id), int(byte_size))
            except ServerError as e:
                raise ServerError(e.kind, f"failed to register CUDA shared memory region '{name}': "
                                          f"{e.message}") from None
            self._regions[name] = CudaRegion(name, int(device_id), int(byte_size), ipc,
                                             raw_handle=bytes(raw_handle) if self.remote else b"")

    def unregister_cuda(self, name: str = "") -> None:
        """Close `name`'s IPC mapping, or every CUDA region's when `name` is empty (unknown names ignored)."""
        self._unregister(CUDA, name)

    def cuda_status(self, name: str = "") -> list[dict[str, object]]:
        return self._status(CUDA, name)

    # -- inference ----------------------------------------------------------------------------------------
    def read(self, name: str, offset: int, byte_size: int) -> bytes | memoryview:
        """The `byte_size` bytes at `offset` (relative to the registered offset) of region `name`: a read-only view
        of a system region, a copy of a CUDA one."""
        with self._lock:
            region = self._span(name, offset, byte_size)
            return region.read(offset, byte_size)

    def device_view(self, name: str, offset: int, byte_size: int, shape: Sequence[int],
                    dtype: np.dtype, system: bool = True) -> DeviceView | None:
        """The tensor at `offset` of region `name` in place, by its device address: a CUDA region's, or (with
        `system`) a page-locked system region's; else None. The engine reads inputs from it and writes outputs
        into it on the device, with no copy through a host staging buffer. INVALID_ARGUMENT when the span is
        outside the region or smaller than the tensor."""
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        with self._lock:
            region = self._span(name, offset, byte_size)
            if isinstance(region, SystemRegion) and (not system or not region.in_place):
                return None
            if nbytes > byte_size:
                raise invalid(f"shared memory region '{name}': {byte_size} bytes at offset {offset} cannot hold "
                              f"the {nbytes} bytes of a {np.dtype(dtype)} tensor of shape {list(shape)}")
            return region.device_view(offset, shape, dtype)

    def is_cuda(self, name: str) -> bool:
        """Whether `name` is a registered CUDA region: device memory, which the response cache leaves alone."""
        with self._lock:
            region = self._regions.get(name)
            return region is not None and region.kind == CUDA

    def write(self, name: str, offset: int, byte_size: int, data: bytes) -> None:
        """Write `data` into a span of `byte_size` bytes; INVALID_ARGUMENT if it does not fit."""
        if len(data) > byte_size:
            raise invalid(f"output needs {len(data)} bytes, shared memory region '{name}' span has {byte_size}")
        with self._lock:
            region = self._span(name, offset, byte_size)
            region.write(offset, data)

    def close(self) -> None:
        self.unregister("")
        self.unregister_cuda("")

    # -- helpers ------------------------------------------------------------------------------------------
    def _check_free(self, name: str) -> None:
        if name in self._regions:
            kind = "CUDA" if self._regions[name].kind == CUDA else "system"
            raise ServerError(ErrorKind.ALREADY_EXISTS, f"shared memory region '{name}' already in manager "
                                                        f"(already registered as {kind} shared memory)")

    def _unregister(self, kind: str, name: str) -> None:
        """Forget then close each region; one that fails to close (a CUDA error) does not keep the rest open."""
        failures: list[ServerError] = []
        with self._lock:
            names = [name] if name else list(self._regions)
            for region_name in names:
                region = self._regions.get(region_name)
                if region is not None and region.kind == kind and not region.internal:
                    del self._regions[region_name]
                    try:
                        region.close()
                    except ServerError as e:
                        failures.append(e)
        if failures:
            raise failures[0]

    def _status(self, kind: str, name: str) -> list[dict[str, object]]:
        label = "cuda" if kind == CUDA else "system"
        with self._lock:
            if name:
                region = self._regions.get(name)
                if region is None or region.internal:
                    raise not_found(f"Unable to find {label} shared memory region: '{name}' (it is not registered)")
                if region.kind != kind:
                    other, this = ("CUDA", "system") if region.kind == CUDA else ("system", "CUDA")
                    raise not_found(f"The region named '{name}' is registered as {other} shared memory, not {this} "
                                    f"shared memory (the {label} region '{name}' is not registered)")
                return [region.status()]
            return [r.status() for r in self._regions.values() if r.kind == kind and not r.internal]

    def _span(self, name: str, offset: int, byte_size: int) -> Region:
        region = self._regions.get(name)
        if region is None:
            raise invalid(f"Unable to find shared memory region: '{name}' (it is not registered)")
        if offset < 0 or byte_size < 0 or offset + byte_size > region.byte_size:
            raise invalid(f"Invalid offset + byte size for shared memory region: '{name}' "
                          f"([{offset}, {offset + byte_size}) is outside its {region.byte_size} bytes)")
        return region


SystemSharedMemory = SharedMemory  # the name server/core/core.py imports


def _check_name(name: str) -> None:
    if not name:
        raise invalid("'region name' is necessary to register shared memory region (a shared memory region needs a name)")


def _map(name: str, key: str, offset: int, byte_size: int, keep_fd: bool = False) -> tuple[mmap.mmap, int]:
    """mmap the whole object (offsets into it need not be page-aligned) after checking it is big enough; with
    `keep_fd`, also a descriptor of it for executor processes (else -1)."""
    path = os.path.join(SHM_ROOT, key.lstrip("/"))
    if "/" in key.strip("/") or not key.strip("/"):
        raise invalid(f"cannot register shared memory region '{name}' - invalid shm key '{key}'")
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as e:
        raise invalid(f"Unable to open shared memory region: '{key}' (region '{name}': cannot open key '{key}': "
                      f"{e.strerror})") from None
    try:
        size = os.fstat(fd).st_size
        if offset + byte_size > size:
            raise invalid(f"failed to register shared memory region '{name}': invalid args (offset {offset} + "
                          f"byte_size {byte_size} exceeds the {size} bytes of '{key}')")
        return mmap.mmap(fd, size), (os.dup(fd) if keep_fd else -1)
    finally:
        os.close(fd)


def _released(region_id: int, fd: int) -> None:
    """A region object is gone (unregistered, and no job holds a view of it): executors forget it."""
    executor.region_released(region_id)
    if fd >= 0:
        os.close(fd)


def _close_mapping(mapping: mmap.mmap) -> None:
    try:
        mapping.close()
    except BufferError:  # a queued or running request still reads it: unmapped when its last view goes
        pass


def _pinned(name: str, mapping: mmap.mmap) -> Any:
    """The mapping page-locked for the device (`HostRegistration`, which unmaps it once released), or None on a
    server without a CUDA device, or where the driver refuses (then the region works through the host, as it
    would without a device, and the log says why)."""
    if not cuda_ipc.available() or len(mapping) == 0:
        return None
    from engine_core.cuda.host_memory import HostRegistration

    anchor = ctypes.c_char.from_buffer(mapping)  # an export of the mapping only while the address is read
    address = ctypes.addressof(anchor)
    del anchor
    try:
        return HostRegistration(address, len(mapping), on_release=lambda: _close_mapping(mapping))
    except Exception as e:  # noqa: BLE001 - a refusal costs speed, not correctness
        LOG.warning("system shared memory region '%s' stays pageable (device reads go through a staging copy): %s",
                    name, e)
        return None


def cuda_unavailable() -> ServerError:
    """Only for core.py until its CUDA shared-memory methods call `SharedMemory.*_cuda`; then delete this."""
    return unavailable("CUDA shared memory is not supported by this server (no CUDA IPC support); "
                       "use system shared memory instead")
