"""Numbers of a measurement: latency percentiles, window stability, server-side statistics deltas.

Pure functions over plain lists and dicts so they are unit-tested without a server.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 95, 99)
SERVER_FIELDS = ("queue", "compute_input", "compute_infer", "compute_output")


def latency_summary_us(latencies_ns: Sequence[int]) -> dict[str, float]:
    """p50/p90/p95/p99, avg, min, max in microseconds; nearest-rank percentiles as perf_analyzer reports them.

    Nearest rank (not interpolation) so each figure is a latency some request really had.
    """
    if len(latencies_ns) == 0:
        return {}
    values = np.sort(np.asarray(latencies_ns, dtype=np.int64))
    summary = {f"p{p}": float(values[_rank(p, values.size)]) / 1e3 for p in PERCENTILES}
    summary.update(avg=float(values.mean()) / 1e3, min=float(values[0]) / 1e3, max=float(values[-1]) / 1e3)
    return summary


def percentile(values: Sequence[float], p: float) -> float:
    """The nearest-rank `p`th percentile of `values` (the rule latency_summary_us follows); nan when empty."""
    if len(values) == 0:
        return float("nan")
    ordered = np.sort(np.asarray(values, dtype=np.float64))
    return float(ordered[_rank(p, ordered.size)])


def _rank(percentile: float, n: int) -> int:
    """0-based index of the nearest-rank percentile: ceil(p/100 * n) - 1, clamped to [0, n - 1]."""
    return min(max(int(np.ceil(percentile / 100.0 * n)) - 1, 0), n - 1)


def is_stable(throughputs: Sequence[float], windows: int = 3, tolerance: float = 0.10) -> bool:
    """True when each of the last `windows` throughputs lies within `tolerance` of their mean (perf_analyzer's rule)."""
    if len(throughputs) < windows:
        return False
    last = np.asarray(throughputs[-windows:], dtype=np.float64)
    mean = last.mean()
    if mean <= 0:
        return False
    return bool(np.all(np.abs(last - mean) <= tolerance * mean))


@dataclass(frozen=True)
class ServerSplit:
    """Average server-side time per successful request over an interval, from two statistics snapshots."""

    count: int
    queue_us: float
    compute_input_us: float
    compute_infer_us: float
    compute_output_us: float
    inferences: int = 0  # items (batch sizes summed) over the interval
    executions: int = 0  # model executions over the interval: inferences / executions is the average batch

    @property
    def avg_batch(self) -> float | None:
        return self.inferences / self.executions if self.executions > 0 else None

    def as_dict(self) -> dict[str, float | int | None]:
        return {"count": self.count, "queue_us": self.queue_us, "compute_input_us": self.compute_input_us,
                "compute_infer_us": self.compute_infer_us, "compute_output_us": self.compute_output_us,
                "inferences": self.inferences, "executions": self.executions, "avg_batch": self.avg_batch}


def _model_entry(snapshot: dict[str, Any], model: str) -> dict[str, Any] | None:
    """The `model_stats` entry of `model` in a Triton statistics answer (HTTP JSON or gRPC as_json)."""
    for entry in snapshot.get("model_stats", []):
        if entry.get("name") == model:
            return entry
    return None


def _inference_stats(snapshot: dict[str, Any], model: str) -> dict[str, Any] | None:
    entry = _model_entry(snapshot, model)
    return None if entry is None else entry.get("inference_stats", {})


def _counts(snapshot: dict[str, Any], model: str) -> tuple[int, int]:
    """(inference_count, execution_count); gRPC's JSON carries int64 as strings, absent fields are 0."""
    entry = _model_entry(snapshot, model) or {}
    return int(entry.get("inference_count", 0)), int(entry.get("execution_count", 0))


def _field(stats: dict[str, Any], name: str) -> tuple[int, int]:
    entry = stats.get(name, {})
    return int(entry.get("count", 0)), int(entry.get("ns", 0))


def server_split(before: dict[str, Any] | None, after: dict[str, Any] | None, model: str) -> ServerSplit | None:
    """The queue/compute split between two statistics snapshots; None when a snapshot or the model is missing."""
    if not before or not after:
        return None
    old, new = _inference_stats(before, model), _inference_stats(after, model)
    if old is None or new is None:
        return None
    count = _field(new, "success")[0] - _field(old, "success")[0]
    if count <= 0:
        return ServerSplit(0, 0.0, 0.0, 0.0, 0.0)
    averages = [(_field(new, f)[1] - _field(old, f)[1]) / count / 1e3 for f in SERVER_FIELDS]
    (inferences_0, executions_0), (inferences_1, executions_1) = _counts(before, model), _counts(after, model)
    return ServerSplit(count, *averages, inferences_1 - inferences_0, executions_1 - executions_0)
