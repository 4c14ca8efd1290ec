"""CUDA models that batch run at power-of-two batch sizes: the inputs are zero-padded, the outputs cut back."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from server.core.model import _execute_bucketed


class _Context:
    def __init__(self, max_batch: int) -> None:
        plan = SimpleNamespace(profiles=[{"x": ((1, 4), (8, 4), (max_batch, 4))}])
        self.engine = SimpleNamespace(backend="cpu", plan=plan, num_optimization_profiles=1)
        self.seen: list[tuple[int, ...]] = []

    def infer(self, inputs):
        self.seen.append(inputs["x"].shape)
        return {"y": inputs["x"] * 2, "total": np.array(inputs["x"].shape[0])}


def test_batches_are_padded_to_the_next_power_of_two_and_cut_back():
    context = _Context(max_batch=16)
    x = np.arange(20, dtype=np.float32).reshape(5, 4)
    out = _execute_bucketed(context, {"x": x})
    assert context.seen == [(8, 4)]
    np.testing.assert_array_equal(out["y"], x * 2)  # padded rows are gone
    assert out["total"] == 8  # a non-batched output is left as it is


def test_sizes_that_are_buckets_or_above_the_profile_run_as_they_are():
    context = _Context(max_batch=6)
    for batch in (4, 5):
        _execute_bucketed(context, {"x": np.ones((batch, 4), np.float32)})
    assert context.seen == [(4, 4), (5, 4)]  # 4 is a bucket; 8 would exceed the profile's 6
