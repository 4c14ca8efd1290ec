"""Pooling (Max/Average/Lp, global variants, MaxUnpool)."""

from __future__ import annotations
