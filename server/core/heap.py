"""Keeping Python's cyclic garbage collector off the server's long-lived objects.

A loaded model brings hundreds of thousands of long-lived objects (ONNX protos, plans, modules). Every full
(generation 2) collection walked all of them: ~50 ms with the event loop stopped, every couple of seconds under
load, which was the whole p99 of a CPU server at 64 clients (docs/performance.md). Frozen objects are skipped by
the collector; they are still freed by reference counting, and `freeze_long_lived` unfreezes and collects first,
so cycles of an unloaded model are not kept forever.
"""

from __future__ import annotations

import gc


def freeze_long_lived() -> None:
    """Collect what is garbage now, then exempt everything left from later collections. Call it when the set of
    long-lived objects changes (a model loaded or unloaded, listeners started): it costs one full collection."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
