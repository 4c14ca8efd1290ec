"""Batched and chunked prefill below the Generator: the plan of one prefill run under its token budget, the padded
layout of a run with ragged pasts and chunks, and DecoderRunner runs on the tiny decoder (CPU engine) whose logits
and cached keys and values equal those of each prompt fed alone and whole."""

from __future__ import annotations

import numpy as np
import pytest

from engine_core.generate import DecoderRunner
from engine_core.generate.decoder import ragged_layout
from engine_core.generate.generator import plan_prefill

PROMPTS = [[1, 2, 3], [50, 60, 70, 80, 90, 100, 110], [300], list(range(100, 125))]


@pytest.mark.parametrize(("pending", "budget", "chunks"), [
    ([(0, 3), (0, 7), (0, 1), (0, 25)], 512, [3, 7, 1, 25]),  # all whole: 4 x 25 slots
    ([(0, 3), (0, 7), (0, 1), (0, 25)], 40, [3, 7, 1, 10]),  # 4 x 10 slots feed 21 tokens, 3 x 13 only 11
    ([(0, 400), (0, 3)], 512, [400]),  # the long one alone feeds more than both cut to 256
    ([(0, 3), (0, 400)], 512, [3, 256]),  # a short oldest prompt does not cut the run to its length
    ([(0, 40)], 8, [8]),
    ([(32, 8)], 8, [8]),  # the last chunk of a long prompt
    ([(0, 5), (0, 5), (0, 5)], 2, [2]),  # budget 2: 1 row of 2 or 2 rows of 1 feed as much; fewer rows win
    ([(1020, 4), (0, 30)], 512, [4, 4]),  # a past of 1020 leaves the run 4 new columns in a context of 1024
    ([], 512, []),
])
def test_a_prefill_run_feeds_the_most_tokens_its_budget_allows(pending, budget, chunks):
    assert plan_prefill(pending, budget, max_context=1024) == chunks


def test_the_padded_layout_hides_pads_from_real_tokens_and_masks_no_query_whole():
    lengths, counts, past, new = np.array([0, 10, 3]), np.array([5, 2, 1]), 16, 5
    mask, positions = ragged_layout(lengths, counts, past, new)
    assert mask.shape == (3, past + new) and positions.shape == (3, new)
    assert mask.sum(axis=1).tolist() == [5, 12, 4]
    assert mask[1, 6:18].all() and not mask[1, :6].any() and not mask[1, 18:].any()
    assert positions[:, 0].tolist() == [0, 10, 3] and positions[1, :2].tolist() == [10, 11]
    for b in range(3):  # causal: query j of row b sees columns <= past + j; a pad query still sees a real token
        for j in range(new):
            assert mask[b, :past + j + 1].any()
    assert positions.max() < past + new


def _pool(runner: DecoderRunner):
    return runner.new_pool(block_tokens=8, num_blocks=40)


def _assert_same_cache(pool, reference, seqs) -> None:
    assert [pool.length(s) for s in seqs] == [reference.length(s) for s in seqs]
    for got, want in zip(pool.gather(seqs, 32), reference.gather(seqs, 32)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_prompts_of_different_lengths_prefilled_together_match_each_alone(tiny_engine):
    runner = DecoderRunner(tiny_engine)
    alone, together = _pool(runner), _pool(runner)
    singles = np.stack([runner.prefill(alone, [i], [p])[0] for i, p in enumerate(PROMPTS)])
    np.testing.assert_allclose(runner.prefill(together, range(4), PROMPTS), singles, rtol=1e-4, atol=1e-4)
    _assert_same_cache(together, alone, range(4))


def test_a_prompt_fed_in_chunks_beside_others_matches_it_fed_whole(tiny_engine):
    """Chunks 10 + 10 + 5 of a 25-token prompt, the second run beside a fresh prompt and the third beside a
    decode-sized chunk of a third sequence: pasts and chunks of different lengths in one run."""
    runner = DecoderRunner(tiny_engine)
    whole, pool = _pool(runner), _pool(runner)
    seqs, prompts = ["long", "short", "one"], [PROMPTS[3], PROMPTS[1], PROMPTS[0] + [7]]
    expected = np.stack([runner.prefill(whole, [s], [p])[0] for s, p in zip(seqs, prompts)])
    runner.prefill(pool, ["long", "one"], [PROMPTS[3][:10], PROMPTS[0]])
    short = runner.prefill(pool, ["long", "short"], [PROMPTS[3][10:20], PROMPTS[1]])[1]
    last = runner.prefill(pool, ["long", "one"], [PROMPTS[3][20:], [7]])
    np.testing.assert_allclose(np.stack([last[0], short, last[1]]), expected, rtol=1e-4, atol=1e-4)
    _assert_same_cache(pool, whole, seqs)


def test_a_run_past_the_context_is_refused(tiny_engine):
    runner = DecoderRunner(tiny_engine)
    pool = _pool(runner)
    runner.prefill(pool, ["a"], [list(range(60))])
    used = pool.used_blocks
    with pytest.raises(ValueError, match="60 cached \\+ 5 new tokens exceed the engine's context of 64"):
        runner.prefill(pool, ["a", "b"], [[1], [1, 2, 3, 4, 5]])
    assert pool.used_blocks == used and "b" not in pool  # refused before anything was reserved
    with pytest.raises(ValueError, match="need as many chunks of at least one token"):
        runner.prefill(pool, ["a", "b"], [[1], []])
