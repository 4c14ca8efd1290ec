"""An ``Attention`` whose only reader is a ``QuantizeLinear`` to int8 -> one ``kiln.AttentionQuantize``.

Pattern (explicitly quantized transformers: the attention output feeds the output projection's input
quantization): ``Attention(q, k, v[, mask]) -> y`` with no past keys and no extra outputs, ``y`` read by nothing
but ``QuantizeLinear(y, scale, zero)`` with one constant fp32 scale and an int8 zero point of 0 (or none, with
``output_dtype`` int8). Both go; ``AttentionQuantize(q, k, v, mask, scale, zero)`` writes the int8 tensor,
computed by the two ops' own code (engine_core/ops/fused.py), so the fused layer equals the unfused ones exactly.

Why: the QuantizeLinear reads the whole attention output back (2 bytes an element in fp16) to write 1 byte an
element, while the flash attention kernel has each value on chip (cuda_kernels/flash_attention.cu). BERT-base
INT8 at batch 64 on the H100 spent 0.19 ms in these 12 QuantizeLinears (session 8). Runs after fuse_qdq_matmul,
which leaves these QuantizeLinears (it absorbs the DequantizeLinears after them).
"""

from __future__ import annotations

from engine_core.ir import Graph, Node
from engine_core.ops.fused import DOMAIN
from engine_core.passes.pattern import Uses, fuse_matches, int8_per_tensor, is_op


def fuse_attention_quantize(graph: Graph) -> int:
    """Fold each eligible QuantizeLinear into the Attention it reads; returns how many were folded."""
    uses = Uses(graph)

    def match(attention: Node, _: set[int]) -> tuple[Node, list[Node]] | None:
        if len(attention.inputs) > 4 or any(attention.outputs[1:]):
            return None
        q = uses.sole_reader(attention.outputs[0])
        if not is_op(q, "QuantizeLinear") or q.inputs[0] != attention.outputs[0] or not int8_per_tensor(graph, q):
            return None
        inputs = [*attention.inputs, *[""] * (4 - len(attention.inputs)), q.inputs[1],
                  q.inputs[2] if len(q.inputs) > 2 else ""]
        node = Node("AttentionQuantize", inputs, [q.outputs[0]], dict(attention.attrs), attention.name, DOMAIN,
                    attention.opset, [*attention.origin, *q.origin])
        return node, [q, attention]  # in the Attention's place

    return fuse_matches(graph, ("Attention",), match)
