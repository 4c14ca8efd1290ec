"""Rotary position embeddings written out op by op -> one ``kiln.Rotary`` (engine_core/ops/fused.py).

    y = x * cos + rotate(x) * sin
    rotate_half(x)      = Concat(Neg(x[..., D/2:]), x[..., :D/2], axis=-1)     Llama, Mistral, Qwen, GPT-NeoX
                          (the halves two Slices, or a Split in two)
    rotate_every_two(x) = Reshape(Concat(Unsqueeze(Neg(x[..., 1::2]), -1), Unsqueeze(x[..., ::2], -1), axis=-1),
                                  [x's leading dims..., -1])                    GPT-J (torch.stack + flatten)

cos and sin are any tensors that broadcast against x (exports compute them from the position ids in the graph, and
Llama's layers share them). The halves are proved from the Slices' bounds, which torch computes at run time from
``x.shape[-1] // 2`` (attention_facts.Facts reads them back to ints). When x is a Transpose that nothing else reads
(Llama's head split [B, S, H, D] -> [B, H, S, D]) the fused layer reads the Transpose's input transposed (attribute
``perm``: the CUDA kernel reads it through strides) and the Transpose goes, with the shape arithmetic that only fed
the covered Slices' bounds (or the stacked form's Reshape target).

Why: per rotated tensor (q and k of every layer) six to nine layers (Slices, Neg, Concat, Muls, Add) and a head
Transpose become one kernel that reads x once and writes y once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine_core.ir import Graph, Node
from engine_core.passes.attention_facts import Facts
from engine_core.passes.pattern import Match, Uses, feeding_only, fuse_matches, is_op, origins, other_input
from engine_core.passes.symbolic import symbolic_shapes


@dataclass(frozen=True)
class _Rotation:
    """One rotate(x) found: the rotated tensor x, the nodes computing rotate(x) from it, whether interleaved, and the
    tensors besides x whose other readers must only feed those nodes (a stacked form's Concat, read by the Shape of
    its Reshape target)."""

    x: str
    nodes: list[Node]
    interleaved: bool
    shared: tuple[str, ...] = ()


def _ints(facts: Facts, name: str) -> list[int] | None:
    values = facts.value(name) if name else None
    if values is None or not all(isinstance(v, int) for v in values):
        return None
    return [v for v in values if isinstance(v, int)]


def _last_axis(facts: Facts, x: str, axis: int) -> bool:
    rank = facts.rank(x)
    return rank is not None and axis in (-1, rank - 1)


def _sliced(facts: Facts, node: Node | None, x: str, width: int) -> list[int] | None:
    """The indices of x's last axis (of ``width``) a Slice of x along that axis keeps, in order; None for anything
    else (another axis, bounds unknown at build time)."""
    if not is_op(node, "Slice") or node.inputs[0] != x or len(node.inputs) < 3:
        return None
    starts, ends = _ints(facts, node.inputs[1]), _ints(facts, node.inputs[2])
    axes = _ints(facts, node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] else [0]
    steps = _ints(facts, node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] else [1]
    if not (starts and ends and axes and steps) or not len(starts) == len(ends) == len(axes) == len(steps) == 1:
        return None
    if not _last_axis(facts, x, axes[0]) or steps[0] <= 0:
        return None
    return list(range(width)[slice(starts[0], ends[0], steps[0])])  # Python's slice clamps as ONNX's does


def _halves(facts: Facts, uses: Uses, x: str, first: str, second: str, width: int) -> list[Node] | None:
    """The nodes splitting x into first = x[..., :D/2] and second = x[..., D/2:]: two Slices, or one Split."""
    half = list(range(width // 2))
    a, b = uses.producers.get(first), uses.producers.get(second)
    if is_op(a, "Split") and a is b and a.inputs[0] == x and a.outputs == [first, second] and \
            _last_axis(facts, x, a.attr("axis", 0)):
        sizes = _ints(facts, a.inputs[1]) if len(a.inputs) > 1 and a.inputs[1] else [width // 2] * 2
        return [a] if sizes == [width // 2] * 2 else None
    if _sliced(facts, a, x, width) == half and _sliced(facts, b, x, width) == [i + width // 2 for i in half]:
        return [a, b]
    return None


def _width(facts: Facts, x: str) -> int | None:
    """x's last dim when the graph fixes it to an even size."""
    width = facts.dim(x, -1)
    return width if isinstance(width, int) and width > 0 and width % 2 == 0 else None


