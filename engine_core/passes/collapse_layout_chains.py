"""Transposes that per-token ops separate from their inverse: the chain from a Transpose on is rewritten with as few
Transposes as its net effect needs.

torch's ``nn.MultiheadAttention`` (batch_first) works sequence-first: x [B, S, E] -> transpose(1, 0) -> in-projection
-> [S, B*H, D] -> transpose -> [B*H, S, D] -> view [B, H, S, D]; after the attention the output is transposed to
[S, B, H, D], flattened to [S*B, E] for the out-projection, viewed as [S, B, E] and transposed back: seven copies per
layer whose net effect is the head split and merge (which fold_attention_heads then folds into the Attention).

A chain starts at a Transpose and follows the only reader of each tensor (a tensor only layout ops wrote since the
root may fork: each branch is rewritten from the root) through

- layout ops (Transpose, Reshape, Squeeze, Unsqueeze, Flatten), tracked as groups of atoms (layout_atoms);
- per-token ops, which commute with any move of the other dims: an elementwise op with a constant scalar or
  per-feature operand, a MatMul or Gemm by a 2-D weight (a constant, or a tensor of known size), a
  LayerNormalization over the last axis.

The rewrite applies the per-token ops to the root's data in the root's order, moving it (one Transpose, Reshapes are
views) only where an op needs its last axis elsewhere, and moves it once more at the end: kept when that makes fewer
Transposes than the chain had. Shape nodes reading a removed tensor compute its dims from the root's instead. Every
chain end keeps its tensor name, so nothing outside the chain changes. A Transpose of the last two dims that feeds a
matrix product (K^T, a GEMM operand) stays out of chains: the GEMM or fuse_attention reads it for free.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np

from engine_core.ir import Graph, Node
from engine_core.passes.attention_facts import UNARY, Facts
from engine_core.passes.dead_code import eliminate_dead_code
from engine_core.passes.layout_atoms import (
    Atoms,
    Groups,
    Piece,
    apply_splits,
    dims,
    flat,
    matrix_dims,
    move,
    shape_nodes,
    target_pieces,
    target_tensor,
)
from engine_core.passes.pattern import Uses, is_op, origins
from engine_core.passes.symbolic import symbolic_shapes

#: Layout ops a chain tracks (views but for Transpose).
_LAYOUT = ("Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity")
#: Unary ops that work along an axis (or per channel): not elementwise.
_ALONG_AXES = ("Softmax", "LogSoftmax", "LayerNormalization", "RMSNormalization", "QuantizeLinear", "DequantizeLinear")
#: Elementwise ops with a second operand that is a scalar or a per-feature vector.
_BINARY = ("Add", "Sub", "Mul", "Div")
#: A chain follows at most this many nodes and forks into at most this many branches.
_MAX_NODES, _MAX_BRANCHES = 48, 8


@dataclasses.dataclass
class _Op:
    """One step of a rewritten branch: a Reshape (``pieces`` its target), a Transpose (``perm``), or a copy of a
    per-token ``node`` reading the branch's tensor at input ``index`` (``vector``: a 1-D stand-in for its other
    operand)."""

    kind: str
    pieces: list[Piece] = dataclasses.field(default_factory=list)
    perm: list[int] = dataclasses.field(default_factory=list)
    node: Node | None = None
    index: int = 0
    vector: np.ndarray | None = None


class _Branch:
    """The rewrite of one path of a chain: ``logical`` is the original tensor at this point, ``phys`` the rewritten
    program's, both as groups of the root's atoms."""

    def __init__(self, atoms: Atoms, facts: Facts, root: Groups) -> None:
        self.atoms, self.facts = atoms, facts
        self.logical, self.phys = [list(g) for g in root], [list(g) for g in root]
        self.ops: list[_Op] = []
        self.transposes = 0

    # -- the program ------------------------------------------------------------------------------------------

    def reshape(self, groups: Groups) -> bool:
        if groups == self.phys:
            return True
        pieces = target_pieces(self.atoms, self.phys, groups)
        if pieces is None:
            return False
        self.ops.append(_Op("reshape", pieces))
        self.phys = groups
        return True

    def relayout(self, groups: Groups) -> bool:
        """Move the program's tensor to ``groups`` (a permutation of its atoms): Reshapes around at most one Transpose
        of the runs of atoms that stay together within one of the new dims (so the Transpose writes the new dims
        themselves where it can: the forms fuse_attention and fold_attention_heads match)."""
        current, wanted = flat(self.phys), flat(groups)
        if current != wanted:
            position = {atom: i for i, atom in enumerate(current)}
            group_of = {atom: i for i, group in enumerate(groups) for atom in group}
            runs: Groups = []
            for atom in wanted:
                if runs and position[atom] == position[runs[-1][-1]] + 1 and group_of[atom] == group_of[runs[-1][-1]]:
                    runs[-1].append(atom)
                else:
                    runs.append([atom])
            stored = sorted(runs, key=lambda run: position[run[0]])
            if not self.reshape(stored):
                return False
            self.ops.append(_Op("transpose", perm=[stored.index(run) for run in runs]))
            self.transposes += 1
            self.phys = runs
        return self.reshape(groups)

    def last_axis(self, two_d: bool) -> bool:
        """Bring the original tensor's last dim to the program's last axis, the other dims in stored order (then
        merged into one for a Gemm: the 3-D step first, where fold_attention_heads finds a head merge)."""
        last = self.logical[-1]
        rest = [[a for a in g if a not in last] for g in self.phys]
        rest = [g for g in rest if g] or [[]]
        return self.relayout([*rest, last]) and (not two_d or self.reshape([flat(rest), last]))

    def finish_transposes(self) -> int | None:
        """Transposes the program has once it ends here; None when its last Reshape cannot be built."""
        trial = copy.copy(self)
        trial.ops = list(self.ops)
        return trial.transposes if trial.relayout(self.logical) else None

    # -- the original's nodes ---------------------------------------------------------------------------------

    def step(self, node: Node, tensor: str) -> bool:
        """Follow ``node`` (reading ``tensor``, the original at this point); False when it is no chain op."""
        if is_op(node, *_LAYOUT):
            if node.inputs[0] != tensor or tensor in node.inputs[1:]:
                return False
            moved = move(self.atoms, self.logical, node, self.facts)
            if moved is None:
                return False
            self.logical = moved[0]
            self.phys = apply_splits(self.phys, moved[1])
            return True
        return self.per_token(node, tensor)

    def per_token(self, node: Node, tensor: str) -> bool:
        if len([o for o in node.outputs if o]) != 1 or node.outputs[0] == "" or node.inputs.count(tensor) != 1:
            return False
        index = node.inputs.index(tensor)
        width = self.atoms.size(self.logical[-1]) if self.logical else (1, ())
        if is_op(node, *UNARY) and node.op_type not in _ALONG_AXES and index == 0:
            self.ops.append(_Op("node", node=node))
            return True
        if is_op(node, *_BINARY) and len(node.inputs) == 2:
            return self.binary(node, index, width)
        if is_op(node, "LayerNormalization") and index == 0:
            axis = int(node.attr("axis", -1))
            if axis not in (-1, len(self.logical) - 1) or not self.logical[-1] or not self.last_axis(False):
                return False
            self.ops.append(_Op("node", node=dataclasses.replace(node, attrs={**node.attrs, "axis": -1})))
            return True
        if is_op(node, "MatMul", "Gemm") and index == 0:
            return self.linear(node, width)
        return False

    def binary(self, node: Node, index: int, width: tuple[int, tuple]) -> bool:
        """Add/Sub/Mul/Div with a constant scalar (anywhere) or per-feature vector (on the last axis)."""
        value = self.facts.graph.constants.get(node.inputs[1 - index])
        if not isinstance(value, np.ndarray) or value.ndim > len(self.logical):
            return False
        if value.size == 1:
            self.ops.append(_Op("node", node=node, index=index, vector=value.reshape(-1)))
            return True
        if any(d != 1 for d in value.shape[:-1]) or width != (int(value.shape[-1]), ()) or not self.last_axis(False):
            return False
        self.ops.append(_Op("node", node=node, index=index, vector=value.reshape(-1)))
        return True

    def linear(self, node: Node, width: tuple[int, tuple]) -> bool:
        """MatMul by a 2-D weight (of a tensor of rank >= 2), Gemm with a per-feature C: a new last dim."""
        weight = matrix_dims(self.facts, node.inputs[1])
        if weight is None or len(self.logical) < 2:
            return False
        k, n = weight[::-1] if node.op_type == "Gemm" and node.attr("transB", 0) else weight
        if node.op_type == "Gemm":
            bias = self.facts.graph.constants.get(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
            if node.attr("transA", 0) or (len(node.inputs) > 2 and node.inputs[2] and (
                    bias is None or bias.size not in (1, n) or any(d != 1 for d in bias.shape[:-1]))):
                return False
        if width != (k, ()) or not self.last_axis(node.op_type == "Gemm"):
            return False
        self.ops.append(_Op("node", node=node))
        out = [self.atoms.add(n)] if n != 1 else []
        self.logical = [*self.logical[:-1], out]
        self.phys = [*self.phys[:-1], out]
        return True


@dataclasses.dataclass
class _Path:
    """One root-to-leaf path of a chain: its nodes and how many lead nodes it shares with other paths (the rewrite
    keeps at least one node past those)."""

    nodes: list[Node]
    shared: int


class _Chains:
    """Finds and rewrites the chains of one graph; nodes go in or out only at the end (``apply``)."""

    def __init__(self, graph: Graph) -> None:
        self.graph, self.uses = graph, Uses(graph)
        self.facts = Facts(graph, self.uses, symbolic_shapes(graph))
        self.taken: set[int] = set()
        self.replaced: dict[int, list[Node]] = {}   # node id -> the nodes in its place (none: removed)
        self.renamed: dict[str, str] = {}

    def readers(self, tensor: str) -> list[Node]:
        """The readers of ``tensor`` but Shape nodes (the rewrite computes those from the root)."""
        return [n for n in self.uses.consumers.get(tensor, []) if not is_op(n, "Shape") or n.inputs[0] != tensor]

    def paths(self, head: Node) -> list[_Path]:
        """The paths of the chain starting at ``head``: each tensor's only reader is followed; a tensor that only
        layout ops wrote since the root forks into all of its readers."""
        done: list[_Path] = []
        todo = [_Path([head], 0)]
        while todo:
            path = todo.pop()
            tensor = path.nodes[-1].outputs[0]
            readers = self.readers(tensor)
            free = tensor not in self.uses.outputs and bool(readers) and len(path.nodes) < _MAX_NODES and \
                all(id(n) not in self.taken and not self.matrix_operand(n) for n in readers)
            if free and len(readers) == 1:
                todo.append(_Path([*path.nodes, readers[0]], path.shared))
            elif free and all(is_op(n, *_LAYOUT) for n in path.nodes) and \
                    len(done) + len(todo) + len(readers) <= _MAX_BRANCHES:
                todo += [_Path([*path.nodes, r], len(path.nodes)) for r in readers]
            else:
                done.append(path)
        return done

    def simulate(self, head: Node, path: _Path, end: int) -> tuple[_Branch, list[Groups]] | None:
        """The branch rewritten up to node ``end`` of the path, with the original's groups after each node."""
        found = dims(self.facts, head.inputs[0])
        if found is None:
            return None
        atoms = Atoms()
        branch, tensor, seen = _Branch(atoms, self.facts, atoms.root(found)), head.inputs[0], list[Groups]()
        for node in path.nodes[:end + 1]:
            if not branch.step(node, tensor):
                return None
            seen.append(branch.logical)
            tensor = node.outputs[0]
        return branch, seen

    def best_end(self, head: Node, path: _Path) -> tuple[int, int] | None:
        """(the end that saves the most Transposes among the path's own nodes, and that saving), or None when no end
        past the shared nodes works. Of equal ends the last layout op wins: the layout left for other passes to fold
        (a head split) then ends the chain, while a per-token op after it (Q's scale, which fuse_attention folds) stays
        where it was."""
        found = self.simulate(head, path, -1)
        if found is None:
            return None
        branch, tensor, best, own = found[0], head.inputs[0], None, 0
        for i, node in enumerate(path.nodes):
            if not branch.step(node, tensor):
                break
            tensor, layout = node.outputs[0], is_op(node, *_LAYOUT)
            if i < path.shared:
                continue
            own += is_op(node, "Transpose") and _moves(node)
            cost = branch.finish_transposes()
            if cost is not None and (best is None or own - cost > best[1] or own - cost == best[1] and layout):
                best = (i, own - cost)
        return best

    def matrix_operand(self, node: Node) -> bool:
        """A Transpose of the last two dims read by a MatMul/Gemm (through a scalar Mul/Div: attention's scale): the
        GEMM (transA/transB) or fuse_attention (K^T) reads it for free, so a chain leaves it alone."""
        perm = [int(p) for p in node.attr("perm") or []] if is_op(node, "Transpose") else []
        if len(perm) < 2 or perm[:-2] != list(range(len(perm) - 2)) or perm[-2:] != [len(perm) - 1, len(perm) - 2]:
            return False
        reader = self.uses.sole_reader(node.outputs[0])
        if is_op(reader, "Mul", "Div") and reader is not None:
            reader = self.uses.sole_reader(reader.outputs[0])
        return is_op(reader, "MatMul", "Gemm")

    def try_chain(self, head: Node) -> bool:
        if id(head) in self.taken or not _moves(head) or head.outputs[0] in self.uses.outputs or \
                self.matrix_operand(head):
            return False
        paths = self.paths(head)
        ends = [self.best_end(head, p) for p in paths]
        if any(e is None for e in ends):
            return False
        lead = {id(n): n for p in paths for n in p.nodes[:p.shared]}
        saving = sum(is_op(n, "Transpose") and _moves(n) for n in lead.values()) + sum(e[1] for e in ends if e)
        if saving <= 0:
            return False
        rewrites = []
        for path, end in zip(paths, ends):
            assert end is not None
            simulated = self.simulate(head, path, end[0])
            if simulated is None or not simulated[0].relayout(simulated[0].logical):
                return False
            rewrites.append((path.nodes[:end[0] + 1], *simulated))
        for rewrite in rewrites:
            self.commit(head, *rewrite)
        return True

    def commit(self, head: Node, kept: list[Node], branch: _Branch, seen: list[Groups]) -> None:
        """Put the branch's program in the place of its last node, drop the rest, recompute Shape reads of the tensors
        it removes from the root."""
        root, end = head.inputs[0], kept[-1].outputs[0]
        layout_origin = origins([n for n in kept if is_op(n, *_LAYOUT)])
        program = _render(self.graph, root, end, branch, layout_origin, kept[-1].name)
        if program is None:
            self.renamed[end] = root
        for node in kept:
            self.taken.add(id(node))
            self.replaced.setdefault(id(node), [])
        self.replaced[id(kept[-1])] = program or []
        for node, groups in zip(kept[:-1], seen[:-1]):
            for shape in self.uses.consumers.get(node.outputs[0], []):
                if is_op(shape, "Shape") and shape.inputs[0] == node.outputs[0] and id(shape) not in self.replaced:
                    self.replaced[id(shape)] = shape_nodes(self.graph, root, branch.atoms, groups, shape)

    def apply(self) -> None:
        self.graph.nodes = [m for n in self.graph.nodes for m in self.replaced.get(id(n), [n])]
        for old, new in self.renamed.items():
            while new in self.renamed:  # a chain that ends where another one's program was empty
                new = self.renamed[new]
            self.graph.rename_tensor_uses(old, new)


