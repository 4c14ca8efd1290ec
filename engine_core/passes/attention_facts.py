"""What fuse_attention must prove about an attention block's operands, worked out backwards on demand.

symbolic_shapes runs forward over the whole graph and loses a tensor (and all that follows it) at the first op it
has no rule for: a Conv front end (ViT, Whisper), Cos/Sin of rotary embeddings (Llama), integer arithmetic on shape
values (``embed_dim // num_heads``, ``num_kv_heads * n_rep``). An attention block needs only a few facts, and those
a short walk back from its operands gives:

- ``rank``: a tensor's rank from the ops' rank rules (a Reshape's target length, a Transpose's perm, the inputs of
  an elementwise op) where no shape is known;
- ``value``: a small 1-D integer tensor (shape arithmetic) as dims: ints, or symbols ``(tensor, axis)`` for a dim of
  a tensor (symbolic_shapes' convention, which it uses where it knows more), through Shape / Gather / Slice / Concat /
  Unsqueeze / Cast, integer arithmetic and the ``Where(Equal(shape, -1), 1, shape)`` torch writes for ``expand``;
- ``factor``: a one-element float tensor as ``coef * d ** power``, d a dim read with Shape: the scale torch's sdpa
  computes at run time from ``q.shape[-1]`` and applies as ``sqrt(scale)`` to Q and to K^T (the caller checks that
  d is the head size).
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import TypeGuard

import numpy as np

from engine_core.ir import Graph, Node
from engine_core.passes.pattern import Uses
from engine_core.passes.symbolic import Sym, Symbols

#: Ops whose output has the rank (and, but for Softmax-like ops' values, the shape) of their first input.
UNARY = frozenset(("Identity", "Cast", "CastLike", "Neg", "Abs", "Relu", "LeakyRelu", "Elu", "Sigmoid", "HardSigmoid",
                   "Tanh", "Erf", "Gelu", "Softplus", "Exp", "Log", "Sqrt", "Reciprocal", "Cos", "Sin", "Floor",
                   "Ceil", "Round", "Sign", "Not", "IsNaN", "IsInf", "Clip", "Softmax", "LogSoftmax", "Dropout",
                   "LayerNormalization", "RMSNormalization", "QuantizeLinear", "DequantizeLinear"))
#: Ops whose output has the rank of their first input.
_SAME_RANK = UNARY | {"Concat", "Slice", "Split", "Conv", "ConvTranspose", "MaxPool", "AveragePool", "GlobalAveragePool",
                      "BatchNormalization", "InstanceNormalization", "Pad", "Resize", "Tile", "CumSum"}
#: Elementwise ops with multidirectional broadcasting: the output rank is the largest input rank.
BROADCAST = frozenset(("Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Where", "Equal", "Less", "Greater",
                       "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor"))
#: ONNX float types (a Cast to one keeps a scale's value, up to rounding) and integer types (a dim's).
FLOAT_TYPES, INT_TYPES = frozenset((1, 10, 11, 16)), frozenset((6, 7))
#: Ops that only reshape a one-element tensor (or a 1-D shape value) without changing its elements.
_VIEWS = ("Identity", "Unsqueeze", "Squeeze", "Reshape", "Flatten")


@dataclasses.dataclass(frozen=True)
class Monomial:
    """``coef * dim ** power``: a scalar that depends on at most one dim (the head size) read at run time."""

    coef: float
    power: Fraction = Fraction(0)
    dim: Sym | None = None

    def times(self, other: Monomial) -> Monomial | None:
        """The product, or None when the two depend on different dims."""
        if self.power and other.power and self.dim != other.dim:
            return None
        power = self.power + other.power
        return Monomial(self.coef * other.coef, power, (self.dim if self.power else other.dim) if power else None)

    def inverse(self) -> Monomial | None:
        return Monomial(1.0 / self.coef, -self.power, self.dim) if self.coef else None

    def raised(self, exponent: Fraction) -> Monomial | None:
        if self.coef < 0 and exponent.denominator != 1 or self.coef == 0 and exponent < 0:
            return None
        return Monomial(self.coef ** float(exponent), self.power * exponent, self.dim if self.power else None)


class Facts:
    """Ranks, shape values and scale factors of one graph's tensors, each worked out once (per pass run)."""

    def __init__(self, graph: Graph, uses: Uses, sym: Symbols) -> None:
        self.graph, self.uses, self.sym = graph, uses, sym
        self._ranks: dict[str, int | None] = {}
        self._values: dict[str, list[Sym] | None] = {}
        self._dims: dict[tuple[str, int], Sym | None] = {}

    # -- ranks --------------------------------------------------------------------------------------------------

    def rank(self, name: str) -> int | None:
        if name not in self._ranks:
            self._ranks[name] = None  # a cycle (malformed graph) reads as unknown
            self._ranks[name] = self._rank(name)
        return self._ranks[name]

    def _rank(self, name: str) -> int | None:
        shape = self.sym.shape(name)
        if shape is not None:
            return len(shape)
        if name in self.graph.constants:
            return int(self.graph.constants[name].ndim)
        node = self.uses.producers.get(name)
        if node is None:
            value = next((v for v in self.graph.inputs if v.name == name), None)
            return len(value.shape) if value is not None and value.shape is not None else None
        if not _standard(node) or name != node.outputs[0] and node.op_type != "Split":
            return None
        return self._rank_rule(node)

    def _rank_rule(self, node: Node) -> int | None:
        op, inputs = node.op_type, [i for i in node.inputs if i]
        if op in _SAME_RANK:
            return self.rank(inputs[0])
        if op in BROADCAST or op == "MatMul":
            return _max(*(self.rank(i) for i in inputs))
        rule = _RANK_RULES.get(op)
        return rule(self, node, inputs) if rule else None

    # -- shape values -------------------------------------------------------------------------------------------

    def dim(self, name: str, axis: int) -> Sym | None:
        """Dim ``axis`` of ``name`` (negative counts from the end): what symbolic_shapes knows, else what the op shows
        (a Transpose's input dim, a Reshape's target, a constant Slice of a known size, ...), else its symbol."""
        rank = self.rank(name)
        if rank is None or not -rank <= axis < rank:
            return None
        axis %= rank
        if (name, axis) not in self._dims:
            self._dims[name, axis] = (name, axis)  # a cycle (malformed graph) reads as the symbol
            self._dims[name, axis] = self._dim(name, rank, axis)
        return self._dims[name, axis]

    def _dim(self, name: str, rank: int, axis: int) -> Sym:
        shape = self.sym.shape(name)
        known = shape[axis] if shape is not None else None
        if isinstance(known, tuple) and known != (name, axis) and known[1] >= 0:
            resolved = self.dim(*known)  # symbolic_shapes' symbol for a dim of another tensor: what is it?
            return known if resolved is None else resolved
        if known is not None and known != (name, axis):
            return known
        node = self.uses.producers.get(name)
        if _standard(node) and name == node.outputs[0]:
            rule = _DIM_RULES.get("Unary" if node.op_type in UNARY else "Broadcast" if node.op_type in BROADCAST
                                  else node.op_type)
            found = rule(self, node, rank, axis) if rule else None
            if found is not None:
                return found
        value = self.value(name) if rank == 1 else None
        return len(value) if value is not None else (name, axis)

    def broadcast_dim(self, node: Node, rank: int, axis: int) -> Sym | None:
        """Dim ``axis`` of an elementwise op's output: a size > 1 of an input (the others must be 1 or the same), or
        the dim all inputs agree on; else its symbol."""
        dims: set[Sym | None] = set()
        for name in (i for i in node.inputs if i):
            inner = self.rank(name)
            if inner is None:
                dims.add(None)
            else:  # right-aligned: an input of lower rank is 1 along the leading axes
                dims.add(self.dim(name, axis - rank + inner) if axis - rank + inner >= 0 else 1)
        sizes = {d for d in dims if isinstance(d, int) and d > 1}
        if len(sizes) == 1:
            return sizes.pop()
        rest = dims - {1}
        if not rest:
            return 1
        return rest.pop() if len(rest) == 1 and None not in rest else (node.outputs[0], axis)

    def ints(self, name: str) -> list[int] | None:
        """A constant integer tensor (at most 1-D) as a list."""
        value = self.graph.constants.get(name)
        if not isinstance(value, np.ndarray) or value.dtype.kind not in "iub" or value.ndim > 1 or value.size > 64:
            return None
        return [int(v) for v in value.reshape(-1)]

    def value(self, name: str) -> list[Sym] | None:
        """The elements of a small integer tensor of rank <= 1 as dims (a 0-D tensor gives one element)."""
        if name not in self._values:
            self._values[name] = None
            self._values[name] = self._value(name)
        return self._values[name]

    def _value(self, name: str) -> list[Sym] | None:
        constant = self.ints(name)
        if constant is not None:
            return list(constant)
        if name in self.sym.values:
            return list(self.sym.values[name])
        node = self.uses.producers.get(name)
        if not _standard(node) or name != node.outputs[0]:
            return None
        if node.op_type == "Shape":
            rank = self.rank(node.inputs[0])
            if rank is None:
                return None
            dims = [self.dim(node.inputs[0], a) for a in range(rank)[slice(node.attr("start", 0), node.attr("end"))]]
            return [d for d in dims if d is not None] if None not in dims else None
        if node.op_type in _VIEWS or node.op_type == "Cast" and node.attr("to") in INT_TYPES:
            rank = self.rank(name)  # a view keeps the elements in order; a 2-D one would not be a list of dims
            return self.value(node.inputs[0]) if rank is not None and rank <= 1 else None
        rule = _VALUE_RULES.get(node.op_type)
        return rule(self, node) if rule else None

    # -- scale factors ------------------------------------------------------------------------------------------

    def factor(self, name: str) -> Monomial | None:
        """A one-element float tensor as a ``Monomial`` of at most one dim read with Shape (the head size, for a
        scale), or None when it is something else (a per-element tensor, a product of two dims)."""
        value = self.graph.constants.get(name)
        if isinstance(value, np.ndarray):
            return Monomial(float(value.reshape(-1)[0].astype(np.float64))) if value.size == 1 else None
        node = self.uses.producers.get(name)
        if not _standard(node) or name != node.outputs[0]:
            return None
        if node.op_type == "Cast" and node.attr("to") in FLOAT_TYPES or node.op_type in _VIEWS:
            return self.factor(node.inputs[0])
        if node.op_type in ("Sqrt", "Reciprocal"):
            inner = self.factor(node.inputs[0])
            return None if inner is None else inner.raised(Fraction(1, 2) if node.op_type == "Sqrt" else Fraction(-1))
        if node.op_type in ("Mul", "Div") and len(node.inputs) == 2:
            a, b = (self.factor(i) for i in node.inputs)
            if b is not None and node.op_type == "Div":
                b = b.inverse()
            return None if a is None or b is None else a.times(b)
        if node.op_type == "Pow":
            base, exponent = self.factor(node.inputs[0]), self.graph.constants.get(node.inputs[1])
            if base is None or exponent is None or exponent.size != 1:
                return None
            return base.raised(Fraction(float(exponent.reshape(-1)[0])).limit_denominator(64))
        dims = self.value(name)  # an integer: a dim read with Shape, or arithmetic on one
        if dims is None or len(dims) != 1:
            return None
        return Monomial(float(dims[0])) if isinstance(dims[0], int) else Monomial(1.0, Fraction(1), dims[0])


