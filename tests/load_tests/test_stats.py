"""Unit tests of the numbers `kiln perf` reports: percentiles, stability, server split, level parsing."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from load_tests.perf import input_specs, local_url, parse_range, split_level
from load_tests.stats import is_stable, latency_summary_us, percentile, server_split
from load_tests.worker import InputSpec


def test_nearest_rank_percentiles_are_real_samples():
    latencies_ns = [i * 1000 for i in range(1, 101)]  # 1..100 us
    summary = latency_summary_us(latencies_ns[::-1])
    assert summary == {"p50": 50.0, "p90": 90.0, "p95": 95.0, "p99": 99.0, "avg": 50.5, "min": 1.0, "max": 100.0}


def test_percentiles_ordered_on_skewed_data():
    rng = np.random.default_rng(0)
    summary = latency_summary_us(rng.lognormal(10, 1.5, 5001).astype(np.int64))
    assert summary["min"] <= summary["p50"] <= summary["p90"] <= summary["p95"] <= summary["p99"] <= summary["max"]


def test_percentile_is_the_summary_s_nearest_rank():
    """generate_bench and bench/generate_step.py report with it: the same figures latency_summary_us gives."""
    rng = np.random.default_rng(1)
    latencies_ns = rng.integers(1000, 10**7, 37).tolist()
    summary = latency_summary_us(latencies_ns)
    assert [percentile(latencies_ns, p) / 1e3 for p in (50, 90, 95, 99)] == [summary[f"p{p}"] for p in (50, 90, 95, 99)]
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.0  # a real sample: no interpolation, the lower middle
    assert percentile([4.0, 1.0, 3.0, 2.0], 90) == 4.0
    assert np.isnan(percentile([], 50))


def test_single_sample_and_empty():
    assert latency_summary_us([7000]) == {"p50": 7.0, "p90": 7.0, "p95": 7.0, "p99": 7.0, "avg": 7.0, "min": 7.0,
                                          "max": 7.0}
    assert latency_summary_us([]) == {}


@pytest.mark.parametrize(("throughputs", "stable"), [
    ([100, 100], False),                   # fewer than 3 windows
    ([50, 100, 104, 97], True),            # only the last 3 count
    ([100, 111, 100], True),               # mean 103.7: every value within 10 %
    ([100, 125, 100], False),              # 125 is 15 % above the mean 108.3
    ([0, 0, 0], False),                    # nothing got through: never "stable"
])
def test_stability_rule(throughputs, stable):
    assert is_stable(throughputs, windows=3, tolerance=0.10) is stable


def _snapshot(success: int, queue_ns: int, infer_ns: int) -> dict:
    stats = {"success": {"count": success, "ns": 0}, "queue": {"count": success, "ns": queue_ns},
             "compute_input": {"count": success, "ns": 0}, "compute_infer": {"count": success, "ns": infer_ns},
             "compute_output": {"count": success, "ns": 0}}
    return {"model_stats": [{"name": "m", "version": "1", "inference_stats": stats}]}


def test_server_split_is_a_delta_per_request():
    split = server_split(_snapshot(10, 5_000, 90_000), _snapshot(30, 45_000, 290_000), "m")
    assert split.count == 20
    assert split.queue_us == pytest.approx(2.0)          # (45000 - 5000) ns / 20 requests
    assert split.compute_infer_us == pytest.approx(10.0)  # (290000 - 90000) ns / 20


def test_server_split_missing_statistics():
    assert server_split(None, _snapshot(1, 1, 1), "m") is None
    assert server_split(_snapshot(1, 1, 1), _snapshot(2, 2, 2), "other") is None
    grpc_style = {"model_stats": [{"name": "m", "inference_stats": {"success": {"count": "4", "ns": "8"}}}]}
    assert server_split(grpc_style, grpc_style, "m").count == 0  # int64 as JSON strings (gRPC as_json)


def test_parse_range():
    assert parse_range("1:64:x2") == [1, 2, 4, 8, 16, 32, 64]
    assert parse_range("100:400:100") == [100, 200, 300, 400]
    assert parse_range("8") == [8]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_range("4:1")
    with pytest.raises(argparse.ArgumentTypeError):
        parse_range("1:8:x1")


def test_split_level_shares_load_exactly():
    shares = split_level("concurrency", 7, 3)
    assert [s["concurrency"] for s in shares] == [3, 2, 2]
    assert sum(s["rate"] for s in split_level("request_rate", 90.0, 4)) == pytest.approx(90.0)


def test_only_local_targets():
    assert local_url("127.0.0.1:8000") == "127.0.0.1:8000"
    assert local_url("localhost:8001") == "localhost:8001"
    with pytest.raises(argparse.ArgumentTypeError):
        local_url("10.0.0.5:8000")


METADATA = {"inputs": [{"name": "A", "datatype": "FP32", "shape": [-1, 16]},
                       {"name": "B", "datatype": "INT32", "shape": ["-1", "4"]}]}  # gRPC as_json: strings


def test_input_specs_batch_and_shapes():
    assert input_specs(METADATA, 3, {}, []) == (InputSpec("A", "FP32", (3, 16)), InputSpec("B", "INT32", (3, 4)))
    assert input_specs(METADATA, 1, {"A": (5, 16)}, ["A"]) == (InputSpec("A", "FP32", (5, 16)),)
    with pytest.raises(SystemExit, match="--shape"):  # max_batch_size 0: -1 is a data dim the user must give
        input_specs(METADATA, 1, {}, [], batching=False)
    with pytest.raises(SystemExit, match="no inputs"):
        input_specs(METADATA, 1, {}, ["C"])
