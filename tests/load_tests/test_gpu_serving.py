"""load_tests/gpu_serving.py: the pure parts, and the whole `--smoke` run (real server, kiln perf, raw engine)."""

from __future__ import annotations

import json

import pytest

from load_tests import gpu_serving


def test_raw_batch_sizes_cover_every_batch_the_server_can_form():
    assert gpu_serving.raw_batch_sizes([1, 2, 4, 8, 16, 32, 64, 128], 128) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert gpu_serving.raw_batch_sizes([2, 4, 8], 4) == [1, 2, 4]  # direct runs batch 1; batches cap at max


def _perf_doc(rates: list[tuple[int, float]], avg_batch: float) -> dict:
    return {"results": [{"concurrency": c, "throughput_infer_per_s": r, "latency_us": {"p50": 1000.0, "p99": 2000.0},
                         "server": {"queue_us": 5.0, "compute_infer_us": 50.0, "avg_batch": avg_batch},
                         "errors": 0} for c, r in rates]}


def test_efficiency_is_served_over_raw_at_the_batch_the_server_ran():
    raw = [{"batch": 1, "infer_per_s": 100.0}, {"batch": 2, "infer_per_s": 180.0}, {"batch": 4, "infer_per_s": 300.0}]
    served = {"batched": _perf_doc([(1, 90.0), (8, 270.0)], 3.5), "direct": _perf_doc([(8, 95.0)], 1.0)}
    rows = gpu_serving.efficiency_rows(served, raw, max_batch=4)
    assert [(r["variant"], r["concurrency"], r["raw_batch"]) for r in rows] == [
        ("batched", 1, 1), ("batched", 8, 4), ("direct", 8, 1)]
    assert [r["efficiency"] for r in rows] == pytest.approx([0.9, 0.9, 0.95])
    assert rows[1]["server_avg_batch"] == 3.5 and rows[1]["p99_ms"] == 2.0


def test_config_carries_precision_and_batching():
    setup = gpu_serving.make_setup(gpu_serving.build_parser().parse_args(["--out", "x", "--precision", "bf16"]))
    batched = gpu_serving.model_config("m", setup, batched=True)
    assert 'key: "kiln_precision" value { string_value: "bf16" }' in batched
    assert "dynamic_batching" in batched and "max_batch_size: 128" in batched and "KIND_GPU" in batched
    assert "dynamic_batching" not in gpu_serving.model_config("m", setup, batched=False)


def test_smoke_run_end_to_end(tmp_path):
    """The CPU stand-in for the device run: both variants served and swept, raw engine timed on the same plan."""
    assert gpu_serving.main(["--smoke", "--out", str(tmp_path), "--precision", "fp32"]) == 0
    doc = json.loads((tmp_path / "gpu_serving.json").read_text())
    assert doc["setup"]["model"] == "resnet_tiny" and doc["setup"]["precision"] == "fp32"
    assert [r["batch"] for r in doc["raw"]] == [1, 2, 4]
    assert all(r["infer_per_s"] > 0 and r["iterations"] >= 5 for r in doc["raw"])
    assert doc["plan_file"].endswith(".plan")
    rows = doc["efficiency"]
    assert [(r["variant"], r["concurrency"]) for r in rows] == [
        ("batched", 1), ("batched", 2), ("batched", 4), ("direct", 1), ("direct", 2), ("direct", 4)]
    for row in rows:
        assert row["errors"] == 0 and row["served_infer_per_s"] > 0 and row["efficiency"] > 0
        assert row["raw_batch"] == (min(row["concurrency"], 4) if row["variant"] == "batched" else 1)
    assert all(r["server_avg_batch"] == 1.0 for r in rows if r["variant"] == "direct")  # no batcher: one by one
    assert all(r["server_avg_batch"] >= 1.0 for r in rows if r["variant"] == "batched")
    for variant, name in doc["models"].items():
        config = (tmp_path / "work" / "repository" / name / "config.pbtxt").read_text()
        assert ('dynamic_batching' in config) == (variant == "batched")
        assert (tmp_path / f"perf_{name}.json").is_file()