def _transpose_rank(facts: Facts, node: Node, inputs: list[str]) -> int | None:
    return len(node.attr("perm")) if node.attr("perm") else facts.rank(inputs[0])


def _target_rank(facts: Facts, node: Node, inputs: list[str]) -> int | None:
    """Reshape, ConstantOfShape: the length of the target shape; Expand: the larger of that and the input rank."""
    target = facts.value(inputs[-1])
    if target is None:
        return None
    return len(target) if node.op_type != "Expand" else _max(facts.rank(inputs[0]), len(target))


def _axes_rank(facts: Facts, node: Node, inputs: list[str]) -> int | None:
    """Unsqueeze, Squeeze and reductions: the input rank, plus or minus the axes (none kept: all of them)."""
    axes = facts.ints(inputs[1]) if len(inputs) > 1 else node.attr("axes")
    rank = facts.rank(inputs[0])
    if rank is None or node.op_type.startswith("Reduce") and node.attr("keepdims", 1):
        return rank
    if axes is None:
        return 0 if node.op_type.startswith("Reduce") else None
    return rank + len(axes) if node.op_type == "Unsqueeze" else rank - len(axes)


def _gather_rank(facts: Facts, node: Node, inputs: list[str]) -> int | None:
    data, index = facts.rank(inputs[0]), facts.rank(inputs[1])
    return None if data is None or index is None else data - 1 + index


