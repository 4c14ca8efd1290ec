"""SamplingParams (checked fields, from a request's JSON) and the Sampler (greedy, temperature, top-k, top-p, seeds)."""

from __future__ import annotations

import numpy as np
import pytest

from engine_core.generate import Sampler, SamplingParams


def test_from_mapping_reads_request_json():
    params = SamplingParams.from_mapping({"max_tokens": 8, "temperature": 0, "top_p": 1, "top_k": -1, "seed": 3,
                                          "stop_token_ids": [5, 6], "ignore_eos": True})
    assert params == SamplingParams(max_tokens=8, temperature=0.0, top_p=1.0, top_k=0, seed=3,
                                    stop_token_ids=(5, 6), ignore_eos=True)
    assert params.greedy and isinstance(params.temperature, float)
    assert SamplingParams.from_mapping({}) == SamplingParams()
    assert SamplingParams.from_mapping({"temperature": None, "seed": None}) == SamplingParams()  # null: the default


@pytest.mark.parametrize("values, message", [
    ({"max_tokens": 4, "best_of": 2, "n": 1}, r"unknown sampling parameters best_of, n \(supported: ignore_eos,"),
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
