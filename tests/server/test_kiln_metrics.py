"""Kiln's own metric families on a real server: plan build time, plan-cache hits and misses, and the histogram of
executed batch sizes (made from /stats' batch_stats at scrape time)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from server.metrics import BATCH_SIZE_BUCKETS, batch_size_family
from tests.server.conftest import examples, run_server
from tests.support.servers import infer_add_sub_int32

ARGS = ["--allow-grpc", "false"]


def _families(url: str) -> dict:
    text = httpx.get(url, timeout=5).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(families: dict, family: str, sample: str, **labels: str) -> float:
    values = [s.value for s in families[family].samples
              if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(values) == 1, (sample, labels, families[family].samples)
    return values[0]


def test_build_time_plan_cache_lookups_and_batch_sizes_on_a_real_server(tmp_path):
    repository = examples.make_repository(tmp_path / "models")
    args = [*ARGS, "--plan-cache-dir", str(tmp_path / "plans")]
    with run_server(repository, tmp_path / "first.log", ["add_sub"], args) as server:
        for rows in (1, 2, 2, 3, 1):
            infer_add_sub_int32(server.http_url, rows)
        families = _families(server.metrics_url)
        stats = httpx.get(f"http://{server.http_url}/v2/models/add_sub/stats", timeout=5).json()
    labels = {"model": "add_sub", "version": "1"}
    assert families["kiln_model_build_seconds"].type == "gauge"
    assert _value(families, "kiln_model_build_seconds", "kiln_model_build_seconds", **labels) > 0  # built
    assert _value(families, "kiln_plan_cache_misses", "kiln_plan_cache_misses_total", model="add_sub") == 1
    assert not [s for s in families["kiln_plan_cache_hits"].samples if s.labels.get("model") == "add_sub"]

    (stat,) = stats["model_stats"]
    counts = {b["batch_size"]: b["compute_infer"]["count"] for b in stat["batch_stats"]}
    assert sum(counts.values()) == stat["execution_count"] > 0
    histogram = families["kiln_batch_size"]
    assert histogram.type == "histogram"
    buckets = {s.labels["le"]: s.value for s in histogram.samples
               if s.name == "kiln_batch_size_bucket" and s.labels["model"] == "add_sub"}
    assert list(buckets) == [str(b) for b in BATCH_SIZE_BUCKETS] + ["+Inf"]
    for bound in BATCH_SIZE_BUCKETS:
        assert buckets[str(bound)] == sum(c for size, c in counts.items() if size <= bound)
    assert buckets["+Inf"] == _value(families, "kiln_batch_size", "kiln_batch_size_count", **labels) \
        == stat["execution_count"]
    assert _value(families, "kiln_batch_size", "kiln_batch_size_sum", **labels) == \
        sum(size * c for size, c in counts.items())

    # a restart on the same plan-cache directory loads the stored plan: a hit, and no build time
    with run_server(repository, tmp_path / "second.log", ["add_sub"], args) as server:
        families = _families(server.metrics_url)
    assert _value(families, "kiln_plan_cache_hits", "kiln_plan_cache_hits_total", model="add_sub") == 1
    assert not [s for s in families["kiln_plan_cache_misses"].samples if s.labels.get("model") == "add_sub"]
    assert _value(families, "kiln_model_build_seconds", "kiln_model_build_seconds", **labels) == 0
    assert _value(families, "kiln_batch_size", "kiln_batch_size_count", **labels) == 0


def test_batch_size_histogram_is_cumulative_over_batch_stats():
    durations = {"count": 0, "ns": 0}
    stat = {"name": "m", "version": "1", "batch_stats": [
        {"batch_size": size, "compute_input": durations, "compute_infer": {"count": count, "ns": 0},
         "compute_output": durations} for size, count in ((1, 3), (3, 2), (200, 1))]}
    samples = {(s.name, s.labels.get("le")): s.value for s in batch_size_family([stat]).samples}
    assert samples[("kiln_batch_size_bucket", "1")] == 3
    assert samples[("kiln_batch_size_bucket", "2")] == 3
    assert samples[("kiln_batch_size_bucket", "4")] == 5
    assert samples[("kiln_batch_size_bucket", "128")] == 5
    assert samples[("kiln_batch_size_bucket", "+Inf")] == samples[("kiln_batch_size_count", None)] == 6
    assert samples[("kiln_batch_size_sum", None)] == 3 + 6 + 200
