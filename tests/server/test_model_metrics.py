"""A model config's `model_metrics` (Triton's per-model metric control, issue #30): histogram bucket overrides for
the histogram families Kiln exports (`nv_inference_first_response_histogram_ms`), applied to that model's versions
while `--metrics-config histogram_latencies=true`; any other family refused at load, naming it and the allowed ones.
"""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import pytest
from onnx import TensorProto
from prometheus_client.parser import text_string_to_metric_families

from server.core import latency
from server.core.config_fields import ConfigFieldCheck, refusals
from server.core.errors import ServerError
from server.core.latency import DEFAULT_BUCKETS_MS, FIRST_RESPONSE, LatencyRecorder, MetricsConfig, model_buckets
from server.core.model_config import parse_config_text
from tests.support.servers import infer_add_sub_int32

from .conftest import examples, run_server

BUCKETS = (0.001, 2.5, 60000.0)  # ms: nothing answers within 1 us, everything within a minute


def _metrics(family: str, buckets: str = "") -> str:
    histogram = f" histogram_options {{ buckets: [{buckets}] }}" if buckets else ""
    return f'model_metrics {{ metric_control [{{ metric_identifier {{ family: "{family}" }}{histogram} }}] }}\n'


CUSTOM = _metrics(FIRST_RESPONSE, ", ".join(map(str, BUCKETS)))
UNKNOWN = _metrics("nv_inference_request_duration_us", "1, 10")


# -- the rules, without a server ------------------------------------------------------------------------------------
def test_model_buckets_follow_tritons_reading():
    def buckets(text: str) -> dict:
        return model_buckets(parse_config_text(text, "m").model_metrics)

    assert buckets(CUSTOM) == {FIRST_RESPONSE: BUCKETS}
    assert buckets("") == {}
    two = (f'model_metrics {{ metric_control [{{ metric_identifier {{ family: "{FIRST_RESPONSE}" }} histogram_options '
           f'{{ buckets: [1, 2] }} }}, {{ metric_identifier {{ family: "{FIRST_RESPONSE}" }} histogram_options '
           "{ buckets: [7] } }] }")
    assert buckets(two) == {FIRST_RESPONSE: (7.0,)}  # the later control wins, as in Triton
    assert buckets(_metrics(FIRST_RESPONSE)) == {FIRST_RESPONSE: ()}  # no histogram_options: only +Inf (Triton)
    assert buckets(UNKNOWN) == {} and buckets(_metrics(FIRST_RESPONSE, "10, 1")) == {}  # refused: left out


def test_a_recorder_takes_the_override_only_with_histograms_on():
    on = MetricsConfig(histogram_latencies=True)
    recorder = LatencyRecorder(on, {FIRST_RESPONSE: BUCKETS})
    assert recorder.first_response_ms is not None and recorder.first_response_ms.bounds == BUCKETS
    default = LatencyRecorder(on)
    assert default.first_response_ms is not None and default.first_response_ms.bounds == DEFAULT_BUCKETS_MS
    assert LatencyRecorder(MetricsConfig(), {FIRST_RESPONSE: BUCKETS}).first_response_ms is None
    before = latency.current()
    try:
        latency.configure(MetricsConfig())
        assert latency.new_recorder(parse_config_text(CUSTOM, "m").model_metrics) is None
        latency.configure(on)
        made = latency.new_recorder(parse_config_text(CUSTOM, "m").model_metrics)
        assert made is not None and made.first_response_ms is not None and made.first_response_ms.bounds == BUCKETS
    finally:
        latency.configure(before)


def test_the_load_check_names_the_family_and_the_allowed_ones():
    assert refusals(parse_config_text(CUSTOM, "m")) == []
    assert refusals(parse_config_text(_metrics(FIRST_RESPONSE), "m")) == []
    for text, expected in (
            (UNKNOWN, ["config field 'model_metrics.metric_control.metric_identifier.family' "
                       "('nv_inference_request_duration_us') is refused",
                       f"histogram families Kiln exports: {FIRST_RESPONSE}"]),
            (_metrics(FIRST_RESPONSE, "10, 1"), ["'model_metrics.metric_control.histogram_options.buckets' "
                                                 "([10.0, 1.0]) is refused", "strictly increasing"]),
            (_metrics(FIRST_RESPONSE, "1, 1"), ["strictly increasing"]),
            ("model_metrics { metric_control [{ histogram_options { buckets: [1] } }] }",
             ["'model_metrics.metric_control' is refused", "without metric_identifier"])):
        with pytest.raises(ServerError) as failure:
            ConfigFieldCheck().check(parse_config_text(text, "m"), "m")
        for part in expected:
            assert part in failure.value.message, failure.value.message
    ConfigFieldCheck(lenient=True).check(parse_config_text(UNKNOWN, "m"), "m")  # Triton: a warning, the model loads


