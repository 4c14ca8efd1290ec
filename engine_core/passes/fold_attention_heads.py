"""4-D ``Attention`` between head split and head merge copies -> the 3-D (packed) form of the same op.

Exporters feed attention through copies that only change the layout:

    x [B, S, H*D] -> Reshape [B, S, H, D] -> Transpose(0, 2, 1, 3) -> Q/K/V [B, H, S, D] -> Attention
    Attention [B, H, S, Dv] -> Transpose(0, 2, 1, 3) -> Reshape [B, S, H*Dv]

ONNX Attention also takes Q/K/V as [B, S, heads * size] (``q_num_heads``/``kv_num_heads``) and then writes
[B, S, q_heads * Dv], so the four transposes disappear: the backend reads the heads through strides. Why
it is a pass of its own: fuse_attention matches the score arithmetic, this one the layout around it.

Q, K, V and the output are folded all together or not at all: the spec and the CPU op accept 3-D
inputs only as a complete set, and a 3-D Q always gives a 3-D output. A Reshape folds only when its
result is *proven* to be [x.shape[0], x.shape[1], H, D] (resp. [B, S, H*Dv]) for every input shape:
the pass evaluates shapes symbolically (dims of graph inputs and of unknown results are opaque symbols,
``(tensor, axis)``), which resolves the Shape -> Gather -> Unsqueeze -> Concat shapes that
torch.onnx.export writes for a dynamic batch, ``0`` entries (with ``allowzero``) and ``-1`` entries.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from engine_core.ir import Graph, Node
from engine_core.passes.pattern import Uses, is_op, origins

#: One dim: a known size, or an opaque symbol ``(tensor, axis)`` standing for that tensor's dim.
Sym = int | tuple[str, int]
SymShape = tuple[Sym, ...]

#: At most this many elements of a 1-D integer tensor are tracked as a (symbolic) value.
VALUE_LIMIT = 16
#: Ops whose (first) output has the shape of their first input.
_SAME_SHAPE = frozenset((
    "Identity", "Cast", "CastLike", "Relu", "LeakyRelu", "Elu", "Erf", "Tanh", "Sigmoid", "HardSigmoid", "Neg", "Abs",
    "Sqrt", "Exp", "Log", "Reciprocal", "Floor", "Ceil", "Round", "Sign", "Not", "Softplus", "Clip", "Gelu", "Softmax",
    "LogSoftmax", "LayerNormalization", "RMSNormalization", "Dropout", "QuantizeLinear", "DequantizeLinear"))
#: ONNX INT32 and INT64: a Cast to these keeps a shape value (a Cast to bool or float would not).
_INT_TYPES = (6, 7)
#: Elementwise ops with multidirectional broadcasting.
_BROADCAST = frozenset(("Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Where", "Equal", "Less", "Greater",
                        "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor"))


# -- symbolic shapes -------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Symbols:
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


def _node_shapes(graph: Graph, sym: _Symbols, node: Node) -> list[SymShape | None]:
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


def _transpose(graph: Graph, sym: _Symbols, node: Node, x: SymShape) -> list[SymShape | None]:
    perm = node.attr("perm") or list(range(len(x)))[::-1]
    return [tuple(x[p] for p in perm) if sorted(perm) == list(range(len(x))) else None]


def _reshape_rule(graph: Graph, sym: _Symbols, node: Node, x: SymShape) -> list[SymShape | None]:
    target = sym.values.get(node.inputs[1])
    return [None if target is None else _reshape(node.outputs[0], x, target, bool(node.attr("allowzero", 0)))]


def _shape(graph: Graph, sym: _Symbols, node: Node, x: SymShape) -> list[SymShape | None]:
    dims = list(x[slice(node.attr("start", 0), node.attr("end", None))])
    sym.values[node.outputs[0]] = dims
    return [(len(dims),)]


def _gather(graph: Graph, sym: _Symbols, node: Node, x: SymShape) -> list[SymShape | None]:
    indices, axis = node.inputs[1], node.attr("axis", 0)
    index_shape = sym.shape(indices)
    if index_shape is None or not -len(x) <= axis < len(x):
        return [None]
    axis %= len(x)
    data, picks = sym.values.get(node.inputs[0]), _ints(graph, indices)
    if data is not None and picks is not None and all(-len(data) <= i < len(data) for i in picks):
        sym.values[node.outputs[0]] = [data[i] for i in picks]
    return [(*x[:axis], *index_shape, *x[axis + 1:])]


def _unsqueeze(graph: Graph, sym: _Symbols, node: Node, x: SymShape) -> list[SymShape | None]:
    axes = _ints(graph, node.inputs[1]) if len(node.inputs) > 1 else None
    if axes is None:
        return [None]
    rank = len(x) + len(axes)
    new = {a % rank for a in axes if -rank <= a < rank}
    if node.inputs[0] in sym.values:
        sym.values[node.outputs[0]] = sym.values[node.inputs[0]]
    dims = iter(x)
    return [tuple(1 if i in new else next(dims) for i in range(rank)) if len(new) == len(axes) else None]


def _squeeze(graph: Graph, sym: _Symbols, node: Node, x: SymShape) -> list[SymShape | None]:
    axes = _ints(graph, node.inputs[1]) if len(node.inputs) > 1 else None
    if axes is None or not all(-len(x) <= a < len(x) for a in axes):
        return [None]
    drop = {a % len(x) for a in axes}
    if node.inputs[0] in sym.values:
        sym.values[node.outputs[0]] = sym.values[node.inputs[0]]
    return [tuple(d for i, d in enumerate(x) if i not in drop)]


def _concat(graph: Graph, sym: _Symbols, node: Node, x: SymShape) -> list[SymShape | None]:
    parts = [sym.shape(i) for i in node.inputs]
    if None in parts or any(len(p) != len(x) for p in parts) or not -len(x) <= node.attr("axis", 0) < len(x):
        return [None]
    axis = node.attr("axis", 0) % len(x)
    if len(x) == 1 and all(i in sym.values for i in node.inputs):
        sym.values[node.outputs[0]] = [d for i in node.inputs for d in sym.values[i]]
    sizes = [p[axis] for p in parts]
    size = sum(sizes) if all(isinstance(s, int) for s in sizes) else (node.outputs[0], axis)
    return [(*x[:axis], size, *x[axis + 1:])]


def _split(graph: Graph, sym: _Symbols, node: Node, x: SymShape) -> list[SymShape | None]:
    axis = node.attr("axis", 0)
    if not -len(x) <= axis < len(x):
        return [None] * len(node.outputs)
    axis %= len(x)
    sizes = _ints(graph, node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] else None
    return [(*x[:axis], sizes[i] if sizes and len(sizes) == len(node.outputs) else (out, axis), *x[axis + 1:])
            for i, out in enumerate(node.outputs)]


def _slice(graph: Graph, sym: _Symbols, node: Node, x: SymShape) -> list[SymShape | None]:
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


def _expand(graph: Graph, sym: _Symbols, node: Node, x: SymShape) -> list[SymShape | None]:
    target = sym.values.get(node.inputs[1])
    return [None if target is None else _broadcast(node.outputs[0], [x, tuple(target)])]


def _constant_of_shape(graph: Graph, sym: _Symbols, node: Node, x: SymShape) -> list[SymShape | None]:
    target = sym.values.get(node.inputs[0])
    return [None if target is None else tuple(target)]


def _matmul(graph: Graph, sym: _Symbols, node: Node, x: SymShape) -> list[SymShape | None]:
    w = sym.shape(node.inputs[1])
    if w is None or len(x) < 2 or len(w) < 2:
        return [None]
    return [(*_broadcast(node.outputs[0], [x[:-2], w[:-2]]), x[-2], w[-1])]


def _range(graph: Graph, sym: _Symbols, node: Node, x: SymShape) -> list[SymShape | None]:
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


def _attention(graph: Graph, sym: _Symbols, node: Node, q: SymShape) -> list[SymShape | None]:
    v = sym.shape(node.inputs[2])
    first = (q[0], q[1], q[2], v[3]) if v is not None and len(q) == len(v) == 4 else None
    return [first] + [None] * (len(node.outputs) - 1)


_RULES: dict[str, Callable[[Graph, _Symbols, Node, SymShape], list[SymShape | None]]] = {
    "Transpose": _transpose, "Reshape": _reshape_rule, "Shape": _shape, "Gather": _gather, "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze, "Concat": _concat, "Split": _split, "MatMul": _matmul, "Slice": _slice, "Range": _range,
    "Expand": _expand, "ConstantOfShape": _constant_of_shape, "Attention": _attention,
}


def symbolic_shapes(graph: Graph) -> _Symbols:
    """Shapes of every tensor the rules reach, valid for every input shape (one pass in graph order)."""
    sym = _Symbols({}, {})
    for value in graph.inputs:
        if value.is_tensor and value.shape is not None:
            sym.shapes[value.name] = tuple(d if isinstance(d, int) and d >= 0 else (value.name, i)
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


# -- the rewrite -----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Heads:
    """One head split ``source`` [B, S, heads * size] -> Reshape -> Transpose -> [B, heads, S, size]."""

    source: str
    heads: int
    size: int
    nodes: tuple[Node, Node]


def _transposed(uses: Uses, name: str) -> Node | None:
    """The Transpose(0, 2, 1, 3) writing ``name`` (swapping the seq and heads axes) when it is one."""
    node = uses.producers.get(name)
    return node if is_op(node, "Transpose") and list(node.attr("perm") or []) == [0, 2, 1, 3] else None


def _head_split(uses: Uses, sym: _Symbols, name: str) -> _Heads | None:
    """``name`` as a head split whose intermediates nothing else reads, with its head count and size."""
    transpose = _transposed(uses, name)
    if transpose is None or uses.sole_reader(name) is None:
        return None
    reshape = uses.producers.get(transpose.inputs[0])
    if not is_op(reshape, "Reshape") or uses.sole_reader(transpose.inputs[0]) is not transpose:
        return None
    source, split = sym.shape(reshape.inputs[0]), sym.shape(reshape.outputs[0])
    if source is None or len(source) != 3 or split is None or len(split) != 4 or split[:2] != source[:2]:
        return None
    heads, size = split[2], split[3]
    if not isinstance(heads, int) or not isinstance(size, int) or heads <= 0 or size <= 0:
        return None
    if isinstance(source[2], int) and source[2] != heads * size:
        return None
    return _Heads(reshape.inputs[0], heads, size, (reshape, transpose))


@dataclasses.dataclass(frozen=True)
class _Merge:
    """The head merge after Attention: Transpose(0, 2, 1, 3) -> Reshape, and Shape nodes reading the
    transposed tensor (torch's ``x.size()[:-2] + (hidden,)``), which are rewritten to read the packed Q."""

    transpose: Node
    reshape: Node
    shapes: tuple[Node, ...]


def _head_merge(uses: Uses, sym: _Symbols, name: str, packed: SymShape) -> _Merge | None:
    """The head merge turning ``name`` [B, H, S, Dv] into ``packed`` ([B, S, H*Dv]), if there is one."""
    transpose = uses.sole_reader(name)
    if not is_op(transpose, "Transpose") or list(transpose.attr("perm") or []) != [0, 2, 1, 3]:
        return None
    heads_last = transpose.outputs[0]
    readers = uses.consumers.get(heads_last, [])
    reshapes = [n for n in readers if is_op(n, "Reshape") and n.inputs[0] == heads_last]
    shapes = tuple(n for n in readers if is_op(n, "Shape"))
    if heads_last in uses.outputs or len(reshapes) != 1 or len(reshapes) + len(shapes) != len(readers):
        return None
    dims, merged = sym.shape(heads_last), sym.shape(reshapes[0].outputs[0])
    if dims is None or len(dims) != 4 or merged != packed or dims[:2] != packed[:2] or \
            not all(isinstance(d, int) for d in dims[2:]):
        return None
    return _Merge(transpose, reshapes[0], shapes)


def _shape_from_source(graph: Graph, node: Node, source: str, dims: SymShape) -> list[Node]:
    """Nodes computing ``node``'s Shape of a [B, S, H, Dv] tensor from ``source`` [B, S, *] and the
    known H, Dv: the tensor itself is gone once its Attention writes the packed form."""
    picked = list(range(4))[slice(node.attr("start", 0), node.attr("end", None))]
    axes = [a for a in picked if a < 2]
    sizes = np.array([dims[a] for a in picked if a >= 2], np.int64)
    out, origin = node.outputs[0], list(node.origin)
    if not sizes.size and axes:  # batch and/or sequence only
        return [Node("Shape", [source], [out], {"start": axes[0], "end": axes[-1] + 1}, node.name, "",
                     max(node.opset, 15), origin)]  # start/end: opset 15
    parts = [graph.add_constant(f"{out}_heads", sizes)]
    nodes = []
    if axes:
        parts.insert(0, graph.unique_name(f"{out}_leading"))
        nodes.append(Node("Shape", [source], [parts[0]], {"start": axes[0], "end": axes[-1] + 1},
                          f"{node.name}_leading", "", max(node.opset, 15), origin))
    return nodes + [Node("Concat", parts, [out], {"axis": 0}, node.name, "", max(node.opset, 13), origin)]


def _packed(uses: Uses, sym: _Symbols, attention: Node) -> tuple[Node, list[Node], list[Node]] | None:
    """The 3-D Attention replacing ``attention``, the nodes it covers (head split/merge copies) and the
    Shape nodes of the merge (each replaced by what ``_shape_from_source`` makes), or None."""
    if len(attention.inputs) < 3 or any(attention.inputs[4:]) or any(attention.outputs[1:]) \
            or "q_num_heads" in attention.attrs or "kv_num_heads" in attention.attrs:
        return None
    q, k, v = (_head_split(uses, sym, name) for name in attention.inputs[:3])
    if q is None or k is None or v is None or k.heads != v.heads or q.size != k.size or q.heads % k.heads:
        return None
    source = sym.shapes[q.source]
    merge = _head_merge(uses, sym, attention.outputs[0], (source[0], source[1], q.heads * v.size))
    if merge is None:
        return None
    covered = [attention, merge.transpose, merge.reshape, *{id(n): n for h in (q, k, v) for n in h.nodes}.values()]
    attrs = {**attention.attrs, "q_num_heads": q.heads, "kv_num_heads": k.heads}
    packed = dataclasses.replace(attention, inputs=[q.source, k.source, v.source, *attention.inputs[3:]],
                                 outputs=[merge.reshape.outputs[0], *attention.outputs[1:]], attrs=attrs)
    return packed, covered, list(merge.shapes)


def fold_attention_heads(graph: Graph) -> int:
    """Rewrite every 4-D Attention fed by head splits and read by a head merge to the 3-D form."""
    uses = Uses(graph)
    sym = symbolic_shapes(graph)
    order = {id(n): i for i, n in enumerate(graph.nodes)}
    replaced: dict[int, list[Node]] = {}  # node id -> the nodes taking its place (none: removed)
    folded = 0
    for node in list(graph.nodes):
        found = _packed(uses, sym, node) if is_op(node, "Attention") else None
        if found is None:
            continue
        packed, covered, shape_readers = found
        packed.origin = origins(sorted(covered, key=lambda n: order[id(n)]))
        replaced.update({id(n): [] for n in covered})
        replaced[id(node)] = [packed]
        folded += 1
        dims = sym.shapes[shape_readers[0].inputs[0]] if shape_readers else ()
        for reader in shape_readers:
            replaced[id(reader)] = _shape_from_source(graph, reader, packed.inputs[0], dims)
    graph.nodes = [m for n in graph.nodes for m in replaced.get(id(n), [n])]
    return folded
