"""Elementwise arithmetic and math: Add ... Pow, Mod, variadic Max/Min/Sum/Mean, unary math, Clip.

Dtype rule (ONNX's, not numpy's): arithmetic keeps the dtype of its first input, so float16 stays
float16, Pow with an int exponent returns the base's float type and integer division truncates.
numpy would promote mixed operands and silently widen; the helpers here compute in a chosen type
(``exact_dtype`` for arithmetic, ``compute_dtype`` for transcendental functions) and cast back once.

The helpers at the top are shared with activations.py, logic.py and reductions.py.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import ml_dtypes
import numpy as np

from engine_core.ir import Graph, Node
from engine_core.ops.registry import TensorInfo, broadcast_infer, register_op, same_as_input
from engine_core.ops.tensor import attr_to_input

Ufunc = Callable[[np.ndarray], np.ndarray]

#: Float formats narrower than float32 (numpy's float16 and the ml_dtypes ones): math on them runs
#: in float32 and rounds once at the end, like onnxruntime's kernels do.
NARROW_FLOATS = frozenset(
    np.dtype(t)
    for t in (
        np.float16,
        ml_dtypes.bfloat16,
        ml_dtypes.float8_e4m3fn,
        ml_dtypes.float8_e4m3fnuz,
        ml_dtypes.float8_e5m2,
        ml_dtypes.float8_e5m2fnuz,
        ml_dtypes.float4_e2m1fn,
    )
)


def is_float(dtype: np.dtype) -> bool:
    """True for every floating format, including the ml_dtypes ones numpy does not call floating."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or dtype in NARROW_FLOATS


def is_integer(dtype: np.dtype) -> bool:
    return np.dtype(dtype).kind in "iu"


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype math on ``dtype`` runs in: float32 for narrow floats, float64 for integers and
    bools (so transcendental functions of them are exact before the final cast), else itself."""
    dtype = np.dtype(dtype)
    if dtype in NARROW_FLOATS:
        return np.dtype(np.float32)
    if dtype.kind in "iub":
        return np.dtype(np.float64)
    return dtype


def exact_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype arithmetic on ``dtype`` runs in: narrow floats widen to float32 (rounded once at
    the end); integers stay integers, so int64 stays exact and overflow wraps as in C."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype in NARROW_FLOATS else dtype


def quiet(fn: Callable) -> Callable:
    """Run ``fn`` with numpy floating-point warnings off: inf/nan results (log(0), 1/0, overflow)
    are the values ONNX specifies, not errors worth a warning per call."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with np.errstate(all="ignore"):
            return fn(*args, **kwargs)

    return wrapper


def in_compute_dtype(fn: Ufunc, x: np.ndarray) -> np.ndarray:
    """``fn(x)`` evaluated in ``compute_dtype``, returned in x's dtype (integers truncate toward
    zero, as a C cast does)."""
    return np.asarray(fn(x.astype(compute_dtype(x.dtype), copy=False))).astype(x.dtype, copy=False)


def float_math(fn: Ufunc) -> Callable[..., np.ndarray]:
    """The cpu function of a unary math op computing ``fn`` (see ``in_compute_dtype``)."""

    @quiet
    def cpu(node: Node, x: np.ndarray) -> np.ndarray:
        return in_compute_dtype(fn, x)

    return cpu


# -- binary arithmetic ---------------------------------------------------------------------------


