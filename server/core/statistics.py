"""Per model-version inference statistics with Triton's fields; read by /stats, gRPC and /metrics alike."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .latency import LatencyRecorder, new_recorder


@dataclass
class Duration:
    """A count and a cumulative duration in nanoseconds (Triton's StatisticDuration)."""

    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += int(ns)

    def as_dict(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass
class ExecutionTimes:
    """Where the time of one model execution went; produced by the scheduler for each request."""

    queue_ns: int = 0
    compute_input_ns: int = 0
    compute_infer_ns: int = 0
    compute_output_ns: int = 0


_INFERENCE_FIELDS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output",
                     "cache_hit", "cache_miss")
_BATCH_FIELDS = ("compute_input", "compute_infer", "compute_output")


@dataclass
class ModelStatistics:
    """Cumulative statistics of one model version since it was loaded. Thread-safe: worker threads record."""

    name: str
    version: str
    inference: dict[str, Duration] = field(default_factory=lambda: {f: Duration() for f in _INFERENCE_FIELDS})
    batches: dict[int, dict[str, Duration]] = field(default_factory=dict)
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    #: `--metrics-config` summaries and histogram (server/core/latency.py); None when they are off
    latencies: LatencyRecorder | None = field(default_factory=new_recorder, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record_success(self, batch_size: int, total_ns: int, times: ExecutionTimes, requests: int = 1) -> None:
        """`requests` successful requests (a frontend's group, server/core/grouping.py, counts each member) of
        `batch_size` items together, each taking `total_ns` (inference_count, success, queue, per-request compute).

        Executions are counted separately by the scheduler (`record_execution`), so with dynamic batching
        execution_count < inference_count, as in Triton."""
        with self._lock:
            inference = self.inference
            inference["success"].add(total_ns * requests, requests)
            inference["queue"].add(times.queue_ns * requests, requests)
            inference["compute_input"].add(times.compute_input_ns * requests, requests)
            inference["compute_infer"].add(times.compute_infer_ns * requests, requests)
            inference["compute_output"].add(times.compute_output_ns * requests, requests)
            self.inference_count += batch_size
            self.last_inference_ms = int(time.time() * 1000)
        if self.latencies is not None:
            for name, ns in (("request_duration", total_ns), ("queue_duration", times.queue_ns),
                             ("compute_input_duration", times.compute_input_ns),
                             ("compute_infer_duration", times.compute_infer_ns),
                             ("compute_output_duration", times.compute_output_ns)):
                self.latencies.observe(name, ns, requests)
            self.latencies.responded(total_ns, requests)

    def record_execution(self, batch_size: int, times: ExecutionTimes) -> None:
        """One model execution of `batch_size` items (execution_count, batch_stats)."""
        with self._lock:
            batch = self.batches.setdefault(batch_size, {f: Duration() for f in _BATCH_FIELDS})
            batch["compute_input"].add(times.compute_input_ns)
            batch["compute_infer"].add(times.compute_infer_ns)
            batch["compute_output"].add(times.compute_output_ns)
            self.execution_count += 1

    def record_cache_hit(self, total_ns: int, queue_ns: int, lookup_ns: int) -> None:
        """A request answered from the response cache, counted as Triton counts one (infer_stats.cc
        UpdateSuccessCacheHit): success and queue (the time before the lookup), cache_hit (the lookup); no
        inference, execution or compute time, since the model did not run."""
        with self._lock:
            self.inference["success"].add(total_ns)
            self.inference["queue"].add(queue_ns)
            self.inference["cache_hit"].add(lookup_ns)
        if self.latencies is not None:
            self.latencies.observe("queue_duration", queue_ns)
            self.latencies.observe("cache_hit_duration", lookup_ns)
            self.latencies.responded(total_ns)

    def record_cache_miss(self, ns: int) -> None:
        """A request the model ran and whose response went into the cache: `ns` is its lookup plus insertion
        (Triton's UpdateSuccessCacheMiss); its success is recorded as usual."""
        with self._lock:
            self.inference["cache_miss"].add(ns)
        if self.latencies is not None:
            self.latencies.observe("cache_miss_duration", ns)

    def record_failure(self, total_ns: int, requests: int = 1) -> None:
        with self._lock:
            self.inference["fail"].add(total_ns * requests, requests)
            self.last_inference_ms = int(time.time() * 1000)

    def as_dict(self) -> dict[str, Any]:
        """Triton's `$model_stat` object."""
        with self._lock:
            return {
                "name": self.name,
                "version": self.version,
                "last_inference": self.last_inference_ms,
                "inference_count": self.inference_count,
                "execution_count": self.execution_count,
                "inference_stats": {k: d.as_dict() for k, d in self.inference.items()},
                "batch_stats": [
                    {"batch_size": size, **{k: d.as_dict() for k, d in durations.items()}}
                    for size, durations in sorted(self.batches.items())
                ],
                "memory_usage": [],
            }
