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
    #: Shape nodes reading the [B, heads, S, size] tensor (fuse_attention's mask Expand reads its key count, T5 its
    #: key length): they read ``source``'s dims instead, with heads and size as constants
    shapes: tuple[Node, ...] = ()


def _transposed(uses: Uses, name: str) -> Node | None:
    """The Transpose(0, 2, 1, 3) writing ``name`` (swapping the seq and heads axes) when it is one."""
    node = uses.producers.get(name)
    return node if is_op(node, "Transpose") and list(node.attr("perm") or []) == [0, 2, 1, 3] else None


def _head_split(uses: Uses, sym: Symbols, name: str) -> _Heads | None:
    """``name`` as a head split whose intermediates nothing else reads, with its head count and size."""
    transpose = _transposed(uses, name)
    readers = uses.consumers.get(name, [])
    shapes = tuple(n for n in readers if is_op(n, "Shape"))
    if transpose is None or name in uses.outputs or len(readers) - len(shapes) != 1:
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
    return _Heads(reshape.inputs[0], heads, size, (reshape, transpose), shapes)


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


#: A Shape node of a removed 4-D tensor, and how to compute it: (the node, the packed [B, S, *] source, for each axis
#: the source axis it is or None, the known sizes of the other axes)
_ShapeRead = tuple[Node, str, tuple[int | None, ...], tuple[int, ...]]


def _shape_from_source(graph: Graph, read: _ShapeRead) -> list[Node]:
    """Nodes computing a Shape of a removed [B, H, S, D] or [B, S, H, Dv] tensor from its packed source [B, S, *]
    and the known head count and size: Shape(source) slices for the batch and sequence axes, constants for the
    others, concatenated (one Shape when that is all it reads)."""
    node, source, layout, sizes = read
    runs: list[tuple[bool, list[int]]] = []  # (from the source?, source axes or sizes), in the order read
    for axis in list(range(4))[slice(node.attr("start", 0), node.attr("end", None))]:
        source_axis = layout[axis]
        from_source, item = source_axis is not None, sizes[axis] if source_axis is None else source_axis
        if runs and runs[-1][0] == from_source and (not from_source or runs[-1][1][-1] + 1 == item):
            runs[-1][1].append(item)
        else:
            runs.append((from_source, [item]))
    out, origin, opset = node.outputs[0], list(node.origin), max(node.opset, 15)  # Shape's start/end: opset 15
    if len(runs) == 1 and runs[0][0]:
        axes = runs[0][1]
        return [Node("Shape", [source], [out], {"start": axes[0], "end": axes[-1] + 1}, node.name, "", opset, origin)]
    nodes, parts = [], []
    for index, (from_source, items) in enumerate(runs):
        if not from_source:
            parts.append(graph.add_constant(f"{out}_sizes", np.array(items, np.int64)))
            continue
        parts.append(graph.unique_name(f"{out}_dims"))
        nodes.append(Node("Shape", [source], [parts[-1]], {"start": items[0], "end": items[-1] + 1},
                          f"{node.name}_{index}", "", opset, origin))
    parts = parts or [graph.add_constant(f"{out}_sizes", np.zeros(0, np.int64))]
    return nodes + [Node("Concat", parts, [out], {"axis": 0}, node.name, "", max(node.opset, 13), origin)]


def _packed(uses: Uses, sym: Symbols, attention: Node) -> tuple[Node, list[Node], list[_ShapeRead]] | None:
    """The 3-D Attention replacing ``attention``, the nodes it covers (head split/merge copies) and the Shape nodes
    of the removed 4-D tensors (each replaced by what ``_shape_from_source`` makes), or None."""
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
    reads: dict[int, _ShapeRead] = {id(n): (n, h.source, (0, None, 1, None), (0, h.heads, 0, h.size))
                                    for h in (q, k, v) for n in h.shapes}
    reads |= {id(n): (n, q.source, (0, 1, None, None), (0, 0, q.heads, v.size)) for n in merge.shapes}
    return packed, covered, list(reads.values())


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
        packed, covered, shape_reads = found
        packed.origin = origins(sorted(covered, key=lambda n: order[id(n)]))
        replaced.update({id(n): [] for n in covered})
        replaced[id(node)] = [packed]
        folded += 1
        replaced.update({id(read[0]): _shape_from_source(graph, read) for read in shape_reads})
    graph.nodes = [m for n in graph.nodes for m in replaced.get(id(n), [n])]
    return folded
