"""DequantizeLinears of int8 tensors feeding a ``kiln.SkipLayerNorm``'s x and skip -> that layer's inputs 6, 7.

Pattern (the residual stream quantized too, as fully INT8 BERTs run it: the attention output projection and FFN2
write int8, and the skip is the previous LayerNorm's int8 output): ``SkipLayerNorm(DequantizeLinear(x_q, x_scale),
DequantizeLinear(skip_q, skip_scale), gamma, ...)`` where both DequantizeLinears read int8 through one constant fp32
scale with zero point 0 and write gamma's type. The layer then reads ``x_q`` and ``skip_q`` and dequantizes them by
DequantizeLinear's own arithmetic (engine_core/ops/fused.py), so it equals the unfused graph exactly. Both operands
or neither: the kernel has no mixed form.

Why: the DequantizeLinears would write two float tensors (2 bytes an element in fp16) only for the norm to read
them back; the norm kernel reads the int8 bytes (cuda_kernels/skip_layer_norm.cu). With fuse_norm_quantize's int8
output, and the float output gone when nothing else reads it, the layer moves 3 bytes an element instead of 7.
Runs after fuse_qdq_matmul (which leaves the DequantizeLinears other layers read) and fuse_norm_quantize.
"""

from __future__ import annotations

import numpy as np

from engine_core.ir import Graph, Node
from engine_core.ops.fused import DOMAIN
from engine_core.passes.fuse_qdq_matmul import _activation_dq, _dq_output_dtype
from engine_core.passes.pattern import Uses, fuse_matches


def fuse_norm_dequantize(graph: Graph) -> int:
    """Absorb the int8 DequantizeLinears of every eligible SkipLayerNorm's operands; returns how many layers changed."""
    uses = Uses(graph)

    def match(norm: Node, _: set[int]) -> tuple[Node, list[Node]] | None:
        gamma = graph.constants.get(norm.inputs[2])
        if len(norm.inputs) > 6 or not isinstance(gamma, np.ndarray):
            return None
        dqs = [_activation_dq(graph, uses, name) for name in norm.inputs[:2]]
        if any(dq is None or graph.constants[dq.inputs[1]].dtype != np.float32
               or _dq_output_dtype(graph, dq) != gamma.dtype for dq in dqs):
            return None
        inputs = [dqs[0].inputs[0], dqs[1].inputs[0], *norm.inputs[2:], *[""] * (6 - len(norm.inputs)),
                  dqs[0].inputs[1], dqs[1].inputs[1]]
        node = Node(norm.op_type, inputs, list(norm.outputs), dict(norm.attrs), norm.name, norm.domain, norm.opset,
                    [*norm.origin, *dqs[0].origin, *dqs[1].origin])
        return node, [norm]  # the DequantizeLinears stay for their other readers (dead-code elimination drops them)

    return fuse_matches(graph, ("SkipLayerNorm",), match, DOMAIN)
