"""Scaled dot-product attention, as exporters write it, -> one ONNX ``Attention`` (opset 23).

    MatMul(Q, K^T) -> Mul/Div(scalar) -> [Add(mask) | Where(mask, ., -big)] -> Softmax(-1) -> MatMul(., V)

with 4-D Q/K/V [batch, heads, seq, head_dim]; a Where mask (GPT-2's causal mask) becomes a boolean
mask. K^T is a Transpose swapping the last two dims of K (BERT's export), or a Transpose with perm
(0, 2, 3, 1) of the [batch, seq, heads, dim] tensor, in which case a Transpose to [batch, heads, seq,
dim] takes its place. Why: the backend runs the scores, the masked softmax and the weighted sum
without materializing K^T or the scaled/masked copies of the scores.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache, partial

from engine_core.ir import Graph, Node
from engine_core.passes.pattern import Match, Uses, fuse_matches, is_op, known_rank, origins, other_input, scalar
from engine_core.passes.symbolic import Symbols, symbolic_shapes

#: Where(cond, scores, fill) before the softmax is a boolean mask when fill is at most this: exp(fill - max)
#: is 0 in every float type, as for the -inf the Attention op adds (rows with no visible key differ: Where
#: gives them uniform weights, Attention does not; exporters' causal and padding masks never have them).
MASKED = -1e4


def _key(graph: Graph, uses: Uses, kt: str, extra: list[Node]) -> str | None:
    """K as [B, H, S, D] given K^T; may add a Transpose node to ``extra``."""
    node = uses.producers.get(kt)
    if not is_op(node, "Transpose") or uses.sole_reader(kt) is None:
        return None
    perm = list(node.attr("perm", []) or [])
    if perm == [0, 1, 3, 2]:
        return node.inputs[0]
    if perm == [0, 2, 3, 1]:  # from [B, S, H, D]
        name = graph.unique_name(f"{node.name}_bhsd")
        extra.append(Node("Transpose", [node.inputs[0]], [name], {"perm": [0, 2, 1, 3]}, f"{node.name}_bhsd", "",
                          node.opset or 13, list(node.origin)))
        return name
    return None


def _mask_over_keys(graph: Graph, sym: Symbols, mask: str, kt: str, key: str, name: str, extra: list[Node]) -> str:
    """The mask as Attention's ``attn_mask``, whose last dim must be the key count: an Add/Where operand may
    broadcast along the keys (last dim 1), which Attention would read as "pad with -inf". Unless the shapes prove
    the last dims equal (K^T's last dim, ``kt``), an Expand to the key count of ``key`` ([B, H, S, D]) goes in
    front: a copy of the mask, not of the scores."""
    mask_shape, key_shape = sym.shape(mask), sym.shape(kt)
    if mask_shape and key_shape and mask_shape[-1] == key_shape[-1]:
        return mask
    keys, expanded = graph.unique_name(f"{name}_keys"), graph.unique_name(f"{name}_mask")
    extra.append(Node("Shape", [key], [keys], {"start": -2, "end": -1}, keys, "", 15, []))
    extra.append(Node("Expand", [mask, keys], [expanded], {}, expanded, "", 13, []))
    return expanded


def _four_d(graph: Graph, uses: Uses, name: str) -> bool:
    """``name`` is known to be 4-D ([batch, heads, seq, head_dim], as Attention's 4-D form needs)."""
    return known_rank(graph, uses, name) == 4


def _scores_side(graph: Graph, uses: Uses, add: Node) -> tuple[str, str] | None:
    """(scores, mask) of the Add before the softmax: the scores come from MatMul(Q, K^T), maybe scaled."""
    for scores, mask in (add.inputs, add.inputs[::-1]):
        node = uses.producers.get(scores)
        if is_op(node, "Mul", "Div"):
            node = next((uses.producers.get(i) for i in node.inputs if is_op(uses.producers.get(i), "MatMul")), None)
        if is_op(node, "MatMul") and _four_d(graph, uses, node.inputs[0]):
            return scores, mask
    return None


def _scores(graph: Graph, uses: Uses, softmax: Node) -> tuple[list[Node], str, float, Node] | None:
    """(the mask and scale nodes, mask, scale, the MatMul(Q, K^T)) behind the softmax's input, else None."""
    covered, mask, tensor = [], "", softmax.inputs[0]
    node = uses.producers.get(tensor)
    if is_op(node, "Where") and uses.sole_reader(tensor) is softmax:
        fill = scalar(graph, node.inputs[2])
        if fill is None or fill > MASKED:
            return None
        covered.append(node)
        mask, tensor = node.inputs[0], node.inputs[1]
        node = uses.producers.get(tensor)
    elif is_op(node, "Add") and uses.sole_reader(tensor) is softmax:
        sides = _scores_side(graph, uses, node)
        if sides is None:
            return None
        covered.append(node)
        tensor, mask = sides
        node = uses.producers.get(tensor)
    scale = 1.0
    if is_op(node, "Mul", "Div") and uses.sole_reader(tensor) is not None:
        constant = next((i for i in node.inputs if scalar(graph, i) is not None), None)
        operand = other_input(node, constant) if constant else None
        if operand is None or (node.op_type == "Div" and node.inputs[1] != constant) or not scalar(graph, constant):
            return None
        value = scalar(graph, constant)
        scale = value if node.op_type == "Mul" else 1.0 / value
        covered.append(node)
        tensor = operand
        node = uses.producers.get(tensor)
    if not is_op(node, "MatMul") or uses.sole_reader(tensor) is None or not _four_d(graph, uses, node.inputs[0]):
        return None
    return covered, mask, scale, node


def _attention(graph: Graph, uses: Uses, symbols: Callable[[], Symbols], softmax: Node, taken: set[int]) -> \
        Match | None:
    """The ``Attention`` node (after the Transpose of K it may need) for the block around ``softmax``, in the place
    of the MatMul by V; None when the block does not match or an earlier match took part of it."""
    if softmax.attr("axis", -1 if softmax.opset >= 13 else 1) not in (-1, 3):
        return None
    out = uses.sole_reader(softmax.outputs[0])
    if not is_op(out, "MatMul") or out.inputs[0] != softmax.outputs[0] or not _four_d(graph, uses, out.inputs[1]):
        return None
    found = _scores(graph, uses, softmax)
    if found is None:
        return None
    covered, mask, scale, scores = found
    extra: list[Node] = []
    key = _key(graph, uses, scores.inputs[1], extra)
    covered = [softmax, *covered, scores, out]
    if key is None or any(id(n) in taken for n in covered):
        return None
    key_transpose = uses.producers[scores.inputs[1]]
    # the layers the Attention stands for: K's Transpose too, unless the Transpose in ``extra`` took its place (and
    # origin); decided before the mask's Shape and Expand join ``extra``
    stands_for = covered if extra else [*covered, key_transpose]
    if mask:
        mask = _mask_over_keys(graph, symbols(), mask, scores.inputs[1], key, softmax.name, extra)
    inputs = [scores.inputs[0], key, out.inputs[1]] + ([mask] if mask else [])
    attention = Node("Attention", inputs, [out.outputs[0]], {"scale": float(scale)}, f"{softmax.name}_attention",
                     "", 23, origins(sorted(stands_for, key=graph.nodes.index)))
    return [*extra, attention], [key_transpose, *covered]


def fuse_attention(graph: Graph) -> int:
    """Replace every matching attention block by an ``Attention`` node; returns how many."""
    uses = Uses(graph)
    symbols = cache(partial(symbolic_shapes, graph))  # computed once, and only when a mask needs it
    return fuse_matches(graph, ("Softmax",),
                        lambda softmax, taken: _attention(graph, uses, symbols, softmax, taken))
