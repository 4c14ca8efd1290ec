"""load_tests/generate_bench.py's figures on synthetic streams: tokens/s in the window counts every request's tokens
that arrived there (a steady closed loop reads its true rate), where the finished-requests figure reads low."""

from __future__ import annotations

import pytest

from load_tests.generate_bench import Load, StreamRecord, summarize, window_tokens

MS = 1_000_000


def _record(start_ms: int, tokens: int, gap_ms: int, ttft_ms: int = 5) -> StreamRecord:
    first = (start_ms + ttft_ms) * MS
    return StreamRecord(start=start_ms * MS, first=first, end=first + (tokens - 1) * gap_ms * MS,
                        gaps_ns=[gap_ms * MS] * (tokens - 1), completion_tokens=tokens)


def test_window_tokens_counts_the_chunks_that_arrived_inside_weighted_per_token():
    record = _record(0, 10, 10)  # chunks at 5, 15, ..., 95 ms
    assert window_tokens(record, 0, 100 * MS) == 10
    assert window_tokens(record, 20 * MS, 60 * MS) == 4  # 25, 35, 45, 55
    doubled = StreamRecord(**{**record.__dict__, "completion_tokens": 20})  # two tokens a chunk
    assert window_tokens(doubled, 20 * MS, 60 * MS) == 8
    assert window_tokens(StreamRecord(start=0, error="HTTP 500"), 0, 10**12) == 0


def test_a_steady_closed_loop_reads_its_rate_where_finished_requests_read_low():
    streams, tokens, gap_ms, ttft_ms = 4, 100, 10, 5  # each request ~1 s: 100 tokens a second a stream
    records = []
    for stream in range(streams):
        at = stream * 250  # staggered, as a running closed loop is
        while at < 12_000:
            records.append(_record(at, tokens, gap_ms, ttft_ms))
            at += ttft_ms + (tokens - 1) * gap_ms
    load = Load(url="", model="m", api="completions", max_tokens=tokens, ignore_eos=True, prompt="p", streams=streams,
                warmup_s=2.0, duration_s=8.0)
    row = summarize(records, 2000 * MS, load)
    true_rate = streams * tokens / ((ttft_ms + (tokens - 1) * gap_ms) / 1000)
    assert row["output_tokens_per_s"] == pytest.approx(true_rate, rel=0.02)
    assert row["finished_tokens_per_s"] < 0.95 * true_rate
