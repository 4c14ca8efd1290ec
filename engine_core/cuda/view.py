"""DeviceView: a tensor in device memory that the caller owns, passed to the engine by address.

Pure data (no driver calls), so CPU-only code can name and validate it; only the CUDA backend reads or
writes through one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DeviceView:
    """``shape`` elements of ``dtype`` in row-major order at device address ``ptr`` (the primary context's
    address space). Whoever made it keeps the memory alive and has finished writing it (its stream
    synchronized) before handing it to the engine; the engine never frees it."""

    ptr: int
    shape: tuple[int, ...]
    dtype: np.dtype

    def __post_init__(self) -> None:
        object.__setattr__(self, "ptr", int(self.ptr))
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        if any(d < 0 for d in self.shape):
            raise ValueError(f"DeviceView shape {list(self.shape)} has a negative dim")
        if self.ptr == 0 and self.nbytes:
            raise ValueError("DeviceView of a null pointer")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize
