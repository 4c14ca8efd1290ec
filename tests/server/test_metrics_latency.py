"""Triton's `--metrics-config` summaries and first-response histogram, and the NVML GPU gauges (a fake NVML).

The server test scrapes /metrics with prometheus_client's own parser, so the text is what Prometheus reads.
"""

from __future__ import annotations

import logging
import math
import types

import httpx
import pytest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from server.core.latency import Histogram, MetricsConfig, WindowQuantiles, parse_metrics_config
from server.core.metric_samples import add_histogram
from server.gpu_metrics import NvmlGpus, Sampled
from tests.server.conftest import examples, run_server
from tests.support.servers import infer_add_sub_int32


# -- the estimator and the flag ---------------------------------------------------------------------------------
def test_window_quantiles_are_exact_over_the_window_and_forget_old_observations():
    window = WindowQuantiles(max_age_s=60.0)
    for value in range(1, 101):
        window.observe(value, now=1000.0)
    assert window.quantiles((0.5, 0.9, 0.99, 1.0), now=1000.0) == {0.5: 50, 0.9: 90, 0.99: 99, 1.0: 100}
    window.observe(7, weight=3, now=1050.0)
    assert window.count == 103 and window.sum == 5050 + 21
    later = window.quantiles((0.5,), now=1061.0)  # the first hundred are older than 60 s
    assert later == {0.5: 7}
    assert math.isnan(window.quantiles((0.5,), now=1200.0)[0.5])  # empty window: NaN, as prometheus-cpp
    assert window.count == 103  # count and sum stay cumulative


def test_histograms_are_written_in_tritons_order_with_its_bounds():
    histogram = Histogram((0.5, 1.0, 100.0))
    histogram.observe(0.7)
    histogram.observe(200.0)
    family = Metric("h_seconds", "help", "histogram")
    add_histogram(family, {"model": "m"}, histogram)
    assert [(s.name, s.labels.get("le"), s.value) for s in family.samples] == [
        ("h_seconds_count", None, 2.0), ("h_seconds_sum", None, 200.7), ("h_seconds_bucket", "0.5", 0.0),
        ("h_seconds_bucket", "1", 1.0), ("h_seconds_bucket", "100", 1.0), ("h_seconds_bucket", "+Inf", 2.0)]


def test_window_is_bounded():
    window = WindowQuantiles(capacity=10)
    for value in range(100):
        window.observe(value)
    assert window.quantiles((0.0,))[0.0] == 90 and window.count == 100


def test_histogram_buckets_are_cumulative():
    histogram = Histogram((100, 500))
    for value in (1, 100, 101, 10_000):
        histogram.observe(value)
    assert histogram.buckets() == [(100, 2), (500, 3), (math.inf, 4)] and histogram.sum == 10_202


def test_metrics_config_parses_tritons_settings_and_refuses_others():
    config = parse_metrics_config(["summary_latencies=true", "summary_quantiles=0.5:0.05,0.99:0.001",
                                   "histogram_latencies=true", "counter_latencies=false"])
    assert config == MetricsConfig(counter_latencies=False, summary_latencies=True, histogram_latencies=True,
                                   quantiles=((0.5, 0.05), (0.99, 0.001)))
    assert parse_metrics_config([]) == MetricsConfig()
    for bad, message in (("summary_latency=true", "unknown --metrics-config setting 'summary_latency'"),
                         ("summary_latencies", "format is <setting>=<value>"),
                         ("local,summary_latencies=true", "format is <setting>=<value>"),
                         ("summary_latencies=maybe", "must be true or false"),
                         ("summary_quantiles=0.5", "<quantile>:<error>"),
                         ("summary_quantiles=1.5:0.1", "<quantile>:<error>")):
        with pytest.raises(ValueError, match=message):
            parse_metrics_config([bad])


# -- a real server ----------------------------------------------------------------------------------------------
def test_summaries_and_histogram_on_a_real_server(tmp_path):
    repository = examples.make_repository(tmp_path / "models")
    args = ["--metrics-config", "summary_latencies=true", "--metrics-config", "histogram_latencies=true",
            "--metrics-config", "summary_quantiles=0.5:0.05,0.9:0.01,0.99:0.001", "--allow-grpc", "false"]
    with run_server(repository, tmp_path / "server.log", ["add_sub"], args) as server:
        for i in range(30):
            infer_add_sub_int32(server.http_url, 1 + i % 2)
        text = httpx.get(server.metrics_url, timeout=5).text
    families = {f.name: f for f in text_string_to_metric_families(text)}

    def samples(family: str, suffix: str = "") -> list:  # the parser names counters' samples `_total`
        return [s for s in families[family].samples
                if s.name in (family + suffix, family + "_total") and s.labels.get("model") == "add_sub"]

    success = samples("nv_inference_request_success")[0].value
    assert success == 30
    for name, counter in (("nv_inference_request_summary_us", "nv_inference_request_duration_us"),
                          ("nv_inference_queue_summary_us", "nv_inference_queue_duration_us"),
                          ("nv_inference_compute_input_summary_us", None),
                          ("nv_inference_compute_infer_summary_us", "nv_inference_compute_infer_duration_us"),
                          ("nv_inference_compute_output_summary_us", None)):
        assert families[name].type == "summary"
        assert samples(name, "_count")[0].value == 30
        total = samples(name, "_sum")[0].value
        if counter:  # Triton: "the _count and _sum of a summary should generally match the counter equivalents"
            assert abs(total - samples(counter)[0].value) <= 30  # each observation truncated to whole us
        quantiles = {s.labels["quantile"]: s.value for s in samples(name)}
        assert set(quantiles) == {"0.5", "0.9", "0.99"}
        assert 0 <= quantiles["0.5"] <= quantiles["0.9"] <= quantiles["0.99"] <= total
    request = {s.labels["quantile"]: s.value for s in samples("nv_inference_request_summary_us")}
    assert 0 < request["0.5"] < 5_000_000  # a small add on the CPU: well under 5 s
    assert "nv_cache_hit_summary_per_model" not in text  # only for models that use the response cache

    histogram = "nv_inference_first_response_histogram_ms"
    assert families[histogram].type == "histogram"
    buckets = [(s.labels["le"], s.value) for s in samples(histogram, "_bucket")]
    assert [le for le, _ in buckets] == ["100", "500", "2000", "5000", "+Inf"]
    assert buckets[-1][1] == samples(histogram, "_count")[0].value == 30
    assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:]))


