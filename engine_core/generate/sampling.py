"""How the next token is chosen from a step's logits: penalised for repeats, then greedy, or sampled with
temperature, top-k and top-p; and, when a request asks, the chosen token's log-probability and the most likely ones.

Each sequence samples from a numpy Generator of its own, seeded from ``SamplingParams.seed`` when one is given, so
a seeded request gives the same tokens however it was batched with others.

Penalties act on the logits before anything else (vLLM's order): ``repetition_penalty`` (vLLM's, over the prompt's
and the generated tokens: a positive logit divided by it, a negative one multiplied), then OpenAI's
``frequency_penalty`` and ``presence_penalty`` over the generated tokens (``logit -= count * frequency + (count > 0)
* presence``). A sampler keeps the counts as its tokens come, one slot per distinct token, so a step touches only
the tokens seen, never the whole history.

Log-probabilities are those of the model's own distribution, ``log_softmax(logits)`` before penalties, temperature,
top-k and top-p: what vLLM reports by default (its ``logprobs_mode`` ``raw_logprobs``). They cost a pass over the
vocabulary per token, so they are computed only for a request that sets ``logprobs``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

#: the most alternatives a request may ask for per token (vLLM's default max_logprobs, OpenAI's top_logprobs limit)
MAX_LOGPROBS = 20
#: the bound of OpenAI's presence_penalty and frequency_penalty
MAX_PENALTY = 2.0
_FLOAT_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings (the names vLLM and OpenAI use). Checked when made: ValueError naming the
    field."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # -2..2, over the generated tokens
    frequency_penalty: float = 0.0  # -2..2, per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # > 0, 1: off; over the prompt and the generated tokens
    logprobs: int | None = None  # None: none; N: the chosen token's and the N most likely tokens' log-probabilities

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), not {self.temperature}")
        _check_float("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p}")
        _check_int("top_k", self.top_k, minimum=0)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
        if not isinstance(self.stop_token_ids, tuple):
            raise ValueError(f"stop_token_ids must be a tuple of token ids, not {type(self.stop_token_ids).__name__}")
        for token in self.stop_token_ids:
            _check_int("stop_token_ids", token, minimum=0)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, not {self.ignore_eos!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_float(name, value)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], not {value}")
        _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1: off), not {self.repetition_penalty}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0, maximum=MAX_LOGPROBS)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits (the sampler then keeps the sequence's token counts)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> SamplingParams:
        """Parameters from a request's JSON object (Triton's ``sampling_parameters``, an OpenAI body's fields).
        ``top_k`` -1 means off, as in vLLM; ``stop_token_ids`` may be a list. ValueError naming an unknown field
        or a value of the wrong type or range."""
        if not isinstance(values, Mapping):
            raise ValueError(f"sampling parameters must be a JSON object, not {type(values).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
                             f"(supported: {', '.join(sorted(known))})")
        given = {k: v for k, v in values.items() if v is not None}  # JSON null: the default
        if given.get("top_k") == -1:
            given["top_k"] = 0
        if "stop_token_ids" in given:
            stops = given["stop_token_ids"]
            if not isinstance(stops, list | tuple):
                raise ValueError(f"stop_token_ids must be a list of token ids, not {stops!r}")
            given["stop_token_ids"] = tuple(stops)
        for name in _FLOAT_FIELDS:  # JSON's 0 and 1 are ints
            if isinstance(given.get(name), int) and not isinstance(given[name], bool):
                given[name] = float(given[name])
        return cls(**given)


def _check_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> None:
    if not isinstance(value, int | np.integer) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, not {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, not {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, not {value}")


def _check_float(name: str, value: Any) -> None:
    if not isinstance(value, float | int) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, not {value!r}")


@dataclass(frozen=True)
class TokenLogprobs:
    """A chosen token's log-probability, its rank (1: the most likely token; on a tie the lower id first) and the
    ``logprobs`` most likely tokens as (token id, log-probability), most likely first."""

    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


def token_logprobs(logits: np.ndarray, token: int, top_n: int) -> TokenLogprobs:
    """``token``'s log-probability under ``log_softmax(logits)`` and the ``top_n`` most likely tokens' (ordered by
    log-probability, then by id: the ranks are those of this order)."""
    scores = np.asarray(logits, np.float64)
    peak = scores.max()
    logprobs = scores - (peak + np.log(np.exp(scores - peak).sum()))
    n = min(top_n, logprobs.shape[0])
    if n:
        cut = -np.partition(-logprobs, n - 1)[n - 1]  # the n-th largest log-probability
        above = np.flatnonzero(logprobs > cut)
        top = np.concatenate([above, np.flatnonzero(logprobs == cut)[:n - above.size]])
        top = top[np.lexsort((top, -logprobs[top]))]
    else:
        top = np.empty(0, np.int64)
    own = logprobs[token]
    rank = 1 + int(np.count_nonzero(logprobs > own)) + int(np.count_nonzero(logprobs[:token] == own))
    return TokenLogprobs(float(own), rank, tuple((int(t), float(logprobs[t])) for t in top))


class _TokenCounts:
    """The distinct tokens a sequence has seen (prompt and generated), each with how often it was generated: a slot
    per token, so adding one is O(1) (amortized) and a step's penalties are one vectorized pass over the slots."""

    def __init__(self) -> None:
        self._slots: dict[int, int] = {}
        self._ids = np.empty(16, np.int64)
        self._counts = np.zeros(16, np.float64)

    def add(self, token: int, generated: bool) -> None:
        slot = self._slots.get(token)
        if slot is None:
            slot = len(self._slots)
            if slot == self._ids.shape[0]:
                self._ids = np.resize(self._ids, 2 * slot)
                self._counts = np.concatenate([self._counts, np.zeros(slot)])
            self._slots[token] = slot
            self._ids[slot] = token
        if generated:
            self._counts[slot] += 1

    @property
    def ids(self) -> np.ndarray:
        return self._ids[:len(self._slots)]

    @property
    def counts(self) -> np.ndarray:
        """How often each of ``ids`` was generated (0 for a token only the prompt has)."""
        return self._counts[:len(self._slots)]


