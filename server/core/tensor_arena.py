"""Request tensors from a frontend process to the core through shared memory instead of the core's socket.

Why: a ResNet-50 request carries 600 KB. Sent inline, the core's event loop reads every byte off its socket and
unpickles it (~1.3 GB/s at 2,200 img/s on an H100: the same interpreter lock the GPU workers need), and a worker
then copies each image again into the run's pinned staging buffer. With an arena, the frontend writes a group's
concatenated inputs into a POSIX shared-memory object it registered with the core, and sends only where they are,
as a client's system shared-memory request would name its region. The core maps the arena once; on a server with a
CUDA device it is page-locked (`shared_memory.SystemRegion.pinned`), so CUDA models gather those rows on the device
straight from it, and CPU models read them in place.

Lifetime: a frontend allocates from a ring (`_Ring`) and frees a call's space only when the core's reply to that
call arrives, so the core never reads memory the frontend has reused. A call that holds arena space is therefore
never withdrawn from the core (a request already running cannot stop reading its inputs); the frontend just drops
its late answer. When the ring is full a request goes inline, as before.

The arena is the core's region `ARENA_PREFIX<pid>`, hidden from clients (not listed, not unregistered by a
client's unregister-all, a name clients cannot register); the core unregisters it when the frontend's connection
closes. Its file is unlinked as soon as the core mapped it, so no crash leaves it in /dev/shm.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import mmap
import os
from dataclasses import dataclass
from typing import cast

import numpy as np

from .types import InferInput, InferRequest

log = logging.getLogger("kiln.server.arena")

#: region names of frontend arenas (clients cannot register names with this prefix)
ARENA_PREFIX = "__kiln_frontend_arena_"
#: a group's inputs go through the arena from this many bytes on; smaller ones are cheaper inline
MIN_ARENA_BYTES = 64 * 1024
#: arena space is handed out in multiples of this (device copies read 16-byte aligned addresses fastest)
_ALIGN = 256
#: default arena size per frontend process (`--frontend-arena-mb`; /dev/shm is 64 MB in a default container)
DEFAULT_ARENA_MB = 64


@dataclass
class _Span:
    start: int
    end: int
    live: bool = True


class _Ring:
    """First-in first-out allocation of ``capacity`` bytes: space is taken after the newest span and given back
    in order once the oldest spans are freed (replies come back roughly in the order calls went out; a slow one
    only holds back the space behind it)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._spans: collections.deque[_Span] = collections.deque()

    def allocate(self, nbytes: int) -> _Span | None:
        nbytes = -(-nbytes // _ALIGN) * _ALIGN
        if nbytes > self.capacity:
            return None
        if not self._spans:
            start = 0
        else:
            head, tail = self._spans[-1].end, self._spans[0].start
            if head > tail:  # in use: [tail, head); free: [head, capacity) and [0, tail)
                start = head if head + nbytes <= self.capacity else (0 if nbytes <= tail else -1)
            else:  # wrapped, in use: [tail, capacity) and [0, head); free: [head, tail)
                start = head if head + nbytes <= tail else -1
            if start < 0:
                return None
        span = _Span(start, start + nbytes)
        self._spans.append(span)
        return span

    def free(self, span: _Span) -> None:
        """Give ``span`` back: with the freed spans next to it at either end of the ring's used space (the newest
        ones: a placement that ran out of room gives back what it took)."""
        span.live = False
        while self._spans and not self._spans[0].live:
            self._spans.popleft()
        while self._spans and not self._spans[-1].live:
            self._spans.pop()

    @property
    def used(self) -> int:
        return len(self._spans)


class TensorArena:
    """A frontend's arena: the shared-memory object, its mapping and the ring that hands out its space."""

    def __init__(self, nbytes: int) -> None:
        self.name = f"{ARENA_PREFIX}{os.getpid()}"
        self.key = f"/kiln_arena_{os.getpid()}_{os.urandom(4).hex()}"
        self._path = path = os.path.join("/dev/shm", self.key.lstrip("/"))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # reserve the pages now: /dev/shm past its size limit (64 MB in a default container) would otherwise
            # fail the first write into them with SIGBUS, here ENOSPC
            os.posix_fallocate(fd, 0, nbytes)
            self._mapping = mmap.mmap(fd, nbytes)
        except OSError:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        self._bytes = np.frombuffer(self._mapping, np.uint8)
        self._ring = _Ring(nbytes)
        self.nbytes = nbytes

    def unlink(self) -> None:
        """Remove the file (the core's mapping and ours stay valid): called once the core has mapped it."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)

    def place(self, requests: list[InferRequest]) -> tuple[InferRequest, list[_Span]] | None:
        """One request holding `requests`' inputs concatenated along the batch dim, each large input written into
        the arena and named by region, offset and size (small ones stay in the message); None when nothing is large
        enough or the arena has no room (the caller sends the request as before). The spans go back to `release`
        once the core answered."""
        first = requests[0]
        datas = [[cast(np.ndarray, r.inputs[i].data) for r in requests] for i in range(len(first.inputs))]
        sizes = [sum(d.nbytes for d in parts) for parts in datas]
        if max(sizes, default=0) < MIN_ARENA_BYTES:
            return None
        spans: list[_Span] = []
        inputs = []
        for tensor, parts, nbytes in zip(first.inputs, datas, sizes):
            shape = (sum(p.shape[0] for p in parts), *tensor.shape[1:])
            span = self._ring.allocate(nbytes) if nbytes >= MIN_ARENA_BYTES else None
            if span is None:
                if nbytes >= MIN_ARENA_BYTES:  # no room: give back what this request took, send it inline
                    self.release(spans)
                    return None
                data = parts[0] if len(parts) == 1 else np.concatenate(parts)
                inputs.append(InferInput(tensor.name, tensor.datatype, shape, data))
                continue
            spans.append(span)
            dtype = parts[0].dtype
            target = self._bytes[span.start:span.start + nbytes].view(dtype).reshape(shape)
            if len(parts) == 1:
                np.copyto(target, parts[0])
            else:
                np.concatenate(parts, out=target)
            inputs.append(InferInput(tensor.name, tensor.datatype, shape, None, {
                "shared_memory_region": self.name, "shared_memory_offset": span.start,
                "shared_memory_byte_size": nbytes}))
        request = InferRequest(first.model_name, inputs, first.model_version, first.id if len(requests) == 1 else "",
                               first.outputs, first.parameters)
        return request, spans

    def release(self, spans: list[_Span]) -> None:
        for span in spans:
            self._ring.free(span)

    def close(self) -> None:
        self.unlink()
        del self._bytes
        with contextlib.suppress(BufferError):
            self._mapping.close()


def arena_bytes(megabytes: float) -> int:
    """The arena size in bytes for `--frontend-arena-mb` (0: no arena), whole pages."""
    return int(math.ceil(megabytes * (1 << 20) / mmap.PAGESIZE)) * mmap.PAGESIZE if megabytes > 0 else 0


#: the smallest arena worth having: a few ResNet-50 groups
MIN_ARENA_MB = 8


def open_arena(megabytes: float) -> TensorArena | None:
    """A frontend's arena of `megabytes`, or of half as much (down to MIN_ARENA_MB) while /dev/shm has no room for
    it (a container's is 64 MB by default, shared by every frontend); None when switched off or nothing fits
    (requests then go inline, and the log says why)."""
    if megabytes <= 0:
        return None
    while True:
        try:
            return TensorArena(arena_bytes(megabytes))
        except OSError as e:
            megabytes /= 2
            if megabytes < MIN_ARENA_MB:
                log.warning("no tensor arena (%s): large request tensors go to the core through its socket", e)
                return None
