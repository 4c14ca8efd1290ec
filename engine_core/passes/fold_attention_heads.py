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

import numpy as np

from engine_core.ir import Graph, Node
from engine_core.passes.pattern import Uses, is_op, origins
from engine_core.passes.symbolic import Symbols, SymShape, symbolic_shapes

# -- the rewrite -----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Heads:
    """One head split ``source`` [B, S, heads * size] -> Reshape -> Transpose -> [B, heads, S, size]."""

    source: str
    heads: int
    size: int
    nodes: tuple[Node, Node]
    #: Shape nodes reading only the sequence axis of the [B, heads, S, size] tensor (fuse_attention's mask
    #: Expand): they read ``source``'s axis 1 instead
    seq_shapes: tuple[Node, ...] = ()


def _transposed(uses: Uses, name: str) -> Node | None:
    """The Transpose(0, 2, 1, 3) writing ``name`` (swapping the seq and heads axes) when it is one."""
    node = uses.producers.get(name)
    return node if is_op(node, "Transpose") and list(node.attr("perm") or []) == [0, 2, 1, 3] else None


def _head_split(uses: Uses, sym: Symbols, name: str) -> _Heads | None:
    """``name`` as a head split whose intermediates nothing else reads, with its head count and size."""
    transpose = _transposed(uses, name)
    readers = uses.consumers.get(name, [])
    seq_shapes = tuple(n for n in readers if is_op(n, "Shape") and _selects_axis(n, 2, 4))
    if transpose is None or name in uses.outputs or len(readers) - len(seq_shapes) != 1:
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
    return _Heads(reshape.inputs[0], heads, size, (reshape, transpose), seq_shapes)


def _selects_axis(shape: Node, axis: int, rank: int) -> bool:
    """``shape`` (a Shape node of a rank-``rank`` tensor) returns exactly dim ``axis``."""
    return list(range(rank))[slice(shape.attr("start", 0), shape.attr("end", None))] == [axis]


@dataclasses.dataclass(frozen=True)
class _Merge:
    """The head merge after Attention: Transpose(0, 2, 1, 3) -> Reshape, and Shape nodes reading the
    transposed tensor (torch's ``x.size()[:-2] + (hidden,)``), which are rewritten to read the packed Q."""

    transpose: Node
    reshape: Node
    shapes: tuple[Node, ...]


def _head_merge(uses: Uses, sym: Symbols, name: str, packed: SymShape) -> _Merge | None:
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


def _packed(uses: Uses, sym: Symbols,
            attention: Node) -> tuple[Node, list[Node], list[Node], list[tuple[Node, Node]]] | None:
    """The 3-D Attention replacing ``attention``, the nodes it covers (head split/merge copies), the Shape
    nodes of the merge (each replaced by what ``_shape_from_source`` makes) and the sequence-length Shape
    nodes of Q/K/V rewritten to read the packed tensors, or None."""
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
    seq_shapes = [(n, Node("Shape", [h.source], n.outputs, {"start": 1, "end": 2}, n.name, "", max(n.opset, 15),
                           list(n.origin))) for h in (q, k, v) for n in h.seq_shapes]
    return packed, covered, list(merge.shapes), seq_shapes


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
        packed, covered, shape_readers, seq_shapes = found
        packed.origin = origins(sorted(covered, key=lambda n: order[id(n)]))
        replaced.update({id(n): [] for n in covered})
        replaced[id(node)] = [packed]
        folded += 1
        replaced.update({id(old): [new] for old, new in seq_shapes})
        dims = sym.shapes[shape_readers[0].inputs[0]] if shape_readers else ()
        for reader in shape_readers:
            replaced[id(reader)] = _shape_from_source(graph, reader, packed.inputs[0], dims)
    graph.nodes = [m for n in graph.nodes for m in replaced.get(id(n), [n])]
    return folded
