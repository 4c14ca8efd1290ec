"""Image / detection ops (Resize, GridSample, AffineGrid, RoiAlign, NonMaxSuppression, ...)."""

from __future__ import annotations
