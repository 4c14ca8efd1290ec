"""Custom metrics of Python models (`pb_utils.MetricFamily` / `Metric`, Triton's Python backend since 23.05).

A model's stub asks the server to create families (counter, gauge or histogram) and metrics under them (one per
label set), updates them and reads them back (python_stub.py forwards its METRIC messages here); `/metrics` exports
them beside Triton's own families (server/metrics.py), as Triton does: `# HELP`, `# TYPE`, then each metric with its
labels in name order. A stub's metrics go when it ends (the model unloaded or restarted) unless another stub holds
them too, and a family once no stub holds it, as Triton drops them with the Python objects.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.metrics_core import Metric

from .latency import Histogram
from .metric_samples import add_histogram

KINDS = ("counter", "gauge", "histogram")


@dataclass
class _Value:
    family: str
    labels: tuple[tuple[str, str], ...]
    value: float = 0.0
    histogram: Histogram | None = None  # a histogram's observations
    owners: set[int] = field(default_factory=set)  # the stubs that created it (instances of one model share it)


@dataclass
class _Family:
    description: str
    kind: str
    holders: set[int] = field(default_factory=set)  # owners (stubs) that created it
    metrics: dict[tuple[tuple[str, str], ...], int] = field(default_factory=dict)  # labels -> metric id


class CustomMetrics:
    """Every custom family and metric of this server, keyed by name and by the ids their creators hold."""

    def __init__(self) -> None:
        self._families: dict[str, _Family] = {}
        self._values: dict[int, _Value] = {}
        self._owned: dict[int, set[int]] = {}  # owner -> metric ids it created
        self._ids = itertools.count(1)

    def family(self, owner: int, name: str, description: str, kind: str) -> None:
        """Create family `name`, or join it when it exists with the same kind (another instance of the model)."""
        if kind not in KINDS:
            raise ValueError(f"metric family '{name}': kind must be one of {list(KINDS)}, got {kind!r}")
        if not name or not (name[0].isalpha() or name[0] in "_:") or not all(c.isalnum() or c in "_:" for c in name):
            raise ValueError(f"metric family name '{name}' is not a valid Prometheus metric name")
        existing = self._families.get(name)
        if existing is not None and existing.kind != kind:
            raise ValueError(f"metric family '{name}' already exists as a {existing.kind}, not a {kind}")
        if existing is None:
            existing = self._families[name] = _Family(description, kind)
        existing.holders.add(owner)

    def metric(self, owner: int, name: str, labels: dict[str, str], buckets: list[float] | None = None) -> int:
        """A metric of family `name` for `labels` (the existing one for the same labels); its id."""
        family = self._families.get(name)
        if family is None:
            raise ValueError(f"metric family '{name}' does not exist")
        if family.kind == "histogram":
            if not buckets or any(not math.isfinite(b) for b in buckets) or list(buckets) != sorted(set(buckets)):
                raise ValueError(f"histogram '{name}' needs buckets: finite, strictly increasing upper bounds")
        elif buckets:
            raise ValueError(f"metric family '{name}' is a {family.kind}: buckets are for histograms")
        key = tuple(sorted((str(k), str(v)) for k, v in labels.items()))
        metric_id = family.metrics.get(key)
        if metric_id is None:
            metric_id = family.metrics[key] = next(self._ids)
            histogram = Histogram(tuple(float(b) for b in buckets)) if buckets else None
            self._values[metric_id] = _Value(name, key, histogram=histogram)
        self._values[metric_id].owners.add(owner)
        self._owned.setdefault(owner, set()).add(metric_id)
        return metric_id

    def update(self, metric_id: int, op: str, amount: float) -> None:
        """increment (counter, gauge), set (gauge) or observe (histogram)."""
        value = self._value(metric_id)
        kind = self._families[value.family].kind
        if op == "increment" and kind in ("counter", "gauge"):
            if kind == "counter" and amount < 0:
                raise ValueError(f"counter '{value.family}' cannot be incremented by a negative value ({amount})")
            value.value += amount
        elif op == "set" and kind == "gauge":
            value.value = amount
        elif op == "observe" and value.histogram is not None:
            value.histogram.observe(amount)
        else:
            raise ValueError(f"'{op}' is not an operation of a {kind} ('{value.family}')")

    def value(self, metric_id: int) -> float:
        """A counter's or gauge's value (a histogram's sum of observations)."""
        value = self._value(metric_id)
        return value.histogram.sum if value.histogram is not None else value.value

    def release(self, owner: int) -> None:
        """`owner` (a stub) ended: the metrics only it held go, and the families no one holds any more (another
        instance of the model that created the same metric keeps it, with its value)."""
        for metric_id in self._owned.pop(owner, set()):
            value = self._values.get(metric_id)
            if value is None:
                continue
            value.owners.discard(owner)
            if not value.owners:
                del self._values[metric_id]
                if value.family in self._families:
                    self._families[value.family].metrics.pop(value.labels, None)
        for name in [n for n, f in self._families.items() if owner in f.holders]:
            family = self._families[name]
            family.holders.discard(owner)
            if not family.holders:
                for metric_id in family.metrics.values():
                    self._values.pop(metric_id, None)
                del self._families[name]

    def families(self) -> Iterable[Metric]:
        """Every family with its metrics, for /metrics; histograms in the layout Kiln has exported for them since
        they came in: _bucket (bounds as floats, le="1.0"), then _sum and _count."""
        for name, family in self._families.items():
            metric = Metric(name, family.description, family.kind)
            for metric_id in family.metrics.values():
                value = self._values[metric_id]
                labels = dict(value.labels)
                if value.histogram is None:
                    metric.add_sample(name, labels, value.value)
                else:
                    add_histogram(metric, labels, value.histogram, buckets_first=True, float_bounds=True)
            yield metric

    def _value(self, metric_id: int) -> _Value:
        value = self._values.get(metric_id)
        if value is None:
            raise ValueError(f"metric {metric_id} does not exist (its family was deleted)")
        return value
