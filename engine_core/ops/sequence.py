"""Sequence and Optional ops (SequenceConstruct/At/Insert/..., SplitToSequence, Optional*)."""

from __future__ import annotations
