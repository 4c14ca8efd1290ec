"""load_tests/gpu_serving.py: the pure parts, and the whole `--smoke` run (real server, kiln perf over gRPC and
system shared memory, raw engine through execute_async_v3 on the server's own plan)."""

from __future__ import annotations

import json

import pytest

from load_tests import gpu_serving


def test_served_batches_map_to_the_buckets_the_cuda_path_runs():
    assert [gpu_serving.bucket(b, 128) for b in (1.0, 1.4, 2.6, 20.0, 33.0, 100.0)] == [1, 1, 3, 24, 48, 128]
    assert gpu_serving.bucket(5.0, 6) == 6


def _perf_doc(rates: list[tuple[int, float]], avg_batch: float | None, p99_us: float = 2000.0) -> dict:
    return {"results": [{"concurrency": c, "throughput_infer_per_s": r, "latency_us": {"p50": 1000.0, "p99": p99_us},
                         "server": {"queue_us": 5.0, "compute_infer_us": 50.0, "avg_batch": avg_batch},
                         "errors": 0, "stable": True, "client": {"client_bound": False}} for c, r in rates]}


RAW = [{"batch": 1, "infer_per_s": 100.0}, {"batch": 2, "infer_per_s": 180.0}, {"batch": 4, "infer_per_s": 300.0}]


def test_efficiency_is_served_over_raw_at_the_bucket_of_the_average_batch():
    rows = gpu_serving.served_rows("m", "grpc", "batched", _perf_doc([(1, 90.0), (8, 270.0)], 3.5), RAW, max_batch=4)
    assert [(r["concurrency"], r["raw_batch"]) for r in rows] == [(1, 4), (8, 4)]
    assert [r["efficiency"] for r in rows] == pytest.approx([0.3, 0.9])
    assert rows[1]["server_avg_batch"] == 3.5 and rows[1]["p99_ms"] == 2.0
    no_stats = gpu_serving.served_rows("m", "grpc", "direct", _perf_doc([(8, 95.0)], None), RAW, max_batch=4)
    assert no_stats[0]["raw_batch"] == 1 and no_stats[0]["efficiency"] == pytest.approx(0.95)  # direct: batch 1


def test_ratios_compare_variants_and_transports_in_the_same_run():
    rows = (gpu_serving.served_rows("m", "grpc", "batched", _perf_doc([(4, 300.0)], 4.0, 1000.0), RAW, 4)
            + gpu_serving.served_rows("m", "grpc", "direct", _perf_doc([(4, 100.0)], 1.0, 4000.0), RAW, 4)
            + gpu_serving.served_rows("m", "system", "batched", _perf_doc([(4, 450.0)], 4.0, 500.0), RAW, 4))
    ratios = {(r["comparison"], r["transport"]): (r["infer_per_s"], r["p99"]) for r in gpu_serving.peer_ratios(rows)}
    assert ratios == {("batched / direct", "grpc"): (3.0, 0.25), ("system / grpc", "batched"): (1.5, 0.5)}


def test_config_carries_precision_batching_and_tensors():
    setup = gpu_serving.make_setup(gpu_serving.build_parser().parse_args(["--out", "x", "--precision", "bf16"]))
    assert setup.models == ("resnet50", "bert") and setup.transports == ("grpc", "http", "system", "cuda")
    assert setup.concurrency == (1, 64) and setup.max_batch == 128
    bert = gpu_serving.spec_of(setup, "bert")
    batched = gpu_serving.model_config("b", bert, setup, batched=True)
    assert 'key: "kiln_precision" value { string_value: "bf16" }' in batched
    assert "dynamic_batching" in batched and "max_batch_size: 128" in batched and "KIND_GPU" in batched
    assert '{ name: "input_ids" data_type: TYPE_INT64 dims: [ 128 ] }' in batched
    assert 'output [ { name: "cls" data_type: TYPE_FP32 dims: [ 768 ] } ]' in batched
    assert "dynamic_batching" not in gpu_serving.model_config("b", bert, setup, batched=False)


def test_selections_and_frontend_flag_detection():
    args = gpu_serving.build_parser().parse_args(["--out", "x", "--models", "bert", "--transports", "http,cuda",
                                                  "--variants", "direct", "--concurrency", "1,4,16,64,256"])
    setup = gpu_serving.make_setup(args)
    assert (setup.models, setup.transports, setup.variants) == (("bert",), ("http", "cuda"), ("direct",))
    assert setup.concurrency == (1, 4, 16, 64, 256)
    with pytest.raises(SystemExit, match="unknown"):
        gpu_serving.make_setup(gpu_serving.build_parser().parse_args(["--out", "x", "--transports", "tcp"]))
    assert gpu_serving.frontend_arguments(None, "--frontend-processes N")[0] == []
    assert gpu_serving.frontend_arguments(4, "usage: ... --http-port")[0] == []
    assert gpu_serving.frontend_arguments(4, "  --frontend-processes N  ...")[0] == ["--frontend-processes", "4"]


