"""`kiln perf` against a real local server subprocess (tests/server/conftest.py): JSON/CSV output and sanity."""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import pytest
import tritonclient.http as httpclient

from load_tests import perf
from server.core.shared_memory import SHM_ROOT

FAST = ["-p", "500", "--warmup", "0.2", "-r", "3", "--processes", "2", "-q"]


def _run(tmp_path, *argv: str) -> dict:
    out = tmp_path / "perf.json"
    assert perf.main([*argv, *FAST, "--json-file", str(out), "-f", str(tmp_path / "perf.csv")]) == 0
    return json.loads(out.read_text())


def _check_row(row: dict) -> None:
    lat = row["latency_us"]
    assert row["requests"] > 0 and row["errors"] == 0 and row["first_error"] == ""
    assert 0 < lat["min"] <= lat["p50"] <= lat["p90"] <= lat["p95"] <= lat["p99"] <= lat["max"]
    assert row["requests_per_s"] == pytest.approx(row["requests"] / row["measured_s"])
    assert row["client"]["processes"] == 2 and row["client"]["cpu_cores"] > 0
    assert 3 <= row["windows"] <= 3 or not row["stable"]


def test_http_concurrency_sweep_binary(kiln_server, tmp_path):
    doc = _run(tmp_path, "-m", "add_sub", "-u", kiln_server.http_url, "--concurrency-range", "1:2:x2", "-b", "2")
    assert doc["protocol"] == "http" and doc["tensor_format"] == "binary" and doc["mode"] == "concurrency"
    assert doc["inputs"] == [{"name": "INPUT0", "datatype": "INT32", "shape": [2, 16]},
                             {"name": "INPUT1", "datatype": "INT32", "shape": [2, 16]}]
    assert [r["concurrency"] for r in doc["results"]] == [1, 2]
    for row in doc["results"]:
        _check_row(row)
        assert row["throughput_infer_per_s"] == pytest.approx(2 * row["requests_per_s"])  # batch size 2
        server = row["server"]  # the statistics extension's delta over the measured windows
        assert server is not None and server["count"] > 0 and server["compute_infer_us"] > 0
    with open(tmp_path / "perf.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["level"] for r in rows] == ["1", "2"] and float(rows[0]["p99_us"]) >= float(rows[0]["p50_us"])


def test_http_json_tensors(kiln_server, tmp_path):
    doc = _run(tmp_path, "-m", "simple_cnn", "-u", kiln_server.http_url, "--input-tensor-format", "json")
    assert doc["tensor_format"] == "json" and doc["inputs"][0]["shape"] == [1, 3, 32, 32]
    _check_row(doc["results"][0])


def test_grpc_poisson_request_rate(kiln_server, tmp_path):
    if not kiln_server.grpc_available:
        pytest.skip("gRPC frontend not importable")
    doc = _run(tmp_path, "-m", "add_sub", "-i", "grpc", "-u", kiln_server.grpc_url, "--request-rate", "40")
    row = doc["results"][0]
    assert doc["mode"] == "request_rate" and row["request_rate"] == 40
    _check_row(row)
    assert 20 <= row["requests_per_s"] <= 60  # open loop: the offered rate, not the server's maximum
    assert row["server"]["count"] > 0


def _leftover_regions() -> list[str]:
    return sorted(p.name for p in Path(SHM_ROOT).glob("kiln_perf_*"))


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_system_shared_memory(kiln_server, tmp_path, protocol):
    """Inputs and outputs in /dev/shm regions registered once per client process; gone from both sides after."""
    if protocol == "grpc" and not kiln_server.grpc_available:
        pytest.skip("gRPC frontend not importable")
    before = _leftover_regions()
    url = kiln_server.grpc_url if protocol == "grpc" else kiln_server.http_url
    doc = _run(tmp_path, "-m", "add_sub", "-i", protocol, "-u", url, "--shared-memory", "system",
               "--concurrency-range", "2", "-b", "2")
    assert doc["shared_memory"] == "system"
    row = doc["results"][0]
    _check_row(row)
    assert row["server"]["count"] > 0
    assert _leftover_regions() == before
    with httpclient.InferenceServerClient(kiln_server.http_url) as client:
        assert client.get_system_shared_memory_status() == []


def test_level_lists():
    assert perf.parse_range("1,16,64") == [1, 16, 64]
    with pytest.raises(argparse.ArgumentTypeError):
        perf.parse_range("1,-2")
