"""Activation memory planner: liveness intervals -> offsets into one device arena.

Why one arena: a single allocation per execution context makes ``device_memory_size`` the true peak
(what the user must provide with a user-managed strategy), and two tensors whose lifetimes do not
overlap share bytes. Placement is greedy best-fit, largest tensors first (the classic offset
planner): each tensor takes the lowest 256-byte-aligned offset that overlaps no live-interval
neighbour already placed. Pure Python: no GPU needed to plan or to test.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

ALIGNMENT = 256


def align_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    return (int(nbytes) + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class Interval:
    """A tensor that lives from the step that writes it to the last step that reads it (inclusive)."""

    name: str
    nbytes: int
    first: int
    last: int

    def overlaps(self, other: Interval) -> bool:
        return self.first <= other.last and other.first <= self.last


@dataclass
class MemoryPlan:
    """Where each planned tensor lives in the arena, and the arena's size (the real peak)."""

    offsets: dict[str, int]
    size: int
    #: sum of all planned tensors, aligned: what the plan would take without reuse
    total_unshared: int


def liveness(steps: Sequence[tuple[Sequence[str], Sequence[str]]], sizes: Mapping[str, int],
             keep_alive: Iterable[str] = ()) -> list[Interval]:
    """Intervals for the tensors in ``sizes`` from ``steps`` = [(inputs, outputs)] in run order.

    A tensor written but never read still occupies its step; ``keep_alive`` tensors live to the end.
    """
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for index, (inputs, outputs) in enumerate(steps):
        for name in outputs:
            if name in sizes:
                first.setdefault(name, index)
                last[name] = max(last.get(name, index), index)
        for name in inputs:
            if name in sizes:
                first.setdefault(name, index)
                last[name] = index
    end = max(len(steps) - 1, 0)
    for name in keep_alive:
        if name in first:
            last[name] = end
    return [Interval(n, int(sizes[n]), first[n], last[n]) for n in first]


def plan_memory(intervals: Sequence[Interval], alignment: int = ALIGNMENT) -> MemoryPlan:
    """Best-fit offset assignment; tensors of 0 bytes get offset 0 and take no space."""
    placed: list[tuple[Interval, int, int]] = []  # (interval, offset, aligned size)
    offsets: dict[str, int] = {}
    order = sorted(intervals, key=lambda t: (-t.nbytes, t.first, t.name))
    for tensor in order:
        size = align_up(tensor.nbytes, alignment)
        if size == 0:
            offsets[tensor.name] = 0
            continue
        busy = sorted((off, off + sz) for other, off, sz in placed if other.overlaps(tensor))
        offsets[tensor.name] = _lowest_gap(busy, size)
        placed.append((tensor, offsets[tensor.name], size))
    peak = max((off + sz for _, off, sz in placed), default=0)
    total = sum(align_up(t.nbytes, alignment) for t in intervals)
    return MemoryPlan(offsets, peak, total)


def _lowest_gap(busy: list[tuple[int, int]], size: int) -> int:
    """Smallest offset where [offset, offset+size) avoids every busy range (sorted by start)."""
    best: int | None = None
    best_slack: int | None = None
    cursor = 0
    for start, stop in busy:
        if start - cursor >= size:
            slack = start - cursor - size
            if best_slack is None or slack < best_slack:
                best, best_slack = cursor, slack
        cursor = max(cursor, stop)
    return cursor if best is None else best
