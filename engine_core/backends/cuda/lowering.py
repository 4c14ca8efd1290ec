"""Lowering: graph + concrete tensor infos -> device steps, tensor locations and the memory plan.

Pure Python (no GPU): the builder runs it at every profile's shapes to pick tactics, collect the
kernels to embed and size the arena; the runner runs it once per input-shape set and launches the
result. Each layer becomes one step: kernel launches, a GEMM, copies, or ``Host`` (the numpy
implementation with explicit copies; reported as tactic "host", never silent).
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine_core.backends.cuda.memory import MemoryPlan, liveness, plan_memory
from engine_core.backends.cuda.pointwise import (
    POINTWISE_OPS,
    PointwiseKernel,
    Unsupported,
    broadcast_strides,
    contiguous_strides,
    make_indexer,
    pointwise_kernel,
)
from engine_core.ir import Graph, Node
from engine_core.ops import TensorInfo
from engine_core.ops.registry import normalize_axis

VIEW_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})
F32 = np.dtype(np.float32)
THREADS = 256
GEMM_TACTICS = ("cublas", "kiln_gemm")


@dataclass(frozen=True)
class Ref:
    """A device pointer argument: a tensor's address plus a byte offset."""

    tensor: str
    offset: int = 0


@dataclass
class Launch:
    """One kernel launch; ``args`` are (value or Ref, ctypes type) pairs."""

    module: str
    function: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: list[tuple[Any, Any]]


@dataclass
class Gemm:
    """Y[b] = alpha * A[b] @ B[b] + beta * Y[b]; operands addressed by element strides (row, col, batch)."""

    a: Ref
    b: Ref
    y: Ref
    m: int
    n: int
    k: int
    batch: int
    a_strides: tuple[int, int, int]
    b_strides: tuple[int, int, int]
    alpha: float = 1.0
    beta: float = 0.0
    tactic: str = "cublas"

    @property
    def trans_a(self) -> bool:
        return self.a_strides[1] != 1

    @property
    def trans_b(self) -> bool:
        return self.b_strides[1] != 1


@dataclass
class Copy:
    dst: Ref
    src: Ref
    nbytes: int


@dataclass
class Host:
    """Run the numpy implementation: inputs device->host, outputs host->device."""

    node: Node


@dataclass
class Step:
    node: Node
    tactic: str
    ops: list[Launch | Gemm | Copy | Host]


@dataclass
class Lowered:
    steps: list[Step]
    #: tensor -> ("arena", offset) | ("io", name) | ("weight", name) | ("folded", name)
    locations: dict[str, tuple[str, Any]]
    memory: MemoryPlan
    #: host-known tensors (shape computations) that device steps read: uploaded per shape set
    folded: dict[str, np.ndarray]
    kernels: list[PointwiseKernel]
    infos: dict[str, TensorInfo]

    def tactics(self) -> dict[str, str]:
        return {s.node.name: s.tactic for s in self.steps}


