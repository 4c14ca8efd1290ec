"""SamplingParams (checked fields, from a request's JSON) and the Sampler (greedy, temperature, top-k, top-p, seeds,
penalties and log-probabilities against a numpy reference)."""

from __future__ import annotations

import numpy as np
import pytest

from engine_core.generate import Sampler, SamplingParams
from engine_core.generate.sampling import StepSampler, TokenLogprobs, token_logprobs


def test_from_mapping_reads_request_json():
    params = SamplingParams.from_mapping({"max_tokens": 8, "temperature": 0, "top_p": 1, "top_k": -1, "seed": 3,
                                          "stop_token_ids": [5, 6], "ignore_eos": True})
    assert params == SamplingParams(max_tokens=8, temperature=0.0, top_p=1.0, top_k=0, seed=3,
                                    stop_token_ids=(5, 6), ignore_eos=True)
    assert params.greedy and isinstance(params.temperature, float)
    assert SamplingParams.from_mapping({}) == SamplingParams()
    assert SamplingParams.from_mapping({"temperature": None, "seed": None}) == SamplingParams()  # null: the default


@pytest.mark.parametrize("values, message", [
    ({"max_tokens": 4, "best_of": 2, "n": 1}, r"unknown sampling parameters best_of, n \(supported: frequency_penalty, ignore_eos,"),
    ({"max_tokens": 0}, "max_tokens must be >= 1, not 0"),
    ({"max_tokens": 2.5}, "max_tokens must be an integer, not 2.5"),
    ({"max_tokens": "16"}, "max_tokens must be an integer, not '16'"),
    ({"max_tokens": True}, "max_tokens must be an integer, not True"),
    ({"temperature": -0.5}, r"temperature must be >= 0 \(0: greedy\), not -0.5"),
    ({"temperature": "hot"}, "temperature must be a finite number"),
    ({"temperature": float("nan")}, "temperature must be a finite number"),
    ({"top_p": 0}, r"top_p must be in \(0, 1\], not 0.0"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\], not 1.5"),
    ({"top_k": -2}, "top_k must be >= 0, not -2"),
    ({"seed": -1}, "seed must be >= 0"),
    ({"stop_token_ids": 7}, "stop_token_ids must be a list of token ids, not 7"),
    ({"stop_token_ids": [1, "x"]}, "stop_token_ids must be an integer, not 'x'"),
    ({"ignore_eos": "yes"}, "ignore_eos must be true or false, not 'yes'"),
    ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\], not 2.5"),
    ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\], not -3.0"),
    ({"frequency_penalty": "lots"}, "frequency_penalty must be a finite number"),
    ({"repetition_penalty": 0}, r"repetition_penalty must be > 0 \(1: off\), not 0.0"),
    ({"logprobs": 21}, "logprobs must be <= 20, not 21"),
    ({"logprobs": -1}, "logprobs must be >= 0, not -1"),
    ({"logprobs": True}, "logprobs must be an integer, not True"),
])
def test_bad_fields_are_named(values, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams.from_mapping(values)


def test_from_mapping_wants_an_object():
    with pytest.raises(ValueError, match="must be a JSON object, not list"):
        SamplingParams.from_mapping([("max_tokens", 3)])  # type: ignore[arg-type]


def _logits(seed: int = 0, vocab: int = 300) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(vocab).astype(np.float32)


def test_greedy_is_argmax_and_top_k_1_is_greedy_at_any_temperature():
    logits = _logits()
    assert Sampler(SamplingParams(temperature=0))(logits) == int(np.argmax(logits))
    assert {Sampler(SamplingParams(temperature=5.0, top_k=1, seed=s))(logits) for s in range(10)} == {
        int(np.argmax(logits))}
    assert {Sampler(SamplingParams(temperature=5.0, top_p=1e-6, seed=s))(logits) for s in range(10)} == {
        int(np.argmax(logits))}


def test_a_seed_reproduces_its_draws_and_another_seed_does_not():
    logits = _logits()

    def draws(seed: int | None) -> list[int]:
        sampler = Sampler(SamplingParams(temperature=2.0, seed=seed))
        return [sampler(logits) for _ in range(20)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    assert len(set(draws(7))) > 5  # a hot temperature spreads the draws


def test_top_k_and_top_p_keep_only_the_likely_tokens():
    logits = _logits()
    top5 = set(np.argsort(-logits)[:5].tolist())
    sampler = Sampler(SamplingParams(temperature=10.0, top_k=5, seed=0))
    drawn = {sampler(logits) for _ in range(200)}
    assert drawn <= top5 and len(drawn) == 5
    # three tokens of 0.5, 0.3, 0.2 and the rest far below: top_p 0.75 keeps the first two only
    peaked = np.full(50, -30.0)
    peaked[[3, 9, 20]] = np.log([0.5, 0.3, 0.2])
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.75, seed=0))
    counts = np.bincount([sampler(peaked) for _ in range(2000)], minlength=50)
    assert set(np.flatnonzero(counts)) == {3, 9}
    assert counts[3] / 2000 == pytest.approx(0.5 / 0.8, abs=0.05)


