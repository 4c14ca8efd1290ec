"""Prometheus metrics with Triton's names, read from the core's per-model statistics at scrape time.

Served on their own port (default 8002) at `/metrics`. A collector turns `ModelStatistics` into metric
families, so the numbers are the same ones /stats reports. Counter names carry no `_total` suffix, exactly as
Triton exposes them (dashboards written for Triton keep working), so the text is rendered here rather than by
prometheus_client's `generate_latest`, which would rename them. Kiln's own families (`kiln_*`: worker restarts,
live workers, adaptive-profile rebuilds, queue depth per priority level, plan build time, plan-cache hits and
misses, the executed batch sizes as a histogram) follow Prometheus naming instead; so do generative models'
(KV-cache blocks, sequences, tokens, time to first token, inter-token latency: server/metrics_generative.py).
Gauges as Triton has them: `nv_inference_pending_request_count` (what autoscalers read) and the host's
`nv_cpu_utilization` / `nv_cpu_memory_*` (from /proc; left out where there is none). With a response cache
(`--cache-config`): Triton's per-model `nv_cache_*_per_model` counters for the models that use it, and the
cache-wide `nv_cache_*` gauges its `local` cache publishes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable

from prometheus_client.core import Metric
from prometheus_client.registry import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from server.core.latency import Histogram
from server.core.metric_samples import add_histogram
from server.core.model import ModelVersion
from server.gpu_metrics import NvmlGpus, Sampled
from server.metrics_flags import MetricsOptions
from server.metrics_generative import generation_families
from server.metrics_latency import latency_families
from server.plan_cache import server_lookups

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# name -> (help, how to read it from a `$model_stat` dict)
_COUNTERS = {
    "nv_inference_request_success": ("Number of successful inference requests, all batch sizes",
                                     lambda s: s["inference_stats"]["success"]["count"]),
    "nv_inference_request_failure": ("Number of failed inference requests, all batch sizes",
                                     lambda s: s["inference_stats"]["fail"]["count"]),
    "nv_inference_count": ("Number of inferences performed (does not include cached requests)",
                           lambda s: s["inference_count"]),
    "nv_inference_exec_count": ("Number of model executions performed (does not include cached requests)",
                                lambda s: s["execution_count"]),
    "nv_inference_request_duration_us": ("Cumulative inference request duration in microseconds "
                                         "(includes cached requests)",
                                         lambda s: (s["inference_stats"]["success"]["ns"]
                                                    + s["inference_stats"]["fail"]["ns"]) // 1000),
    "nv_inference_queue_duration_us": ("Cumulative inference queuing duration in microseconds "
                                       "(includes cached requests)",
                                       lambda s: s["inference_stats"]["queue"]["ns"] // 1000),
    "nv_inference_compute_input_duration_us": ("Cumulative compute input duration in microseconds "
                                               "(does not include cached requests)",
                                               lambda s: s["inference_stats"]["compute_input"]["ns"] // 1000),
    "nv_inference_compute_infer_duration_us": ("Cumulative compute inference duration in microseconds "
                                               "(does not include cached requests)",
                                               lambda s: s["inference_stats"]["compute_infer"]["ns"] // 1000),
    "nv_inference_compute_output_duration_us": ("Cumulative inference compute output duration in microseconds "
                                                "(does not include cached requests)",
                                                lambda s: s["inference_stats"]["compute_output"]["ns"] // 1000),
}

# Triton's per-model response cache counters (core/src/metrics.cc), for versions that use the cache.
_CACHE_COUNTERS = {
    "nv_cache_num_hits_per_model": ("Number of cache hits per model",
                                    lambda s: s["inference_stats"]["cache_hit"]["count"]),
    "nv_cache_hit_duration_per_model": ("Total cache hit duration per model, in microseconds",
                                        lambda s: s["inference_stats"]["cache_hit"]["ns"] // 1000),
    "nv_cache_num_misses_per_model": ("Number of cache misses per model",
                                      lambda s: s["inference_stats"]["cache_miss"]["count"]),
    "nv_cache_miss_duration_per_model": ("Total cache miss (insert+lookup) duration per model, in microseconds",
                                         lambda s: s["inference_stats"]["cache_miss"]["ns"] // 1000),
}

# The gauges Triton's local cache publishes (local_cache.cc InitMetrics): name -> (help, read `CacheCounters`).
_CACHE_GAUGES = {
    "nv_cache_util": ("Cache utilization [0.0 - 1.0]", lambda c: c.used / c.size),
    "nv_cache_num_entries": ("Number of responses stored in response cache", lambda c: c.entries),
    "nv_cache_num_hits": ("Number of cache hits in response cache", lambda c: c.hits),
    "nv_cache_num_misses": ("Number of cache misses in response cache", lambda c: c.misses),
    "nv_cache_num_lookups": ("Number of cache lookups in response cache", lambda c: c.lookups),
    "nv_cache_num_evictions": ("Number of cache evictions in response cache", lambda c: c.evictions),
    "nv_cache_lookup_duration": ("Total cache lookup duration (hit and miss), in microseconds",
                                 lambda c: c.lookup_us),
    "nv_cache_insertion_duration": ("Total cache insertion duration, in microseconds", lambda c: c.insertion_us),
}


# Kiln's own per-version families (Prometheus naming, `_total` on counters): name -> (help, type, read it
# from a `ModelVersion`).
_KILN_FAMILIES = {
    "kiln_worker_restarts_total": ("Execution contexts (workers) replaced after their execution failed",
                                   "counter", lambda v: v.worker_restarts),
    "kiln_workers": ("Workers serving (one per instance; two on the GPU, where one gathers a batch while the other's "
                     "runs); fewer when a replacement failed or an execution outlived kiln_execution_timeout_ms", "gauge", lambda v: v.workers.alive - v.workers.hung),
    "kiln_execution_timeouts_total": ("Executions abandoned after running longer than kiln_execution_timeout_ms",
                                      "counter", lambda v: v.workers.hangs),
    "kiln_profile_rebuilds_total": ("Plans rebuilt with optimization profiles fitted to traffic and swapped in",
                                    "counter", lambda v: v.profile_rebuilds),
    "kiln_optimization_profiles": ("Optimization profiles in the plan serving this version", "gauge",
                                   lambda v: v.engine.num_optimization_profiles),
    "kiln_model_build_seconds": ("Seconds building the plan serving this version took; 0 when it was loaded from "
                                 "the plan cache", "gauge", lambda v: v.build_seconds),
}

#: upper bounds of kiln_batch_size's buckets (+Inf follows)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


def batch_size_family(stats: list[dict]) -> Metric:
    """`kiln_batch_size`: a histogram of executed batch sizes per version, made at scrape time from the
    statistics' per-batch-size execution counts (`batch_stats`), so nothing more is recorded per request."""
    family = Metric("kiln_batch_size", "Batch sizes (items per model execution) executed", "histogram")
    for stat in stats:
        histogram = Histogram(BATCH_SIZE_BUCKETS)
        for entry in stat["batch_stats"]:
            histogram.observe(entry["batch_size"], weight=entry["compute_infer"]["count"])
        add_histogram(family, {"model": stat["name"], "version": stat["version"]}, histogram)
    return family


