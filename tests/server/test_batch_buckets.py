"""CUDA models that batch run at bucketed batch sizes (powers of two and the profile's largest batch): the
engine gathers the jobs and zero-pads them to the bucket, and each job gets its own rows back."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from server.core.execution import batch_buckets, bucket_for, execute_bucketed, execute_parts


class _Context:
    """Records what the engine is asked to run; computes y = 2x per row and a non-batched output."""

    def __init__(self, max_batch: int) -> None:
        plan = SimpleNamespace(profiles=[{"x": ((1, 4), (8, 4), (max_batch, 4))}])
        self.engine = SimpleNamespace(backend="cuda", plan=plan, num_optimization_profiles=1)
        self.seen: list[tuple[list[int], int | None]] = []

    def infer_batch(self, parts, pad_to=None, destinations=None):
        self.seen.append(([p["x"].shape[0] for p in parts], pad_to))
        return [{"y": p["x"] * 2, "total": np.array(pad_to or sum(q["x"].shape[0] for q in parts))} for p in parts]


def test_buckets_are_powers_of_two_their_midpoints_and_the_largest_batch():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 3, 4, 6, 8]
    assert batch_buckets(100) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 100]
    assert batch_buckets(128)[-4:] == [48, 64, 96, 128]
    assert [bucket_for(b, 100) for b in (1, 3, 5, 64, 65, 97, 100)] == [1, 3, 6, 64, 96, 100, 100]
    for highest in (2, 7, 64, 1000):  # never more than a third of a batch is padding
        assert all(bucket_for(b, highest) <= max(b * 3 // 2, b + 1) for b in range(1, highest + 1))


def test_a_job_is_padded_to_its_bucket_by_the_engine():
    context = _Context(max_batch=16)
    x = np.arange(28, dtype=np.float32).reshape(7, 4)
    out = execute_bucketed(context, {"x": x})
    assert context.seen == [([7], 8)]
    np.testing.assert_array_equal(out["y"], x * 2)
    assert out["total"] == 8  # a non-batched output is left as it is


def test_buckets_never_exceed_the_profile_and_exact_sizes_are_not_padded():
    context = _Context(max_batch=6)
    for batch in (4, 5):
        execute_bucketed(context, {"x": np.ones((batch, 4), np.float32)})
    assert context.seen == [([4], None), ([5], 6)]  # 4 is a bucket; 5 pads to the profile's 6, not to 8


def test_jobs_of_a_batch_are_gathered_together():
    context = _Context(max_batch=16)
    parts = [{"x": np.full((n, 4), n, np.float32)} for n in (1, 2, 2, 2)]
    outs = execute_parts(context, parts, bucketed=True)
    assert context.seen == [([1, 2, 2, 2], 8)]
    for part, out in zip(parts, outs):
        np.testing.assert_array_equal(out["y"], part["x"] * 2)
