"""Symbolic shapes for graph passes: dims valid for every input shape, before any shape is known.

Dims of graph inputs and of results no rule covers are opaque symbols ``(tensor, axis)``; small 1-D integer
tensors (shape arithmetic: Shape -> Gather -> Unsqueeze -> Concat, as torch.onnx.export writes for dynamic
axes) are tracked as symbolic values. Why: a pass that removes or reorders layout ops must *prove* a shape
(fold_attention_heads), or that an operand does not broadcast (fuse_attention's masks).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from engine_core.ir import Graph, Node

#: One dim: a known size, or an opaque symbol ``(tensor, axis)`` standing for that tensor's dim.
Sym = int | tuple[str, int]
SymShape = tuple[Sym, ...]

#: At most this many elements of a 1-D integer tensor are tracked as a (symbolic) value.
VALUE_LIMIT = 16
#: Ops whose (first) output has the shape of their first input.
_SAME_SHAPE = frozenset((
    "Identity", "Cast", "CastLike", "Relu", "LeakyRelu", "Elu", "Erf", "Tanh", "Sigmoid", "HardSigmoid", "Neg", "Abs",
    "Sqrt", "Exp", "Log", "Reciprocal", "Floor", "Ceil", "Round", "Sign", "Not", "Softplus", "Clip", "Gelu", "Softmax",
    "LogSoftmax", "LayerNormalization", "RMSNormalization", "Dropout", "QuantizeLinear", "DequantizeLinear", "Cos", "Sin",
    "IsNaN", "IsInf"))
#: ONNX INT32 and INT64: a Cast to these keeps a shape value (a Cast to bool or float would not).
_INT_TYPES = (6, 7)
#: Elementwise ops with multidirectional broadcasting.
_BROADCAST = frozenset(("Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Where", "Equal", "Less", "Greater",
                        "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor"))


@dataclasses.dataclass
class Symbols:
    """Symbolic shapes of tensors and symbolic values of small 1-D integer tensors (shape arithmetic)."""

    shapes: dict[str, SymShape]
    values: dict[str, list[Sym]]

    def shape(self, name: str) -> SymShape | None:
        return self.shapes.get(name) if name else None


def _broadcast(out: str, shapes: list[SymShape]) -> SymShape:
    """Multidirectional broadcast: a dim of 1 yields to the others, equal dims agree, else a new symbol."""
    rank = max(len(s) for s in shapes)
    dims: list[Sym] = []
    for axis in range(rank):
        column = {s[axis - rank + len(s)] for s in shapes if axis - rank + len(s) >= 0} - {1}
        sizes = {d for d in column if isinstance(d, int)}
        if not column:
            dims.append(1)
        elif sizes:  # valid broadcasting: every other dim is 1 or this size
            dims.append(sizes.pop() if len(sizes) == 1 else (out, axis))
        else:
            dims.append(column.pop() if len(column) == 1 else (out, axis))
    return tuple(dims)


def _reshape(out: str, source: SymShape, target: list[Sym], allowzero: bool) -> SymShape | None:
    """Reshape's result: 0 copies the source dim unless ``allowzero``; -1 is solved by cancelling
    the dims both sides share (a source dim of 0 makes the Reshape itself fail, so this is exact)."""
    dims: list[Sym] = []
    for axis, d in enumerate(target):
        if d == 0 and not allowzero:
            if axis >= len(source):
                return None
            d = source[axis]
        elif isinstance(d, int) and d < -1:
            return None
        dims.append(d)
    if dims.count(-1) > 1:
        return None
    if -1 in dims:
        dims[dims.index(-1)] = _solve(source, [d for d in dims if d != -1]) or (out, dims.index(-1))
    return tuple(dims)


def _solve(source: SymShape, others: list[Sym]) -> Sym | None:
    """The size X with prod(source) == prod(others) * X, cancelling the symbols both sides share."""
    rest, known = list(source), 1
    for d in others:
        if isinstance(d, int):
            known *= d
        elif d in rest:
            rest.remove(d)
        else:
            return None
    symbols = [d for d in rest if not isinstance(d, int)]
    total = math.prod(d for d in rest if isinstance(d, int))
    if known <= 0 or total % known:
        return None
    if not symbols:
        return total // known
    return symbols[0] if len(symbols) == 1 and total == known else None


def _ints(graph: Graph, name: str) -> list[int] | None:
    """A small integer constant as a list (a scalar gives one element)."""
    value = graph.constants.get(name) if name else None
    if not isinstance(value, np.ndarray) or value.dtype.kind not in "iu" or value.ndim > 1 or value.size > VALUE_LIMIT:
        return None
    return [int(v) for v in value.reshape(-1)]


def _node_shapes(graph: Graph, sym: Symbols, node: Node) -> list[SymShape | None]:
    """Symbolic shapes of ``node``'s outputs (None where no rule applies); records shape values too."""
    op, out = node.op_type, node.outputs[0]
    x = sym.shape(node.inputs[0]) if node.inputs else None
    if op in _SAME_SHAPE:
        if node.inputs[0] in sym.values and (op == "Identity" or op == "Cast" and node.attr("to") in _INT_TYPES):
            sym.values[out] = sym.values[node.inputs[0]]
        return [x]
    shapes = [sym.shape(i) for i in node.inputs if i]
    if op in _BROADCAST:
        return [_broadcast(out, shapes)] if shapes and None not in shapes else [None]
    if x is None:
        return [None] * len(node.outputs)
    rule = _RULES.get(op)
    return rule(graph, sym, node, x) if rule else [None] * len(node.outputs)