def test_plan_files_from_the_server_log():
    log = ("I1126 model 'a_batched' version 1: plan built, stored in the plan cache (/c/plans/cc/k1.plan)\n"
           "I1126 model 'a_direct' version 1: plan cache hit (/c/plans/cc/k1.plan), no rebuild\n")
    assert gpu_serving.plan_files(log) == {"a_batched": "/c/plans/cc/k1.plan", "a_direct": "/c/plans/cc/k1.plan"}


def test_bert_serves_the_cls_vector_only():
    spec = gpu_serving.MODELS["bert"][1]
    model = gpu_serving.build_onnx(spec)
    assert [o.name for o in model.graph.output] == ["cls"]
    assert [i.name for i in model.graph.input] == [t.name for t in spec.inputs]


def test_smoke_run(tmp_path):
    """The whole pipeline on the CPU: both tiny models and variants served over gRPC and system shared memory,
    the raw engine timed on the very plan the server built."""
    assert gpu_serving.main(["--smoke", "--out", str(tmp_path), "--precision", "fp32"]) == 0
    doc = json.loads((tmp_path / "gpu_serving.json").read_text())
    assert doc["setup"]["precision"] == "fp32" and doc["frontend_processes"] == "not requested"
    assert set(doc["raw"]) == {"resnet_tiny", "bert_tiny"}
    for raw in doc["raw"].values():
        assert [r["batch"] for r in raw] == [1, 2, 3, 4]
        assert all(r["infer_per_s"] > 0 and r["iterations"] >= 5 for r in raw)
    assert all(path.endswith(".plan") for path in doc["plan_files"].values())
    rows = doc["rows"]
    assert {(r["model"], r["transport"], r["variant"], r["concurrency"]) for r in rows} == {
        (m, t, v, c) for m in ("resnet_tiny", "bert_tiny") for t in ("grpc", "system") for v in ("batched", "direct")
        for c in (1, 4)}
    for row in rows:
        assert row["errors"] == 0 and row["infer_per_s"] > 0 and row["efficiency"] > 0
    # no batcher: one by one. Not exactly 1.0: the statistics snapshots that bound a window are taken under load,
    # and a request counted in inference_count whose execution is not yet in execution_count (or the reverse)
    # moves the ratio by about 1/executions; batching at concurrency 4 would move it towards 2.
    direct = [r["server_avg_batch"] for r in rows if r["variant"] == "direct"]
    assert all(abs(avg - 1.0) < 0.05 for avg in direct), direct
    assert all(r["server_avg_batch"] >= 1.0 for r in rows if r["variant"] == "batched")
    assert {r["comparison"] for r in doc["ratios"]} == {"batched / direct", "system / grpc"}
    for model in doc["models"].values():
        for variant, name in model.items():
            config = (tmp_path / "work" / "repository" / name / "config.pbtxt").read_text()
            assert ("dynamic_batching" in config) == (variant == "batched")
            assert (tmp_path / f"perf_{name}_system.json").is_file()
    perf_doc = json.loads((tmp_path / "perf_bert_tiny_batched_system.json").read_text())
    assert perf_doc["shared_memory"] == "system" and perf_doc["input_data"] == "zero"


def test_gpus_lists_place_one_model_each_and_compare_with_the_first(tmp_path):
    args = gpu_serving.build_parser().parse_args(["--out", "x", "--models", "bert", "--variants", "batched",
                                                  "--gpus", "0", "--gpus", "0, 1"])
    setup = gpu_serving.make_setup(args)
    assert setup.gpus == ("0", "0,1")
    source = tmp_path / "m.onnx"
    source.write_bytes(b"onnx")
    names = gpu_serving.write_model(tmp_path / "repo", gpu_serving.spec_of(setup, "bert"), source, setup)
    assert names == {"batched@0": "bert_cls_batched_g0", "batched@0,1": "bert_cls_batched_g0-1"}
    assert "kind: KIND_GPU gpus: [ 0,1 ] }" in (tmp_path / "repo" / "bert_cls_batched_g0-1" / "config.pbtxt").read_text()
    rows = (gpu_serving.served_rows("m", "grpc", "batched", _perf_doc([(128, 1000.0)], 4.0, 1000.0), RAW, 4, "0")
            + gpu_serving.served_rows("m", "grpc", "batched", _perf_doc([(128, 1900.0)], 4.0, 500.0), RAW, 4, "0,1"))
    assert [r["gpus"] for r in rows] == ["0", "0,1"]
    (ratio,) = gpu_serving.peer_ratios(rows)
    assert (ratio["comparison"], ratio["transport"], ratio["gpus"]) == ("gpus 0,1 / 0", "grpc batched", "0,1")
    assert (ratio["infer_per_s"], ratio["p99"]) == pytest.approx((1.9, 0.5))
    with pytest.raises(SystemExit, match="--gpus"):
        gpu_serving.make_setup(gpu_serving.build_parser().parse_args(["--out", "x", "--gpus", "a"]))
