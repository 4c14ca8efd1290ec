"""Type conversion (Cast, CastLike, BitCast) incl. float8/int4/int2/float4/bfloat16 and strings.

The exotic element types come from ml_dtypes (see ``engine_core.types.onnx_to_np``); numpy's
``astype`` between them rounds to nearest-even like the ONNX spec asks. What ``astype`` does not
do is kept here: float8 saturation, the float8e8m0 exponent-only format with its rounding modes,
and strings (stored as object arrays) in both directions.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from engine_core.ir import Node
from engine_core.ops.registry import ShapeInferenceError, TensorInfo, register_op
from engine_core.types import onnx_to_np

#: float8 formats whose ``saturate`` attribute clamps out-of-range values to the largest finite one.
SATURATING_FLOAT8 = frozenset(
    np.dtype(t)
    for t in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2, ml_dtypes.float8_e5m2fnuz)
)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)


def is_string(dtype: np.dtype) -> bool:
    return np.dtype(dtype).kind in "OSU"


def _as_text(x: np.ndarray) -> np.ndarray:
    """A string tensor (object array of str or bytes) as a numpy unicode array."""
    if x.size and isinstance(x.reshape(-1)[0], bytes):
        return np.char.decode(x.astype(np.bytes_), "utf-8")
    return x.astype(np.str_)


def _to_e8m0(x: np.ndarray, saturate: bool, round_mode: str) -> np.ndarray:
    """float -> float8e8m0 (a bare power-of-two exponent), rounding the mantissa away per
    ``round_mode`` ("up", "down" or "nearest"); NaN/Inf map to the NaN code 0xFF."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32)
    exponent = ((bits >> 23) & 0xFF).astype(np.uint16)
    special = exponent == 0xFF
    if round_mode == "up":
        round_up = (bits & 0x7FFFFF) > 0
    elif round_mode == "nearest":
        guard = (bits & 0x400000) > 0
        rest = (bits & 0x3FFFFF) > 0
        round_up = guard & (rest | (exponent > 0))
    elif round_mode == "down":
        round_up = np.zeros(bits.shape, dtype=bool)
    else:
        raise ShapeInferenceError(f"Cast round_mode must be up, down or nearest, got {round_mode!r}")
    round_up &= ~special
    if saturate:
        round_up &= exponent != 0xFE
    exponent = exponent + round_up
    exponent[special] = 0xFF
    return np.minimum(exponent, 0xFF).astype(np.uint8).view(E8M0)


def cast_array(x: np.ndarray, to: np.dtype, saturate: bool = True, round_mode: str = "up") -> np.ndarray:
    """ONNX Cast of ``x`` to numpy dtype ``to`` (shared with ops that cast internally)."""
    to = np.dtype(to)
    if is_string(to):
        if is_string(x.dtype):
            return x.astype(object)
        if x.dtype == np.bool_:
            return np.where(x, "1", "0").astype(object)
        return x.astype(np.str_).astype(object)
    if is_string(x.dtype):
        text = _as_text(x)
        if to.kind in "iu":
            try:  # exact for large integers, which a detour through float64 would round
                return text.astype(to)
            except ValueError:
                pass
        numbers = text.astype(np.float64)  # parses "1e-3", "inf", "NaN", "-7"
        return numbers != 0 if to == np.bool_ else cast_array(numbers, to, saturate, round_mode)
    if to == E8M0:
        return _to_e8m0(x, saturate, round_mode)
    if saturate and to in SATURATING_FLOAT8 and x.dtype.kind in "fV":
        info = ml_dtypes.finfo(to)
        wide = x if x.dtype == np.float64 else x.astype(np.float32)
        return np.clip(wide, float(info.min), float(info.max)).astype(to)
    return x.astype(to)


def _target(node: Node) -> np.dtype:
    return onnx_to_np(int(node.attr("to")))


def _saturate(node: Node) -> bool:
    return bool(node.attr("saturate", 1))


def _cast_infer(node: Node, x: TensorInfo) -> TensorInfo:
    if node.attr("to") is None:
        raise ShapeInferenceError("Cast needs the 'to' attribute")
    return TensorInfo(_target(node), x.shape)


def _cast_cpu(node: Node, x: np.ndarray) -> np.ndarray:
    return cast_array(x, _target(node), _saturate(node), node.attr("round_mode", "up"))


register_op("Cast", infer=_cast_infer, cpu=_cast_cpu, doc="Element type conversion (ONNX Cast).")


def _castlike_infer(node: Node, x: TensorInfo, like: TensorInfo) -> TensorInfo:
    return TensorInfo(like.dtype, x.shape)


def _castlike_cpu(node: Node, x: np.ndarray, like: np.ndarray) -> np.ndarray:
    return cast_array(x, like.dtype, _saturate(node), node.attr("round_mode", "up"))


register_op("CastLike", infer=_castlike_infer, cpu=_castlike_cpu, min_opset=15,
            doc="Cast to the element type of a second input.")


def _bitcast_infer(node: Node, x: TensorInfo) -> TensorInfo:
    to = _target(node)
    if is_string(to) or is_string(x.dtype):
        raise ShapeInferenceError("BitCast does not take or produce strings")
    if to.itemsize != x.dtype.itemsize:
        raise ShapeInferenceError(f"BitCast needs equal bit widths, got {x.dtype} and {to}")
    return TensorInfo(to, x.shape)


def _bitcast_cpu(node: Node, x: np.ndarray) -> np.ndarray:
    x = x if x.flags.c_contiguous else x.copy()  # view() needs contiguous data; keeps 0-d shape
    return x.view(_target(node))


register_op("BitCast", infer=_bitcast_infer, cpu=_bitcast_cpu, min_opset=26,
            doc="Reinterpret the bits of each element as another type of the same width.")
