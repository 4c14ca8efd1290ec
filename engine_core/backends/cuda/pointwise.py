"""Generated pointwise kernels: one NVRTC kernel per (op, dtypes) from `cuda_kernels/pointwise.cu`.

Broadcasting, transposes, slices and concatenation all reduce to one strided indexer
(``Indexer``): output coordinate -> element offset of the output and of each input. The host
merges dimensions that are contiguous for every operand, so plain same-shape ops run at rank 1.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine_core.cuda.nvrtc import KERNEL_DIR

MAX_RANK = 6

#: numpy dtype -> (C type, name suffix)
C_TYPES: dict[np.dtype, tuple[str, str]] = {
    np.dtype(np.float32): ("float", "f32"),
    np.dtype(np.float64): ("double", "f64"),
    np.dtype(np.int64): ("long long", "i64"),
    np.dtype(np.int32): ("int", "i32"),
    np.dtype(np.int8): ("signed char", "i8"),
    np.dtype(np.uint8): ("unsigned char", "u8"),
    np.dtype(np.bool_): ("bool", "b8"),
}
FLOATS = {np.dtype(np.float32), np.dtype(np.float64)}

# Expressions over a, b, c (inputs 0..2); "{f}" is the float-math suffix ("f" for float, "" for double).
_FLOAT_UNARY = {
    "Sigmoid": "1 / (1 + exp{f}(-a))", "Tanh": "tanh{f}(a)", "Erf": "erf{f}(a)", "Exp": "exp{f}(a)",
    "Log": "log{f}(a)", "Sqrt": "sqrt{f}(a)", "Reciprocal": "1 / a", "Floor": "floor{f}(a)",
    "Ceil": "ceil{f}(a)", "Sin": "sin{f}(a)", "Cos": "cos{f}(a)",
}
_ANY_UNARY = {"Relu": "a > 0 ? a : (T0)0", "Neg": "-a", "Abs": "a < 0 ? -a : a", "Identity": "a"}
_ARITH = {"Add": "a + b", "Sub": "a - b", "Mul": "a * b", "Max": "a > b ? a : b", "Min": "a < b ? a : b"}
_FLOAT_BINARY = {"Div": "a / b", "Pow": "pow{f}(a, (T0)b)"}
_COMPARE = {"Equal": "a == b", "Less": "a < b", "Greater": "a > b", "LessOrEqual": "a <= b",
            "GreaterOrEqual": "a >= b"}
_BOOL = {"And": "a && b", "Or": "a || b", "Xor": "a != b"}

#: ops lowered to a generated pointwise kernel (Cast, Clip, Where are handled specially)
POINTWISE_OPS = frozenset(_FLOAT_UNARY) | set(_ANY_UNARY) | set(_ARITH) | set(_FLOAT_BINARY) | set(_COMPARE) \
    | set(_BOOL) | {"Not", "Cast", "Clip", "Where"}


class Unsupported(Exception):
    """This layer (op, dtypes or layout) has no CUDA implementation yet: it runs on the host."""


@dataclass(frozen=True)
class PointwiseKernel:
    """One instantiation of the template: name, output type, input types, C expression."""

    name: str
    out: np.dtype
    ins: tuple[np.dtype, ...]
    expr: str

    def instantiation(self) -> str:
        types = ", ".join(C_TYPES[t][0] for t in (self.out, *self.ins))
        expr = self.expr
        for i, t in enumerate(self.ins):
            expr = expr.replace(f"T{i}", C_TYPES[t][0])
        return f"KILN_POINTWISE{len(self.ins)}({self.name}, {types}, {expr})"


def _ctype(dtype: np.dtype) -> str:
    if np.dtype(dtype) not in C_TYPES:
        raise Unsupported(f"dtype {np.dtype(dtype)} has no pointwise kernels yet")
    return C_TYPES[np.dtype(dtype)][1]


def pointwise_kernel(op: str, out: np.dtype, ins: Sequence[np.dtype], variant: str = "") -> PointwiseKernel:
    """The kernel for ``op`` over input dtypes ``ins`` producing ``out``; raises Unsupported."""
    out, ins = np.dtype(out), tuple(np.dtype(t) for t in ins)
    name = "_".join(["pw", op.lower() + variant, _ctype(out), *(_ctype(t) for t in ins)])
    f = "f" if ins and ins[0] == np.float32 else ""
    expr = _expression(op, out, ins, variant)
    return PointwiseKernel(name, out, ins, expr.replace("{f}", f))


def _expression(op: str, out: np.dtype, ins: tuple[np.dtype, ...], variant: str) -> str:
    first = ins[0] if ins else None
    if op in _FLOAT_UNARY and first in FLOATS:
        return _FLOAT_UNARY[op]
    if op in _ANY_UNARY and first != np.bool_:
        return _ANY_UNARY[op]
    if op == "Identity":
        return "a"
    if op in _ARITH and first != np.bool_ and len(ins) == 2:
        return _ARITH[op]
    if op in _FLOAT_BINARY and first in FLOATS:
        return _FLOAT_BINARY[op]
    if op in _COMPARE and len(ins) == 2:
        return _COMPARE[op]
    if op in _BOOL and first == np.bool_:
        return _BOOL[op]
    if op == "Not" and first == np.bool_:
        return "!a"
    if op == "Cast":
        return "a != 0" if out == np.bool_ else "a"
    if op == "Where" and first == np.bool_:
        return "a ? b : c"
    if op == "Clip" and first != np.bool_:
        lo, hi = "lo" in variant, "hi" in variant
        if lo and hi:
            return "(a < b ? b : a) > c ? c : (a < b ? b : a)"
        if lo or hi:
            return "a < b ? b : a" if lo else "a > b ? b : a"
        return "a"
    raise Unsupported(f"no pointwise kernel for {op} over {[str(t) for t in ins]}")


def pointwise_source(kernels: Sequence[PointwiseKernel]) -> str:
    """The template followed by one instantiation per distinct kernel."""
    template = (KERNEL_DIR / "pointwise.cu").read_text()
    lines = dict.fromkeys(k.instantiation() for k in kernels)
    return "#define KILN_GENERATED\n" + template + "\n" + "\n".join(lines) + "\n"


class Indexer(ctypes.Structure):
    """Mirror of ``struct KilnIndexer`` (passed by value to every pointwise kernel)."""

    _fields_ = [("shape", ctypes.c_longlong * MAX_RANK), ("out", ctypes.c_longlong * MAX_RANK),
                ("in0", ctypes.c_longlong * MAX_RANK), ("in1", ctypes.c_longlong * MAX_RANK),
                ("in2", ctypes.c_longlong * MAX_RANK)]


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= int(d)
    return tuple(reversed(strides))


def broadcast_strides(shape: Sequence[int], out_shape: Sequence[int]) -> tuple[int, ...]:
    """Element strides reading ``shape`` broadcast to ``out_shape`` (0 along broadcast dims)."""
    pad = len(out_shape) - len(shape)
    full = (1,) * pad + tuple(shape)
    strides = contiguous_strides(full)
    return tuple(0 if d == 1 and o != 1 else s for d, o, s in zip(full, out_shape, strides))


def coalesce(shape: Sequence[int], strides: Sequence[Sequence[int]]) -> tuple[list[int], list[list[int]]]:
    """Drop size-1 dims and merge neighbours contiguous for every operand (same element order)."""
    dims = [(int(n), [int(s[d]) for s in strides]) for d, n in enumerate(shape) if n != 1]
    merged: list[tuple[int, list[int]]] = []
    for n, st in dims:
        if merged:
            pn, pst = merged[-1]
            if all(p == s * n for p, s in zip(pst, st)):
                merged[-1] = (pn * n, st)
                continue
        merged.append((n, st))
    return [n for n, _ in merged], [[st[i] for _, st in merged] for i in range(len(strides))]


def make_indexer(shape: Sequence[int], out_strides: Sequence[int],
                 in_strides: Sequence[Sequence[int]]) -> tuple[Indexer, int]:
    """The kernel's indexer and rank for iterating ``shape``; raises Unsupported past MAX_RANK."""
    dims, strides = coalesce(shape, [out_strides, *in_strides])
    if len(dims) > MAX_RANK:
        raise Unsupported(f"rank {len(dims)} after merging dims exceeds {MAX_RANK}")
    ix = Indexer()
    for d, n in enumerate(dims):
        ix.shape[d] = n
        ix.out[d] = strides[0][d]
        for i, st in enumerate(strides[1:]):
            getattr(ix, f"in{i}")[d] = st[d]
    return ix, len(dims)