def plan_cache_families() -> Iterable[Metric]:
    """Plan-cache hits and misses by model since the server started (models unloaded since included)."""
    hits, misses = server_lookups()
    for name, help_text, counts in (
            ("kiln_plan_cache_hits_total", "Model loads whose plan came from the plan cache", hits),
            ("kiln_plan_cache_misses_total", "Model loads that built their plan (no usable plan-cache entry, or "
                                             "the cache disabled)", misses)):
        family = Metric(name, help_text, "counter")
        for model, count in sorted(counts.items()):
            family.add_sample(name, {"model": model}, float(count))
        yield family


class HostCpu:
    """Triton's nv_cpu_* gauges from /proc: utilization over the time since the previous scrape (since boot at the
    first), memory used as total minus available."""

    def __init__(self, proc: str = "/proc") -> None:
        self._proc = proc
        self._last: tuple[int, int] | None = None  # (busy, total) jiffies at the previous scrape

    def _jiffies(self) -> tuple[int, int]:
        with open(os.path.join(self._proc, "stat")) as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
        return total - idle, total

    def utilization(self) -> float:
        busy, total = self._jiffies()
        last_busy, last_total = self._last or (0, 0)
        self._last = (busy, total)
        return (busy - last_busy) / (total - last_total) if total > last_total else 0.0

    def memory(self) -> tuple[int, int]:
        """(total, used) bytes."""
        values = {}
        with open(os.path.join(self._proc, "meminfo")) as f:
            for line in f:
                key, _, rest = line.partition(":")
                values[key] = int(rest.split()[0]) * 1024
        return values["MemTotal"], values["MemTotal"] - values.get("MemAvailable", values.get("MemFree", 0))

    def families(self) -> Iterable[Metric]:
        try:
            utilization, (total, used) = self.utilization(), self.memory()
        except (OSError, ValueError, KeyError, IndexError):  # no /proc (not Linux): Triton leaves them out too
            return
        for name, help_text, value in (
                ("nv_cpu_utilization", "CPU utilization rate [0.0 - 1.0]", utilization),
                ("nv_cpu_memory_total_bytes", "CPU total memory (RAM), in bytes", total),
                ("nv_cpu_memory_used_bytes", "CPU used memory (RAM), in bytes", used)):
            family = Metric(name, help_text, "gauge")
            family.add_sample(name, {}, float(value))
            yield family


