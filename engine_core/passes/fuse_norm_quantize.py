"""A ``QuantizeLinear`` to int8 of a ``kiln.SkipLayerNorm``'s output -> that SkipLayerNorm's second output.

Pattern (explicitly quantized post-LN transformers: BERT's LayerNorm output feeds the next residual in float and
the next linear layer's input quantization): ``SkipLayerNorm(x, skip, gamma[, beta]) -> y``, and
``QuantizeLinear(y, scale, zero)`` with one constant scale and an int8 zero point of 0 (or none, with
``output_dtype`` int8). The QuantizeLinear goes; the SkipLayerNorm takes ``scale, zero`` as inputs 4, 5 and writes
the quantized tensor as output 1, computed by QuantizeLinear's own code from the stored ``y``
(engine_core/ops/fused.py), so the fused layer equals the two unfused ones exactly. When nothing else reads ``y``
(the residual stream quantized too: the next layer's skip is the int8 tensor), output 0 becomes "" and is not written.

Why: the QuantizeLinear reads the whole activation back (2 bytes an element in fp16) to write 1 byte an
element, while the norm kernel has each value in a register (cuda_kernels/skip_layer_norm.cu). BERT-base INT8
at batch 64 on the H100 had 36 standalone QuantizeLinear kernels (0.55 ms), 24 after a SkipLayerNorm; folded,
7.34 -> 7.26 ms (docs/cuda-backend.md). Runs after fuse_qdq_matmul, which leaves these QuantizeLinears (it
absorbs the DequantizeLinears after them).
"""

from __future__ import annotations

from engine_core.ir import Graph, Node
from engine_core.ops.fused import DOMAIN
from engine_core.passes.pattern import Uses, fuse_matches, int8_per_tensor, is_op


def fuse_norm_quantize(graph: Graph) -> int:
    """Fold each eligible QuantizeLinear into the SkipLayerNorm it reads; returns how many were folded."""
    uses = Uses(graph)

    def match(norm: Node, _: set[int]) -> tuple[Node, list[Node]] | None:
        if any(norm.outputs[1:]) or len(norm.inputs) > 4:
            return None
        q = next((r for r in uses.consumers.get(norm.outputs[0], [])
                  if is_op(r, "QuantizeLinear") and r.inputs[0] == norm.outputs[0] and int8_per_tensor(graph, r)), None)
        if q is None:
            return None
        zero = q.inputs[2] if len(q.inputs) > 2 else ""
        inputs = [*norm.inputs, *[""] * (4 - len(norm.inputs)), q.inputs[1], zero]
        # the float output goes when the QuantizeLinear was its only reader (the kernel then writes int8 alone)
        y = "" if uses.sole_reader(norm.outputs[0]) is q else norm.outputs[0]
        node = Node(norm.op_type, inputs, [y, q.outputs[0]], dict(norm.attrs), norm.name, norm.domain,
                    norm.opset, [*norm.origin, *q.origin])
        return node, [q, norm]  # in the SkipLayerNorm's place

    return fuse_matches(graph, ("SkipLayerNorm",), match, DOMAIN)