# -- a real server ------------------------------------------------------------------------------------------------
def _repository(root: Path) -> Path:
    model = examples.add_sub_model(TensorProto.INT32)
    for name, extra in (("custom", CUSTOM), ("plain", ""), ("unknown_family", UNKNOWN)):
        config = examples.ADD_SUB_CONFIG.replace('name: "add_sub"', f'name: "{name}"') + extra
        examples.write_model(root, name, model, config)
    return root


def _histogram(text: str, model: str) -> tuple[list[tuple[float, float]], float, float]:
    """([(le, cumulative count)], _count, _sum) of `model`'s first-response histogram."""
    family = next(f for f in text_string_to_metric_families(text) if f.name == FIRST_RESPONSE)
    assert family.type == "histogram"
    mine = [s for s in family.samples if s.labels.get("model") == model]
    buckets = [(float(s.labels["le"]), s.value) for s in mine if s.name == FIRST_RESPONSE + "_bucket"]
    count = next(s.value for s in mine if s.name == FIRST_RESPONSE + "_count")
    total = next(s.value for s in mine if s.name == FIRST_RESPONSE + "_sum")
    return buckets, count, total


def test_per_model_buckets_on_a_real_server(tmp_path: Path):
    repository = _repository(tmp_path / "models")
    args = ["--metrics-config", "histogram_latencies=true", "--allow-grpc", "false",
            "--plan-cache-dir", str(tmp_path / "plans")]
    with run_server(repository, tmp_path / "server.log", ["custom", "plain"], args) as server:
        for i in range(12):
            infer_add_sub_int32(server.http_url, 1 + i % 2, "custom")
        for _ in range(5):
            infer_add_sub_int32(server.http_url, 1, "plain")
        text = httpx.get(server.metrics_url, timeout=5).text
        failed = httpx.post(f"http://{server.http_url}/v2/repository/models/unknown_family/load", timeout=60)
        index = httpx.post(f"http://{server.http_url}/v2/repository/index", json={}, timeout=10).json()
        still = httpx.get(f"http://{server.http_url}/v2/models/custom/ready", timeout=5).status_code

    buckets, count, total = _histogram(text, "custom")
    assert [le for le, _ in buckets] == [*BUCKETS, math.inf]  # exactly the configured bounds, then +Inf
    assert dict(buckets)[0.001] == 0 and dict(buckets)[60000.0] == 12  # every answer took more than 1 us, < 1 min
    assert all(a <= b for (_, a), (_, b) in zip(buckets, buckets[1:]))  # cumulative
    assert buckets[-1][1] == count == 12 and total > 0
    plain, plain_count, _ = _histogram(text, "plain")
    assert [le for le, _ in plain] == [*DEFAULT_BUCKETS_MS, math.inf]  # the server-wide (Triton's) buckets
    assert plain[-1][1] == plain_count == 5

    assert failed.status_code == 400
    message = failed.json()["error"]
    assert "'nv_inference_request_duration_us'" in message and FIRST_RESPONSE in message
    entry = next(m for m in index if m["name"] == "unknown_family")
    assert entry["state"] == "UNAVAILABLE" and "metric_identifier.family" in entry["reason"]
    assert still == 200  # the server serves on


def test_histograms_off_the_section_is_accepted_and_nothing_is_exported(tmp_path: Path):
    repository = _repository(tmp_path / "models")
    args = ["--allow-grpc", "false", "--plan-cache-dir", str(tmp_path / "plans")]
    with run_server(repository, tmp_path / "server.log", ["custom"], args) as server:
        assert httpx.get(f"http://{server.http_url}/v2/models/custom/ready", timeout=5).status_code == 200
        for _ in range(3):
            infer_add_sub_int32(server.http_url, 1, "custom")
        text = httpx.get(server.metrics_url, timeout=5).text
    assert 'nv_inference_request_success{model="custom",version="1"} 3' in text
    assert FIRST_RESPONSE not in text and "histogram_ms" not in text
