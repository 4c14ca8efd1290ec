"""Activation functions (Relu family, Gelu, Sigmoid, Softplus, ...)."""

from __future__ import annotations
