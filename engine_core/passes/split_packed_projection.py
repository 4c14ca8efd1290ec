"""q, k, v picked out of one packed projection -> one projection each, by the weight columns they read.

torch's ``F.multi_head_attention_forward`` projects with one Linear of 3E columns and splits the result with
``proj.unflatten(-1, (3, E)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()`` and ``q, k, v = proj[0],
proj[1], proj[2]``: a 5-D transpose copy of the whole projection, then a Gather copy of each third. Each of those
Gathers reads the columns of one index of the "3" factor of the projection's last dim; the pass makes it the
projection by those columns of the weight (and bias), so no copy remains and fuse_matmul_epilogue puts the bias in
the GEMM's epilogue.

Matches Gather(constant scalar index) of a tensor that layout ops (Reshape, Transpose, Squeeze, Unsqueeze) make from
P = MatMul(a, W) (+ per-column bias) or Gemm(a, W, bias), W a constant 2-D weight, when every Gather reads the same
factor of P's last dim with its own index, the Gathers (and Shape nodes) are all that read the layout ops' results,
and each Gather's result keeps P's element order (layout_atoms proves it): its dims are then a Reshape of the new
projection's. Shape nodes of the removed tensors read the dims of ``a`` instead.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from engine_core.ir import Graph, Node
from engine_core.passes.attention_facts import Facts
from engine_core.passes.dead_code import eliminate_dead_code
from engine_core.passes.layout_atoms import (
    Atoms,
    Groups,
    apply_splits,
    dims,
    flat,
    move,
    op,
    shape_nodes,
    target_pieces,
    target_tensor,
)
from engine_core.passes.pattern import Uses, is_op, origins
from engine_core.passes.symbolic import symbolic_shapes

#: Layout ops between the projection and the Gathers.
_LAYOUT = ("Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity")


@dataclasses.dataclass
class _Projection:
    """P = (MatMul | Gemm)(a, W) (+ bias): the nodes, and the weight and bias as [K, N] and [N] arrays."""

    a: str
    nodes: list[Node]
    weight: np.ndarray
    bias: np.ndarray | None
    bias_rank: int

    @property
    def out(self) -> str:
        return self.nodes[-1].outputs[0]


def _projection(graph: Graph, uses: Uses, name: str) -> _Projection | None:
    """``name`` as the output of a projection by a constant 2-D weight whose intermediate only the next node reads."""
    node = uses.producers.get(name)
    bias = None
    nodes: list[Node] = []
    if op(node, "Add") and len(node.inputs) == 2:
        constant = [i for i in node.inputs if i in graph.constants]
        matmul = uses.producers.get(next((i for i in node.inputs if i not in constant), ""))
        if len(constant) != 1 or not op(matmul, "MatMul") or uses.sole_reader(matmul.outputs[0]) is not node:
            return None
        bias, nodes, node = graph.constants[constant[0]], [node], matmul
    if op(node, "MatMul") and node.inputs[1] in graph.constants and graph.constants[node.inputs[1]].ndim == 2:
        weight = graph.constants[node.inputs[1]]
    elif op(node, "Gemm") and not nodes and not node.attr("transA", 0) and node.inputs[1] in graph.constants \
            and node.attr("alpha", 1.0) == 1.0 and node.attr("beta", 1.0) == 1.0:
        weight = graph.constants[node.inputs[1]]
        weight = weight.T if node.attr("transB", 0) else weight
        bias = graph.constants.get(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
        if len(node.inputs) > 2 and node.inputs[2] and bias is None:
            return None
    else:
        return None
    columns = weight.shape[1]
    if bias is not None and (bias.ndim == 0 or bias.shape[-1] != columns or any(d != 1 for d in bias.shape[:-1])):
        return None
    return _Projection(node.inputs[0], [node, *nodes], weight, None if bias is None else bias.reshape(-1),
                       0 if bias is None else bias.ndim)


@dataclasses.dataclass
class _Pick:
    """One Gather: its node, the atom (a factor of P's last dim) it indexes and the index."""

    gather: Node
    atom: int
    index: int
    groups: Groups  # the Gather's result as groups of P's atoms


class _Split:
    """One packed projection read through layout ops by Gathers."""

    def __init__(self, graph: Graph, uses: Uses, facts: Facts, data: str) -> None:
        self.graph, self.uses, self.facts, self.data = graph, uses, facts, data
        self.layout: list[Node] = []       # the layout ops from P to ``data``, in order
        self.seen: list[Groups] = []       # P and each layout op's result, as groups of P's atoms
        self.atoms = Atoms()
        self.last = -1                     # the atom of P's last dim

    def find(self) -> tuple[_Projection, list[_Pick]] | None:
        tensor, layout = self.data, list[Node]()
        while op(node := self.uses.producers.get(tensor), *_LAYOUT) and tensor not in self.uses.outputs:
            layout.append(node)
            tensor = node.inputs[0]
            if self._others(tensor, node):
                return None
        projection = _projection(self.graph, self.uses, tensor)
        if projection is None or not layout or tensor in self.uses.outputs:
            return None
        self.layout = layout[::-1]
        source = dims(self.facts, projection.a)
        if source is None or len(source) < 2 or (projection.bias_rank > len(source)):
            return None  # a 1-D a would make P 1-D (its dims are not a's); a bias of higher rank widens P
        self.seen = [self.atoms.root([*source[:-1], projection.weight.shape[1]])]
        self.last = self.seen[0][-1][0] if self.seen[0][-1] else -1
        for node in self.layout:
            moved = move(self.atoms, self.seen[-1], node, self.facts)
            if moved is None:
                return None
            self.seen = [apply_splits(groups, moved[1]) for groups in self.seen] + [moved[0]]
        picks = [self._pick(g) for g in self.uses.consumers.get(self.data, [])
                 if not (is_op(g, "Shape") and g.inputs[0] == self.data)]
        if not picks or any(p is None for p in picks):
            return None
        found = [p for p in picks if p is not None]
        if len({p.atom for p in found}) != 1 or len({p.index for p in found}) != len(found):
            return None  # two factors, or one index twice, would compute some columns twice
        return projection, found

    def _others(self, tensor: str, reader: Node) -> bool:
        """``tensor`` has readers besides ``reader`` and Shape nodes."""
        return any(n is not reader and not (is_op(n, "Shape") and n.inputs[0] == tensor)
                   for n in self.uses.consumers.get(tensor, []))

    def _pick(self, gather: Node) -> _Pick | None:
        """The Gather as an index into one factor of P's last dim, when its result keeps P's element order."""
        index = self.graph.constants.get(gather.inputs[1]) if is_op(gather, "Gather") and len(gather.inputs) > 1 \
            else None
        groups = self.seen[-1]
        if index is None or index.ndim != 0 or index.dtype.kind not in "iu" or gather.inputs[0] != self.data \
                or gather.inputs[1] == self.data or not -len(groups) <= int(gather.attr("axis", 0)) < len(groups):
            return None
        axis = int(gather.attr("axis", 0)) % len(groups)
        if len(groups[axis]) != 1 or not self.atoms.descends(groups[axis][0], self.last):
            return None
        atom, size = groups[axis][0], self.atoms.sizes[groups[axis][0]]
        assert isinstance(size, int)
        if not -size <= int(index) < size:
            return None
        rest = [g for i, g in enumerate(groups) if i != axis]
        if flat(rest) != [a for a in flat(self.seen[0]) if a != atom]:
            return None  # the other dims moved: the Gather's result is no column slice of P
        return _Pick(gather, atom, int(index) % size, rest)

    def columns(self, pick: _Pick) -> np.ndarray:
        """P's columns the pick reads, in order: the factors of P's last dim, with the picked one at its index."""
        factors = [a for a in flat(self.seen[0]) if self.atoms.descends(a, self.last)]
        sizes = [self.atoms.sizes[a] for a in factors]
        shape = [s for s in sizes if isinstance(s, int)]  # factors of an int dim are ints
        grid = np.arange(int(np.prod(shape))).reshape(shape)
        return np.take(grid, pick.index, axis=factors.index(pick.atom)).reshape(-1)


def _rewrite(graph: Graph, split: _Split, projection: _Projection, pick: _Pick) -> list[Node] | None:
    """The projection by the pick's columns, reshaped to the Gather's dims if they group P's differently."""
    columns = split.columns(pick)
    head, hint = projection.nodes[0], pick.gather.outputs[0]
    leading = [g for g in split.seen[0] if not any(split.atoms.descends(a, split.last) for a in g)]
    kept = [a for a in flat(pick.groups) if split.atoms.descends(a, split.last)]
    produced = [*leading, kept]
    if produced != pick.groups and target_pieces(split.atoms, produced, pick.groups) is None:
        return None
    weight = np.ascontiguousarray(projection.weight[:, columns])
    separate_bias = projection.bias is not None and not is_op(head, "Gemm")
    product = hint if produced == pick.groups and not separate_bias else graph.unique_name(f"{hint}_columns")
    origin = origins([*projection.nodes, *split.layout, pick.gather])
    if is_op(head, "Gemm"):
        inputs = [projection.a, graph.add_constant(f"{head.inputs[1]}_columns", np.ascontiguousarray(weight.T)
                                                    if head.attr("transB", 0) else weight)]
        inputs += [graph.add_constant(f"{head.inputs[2]}_columns", projection.bias[columns])] \
            if projection.bias is not None else []
        nodes = [dataclasses.replace(head, inputs=inputs, outputs=[product], name=product, origin=origin)]
    else:
        inputs = [projection.a, graph.add_constant(f"{head.inputs[1]}_columns", weight)]
        nodes = [dataclasses.replace(head, inputs=inputs, outputs=[product], name=product, origin=origin)]
        if projection.bias is not None:
            add = projection.nodes[-1]
            biased = hint if produced == pick.groups else graph.unique_name(f"{hint}_biased")
            bias = graph.add_constant(f"{hint}_bias", projection.bias[columns])
            nodes.append(dataclasses.replace(add, inputs=[product, bias], outputs=[biased], name=biased,
                                             origin=list(origin)))
            product = biased
    if produced != pick.groups:
        pieces = target_pieces(split.atoms, produced, pick.groups)
        assert pieces is not None
        target, extra = target_tensor(graph, projection.a, pieces, hint)
        nodes += [*extra, Node("Reshape", [product, target], [hint], {}, hint, "", 14, origin)]
    return nodes


def split_packed_projections(graph: Graph) -> int:
    """Rewrite every packed projection read through Gathers; returns how many Gathers became projections."""
    uses = Uses(graph)
    facts = Facts(graph, uses, symbolic_shapes(graph))
    replaced: dict[int, list[Node]] = {}
    done: set[str] = set()
    count = 0
    for node in list(graph.nodes):
        if not is_op(node, "Gather") or node.inputs[0] in done:
            continue
        done.add(node.inputs[0])
        split = _Split(graph, uses, facts, node.inputs[0])
        found = split.find()
        if found is None:
            continue
        projection, picks = found
        rewrites = [_rewrite(graph, split, projection, pick) for pick in picks]
        if any(r is None for r in rewrites):
            continue
        for pick, rewrite in zip(picks, rewrites):
            replaced[id(pick.gather)] = rewrite or []
        for tensor, groups in zip([projection.out, *(n.outputs[0] for n in split.layout)], split.seen):
            for shape in uses.consumers.get(tensor, []):
                if is_op(shape, "Shape") and shape.inputs[0] == tensor:
                    replaced[id(shape)] = shape_nodes(graph, projection.a, split.atoms, groups, shape)
        count += len(picks)
    if count:
        graph.nodes = [m for n in graph.nodes for m in replaced.get(id(n), [n])]
        eliminate_dead_code(graph)
    return count