def _rotate_half(facts: Facts, uses: Uses, rotated: str) -> _Rotation | None:
    """Concat(Neg(second half), first half) along the last axis."""
    concat = uses.producer(rotated, "Concat")
    if concat is None or len(concat.inputs) != 2:
        return None
    neg = uses.producer(concat.inputs[0], "Neg")
    halves = uses.producers.get(concat.inputs[1])
    x = halves.inputs[0] if neg is not None and halves is not None and halves.inputs else ""
    width = _width(facts, x) if x else None
    if width is None or not _last_axis(facts, x, concat.attr("axis", 0)):
        return None
    split = _halves(facts, uses, x, concat.inputs[1], neg.inputs[0], width)
    if split is None or uses.sole_reader(concat.inputs[0]) is not concat or \
            uses.sole_reader(concat.inputs[1]) is not concat or uses.sole_reader(neg.inputs[0]) is not neg:
        return None
    return _Rotation(x, [*split, neg, concat], interleaved=False)


def _unsqueezed_last(facts: Facts, uses: Uses, name: str) -> Node | None:
    """The Unsqueeze adding a last axis that writes ``name``."""
    node = uses.producer(name, "Unsqueeze")
    if node is None or uses.sole_reader(name) is None:
        return None
    axes = _ints(facts, node.inputs[1]) if len(node.inputs) > 1 else [int(a) for a in node.attr("axes", [])]
    rank = facts.rank(node.inputs[0])
    return node if rank is not None and axes in ([-1], [rank]) else None


def _rotate_every_two(facts: Facts, uses: Uses, rotated: str) -> _Rotation | None:
    """Reshape(Concat(Unsqueeze(Neg(x[..., 1::2])), Unsqueeze(x[..., ::2])) along a new last axis) back to x's
    shape: pairs (a, b) become (-b, a)."""
    reshape = uses.producer(rotated, "Reshape")
    concat = uses.producer(reshape.inputs[0], "Concat") if reshape is not None else None
    if concat is None or len(concat.inputs) != 2:
        return None
    odd_up, even_up = (_unsqueezed_last(facts, uses, name) for name in concat.inputs)
    neg = uses.producer(odd_up.inputs[0], "Neg") if odd_up is not None and even_up is not None else None
    odd = uses.producers.get(neg.inputs[0]) if neg is not None else None
    even = uses.producers.get(even_up.inputs[0]) if even_up is not None else None
    x = odd.inputs[0] if odd is not None and even is not None and odd.inputs else ""
    width = _width(facts, x) if x else None
    if width is None or facts.rank(concat.outputs[0]) != (facts.rank(x) or 0) + 1 or \
            not _last_axis(facts, concat.outputs[0], concat.attr("axis", 0)):
        return None
    if _sliced(facts, even, x, width) != list(range(0, width, 2)) or \
            _sliced(facts, odd, x, width) != list(range(1, width, 2)) or \
            uses.sole_reader(neg.outputs[0]) is not odd_up or uses.sole_reader(neg.inputs[0]) is not neg or \
            uses.sole_reader(even.outputs[0]) is not even_up or not _restores(facts, reshape, x, concat.outputs[0]):
        return None
    return _Rotation(x, [even, odd, neg, odd_up, even_up, concat, reshape], interleaved=True,
                     shared=(concat.outputs[0],))


