"""The host's CPU gauges (Triton's nv_cpu_*) from a /proc made for the test: utilization between scrapes."""

from __future__ import annotations

from pathlib import Path

from server.metrics import HostCpu


def _proc(root: Path, user: int, idle: int) -> None:
    # cpu  user nice system idle iowait irq softirq steal guest guest_nice
    (root / "stat").write_text(f"cpu  {user} 0 0 {idle} 0 0 0 0 0 0\ncpu0 {user} 0 0 {idle} 0 0 0 0 0 0\n")


def test_utilization_is_measured_between_scrapes_and_memory_used_is_total_minus_available(tmp_path: Path) -> None:
    (tmp_path / "meminfo").write_text("MemTotal:       1000 kB\nMemFree:         100 kB\nMemAvailable:    400 kB\n")
    _proc(tmp_path, user=300, idle=700)
    cpu = HostCpu(str(tmp_path))
    assert cpu.utilization() == 0.3  # since boot
    _proc(tmp_path, user=300 + 90, idle=700 + 10)
    assert cpu.utilization() == 0.9  # the last interval alone
    assert cpu.memory() == (1000 * 1024, 600 * 1024)
    families = {f.name: f.samples[0].value for f in cpu.families()}
    assert families["nv_cpu_memory_used_bytes"] == 600 * 1024 and families["nv_cpu_utilization"] == 0.0


def test_no_proc_means_no_cpu_gauges(tmp_path: Path) -> None:
    assert list(HostCpu(str(tmp_path / "absent")).families()) == []
