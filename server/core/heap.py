"""The server's heap: Python's cyclic garbage collector kept off long-lived objects, and large buffers kept in
malloc's heap instead of a mapping each.

Collector: a loaded model brings hundreds of thousands of long-lived objects (ONNX protos, plans, modules). Every full
(generation 2) collection walked all of them: ~50 ms with the event loop stopped, every couple of seconds under
load, which was the whole p99 of a CPU server at 64 clients (docs/performance.md). Frozen objects are skipped by
the collector; they are still freed by reference counting, and `freeze_long_lived` unfreezes and collects first,
so cycles of an unloaded model are not kept forever.

Large buffers (`keep_large_buffers_in_heap`): glibc's malloc maps every allocation above its mmap threshold (128 KB at
first, raised to the largest such block freed, at most 32 MB) and gives the heap's free top back to the system past
its trim threshold (twice that). A served request of a 600 KB tensor makes several buffers that size (socket reads,
the joined frame, the parsed message), a few requests are in flight at once, and when they are done the freed top is
given back: the next requests fault every page in again. On the 2-core VM a frontend took ~340 page faults a request
for a [1, 150528] FP32 input over gRPC; with the thresholds fixed high, 100x fewer, its CPU per request halved and the
server answered 1.5x the requests a second at the same concurrency (docs/performance.md, "Large buffers in the heap").
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os

log = logging.getLogger("kiln.server.heap")

#: glibc's mallopt parameter numbers (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: allocations up to this size come from the heap (a request's tensors and frames), larger ones are mapped
MMAP_THRESHOLD_BYTES = 64 << 20
#: free memory at the heap's top kept for the next requests before it is given back to the system
TRIM_THRESHOLD_BYTES = 256 << 20


def freeze_long_lived() -> None:
    """Collect what is garbage now, then exempt everything left from later collections. Call it when the set of
    long-lived objects changes (a model loaded or unloaded, listeners started): it costs one full collection."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def keep_large_buffers_in_heap() -> bool:
    """Tune this process's malloc (glibc) so that request-sized buffers are reused from the heap instead of mapped and
    unmapped per request; whether it applied. Off with KILN_MALLOC_TUNING=0, and where GLIBC_TUNABLES already sets
    malloc's thresholds (the user's choice wins); a C library without `mallopt` (musl's is a stub, macOS has none)
    is left as it is."""
    if os.environ.get("KILN_MALLOC_TUNING", "1").strip() == "0":
        return False
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if "malloc.mmap_threshold" in tunables or "malloc.trim_threshold" in tunables:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD,
                                                                                     TRIM_THRESHOLD_BYTES))
    if not applied:
        log.info("malloc thresholds not set (this C library's mallopt refused them)")
    return applied
