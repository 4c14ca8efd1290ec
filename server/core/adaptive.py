"""Traffic-adaptive optimization profiles: record the request shapes a model sees, fit profiles to them.

A model whose inputs have variable (-1) dims gets one profile by default, covering 1..DYNAMIC_DIM_MAX for
each such dim. Real traffic is rarely uniform over that range, so `ShapeHistogram` counts the sizes each
variable dim takes in requests (bounded memory: one counter per dim, at most DYNAMIC_DIM_MAX entries), and
`fit_profiles` turns its quantiles into nested profiles: profile k covers every variable dim up to the k-th
quantile cut (opt = max = the cut), and a last one reaches the declared maximum so no shape that was valid
before becomes invalid. Profile selection picks the smallest profile that covers a batch, and with padding
on (`kiln_pad_batch`) only requests of one profile are padded together, so a short request is no longer
padded to the longest one in its batch. With `--adaptive-profiles` (`AdaptiveSettings`) the server refits
every `interval_s`, and when the fit changed it builds the new plan in the background and hot-swaps it
(`ServerCore.refit_profiles`): requests already queued finish on the old plan, none fail. Only models where
profiles can pay off are refitted (`ModelVersion.profiles_matter`: CUDA plans, or padding on); a refit whose
cuts are within 25% of the current plan's (`close_enough`) is skipped, so wobbling quantiles cause no rebuilds.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Mapping

import numpy as np

# Per input: (min, opt, max) shapes, batch dim included when the model batches.
ProfileRanges = dict[str, tuple[list[int], list[int], list[int]]]
DimKey = tuple[str, int]  # (input name, axis in the engine-ready array)


class ShapeHistogram:
    """How often each size of each variable dim occurred in requests (engine-ready arrays, batch dim excluded).

    `record` runs on the event loop for every request, so it does a few dict increments and nothing else.
    """

    def __init__(self, variable_dims: Mapping[str, list[int]]) -> None:
        self.variable_dims = {name: list(axes) for name, axes in variable_dims.items() if axes}
        self.counts: dict[DimKey, collections.Counter[int]] = {
            (name, axis): collections.Counter() for name, axes in self.variable_dims.items() for axis in axes}
        self.requests = 0
        self._lock = threading.Lock()

    def record(self, inputs: Mapping[str, np.ndarray]) -> None:
        if not self.counts:
            return
        with self._lock:
            self.requests += 1
            for name, axes in self.variable_dims.items():
                array = inputs.get(name)
                if array is None:
                    continue
                for axis in axes:
                    if axis < len(array.shape):  # numpy arrays and DeviceViews (CUDA shared memory)
                        self.counts[(name, axis)][int(array.shape[axis])] += 1

    def quantile_cuts(self, profiles: int) -> dict[DimKey, list[int]]:
        """Per variable dim: the sizes at quantiles 1/n, 2/n, ..., 1 of the traffic (deduplicated, ascending)."""
        with self._lock:
            snapshot = {key: sorted(counter.items()) for key, counter in self.counts.items()}
        cuts = {}
        for key, items in snapshot.items():
            if not items:
                continue
            sizes = np.array([size for size, _ in items])
            cumulative = np.cumsum([count for _, count in items]) / sum(count for _, count in items)
            picks = [int(sizes[min(int(np.searchsorted(cumulative, q - 1e-9)), len(sizes) - 1)])
                     for q in np.linspace(1 / profiles, 1, profiles)]
            cuts[key] = sorted(set(picks))
        return cuts

    def adopt(self, other: ShapeHistogram) -> None:
        """Continue counting where `other` (the histogram of the plan being replaced) left off."""
        with self._lock, other._lock:
            for key, counter in other.counts.items():
                if key in self.counts:
                    self.counts[key].update(counter)
            self.requests += other.requests


def variable_dims(ranges: ProfileRanges, batched: bool) -> dict[str, list[int]]:
    """The axes of each input whose min and max differ, batch dim excluded (the batcher owns that one)."""
    first = 1 if batched else 0
    return {name: [axis for axis in range(first, len(low)) if low[axis] != high[axis]]
            for name, (low, _, high) in ranges.items()}


def fit_profiles(histogram: ShapeHistogram, base: ProfileRanges, count: int) -> list[ProfileRanges] | None:
    """Nested profiles fitted to the traffic: profile k has opt = max = the k-th quantile cut of every variable
    dim (dims with fewer distinct cuts repeat their last), and the last profile reaches `base`'s max so every
    shape `base` allowed stays allowed. None when the histogram has seen no variable dim yet."""
    cuts = histogram.quantile_cuts(max(count, 1))
    if not cuts:
        return None
    levels = max(len(c) for c in cuts.values())
    profiles: list[ProfileRanges] = []
    for level in range(levels):
        profile: ProfileRanges = {}
        for name, (low, opt, high) in base.items():
            top, best = list(high), list(opt)
            for axis in range(len(low)):
                key_cuts = cuts.get((name, axis))
                if key_cuts:
                    size = min(max(key_cuts[min(level, len(key_cuts) - 1)], low[axis]), high[axis])
                    top[axis], best[axis] = size, size
            profile[name] = (list(low), best, top)
        profiles.append(profile)
    last = profiles[-1]
    if any(last[name][2] != list(high) for name, (_, _, high) in base.items()):
        profiles.append({name: (list(low), list(last[name][1]), list(high)) for name, (low, _, high) in base.items()})
    return profiles


def same_profiles(a: list[ProfileRanges], b: list[ProfileRanges]) -> bool:
    """Whether two profile lists are equal (as plain lists of ints), so a refit that changed nothing is skipped."""
    def plain(profiles: list[ProfileRanges]) -> list[dict[str, list[list[int]]]]:
        return [{name: [list(map(int, s)) for s in shapes] for name, shapes in p.items()} for p in profiles]

    return plain(a) == plain(b)


def close_enough(fitted: list[ProfileRanges], current: list[ProfileRanges], tolerance: float = 0.25) -> bool:
    """Whether `current` already fits the traffic: same number of profiles and every max within `tolerance`
    (relative) of the fitted one. Quantiles wobble with traffic; this keeps the server from rebuilding for it."""
    if len(fitted) != len(current) or any(set(f) != set(c) for f, c in zip(fitted, current)):
        return False
    for f, c in zip(fitted, current):
        for name, (_, _, high) in f.items():
            if any(abs(a - b) > tolerance * max(a, b) for a, b in zip(high, c[name][2])):
                return False
    return True


def describe(profiles: list[ProfileRanges]) -> str:
    """One line per profile, for the log: `X max [8, 32]; ...`."""
    return " | ".join("; ".join(f"{name} max {list(high)}" for name, (_, _, high) in p.items()) for p in profiles)
