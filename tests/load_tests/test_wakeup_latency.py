"""load_tests/wakeup_latency.py: every case measures round trips and the JSON says what was measured."""

from __future__ import annotations

import json
from pathlib import Path

from load_tests import wakeup_latency


def test_each_hand_off_case_is_measured_and_written(tmp_path: Path, capsys) -> None:
    assert wakeup_latency.main(["--seconds", "0.2", "--idle-s", "0.05", "--out", str(tmp_path)]) == 0
    document = json.loads((tmp_path / "wakeup_latency.json").read_text())
    assert set(document["cases"]) == {"processes, socket, receivers sleep", "processes, socket, receivers spin",
                                      "threads, SimpleQueue, receivers sleep", "processes, socket, after 0.05 s idle"}
    assert document["cases"]["processes, socket, after 0.05 s idle"]["round_trips"] == wakeup_latency.IDLE_ROUND_TRIPS
    for row in document["cases"].values():
        assert row["round_trips"] >= wakeup_latency.IDLE_ROUND_TRIPS and 0 < row["p50_us"] <= row["p99_us"]
    assert "processes, socket, receivers sleep" in capsys.readouterr().out
