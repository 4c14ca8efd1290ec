"""How a model version runs requests on one execution context: profile choice, batch buckets, gathering.

CUDA models that batch run at bucketed batch sizes (powers of two, the midpoints 3 * 2^k between them, and the
profile's largest batch): each distinct batch size is a binding on the device (lowering, cuDNN plans, a captured
CUDA graph; the activation arena is shared), so buckets bound them to about 2 * log2(max batch), and
`server.core.warmup` prepares every one when the model loads. Why the midpoints: a batch runs at the cost of its
bucket, and with powers of two alone a batch of 70 paid for 128 (BERT-base on an H100: 7.3 ms instead of ~5 at 96;
docs/performance.md); now no batch pays for more than a third of padding. Requests are
gathered by the engine (`ExecutionContext.infer_batch`) straight into its staging buffers, zero-padded to the
bucket there; outputs come back per request, so the server never concatenates or pads arrays itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

Feeds = Mapping[str, np.ndarray]
ProfileShapes = dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]


def batch_buckets(highest: int) -> list[int]:
    """The batch sizes a CUDA model runs at: powers of two and 3 * 2^k below `highest`, and `highest` itself."""
    buckets, size = [], 1
    while size < highest:
        buckets.append(size)
        if size >= 2 and size * 3 // 2 < highest:
            buckets.append(size * 3 // 2)
        size *= 2
    return [*buckets, highest]


def bucket_for(batch: int, highest: int) -> int:
    """The smallest bucket that holds `batch` rows (`batch` itself above `highest`: the engine then refuses it)."""
    return batch if batch >= highest else min(b for b in batch_buckets(highest) if b >= batch)


def highest_batch(engine, names: Sequence[str]) -> int:
    """The largest batch any optimization profile allows for these inputs."""
    return max(p[name][2][0] for p in engine.plan.profiles for name in names if name in p)


def select_profile(profiles: list[ProfileShapes], shapes: Mapping[str, tuple[int, ...]]) -> int:
    """The profile whose min..max covers every input shape, with the least total distance to its opt shapes
    (the smallest kernels/padding that still fit); profile 0 when none covers them (its error then says why)."""
    best, best_distance = 0, None
    for index, profile in enumerate(profiles):
        distance = 0
        for name, shape in shapes.items():
            if name not in profile:
                continue
            low, opt, high = profile[name]
            if len(shape) != len(low) or not all(a <= d <= b for a, d, b in zip(low, shape, high)):
                break
            distance += sum(abs(o - d) for o, d in zip(opt, shape))
        else:
            if best_distance is None or distance < best_distance:
                best, best_distance = index, distance
    return best


def use_profile_for(context, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Switch `context` to the optimization profile that fits these input shapes best."""
    engine = context.engine
    if engine.num_optimization_profiles > 1:
        profile = select_profile(engine.plan.profiles, shapes)
        if profile != context.active_optimization_profile:
            context.set_optimization_profile_async(profile)


def execute(context, inputs: Feeds) -> dict[str, np.ndarray]:
    """Run one job's inputs as they are (models that do not batch, and the CPU backend)."""
    use_profile_for(context, {name: tuple(a.shape) for name, a in inputs.items()})
    return context.infer(inputs)


def _rows(feeds: Feeds) -> int | None:
    sizes = {a.shape[0] for a in feeds.values() if len(a.shape)}
    return sizes.pop() if len(sizes) == 1 else None


def execute_parts(context, parts: Sequence[Feeds], destinations: Sequence[Mapping[str, Any]] | None = None,
                  routes: Sequence[Any] | None = None, *, bucketed: bool) -> list[Any]:
    """Run several jobs as one batch (the dynamic batcher), each job's outputs returned separately, or written
    to its `destinations` (DeviceViews in CUDA shared memory) on the device. `bucketed`: pad the batch to its
    bucket (CUDA models that batch). `routes` (an executor's lanes only): where the executor may send each job's
    response itself (server/core/direct_replies.py)."""
    gathered, pad_to = _gathering(context, parts, bucketed)
    if not gathered:  # no common batch dim to gather along (device tensors need one: core.py)
        return [execute(context, feeds) for feeds in parts]
    if routes is not None:
        return context.infer_batch(list(parts), pad_to=pad_to, destinations=destinations, routes=routes)
    return context.infer_batch(list(parts), pad_to=pad_to, destinations=destinations)


async def execute_parts_async(context, parts: Sequence[Feeds], destinations: Sequence[Mapping[str, Any]] | None = None,
                              routes: Sequence[Any] | None = None, *, bucketed: bool) -> list[Any]:
    """`execute_parts` on the event loop, for contexts whose batches cross to an executor process there
    (`RemoteContext.infer_batch_async`); parts without a common batch dim run in a worker thread."""
    gathered, pad_to = _gathering(context, parts, bucketed)
    if not gathered:
        return await asyncio.to_thread(execute_parts, context, parts, destinations, routes, bucketed=bucketed)
    return await context.infer_batch_async(list(parts), pad_to=pad_to, destinations=destinations, routes=routes)


def _gathering(context, parts: Sequence[Feeds], bucketed: bool) -> tuple[bool, int | None]:
    """Whether the parts gather along a common batch dim, and the bucket to pad their rows to (None: their own
    count); the context switched to the profile that fits the batch."""
    rows = [_rows(feeds) for feeds in parts]
    if any(r is None for r in rows):
        return False, None
    total = sum(rows)  # type: ignore[arg-type]
    shapes = {name: (total, *a.shape[1:]) for name, a in parts[0].items()}
    pad_to = None
    if bucketed:
        pad_to = bucket_for(total, highest_batch(context.engine, list(shapes)))
        shapes = {name: (pad_to, *shape[1:]) for name, shape in shapes.items()}
    use_profile_for(context, shapes)
    return True, (pad_to if pad_to != total else None)


def execute_bucketed(context, inputs: Feeds) -> dict[str, np.ndarray]:
    """One job of a CUDA model that batches: padded to its bucket by the engine, outputs cut back."""
    return execute_parts(context, [inputs], bucketed=True)[0]