_RANK_RULES = {"Transpose": _transpose_rank, "Reshape": _target_rank, "Expand": _target_rank,
               "ConstantOfShape": _target_rank, "Unsqueeze": _axes_rank, "Squeeze": _axes_rank,
               "Gather": _gather_rank, "Shape": lambda facts, node, inputs: 1, "Gemm": lambda facts, node, inputs: 2,
               **{op: _axes_rank for op in ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd",
                                            "ReduceL1", "ReduceL2", "ReduceSumSquare", "ReduceLogSumExp")}}


def _input_dim(facts: Facts, node: Node, rank: int, axis: int) -> Sym | None:
    """Ops that keep their input's dims (elementwise on one tensor); Concat on another axis."""
    return facts.dim(node.inputs[0], axis) if node.op_type != "Concat" or node.attr("axis") % rank != axis else None


def _transpose_dim(facts: Facts, node: Node, rank: int, axis: int) -> Sym | None:
    perm = node.attr("perm")
    return facts.dim(node.inputs[0], int(perm[axis])) if perm else None


def _reshape_dim(facts: Facts, node: Node, rank: int, axis: int) -> Sym | None:
    target = facts.value(node.inputs[1])
    return target[axis] if target is not None and len(target) == rank and target[axis] not in (0, -1) else None


