"""Random ops (RandomNormal/Uniform(+Like), Bernoulli, Multinomial) with seeds."""

from __future__ import annotations
