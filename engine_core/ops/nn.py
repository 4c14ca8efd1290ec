"""Neural-network layers: matrix products, convolution, pooling, normalization, softmax."""

from __future__ import annotations

import numpy as np

from engine_core.ops.registry import ShapeInferenceError, TensorInfo, broadcast_shapes, register_op
from engine_core.ir import Node


def _matmul_infer(node: Node, a: TensorInfo, b: TensorInfo) -> TensorInfo:
    if a.shape is None or b.shape is None:
        return TensorInfo(a.dtype, None)
    sa, sb = a.shape, b.shape
    if len(sa) == 0 or len(sb) == 0:
        raise ShapeInferenceError("MatMul inputs must have rank >= 1")
    ka = sa[-1]
    kb = sb[0] if len(sb) == 1 else sb[-2]
    if ka != kb:
        raise ShapeInferenceError(f"MatMul inner dimensions differ: {sa} x {sb}")
    batch = broadcast_shapes(sa[:-2], sb[:-2])
    rows = sa[-2:-1] if len(sa) > 1 else ()
    cols = sb[-1:] if len(sb) > 1 else ()
    return TensorInfo(a.dtype, (*batch, *rows, *cols))


register_op("MatMul", infer=_matmul_infer, cpu=lambda node, a, b: np.matmul(a, b))


def _gemm_operands(node: Node, a, b):
    ta, tb = node.attr("transA", 0), node.attr("transB", 0)
    return (a.T if ta else a), (b.T if tb else b)


def _gemm_infer(node: Node, a: TensorInfo, b: TensorInfo, c: TensorInfo | None = None) -> TensorInfo:
    sa = a.shape[::-1] if node.attr("transA", 0) else a.shape
    sb = b.shape[::-1] if node.attr("transB", 0) else b.shape
    if len(sa) != 2 or len(sb) != 2 or sa[1] != sb[0]:
        raise ShapeInferenceError(f"Gemm needs 2-D operands with matching K, got {a.shape} and {b.shape}")
    out = (sa[0], sb[1])
    if c is not None and c.shape is not None:
        broadcast_shapes(out, c.shape)
    return TensorInfo(a.dtype, out)


def _gemm_cpu(node: Node, a, b, c=None):
    a, b = _gemm_operands(node, a, b)
    y = node.attr("alpha", 1.0) * (a @ b)
    if c is not None:
        y = y + node.attr("beta", 1.0) * c
    return y.astype(a.dtype, copy=False)


register_op("Gemm", infer=_gemm_infer, cpu=_gemm_cpu)
