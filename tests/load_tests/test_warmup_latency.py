"""load_tests/warmup_latency.py end to end on the CPU (`--smoke`): a real `kiln serve`, the stock tritonclient, the
first request's latency against the steady median. The ratio itself is a benchmark figure (GPU), not asserted."""

from __future__ import annotations

import json

from load_tests import warmup_latency


def test_smoke_run_times_the_first_request_and_the_steady_ones(tmp_path):
    warmup_latency.main(["--smoke", "--models", "bert", "--requests", "12", "--out", str(tmp_path)])
    document = json.loads((tmp_path / "warmup_latency.json").read_text())
    (row,) = document["rows"]
    assert row["model"] == "bert_tiny" and len(row["latencies_ms"]) == 12 and all(v > 0 for v in row["latencies_ms"])
    assert row["first_ms"] == row["latencies_ms"][0] and row["hundredth_ms"] is None  # fewer than 100 requests
    assert abs(row["first_over_steady"] - row["first_ms"] / row["median_90_110_ms"]) < 0.01
    assert document["bound"] == warmup_latency.BOUND and row["ready_s"] > 0


def test_trace_splits_each_request_into_the_servers_time_and_its_execution_and_idle_samples_follow(tmp_path):
    warmup_latency.main(["--smoke", "--models", "bert", "--requests", "6", "--trace", "--idle-s", "0.05",
                         "--out", str(tmp_path)])
    (row,) = json.loads((tmp_path / "warmup_latency.json").read_text())["rows"]
    assert row["traced"] and len(row["server_latencies_ms"]) == len(row["compute_latencies_ms"]) == 6
    for prefix in ("", "server_", "compute_"):  # the requests after idle pauses are apart from the timed ones
        assert len(row[prefix + "after_idle_latencies_ms"]) == warmup_latency.IDLE_SAMPLES
        assert row[prefix + "after_idle_ms"] > 0
    for client, server, compute in zip(row["latencies_ms"], row["server_latencies_ms"], row["compute_latencies_ms"]):
        assert 0 < compute <= server <= client  # nested: the execution in the server's time in the client's
