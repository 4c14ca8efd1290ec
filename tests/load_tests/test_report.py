"""bench/report.py: ratios from result JSON, and the doc block replaced without touching the prose around it."""

from __future__ import annotations

import json

from bench import report


def _doc(scenario: str, server: str, rows: list[tuple[int, float, float]]) -> dict:
    return {"scenario": scenario, "server": server, "command": f"python -m load_tests.peers bench --only {scenario}",
            "model": "trivial", "protocol": "http", "tensor_format": "json", "mode": "concurrency",
            "inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 16]}],
            "host": {"cpus": 2, "platform": "linux", "python": "3.11"},
            "results": [{"concurrency": c, "requests_per_s": rps, "errors": 0, "stable": True, "server": None,
                         "latency_us": {"p50": p99 / 2, "p90": p99, "p95": p99, "p99": p99},
                         "client": {"cpu_cores": 0.2}} for c, rps, p99 in rows]}


def _render(results) -> str:
    """The performance page `bench/report.py` writes from the JSON files in `results` (no plots)."""
    page = results / "performance.md"
    assert report.main(["--results", str(results), "--doc", str(page), "--no-plots"]) == 0
    return page.read_text()


def test_peer_ratios_per_level_and_peak():
    kiln = _doc("trivial_http_json", "kiln", [(1, 400.0, 2000.0), (2, 900.0, 3000.0)])
    peer = _doc("trivial_http_json", "mlserver", [(1, 200.0, 8000.0), (2, 300.0, 6000.0), (4, 350.0, 9000.0)])
    ratios = report.peer_ratios(kiln, peer)
    assert [r["level"] for r in ratios["per_level"]] == [1, 2]  # only levels both measured
    assert [r["rps"] for r in ratios["per_level"]] == [2.0, 3.0]
    assert [r["p99"] for r in ratios["per_level"]] == [0.25, 0.5]
    assert ratios["peak_rps"] == 900.0 / 350.0


def test_report_writes_block_and_keeps_prose(tmp_path):
    for doc in (_doc("trivial_http_json", "kiln", [(1, 400.0, 2000.0)]),
                _doc("trivial_http_json", "mlserver", [(1, 100.0, 4000.0)])):
        (tmp_path / f"serving_{doc['scenario']}_{doc['server']}.json").write_text(json.dumps(doc))
    page = tmp_path / "performance.md"
    page.write_text(f"# Perf\n\nintro\n\n{report.BEGIN}\nold table\n{report.END}\n\nclosing note\n")
    assert report.main(["--results", str(tmp_path), "--doc", str(page), "--no-plots"]) == 0
    text = page.read_text()
    assert text.startswith("# Perf\n\nintro\n") and text.rstrip().endswith("closing note")
    assert "old table" not in text and text.count(report.BEGIN) == 1
    assert "| trivial_http_json: Kiln / mlserver | 4.00x | c1: 4.00x | c1: 0.50x |" in text
    assert "python -m load_tests.peers bench --only trivial_http_json" in text


def test_every_peer_gets_a_ratio_row_with_geomeans(tmp_path):
    for doc in (_doc("trivial_grpc", "kiln", [(1, 400.0, 2000.0), (2, 800.0, 2000.0)]),
                _doc("trivial_grpc", "mlserver", [(1, 100.0, 4000.0), (2, 200.0, 8000.0)]),
                _doc("trivial_grpc", "kserve", [(1, 400.0, 1000.0), (2, 200.0, 4000.0)])):
        (tmp_path / f"serving_{doc['scenario']}_{doc['server']}.json").write_text(json.dumps(doc))
    text = _render(tmp_path)
    assert "| trivial_grpc: Kiln / mlserver | 4.00x | c1: 4.00x, c2: 4.00x | c1: 0.50x, c2: 0.25x | 4.00x | 0.35x |" in text
    assert "| trivial_grpc: Kiln / kserve | 2.00x | c1: 1.00x, c2: 4.00x | c1: 2.00x, c2: 0.50x | 2.00x | 1.00x |" in text


