"""The fault driver (load_tests/gpu_faults.py) on the CPU: its scenarios that need no GPU, a second or two each at
c=64 over HTTP and gRPC, lose no request and serve again after each fault; and its bookkeeping (recovery, lost
gRPC answers, failure keys, a load message naming bytes) on made-up records. The GPU run is
`bench/device_session.sh faults`."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from load_tests import gpu_faults
from load_tests.fault_tally import Record, ScenarioResult, lost_grpc, lost_http, tally

pytest.importorskip("tritonclient.grpc")


def test_cpu_faults_lose_no_request_and_each_model_serves_again(tmp_path: Path, monkeypatch) -> None:
    """The memory cycles run too, on a made-up gauge: the CPU has none (the run itself skips them there)."""
    monkeypatch.setattr(gpu_faults, "NEEDS_GPU", {"oversize": gpu_faults.NEEDS_GPU["oversize"]})
    monkeypatch.setattr(gpu_faults.FaultServer, "device_memory", lambda self: (2.0**30, "made up"))
    out = tmp_path / "faults.json"
    code = gpu_faults.main(["--device", "cpu", "--short", "--warm-s", "0.5", "--after-s", "0.5",
                            "--scenarios", "oversize,cuda,kill,reload,memory", "--json-file", str(out)])
    report = json.loads(out.read_text())
    by_name = {s["scenario"]: s for s in report["scenarios"]}
    assert by_name["oversize"]["skipped"]  # it needs a GPU
    for name in ("cuda", "kill", "reload", "memory"):
        scenario = by_name[name]
        assert scenario["sent"] > 64 and scenario["succeeded"] > 0, scenario
        assert scenario["lost"] == 0 and scenario["wrong"] == 0, scenario
        assert scenario["recovery_s"] is not None, f"{name}: no success after the fault"
        for probe in ("http live", "grpc live"):
            assert scenario["health"][probe]["failed"] == 0, scenario["health"]
    cuda, kill, reload = by_name["cuda"], by_name["kill"], by_name["reload"]
    assert cuda["detail"]["injected"]["status"] == 500 and "CUDA_ERROR_ILLEGAL_ADDRESS" in cuda["detail"]["injected"]["text"]
    assert cuda["detail"]["executor_after"] != cuda["detail"]["executor_before"]
    assert kill["detail"]["executor_after"] not in (None, kill["detail"]["killed"])
    assert all(key.startswith(("503", "gRPC UNAVAILABLE")) for key in [*kill["failed"], *reload["failed"]])
    assert reload["detail"]["unload"][0] == 200 and reload["detail"]["load"][0] == 200
    memory = by_name["memory"]["detail"]
    assert memory["cycles"] == 2 and len(memory["recovery_each_s"]) == 2 and None not in memory["recovery_each_s"]
    assert memory["baseline_mib"] == 1024 and memory["growth_mib"] == 0
    assert code == (0 if all(s["passed"] for s in report["scenarios"] if not s["skipped"]) else 1)


def _records(*rows: tuple[float, float, str]) -> list[Record]:
    return [Record("http", sent, done, outcome) for sent, done, outcome in rows]


def test_recovery_counts_from_the_fault_to_the_first_success_sent_after_the_last_failure() -> None:
    records = _records((9.0, 10.2, "ok"),  # sent before the fault, answered after: not a recovery
                       (10.1, 10.3, "ok"),  # slipped through before the fault took hold
                       (10.2, 10.4, "503: gone"), (11.0, 11.1, "503: gone"),
                       (11.5, 12.0, "ok"), (11.6, 11.9, "ok"), (12.5, 12.6, "lost: HTTP timeout"))
    result = ScenarioResult("x", "m")
    tally(result, records[:-1], [10.0])
    assert result.recovery_s == pytest.approx(1.9) and result.disrupted_s == pytest.approx(1.1)
    assert result.failed == {"503: gone": 2} and result.failed_by_status == {"503": 2}
    assert result.succeeded == 4 and result.lost == 0
    tally(result, records, [10.0])
    assert result.lost == 1 and result.lost_by == {"lost: HTTP timeout": 1}
    assert result.recovery_s is None  # a failure after the last success: not recovered
    cycles = _records((1.0, 1.5, "503: x"), (1.6, 1.7, "ok"), (5.0, 5.2, "503: x"), (5.3, 5.4, "ok"))
    tally(result, cycles, [1.0, 5.0])
    assert result.recovery_s == pytest.approx(0.7) and result.detail["recovery_each_s"] == [0.7, 0.4]


def test_lost_answers_and_failure_keys() -> None:
    assert lost_grpc("StatusCode.DEADLINE_EXCEEDED", "Deadline Exceeded")
    assert lost_grpc("StatusCode.UNAVAILABLE", "failed to connect to all addresses")
    assert not lost_grpc("StatusCode.UNAVAILABLE", "Request for unknown model: 'm' (not loaded)")
    assert not lost_grpc("StatusCode.UNAVAILABLE", "model 'm' version 1: the executor process ended during "
                                    "the execution (exit code -9: [Errno 104] Connection reset by peer)")
    assert lost_http(httpx.ConnectError("refused")) and lost_http(httpx.ReadTimeout("slow"))
    assert not lost_http(httpx.DecodingError("bad gzip"))  # the server answered, unreadably
    assert gpu_faults.failure_key("503", "executor  process 1234 ended\n(exit code -9)") == \
        "503: executor process N ended (exit code -N)"


def test_a_load_message_names_the_bytes_needed_and_free() -> None:
    assert gpu_faults.names_bytes("model 'big' needs 2147483648 bytes of device memory; 1073741824 bytes are free") \
        == {"needed": True, "free": True}
    assert gpu_faults.names_bytes("cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY") == {"needed": False, "free": False}
