"""The soak's judgement (load_tests/soak.py): host RSS of the server's whole process tree and, on a GPU, its
device memory must both stay flat; a real child process counts in the tree."""

from __future__ import annotations

import os
import subprocess
import sys
import time

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
