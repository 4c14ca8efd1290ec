"""Attention family (Attention, RotaryEmbedding, LinearAttention, FlexAttention, ...)."""

from __future__ import annotations
