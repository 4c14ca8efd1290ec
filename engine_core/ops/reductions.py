"""Reductions (ReduceSum/Mean/Max/..., ArgMax/ArgMin, CumSum/CumProd)."""

from __future__ import annotations