class Sampler:
    """Chooses one sequence's tokens: the logits penalised for the sequence's tokens so far (when a penalty is set),
    then argmax when greedy, else a draw from the tempered, top-k and top-p filtered distribution with this
    sequence's own random generator. Each call is one step: the chosen token joins the sequence's counts."""

    def __init__(self, params: SamplingParams, prompt: Sequence[int] = ()) -> None:
        self.params = params
        self.rng = np.random.default_rng(params.seed)
        self._seen: _TokenCounts | None = _TokenCounts() if params.penalized else None
        if self._seen is not None and params.repetition_penalty != 1:  # only repetition_penalty reads the prompt
            for token in prompt:
                self._seen.add(int(token), generated=False)

    @property
    def plain_greedy(self) -> bool:
        """Whether this sequence's token is the logits' argmax and nothing else (no penalty, no logprobs): a step of
        such sequences only needs the argmax, which a device can find without sending the logits (device_argmax)."""
        params = self.params
        return params.greedy and self._seen is None and params.logprobs is None

    def __call__(self, logits: np.ndarray) -> int:
        """The next token for one row of logits [vocab]."""
        return self.choose(logits)[0]

    def choose(self, logits: np.ndarray) -> tuple[int, TokenLogprobs | None]:
        """The next token for one row of logits [vocab], with its log-probabilities when the request asks."""
        scores = self.penalize(logits) if self._seen is not None else logits
        token = self._pick(scores)
        if self._seen is not None:
            self._seen.add(token, generated=True)
        if self.params.logprobs is None:
            return token, None
        return token, token_logprobs(logits, token, self.params.logprobs)

    def penalize(self, logits: np.ndarray) -> np.ndarray:
        """A copy of ``logits`` with the penalties for the tokens seen so far applied (vLLM's order)."""
        scores = np.array(logits, np.float64)
        if self._seen is None:
            return scores
        ids, counts, params = self._seen.ids, self._seen.counts, self.params
        values = scores[ids]
        if params.repetition_penalty != 1:
            values = np.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
        values -= counts * params.frequency_penalty + (counts > 0) * params.presence_penalty
        scores[ids] = values
        return scores

    def _pick(self, logits: np.ndarray) -> int:
        if self.params.greedy:
            return int(np.argmax(logits))
        scores = np.asarray(logits, np.float64) / self.params.temperature
        k, top_p = self.params.top_k, self.params.top_p
        if 0 < k < scores.shape[0]:
            tokens = _most_likely(scores, k)
            chosen = scores[tokens]
            probs = np.exp(chosen - chosen.max())
            probs /= probs.sum()
        else:
            weights = np.exp(scores - scores.max())
            if top_p >= 1.0:
                return _draw(self.rng, weights)
            tokens, probs = _nucleus_candidates(scores, weights, top_p)
        if top_p < 1.0:
            # the fewest most likely tokens whose probabilities reach top_p (the first always stays)
            keep = int(np.searchsorted(np.cumsum(probs), top_p)) + 1
            tokens, probs = tokens[:keep], probs[:keep] / probs[:keep].sum()
        return int(tokens[_draw(self.rng, probs)])


