"""Elementwise arithmetic and activations."""

from __future__ import annotations

import numpy as np

from engine_core.ops.registry import broadcast_infer, register_op, same_as_input


def _binary(op_type: str, fn) -> None:
    register_op(op_type, infer=broadcast_infer(), cpu=lambda node, a, b: fn(a, b).astype(a.dtype, copy=False))


_binary("Add", np.add)
_binary("Sub", np.subtract)
_binary("Mul", np.multiply)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """ONNX Div: true division for floats, truncation toward zero for integers."""
    if np.issubdtype(a.dtype, np.integer):
        return np.trunc(np.divide(a, b)).astype(a.dtype)
    return np.divide(a, b)


_binary("Div", _div)

register_op("Relu", infer=same_as_input(), cpu=lambda node, x: np.maximum(x, np.zeros((), x.dtype)))