def _transpose(graph: Graph, sym: Symbols, node: Node, x: SymShape) -> list[SymShape | None]:
    perm = node.attr("perm") or list(range(len(x)))[::-1]
    return [tuple(x[p] for p in perm) if sorted(perm) == list(range(len(x))) else None]


def _reshape_rule(graph: Graph, sym: Symbols, node: Node, x: SymShape) -> list[SymShape | None]:
    target = sym.values.get(node.inputs[1])
    return [None if target is None else _reshape(node.outputs[0], x, target, bool(node.attr("allowzero", 0)))]


def _shape(graph: Graph, sym: Symbols, node: Node, x: SymShape) -> list[SymShape | None]:
    dims = list(x[slice(node.attr("start", 0), node.attr("end", None))])
    sym.values[node.outputs[0]] = dims
    return [(len(dims),)]


def _gather(graph: Graph, sym: Symbols, node: Node, x: SymShape) -> list[SymShape | None]:
    indices, axis = node.inputs[1], node.attr("axis", 0)
    index_shape = sym.shape(indices)
    if index_shape is None or not -len(x) <= axis < len(x):
        return [None]
    axis %= len(x)
    data, picks = sym.values.get(node.inputs[0]), _ints(graph, indices)
    if data is not None and picks is not None and all(-len(data) <= i < len(data) for i in picks):
        sym.values[node.outputs[0]] = [data[i] for i in picks]
    return [(*x[:axis], *index_shape, *x[axis + 1:])]


def _unsqueeze(graph: Graph, sym: Symbols, node: Node, x: SymShape) -> list[SymShape | None]:
    axes = _ints(graph, node.inputs[1]) if len(node.inputs) > 1 else None
    if axes is None:
        return [None]
    rank = len(x) + len(axes)
    new = {a % rank for a in axes if -rank <= a < rank}
    if node.inputs[0] in sym.values:
        sym.values[node.outputs[0]] = sym.values[node.inputs[0]]
    dims = iter(x)
    return [tuple(1 if i in new else next(dims) for i in range(rank)) if len(new) == len(axes) else None]


def _squeeze(graph: Graph, sym: Symbols, node: Node, x: SymShape) -> list[SymShape | None]:
    axes = _ints(graph, node.inputs[1]) if len(node.inputs) > 1 else None
    if axes is None or not all(-len(x) <= a < len(x) for a in axes):
        return [None]
    drop = {a % len(x) for a in axes}
    if node.inputs[0] in sym.values:
        sym.values[node.outputs[0]] = sym.values[node.inputs[0]]
    return [tuple(d for i, d in enumerate(x) if i not in drop)]


