"""`load_tests/core_path.py` end to end, briefly: a real core process served through `CoreService` and client
processes through `RemoteCore`, with plain requests and with requests in system shared memory (groups by
reference)."""

from __future__ import annotations

import argparse

import pytest

from load_tests import core_path


@pytest.mark.parametrize("shared_memory", ["", "system"])
def test_the_core_path_serves_plain_and_shared_memory_requests(shared_memory: str) -> None:
    args = argparse.Namespace(clients=1, concurrency=4, seconds=0.5, profile=None, shared_memory=shared_memory)
    result = core_path.run(args)
    assert result["requests"] > 0 and result["req_per_s"] > 0
    assert result["shared_memory"] == (shared_memory or "none")
    assert result["core_cpu_us_per_request"] > 0