def _unsqueeze_dim(facts: Facts, node: Node, rank: int, axis: int) -> Sym | None:
    axes = facts.ints(node.inputs[1]) if len(node.inputs) > 1 else node.attr("axes")
    if axes is None:
        return None
    axes = sorted(int(a) % rank for a in axes)
    return 1 if axis in axes else facts.dim(node.inputs[0], axis - sum(a < axis for a in axes))


def _gather_dim(facts: Facts, node: Node, rank: int, axis: int) -> Sym | None:
    """[data dims before the axis, the index dims, data dims after it]."""
    data, index = facts.rank(node.inputs[0]), facts.rank(node.inputs[1])
    if data is None or index is None:
        return None
    at = int(node.attr("axis", 0)) % data
    if axis < at:
        return facts.dim(node.inputs[0], axis)
    return facts.dim(node.inputs[1], axis - at) if axis < at + index else facts.dim(node.inputs[0], axis - index + 1)


def _slice_dim(facts: Facts, node: Node, rank: int, axis: int) -> Sym | None:
    """An axis the Slice does not touch keeps its dim; one it slices with known bounds of a known size, the count."""
    starts, ends = facts.value(node.inputs[1]), facts.value(node.inputs[2])
    axes = facts.value(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] else list(range(len(starts or [])))
    steps = facts.value(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] else [1] * len(axes or [])
    if starts is None or ends is None or axes is None or steps is None:
        return None
    sliced = [a % rank for a in axes if isinstance(a, int)]
    if len(sliced) != len(axes):
        return None
    if axis not in sliced:
        return facts.dim(node.inputs[0], axis)
    i = sliced.index(axis)
    size, start, end, step = facts.dim(node.inputs[0], axis), starts[i], ends[i], steps[i]
    if not (isinstance(size, int) and isinstance(start, int) and isinstance(end, int) and isinstance(step, int)) or \
            not step:
        return None
    return len(range(size)[start:end:step])


def _matmul_dim(facts: Facts, node: Node, rank: int, axis: int) -> Sym | None:
    """The rows of A, the columns of B (the batch dims broadcast: no rule)."""
    return facts.dim(node.inputs[0], -2) if axis == rank - 2 else facts.dim(node.inputs[1], -1) if axis == rank - 1 \
        else None


_DIM_RULES = {"Unary": _input_dim, "Concat": _input_dim, "Broadcast": Facts.broadcast_dim, "Transpose": _transpose_dim,
              "Reshape": _reshape_dim, "Unsqueeze": _unsqueeze_dim, "Gather": _gather_dim, "Slice": _slice_dim,
              "MatMul": _matmul_dim}


