"""Generated pointwise kernels: one NVRTC kernel per pointwise *program* (`cuda_kernels/pointwise.cu`).

A program is one ONNX pointwise op, or a fused chain of them (``kiln.PointwiseChain``, a conv/GEMM
epilogue): a list of ``PwNode`` evaluated per output element in registers, reading each input once.
Broadcasting, transposes, slices, concatenation and channels-last layouts all reduce to one strided
indexer (``Indexer``): output coordinate -> element offset of the output and of each input. The host
merges dimensions that are contiguous for every operand, so plain same-shape ops run at rank 1.
fp16/bf16 values compute in float (only stores round), so a fused chain is at least as accurate as
the unfused layers.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from engine_core.cuda.nvrtc import KERNEL_DIR

MAX_RANK = 6
MAX_INPUTS = 8
#: vectors per thread in a generated kernel's vector path (loads of all of them before any store); None: 2 when
#: the output is narrower than the widest input (int32 GEMM sums -> fp16, fp16 -> int8), else 1. Measured on the
#: H100 at BERT-base sizes (bench/pointwise.py, bench/results/pointwise_20261123T164529.json): 2 was 4-11% faster
#: than 1 on those narrowing kernels, 1 was 3-7% faster on same-width ones (GELU, bias add), 4 was slower on all
#: (up to 1.8x: registers)
VECTOR_UNROLL: int | None = None
BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)

#: numpy dtype -> (storage C type, name suffix, compute C type)
C_TYPES: dict[np.dtype, tuple[str, str, str]] = {
    np.dtype(np.float32): ("float", "f32", "float"),
    np.dtype(np.float64): ("double", "f64", "double"),
    np.dtype(np.float16): ("__half", "f16", "float"),
    BF16: ("__nv_bfloat16", "bf16", "float"),
    np.dtype(np.int64): ("long long", "i64", "long long"),
    np.dtype(np.int32): ("int", "i32", "int"),
    np.dtype(np.int16): ("short", "i16", "short"),
    np.dtype(np.int8): ("signed char", "i8", "signed char"),
    np.dtype(np.uint8): ("unsigned char", "u8", "unsigned char"),
    np.dtype(np.uint16): ("unsigned short", "u16", "unsigned short"),
    np.dtype(np.uint32): ("unsigned int", "u32", "unsigned int"),
    np.dtype(np.uint64): ("unsigned long long", "u64", "unsigned long long"),
    np.dtype(np.bool_): ("bool", "b8", "bool"),
    E4M3: ("__nv_fp8_e4m3", "e4m3", "float"),  # Q/DQ and casts only (not in FLOATS: no arithmetic in fp8)
}
FLOATS = frozenset({np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16), BF16})
BOOL = np.dtype(np.bool_)

# Expressions over {a}, {b}, {c} (arguments), {F} (the float compute type), {f} (math suffix: "f" for
# float, "" for double) and {alpha}/{beta} (the op's float attributes).
_FLOAT_UNARY = {
    "Sigmoid": "({F})1 / (({F})1 + exp{f}(-{a}))", "Tanh": "tanh{f}({a})", "Erf": "erf{f}({a})",
    "Exp": "exp{f}({a})", "Log": "log{f}({a})", "Sqrt": "sqrt{f}({a})", "Reciprocal": "({F})1 / {a}",
    "Floor": "floor{f}({a})", "Ceil": "ceil{f}({a})", "Sin": "sin{f}({a})", "Cos": "cos{f}({a})",
    "Round": "rint{f}({a})", "Softplus": "({a} > ({F})20 ? {a} : log1p{f}(exp{f}({a})))",
    "Gelu": "({F})0.5 * {a} * (({F})1 + erf{f}({a} * ({F})0.7071067811865476))",
    "GeluTanh": "({F})0.5 * {a} * (({F})1 + tanh{f}(({F})0.7978845608028654 * ({a} + ({F})0.044715 * {a} * {a} * {a})))",
    "LeakyRelu": "({a} >= ({F})0 ? {a} : ({F}){alpha} * {a})",
    "Elu": "({a} >= ({F})0 ? {a} : ({F}){alpha} * (exp{f}({a}) - ({F})1))",
    "HardSigmoid": "fmax{f}(({F})0, fmin{f}(({F})1, ({F}){alpha} * {a} + ({F}){beta}))",
    "HardSwish": "{a} * fmax{f}(({F})0, fmin{f}(({F})1, {a} / ({F})6 + ({F})0.5))",
    "IsNaN": "isnan({a})",
    "Softsign": "{a} / (({F})1 + fabs{f}({a}))", "ThresholdedRelu": "({a} > ({F}){alpha} ? {a} : ({F})0)",
    "Mish": "{a} * tanh{f}({a} > ({F})20 ? {a} : log1p{f}(exp{f}({a})))",  # x * tanh(softplus(x)), softplus as above
    "Tan": "tan{f}({a})", "Asin": "asin{f}({a})", "Acos": "acos{f}({a})", "Atan": "atan{f}({a})",
    "Sinh": "sinh{f}({a})", "Cosh": "cosh{f}({a})", "Asinh": "asinh{f}({a})", "Acosh": "acosh{f}({a})",
    "Atanh": "atanh{f}({a})",
}
_ANY_UNARY = {"Relu": "({a} > 0 ? {a} : 0)", "Neg": "-{a}", "Abs": "({a} < 0 ? -{a} : {a})", "Identity": "{a}",
              "Sign": "(({a} > 0) - ({a} < 0))"}
_ARITH = {"Add": "{a} + {b}", "Sub": "{a} - {b}", "Mul": "{a} * {b}", "Max": "({a} > {b} ? {a} : {b})",
          "Min": "({a} < {b} ? {a} : {b})", "Sum": "{a} + {b}", "Mean": "{a} + {b}"}
_FLOAT_BINARY = {"Div": "{a} / {b}", "Pow": "pow{f}({a}, ({F}){b})"}
_COMPARE = {"Equal": "{a} == {b}", "Less": "{a} < {b}", "Greater": "{a} > {b}", "LessOrEqual": "{a} <= {b}",
            "GreaterOrEqual": "{a} >= {b}"}
_BOOL = {"And": "{a} && {b}", "Or": "{a} || {b}", "Xor": "{a} != {b}"}
#: integer types of QuantizeLinear/DequantizeLinear (int4 runs on the host) -> saturation range; E4M3 saturates
#: in its store (KilnConvert)
_QUANT_RANGE = {np.dtype(np.int8): (-128, 127), np.dtype(np.uint8): (0, 255), np.dtype(np.int16): (-32768, 32767),
                np.dtype(np.uint16): (0, 65535)}


def compute_of(dtype: np.dtype) -> str:
    """The C type a value of ``dtype`` computes in."""
    return C_TYPES[np.dtype(dtype)][2]


#: float attributes the expressions read, with the ONNX defaults
_ATTR_DEFAULTS = {"LeakyRelu": {"alpha": 0.01}, "Elu": {"alpha": 1.0}, "HardSigmoid": {"alpha": 0.2, "beta": 0.5},
                  "ThresholdedRelu": {"alpha": 1.0}}

#: ops lowered to a generated pointwise kernel (Cast, Clip, Where and variadic ones are special-cased)
POINTWISE_OPS = frozenset(_FLOAT_UNARY) - {"GeluTanh"} | set(_ANY_UNARY) | set(_ARITH) | set(_FLOAT_BINARY) \
    | set(_COMPARE) | set(_BOOL) | {"Not", "Cast", "Clip", "Where"}
_VARIADIC = frozenset({"Sum", "Mean", "Max", "Min"})


class Unsupported(Exception):
    """This layer (op, dtypes or layout) has no CUDA implementation yet: it runs on the host."""


def _freeze(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, np.ndarray):
        return tuple(value.reshape(-1).tolist())
    if isinstance(value, (bytes, str, int, float, bool)) or value is None:
        return value
    raise Unsupported(f"attribute of type {type(value).__name__} in a pointwise program")


@dataclass(frozen=True)
class PwNode:
    """One op of a program. ``args`` index values: 0..n_inputs-1 are the kernel inputs, then each node's
    result in order; -1 is an absent optional input. ``attrs`` are the ONNX attributes (for the emulator
    and for the expression's constants)."""

    op: str
    args: tuple[int, ...]
    dtype: np.dtype
    attrs: tuple[tuple[str, Any], ...] = ()
    opset: int = 21

    @staticmethod
    def make(op: str, args: Sequence[int], dtype: Any, attrs: Mapping[str, Any] | None = None,
             opset: int = 21) -> PwNode:
        return PwNode(op, tuple(args), np.dtype(dtype), tuple(sorted((k, _freeze(v)) for k, v in (attrs or {}).items())),
                      opset)

    def attr(self, name: str, default: Any = None) -> Any:
        return dict(self.attrs).get(name, default)


@dataclass(frozen=True)
class PointwiseKernel:
    """One generated kernel: output dtype, input dtypes and the program computing the output."""

    name: str
    out: np.dtype
    ins: tuple[np.dtype, ...]
    nodes: tuple[PwNode, ...]

    def source(self) -> str:
        """The kernel's CUDA C: load each input once, one register per node, one store.

        A vector path first: when the innermost dim (after merging) is contiguous in the output and in every
        input (or broadcast), divides by V and every vector start is aligned, each thread moves V consecutive
        elements with one 16-byte (or narrower) load per input and one store; otherwise the strided path.
        """
        n = len(self.ins)
        params = ", ".join([f"{C_TYPES[self.out][0]}* __restrict__ y"]
                           + [f"const {C_TYPES[t][0]}* __restrict__ x{i}" for i, t in enumerate(self.ins)])
        scalar = [f"const {C_TYPES[t][2]} v{i} = kiln_load(x{i}[o[{i}]]);" for i, t in enumerate(self.ins)]
        scalar += self._program_lines()
        scalar.append(f"y[oy] = KILN_CONVERT({C_TYPES[self.out][0]}, v{n + len(self.nodes) - 1});")
        lines = "\n        ".join(scalar)
        return (f'extern "C" __global__ void {self.name}({params}, long long n, int rank, KilnIndexer ix) {{\n'
                f"{self._vector_path()}"
                f"    KILN_FOR_EACH({n}, {{\n        {lines}\n    }})\n}}\n")

    def _program_lines(self) -> list[str]:
        n = len(self.ins)
        types = list(self.ins) + [node.dtype for node in self.nodes]
        body = []
        for j, node in enumerate(self.nodes):
            args = [(f"v{a}", types[a]) if a >= 0 else None for a in node.args]
            body.append(f"const {C_TYPES[node.dtype][2]} v{n + j} = ({C_TYPES[node.dtype][2]})({_expression(node, args)});")
        return body

    def vector_width(self) -> int:
        widest = max(np.dtype(t).itemsize for t in (self.out, *self.ins))
        return min(8, 16 // widest)

    def vector_unroll(self) -> int:
        """Vectors per thread in the vector path (``VECTOR_UNROLL``)."""
        if VECTOR_UNROLL is not None:
            return VECTOR_UNROLL
        return 2 if self.out.itemsize < max(np.dtype(t).itemsize for t in self.ins) else 1

    def _vector_path(self) -> str:
        """Each thread moves ``vector_unroll()`` vectors, blockDim.x apart, every load issued before the first
        store (more bytes in flight per thread), and the host launches just the threads the vectors need
        (``vector_threads``: sized for one element per thread before, 3/4 of the threads of a 4-wide kernel
        had nothing to do; session 5's CUPTI profile had BERT's INT8 epilogues at 4-5x their memory time)."""
        width = self.vector_width()
        if width < 2:
            return ""
        n, unroll = len(self.ins), self.vector_unroll()
        out_t = C_TYPES[self.out][0]
        last = "rank - 1"
        conds = ["rank >= 1", f"ix.shape[{last}] % {width} == 0", f"ix.out[{last}] == 1",
                 f"kiln_aligned(y, {width} * sizeof({out_t}))", f"kiln_outer_strides_ok(ix.out, rank, {width})"]
        for i, t in enumerate(self.ins):
            conds.append(f"(ix.in[{i}][{last}] == 0 || (ix.in[{i}][{last}] == 1 && kiln_aligned(x{i}, {width} * "
                         f"sizeof({C_TYPES[t][0]})) && kiln_outer_strides_ok(ix.in[{i}], rank, {width})))")
        loads = [f"KilnVec<{C_TYPES[t][0]}, {width}> a{i}[{unroll}];" for i, t in enumerate(self.ins)]
        fill = []
        for i, t in enumerate(self.ins):
            vec = f"KilnVec<{C_TYPES[t][0]}, {width}>"
            fill.append(f"if (ix.in[{i}][{last}]) a{i}[s] = *reinterpret_cast<const {vec}*>(x{i} + o[{i}]); else "
                        f"{{ _Pragma(\"unroll\") for (int u = 0; u < {width}; ++u) a{i}[s].v[u] = x{i}[o[{i}]]; }}")
        lane = [f"const {C_TYPES[t][2]} v{i} = kiln_load(a{i}[s].v[u]);" for i, t in enumerate(self.ins)]
        lane += self._program_lines()
        lane.append(f"out.v[u] = KILN_CONVERT({out_t}, v{n + len(self.nodes) - 1});")
        offsets = (f"if (rank == 1) {{ oy[s] = i; _Pragma(\"unroll\") for (int k = 0; k < {max(n, 1)}; ++k) o[k] = "
                   f"ix.in[k][0] ? i : 0; }} else kiln_offsets<{n}>(i, n, rank, ix, oy[s], o);")
        ind = "\n" + " " * 16
        return (f"    if ({' && '.join(conds)}) {{\n"
                f"        const long long kiln_vectors = n / {width};\n"
                f"        const long long kiln_step = (long long)gridDim.x * blockDim.x * {unroll};\n"
                f"        for (long long kiln_base = blockIdx.x * (long long)blockDim.x * {unroll} + threadIdx.x; "
                f"kiln_base < kiln_vectors; kiln_base += kiln_step) {{\n"
                f"            long long oy[{unroll}];\n"
                f"            {' '.join(loads)}\n"
                f"            _Pragma(\"unroll\") for (int s = 0; s < {unroll}; ++s) {{\n"
                f"                const long long t = kiln_base + (long long)s * blockDim.x;\n"
                f"                if (t < kiln_vectors) {{\n"
                f"                const long long i = t * {width};\n"
                f"                long long o[{max(n, 1)}];\n"
                f"                {offsets}{ind}{ind.join(fill)}\n"
                f"            }} }}\n"
                f"            _Pragma(\"unroll\") for (int s = 0; s < {unroll}; ++s) {{\n"
                f"                if (kiln_base + (long long)s * blockDim.x < kiln_vectors) {{\n"
                f"                KilnVec<{out_t}, {width}> out;\n"
                f"                _Pragma(\"unroll\") for (int u = 0; u < {width}; ++u) {{\n"
                f"                    {(chr(10) + ' ' * 20).join(lane)}\n"
                f"                }}\n"
                f"                *reinterpret_cast<KilnVec<{out_t}, {width}>*>(y + oy[s]) = out;\n"
                f"            }} }}\n"
                f"        }}\n"
                f"        return;\n"
                f"    }}\n")

    def vector_threads(self, n: int, rank: int, ix: Indexer) -> int | None:
        """Threads the vector path needs for ``n`` elements when the merged dims allow it (pointer alignment,
        checked by the kernel, aside); None when the strided path will run."""
        width = self.vector_width()
        if width < 2 or rank < 1 or ix.shape[rank - 1] % width or ix.out[rank - 1] != 1:
            return None
        ins = [ix.inp[i] for i in range(len(self.ins))]
        if any(st[rank - 1] not in (0, 1) for st in ins):
            return None
        read = [ix.out] + [st for st in ins if st[rank - 1] == 1]  # broadcast (stride-0) inputs read one value
        if any(st[d] % width for st in read for d in range(rank - 1)):
            return None
        return -(-n // (width * self.vector_unroll()))


def _suffix(dtype: np.dtype) -> str:
    if np.dtype(dtype) not in C_TYPES:
        raise Unsupported(f"dtype {np.dtype(dtype)} has no pointwise kernels")
    return C_TYPES[np.dtype(dtype)][1]


def _literal(value: float) -> str:
    if not math.isfinite(value):
        raise Unsupported(f"non-finite constant {value} in a pointwise program")
    return repr(float(value))


def _expression(node: PwNode, args: list[tuple[str, np.dtype] | None]) -> str:
    """The C expression for one node over its argument registers; raises Unsupported."""
    op = node.op
    present = [a for a in args if a is not None]
    if not present:
        raise Unsupported(f"{op} without inputs")
    first = present[0][1]
    compute = C_TYPES[first][2] if first in C_TYPES else ""
    fmt = {"F": compute, "f": "f" if compute == "float" else "",
           **{k: "" for k in ("alpha", "beta")}}
    for key, default in _ATTR_DEFAULTS.get(op, {}).items():
        fmt[key] = _literal(float(node.attr(key, default)))
    names = {k: "" for k in "abc"} | {k: (a[0] if a is not None else "") for k, a in zip("abc", args)}
    if op == "Gelu" and node.attr("approximate", "none") == "tanh":
        op = "GeluTanh"
    if op in _FLOAT_UNARY and first in FLOATS:
        return _FLOAT_UNARY[op].format(**fmt, **names)
    if op in _ANY_UNARY and (first != BOOL or op == "Identity"):
        return _ANY_UNARY[op].format(**fmt, **names)
    if op in _VARIADIC and first != BOOL and len(present) >= 1 and len(present) == len(args):
        expr = present[0][0]
        for other, _ in present[1:]:
            expr = "(" + _ARITH[op].format(a=expr, b=other) + ")"
        if op == "Mean":
            if first not in FLOATS:
                raise Unsupported("integer Mean")
            expr = f"{expr} / ({compute}){len(present)}"
        return expr
    if op in _ARITH and first != BOOL and len(args) == 2:
        return _ARITH[op].format(**names)
    if op in _FLOAT_BINARY and first in FLOATS and len(args) == 2:
        return _FLOAT_BINARY[op].format(**fmt, **names)
    if op in _COMPARE and len(args) == 2:
        return _COMPARE[op].format(**names)
    if op in _BOOL and first == BOOL:
        return _BOOL[op].format(**names)
    if op == "Not" and first == BOOL:
        return f"!{names['a']}"
    if op == "Cast":
        out = node.dtype
        if out == BOOL:
            return f"{names['a']} != 0"
        if out in (np.dtype(np.float16), BF16, E4M3):  # round like the real cast would
            storage = C_TYPES[out][0]
            return f"kiln_load(KILN_CONVERT({storage}, {names['a']}))"
        return f"({C_TYPES[out][2]})({names['a']})"
    if op == "DequantizeLinear" and (first in _QUANT_RANGE or first == E4M3):
        zero = f" - ({compute_of(node.dtype)})({names['c']})" if names["c"] else ""
        return f"(({compute_of(node.dtype)}){names['a']}{zero}) * ({compute_of(node.dtype)}){names['b']}"
    if op == "QuantizeLinear" and first in FLOATS and node.dtype == E4M3 and dict(node.attrs).get("saturate", 1):
        zero = f" + (float)({names['c']})" if names["c"] else ""  # rounded (and saturated) as the E4M3 store does
        return f"kiln_load(KILN_CONVERT(__nv_fp8_e4m3, (float){names['a']} / (float){names['b']}{zero}))"
    if op == "QuantizeLinear" and first in FLOATS and node.dtype in _QUANT_RANGE:
        lo, hi = _QUANT_RANGE[node.dtype]
        zero = f" + (float)({names['c']})" if names["c"] else ""
        return f"fminf(fmaxf(rintf((float){names['a']} / (float){names['b']}){zero}, {lo}.0f), {hi}.0f)"
    if op == "Where" and first == BOOL and len(present) == 3:
        return f"({names['a']} ? {names['b']} : {names['c']})"
    if op == "Clip" and first != BOOL:
        a, lo, hi = names["a"], names["b"], names["c"]
        expr = a
        if lo:
            expr = f"({expr} < {lo} ? {lo} : {expr})"
        if hi:
            expr = f"({expr} > {hi} ? {hi} : {expr})"
        return expr
    raise Unsupported(f"no pointwise kernel for {op} over {[str(a[1]) for a in present]}")


def program_kernel(nodes: Sequence[PwNode], out: Any, ins: Sequence[Any]) -> PointwiseKernel:
    """The kernel evaluating ``nodes`` (the last one is the output); raises Unsupported.

    Single-op programs get readable names (``pw_relu_f32_f32``); fused ones a content hash.
    """
    out, ins, nodes = np.dtype(out), tuple(np.dtype(t) for t in ins), tuple(nodes)
    if not nodes:
        raise Unsupported("empty pointwise program")
    if len(ins) > MAX_INPUTS:
        raise Unsupported(f"{len(ins)} inputs exceed the {MAX_INPUTS} a pointwise kernel takes")
    for t in (out, *ins, *(n.dtype for n in nodes)):
        _suffix(t)
    node = nodes[0]
    if len(nodes) == 1 and not node.attrs and all(a == i for i, a in enumerate(node.args) if a >= 0):
        variant = "".join(f"_{k}" for k, a in zip(("x", "lo", "hi"), node.args) if a >= 0 and k != "x") \
            if node.op == "Clip" else ""
        name = "_".join(["pw", node.op.lower() + variant, _suffix(out), *(_suffix(t) for t in ins)])
    else:
        digest = hashlib.sha256(repr((nodes, out, ins)).encode()).hexdigest()[:10]
        ops = "_".join(n.op.lower() for n in nodes[:4])
        name = f"pw_{ops}_{digest}"
    kernel = PointwiseKernel(name, out, ins, nodes)
    kernel.source()  # raises Unsupported now, not at compile time
    return kernel


def pointwise_kernel(op: str, out: Any, ins: Sequence[Any], attrs: Mapping[str, Any] | None = None,
                     args: Sequence[int] | None = None, opset: int = 21) -> PointwiseKernel:
    """The kernel for one ``op`` over input dtypes ``ins`` producing ``out``; raises Unsupported."""
    args = tuple(range(len(ins))) if args is None else tuple(args)
    return program_kernel([PwNode.make(op, args, out, attrs, opset)], out, ins)


#: NVRTC options of the generated module: no FMA contraction, so the vector and strided paths of a kernel
#: (chosen per launch by alignment) give bit-identical results
POINTWISE_OPTIONS = ("--fmad=false",)


def pointwise_source(kernels: Sequence[PointwiseKernel]) -> str:
    """The template followed by one generated kernel per distinct program."""
    template = (KERNEL_DIR / "pointwise.cu").read_text()
    sources = dict.fromkeys(k.source() for k in kernels)
    return "#define KILN_GENERATED\n" + template + "\n" + "\n".join(sources) + "\n"


class Indexer(ctypes.Structure):
    """Mirror of ``struct KilnIndexer`` (passed by value to every pointwise kernel)."""

    _fields_ = [("shape", ctypes.c_longlong * MAX_RANK), ("out", ctypes.c_longlong * MAX_RANK),
                ("inp", (ctypes.c_longlong * MAX_RANK) * MAX_INPUTS)]


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= int(d)
    return tuple(reversed(strides))


def broadcast_strides(shape: Sequence[int], out_shape: Sequence[int],
                      strides: Sequence[int] | None = None) -> tuple[int, ...]:
    """Element strides reading ``shape`` (laid out with ``strides``, default contiguous) broadcast to
    ``out_shape`` (0 along broadcast dims)."""
    pad = len(out_shape) - len(shape)
    full = (1,) * pad + tuple(shape)
    own = (0,) * pad + tuple(strides if strides is not None else contiguous_strides(shape))
    return tuple(0 if d == 1 and o != 1 else s for d, o, s in zip(full, out_shape, own))


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
    if len(in_strides) > MAX_INPUTS:
        raise Unsupported(f"{len(in_strides)} inputs exceed {MAX_INPUTS}")
    # Iterate in the output's physical order (largest stride first): consecutive threads then write
    # consecutive addresses whatever the logical layout (channels-last outputs would otherwise be
    # written C elements apart), and dims contiguous in memory merge.
    order = sorted(range(len(shape)), key=lambda d: -int(out_strides[d]))
    shape = [shape[d] for d in order]
    out_strides = [out_strides[d] for d in order]
    in_strides = [[st[d] for d in order] for st in in_strides]
    dims, strides = coalesce(shape, [out_strides, *in_strides])
    if len(dims) > MAX_RANK:
        raise Unsupported(f"rank {len(dims)} after merging dims exceeds {MAX_RANK}")
    ix = Indexer()
    for d, n in enumerate(dims):
        ix.shape[d] = n
        ix.out[d] = strides[0][d]
        for i, st in enumerate(strides[1:]):
            ix.inp[i][d] = st[d]
    return ix, len(dims)
