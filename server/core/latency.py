"""Triton's latency summaries and first-response histogram (`--metrics-config`), recorded per model version.

Triton's `--metrics-config` keys: `counter_latencies` (default true: the cumulative `*_duration_us` counters),
`summary_latencies` (default false: `nv_inference_*_summary_us`, quantiles over a sliding window),
`summary_quantiles` (`<quantile>:<error>,...`), `histogram_latencies` (default false:
`nv_inference_first_response_histogram_ms`, buckets 100, 500, 2000, 5000 ms). Any other key is refused, since
Triton would silently ignore a misspelt one.

prometheus_client's Summary exports no quantiles, so `WindowQuantiles` keeps the observations of the last
`MAX_AGE_S` seconds (Triton's prometheus-cpp default window) in a bounded ring and computes exact quantiles at
scrape time; the `error` of each quantile is accepted for compatibility and unused (the estimate is exact over the
ring). The process-wide settings are set once at start-up (`configure`), like the plan cache's.

A model config's `model_metrics` (Triton's per-model metric control) overrides the buckets of a histogram family
for that model's versions, as Triton 2.5x's MetricReporterConfig does: for each `metric_control` naming a
histogram family Kiln exports (`HISTOGRAM_FAMILIES`), its `histogram_options.buckets` replace the server-wide ones
(a later control for the same family wins; one without histogram_options leaves only +Inf, as in Triton). The
load check (server/core/config_fields.py) refuses other families and buckets that are not finite and strictly
increasing. Like Triton, the override only matters while `histogram_latencies=true`: otherwise no histogram exists.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

#: prometheus-cpp's Summary default max_age, which Triton keeps
MAX_AGE_S = 60.0
#: observations kept per summary: past this rate (about 136 requests/s), the window is the latest ones
MAX_OBSERVATIONS = 8192
#: Triton's defaults (core/src/metric_model_reporter.h): quantile -> allowed error
DEFAULT_QUANTILES: tuple[tuple[float, float], ...] = ((0.5, 0.05), (0.9, 0.01), (0.95, 0.001), (0.99, 0.001),
                                                      (0.999, 0.001))
DEFAULT_BUCKETS_MS: tuple[float, ...] = (100.0, 500.0, 2000.0, 5000.0)
FIRST_RESPONSE = "nv_inference_first_response_histogram_ms"
#: the histogram families Kiln exports, the ones a model config's model_metrics may set buckets for
HISTOGRAM_FAMILIES: tuple[str, ...] = (FIRST_RESPONSE,)
#: the summaries of a model version: Triton's reporter keys
SUMMARIES = ("request_duration", "queue_duration", "compute_input_duration", "compute_infer_duration",
             "compute_output_duration", "cache_hit_duration", "cache_miss_duration")
_BOOLEAN_KEYS = ("counter_latencies", "summary_latencies", "histogram_latencies")


@dataclass(frozen=True)
class MetricsConfig:
    """The `--metrics-config` settings."""

    counter_latencies: bool = True
    summary_latencies: bool = False
    histogram_latencies: bool = False
    quantiles: tuple[tuple[float, float], ...] = DEFAULT_QUANTILES
    buckets_ms: tuple[float, ...] = DEFAULT_BUCKETS_MS


def parse_metrics_config(settings: list[str]) -> MetricsConfig:
    """`--metrics-config <setting>=<value>` flags (Triton's format) -> MetricsConfig; ValueError on a bad one."""
    values: dict[str, object] = {}
    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep or not key or not value or "," in key:
            raise ValueError(f"--metrics-config option format is <setting>=<value>. Got {setting}")
        if key in _BOOLEAN_KEYS:
            if value.lower() not in ("true", "false"):
                raise ValueError(f"--metrics-config {key} must be true or false, got '{value}'")
            values[key] = value.lower() == "true"
        elif key == "summary_quantiles":
            values["quantiles"] = _quantiles(value)
        else:
            raise ValueError(f"unknown --metrics-config setting '{key}' (Kiln knows {', '.join(_BOOLEAN_KEYS)}, "
                             "summary_quantiles)")
    return MetricsConfig(**values)  # type: ignore[arg-type]


def _quantiles(text: str) -> tuple[tuple[float, float], ...]:
    """`0.5:0.05,0.9:0.01` -> ((0.5, 0.05), (0.9, 0.01))."""
    pairs = []
    for part in text.split(","):
        quantile, sep, error = part.strip().partition(":")
        try:
            pair = (float(quantile), float(error))
        except ValueError:
            pair = (-1.0, -1.0)
        if not sep or not 0 <= pair[0] <= 1 or not 0 <= pair[1] <= 1:
            raise ValueError(f"--metrics-config summary_quantiles: expected <quantile>:<error> with both in "
                             f"[0, 1], got '{part}'")
        pairs.append(pair)
    return tuple(pairs)


class WindowQuantiles:
    """One summary: cumulative count and sum, and exact quantiles over the observations of the last `max_age_s`
    seconds (at most `capacity` of them)."""

    def __init__(self, max_age_s: float = MAX_AGE_S, capacity: int = MAX_OBSERVATIONS) -> None:
        self._max_age_s = max_age_s
        self._ring: deque[tuple[float, float, int]] = deque(maxlen=capacity)  # (monotonic s, value, weight)
        self.count = 0
        self.sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float, weight: int = 1, now: float | None = None) -> None:
        """`weight` alike observations at once (a frontend's group of requests counts each member)."""
        with self._lock:
            self._ring.append((time.monotonic() if now is None else now, value, weight))
            self.count += weight
            self.sum += value * weight

    def quantiles(self, wanted: tuple[float, ...], now: float | None = None) -> dict[float, float]:
        """Nearest-rank quantiles of the window; NaN when it is empty (as prometheus-cpp reports them)."""
        cutoff = (time.monotonic() if now is None else now) - self._max_age_s
        with self._lock:
            while self._ring and self._ring[0][0] < cutoff:
                self._ring.popleft()
            window = sorted((value, weight) for _, value, weight in self._ring)
        total = sum(weight for _, weight in window)
        result = {}
        for q in wanted:
            if not total:
                result[q] = math.nan
                continue
            rank, seen = max(1, math.ceil(q * total)), 0
            for value, weight in window:
                seen += weight
                if seen >= rank:
                    result[q] = value
                    break
        return result