def test_gpu_serving_section(tmp_path):
    (tmp_path / "serving_trivial_grpc_kiln.json").write_text(json.dumps(_doc("trivial_grpc", "kiln", [(1, 1.0, 1.0)])))
    gpu = {"tool": "load_tests/gpu_serving.py", "command": "python load_tests/gpu_serving.py --out x",
           "setup": {"model": "resnet50", "precision": "fp16", "max_batch": 128}, "device": {"gpus": ["H100"]},
           "load_s": {"batched": 60.0, "direct": 1.0}, "elapsed_s": 300.0, "started_utc": "t",
           "raw": [{"batch": 1, "infer_per_s": 500.0, "latency_ms": 2.0}],
           "efficiency": [{"variant": "direct", "concurrency": 1, "raw_batch": 1, "server_avg_batch": 1.0,
                           "served_infer_per_s": 450.0, "raw_infer_per_s": 500.0, "efficiency": 0.9,
                           "p50_ms": 2.2, "p99_ms": 3.0, "server_queue_us": 4.0, "errors": 0}]}
    (tmp_path / "gpu_serving_resnet50_fp16.json").write_text(json.dumps(gpu))
    text = _render(tmp_path)
    assert "### GPU serving: resnet50 fp16, max batch 128 (H100)" in text
    assert "| 1 | 500.0 | 2.00 |" in text
    assert "| direct | 1 | 1.0 | 450.0 | 500.0 (b1) | 90% | 2.20 | 3.00 | 4 | 0 |" in text


def test_rounds_get_a_median_ratio_row(tmp_path):
    """Three alternating rounds against Triton: a ratio row per round, and the per-level median of those ratios."""
    for run, (kiln_rps, triton_rps) in enumerate([(100.0, 200.0), (300.0, 200.0), (150.0, 200.0)], start=1):
        for doc in (_doc("add_sub_grpc", "kiln", [(16, kiln_rps, 1000.0)]),
                    _doc("add_sub_grpc", "triton", [(16, triton_rps, 2000.0)])):
            doc["run"] = run
            suffix = f"_run{run}" if run > 1 else ""
            (tmp_path / f"serving_add_sub_grpc_{doc['server']}{suffix}.json").write_text(json.dumps(doc))
    text = _render(tmp_path)
    assert "| add_sub_grpc, run 2: Kiln / triton | 1.50x |" in text
    assert "| add_sub_grpc: Kiln / triton, median of 3 runs | | c16: 0.75x | c16: 0.50x | 0.75x | 0.50x |" in text


def _gpu_row(transport: str, variant: str, rate: float, raw: float) -> dict:
    return {"model": "bert_cls", "transport": transport, "variant": variant, "concurrency": 64, "infer_per_s": rate,
            "p50_ms": 2.0, "p99_ms": 4.0, "server_avg_batch": 40.0 if variant == "batched" else 1.0,
            "raw_batch": 64 if variant == "batched" else 1, "raw_infer_per_s": raw, "efficiency": rate / raw,
            "errors": 0, "client_bound": False}


def test_gpu_serving_run_section(tmp_path):
    (tmp_path / "serving_trivial_grpc_kiln.json").write_text(json.dumps(_doc("trivial_grpc", "kiln", [(1, 1.0, 1.0)])))
    gpu = {"tool": "load_tests/gpu_serving.py", "command": "python load_tests/gpu_serving.py --out x",
           "setup": {"precision": "fp16", "max_batch": 128}, "device": {"gpus": ["H100"]},
           "load_s": {"bert_cls_batched": 40.0}, "elapsed_s": 300.0, "started_utc": "2026-11-27T10:00:00Z",
           "frontend_processes": "not requested",
           "raw": {"bert_cls": [{"batch": 1, "infer_per_s": 900.0, "latency_ms": 1.11},
                                {"batch": 64, "infer_per_s": 8000.0, "latency_ms": 8.0}]},
           "rows": [_gpu_row("grpc", "batched", 4000.0, 8000.0), _gpu_row("grpc", "direct", 450.0, 900.0)],
           "ratios": [{"model": "bert_cls", "comparison": "batched / direct", "transport": "grpc", "concurrency": 64,
                       "infer_per_s": 4000.0 / 450.0, "p99": 1.0}]}
    (tmp_path / "gpu_serving_20261127.json").write_text(json.dumps(gpu))
    text = _render(tmp_path)
    assert "### GPU serving: bert_cls fp16, max batch 128 (H100)" in text
    assert "| 64 | 8000.0 (8.00 ms) |" in text
    assert "| bert_cls | grpc | batched | 64 | 4000.0 | 2.00 | 4.00 | 40.0 | 8000.0 (b64) | 50% | 0 |" in text
    assert "| bert_cls | batched / direct | grpc | 64 | 8.89x | 1.00x |" in text
