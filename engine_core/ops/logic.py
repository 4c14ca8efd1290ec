"""Comparisons, boolean logic, Where, and bitwise ops.

Comparisons broadcast and return bool. Narrow floats compare in float32 (exact: widening keeps every
value). String tensors (object arrays of str or bytes, Equal since opset 19) compare as text.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from engine_core.ir import Node
from engine_core.ops.elementwise import NARROW_FLOATS, is_integer
from engine_core.ops.registry import ShapeInferenceError, TensorInfo, broadcast_infer, register_op, same_as_input

Binary = Callable[[np.ndarray, np.ndarray], np.ndarray]


def _comparable(x: np.ndarray) -> np.ndarray:
    """A view of ``x`` numpy compares correctly: narrow floats as float32, bytes as str."""
    if x.dtype in NARROW_FLOATS:
        return x.astype(np.float32)
    if x.dtype.kind in "OS" and x.size and isinstance(x.reshape(-1)[0], bytes):
        return np.char.decode(x.astype(np.bytes_), "utf-8").astype(object)
    return x


def _compare_cpu(fn: Binary) -> Callable[..., np.ndarray]:
    def cpu(node: Node, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.asarray(fn(_comparable(a), _comparable(b)), dtype=np.bool_)

    return cpu


_COMPARISONS: dict[str, Binary] = {
    "Equal": np.equal,
    "Greater": np.greater,
    "Less": np.less,
    "GreaterOrEqual": np.greater_equal,
    "LessOrEqual": np.less_equal,
}
for _name, _fn in _COMPARISONS.items():
    register_op(_name, infer=broadcast_infer(np.dtype(np.bool_)), cpu=_compare_cpu(_fn),
                min_opset=12 if _name.endswith("OrEqual") else 1)

for _name, _fn in (("And", np.logical_and), ("Or", np.logical_or), ("Xor", np.logical_xor)):
    register_op(_name, infer=broadcast_infer(np.dtype(np.bool_)),
                cpu=lambda node, a, b, fn=_fn: fn(a, b))
register_op("Not", infer=same_as_input(), cpu=lambda node, x: np.logical_not(x))


def _where_infer(node: Node, cond: TensorInfo, x: TensorInfo, y: TensorInfo) -> TensorInfo:
    """Broadcast over all three inputs; the dtype is X's (X and Y share it)."""
    info = broadcast_infer()(node, cond, x, y)
    return TensorInfo(x.dtype, info.shape)


register_op("Where", infer=_where_infer, min_opset=9,
            cpu=lambda node, cond, x, y: np.where(cond.astype(np.bool_, copy=False), x, y).astype(x.dtype, copy=False))


# -- bitwise -------------------------------------------------------------------------------------------


def _integer_infer(node: Node, *inputs: TensorInfo) -> TensorInfo:
    """Bitwise ops take integer tensors of one dtype and broadcast them."""
    if any(not is_integer(i.dtype) for i in inputs):
        raise ShapeInferenceError(f"{node.op_type} needs integer inputs, got {[str(i.dtype) for i in inputs]}")
    return broadcast_infer()(node, *inputs)


def _bitshift_cpu(node: Node, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Shifts by a negative amount or by the bit width or more give what sign extension alone
    produces (-1 for a negative X shifted right, else 0) instead of C's undefined behaviour; a
    signed right shift is arithmetic (opset 28 defines both)."""
    direction = node.attr("direction", "")
    if direction not in ("LEFT", "RIGHT"):
        raise ShapeInferenceError(f"BitShift direction must be LEFT or RIGHT, got {direction!r}")
    bits = x.dtype.itemsize * 8
    amount = y.astype(np.int64)
    in_range = (amount >= 0) & (amount < bits)
    safe = np.where(in_range, amount, 0).astype(x.dtype)
    if direction == "LEFT":
        shifted, fill = np.left_shift(x, safe), np.zeros((), x.dtype)
    else:
        shifted = np.right_shift(x, safe)
        fill = np.where(x < 0, -1, 0).astype(x.dtype)  # never -1 for unsigned X
    return np.where(in_range, shifted, fill).astype(x.dtype, copy=False)


register_op("BitShift", infer=_integer_infer, cpu=_bitshift_cpu, min_opset=11)
for _name, _fn in (("BitwiseAnd", np.bitwise_and), ("BitwiseOr", np.bitwise_or), ("BitwiseXor", np.bitwise_xor)):
    register_op(_name, infer=_integer_infer, cpu=lambda node, a, b, fn=_fn: fn(a, b).astype(a.dtype, copy=False),
                min_opset=18)
register_op("BitwiseNot", infer=_integer_infer, cpu=lambda node, x: np.invert(x), min_opset=18)
