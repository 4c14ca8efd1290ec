"""KILN_CPU_LATENCY_US (server/core/cpu_latency.py): the PM QoS bound is written and held open, or the server
says why not and runs as before. A regular file stands in for /dev/cpu_dma_latency (writing the real one needs root
and changes the whole host's idle states)."""

from __future__ import annotations

import logging
import struct
from pathlib import Path

from server.core.cpu_latency import hold_cpu_latency


def test_the_bound_is_written_and_held_open(tmp_path: Path, caplog) -> None:
    device = tmp_path / "cpu_dma_latency"
    device.touch()
    with caplog.at_level(logging.INFO, "kiln.server"):
        held = hold_cpu_latency({"KILN_CPU_LATENCY_US": "0"}, str(device))
    assert held is not None and not held.closed
    held.close()
    assert struct.unpack("i", device.read_bytes()) == (0,)
    assert "cores stay out of idle states slower to leave than 0 us" in caplog.text


def test_unset_bad_or_unwritable_bounds_change_nothing(tmp_path: Path, caplog) -> None:
    device = tmp_path / "cpu_dma_latency"
    assert hold_cpu_latency({}, str(device)) is None
    assert hold_cpu_latency({"KILN_CPU_LATENCY_US": "-5"}, str(device)) is None
    assert "is not a whole number of microseconds" in caplog.text
    assert hold_cpu_latency({"KILN_CPU_LATENCY_US": "10"}, str(tmp_path / "missing" / "device")) is None
    assert "cannot open" in caplog.text and "the cores keep their idle states" in caplog.text
    assert not device.exists()
