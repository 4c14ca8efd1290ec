"""Lowering rule of ``kiln.Rotary`` (passes/fuse_rotary.py): one generated pointwise kernel, no kernel file of its own.

Why a pointwise program: split the last axis into its two rotated halves, [..., D] as [..., 2, D/2] (interleaved:
[..., D/2, 2]), and every output element is y[k, j] = x[k, j] * cos[k, j] + sign[k] * x[1 - k, j] * sin[k, j]. The
partner x[1 - k, j] is x itself read through a second strided view, one half further on with the pair axis's stride
negated, and sign[k] is (-1, 1). Broadcast cos / sin, the transposed x of ``perm`` and every float type are the
generator's strided indexer already (engine_core/backends/cuda/pointwise.py); with the halves a multiple of the
vector width, the half-split form takes its vector path (16-byte loads). The emulator runs it as any program.
"""

from __future__ import annotations

import numpy as np

from engine_core.backends.cuda.lowering_context import LoweringContext, Ref, launch_program, lowering_rule
from engine_core.backends.cuda.pointwise import (
    FLOATS,
    PwNode,
    Unsupported,
    broadcast_strides,
    program_kernel,
)
from engine_core.ir import Node

#: inputs 0..4: x, x's partner view, cos, sin, sign; then x * cos, partner * sign, that * sin, the sum
_PROGRAM = (("Mul", (0, 2)), ("Mul", (1, 4)), ("Mul", (6, 3)), ("Add", (5, 7)))


def _paired(strides: tuple[int, ...], half: int, interleaved: bool) -> tuple[int, ...]:
    """Element strides of a [..., D] operand read as [..., 2, D/2] (interleaved: [..., D/2, 2])."""
    step = strides[-1]
    return (*strides[:-1], step * 2, step) if interleaved else (*strides[:-1], step * half, step)


def _partner(strides: tuple[int, ...], half: int, interleaved: bool) -> tuple[tuple[int, ...], int]:
    """(strides, element offset) of x's paired view that reads, at [k, j], the other member of the pair."""
    step = strides[-1]
    if interleaved:
        return (*strides[:-1], step * 2, -step), step
    return (*strides[:-1], -step * half, step), step * half


@lowering_rule("Rotary")
def _lower_rotary(node: Node, ctx: LoweringContext) -> list:
    """``kiln.Rotary``: x' * cos + rotate(x') * sin as one generated kernel over the paired view of the output."""
    x, cos, sin = node.inputs
    out = ctx.info(node.outputs[0])
    dtype, shape = out.dtype, tuple(out.shape or ())
    if dtype not in FLOATS or any(ctx.info(name).dtype != dtype for name in node.inputs):
        raise Unsupported(f"Rotary over {[str(ctx.info(n).dtype) for n in node.inputs]}")
    x_shape = ctx.info(x).shape or ()
    perm = [int(p) for p in node.attr("perm") or range(len(x_shape))]
    source_shape = tuple(x_shape[p] for p in perm)
    source_strides = tuple(ctx.strides(x)[p] for p in perm)
    if not shape or shape[-1] % 2 or source_shape[-1] != shape[-1]:
        raise Unsupported(f"Rotary of {source_shape} to {shape}")
    if int(np.prod(shape)) == 0:
        return []
    half, interleaved = shape[-1] // 2, bool(node.attr("interleaved", 0))
    view = (*shape[:-1], half, 2) if interleaved else (*shape[:-1], 2, half)
    x_strides = broadcast_strides(source_shape, shape, source_strides)
    partner, offset = _partner(x_strides, half, interleaved)
    strides = [_paired(x_strides, half, interleaved), partner,
               *(_paired(broadcast_strides(ctx.info(n).shape or (), shape, ctx.strides(n)), half, interleaved)
                 for n in (cos, sin)),
               (*(0,) * (len(view) - 2), 0, 1) if interleaved else (*(0,) * (len(view) - 2), 1, 0)]
    sign = ctx.fold(f"{node.name}#sign", np.array([-1, 1], dtype))
    nodes = [PwNode.make(op, args, dtype) for op, args in _PROGRAM]
    kernel = ctx.kernel(program_kernel(nodes, dtype, [dtype] * 5))
    refs = [Ref(x), Ref(x, offset * dtype.itemsize), Ref(cos), Ref(sin), sign]
    out_strides = _paired(ctx.strides(node.outputs[0]), half, interleaved)
    return [launch_program(kernel, Ref(node.outputs[0]), refs, view, out_strides, strides)]
