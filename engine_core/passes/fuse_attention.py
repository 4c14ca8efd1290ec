"""Scaled dot-product attention, as exporters write it, -> one ONNX ``Attention`` (opset 23).

The pass matches the computation ``softmax(s * Q K^T + mask) V``, not one exporter's nodes:

- the scores: MatMul(Q, K^T) of 4-D Q/K/V [batch, heads, seq, head_dim]; K^T is a Transpose swapping the last two
  dims of K (BERT, sdpa), or perm (0, 2, 3, 1) of a [batch, seq, heads, dim] K (GPT-2, T5: torch merges the head
  split and the swap), in which case a Transpose to [batch, heads, seq, dim] takes its place;
- the scale s: the product of scalar Mul/Div on the scores and on either MatMul operand. torch's sdpa export
  multiplies Q and K^T by sqrt(scale) each (T5 and Whisper by 1), with a constant scale or, by default, one it
  computes at run time from ``q.shape[-1]`` (ViT): ``1 / sqrt(head_dim)`` is Attention's own default scale;
- the mask: Add(scores, mask) (a float mask: padding, causal, T5's relative position bias) or
  Where(mask, scores, fill <= -1e4) (a boolean one);
- Softmax over the last axis, maybe read through sdpa's ``Where(IsNaN(p), 0, p)``: the NaN rows are those with every
  key masked, which Attention (and the flash kernel) give zeros as well;
- grouped-query attention: K and V repeated per query-head group (transformers' ``repeat_kv``: Unsqueeze(2) ->
  Expand -> Reshape) are read unrepeated, with fewer KV heads than query heads;
- a Reshape of the output to its own shape (transformers' sdpa path) is absorbed, so that fold_attention_heads
  finds the head merge right after the Attention.

Why: the backend runs the scores, the masked softmax and the weighted sum without materializing K^T or the
scaled/masked copies of the scores (the flash kernel), and reads K/V once per KV head instead of per query head.
The facts a match must prove (ranks, the scale as a function of the head size, the repeat of K/V, the identity
Reshape) come from attention_facts, which works where symbolic shapes stop (Conv front ends, rotary embeddings).
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import TypeGuard

from engine_core.ir import Graph, Node
from engine_core.passes.attention_facts import Facts, Monomial
from engine_core.passes.pattern import Match, Uses, fuse_matches, is_op, origins, scalar
from engine_core.passes.symbolic import Sym, symbolic_shapes

#: Where(cond, scores, fill) before the softmax is a boolean mask when fill is at most this: exp(fill - max)
#: is 0 in every float type, as for the -inf the Attention op adds (rows with no visible key differ: Where
#: gives them uniform weights, Attention does not; exporters' causal and padding masks never have them).
MASKED = -1e4
#: Relative rounding error of a float constant of each type (half an ulp), and a bound for the fp32 arithmetic of a
#: scale computed at run time.
_ROUNDING = {"float64": 2.0 ** -53, "float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
_ARITHMETIC = 2.0 ** -21
#: K^T's Transpose perms: whether K is [B, S, H, D] (a Transpose to [B, H, S, D] replaces it) or [B, H, S, D].
_KEY_PERMS = {(0, 1, 3, 2): False, (0, 2, 3, 1): True}


def _op(node: Node | None, *op_types: str) -> TypeGuard[Node]:
    """``is_op`` as a type guard."""
    return is_op(node, *op_types)


@dataclasses.dataclass
class _Block:
    """One attention block's parts as matched so far."""

    covered: list[Node]                                  # the nodes the Attention replaces
    factors: list[tuple[str, bool]] = dataclasses.field(default_factory=list)  # scalars (tensor, divides) on scores
    mask: str = ""
    dropped: bool = False  # a boolean mask that is true where keys are masked out (masked_fill)


