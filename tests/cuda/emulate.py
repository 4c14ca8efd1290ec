"""A numpy emulation of lowered CUDA steps: runs the exact launches, strides, offsets and arena
placement the GPU would, on host bytes. Why: the index math, aliasing and memory reuse (the parts
most likely to go wrong) are then checked on every CI machine, not only on the device."""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import as_strided

from engine_core.backends.cpu import run_node
from engine_core.backends.cuda.lowering import Copy, Gemm, Host, Launch, Lowered, Ref
from engine_core.backends.cuda.pointwise import C_TYPES
from engine_core.ir import Graph

_SUFFIX = {suffix: dtype for dtype, (_, suffix) in C_TYPES.items()}
_ERF = np.vectorize(math.erf, otypes=[np.float64])

_UFUNCS = {
    "relu": lambda a: np.maximum(a, 0), "sigmoid": lambda a: 1 / (1 + np.exp(-a)), "tanh": np.tanh,
    "erf": lambda a: _ERF(a).astype(a.dtype), "exp": np.exp, "log": np.log, "sqrt": np.sqrt, "neg": np.negative,
    "abs": np.abs, "reciprocal": lambda a: 1 / a, "floor": np.floor, "ceil": np.ceil, "sin": np.sin, "cos": np.cos,
    "identity": lambda a: a, "add": np.add, "sub": np.subtract, "mul": np.multiply, "max": np.maximum,
    "min": np.minimum, "div": np.divide, "pow": lambda a, b: np.power(a, b.astype(a.dtype)), "equal": np.equal,
    "less": np.less, "greater": np.greater, "lessorequal": np.less_equal, "greaterorequal": np.greater_equal,
    "and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor, "not": np.logical_not,
    "cast": lambda a: a, "where": np.where, "clip_lo_hi": lambda a, b, c: np.minimum(np.maximum(a, b), c),
    "clip_lo": np.maximum, "clip_hi": np.minimum, "clip": lambda a: a,
}