def _restores(facts: Facts, reshape: Node, x: str, stacked: str) -> bool:
    """The Reshape gives the stacked [..., D/2, 2] tensor x's shape back: its target keeps every leading dim (0, or
    the dim of x or of the stacked tensor) and ends in -1 or D."""
    target = facts.value(reshape.inputs[1])
    rank = facts.rank(x)
    if target is None or rank is None or len(target) != rank or target[-1] not in (-1, facts.dim(x, -1)):
        return False
    copies = 0 if not reshape.attr("allowzero", 0) else None
    return all(d == copies or d in (facts.dim(x, axis), facts.dim(stacked, axis)) for axis, d in
               enumerate(target[:-1]))


def _transposed(graph: Graph, uses: Uses, x: str, covered: list[Node]) -> tuple[str, list[int], list[Node]] | None:
    """(x's source, perm, the Transpose and the dead shape arithmetic) when x is a Transpose that, but for the covered
    nodes and shape arithmetic feeding only them, nothing reads."""
    transpose = uses.producer(x, "Transpose")
    perm = transpose.attr("perm") if transpose is not None else None
    if not perm:
        return None
    dead = feeding_only(uses, x, {id(n) for n in covered})
    return (transpose.inputs[0], [int(p) for p in perm], [transpose, *dead]) if dead is not None else None


def _rotary(graph: Graph, uses: Uses, facts: Facts, add: Node, taken: set[int]) -> Match | None:
    """The ``kiln.Rotary`` for x * cos + rotate(x) * sin ending at ``add``."""
    if len(add.inputs) != 2 or any(uses.sole_reader(name) is not add for name in add.inputs):
        return None
    for plain_name, rotated_name in (add.inputs, add.inputs[::-1]):
        plain, product = uses.producer(plain_name, "Mul"), uses.producer(rotated_name, "Mul")
        if plain is None or product is None:
            continue
        for rotated in dict.fromkeys(product.inputs):
            sin = other_input(product, rotated)
            if sin is None or uses.sole_reader(rotated) is not product:
                continue
            rotation = _rotate_half(facts, uses, rotated) or _rotate_every_two(facts, uses, rotated)
            cos = other_input(plain, rotation.x) if rotation is not None else None
            if rotation is not None and cos is not None:
                return _fused(graph, uses, rotation, cos, sin, [*rotation.nodes, product, plain, add], taken)
    return None


def _fused(graph: Graph, uses: Uses, rotation: _Rotation, cos: str, sin: str, covered: list[Node],
           taken: set[int]) -> Match | None:
    """The Rotary node replacing ``covered`` (and x's Transpose when it can go); the shape arithmetic dropped with
    them is not named in its origin."""
    dead: list[Node] = []
    for name in rotation.shared:  # the stacked tensor's Shape for the Reshape target
        found = feeding_only(uses, name, {id(n) for n in covered})
        if found is None:
            return None
        dead += found
    if any(id(n) in taken for n in covered + dead):
        return None
    source = rotation.x
    attrs: dict[str, Any] = {"interleaved": int(rotation.interleaved)}
    transposed = _transposed(graph, uses, rotation.x, covered + dead)
    if transposed is not None and not any(id(n) in taken for n in transposed[2]):
        source, attrs["perm"], (transpose, *more) = transposed
        covered, dead = [transpose, *covered], dead + more
    add = covered[-1]
    node = Node("Rotary", [source, cos, sin], list(add.outputs), attrs, f"{add.name}_rotary", "kiln", 1,
                origins(covered))
    return node, [*dead, *covered]


def fuse_rotary(graph: Graph) -> int:
    """Replace every rotary embedding x * cos + rotate(x) * sin by one ``kiln.Rotary``; returns how many."""
    uses = Uses(graph)
    facts = Facts(graph, uses, symbolic_shapes(graph))
    return fuse_matches(graph, ("Add",), lambda add, taken: _rotary(graph, uses, facts, add, taken))