class InferenceMetricsCollector:
    """A prometheus_client collector over the core's loaded model versions, and the host's CPU."""

    def __init__(self, core, options: MetricsOptions | None = None) -> None:
        self._core = core
        self._options = options or MetricsOptions()
        interval_s = self._options.interval_s
        self._host = [Sampled(HostCpu().families, interval_s)] if self._options.allow_cpu else []
        self._host += [Sampled(NvmlGpus().families, interval_s)] if self._options.allow_gpu else []

    def collect(self) -> Iterable[Metric]:
        loaded = self._core.loaded_versions()
        stats = [version.statistics.as_dict() for version in loaded]
        config = self._options.config
        for name, (help_text, read) in _COUNTERS.items():
            if name.endswith("_duration_us") and not config.counter_latencies:
                continue  # --metrics-config counter_latencies=false
            family = Metric(name, help_text, "counter")
            for stat in stats:
                family.add_sample(name, {"model": stat["name"], "version": stat["version"]}, float(read(stat)))
            yield family
        yield from self._cache([s for v, s in zip(loaded, stats) if self._core.caches_responses(v)])
        # ensembles run their composing models' plans, which these families count: they have none of their own
        versions = [v for v in self._core.loaded_versions() if isinstance(v, ModelVersion)]
        for name, (help_text, kind, read_version) in _KILN_FAMILIES.items():
            family = Metric(name, help_text, kind)
            for version in versions:
                family.add_sample(name, {"model": version.name, "version": str(version.version)},
                                  float(read_version(version)))
            yield family
        yield from self._queues(versions)
        yield batch_size_family(stats)  # every version, as /stats reports its batch_stats
        yield from plan_cache_families()
        yield from latency_families(config, loaded, self._core.caches_responses)
        yield from generation_families(loaded)  # generative models' KV cache, sequences, tokens, latencies
        yield from self._core.custom_metrics.families()  # Python models' pb_utils.MetricFamily
        for host in self._host:
            yield from host.families()

    def _cache(self, stats: list[dict]) -> Iterable[Metric]:
        """The response cache's families; none without a cache (Triton creates them only then). The per-model
        counters are latency counters in Triton: --metrics-config counter_latencies=false leaves them out."""
        cache = self._core.response_cache
        if cache is None:
            return
        if self._options.config.counter_latencies:
            for name, (help_text, read) in _CACHE_COUNTERS.items():
                family = Metric(name, help_text, "counter")
                for stat in stats:
                    family.add_sample(name, {"model": stat["name"], "version": stat["version"]}, float(read(stat)))
                yield family
        counters = cache.counters()
        for name, (help_text, read_counters) in _CACHE_GAUGES.items():
            family = Metric(name, help_text, "gauge")
            family.add_sample(name, {}, float(read_counters(counters)))
            yield family

    @staticmethod
    def _queues(versions: list) -> Iterable[Metric]:
        pending = Metric("nv_inference_pending_request_count",
                         "Instantaneous number of pending requests awaiting execution per-model.", "gauge")
        depth = Metric("kiln_queue_depth", "Requests waiting for execution, by priority level (1 is highest; "
                       "models without priority levels have one)", "gauge")
        for version in versions:
            labels = {"model": version.name, "version": str(version.version)}
            levels = version.scheduler.pending()
            pending.add_sample(pending.name, labels, float(sum(levels.values())))
            for level, count in levels.items():
                depth.add_sample(depth.name, {**labels, "priority": str(level)}, float(count))
        yield pending
        yield depth


def make_registry(core, options: MetricsOptions | None = None) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(InferenceMetricsCollector(core, options))
    return registry


def _escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _number(value: float) -> str:
    if math.isnan(value) or math.isinf(value):  # an empty summary's quantiles; Prometheus' own spelling
        return "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def render(registry: CollectorRegistry) -> str:
    """Prometheus text format 0.0.4 with each family's own name on its HELP/TYPE lines."""
    lines = []
    for family in registry.collect():
        lines.append(f"# HELP {family.name} {family.documentation}")
        lines.append(f"# TYPE {family.name} {family.type}")
        for sample in family.samples:
            labels = ",".join(f'{k}="{_escape_label(str(v))}"' for k, v in sample.labels.items())
            lines.append(f"{sample.name}{{{labels}}} {_number(sample.value)}" if labels
                         else f"{sample.name} {_number(sample.value)}")
    return "\n".join(lines) + "\n"


def create_metrics_app(core, options: MetricsOptions | None = None) -> Starlette:
    """An ASGI app serving `/metrics` for `core` (run it on the metrics port)."""
    registry = make_registry(core, options)

    async def metrics(request: Request) -> PlainTextResponse:
        return PlainTextResponse(render(registry), media_type=CONTENT_TYPE)

    return Starlette(routes=[Route("/metrics", metrics)])
