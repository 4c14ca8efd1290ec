"""Histograms as Prometheus samples: the one writer for every histogram on /metrics.

It sits in the core, beside `Histogram` (latency.py), because Python models' custom metrics (custom_metrics.py) are
written here too and the core imports nothing from the metrics modules above it (server/metrics*.py).
"""

from __future__ import annotations

import math

from prometheus_client.core import Metric

from .latency import Histogram


def label_number(value: float) -> str:
    """A quantile or bucket bound as Triton (prometheus-cpp) writes it: whole numbers without ".0" (le="100")."""
    if math.isinf(value):
        return "+Inf"
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def add_histogram(family: Metric, labels: dict[str, str], histogram: Histogram, *, buckets_first: bool = False,
                  float_bounds: bool = False) -> None:
    """`histogram`'s samples, labelled `labels`, added to `family` in Triton's order (_count, _sum, then the
    cumulative _bucket per bound and +Inf). Every histogram on /metrics is written here, so their bounds read alike:
    Triton's first-response histogram (server/metrics_latency.py), Kiln's batch sizes (server/metrics.py) and the
    generative models' latencies (server/metrics_generative.py). Python models' custom histograms (custom_metrics.py)
    keep the layout they were published with: `buckets_first` (the _bucket samples, then _sum and _count) and
    `float_bounds` (le="1.0" where Triton writes le="1")."""
    name = family.name
    buckets = histogram.buckets()
    if not buckets_first:
        family.add_sample(f"{name}_count", labels, float(buckets[-1][1]))
        family.add_sample(f"{name}_sum", labels, histogram.sum)
    for bound, count in buckets:
        le = repr(float(bound)) if float_bounds and math.isfinite(bound) else label_number(bound)
        family.add_sample(f"{name}_bucket", {**labels, "le": le}, float(count))
    if buckets_first:
        family.add_sample(f"{name}_sum", labels, histogram.sum)
        family.add_sample(f"{name}_count", labels, float(buckets[-1][1]))