def _moves(node: Node) -> bool:
    """A Transpose that is not the identity."""
    perm = node.attr("perm")
    return perm is None or [int(p) for p in perm] != list(range(len(perm)))


def _render(graph: Graph, root: str, end: str, branch: _Branch, origin: list[str], name: str) -> list[Node] | None:
    """The branch's program as nodes from ``root`` to ``end`` (None when it has no step: ``end`` is the root)."""
    if not branch.ops:
        if end not in graph.output_names:
            return None
        return [Node("Identity", [root], [end], {}, name, "", 13, origin)]
    nodes: list[Node] = []
    tensor = root
    for i, op in enumerate(branch.ops):
        hint = op.node.outputs[0] if op.node is not None else f"{end}_{op.kind}"
        out = end if i == len(branch.ops) - 1 else graph.unique_name(hint)
        if op.kind == "reshape":
            target, extra = target_tensor(graph, root, op.pieces, out)
            nodes += [*extra, Node("Reshape", [tensor, target], [out], {}, out, "", 14, origin)]
        elif op.kind == "transpose":
            nodes.append(Node("Transpose", [tensor], [out], {"perm": op.perm}, out, "", 13, origin))
        else:
            assert op.node is not None
            inputs = list(op.node.inputs)
            inputs[op.index] = tensor
            if op.vector is not None and graph.constants[inputs[1 - op.index]].ndim > 1:
                inputs[1 - op.index] = graph.add_constant(f"{inputs[1 - op.index]}_vector", op.vector)
            nodes.append(dataclasses.replace(op.node, inputs=inputs, outputs=[out], name=out))
        tensor = out
    return nodes


def collapse_layout_chains(graph: Graph) -> int:
    """Rewrite every chain that gets fewer Transposes; returns how many chains were rewritten."""
    chains = _Chains(graph)
    count = sum(chains.try_chain(node) for node in list(graph.nodes) if is_op(node, "Transpose"))
    if count:
        chains.apply()
        eliminate_dead_code(graph)
    return count