class Emulator:
    def __init__(self, graph: Graph, lowered: Lowered, feeds: dict[str, np.ndarray]) -> None:
        self.graph, self.lowered = graph, lowered
        self.arena = np.zeros(max(lowered.memory.size, 1), np.uint8)
        self.buffers: dict[tuple[str, str], np.ndarray] = {}
        for name, value in graph.constants.items():
            self.buffers[("weight", name)] = _bytes(value)
        for name, value in lowered.folded.items():
            self.buffers[("folded", name)] = _bytes(value)
        for name, value in feeds.items():
            self.buffers[("io", name)] = _bytes(value)
        for name in graph.output_names:
            info = lowered.infos[name]
            self.buffers[("io", name)] = np.zeros(int(np.prod(info.shape)) * info.dtype.itemsize, np.uint8)

    def bytes_at(self, ref: Ref) -> np.ndarray:
        kind, key = self.lowered.locations[ref.tensor]
        if kind == "arena":
            return self.arena[key + ref.offset:]
        return self.buffers[(kind, key)][ref.offset:]

    def view(self, ref: Ref, dtype: np.dtype, shape, strides) -> np.ndarray:
        raw = self.bytes_at(ref)
        base = raw.view(np.uint8)[: raw.size - raw.size % dtype.itemsize].view(dtype)
        return as_strided(base, shape=tuple(shape), strides=tuple(s * dtype.itemsize for s in strides))

    def run(self) -> dict[str, np.ndarray]:
        for step in self.lowered.steps:
            for op in step.ops:
                getattr(self, "_" + type(op).__name__.lower())(op)
        out = {}
        for name in self.graph.output_names:
            info = self.lowered.infos[name]
            out[name] = self.buffers[("io", name)].view(info.dtype).reshape(info.shape).copy()
        return out

    def _copy(self, op: Copy) -> None:
        self.bytes_at(op.dst)[: op.nbytes] = self.bytes_at(op.src)[: op.nbytes]

    def _host(self, op: Host) -> None:
        infos, args = self.lowered.infos, []
        for name in op.node.inputs:
            info = infos.get(name) if name else None
            if info is None:
                args.append(None)
            elif info.value is not None:
                args.append(info.value)
            else:
                args.append(self.view(Ref(name), info.dtype, info.shape, _contig(info.shape)).copy())
        for name, value in zip(op.node.outputs, run_node(op.node, args)):
            if name:
                info = infos[name]
                self.view(Ref(name), info.dtype, info.shape, _contig(info.shape))[...] = value

    def _gemm(self, op: Gemm) -> None:
        a = self.view(op.a, np.dtype(np.float32), (op.batch, op.m, op.k), (op.a_strides[2], *op.a_strides[:2]))
        b = self.view(op.b, np.dtype(np.float32), (op.batch, op.k, op.n), (op.b_strides[2], *op.b_strides[:2]))
        y = self.view(op.y, np.dtype(np.float32), (op.batch, op.m, op.n), (op.m * op.n, op.n, 1))
        y[...] = op.alpha * (a.astype(np.float64) @ b) + (op.beta * y if op.beta else 0)

    def _launch(self, op: Launch) -> None:
        name = op.function
        args = [v for v, _ in op.args]
        if name.startswith("pw_"):
            self._pointwise(name, args)
        elif name.startswith("gather_w"):
            y, x, idx, outer, nidx, axis_len, inner = args
            word = int(name.split("_")[1][1:])
            idx_dtype = np.dtype(np.int64 if name.endswith("i64") else np.int32)
            ind = self.view(idx, idx_dtype, (nidx,), (1,)).astype(np.int64)
            ind = np.where(ind < 0, ind + axis_len, ind)
            src = self.view(x, np.dtype(np.uint8), (outer, axis_len, inner * word), (axis_len * inner * word, inner * word, 1))
            dst = self.view(y, np.dtype(np.uint8), (outer, nidx, inner * word), (nidx * inner * word, inner * word, 1))
            dst[...] = src[:, ind, :]
        else:
            self._row_kernel(name, args, op.grid[0])

    def _row_kernel(self, name: str, args: list, rows: int) -> None:
        f32 = np.dtype(np.float32)
        if name == "softmax_f32":
            x, y, cols = args
            v = self.view(x, f32, (rows, cols), (cols, 1)).astype(np.float64)
            e = np.exp(v - v.max(-1, keepdims=True))
            self.view(y, f32, (rows, cols), (cols, 1))[...] = e / e.sum(-1, keepdims=True)
        elif name == "layer_norm_f32":
            x, gamma, beta, y, cols, eps = args
            v = self.view(x, f32, (rows, cols), (cols, 1)).astype(np.float64)
            norm = (v - v.mean(-1, keepdims=True)) / np.sqrt(v.var(-1, keepdims=True) + eps)
            norm = norm * self.view(gamma, f32, (cols,), (1,))
            if isinstance(beta, Ref):
                norm = norm + self.view(beta, f32, (cols,), (1,))
            self.view(y, f32, (rows, cols), (cols, 1))[...] = norm
        elif name == "reduce_rows_f32":
            x, y, cols, scale = args
            self.view(y, f32, (rows,), (1,))[...] = self.view(x, f32, (rows, cols), (cols, 1)).sum(-1) * scale
        else:
            raise NotImplementedError(name)

    def _pointwise(self, name: str, args: list) -> None:
        y, x0, x1, x2, n, rank, ix = args
        parts = name.split("_")[1:]
        suffixes = [p for p in parts if p in _SUFFIX]
        op = "_".join(p for p in parts if p not in _SUFFIX)
        dtypes = [_SUFFIX[s] for s in suffixes]
        shape = [ix.shape[d] for d in range(rank)]
        ins = [self.view(ref, dt, shape, [getattr(ix, f"in{i}")[d] for d in range(rank)])
               for i, (ref, dt) in enumerate(zip((x0, x1, x2), dtypes[1:]))]
        out = self.view(y, dtypes[0], shape, [ix.out[d] for d in range(rank)])
        with np.errstate(all="ignore"):
            out[...] = np.asarray(_UFUNCS[op](*ins)).astype(dtypes[0])


def _bytes(value: np.ndarray) -> np.ndarray:
    return np.frombuffer(bytearray(np.ascontiguousarray(value).tobytes()), np.uint8)


def _contig(shape) -> list[int]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return list(reversed(strides))
