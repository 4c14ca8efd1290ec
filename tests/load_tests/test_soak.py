"""The soak's judgement (load_tests/soak.py): host RSS of the server's whole process tree and, on a GPU, its
device memory must both stay flat; a real child process counts in the tree."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from load_tests import soak


def _report(rss: list[float], device: list[float] | None = None) -> soak.SoakReport:
    report = soak.SoakReport(minutes=1.0, max_slope_mb_per_min=2.0, max_growth_mb=32.0)
    report.rss_sample_minutes = [0.1 * i for i in range(1, len(rss) + 1)]
    report.rss_samples_mb = rss
    if device is not None:
        report.device_samples_mb = device
        report.device_sample_minutes = report.rss_sample_minutes[:len(device)]
    return report


def test_flat_host_and_device_memory_pass_and_growth_in_either_fails():
    flat = [100.0 + 0.01 * i for i in range(10)]
    report = _report(flat, [500.0] * 10)
    soak.judge(report)
    assert report.flat and report.passed and report.device_growth_mb == 0.0
    growing = _report(flat, [500.0 + 20 * i for i in range(10)])  # 200 MiB/min on the device
    soak.judge(growing)
    assert not growing.flat and not growing.passed and growing.device_slope_mb_per_min == 200.0
    leaking = _report([100.0 + 10 * i for i in range(10)])
    soak.judge(leaking)
    assert not leaking.flat and leaking.rss_slope_mb_per_min == 100.0
    lost = _report(flat)
    lost.lost = 1
    soak.judge(lost)
    assert lost.flat and not lost.passed


def test_the_process_tree_counts_children():
    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(64 << 20); time.sleep(30)"])
    try:
        deadline = time.monotonic() + 10
        while soak.rss_mb(child.pid) < 60 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child.pid in soak.descendants(os.getpid())
        assert soak.tree_rss_mb(os.getpid()) >= soak.rss_mb(os.getpid()) + 60
    finally:
        child.kill()
        child.wait()


def test_a_grpc_error_the_server_sent_is_an_answer_and_a_broken_transport_is_lost():
    """fault_tally.py's rule: UNAVAILABLE from the server counts by its status (as HTTP's 503); gRPC's own
    transport failure is a lost request."""
    grpc = pytest.importorskip("grpc")

    class Failure(grpc.RpcError):
        def __init__(self, code, details: str) -> None:
            self._code, self._details = code, details

        def code(self):
            return self._code

        def details(self) -> str:
            return self._details

    class Stub:
        def __init__(self, error: Exception) -> None:
            self.error = error

        def ModelInfer(self, request, timeout):  # noqa: N802 - the gRPC method's name
            raise self.error

    traffic = object.__new__(soak.Traffic)
    traffic.grpc = Stub(Failure(grpc.StatusCode.UNAVAILABLE, "Request for unknown model: 'add_sub' (not loaded)"))
    assert traffic._model_infer(None) == ("good", 503, False)
    traffic.grpc = Stub(Failure(grpc.StatusCode.INVALID_ARGUMENT, "bad shape"))
    assert traffic._model_infer(None) == ("good", 400, False)
    traffic.grpc = Stub(Failure(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: ..."))
    with pytest.raises(soak.NoAnswer):
        traffic._model_infer(None)
