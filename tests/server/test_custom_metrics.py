"""Custom metrics of Python models (`pb_utils.MetricFamily` / `Metric`, Triton's Python backend since 23.05): the
same model on Kiln and on the real Triton 2.51 (where installed) gives the same /metrics lines, and the values the
model reads back; histograms (Kiln only here) export Prometheus' _bucket / _sum / _count."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient

from .test_python_backend import write_python_model
from .test_triton_examples import Urls, kiln_or_triton

COUNTING = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.requests = pb_utils.MetricFamily(name="counting_requests_total", description="Requests seen by the model",
                                              kind=pb_utils.MetricFamily.COUNTER)
        self.last = pb_utils.MetricFamily(name="counting_last_value", description="The last IN value",
                                          kind=pb_utils.MetricFamily.GAUGE)
        self.counter = self.requests.Metric(labels={"model": "counting", "kind": "all"})
        self.gauge = self.last.Metric(labels={"model": "counting"})

    def execute(self, requests):
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            self.counter.increment(1)
            self.gauge.set(float(value[0]))
            seen = np.array([self.counter.value()], np.float64)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("SEEN", seen)]))
        return responses
'''
COUNTING_CONFIG = ('backend: "python"\nmax_batch_size: 0\ninput [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
                   'output [ { name: "SEEN" data_type: TYPE_FP64 dims: [ 1 ] } ]\ninstance_group [{ kind: KIND_CPU }]\n')
TIMING = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        family = pb_utils.MetricFamily(name="timing_ms", description="Observed values",
                                       kind=pb_utils.MetricFamily.HISTOGRAM)
        self.histogram = family.Metric(labels={"model": "timing"}, buckets=[1.0, 5.0, 10.0])
        try:
            self.histogram.increment(1)
        except pb_utils.TritonModelException as e:
            self.refused = str(e)

    def execute(self, requests):
        responses = []
        for request in requests:
            self.histogram.observe(float(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0]))
            text = np.array([self.refused.encode()], dtype=object)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("SEEN", text)]))
        return responses
'''
TIMING_CONFIG = COUNTING_CONFIG.replace("TYPE_FP64", "TYPE_STRING")


@pytest.fixture(scope="module", params=["kiln", "triton"])
def server(request, tmp_path_factory) -> Iterator[Urls]:
    base = tmp_path_factory.mktemp(f"custom_metrics_{request.param}")
    repo = base / "models"
    write_python_model(repo, "counting", COUNTING, COUNTING_CONFIG)
    if request.param == "kiln":  # the timing model is checked on Kiln only
        write_python_model(repo, "timing", TIMING, TIMING_CONFIG)
    yield from kiln_or_triton(request.param, base, repo, ["counting", "timing"])


def _infer(server: Urls, model: str, value: float):
    client = httpclient.InferenceServerClient(server.http)
    tensor = httpclient.InferInput("IN", [1], "FP32")
    tensor.set_data_from_numpy(np.array([value], np.float32))
    return client.infer(model, [tensor]).as_numpy("SEEN")


def _family(server: Urls, name: str) -> list[str]:
    text = httpx.get(server.metrics, timeout=10).text
    return [line for line in text.splitlines() if line.split(" ", 2)[:2] in (["#", "HELP"], ["#", "TYPE"])
            and line.split(" ", 3)[2] == name or line.startswith(name)]


def test_counter_and_gauge_are_exported_and_read_back_as_triton_does(server):
    seen = [_infer(server, "counting", value).tolist() for value in (1.5, 2.5, 7.0)]
    assert seen == [[1.0], [2.0], [3.0]]
    assert _family(server, "counting_requests_total") == [
        "# HELP counting_requests_total Requests seen by the model", "# TYPE counting_requests_total counter",
        'counting_requests_total{kind="all",model="counting"} 3']
    assert _family(server, "counting_last_value") == [
        "# HELP counting_last_value The last IN value", "# TYPE counting_last_value gauge",
        'counting_last_value{model="counting"} 7']


def test_histogram_buckets_sum_and_count(server):
    if server.name != "kiln":
        pytest.skip("the histogram model runs on Kiln only")
    for value in (0.5, 3.0, 3.0, 20.0):
        refused = _infer(server, "timing", value)[0].decode()
    assert refused == "increment is not supported for a histogram; use observe"
    assert _family(server, "timing_ms")[2:] == [
        'timing_ms_bucket{model="timing",le="1.0"} 1', 'timing_ms_bucket{model="timing",le="5.0"} 3',
        'timing_ms_bucket{model="timing",le="10.0"} 3', 'timing_ms_bucket{model="timing",le="+Inf"} 4',
        'timing_ms_sum{model="timing"} 26.5', 'timing_ms_count{model="timing"} 4']


def test_a_models_metrics_go_when_it_is_unloaded(server, tmp_path: Path):
    if server.name != "kiln":
        pytest.skip("model control runs on Kiln only here")
    client = httpclient.InferenceServerClient(server.http)
    client.unload_model("timing")
    assert _family(server, "timing_ms") == []
    client.load_model("timing")
    assert _family(server, "timing_ms")[:2] == ["# HELP timing_ms Observed values", "# TYPE timing_ms histogram"]


def test_a_metric_two_instances_share_stays_until_both_are_gone():
    """Two instances of one model create the same family and labels: one metric, kept (with its value) while
    either instance's stub lives."""
    from server.core.custom_metrics import CustomMetrics

    metrics = CustomMetrics()
    for owner in (1, 2):
        metrics.family(owner, "shared_total", "Shared", "counter")
    first, second = (metrics.metric(owner, "shared_total", {"model": "m"}) for owner in (1, 2))
    assert first == second
    metrics.update(first, "increment", 2)
    metrics.release(1)
    metrics.update(second, "increment", 1)
    assert metrics.value(second) == 3
    assert [s.value for f in metrics.families() for s in f.samples] == [3]
    metrics.release(2)
    assert list(metrics.families()) == []