def _concat(graph: Graph, sym: Symbols, node: Node, x: SymShape) -> list[SymShape | None]:
    parts = [sym.shape(i) for i in node.inputs]
    if None in parts or any(len(p) != len(x) for p in parts) or not -len(x) <= node.attr("axis", 0) < len(x):
        return [None]
    axis = node.attr("axis", 0) % len(x)
    if len(x) == 1 and all(i in sym.values for i in node.inputs):
        sym.values[node.outputs[0]] = [d for i in node.inputs for d in sym.values[i]]
    sizes = [p[axis] for p in parts]
    size = sum(sizes) if all(isinstance(s, int) for s in sizes) else (node.outputs[0], axis)
    return [(*x[:axis], size, *x[axis + 1:])]


def _split(graph: Graph, sym: Symbols, node: Node, x: SymShape) -> list[SymShape | None]:
    axis = node.attr("axis", 0)
    if not -len(x) <= axis < len(x):
        return [None] * len(node.outputs)
    axis %= len(x)
    sizes = _ints(graph, node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] else None
    return [(*x[:axis], sizes[i] if sizes and len(sizes) == len(node.outputs) else (out, axis), *x[axis + 1:])
            for i, out in enumerate(node.outputs)]


def _slice(graph: Graph, sym: Symbols, node: Node, x: SymShape) -> list[SymShape | None]:
    """Sliced axes get new symbols (or sizes, for constant bounds on a known size), the others are kept;
    1-D shape values with constant bounds and step 1 (torch's ``x.size()[:-2]``) are sliced too."""
    starts, ends = _ints(graph, node.inputs[1]), _ints(graph, node.inputs[2])
    axes = _ints(graph, node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] else None
    steps = _ints(graph, node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] else None
    count = len(starts) if starts is not None else len(axes) if axes is not None else None
    if count is None or (axes is None and count > len(x)) or any(not -len(x) <= a < len(x) for a in axes or []):
        return [None]
    axes = [a % len(x) for a in axes] if axes is not None else list(range(count))
    out = list(x)
    for position, axis in enumerate(axes):
        out[axis] = (node.outputs[0], axis)
        if starts is not None and ends is not None and isinstance(x[axis], int) and (steps is None or steps[position]):
            step = steps[position] if steps is not None else 1
            out[axis] = len(range(x[axis])[slice(starts[position], ends[position], step)])
    value = sym.values.get(node.inputs[0])
    if value is not None and starts is not None and ends is not None and len(x) == 1 and steps in (None, [1]):
        sym.values[node.outputs[0]] = value[starts[0]:ends[0]]
        out = [len(sym.values[node.outputs[0]])]
    return [tuple(out)]


def _expand(graph: Graph, sym: Symbols, node: Node, x: SymShape) -> list[SymShape | None]:
    target = sym.values.get(node.inputs[1])
    return [None if target is None else _broadcast(node.outputs[0], [x, tuple(target)])]


def _constant_of_shape(graph: Graph, sym: Symbols, node: Node, x: SymShape) -> list[SymShape | None]:
    target = sym.values.get(node.inputs[0])
    return [None if target is None else tuple(target)]


def _matmul(graph: Graph, sym: Symbols, node: Node, x: SymShape) -> list[SymShape | None]:
    w = sym.shape(node.inputs[1])
    if w is None or len(x) < 2 or len(w) < 2:
        return [None]
    return [(*_broadcast(node.outputs[0], [x[:-2], w[:-2]]), x[-2], w[-1])]


