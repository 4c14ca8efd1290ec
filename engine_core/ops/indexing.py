"""Indexing ops (Gather*, Scatter*, TopK, NonZero, Unique, Compress, OneHot, ...)."""

from __future__ import annotations
