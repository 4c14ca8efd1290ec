"""Triton's latency summaries and first-response histogram as metric families (`--metrics-config`).

The numbers are recorded by each version's `LatencyRecorder` (server/core/latency.py); this module only names
them as Triton's core does (core/src/metrics.cc), including its help texts, so dashboards carry over. Each
version's histogram has its own buckets: the server-wide ones, or its config's `model_metrics` override.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import Metric

from server.core.latency import FIRST_RESPONSE, MetricsConfig
from server.core.metric_samples import add_histogram, label_number

# recorder key -> (family, help): Triton's summary families
_SUMMARIES = {
    "request_duration": ("nv_inference_request_summary_us",
                         "Summary of inference request duration in microseconds (includes cached requests)"),
    "queue_duration": ("nv_inference_queue_summary_us",
                       "Summary of inference queuing duration in microseconds (includes cached requests)"),
    "compute_input_duration": ("nv_inference_compute_input_summary_us",
                               "Cumulative compute input duration in microseconds (does not include cached requests)"),
    "compute_infer_duration": ("nv_inference_compute_infer_summary_us",
                               "Cumulative compute inference duration in microseconds (does not include cached "
                               "requests)"),
    "compute_output_duration": ("nv_inference_compute_output_summary_us",
                                "Cumulative inference compute output duration in microseconds (does not include "
                                "cached requests)"),
    "cache_hit_duration": ("nv_cache_hit_summary_per_model",
                           "Summary of cache hit counts/durations per model, in microseconds."),
    "cache_miss_duration": ("nv_cache_miss_summary_per_model",
                            "Summary of cache miss counts/durations per model, in microseconds."),
}
_CACHE_ONLY = ("cache_hit_duration", "cache_miss_duration")


def latency_families(config: MetricsConfig, versions: list, caches) -> Iterable[Metric]:
    """The summaries and histogram of `versions` (loaded model versions); `caches(version)` says whether the
    version uses the response cache: then, as in Triton, its request summary is left out (the cache's time is not
    in it) and its cache hit/miss summaries are in."""
    recorded = [(v, v.statistics.latencies) for v in versions if v.statistics.latencies is not None]
    if config.summary_latencies:
        quantiles = tuple(q for q, _ in config.quantiles)
        for key, (name, help_text) in _SUMMARIES.items():
            family = Metric(name, help_text, "summary")
            for version, recorder in recorded:
                cached = caches(version)
                if (key == "request_duration" and cached) or (key in _CACHE_ONLY and not cached):
                    continue
                summary = recorder.summaries[key]
                labels = {"model": version.name, "version": str(version.version)}
                family.add_sample(f"{name}_count", labels, float(summary.count))
                family.add_sample(f"{name}_sum", labels, float(summary.sum))
                for q, value in summary.quantiles(quantiles).items():
                    family.add_sample(name, {**labels, "quantile": label_number(q)}, value)
            if family.samples:
                yield family
    if config.histogram_latencies:
        family = Metric(FIRST_RESPONSE, "Duration from request to first response in milliseconds", "histogram")
        for version, recorder in recorded:
            add_histogram(family, {"model": version.name, "version": str(version.version)},
                          recorder.first_response_ms)
        yield family