class StepSampler:
    """Chooses the tokens of one step's rows, each with its sequence's own ``Sampler``: inline when at most one row
    needs more than an argmax, else on a few threads. Over a 128k vocabulary a sampled row costs ~1-25 ms of numpy
    (partitions, sorts, exponentials, which release the GIL), so 64 sampled rows one after another would take
    longer than the decode step itself; rows are independent (own generators), so the tokens are the same either
    way. The threads start on the first step that needs them."""

    def __init__(self, workers: int | None = None) -> None:
        self.workers = workers if workers is not None else min(8, os.cpu_count() or 1)
        self._pool: ThreadPoolExecutor | None = None

    def choose(self, samplers: Sequence[Sampler], logits: np.ndarray) -> list[tuple[int, TokenLogprobs | None]]:
        """``samplers[i].choose(logits[i])`` for every row, in row order."""
        if sum(not s.plain_greedy for s in samplers) < 2 or self.workers < 2:
            return [s.choose(row) for s, row in zip(samplers, logits)]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="kiln-sampling")
        return list(self._pool.map(Sampler.choose, samplers, logits))

    def close(self) -> None:
        """Stop the threads (idempotent; a later step starts them again)."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def _draw(rng: np.random.Generator, weights: np.ndarray) -> int:
    """An index drawn with probability proportional to ``weights``: the same draw as ``rng.choice(len(weights),
    p=weights / weights.sum())`` (its inverse-CDF steps, one uniform), without its checks of ``p``, which cost
    more than the draw over a large vocabulary."""
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    return int(np.searchsorted(cdf, rng.random(), side="right"))


#: how many candidates a top-p draw sorts, tried in turn until their mass reaches top_p (then every token): a 128k
#: vocabulary's full sort cost ~18 ms per sequence per step on the CPU, and a peaked distribution's nucleus is far
#: smaller; a flat one pays one partition more than the full sort alone
_NUCLEUS_TRIES = (256, 4096, 32768)


def _most_likely(scores: np.ndarray, count: int) -> np.ndarray:
    """The ``count`` highest-scoring token ids, highest first, ties in token order (what a stable sort of every
    token by descending score would put first)."""
    if count >= scores.shape[0]:
        return np.argsort(-scores, kind="stable")
    part = np.argpartition(scores, -count)[-count:]
    floor = scores[part].min()
    if np.count_nonzero(scores >= floor) > count:  # a tie at the boundary: the lowest ids of it belong in
        part = np.flatnonzero(scores > floor)
        part = np.concatenate([part, np.flatnonzero(scores == floor)[:count - part.shape[0]]])
    part.sort()  # token order first, so the stable sort below leaves ties in it (logits in fp16 tie often)
    return part[np.argsort(-scores[part], kind="stable")]


def _nucleus_candidates(scores: np.ndarray, weights: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """The most likely tokens, highest first, whose probabilities (``weights`` normalised over the whole
    vocabulary) reach ``top_p``, and those probabilities: sorting a few hundred candidates instead of the
    vocabulary gives the same nucleus whenever their mass reaches top_p."""
    total, vocab = weights.sum(), scores.shape[0]
    mass, smallest, taken = 0.0, 1.0, 0
    for count in (*_NUCLEUS_TRIES, vocab):
        # every token past the ones taken has at most the smallest probability among them: skip a try that
        # cannot reach top_p even so (a flat distribution goes straight to the full sort)
        if count < vocab and mass + (count - taken) * smallest < top_p:
            continue
        tokens = _most_likely(scores, count)
        probs = weights[tokens] / total
        mass, smallest, taken = float(probs.sum()), float(probs[-1]), count
        if count >= vocab or mass >= top_p:
            break
    return tokens, probs