def _arith_cpu(fn: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Callable[..., np.ndarray]:
    """``fn`` in ``exact_dtype``, the result in a's dtype."""

    @quiet
    def cpu(node: Node, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        work = exact_dtype(a.dtype)
        return np.asarray(fn(a.astype(work, copy=False), b.astype(work, copy=False))).astype(a.dtype, copy=False)

    return cpu


def truncating_divide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Integer division rounding toward zero (C semantics, which ONNX follows), computed in the
    integer type itself so that int64 values beyond 2**53 stay exact. x / 0 gives 0."""
    q = np.floor_divide(a, b)
    inexact = (a - q * b) != 0
    return q + (inexact & ((a < 0) != (b < 0)))


def _divide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return truncating_divide(a, b) if is_integer(a.dtype) else np.divide(a, b)


for _name, _fn in (("Add", np.add), ("Sub", np.subtract), ("Mul", np.multiply), ("Div", _divide)):
    register_op(_name, infer=broadcast_infer(), cpu=_arith_cpu(_fn))


@quiet
def _pow_cpu(node: Node, base: np.ndarray, exponent: np.ndarray) -> np.ndarray:
    """Pow keeps the base's dtype whatever the exponent's (opset 12+ allows mixed types).
    Integer ** non-negative integer stays in integers (exact, wrapping); anything else runs in
    floats and is cast back, so int ** 0.5 truncates like onnxruntime's static_cast."""
    if is_integer(base.dtype) and is_integer(exponent.dtype) and not (exponent < 0).any():
        return np.power(base.astype(np.int64), exponent.astype(np.int64)).astype(base.dtype)
    wide = np.float64 if np.float64 in (base.dtype, exponent.dtype) or not is_float(base.dtype) else np.float32
    return np.power(base.astype(wide), exponent.astype(wide)).astype(base.dtype)


register_op("Pow", infer=broadcast_infer(), cpu=_pow_cpu)


@quiet
def _mod_cpu(node: Node, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """fmod=1: C fmod (sign of the dividend); fmod=0: sign of the divisor, as Python's %."""
    fn = np.fmod if node.attr("fmod", 0) else np.mod
    work = exact_dtype(a.dtype)
    return fn(a.astype(work, copy=False), b.astype(work, copy=False)).astype(a.dtype, copy=False)


register_op("Mod", infer=broadcast_infer(), cpu=_mod_cpu, min_opset=10)


# -- variadic ops ----------------------------------------------------------------------------------


def _variadic_cpu(fn: Callable[[np.ndarray, np.ndarray], np.ndarray], mean: bool = False) -> Callable:
    """Fold ``fn`` over all inputs (broadcasting); Mean divides the sum by the input count."""

    @quiet
    def cpu(node: Node, *inputs: np.ndarray) -> np.ndarray:
        dtype = inputs[0].dtype
        work = exact_dtype(dtype)
        result = functools.reduce(fn, (x.astype(work, copy=False) for x in inputs))
        if mean:
            result = result / len(inputs)
        return np.asarray(result).astype(dtype, copy=False)

    return cpu


register_op("Max", infer=broadcast_infer(), cpu=_variadic_cpu(np.maximum))
register_op("Min", infer=broadcast_infer(), cpu=_variadic_cpu(np.minimum))
register_op("Sum", infer=broadcast_infer(), cpu=_variadic_cpu(np.add))
register_op("Mean", infer=broadcast_infer(), cpu=_variadic_cpu(np.add, mean=True))


# -- unary math --------------------------------------------------------------------------------------


#: |x| below which erf sums its power series; above it the erfc continued fraction is used.
ERF_SPLIT = 2.0
#: Continued-fraction depth reaching full precision at |x| = ERF_SPLIT (checked against C's erf
#: in tests/ops/test_math_ops.py), per working dtype.
_ERFC_DEPTH = {np.dtype(np.float32): 32, np.dtype(np.float64): 128}


@functools.cache
def _erf_series(dtype: np.dtype) -> tuple[float, ...]:
    """Coefficients 1/(2n+1)!! of sum_n t^n / (2n+1)!! (t = 2x^2), highest power first, with as
    many terms as ``dtype`` needs: the first term left out is below its eps at |x| = ERF_SPLIT."""
    t = 2.0 * ERF_SPLIT**2
    eps = float(np.finfo(dtype).eps) / 8
    coefficients, term, n = [1.0], 1.0, 1
    while term >= eps:
        term *= t / (2 * n + 1)
        coefficients.append(coefficients[-1] / (2 * n + 1))
        n += 1
    return tuple(reversed(coefficients))


def erf(x: np.ndarray) -> np.ndarray:
    """The error function (numpy has none), within a few ulp of C's erf, computed in float32 for
    float32 input (cheap: Gelu/BERT-sized tensors) and in float64 for anything else.

    Below |x| = ERF_SPLIT: erf(x) = 2/sqrt(pi) x exp(-x^2) sum_n (2x^2)^n / (2n+1)!!, a series of
    positive terms (no cancellation) evaluated by Horner's rule. Above: the continued fraction
    erfc(x) = exp(-x^2)/sqrt(pi) / (x + (1/2)/(x + 1/(x + (3/2)/(x + ...)))), evaluated bottom-up.
    """
    x = np.asarray(x)
    dtype = x.dtype if x.dtype == np.float32 else np.dtype(np.float64)
    x = x.astype(dtype, copy=False)
    a = np.abs(x)
    near = a < ERF_SPLIT
    out = np.empty_like(a)
    with np.errstate(all="ignore"):
        s = a[near]
        t = 2 * s * s
        coefficients = _erf_series(dtype)
        series = np.full_like(s, coefficients[0])
        for c in coefficients[1:]:
            series *= t
            series += dtype.type(c)
        out[near] = dtype.type(2 / math.sqrt(math.pi)) * s * np.exp(-s * s) * series
        f = a[~near]
        fraction = f.copy()
        for k in range(_ERFC_DEPTH[dtype], 0, -1):
            fraction = f + dtype.type(0.5 * k) / fraction
        out[~near] = 1 - np.exp(-f * f) / (dtype.type(math.sqrt(math.pi)) * fraction)
    return np.copysign(out, x)


_UNARY_MATH: dict[str, Ufunc] = {
    "Abs": np.abs,
    "Neg": np.negative,
    "Sign": np.sign,
    "Reciprocal": np.reciprocal,
    "Floor": np.floor,
    "Ceil": np.ceil,
    "Round": np.round,  # half to even, like the spec
    "Exp": np.exp,
    "Log": np.log,
    "Sqrt": np.sqrt,
    "Erf": erf,
    "Sin": np.sin,
    "Cos": np.cos,
    "Tan": np.tan,
    "Asin": np.arcsin,
    "Acos": np.arccos,
    "Atan": np.arctan,
    "Sinh": np.sinh,
    "Cosh": np.cosh,
    "Asinh": np.arcsinh,
    "Acosh": np.arccosh,
    "Atanh": np.arctanh,
}


@quiet
def _exact_unary(fn: Ufunc, node: Node, x: np.ndarray) -> np.ndarray:
    """Abs/Neg/Sign on integers stay in the integer type (wrapping, exact for int64)."""
    if is_integer(x.dtype):
        return fn(x)
    return float_math(fn)(node, x)


#: Unary ops added after opset 7 (older models cannot use them).
_INTRODUCED = {"Sign": 9, "Erf": 9, "Sinh": 9, "Cosh": 9, "Asinh": 9, "Acosh": 9, "Atanh": 9, "Round": 11}

for _name, _fn in _UNARY_MATH.items():
    if _name in ("Abs", "Neg", "Sign"):
        _cpu = functools.partial(_exact_unary, _fn)
    else:
        _cpu = float_math(_fn)
    register_op(_name, infer=same_as_input(), cpu=_cpu, min_opset=_INTRODUCED.get(_name, 1))


def _is_inf_cpu(node: Node, x: np.ndarray) -> np.ndarray:
    x = x.astype(compute_dtype(x.dtype), copy=False)
    positive = np.isposinf(x) if node.attr("detect_positive", 1) else np.zeros(x.shape, bool)
    negative = np.isneginf(x) if node.attr("detect_negative", 1) else np.zeros(x.shape, bool)
    return positive | negative


def _predicate_infer(node: Node, x: TensorInfo) -> TensorInfo:
    return TensorInfo(np.bool_, x.shape)


register_op("IsInf", infer=_predicate_infer, cpu=_is_inf_cpu, min_opset=10)
register_op("IsNaN", infer=_predicate_infer,
            cpu=lambda node, x: np.isnan(x.astype(compute_dtype(x.dtype), copy=False)), min_opset=9)


# -- Clip ----------------------------------------------------------------------------------------------


def _clip_normalize(node: Node, graph: Graph) -> None:
    """Opset < 11 carried min/max as float attributes; make them inputs 1 and 2 (the cpu function
    casts bounds to the data's dtype, so float32 constants serve every float input)."""
    attr_to_input(node, graph, "min", 1, np.float32)
    attr_to_input(node, graph, "max", 2, np.float32)


@quiet
def _clip_cpu(node: Node, x: np.ndarray, low: np.ndarray | None = None, high: np.ndarray | None = None) -> np.ndarray:
    """Bounds apply in order max(low) then min(high), so low > high yields high everywhere (the
    spec's rule). Bounds are cast to the data's dtype first: comparisons then happen in one type."""
    y = x
    if low is not None:
        y = np.maximum(y, np.asarray(low).astype(x.dtype))
    if high is not None:
        y = np.minimum(y, np.asarray(high).astype(x.dtype))
    return np.asarray(y).astype(x.dtype, copy=False)


register_op("Clip", infer=same_as_input(), cpu=_clip_cpu, normalize=_clip_normalize)
