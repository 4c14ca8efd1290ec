"""Comparison, logical and bitwise ops (Equal, Less, And, Not, BitShift, Where, ...)."""

from __future__ import annotations
