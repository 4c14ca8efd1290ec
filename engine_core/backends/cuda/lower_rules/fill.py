"""Lowering rule of ConstantOfShape: a fill of the device tensor from one folded element.

Why a rule of its own: when the target shape is known only as a shape computation (T5's relative-position
buckets: ``torch.full_like`` exported as ConstantOfShape(Shape(x))), the layer's value is not folded at build
time, and without a rule the layer (and every graph around it) would run on the host.
"""

from __future__ import annotations

import numpy as np

from engine_core.backends.cuda.lowering_context import LoweringContext, Ref, copy_launch, lowering_rule
from engine_core.backends.cuda.pointwise import contiguous_strides
from engine_core.ir import Node


@lowering_rule("ConstantOfShape")
def _lower_constant_of_shape(node: Node, ctx: LoweringContext) -> list:
    """A broadcast copy (every source stride 0) of the fill value, folded as a one-element constant."""
    out = ctx.info(node.outputs[0])
    if int(np.prod(out.shape, dtype=np.int64)) == 0:
        return []
    value = node.attr("value")
    fill = np.zeros(1, out.dtype) if value is None else np.asarray(value, dtype=out.dtype).reshape(-1)[:1]
    source = ctx.fold(f"{node.outputs[0]}#fill", fill)
    return [copy_launch(ctx, out.dtype, Ref(node.outputs[0]), source, out.shape, contiguous_strides(out.shape),
                        (0,) * len(out.shape))]