def _standard(node: Node | None) -> TypeGuard[Node]:
    return node is not None and node.domain in ("", "ai.onnx")


def _concat_value(facts: Facts, node: Node) -> list[Sym] | None:
    dims: list[Sym] = []
    for part in (facts.value(i) for i in node.inputs):
        if part is None:
            return None
        dims += part
    return dims


def _gather_value(facts: Facts, node: Node) -> list[Sym] | None:
    data, picks = facts.value(node.inputs[0]), facts.ints(node.inputs[1])
    if node.attr("axis", 0) != 0 or data is None or picks is None or not all(-len(data) <= i < len(data)
                                                                              for i in picks):
        return None
    return [data[i] for i in picks]


def _slice_value(facts: Facts, node: Node) -> list[Sym] | None:
    data, starts, ends = facts.value(node.inputs[0]), facts.ints(node.inputs[1]), facts.ints(node.inputs[2])
    steps = facts.ints(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] else [1]
    if data is None or starts is None or ends is None or len(starts) != 1 or len(ends) != 1 or steps != [1]:
        return None
    return data[starts[0]:ends[0]]


def _constant_of_shape_value(facts: Facts, node: Node) -> list[Sym] | None:
    """A 1-D ConstantOfShape of an integer fill (torch's ``ones`` for the expand idiom)."""
    shape, fill = facts.value(node.inputs[0]), node.attr("value")
    fill_value = np.asarray(fill if fill is not None else 0).reshape(-1)
    if shape is None or len(shape) != 1 or not isinstance(shape[0], int) or fill_value.size != 1 or \
            fill_value.dtype.kind not in "iub":
        return None
    return [int(fill_value[0])] * shape[0]


def _elementwise_value(facts: Facts, node: Node) -> list[Sym] | None:
    args = [facts.value(i) for i in node.inputs]
    known = [a for a in args if a is not None]
    return _elementwise(node.op_type, node.outputs[0], known) if len(known) == len(args) else None


_VALUE_RULES = {"Concat": _concat_value, "Gather": _gather_value, "Slice": _slice_value,
                "ConstantOfShape": _constant_of_shape_value,
                **{op: _elementwise_value for op in ("Mul", "Add", "Sub", "Div", "Equal", "Where")}}


def _max(*ranks: int | None) -> int | None:
    return None if not ranks or any(r is None for r in ranks) else max(r for r in ranks if r is not None)


def _is_dim(d: Sym) -> bool:
    """A symbol standing for a tensor's dim (never negative), not for the result of arithmetic."""
    return isinstance(d, tuple) and not str(d[0]).endswith("#value")


def _elementwise(op: str, out: str, args: list[list[Sym]]) -> list[Sym] | None:
    """``op`` over 1-D shape values with broadcasting: exact on ints and on the identities (x * 1, x + 0, x == x,
    a dim != a negative number); anything else is a new symbol for that element."""
    size = max(len(a) for a in args)
    if any(len(a) not in (1, size) for a in args):
        return None
    result: list[Sym] = []
    for i in range(size):
        x = [a[i if len(a) > 1 else 0] for a in args]
        result.append(_element(op, x, (f"{out}#value", i)))
    return result


def _element(op: str, x: list[Sym], unknown: Sym) -> Sym:
    if op == "Where":
        cond, yes, no = x
        return unknown if not isinstance(cond, int) else yes if cond else no
    a, b = x
    if isinstance(a, int) and isinstance(b, int):
        if op == "Div":
            return a // b if b and a % b == 0 else unknown
        return {"Mul": a * b, "Add": a + b, "Sub": a - b, "Equal": int(a == b)}[op]
    if op == "Equal":
        if a == b:
            return 1
        return 0 if (_is_dim(a) and isinstance(b, int) and b < 0) or (_is_dim(b) and isinstance(a, int) and a < 0) \
            else unknown
    identity = {"Mul": 1, "Div": 1, "Add": 0, "Sub": 0}[op]
    if b == identity:
        return a
    return b if a == identity and op in ("Mul", "Add") else unknown