def _gemm(graph: Graph, sym: Symbols, node: Node, a: SymShape) -> list[SymShape | None]:
    """[M, K] x [K, N] (either transposed by its attribute) -> [M, N]: exporters write Linear on 2-D inputs (GPT-2's
    Conv1D, ViT's out_proj) as Gemm."""
    b = sym.shape(node.inputs[1])
    if b is None or len(a) != 2 or len(b) != 2:
        return [None]
    return [(a[1] if node.attr("transA", 0) else a[0], b[0] if node.attr("transB", 0) else b[1])]


def _conv(graph: Graph, sym: Symbols, node: Node, x: SymShape) -> list[SymShape | None]:
    """[N, C, *spatial] with explicit pads (auto_pad NOTSET): the front ends of ViT (patches) and Whisper (Conv1d,
    parsed as 2-D)."""
    w = sym.shape(node.inputs[1])
    n = len(x) - 2
    auto_pad = node.attr("auto_pad", "NOTSET")
    if w is None or len(w) != len(x) or n < 1 or (auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad) \
            != "NOTSET" or not all(isinstance(d, int) for d in (*x[2:], *w[2:])):
        return [None]
    pads, strides = node.attr("pads") or [0] * (2 * n), node.attr("strides") or [1] * n
    dilations = node.attr("dilations") or [1] * n
    spatial = tuple((x[2 + i] + pads[i] + pads[i + n] - dilations[i] * (w[2 + i] - 1) - 1) // strides[i] + 1
                    for i in range(n))
    return [(x[0], w[0], *spatial)]


def _range(graph: Graph, sym: Symbols, node: Node, x: SymShape) -> list[SymShape | None]:
    """Range(0, n, 1) has n elements (torch's position ids); other Ranges only with known numbers."""
    start, limit, delta = (sym.values.get(i) for i in node.inputs[:3])
    if start is None or limit is None or delta is None or not len(start) == len(limit) == len(delta) == 1:
        return [None]
    (start,), (limit,), (delta,) = start, limit, delta
    if (start, delta) == (0, 1) and not isinstance(limit, int):
        return [(limit,)]
    if isinstance(start, int) and isinstance(limit, int) and isinstance(delta, int) and delta:
        return [(max(-(-(limit - start) // delta), 0),)]
    return [None]


def _attention(graph: Graph, sym: Symbols, node: Node, q: SymShape) -> list[SymShape | None]:
    v = sym.shape(node.inputs[2])
    first = (q[0], q[1], q[2], v[3]) if v is not None and len(q) == len(v) == 4 else None
    return [first] + [None] * (len(node.outputs) - 1)


_RULES: dict[str, Callable[[Graph, Symbols, Node, SymShape], list[SymShape | None]]] = {
    "Transpose": _transpose, "Reshape": _reshape_rule, "Shape": _shape, "Gather": _gather, "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze, "Concat": _concat, "Split": _split, "MatMul": _matmul, "Slice": _slice, "Range": _range,
    "Expand": _expand, "ConstantOfShape": _constant_of_shape, "Attention": _attention, "Gemm": _gemm, "Conv": _conv,
}


def symbolic_shapes(graph: Graph) -> Symbols:
    """Shapes of every tensor the rules reach, valid for every input shape (one pass in graph order)."""
    sym = Symbols({}, {})
    for value in graph.inputs:
        if value.is_tensor and value.shape is not None:
            # a named dim (dim_param) is one symbol wherever it appears: ONNX names equal dims alike
            sym.shapes[value.name] = tuple(d if isinstance(d, int) and d >= 0 else
                                           (f"dim:{d}", -1) if isinstance(d, str) and d else (value.name, i)
                                           for i, d in enumerate(value.shape))
    for name, value in graph.constants.items():
        sym.shapes[name] = tuple(int(d) for d in value.shape)
        ints = _ints(graph, name)
        if ints is not None:
            sym.values[name] = list(ints)
    for node in graph.nodes:
        if node.domain not in ("", "ai.onnx") or not node.outputs:
            continue
        for name, shape in zip(node.outputs, _node_shapes(graph, sym, node)):
            if name and shape is not None:
                sym.shapes[name] = shape
    return sym