# -- NVML -------------------------------------------------------------------------------------------------------
class _NvmlError(Exception):
    pass


def _fake_nvml(energy_mj: list[int]) -> types.ModuleType:
    """Two GPUs; the second supports no power readings (as some boards do not)."""
    nvml = types.ModuleType("pynvml")
    nvml.nvmlInit = lambda: None
    nvml.nvmlDeviceGetCount = lambda: 2
    nvml.nvmlDeviceGetHandleByIndex = lambda i: i
    nvml.nvmlDeviceGetUUID = lambda h: [b"GPU-aaaa", "GPU-bbbb"][h]
    nvml.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=[b"00000000:19:00.0", "00000000:3B:00.0"][h])
    nvml.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=[37, 0][h], memory=5)
    nvml.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=80 << 30, used=[3 << 30, 0][h], free=0)

    def power(h):
        if h == 1:
            raise _NvmlError("Not Supported")
        return 123_456

    nvml.nvmlDeviceGetPowerUsage = power
    nvml.nvmlDeviceGetPowerManagementLimit = lambda h: power(h) * 0 + 700_000
    nvml.nvmlDeviceGetTotalEnergyConsumption = lambda h: power(h) * 0 + energy_mj[0]
    return nvml


def test_nvml_gauges_with_a_fake_nvml():
    energy = [5_000_000]
    fake = _fake_nvml(energy)
    gpus = NvmlGpus(load=lambda: fake, visible=lambda: None)  # CUDA not asked: every GPU NVML sees
    first = {f.name: f for f in gpus.families()}
    energy[0] += 2_500  # 2.5 J later
    families = {f.name: {s.labels["gpu_uuid"]: s.value for s in f.samples} for f in gpus.families()}
    assert families["nv_gpu_utilization"] == {"GPU-aaaa": 0.37, "GPU-bbbb": 0.0}
    assert families["nv_gpu_memory_total_bytes"]["GPU-aaaa"] == 80 << 30
    assert families["nv_gpu_memory_used_bytes"] == {"GPU-aaaa": 3 << 30, "GPU-bbbb": 0}
    assert families["nv_gpu_power_usage"] == {"GPU-aaaa": pytest.approx(123.456)}  # GPU-bbbb: not supported
    assert families["nv_gpu_power_limit"] == {"GPU-aaaa": 700.0}
    assert families["nv_energy_consumption"] == {"GPU-aaaa": pytest.approx(2.5)}
    assert first["nv_energy_consumption"].type == "counter" and first["nv_gpu_utilization"].type == "gauge"


def test_only_the_gpus_cuda_shows_the_server_are_reported():
    """CUDA_VISIBLE_DEVICES / --gpus: NVML lists every GPU of the machine; the server reports those CUDA shows it,
    matched by PCI bus id (CUDA writes a 4-digit domain, NVML an 8-digit one), as Triton does."""
    from server.gpu_metrics import bus_key

    visible = {bus_key("0000:3b:00.0")}
    families = {f.name: f for f in NvmlGpus(load=lambda: _fake_nvml([0]), visible=lambda: visible).families()}
    assert {s.labels["gpu_uuid"] for s in families["nv_gpu_memory_total_bytes"].samples} == {"GPU-bbbb"}
    assert list(NvmlGpus(load=lambda: _fake_nvml([0]), visible=set).families()) == []  # CUDA shows none


def test_no_nvml_means_no_gpu_families_logged_once(caplog):
    def missing():
        raise ModuleNotFoundError("No module named 'pynvml'")

    gpus = NvmlGpus(load=missing, visible=lambda: None)
    with caplog.at_level(logging.INFO, logger="kiln.server.metrics"):
        assert list(gpus.families()) == [] and list(gpus.families()) == []
    assert len([r for r in caplog.records if "GPU metrics are not exported" in r.message]) == 1
    no_gpu = _fake_nvml([0])
    no_gpu.nvmlDeviceGetCount = lambda: 0
    assert list(NvmlGpus(load=lambda: no_gpu, visible=lambda: None).families()) == []


def test_nvml_module_monkeypatched_in_sys_modules(monkeypatch):
    """The default loader imports `pynvml` lazily: a module put in its place is what gets read."""
    monkeypatch.setitem(__import__("sys").modules, "pynvml", _fake_nvml([0]))
    names = {f.name for f in NvmlGpus(visible=lambda: None).families()}
    assert {"nv_gpu_utilization", "nv_gpu_memory_total_bytes", "nv_gpu_memory_used_bytes", "nv_gpu_power_usage",
            "nv_gpu_power_limit", "nv_energy_consumption"} <= names


def test_sampled_reads_at_most_once_per_interval():
    calls = []
    sampled = Sampled(lambda: calls.append(1) or [], interval_s=3600)
    sampled.families()
    sampled.families()
    assert len(calls) == 1
