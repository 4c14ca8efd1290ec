"""server/core/heap.py: request-sized buffers kept in malloc's heap (glibc), unless the user said otherwise."""

from __future__ import annotations

import ctypes
import platform
import resource

import numpy as np
import pytest

from server.core import heap

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt thresholds are glibc's")


@glibc
def test_large_buffers_stop_faulting_in_fresh_pages_once_tuned() -> None:
    """A few 1 MB buffers in flight, then all freed, round after round (requests of a 600 KB tensor through a
    frontend): untuned, glibc gives the freed heap top back and every round faults its pages in again (~1,000 faults a
    round); tuned, the heap keeps them."""
    def faults_for(rounds: int) -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(rounds):
            buffers = [np.ones(1 << 18, np.float32) for _ in range(4)]  # written: every page touched
            del buffers
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    assert heap.keep_large_buffers_in_heap()
    faults_for(4)  # the heap grows once
    assert faults_for(50) < 50 * 100  # untuned: ~50 x 1,000


def test_the_user_s_choice_wins(monkeypatch) -> None:
    monkeypatch.setenv("KILN_MALLOC_TUNING", "0")
    assert not heap.keep_large_buffers_in_heap()
    monkeypatch.setenv("KILN_MALLOC_TUNING", "1")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=131072")
    assert not heap.keep_large_buffers_in_heap()


def test_a_c_library_without_mallopt_is_left_alone(monkeypatch) -> None:
    class NoMallopt:
        def __init__(self, name) -> None:
            pass

    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setattr(ctypes, "CDLL", NoMallopt)
    assert not heap.keep_large_buffers_in_heap()
