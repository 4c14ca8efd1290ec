"""Layout algebra for passes that remove data movement: a tensor's dims as runs ("groups") of atoms of a root tensor.

A chain of Reshape / Transpose / Squeeze / Unsqueeze / Flatten only moves the elements of its root x. Split x's dims
into the finest factors any step needs (the atoms): every tensor along the chain is then a list of groups, each group
a run of atoms whose product is that dim. A Transpose permutes the groups, a Reshape regroups the same atom sequence,
Squeeze/Unsqueeze drop/insert empty groups (dims of 1). Two tensors with the same atom order hold the same data in
the same order (a Reshape, a view, turns one into the other); one Transpose suffices when the orders differ. Why:
an exporter's layout code (torch's sequence-first attention, its packed q/k/v split) goes through several copies
whose net effect is one transpose or none, which the ops one at a time do not show.

Sizes are ints or symbols (symbolic_shapes' convention, ``(tensor, axis)``). A symbol is never split; a Reshape's
target dims are matched against runs of atoms from both ends, and at most one target dim that the graph does not
prove (arithmetic on shape values, -1) takes the atoms left in the middle. The element count fixes that dim for a
non-empty tensor; exporters compute such dims from the same shapes, so empty tensors agree as well.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import TypeGuard

import numpy as np

from engine_core.ir import Graph, Node
from engine_core.passes.attention_facts import UNARY, Facts
from engine_core.passes.pattern import is_op
from engine_core.passes.symbolic import Sym

#: A size as a monomial: (integer factor, the symbols multiplied in, sorted).
Size = tuple[int, tuple[Sym, ...]]
#: A Reshape target element as the chain passes build it: an int (0 copies the input dim, -1 is solved) or the
#: root's dim at an axis, read at run time with Shape.
Piece = int | tuple[str, int]
def op(node: Node | None, *op_types: str) -> TypeGuard[Node]:
    """``is_op`` as a type guard."""
    return is_op(node, *op_types)


#: How deep the dim rules below walk back through per-token ops before falling back to Facts.
_DEPTH = 12


@dataclasses.dataclass
class Atoms:
    """The atoms of one root tensor: sizes, the root axis of each root dim atom, the atom each split part came from."""

    sizes: list[Sym] = dataclasses.field(default_factory=list)
    axes: list[int | None] = dataclasses.field(default_factory=list)
    parents: list[int | None] = dataclasses.field(default_factory=list)

    def add(self, size: Sym, axis: int | None = None, parent: int | None = None) -> int:
        self.sizes.append(size)
        self.axes.append(axis)
        self.parents.append(parent)
        return len(self.sizes) - 1

    def split(self, atom: int, major: int) -> tuple[int, int]:
        """Two new atoms for an int atom, row-major: ``major`` and the size left (both > 1)."""
        size = self.sizes[atom]
        assert isinstance(size, int) and 1 < major < size and size % major == 0
        return self.add(major, None, atom), self.add(size // major, None, atom)

    def descends(self, atom: int, ancestor: int) -> bool:
        """``atom`` is ``ancestor`` or one of its split parts, at any depth."""
        current: int | None = atom
        while current is not None:
            if current == ancestor:
                return True
            current = self.parents[current]
        return False

    def size(self, group: list[int]) -> Size:
        coef, syms = 1, []
        for atom in group:
            size = self.sizes[atom]
            if isinstance(size, int):
                coef *= size
            else:
                syms.append(size)
        return coef, tuple(sorted(syms, key=repr))

    def root(self, dims: list[Sym]) -> list[list[int]]:
        """The groups of a root with these dims: one atom per dim, none for a dim of 1 (the root's axis recorded)."""
        return [[] if d == 1 else [self.add(d, axis)] for axis, d in enumerate(dims)]


Groups = list[list[int]]
Split = tuple[int, tuple[int, int]]


def flat(groups: Groups) -> list[int]:
    return [atom for group in groups for atom in group]


def apply_splits(groups: Groups, splits: list[Split]) -> Groups:
    """``groups`` with each split atom replaced by its two parts (in the order the splits happened)."""
    for atom, parts in splits:
        groups = [[p for a in group for p in (parts if a == atom else (a,))] for group in groups]
    return groups


def _take(atoms: Atoms, queue: deque[int], want: Size, left: bool, splits: list[Split]) -> list[int] | None:
    """The run of atoms at one end of ``queue`` whose sizes multiply to ``want``, splitting an int atom when the
    run ends inside it; None when no run does."""
    coef, syms = want[0], list(want[1])
    group: list[int] = []
    while coef != 1 or syms:
        if not queue:
            return None
        atom = queue[0] if left else queue[-1]
        size = atoms.sizes[atom]
        if not isinstance(size, int):
            if size not in syms:
                return None
            syms.remove(size)
        elif coef % size == 0:
            coef //= size
        elif not syms and size % coef == 0:
            major, minor = atoms.split(atom, coef if left else size // coef)
            splits.append((atom, (major, minor)))
            if left:
                queue.popleft()
                queue.appendleft(minor)
                group.append(major)
            else:
                queue.pop()
                queue.append(major)
                group.append(minor)
            break
        else:
            return None
        group.append(queue.popleft() if left else queue.pop())
    return group if left else group[::-1]


def regroup(atoms: Atoms, groups: Groups, targets: list[Size | None]) -> tuple[Groups, list[Split]] | None:
    """The groups of a Reshape of ``groups`` to ``targets`` (None: a dim to solve by the element count, at most one)
    and the atom splits it needed; None when the target does not regroup the same atoms."""
    unknown = [i for i, t in enumerate(targets) if t is None]
    if len(unknown) > 1:
        return None
    queue, splits = deque(flat(groups)), list[Split]()
    cut = unknown[0] if unknown else len(targets)
    head: Groups = []
    for target in targets[:cut]:
        assert target is not None
        group = _take(atoms, queue, target, True, splits)
        if group is None:
            return None
        head.append(group)
    tail: Groups = []
    for target in reversed(targets[cut + 1:]):
        assert target is not None
        group = _take(atoms, queue, target, False, splits)
        if group is None:
            return None
        tail.append(group)
    if not unknown and queue:
        return None
    return head + ([list(queue)] if unknown else []) + tail[::-1], splits


def reshape_targets(facts: Facts, node: Node, atoms: Atoms, groups: Groups) -> list[Size | None] | None:
    """A Reshape's target as sizes (None for the one dim the graph does not prove), for input ``groups``."""
    values = facts.value(node.inputs[1]) if len(node.inputs) > 1 else None
    if values is None:
        return None
    known = {s for s in atoms.sizes if not isinstance(s, int)}
    targets: list[Size | None] = []
    for i, value in enumerate(values):
        if isinstance(value, int):
            if value > 0:
                targets.append((value, ()))
            elif value == 0 and not node.attr("allowzero", 0) and i < len(groups):
                targets.append(atoms.size(groups[i]))
            elif value == -1:
                targets.append(None)
            else:
                return None
        else:
            targets.append((1, (value,)) if value in known else None)
    return targets


def move(atoms: Atoms, groups: Groups, node: Node, facts: Facts) -> tuple[Groups, list[Split]] | None:
    """The groups after one layout op (Transpose, Reshape, Squeeze, Unsqueeze, Flatten, Identity), or None."""
    rank = len(groups)
    if is_op(node, "Identity"):
        return groups, []
    if is_op(node, "Transpose"):
        perm = [int(p) for p in node.attr("perm") or range(rank - 1, -1, -1)]
        return ([groups[p] for p in perm], []) if sorted(perm) == list(range(rank)) else None
    if is_op(node, "Reshape"):
        targets = reshape_targets(facts, node, atoms, groups)
        return regroup(atoms, groups, targets) if targets is not None else None
    if is_op(node, "Flatten"):
        axis = int(node.attr("axis", 1))
        axis = axis + rank if axis < 0 else axis
        return ([flat(groups[:axis]), flat(groups[axis:])], []) if 0 <= axis <= rank else None
    if is_op(node, "Squeeze", "Unsqueeze"):
        axes = facts.ints(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] else node.attr("axes")
        if axes is None:
            return None  # Squeeze of every dim of 1: which ones depends on the run's shape
        out_rank = rank + len(axes) if node.op_type == "Unsqueeze" else rank
        picked = {int(a) % out_rank for a in axes if -out_rank <= int(a) < out_rank}
        if len(picked) != len(axes):
            return None
        if node.op_type == "Squeeze":
            return ([g for i, g in enumerate(groups) if i not in picked], []) if all(not groups[i] for i in picked) \
                else None
        rest = iter(groups)
        return [[] if i in picked else list(next(rest)) for i in range(out_rank)], []
    return None


# -- dims of a chain's root --------------------------------------------------------------------------------------


def rank(facts: Facts, name: str) -> int | None:
    """``Facts.rank``, and a 4-D Attention's output."""
    node = facts.uses.producers.get(name)
    if op(node, "Attention") and name == node.outputs[0] and "q_num_heads" not in node.attrs:
        return facts.rank(node.inputs[0])
    return facts.rank(name)


def dims(facts: Facts, name: str) -> list[Sym] | None:
    """Every dim of ``name`` (ints or symbols), or None when its rank is unknown or a known dim is 0 (an empty
    tensor: nothing to move, and no atoms to count it with)."""
    count = rank(facts, name)
    found = None if count is None else [dim(facts, name, axis, _DEPTH) for axis in range(count)]
    return None if found is None or any(isinstance(d, int) and d < 1 for d in found) else found


def dim(facts: Facts, name: str, axis: int, depth: int) -> Sym:
    """Dim ``axis`` (>= 0) of ``name``: through the per-token ops a chain passes (a MatMul or Gemm by a 2-D weight, an
    elementwise op with a per-feature constant, a 4-D Attention), which ``Facts`` gives up on, then ``Facts.dim``."""
    node = facts.uses.producers.get(name)
    found = _dim_rule(facts, node, axis, depth - 1) if depth and node is not None and name == node.outputs[0] else None
    if found is not None:
        return found
    known = facts.dim(name, axis)
    return (name, axis) if known is None else known


def _dim_rule(facts: Facts, node: Node, axis: int, depth: int) -> Sym | None:
    graph, out_rank = facts.graph, rank(facts, node.outputs[0])
    if out_rank is None:
        return None
    if is_op(node, "MatMul"):
        a, b = (rank(facts, i) for i in node.inputs[:2])
        if axis >= out_rank - 2 or a != out_rank:
            return None if a != out_rank or b is None or b < 2 else \
                dim(facts, node.inputs[0], axis, depth) if axis == out_rank - 2 else dim(facts, node.inputs[1], b - 1, depth)
        if b == 2:
            return dim(facts, node.inputs[0], axis, depth)
        if b != out_rank:
            return None
        da, db = dim(facts, node.inputs[0], axis, depth), dim(facts, node.inputs[1], axis, depth)
        return da if da == db or db == 1 else db if da == 1 else None  # batch dims broadcast
    if is_op(node, "Attention") and "q_num_heads" not in node.attrs and out_rank == 4:
        return dim(facts, node.inputs[2], 3, depth) if axis == 3 else dim(facts, node.inputs[0], axis, depth)
    if is_op(node, *UNARY):
        return dim(facts, node.inputs[0], axis, depth)
    if is_op(node, "Add", "Sub", "Mul", "Div") and len(node.inputs) == 2:
        constant = [i for i in node.inputs if i in graph.constants]
        if len(constant) != 1:
            return None
        value, data = graph.constants[constant[0]], next(i for i in node.inputs if i != constant[0])
        if rank(facts, data) != out_rank or value.ndim > out_rank:
            return None
        aligned = axis - out_rank + value.ndim
        return dim(facts, data, axis, depth) if aligned < 0 or value.shape[aligned] == 1 else int(value.shape[aligned])
    return None


def matrix_dims(facts: Facts, name: str) -> tuple[int, int] | None:
    """[K, N] of a 2-D weight: a constant, or a tensor of known int dims."""
    value = facts.graph.constants.get(name)
    if isinstance(value, np.ndarray):
        return (int(value.shape[0]), int(value.shape[1])) if value.ndim == 2 else None
    if rank(facts, name) != 2:
        return None
    k, n = (dim(facts, name, a, 2) for a in (0, 1))
    return (k, n) if isinstance(k, int) and isinstance(n, int) else None


# -- building the shape tensors of a rewrite ----------------------------------------------------------------------


def target_pieces(atoms: Atoms, before: Groups, after: Groups) -> list[Piece] | None:
    """A Reshape target turning ``before`` into ``after`` for every shape of the root: known sizes as ints, a group
    equal to the input's at the same index as 0, one other group as -1, single root dims read with Shape; None when
    more than that is unknown (a product of symbols in two groups)."""
    pieces: list[Piece | None] = []
    for i, group in enumerate(after):
        coef, syms = atoms.size(group)
        if not syms:
            pieces.append(coef)
        elif i < len(before) and before[i] == group:
            pieces.append(0)
        else:
            pieces.append(None)
    open_ = [i for i, p in enumerate(pieces) if p is None]
    single = [i for i in open_ if _root_axis(atoms, after[i]) is not None]
    solved = next((i for i in open_ if i not in single), single[-1] if single else None)
    if any(i not in single for i in open_ if i != solved):
        return None
    out: list[Piece] = []
    for i, piece in enumerate(pieces):
        if piece is not None:
            out.append(piece)
        elif i == solved:
            out.append(-1)
        else:
            axis = _root_axis(atoms, after[i])
            assert axis is not None
            out.append(("", axis))
    return out


def _axis(atoms: Atoms, atom: int) -> int:
    """The root axis of a symbolic atom (only the root's dims are symbols: splits and new dims are ints)."""
    axis = atoms.axes[atom]
    assert axis is not None
    return axis


def _root_axis(atoms: Atoms, group: list[int]) -> int | None:
    """The root axis when the group is one symbolic root dim alone."""
    if len(group) != 1 or isinstance(atoms.sizes[group[0]], int):
        return None
    return atoms.axes[group[0]]


def target_tensor(graph: Graph, root: str, pieces: list[Piece], hint: str) -> tuple[str, list[Node]]:
    """The int64 target tensor for ``pieces``: a constant, or a Concat of constants and Shape slices of ``root``."""
    if all(isinstance(p, int) for p in pieces):
        return graph.add_constant(f"{hint}_shape", np.array(pieces, np.int64)), []
    nodes: list[Node] = []
    parts: list[str] = []
    run: list[int] = []
    for piece in [*pieces, None]:
        if isinstance(piece, int):
            run.append(piece)
            continue
        if run:
            parts.append(graph.add_constant(f"{hint}_dims", np.array(run, np.int64)))
            run = []
        if piece is not None:
            parts.append(_shape_slice(graph, root, piece[1], nodes, hint))
    out = graph.unique_name(f"{hint}_shape")
    nodes.append(Node("Concat", parts, [out], {"axis": 0}, out, "", 13, []))
    return out, nodes


def _shape_slice(graph: Graph, root: str, axis: int, nodes: list[Node], hint: str) -> str:
    out = graph.unique_name(f"{hint}_dim{axis}")
    nodes.append(Node("Shape", [root], [out], {"start": axis, "end": axis + 1}, out, "", 15, []))
    return out


def shape_nodes(graph: Graph, root: str, atoms: Atoms, groups: Groups, shape: Node) -> list[Node]:
    """Nodes writing what ``shape`` (a Shape node of a tensor the rewrite removes, whose dims are ``groups``) wrote:
    known sizes as constants, symbolic dims as products of the root's dims."""
    picked = groups[slice(shape.attr("start", 0), shape.attr("end", None))]
    out, hint, nodes = shape.outputs[0], shape.outputs[0], list[Node]()
    parts: list[str] = []
    for group in picked:
        coef, _ = atoms.size(group)
        factors = [_shape_slice(graph, root, _axis(atoms, a), nodes, hint) for a in group
                   if not isinstance(atoms.sizes[a], int)]
        if coef != 1 or not factors:
            factors.append(graph.add_constant(f"{hint}_factor", np.array([coef], np.int64)))
        product = factors[0]
        for factor in factors[1:]:
            product_out = graph.unique_name(f"{hint}_product")
            nodes.append(Node("Mul", [product, factor], [product_out], {}, product_out, "", 14, []))
            product = product_out
        parts.append(product)
    if not parts:
        parts.append(graph.add_constant(f"{hint}_empty", np.zeros(0, np.int64)))
    nodes.append(Node("Concat", parts, [out], {"axis": 0}, shape.name, "", 13, list(shape.origin)))
    return nodes
