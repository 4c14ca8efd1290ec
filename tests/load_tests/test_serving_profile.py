"""load_tests/serving_profile.py's summary of a py-spy raw file of the server's process tree."""

from __future__ import annotations

import gzip
from pathlib import Path

from load_tests.serving_profile import summarize_tree

CORE = 'process 10:"python -m server --model-repository r"'
FRONTEND = 'process 11:"python -B -c from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=3) --multiprocessing-fork"'
EXECUTOR = 'process 12:"python -m server.core.executor_main 7"'


def test_each_process_kind_and_thread_is_summarized_apart(tmp_path: Path) -> None:
    lines = [f"{CORE};thread (10): MainThread;run (a.py:1);decode (framing.py:2) 30",
             f"{CORE};{FRONTEND};thread (11): MainThread;run (a.py:1);parse (grpc.py:3) 50",
             f"{CORE};{EXECUTOR};thread (12): kiln-executor-lane-0;serve_lane (e.py:4);wait (s.py:5) 20"]
    path = tmp_path / "tree.pyspy.txt.gz"
    path.write_bytes(gzip.compress("\n".join(lines).encode()))
    text = summarize_tree(path)
    assert "== frontend, MainThread: 50 samples" in text  # the ";" in its command line does not split it
    assert "== core, MainThread: 30 samples" in text and "== executor, kiln-executor-lane-0: 20 samples" in text
    assert "100.0% self  parse (grpc.py:3)" in text and "100.0% self  wait (s.py:5)" in text
