"""The check that a captured CUDA graph's replay reproduces a layer-by-layer run (runner_graphs.outputs_match), on the
CPU: bit-identical outputs pass at memcmp speed, floats within the tolerance pass chunk by chunk, anything else
fails."""

from __future__ import annotations

import numpy as np
import pytest

from engine_core.backends.cuda import runner_graphs
from engine_core.backends.cuda.runner_graphs import outputs_match


def test_identical_outputs_match_and_other_integers_do_not():
    want = np.random.default_rng(0).standard_normal((3, 1000)).astype(np.float16)
    assert outputs_match(want, want.copy())
    assert outputs_match(np.zeros(0, np.float32), np.zeros(0, np.float32))
    ids = np.arange(10, dtype=np.int64)
    assert outputs_match(ids, ids.copy()) and not outputs_match(ids, ids[::-1].copy())


@pytest.mark.parametrize("chunk", [7, 1 << 22])
def test_floats_match_within_a_thousandth_of_the_largest_magnitude_in_every_chunk(monkeypatch, chunk):
    monkeypatch.setattr(runner_graphs, "COMPARE_CHUNK", chunk)
    want = np.linspace(-50, 50, 101, dtype=np.float32)
    near = want + np.float32(0.04)  # within 1e-3 * 50
    assert outputs_match(want, near)
    far = want.copy()
    far[3] += 0.06
    assert not outputs_match(want, far)
    with_nan = want.copy()
    with_nan[5] = np.nan
    assert outputs_match(with_nan, with_nan.copy())
    assert not outputs_match(with_nan, want) and not outputs_match(want, with_nan)
    assert not outputs_match(want, want.astype(np.float64)) and not outputs_match(want, want[:50])
