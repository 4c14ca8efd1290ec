"""Normalizations (Batch/Instance/Layer/Group/RMS/LRN, MeanVarianceNormalization, LpNormalization)."""

from __future__ import annotations