class Histogram:
    """Cumulative Prometheus histogram: counts per upper bound (plus +Inf), count and sum."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = tuple(sorted(bounds))
        self._counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float, weight: int = 1) -> None:
        index = next((i for i, bound in enumerate(self.bounds) if value <= bound), len(self.bounds))
        with self._lock:
            self._counts[index] += weight
            self.sum += value * weight

    def buckets(self) -> list[tuple[float, int]]:
        """(upper bound, cumulative count) for each bound and +Inf."""
        with self._lock:
            counts = list(self._counts)
        cumulative, running = [], 0
        for bound, count in zip([*self.bounds, math.inf], counts):
            running += count
            cumulative.append((bound, running))
        return cumulative


def valid_buckets(buckets: Any) -> bool:
    """Bucket bounds a histogram can have: finite and strictly increasing (prometheus-cpp, and so Triton, throws
    on unsorted ones; equal ones would give two samples with the same `le`). None or empty: only +Inf."""
    bounds = list(buckets)
    return all(math.isfinite(b) for b in bounds) and all(a < b for a, b in zip(bounds, bounds[1:]))


def model_buckets(model_metrics: Any) -> dict[str, tuple[float, ...]]:
    """Histogram family -> the buckets a model config's `model_metrics` (a `ModelMetrics` message) sets for it.
    Controls naming a family Kiln does not export as a histogram, or with buckets a histogram cannot have, are
    left out (the load check refuses them; with --lenient-config the family keeps the server-wide buckets)."""
    chosen: dict[str, tuple[float, ...]] = {}
    for control in model_metrics.metric_control:
        family, buckets = control.metric_identifier.family, tuple(control.histogram_options.buckets)
        if family in HISTOGRAM_FAMILIES and valid_buckets(buckets):
            chosen[family] = buckets  # a later control for the same family wins, as in Triton
    return chosen


@dataclass
class LatencyRecorder:
    """A model version's summaries and first-response histogram, fed by its `ModelStatistics`.
    `buckets`: per-family bucket overrides (the model's `model_metrics`, `model_buckets`)."""

    config: MetricsConfig
    buckets: dict[str, tuple[float, ...]] = field(default_factory=dict)
    summaries: dict[str, WindowQuantiles] = field(default_factory=dict)
    first_response_ms: Histogram | None = None

    def __post_init__(self) -> None:
        if self.config.summary_latencies:
            self.summaries = {name: WindowQuantiles() for name in SUMMARIES}
        if self.config.histogram_latencies:
            self.first_response_ms = Histogram(self.buckets.get(FIRST_RESPONSE, self.config.buckets_ms))

    def observe(self, name: str, ns: int, weight: int = 1) -> None:
        summary = self.summaries.get(name)
        if summary is not None:
            summary.observe(ns // 1000, weight)  # microseconds, as Triton observes them

    def responded(self, total_ns: int, weight: int = 1) -> None:
        """A request's (first and only) response was ready `total_ns` after the request started."""
        if self.first_response_ms is not None:
            self.first_response_ms.observe(total_ns / 1e6, weight)


_config = MetricsConfig()


def configure(config: MetricsConfig) -> None:
    """Set the process's `--metrics-config` (before models load: each version's recorder is made with it)."""
    global _config
    _config = config


def current() -> MetricsConfig:
    return _config


def new_recorder(model_metrics: Any = None) -> LatencyRecorder | None:
    """A recorder for a newly loaded version, or None when neither summaries nor histograms are on.
    `model_metrics`: its config's `ModelMetrics` (per-model histogram buckets), if any."""
    if not (_config.summary_latencies or _config.histogram_latencies):
        return None
    buckets = model_buckets(model_metrics) if model_metrics is not None and _config.histogram_latencies else {}
    return LatencyRecorder(_config, buckets)
