"""How the next token is chosen from a step's logits: greedy, or sampled with temperature, top-k and top-p.

Each sequence samples from a numpy Generator of its own, seeded from ``SamplingParams.seed`` when one is given, so
a seeded request gives the same tokens however it was batched with others.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import numpy as np


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

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
        for name in ("temperature", "top_p"):  # JSON's 0 and 1 are ints
            if isinstance(given.get(name), int) and not isinstance(given[name], bool):
                given[name] = float(given[name])
        return cls(**given)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int | np.integer) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, not {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, not {value}")


def _check_float(name: str, value: Any) -> None:
    if not isinstance(value, float | int) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, not {value!r}")


class Sampler:
    """Chooses one sequence's tokens: argmax when greedy, else a draw from the tempered, top-k and top-p filtered
    distribution with this sequence's own random generator."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        """The next token for one row of logits [vocab]."""
        if self.params.greedy:
            return int(np.argmax(logits))
        scores = np.asarray(logits, np.float64) / self.params.temperature
        tokens = np.arange(scores.shape[0])
        k = self.params.top_k
        if 0 < k < scores.shape[0]:
            tokens = np.argpartition(scores, -k)[-k:]
        if self.params.top_p < 1.0:  # sorting only when top_p needs the order (a large vocabulary costs)
            tokens = tokens[np.argsort(-scores[tokens], kind="stable")]
        chosen = scores[tokens]
        probs = np.exp(chosen - chosen.max())
        probs /= probs.sum()
        if self.params.top_p < 1.0:
            # the fewest most likely tokens whose probabilities reach top_p (the first always stays)
            keep = int(np.searchsorted(np.cumsum(probs), self.params.top_p)) + 1
            tokens, probs = tokens[:keep], probs[:keep] / probs[:keep].sum()
        return int(tokens[self.rng.choice(len(tokens), p=probs)])