def test_temperature_one_samples_the_softmax():
    logits = np.log(np.array([0.25, 0.75]))
    sampler = Sampler(SamplingParams(temperature=1.0, seed=1))
    share = np.mean([sampler(logits) for _ in range(4000)])
    assert share == pytest.approx(0.75, abs=0.03)


def reference_nucleus_draw(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> int:
    """The nucleus draw by its definition: every token sorted by descending score (ties in token order), the
    fewest whose probabilities reach top_p, one draw from them renormalised (top_p 1: every token, unsorted)."""
    scores = np.asarray(logits, np.float64) / temperature
    tokens = np.argsort(-scores, kind="stable") if top_p < 1.0 else np.arange(scores.shape[0])
    probs = np.exp(scores[tokens] - scores.max())
    probs /= probs.sum()
    if top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), top_p)) + 1
        tokens, probs = tokens[:keep], probs[:keep] / probs[:keep].sum()
    return int(tokens[rng.choice(len(tokens), p=probs)])


@pytest.mark.parametrize("scale", [0.5, 3.0, 8.0], ids=["flat", "spread", "peaked"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_top_p_draws_as_the_full_sort_does(scale, dtype):
    """The nucleus comes from a few hundred candidates where their mass suffices, else from the full sort: the
    same tokens, draw for draw, as sorting the whole vocabulary (fp16 logits tie often)."""
    rng = np.random.default_rng(7)
    for temperature, top_p in [(1.0, 0.95), (0.7, 0.5), (1.3, 1.0)]:
        sampler = Sampler(SamplingParams(temperature=temperature, top_p=top_p, seed=3))
        reference = np.random.default_rng(3)
        for _ in range(40):
            logits = (rng.standard_normal(32000) * scale).astype(dtype)
            assert sampler(logits) == reference_nucleus_draw(logits, temperature, top_p, reference)


def test_a_step_sampled_on_threads_gives_each_row_its_serial_tokens():
    """StepSampler runs rows on threads when several need more than an argmax: each row's seeded tokens, penalties
    and logprobs are those its sampler gives alone."""
    rng = np.random.default_rng(5)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=1), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.2, top_k=20, seed=2, logprobs=3),
              SamplingParams(temperature=0.0, presence_penalty=1.0), SamplingParams(temperature=1.0, seed=4)]
    threaded, serial = [Sampler(p, [1, 2, 3]) for p in params], [Sampler(p, [1, 2, 3]) for p in params]
    step = StepSampler(workers=4)
    try:
        for _ in range(20):
            logits = (rng.standard_normal((len(params), 5000)) * 3).astype(np.float32)
            assert step.choose(threaded, logits) == [s.choose(row) for s, row in zip(serial, logits)]
    finally:
        step.close()


# -- penalties and log-probabilities ------------------------------------------------------------------------------
def reference_penalized(logits: np.ndarray, prompt: list[int], generated: list[int], params: SamplingParams
                         ) -> np.ndarray:
    """vLLM's penalties recomputed from the whole history: repetition over prompt and generated tokens, then
    OpenAI's frequency and presence over the generated ones."""
    scores = logits.astype(np.float64)
    for token in set(prompt) | set(generated):
        value = scores[token]
        scores[token] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
    counts = np.bincount(np.array(generated, np.int64), minlength=scores.shape[0])
    return scores - counts * params.frequency_penalty - (counts > 0) * params.presence_penalty


def log_softmax(logits: np.ndarray) -> np.ndarray:
    scores = logits.astype(np.float64)
    return scores - scores.max() - np.log(np.exp(scores - scores.max()).sum())


def test_from_mapping_reads_penalties_and_logprobs():
    params = SamplingParams.from_mapping({"presence_penalty": 1, "frequency_penalty": -0.5, "repetition_penalty": 2,
                                          "logprobs": 3})
    assert params == SamplingParams(presence_penalty=1.0, frequency_penalty=-0.5, repetition_penalty=2.0, logprobs=3)
    assert isinstance(params.presence_penalty, float) and params.penalized
    assert not SamplingParams(logprobs=0).penalized and SamplingParams.from_mapping({"logprobs": None}).logprobs is None


