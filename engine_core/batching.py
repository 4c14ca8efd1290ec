"""Pure helpers of ``ExecutionContext.infer_batch``: where each request's rows sit in one batch, gathering
host parts into it and splitting outputs back. Both backends share them, so padding and splitting follow
one rule: an output whose leading dim equals the batch's total rows is split by rows, any other is whole.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from engine_core.cuda.view import DeviceView
from engine_core.errors import ShapeError

#: a part's rows in the batch: [start, stop)
Span = tuple[int, int]


def row_spans(rows: Sequence[int]) -> list[Span]:
    """Consecutive [start, stop) per part, in order."""
    spans, start = [], 0
    for count in rows:
        spans.append((start, start + int(count)))
        start += int(count)
    return spans


def is_batched(shape: Sequence[int], total: int) -> bool:
    """Whether an output of ``shape`` is split by rows (its leading dim is the batch's total rows)."""
    return len(shape) > 0 and int(shape[0]) == total


def part_shape(shape: Sequence[int], span: Span, total: int) -> tuple[int, ...]:
    """The shape of one part's piece of an output of ``shape``."""
    shape = tuple(int(d) for d in shape)
    return (span[1] - span[0], *shape[1:]) if is_batched(shape, total) else shape


def gather_rows(values: Sequence[np.ndarray], total: int) -> np.ndarray:
    """The parts stacked along axis 0 into one array of ``total`` rows, rows past the parts zero."""
    first = values[0]
    out = np.empty((total, *first.shape[1:]), first.dtype)
    row = 0
    for value in values:
        out[row:row + value.shape[0]] = value
        row += value.shape[0]
    out[row:] = 0
    return out


def split_outputs(outputs: Mapping[str, Any], spans: Sequence[Span], total: int) -> list[dict[str, Any]]:
    """Per part: its rows of every batched output, every other output whole; always copies, so parts
    never share memory with each other or with ``outputs``."""
    parts: list[dict[str, Any]] = [{} for _ in spans]
    for name, value in outputs.items():
        for part, (start, stop) in zip(parts, spans):
            if not isinstance(value, np.ndarray):
                part[name] = copy.deepcopy(value)  # sequences / optionals (CPU backend): whole
            elif is_batched(value.shape, total):
                part[name] = value[start:stop].copy()
            else:
                part[name] = value.copy()
    return parts


def check_destination(name: str, index: int, view: DeviceView, shape: Sequence[int], dtype: np.dtype) -> None:
    """A destination must hold exactly part ``index``'s piece of output ``name`` (``shape``, ``dtype``)."""
    if view.dtype != np.dtype(dtype):
        raise TypeError(f"destination of output '{name}' for part {index} has dtype {view.dtype}, the output is "
                        f"{np.dtype(dtype)}")
    if int(np.prod(view.shape, dtype=np.int64)) != int(np.prod(shape, dtype=np.int64)):
        raise ShapeError(f"destination of output '{name}' for part {index} has shape {list(view.shape)}, that "
                         f"part's piece of the output has shape {list(shape)}")