class _Matcher:
    """Matches attention blocks of one graph; the facts (symbolic shapes first) are computed on the first softmax
    that needs them."""

    def __init__(self, graph: Graph) -> None:
        self.graph, self.uses = graph, Uses(graph)
        self._facts: Facts | None = None

    @property
    def facts(self) -> Facts:
        if self._facts is None:
            self._facts = Facts(self.graph, self.uses, symbolic_shapes(self.graph))
        return self._facts

    # -- the scores: mask, scale factors, MatMul(Q, K^T) --------------------------------------------------------

    def peel(self, tensor: str, reader: Node, block: _Block) -> tuple[str, Node]:
        """(``tensor`` without the scalar Mul/Div nodes in front of ``reader``, each read only by the next, which go
        into ``block``; the node reading what is left)."""
        while True:
            node = self.uses.producers.get(tensor)
            if not _op(node, "Mul", "Div") or len(node.inputs) != 2 or self.uses.sole_reader(tensor) is not reader:
                return tensor, reader
            pairs = [node.inputs, node.inputs[::-1]] if node.op_type == "Mul" else [node.inputs]
            split = next(((data, f) for data, f in pairs if self._is_factor(f)), None)
            if split is None:
                return tensor, reader
            block.covered.append(node)
            block.factors.append((split[1], node.op_type == "Div"))
            tensor, reader = split[0], node

    def _is_factor(self, name: str) -> bool:
        """A one-element float tensor of rank <= 4 (multiplying by it keeps the scores' rank)."""
        rank = self.facts.rank(name)
        return rank is not None and rank <= 4 and self.facts.factor(name) is not None

    def scores(self, softmax: Node, mask_first: bool) -> tuple[_Block, Node] | None:
        """The block behind the softmax's input up to MatMul(Q, K^T) (the MatMul too), with the mask as the first
        (``mask_first``) or the second operand of an Add."""
        tensor, reader, block = softmax.inputs[0], softmax, _Block([])
        if self.uses.sole_reader(tensor) is not reader:
            return None
        node = self.uses.producers.get(tensor)
        if _op(node, "Where") and len(node.inputs) == 3:
            # Where(keep, scores, fill) or masked_fill's Where(drop, fill, scores): the mask says where to attend
            fills = [scalar(self.graph, node.inputs[i]) for i in (2, 1)]
            side = next((i for i, fill in enumerate(fills) if fill is not None and fill <= MASKED), None)
            if side is None:
                return None
            block.covered.append(node)
            block.mask, block.dropped = node.inputs[0], side == 1
            tensor, reader = node.inputs[1 + side], node
        elif _op(node, "Add") and len(node.inputs) == 2:
            block.covered.append(node)
            block.mask, tensor = node.inputs if mask_first else node.inputs[::-1]
            reader = node
        elif mask_first:  # only an Add has a second order to try
            return None
        if self.uses.sole_reader(tensor) is not reader:
            return None
        tensor, _ = self.peel(tensor, reader, block)
        matmul = self.uses.producers.get(tensor)
        if not _op(matmul, "MatMul") or block.mask in matmul.outputs:
            return None
        block.covered.append(matmul)
        return block, matmul

    # -- K and V ------------------------------------------------------------------------------------------------

    def repeated(self, name: str, reader: Node) -> tuple[str, Sym, list[Node], list[Node]] | None:
        """(the source, the repeat count, the nodes, Shape nodes reading ``name``) when ``name`` is a [B, H, S, D]
        source repeated per query-head group: Reshape(Expand(Unsqueeze(source, 2), [B|1, H|1, n, S|1, D|1]),
        [B, *, S, D]) (the Reshape keeps the element count, so * is H * n), each read only by the next, ``name``
        also by Shape nodes (they must die with the block)."""
        reshape = self.uses.producers.get(name)
        readers = self.uses.consumers.get(name, [])
        shapes = [n for n in readers if _op(n, "Shape")]
        if not _op(reshape, "Reshape") or name in self.uses.outputs or reader not in readers or \
                len(readers) != len(shapes) + 1:
            return None
        expand = self.uses.producers.get(reshape.inputs[0])
        if not _op(expand, "Expand") or self.uses.sole_reader(reshape.inputs[0]) is not reshape:
            return None
        unsqueeze = self.uses.producers.get(expand.inputs[0])
        if not _op(unsqueeze, "Unsqueeze") or self.uses.sole_reader(expand.inputs[0]) is not expand:
            return None
        axes = self.facts.ints(unsqueeze.inputs[1]) if len(unsqueeze.inputs) > 1 else unsqueeze.attr("axes")
        source, facts = unsqueeze.inputs[0], self.facts
        if axes is None or [int(a) for a in axes] not in ([2], [-3]) or facts.rank(source) != 4:
            return None
        sizes, target = facts.value(expand.inputs[1]), facts.value(reshape.inputs[1])
        dims = [facts.dim(source, axis) for axis in range(4)]
        if sizes is None or target is None or len(sizes) != 5 or len(target) != 4:
            return None
        kept = not reshape.attr("allowzero", 0)
        if not all(sizes[j] in (1, dims[i]) for j, i in ((0, 0), (1, 1), (3, 2), (4, 3))) or \
                not all(target[i] == dims[i] or (kept and target[i] == 0) for i in (0, 2, 3)):
            return None
        if not isinstance(sizes[2], int) or sizes[2] < 1:
            return None
        return source, sizes[2], [unsqueeze, expand, reshape], shapes

    def key(self, kt: str, reader: Node, extra: list[Node]) -> tuple[str, Node, bool] | None:
        """(K as [B, H, S, D], K^T's Transpose, whether a new Transpose in ``extra`` replaces it) for K^T ``kt``. K^T
        from [B, S, H, D] reads an existing Transpose to [B, H, S, D] of it if there is one (T5's first layer keeps
        one for the key length), else a new one."""
        transpose = self.uses.producers.get(kt)
        if not _op(transpose, "Transpose") or self.uses.sole_reader(kt) is not reader:
            return None
        perm = tuple(int(p) for p in transpose.attr("perm", []) or [])
        if perm not in _KEY_PERMS:
            return None
        if not _KEY_PERMS[perm]:
            return transpose.inputs[0], transpose, False
        heads = next((n for n in self.uses.consumers.get(transpose.inputs[0], [])
                      if _op(n, "Transpose") and list(n.attr("perm") or []) == [0, 2, 1, 3]), None)
        if heads is not None:
            return heads.outputs[0], transpose, False
        name = self.graph.unique_name(f"{transpose.name}_bhsd")
        extra.append(Node("Transpose", [transpose.inputs[0]], [name], {"perm": [0, 2, 1, 3]}, f"{transpose.name}_bhsd",
                          "", transpose.opset or 13, list(transpose.origin)))
        return name, transpose, True

    # -- scale, mask, output ------------------------------------------------------------------------------------

    def scale(self, block: _Block, heads: set[Sym | None]) -> float | None | bool:
        """The Attention scale of the block's factors: a number, None for Attention's default (1 / sqrt(head size),
        a factor computed from a dim in ``heads``), or False when the product is neither. A product within the
        rounding of its constant factors (sdpa's sqrt(1 / sqrt(d)) twice; in 16 bits once the precision pass
        converted them) of 1 / sqrt(head size) is that: the fused kernel scales with the exact value, as the model
        meant."""
        total: Monomial | None = Monomial(1.0)
        rounding = _ARITHMETIC  # relative error bound of the factors' product
        for name, divides in block.factors:
            factor = self.facts.factor(name)
            factor = factor.inverse() if factor is not None and divides else factor
            total = total.times(factor) if total is not None and factor is not None else None
            constant = self.graph.constants.get(name)
            rounding += _ROUNDING.get(constant.dtype.name, 0.0) if constant is not None else 0.0
        if total is None or not total.coef:
            return False
        head = next((d for d in heads if isinstance(d, int) and d > 0), None)
        if not total.power:
            near_default = head is not None and abs(total.coef * math.sqrt(head) - 1.0) <= rounding
            return 1.0 / math.sqrt(head) if near_default and head else total.coef
        default = total.power == Fraction(-1, 2) and total.dim in heads and math.isclose(total.coef, 1.0, rel_tol=1e-6)
        return None if default else False

    def mask_over_keys(self, block: _Block, kt: str, key: str, name: str, extra: list[Node]) -> str:
        """The block's mask as Attention's ``attn_mask`` (true where it attends, if boolean), whose last dim must be
        the key count: an Add/Where operand may broadcast along the keys (last dim 1), which Attention would read as
        "pad with -inf". Unless the shapes prove the last dims equal (K^T's last dim, ``kt``), an Expand to the key
        count of ``key`` ([B, H, S, D]) goes in front: a copy of the mask, not of the scores."""
        mask_keys, keys, mask = self.facts.dim(block.mask, -1), self.facts.dim(kt, -1), block.mask
        if block.dropped:
            mask = self.graph.unique_name(f"{name}_keep")
            extra.append(Node("Not", [block.mask], [mask], {}, mask, "", 1, []))
        if mask_keys is not None and mask_keys == keys:
            return mask
        count, expanded = self.graph.unique_name(f"{name}_keys"), self.graph.unique_name(f"{name}_mask")
        extra.append(Node("Shape", [key], [count], {"start": -2, "end": -1}, count, "", 15, []))
        extra.append(Node("Expand", [mask, count], [expanded], {}, expanded, "", 13, []))
        return expanded

    def same_shape_reshape(self, out: str, q: str, v: str) -> tuple[Node, list[Node]] | None:
        """(Reshape, Shape nodes) when ``out`` [B, H, Sq, Dv] is read by one Reshape to its own shape and otherwise
        only by Shape nodes: the Reshape's target is proven the same dims (Q's for B, H, Sq, V's for Dv), at most one
        of them -1 (the element count fixes it) or 0 (a copy of the dim)."""
        readers = self.uses.consumers.get(out, [])
        reshapes = [n for n in readers if _op(n, "Reshape") and n.inputs[0] == out]
        if out in self.uses.outputs or len(reshapes) != 1 or not all(_op(n, "Shape") for n in readers
                                                                      if n is not reshapes[0]):
            return None
        reshape, facts = reshapes[0], self.facts
        target = facts.value(reshape.inputs[1])
        if target is None or len(target) != 4 or target.count(-1) > 1:
            return None
        kept = not reshape.attr("allowzero", 0)
        same = [{facts.dim(out, 0), facts.dim(q, 0)}, {facts.dim(out, 1), facts.dim(q, 1)},
                {facts.dim(out, 2), facts.dim(q, 2)}, {facts.dim(out, 3), facts.dim(v, 3)}]
        if not all(d in same[i] - {None} or d == -1 or (kept and d == 0) for i, d in enumerate(target)):
            return None
        return reshape, [n for n in readers if n is not reshape]

    # -- the block ----------------------------------------------------------------------------------------------

    def attention(self, softmax: Node, taken: set[int]) -> Match | None:
        """The ``Attention`` node (after the nodes it needs: K's Transpose, the mask's Expand) for the block around
        ``softmax``, in the place of the MatMul by V; None when the block does not match or an earlier match took
        part of it."""
        if softmax.attr("axis", -1 if softmax.opset >= 13 else 1) not in (-1, 3):
            return None
        probs, guard = self.probabilities(softmax)
        out = self.uses.sole_reader(probs)
        if not _op(out, "MatMul") or out.inputs[0] != probs:
            return None
        for mask_first, grouped in ((False, True), (False, False), (True, True), (True, False)):
            found = self.scores(softmax, mask_first)
            match = found and self.complete(found[0], found[1], softmax, guard, out, taken, grouped)
            if match:
                return match
        return None

    def probabilities(self, softmax: Node) -> tuple[str, list[Node]]:
        """The tensor MatMul(., V) reads: the softmax's output, or sdpa's Where(IsNaN(p), 0, p) of it (its nodes)."""
        p = softmax.outputs[0]
        readers = self.uses.consumers.get(p, [])
        isnan = next((n for n in readers if _op(n, "IsNaN")), None)
        where = next((n for n in readers if _op(n, "Where")), None)
        if len(readers) != 2 or p in self.uses.outputs or isnan is None or where is None or \
                self.uses.sole_reader(isnan.outputs[0]) is not where or where.inputs[0] != isnan.outputs[0] or \
                where.inputs[2] != p or scalar(self.graph, where.inputs[1]) != 0.0:
            return p, []
        return where.outputs[0], [isnan, where]

    def complete(self, block: _Block, scores: Node, softmax: Node, guard: list[Node], out: Node, taken: set[int],
                 grouped: bool) -> Match | None:
        """The match of a block whose scores are known: Q, K, V (read unrepeated if ``grouped`` and they are
        repeated per query-head group), the scale, the mask and the output."""
        facts, extra = self.facts, list[Node]()
        q, _ = self.peel(scores.inputs[0], scores, block)
        kt, kt_reader = self.peel(scores.inputs[1], scores, block)
        found = self.key(kt, kt_reader, extra)
        if found is None:
            return None
        key, transpose, new_key = found
        v = out.inputs[1]
        in_heads_layout = list(transpose.attr("perm")) == [0, 1, 3, 2]  # K [B, H, S, D]: maybe repeated per group
        repeats = [self.repeated(key, transpose), self.repeated(v, out)] if in_heads_layout and grouped else []
        unrepeated: list[Node] = []  # Shape nodes of the repeated K/V
        if repeats and repeats[0] and repeats[1] and repeats[0][1] == repeats[1][1]:
            key, v = repeats[0][0], repeats[1][0]
            block.covered += repeats[0][2] + repeats[1][2]
            unrepeated = repeats[0][3] + repeats[1][3]
        elif grouped:
            return None  # the ungrouped attempt follows
        if facts.rank(q) != 4 or facts.rank(v) != 4:  # K^T's 4-D perm makes K 4-D
            return None
        scale = self.scale(block, {facts.dim(q, -1), facts.dim(transpose.inputs[0], -1)})
        reshape = self.same_shape_reshape(out.outputs[0], q, v)
        covered = [softmax, *guard, *block.covered, out]
        sources = [self.uses.producers.get(t) for t in (q, key, v, block.mask)]
        if scale is False or scale == 0.0 or any(id(n) in taken for n in [*covered, transpose, *sources]):
            return None
        # the layers the Attention stands for: K's Transpose too, unless a new Transpose took its place (and origin)
        stands_for = [*covered, *([] if new_key else [transpose]), *([reshape[0]] if reshape else [])]
        mask = self.mask_over_keys(block, transpose.outputs[0], key, softmax.name, extra) if block.mask else ""
        inputs = [q, key, v, *([mask] if mask else [])]
        removed = [transpose, *([reshape[0]] if reshape else []), *covered]
        dead = self.dead_cone(removed, {*inputs, *(t for n in extra for t in n.inputs)}, taken)
        if not {id(n) for n in unrepeated} <= {id(n) for n in dead}:
            return None
        output = out.outputs[0]
        if reshape:  # the Attention writes the Reshape's output; Shape nodes of its input read that instead
            output = reshape[0].outputs[0]
            for shape in reshape[1]:
                shape.inputs = [output, *shape.inputs[1:]]
        attention = Node("Attention", inputs, [output], {} if scale is None else {"scale": float(scale)},
                         f"{softmax.name}_attention", "", 23, origins(sorted(stands_for, key=self.graph.nodes.index)))
        return [*extra, attention], [*dead, *removed]

    def dead_cone(self, removed: list[Node], kept: set[str], taken: set[int]) -> list[Node]:
        """The nodes only ``removed`` nodes (or earlier matches') read, and those only they read, and so on, except
        the producers of ``kept`` tensors: the shape arithmetic of a removed Reshape's or Expand's target, a scale
        computed at run time. Removed with the block, they cannot hold on to Q/K/V as extra readers (a Shape of Q
        stops fold_attention_heads)."""
        gone = {id(n) for n in removed} | taken
        cone: list[Node] = []
        changed = True
        while changed:
            changed = False
            for name in {i for n in (*removed, *cone) for i in n.inputs if i and i not in kept}:
                node = self.uses.producers.get(name)
                if node is None or id(node) in gone or any(o in kept or o in self.uses.outputs for o in node.outputs):
                    continue
                if all(id(r) in gone for o in node.outputs for r in self.uses.consumers.get(o, [])):
                    gone.add(id(node))
                    cone.append(node)
                    changed = True
        return cone


def fuse_attention(graph: Graph) -> int:
    """Replace every matching attention block by an ``Attention`` node; returns how many."""
    matcher = _Matcher(graph)
    return fuse_matches(graph, ("Softmax",), matcher.attention)