def grid_for(n: int, threads: int = THREADS) -> tuple[int, int, int]:
    return (max(1, min((n + threads - 1) // threads, 1 << 20)), 1, 1)


@dataclass
class _Context:
    infos: Mapping[str, TensorInfo]
    graph_outputs: frozenset[str]
    gemm_choice: Mapping[str, str]
    kernels: list[PointwiseKernel] = field(default_factory=list)

    def info(self, name: str) -> TensorInfo:
        info = self.infos.get(name)
        if info is None or info.shape is None:
            raise Unsupported(f"tensor '{name}' has no known shape")
        return info

    def value(self, name: str) -> np.ndarray | None:
        info = self.infos.get(name)
        return None if info is None else info.value

    def pointwise(self, op: str, out: np.dtype, ins: list[np.dtype], variant: str = "") -> PointwiseKernel:
        kernel = pointwise_kernel(op, out, ins, variant)
        self.kernels.append(kernel)
        return kernel


def _launch_pointwise(kernel: PointwiseKernel, y: Ref, xs: list[Ref], shape, out_strides, in_strides) -> Launch:
    n = int(np.prod(shape, dtype=np.int64))
    ix, rank = make_indexer(shape, out_strides, in_strides)
    ptrs = [(x, ctypes.c_void_p) for x in xs] + [(0, ctypes.c_void_p)] * (3 - len(xs))
    grid = grid_for((n + 3) // 4 if rank <= 1 else n)  # rank <= 1: 4 elements per thread (pointwise.cu)
    return Launch("pointwise", kernel.name, grid, (THREADS, 1, 1),
                  [(y, ctypes.c_void_p), *ptrs, (n, ctypes.c_longlong), (rank, ctypes.c_int), (ix, type(ix))])


def copy_launch(ctx: _Context, dtype: np.dtype, dst: Ref, src: Ref, shape, dst_strides, src_strides) -> Launch:
    return _launch_pointwise(ctx.pointwise("Identity", dtype, [dtype]), dst, [src], shape, dst_strides, [src_strides])


# -- per-op lowering ------------------------------------------------------------------------------


def _lower_pointwise(node: Node, ctx: _Context) -> list:
    out = ctx.info(node.outputs[0])
    inputs = [name for name in node.inputs]
    variant = ""
    if node.op_type == "Clip":
        lo = len(inputs) > 1 and inputs[1] != ""
        hi = len(inputs) > 2 and inputs[2] != ""
        variant = ("_lo" if lo else "") + ("_hi" if hi else "")
        inputs = [inputs[0]] + ([inputs[1]] if lo else []) + ([inputs[2]] if hi else [])
        if node.opset < 11:
            raise Unsupported("Clip before opset 11 keeps bounds in attributes")
    if len(inputs) == 0 or len(inputs) > 3 or any(n == "" for n in inputs):
        raise Unsupported(f"{node.op_type} with {len(inputs)} inputs")
    infos = [ctx.info(n) for n in inputs]
    kernel = ctx.pointwise(node.op_type, out.dtype, [i.dtype for i in infos], variant)
    return [_launch_pointwise(kernel, Ref(node.outputs[0]), [Ref(n) for n in inputs], out.shape,
                              contiguous_strides(out.shape), [broadcast_strides(i.shape, out.shape) for i in infos])]


def _lower_view(node: Node, ctx: _Context) -> list:
    """Views alias their input; only a view that is a graph output needs a copy."""
    if node.outputs[0] not in ctx.graph_outputs:
        return []
    out = ctx.info(node.outputs[0])
    return [Copy(Ref(node.outputs[0]), Ref(node.inputs[0]), int(np.prod(out.shape)) * out.dtype.itemsize)]


def _lower_transpose(node: Node, ctx: _Context) -> list:
    x, out = ctx.info(node.inputs[0]), ctx.info(node.outputs[0])
    perm = node.attr("perm", None) or list(reversed(range(len(x.shape))))
    src = contiguous_strides(x.shape)
    return [copy_launch(ctx, x.dtype, Ref(node.outputs[0]), Ref(node.inputs[0]), out.shape,
                        contiguous_strides(out.shape), [src[p] for p in perm])]


def _lower_expand(node: Node, ctx: _Context) -> list:
    x, out = ctx.info(node.inputs[0]), ctx.info(node.outputs[0])
    return [copy_launch(ctx, x.dtype, Ref(node.outputs[0]), Ref(node.inputs[0]), out.shape,
                        contiguous_strides(out.shape), broadcast_strides(x.shape, out.shape))]


def _lower_concat(node: Node, ctx: _Context) -> list:
    out = ctx.info(node.outputs[0])
    axis = normalize_axis(node.attr("axis"), len(out.shape))
    out_strides = contiguous_strides(out.shape)
    launches, start = [], 0
    for name in node.inputs:
        x = ctx.info(name)
        if int(np.prod(x.shape)):
            dst = Ref(node.outputs[0], start * out_strides[axis] * out.dtype.itemsize)
            launches.append(copy_launch(ctx, x.dtype, dst, Ref(name), x.shape, out_strides, contiguous_strides(x.shape)))
        start += x.shape[axis]
    return launches


def _lower_slice(node: Node, ctx: _Context) -> list:
    x, out = ctx.info(node.inputs[0]), ctx.info(node.outputs[0])
    args = [ctx.value(n) if i < len(node.inputs) and n else None for i, n in enumerate(node.inputs[1:5])]
    if node.opset < 10 or args[0] is None or args[1] is None or any(
            a is None for a, n in zip(args[2:], node.inputs[3:5]) if n):
        raise Unsupported("Slice needs known starts/ends/axes/steps")
    starts, ends = args[0].tolist(), args[1].tolist()
    axes = args[2].tolist() if len(args) > 2 and args[2] is not None else list(range(len(starts)))
    steps = args[3].tolist() if len(args) > 3 and args[3] is not None else [1] * len(starts)
    strides = list(contiguous_strides(x.shape))
    base = 0
    for s, e, a, st in zip(starts, ends, axes, steps):
        a = normalize_axis(a, len(x.shape))
        first, _, _ = slice(s, e, st).indices(x.shape[a])
        base += first * strides[a]
        strides[a] *= st
    return [copy_launch(ctx, x.dtype, Ref(node.outputs[0]), Ref(node.inputs[0], base * x.dtype.itemsize), out.shape,
                        contiguous_strides(out.shape), strides)]


def _lower_gather(node: Node, ctx: _Context) -> list:
    data, idx = ctx.info(node.inputs[0]), ctx.info(node.inputs[1])
    ctx.info(node.outputs[0])
    if idx.dtype not in (np.dtype(np.int64), np.dtype(np.int32)):
        raise Unsupported(f"Gather indices of {idx.dtype}")
    axis = normalize_axis(node.attr("axis", 0), len(data.shape))
    outer = int(np.prod(data.shape[:axis], dtype=np.int64))
    inner_bytes = int(np.prod(data.shape[axis + 1:], dtype=np.int64)) * data.dtype.itemsize
    word = next(w for w in (16, 8, 4, 2, 1) if inner_bytes % w == 0)
    nidx = int(np.prod(idx.shape, dtype=np.int64))
    total = outer * nidx * (inner_bytes // word)
    if total == 0:
        return []
    suffix = "i64" if idx.dtype == np.int64 else "i32"
    return [Launch("gather", f"gather_w{word}_{suffix}", grid_for(total), (THREADS, 1, 1),
                   [(Ref(node.outputs[0]), ctypes.c_void_p), (Ref(node.inputs[0]), ctypes.c_void_p),
                    (Ref(node.inputs[1]), ctypes.c_void_p), (outer, ctypes.c_longlong), (nidx, ctypes.c_longlong),
                    (data.shape[axis], ctypes.c_longlong), (inner_bytes // word, ctypes.c_longlong)])]


def _rows_cols(shape: tuple[int, ...], axis: int) -> tuple[int, int]:
    return int(np.prod(shape[:axis], dtype=np.int64)), int(np.prod(shape[axis:], dtype=np.int64))


def _lower_softmax(node: Node, ctx: _Context) -> list:
    x = ctx.info(node.inputs[0])
    if x.dtype != F32 or not x.shape:
        raise Unsupported(f"Softmax over {x.dtype} rank {len(x.shape)}")
    axis = normalize_axis(node.attr("axis", -1 if node.opset >= 13 else 1), len(x.shape))
    if node.opset >= 13 and axis != len(x.shape) - 1:
        raise Unsupported("Softmax over a non-last axis")
    rows, cols = _rows_cols(x.shape, axis)
    if rows * cols == 0:
        return []
    return [Launch("softmax", "softmax_f32", (rows, 1, 1), (THREADS, 1, 1),
                   [(Ref(node.inputs[0]), ctypes.c_void_p), (Ref(node.outputs[0]), ctypes.c_void_p),
                    (cols, ctypes.c_longlong)])]


def _lower_layer_norm(node: Node, ctx: _Context) -> list:
    x = ctx.info(node.inputs[0])
    if x.dtype != F32 or any(node.outputs[1:]) or ctx.info(node.inputs[1]).dtype != F32:
        raise Unsupported("LayerNormalization: fp32 with only the Y output")
    axis = normalize_axis(node.attr("axis", -1), len(x.shape))
    rows, cols = _rows_cols(x.shape, axis)
    for name in node.inputs[1:3]:
        if name and int(np.prod(ctx.info(name).shape)) != cols:
            raise Unsupported("LayerNormalization scale/bias that broadcast")
    bias = (Ref(node.inputs[2]), ctypes.c_void_p) if len(node.inputs) > 2 and node.inputs[2] else (0, ctypes.c_void_p)
    if rows * cols == 0:
        return []
    return [Launch("layer_norm", "layer_norm_f32", (rows, 1, 1), (THREADS, 1, 1),
                   [(Ref(node.inputs[0]), ctypes.c_void_p), (Ref(node.inputs[1]), ctypes.c_void_p), bias,
                    (Ref(node.outputs[0]), ctypes.c_void_p), (cols, ctypes.c_longlong),
                    (float(node.attr("epsilon", 1e-5)), ctypes.c_float)])]


def _lower_reduce_mean(node: Node, ctx: _Context) -> list:
    x = ctx.info(node.inputs[0])
    if x.dtype != F32 or not x.shape:
        raise Unsupported("ReduceMean: fp32 rank >= 1 only")
    if len(node.inputs) > 1 and node.inputs[1]:  # axes as an input (opset 18, or normalized on import)
        axes = ctx.value(node.inputs[1])
        if axes is None:
            raise Unsupported("ReduceMean axes not known")
        axes = axes.reshape(-1).tolist()
    else:
        axes = node.attr("axes", None)
    if not axes:
        raise Unsupported("ReduceMean over all axes / noop_with_empty_axes")
    axes = sorted(normalize_axis(a, len(x.shape)) for a in axes)
    if axes != list(range(axes[0], len(x.shape))):
        raise Unsupported("ReduceMean over non-trailing axes")
    rows, cols = _rows_cols(x.shape, axes[0])
    if rows * cols == 0:
        raise Unsupported("ReduceMean of an empty tensor")
    return [Launch("reduce", "reduce_rows_f32", (rows, 1, 1), (THREADS, 1, 1),
                   [(Ref(node.inputs[0]), ctypes.c_void_p), (Ref(node.outputs[0]), ctypes.c_void_p),
                    (cols, ctypes.c_longlong), (1.0 / cols, ctypes.c_float)])]


def _gemm_tactic(node: Node, ctx: _Context) -> str:
    return ctx.gemm_choice.get(node.name, GEMM_TACTICS[0])


def _lower_matmul(node: Node, ctx: _Context) -> list:
    a, b, out = ctx.info(node.inputs[0]), ctx.info(node.inputs[1]), ctx.info(node.outputs[0])
    if a.dtype != F32 or b.dtype != F32 or len(a.shape) < 2 or len(b.shape) < 2:
        raise Unsupported("MatMul: fp32 operands of rank >= 2")
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    batch_shape = out.shape[:-2]
    batch = int(np.prod(batch_shape, dtype=np.int64))
    if len(b.shape) == 2:  # weights: fold A's batch into M
        m, batch, a_bs, b_bs = m * batch, 1, 0, 0
    else:
        a_bs, b_bs = (_batch_stride(x.shape, batch_shape, m_or_k * k_or_n)
                      for x, m_or_k, k_or_n in ((a, m, k), (b, k, n)))
    if m * n * batch == 0:
        return []
    return [Gemm(Ref(node.inputs[0]), Ref(node.inputs[1]), Ref(node.outputs[0]), m, n, k, batch,
                 (k, 1, a_bs), (n, 1, b_bs), tactic=_gemm_tactic(node, ctx))]


def _batch_stride(shape: tuple[int, ...], batch_shape: tuple[int, ...], matrix: int) -> int:
    """Element stride between batch matrices: full batch, or 0 when the operand broadcasts (all ones)."""
    own = tuple(shape[:-2])
    if int(np.prod(own, dtype=np.int64)) == 1:
        return 0
    if (1,) * (len(batch_shape) - len(own)) + own == tuple(batch_shape):
        return matrix
    raise Unsupported("MatMul with partially broadcast batch dims")


def _lower_gemm(node: Node, ctx: _Context) -> list:
    a, b, out = ctx.info(node.inputs[0]), ctx.info(node.inputs[1]), ctx.info(node.outputs[0])
    if a.dtype != F32 or b.dtype != F32:
        raise Unsupported("Gemm: fp32 only")
    ta, tb = node.attr("transA", 0), node.attr("transB", 0)
    m, n = out.shape
    k = a.shape[0] if ta else a.shape[1]
    a_strides = (1, m, 0) if ta else (k, 1, 0)
    b_strides = (1, k, 0) if tb else (n, 1, 0)
    if (ta and m == 1) or (tb and k == 1):
        raise Unsupported("Gemm with a transposed single-row operand")
    ops: list = []
    beta = 0.0
    if len(node.inputs) > 2 and node.inputs[2]:
        c = ctx.info(node.inputs[2])
        if c.dtype != F32:
            raise Unsupported("Gemm C of another dtype")
        ops.append(copy_launch(ctx, F32, Ref(node.outputs[0]), Ref(node.inputs[2]), out.shape,
                               contiguous_strides(out.shape), broadcast_strides(c.shape, out.shape)))
        beta = float(node.attr("beta", 1.0))
    if m * n:
        ops.append(Gemm(Ref(node.inputs[0]), Ref(node.inputs[1]), Ref(node.outputs[0]), m, n, k, 1, a_strides,
                        b_strides, float(node.attr("alpha", 1.0)), beta, _gemm_tactic(node, ctx)))
    return ops


_LOWER = {
    "Transpose": _lower_transpose, "Expand": _lower_expand, "Concat": _lower_concat, "Slice": _lower_slice,
    "Gather": _lower_gather, "Softmax": _lower_softmax, "LayerNormalization": _lower_layer_norm,
    "ReduceMean": _lower_reduce_mean, "MatMul": _lower_matmul, "Gemm": _lower_gemm,
}


def lower_node(node: Node, ctx: _Context) -> tuple[str, list]:
    """(tactic name, device ops) for one layer; ("host", [Host]) when it has no CUDA implementation."""
    try:
        if node.domain not in ("", "ai.onnx"):
            raise Unsupported(f"domain {node.domain}")
        if len(node.outputs) != 1 and node.op_type not in ("LayerNormalization",):
            raise Unsupported("multi-output layer")
        for name in node.outputs:
            ctx.info(name)
        if node.op_type in VIEW_OPS and node.inputs and node.inputs[0]:
            ctx.info(node.inputs[0])
            return "view", _lower_view(node, ctx)
        if node.op_type in POINTWISE_OPS:
            ops = _lower_pointwise(node, ctx)
            return f"pointwise:{ops[0].function}", ops
        if node.op_type in _LOWER:
            ops = _LOWER[node.op_type](node, ctx)
            gemm = next((o for o in ops if isinstance(o, Gemm)), None)
            return (f"gemm:{gemm.tactic}" if gemm else f"kernel:{node.op_type}"), ops
        raise Unsupported(f"no CUDA implementation of {node.op_type}")
    except Unsupported:
        return "host", [Host(node)]


# -- the whole graph --------------------------------------------------------------------------------


def lower_graph(graph: Graph, infos: Mapping[str, TensorInfo], gemm_choice: Mapping[str, str] | None = None,
                constants_on_device: frozenset[str] | None = None) -> Lowered:
    """Lower every layer that is not a pure shape computation, place tensors, plan the arena."""
    graph_outputs = frozenset(graph.output_names)
    ctx = _Context(infos, graph_outputs, gemm_choice or {})
    io = set(graph.input_names) | graph_outputs
    locations: dict[str, tuple[str, Any]] = {n: ("io", n) for n in io}
    for name in graph.constants:
        locations.setdefault(name, ("weight", name))
    alias: dict[str, str] = {}
    steps: list[Step] = []
    for node in graph.nodes:
        if node.outputs and all(infos.get(o) is not None and infos[o].value is not None for o in node.outputs if o):
            continue  # shape computation: its value is known on the host
        tactic, ops = lower_node(node, ctx)
        if tactic == "view" and not ops:
            alias[node.outputs[0]] = alias.get(node.inputs[0], node.inputs[0])
        steps.append(Step(node, tactic, ops))
    folded = {}
    for step in steps:
        for name in step.node.inputs:
            root = alias.get(name, name)
            if root and root not in locations and infos.get(root) is not None and infos[root].value is not None:
                folded[root] = np.ascontiguousarray(infos[root].value)
                locations[root] = ("folded", root)
    for name in graph.output_names:  # outputs that no step writes: copied from their source
        producer = next((s for s in steps if name in s.node.outputs), None)
        if producer is None and name in infos and infos[name].value is not None and name not in graph.input_names:
            folded.setdefault(f"{name}#value", np.ascontiguousarray(infos[name].value))
            locations[f"{name}#value"] = ("folded", f"{name}#value")
            steps.append(Step(_copy_node(name), "copy", [Copy(Ref(name), Ref(f"{name}#value"),
                                                               folded[f"{name}#value"].nbytes)]))
    sizes, sequence = {}, []
    for step in steps:
        ins = [alias.get(n, n) for n in step.node.inputs if n]
        outs = [n for n in step.node.outputs if n and n not in alias]
        sequence.append((ins, outs))
        for name in outs:
            if name not in locations:
                info = ctx.info(name)
                sizes[name] = int(np.prod(info.shape, dtype=np.int64)) * info.dtype.itemsize
    memory = plan_memory(liveness(sequence, sizes))
    for name, offset in memory.offsets.items():
        locations[name] = ("arena", offset)
    for name, root in alias.items():
        if name not in locations:
            locations[name] = locations.get(root, ("arena", 0))
    return Lowered(steps, locations, memory, folded, list(dict.fromkeys(ctx.kernels)), dict(infos))


def _copy_node(name: str) -> Node:
    return Node("Identity", [f"{name}#value"], [name], {}, f"copy_{name}", "", 1, [])