@pytest.mark.parametrize("penalties", [
    {"presence_penalty": 0.7}, {"frequency_penalty": 0.4}, {"repetition_penalty": 1.8}, {"repetition_penalty": 0.6},
    {"presence_penalty": -1.0, "frequency_penalty": 1.5, "repetition_penalty": 1.3},
], ids=["presence", "frequency", "repetition", "repetition_below_1", "all"])
def test_penalties_follow_the_reference_step_by_step(penalties):
    params = SamplingParams(temperature=0, **penalties)
    prompt = [3, 3, 17, 40, 75]
    sampler = Sampler(params, prompt)
    generated: list[int] = []
    for step in range(60):  # more distinct tokens than the first slots hold: the counts grow
        logits = _logits(step, vocab=80) * 3
        expected = reference_penalized(logits, prompt, generated, params)
        np.testing.assert_allclose(sampler.penalize(logits), expected, rtol=1e-12)
        token = sampler(logits)
        assert token == int(np.argmax(expected))  # greedy picks from the penalised logits
        generated.append(token)
    assert len(set(generated)) > 16


def test_penalties_change_greedy_choices_as_their_formulas_say():
    logits = np.array([2.0, 1.9, -1.0, -1.1, 0.5], np.float32)
    presence = Sampler(SamplingParams(temperature=0, presence_penalty=0.2))
    assert [presence(logits) for _ in range(3)] == [0, 1, 0]  # 2.0 - 0.2 < 1.9; then 1.9 - 0.2 < 1.8
    frequency = Sampler(SamplingParams(temperature=0, frequency_penalty=0.06))
    assert [frequency(logits) for _ in range(4)] == [0, 0, 1, 0]  # 2.0 - 2 * 0.06 < 1.9 after two
    repeated = Sampler(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=[0, 3])
    assert repeated(logits) == 1  # 2.0 / 2 < 1.9
    scores = repeated.penalize(logits)
    assert scores[3] == pytest.approx(-2.2) and scores[2] == pytest.approx(-1.0)  # negative: multiplied
    assert Sampler(SamplingParams(temperature=0, presence_penalty=0.2), prompt=[0])(logits) == 0  # not the prompt


def test_unpenalized_sampling_keeps_no_history_and_leaves_the_logits():
    sampler = Sampler(SamplingParams(temperature=0), prompt=[1, 2])
    logits = _logits()
    assert sampler._seen is None and sampler.choose(logits) == (int(np.argmax(logits)), None)


def test_logprobs_are_thelog_softmax_of_the_raw_logits_with_the_top_n_in_order():
    logits = _logits(3)
    params = SamplingParams(temperature=0, logprobs=5, presence_penalty=2.0)
    sampler = Sampler(params)
    reference = log_softmax(logits)
    order = np.argsort(-reference, kind="stable")
    token, first = sampler.choose(logits)
    assert token == order[0] and first is not None
    assert first.logprob == pytest.approx(reference[token], abs=1e-9) and first.rank == 1
    assert [t for t, _ in first.top] == order[:5].tolist()
    np.testing.assert_allclose([v for _, v in first.top], reference[order[:5]], atol=1e-9)
    token, second = sampler.choose(logits)  # the penalty moved the choice, not the reported distribution
    assert token == order[1] and second is not None
    assert second.rank == 2 and second.top == first.top
    assert second.logprob == pytest.approx(reference[order[1]], abs=1e-9)


def test_token_logprobs_ranks_ties_and_edges():
    logits = np.array([1.0, 3.0, 3.0, 0.0, 3.0], np.float32)
    tied = token_logprobs(logits, 4, 2)
    assert [t for t, _ in tied.top] == [1, 2] and tied.rank == 3  # ties in id order; the chosen one after them
    assert token_logprobs(logits, 0, 0) == TokenLogprobs(pytest.approx(log_softmax(logits)[0]), 4, ())
    whole = token_logprobs(logits, 3, 20)  # more asked than the vocabulary has
    assert [t for t, _ in whole.top] == [1, 2, 4, 0, 3] and whole.rank == 5
    assert np.exp([v for _, v in whole.top]).sum() == pytest.approx(1.0)


def test_sampled_tokens_get_their_own_logprobs():
    logits = _logits(5)
    sampler = Sampler(SamplingParams(temperature=2.0, seed=4, logprobs=0))
    reference = log_softmax(logits)
    for _ in range(20):
        token, logprobs = sampler.choose(logits)
        assert logprobs is not None and logprobs.top == ()
        assert logprobs.logprob == pytest.approx(reference[token], abs=1e-9)
        assert logprobs.rank == 1 + int(np.count_nonzero(reference > reference[token]))
