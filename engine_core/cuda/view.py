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
        # normalised only where needed: a server makes several views per request (fields given as int, a tuple of
        # ints and an np.dtype, the common case, cost no conversions)
        if type(self.ptr) is not int:
            object.__setattr__(self, "ptr", int(self.ptr))
        shape = self.shape
        if type(shape) is not tuple or any(type(d) is not int for d in shape):
            shape = tuple(int(d) for d in shape)
            object.__setattr__(self, "shape", shape)
        if not isinstance(self.dtype, np.dtype):
            object.__setattr__(self, "dtype", np.dtype(self.dtype))
        if shape and min(shape) < 0:
            raise ValueError(f"DeviceView shape {list(shape)} has a negative dim")
        if self.ptr == 0 and self.nbytes:
            raise ValueError("DeviceView of a null pointer")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True, eq=False)
class DeviceRows:
    """One tensor of a batch whose parts each hold their rows at their own device address: part ``i``'s
    ``rows[i]`` rows (each of ``row_shape`` and ``dtype``, row-major) at ``addresses[i]``, in part order.

    Why: a batch of many requests in shared memory is two arrays here instead of a ``DeviceView`` per request, so
    gathering its rows into the engine's input buffer (or delivering each request's output rows) costs a few numpy
    operations, not Python work per request (``ExecutionContext.infer_rows``). The caller keeps the memory alive
    and written until the run is done, as for a ``DeviceView``."""

    addresses: np.ndarray
    rows: np.ndarray
    row_shape: tuple[int, ...]
    dtype: np.dtype

    def __post_init__(self) -> None:
        addresses = np.ascontiguousarray(self.addresses, dtype=np.uint64).reshape(-1)
        rows = np.ascontiguousarray(self.rows, dtype=np.int64).reshape(-1)
        object.__setattr__(self, "addresses", addresses)
        object.__setattr__(self, "rows", rows)
        object.__setattr__(self, "row_shape", tuple(int(d) for d in self.row_shape))
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        if len(addresses) != len(rows):
            raise ValueError(f"DeviceRows has {len(addresses)} addresses for {len(rows)} parts")
        if np.any(rows < 0) or any(d < 0 for d in self.row_shape):
            raise ValueError("DeviceRows with a negative row count or dim")
        if self.row_bytes and np.any((addresses == 0) & (rows > 0)):
            raise ValueError("DeviceRows with a null address")

    @property
    def shape(self) -> tuple[int, ...]:
        """The batch's shape: every part's rows, stacked."""
        return (int(self.rows.sum()), *self.row_shape)

    @property
    def row_bytes(self) -> int:
        return math.prod(self.row_shape) * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.row_bytes

    def gather_copies(self, base: int) -> np.ndarray:
        """(dst, src, nbytes) rows that copy every part's rows, in order, to consecutive rows from ``base``."""
        sizes = self.rows.astype(np.uint64) * np.uint64(self.row_bytes)
        starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.uint64) + np.uint64(base)
        return np.stack([starts, self.addresses, sizes], axis=1)

    def scatter_copies(self, base: int) -> np.ndarray:
        """(dst, src, nbytes) rows that copy consecutive rows from ``base`` to every part's address, in order."""
        gathered = self.gather_copies(base)
        return gathered[:, [1, 0, 2]]
