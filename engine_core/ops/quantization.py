"""Quantization ops (QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear, *Integer, QLinear*)."""

from __future__ import annotations
