"""Lowering rules of the float GEMMs: MatMul, Gemm and ``kiln.FusedMatMul`` (cuBLAS, cuBLASLt epilogues or Kiln's
fp32 GEMM), and the generated epilogue kernel that GEMMs and convolutions share.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from engine_core.backends.cuda.lower_rules.common import (
    gemm_dtype,
)
from engine_core.backends.cuda.lowering_context import (
    F32,
    Gemm,
    LoweringContext,
    Ref,
    copy_launch,
    launch_program,
    lowering_rule,
)
from engine_core.backends.cuda.pointwise import (
    PwNode,
    Unsupported,
    broadcast_strides,
    contiguous_strides,
    program_kernel,
)
from engine_core.ir import Node

GEMM_TACTICS = ("cublas", "kiln_gemm")
ACTIVATIONS = {"": None, "Relu": "Relu", "Sigmoid": "Sigmoid", "Tanh": "Tanh", "Gelu": "Gelu",
               "GeluTanh": "Gelu", "LeakyRelu": "LeakyRelu", "Clip": "Clip"}


def _gemm_tactic(node: Node, ctx: LoweringContext, dtype: np.dtype) -> str:
    return ctx.gemm_choice.get(node.name, GEMM_TACTICS[0]) if dtype == F32 else "cublas"


def _matmul_ops(node: Node, ctx: LoweringContext, a_name: str, b_name: str, trans_a: bool, trans_b: bool,
                alpha: float) -> list[Gemm]:
    """Batched GEMM for MatMul semantics (numpy broadcasting of batch dims), operands optionally transposed
    in their last two dims."""
    a, b, out = ctx.info(a_name), ctx.info(b_name), ctx.info(node.outputs[0])
    dtype = gemm_dtype([a.dtype, b.dtype, out.dtype], "MatMul")
    if len(a.shape) < 2 or len(b.shape) < 2:
        raise Unsupported("MatMul of a vector")
    m, k = (a.shape[-1], a.shape[-2]) if trans_a else (a.shape[-2], a.shape[-1])
    n = b.shape[-2] if trans_b else b.shape[-1]
    batch_shape = out.shape[:-2]
    batch = int(np.prod(batch_shape, dtype=np.int64))
    a_rc = (1, m) if trans_a else (k, 1)
    b_rc = (1, k) if trans_b else (n, 1)
    if len(b.shape) == 2 and not trans_a:  # weights: fold A's batch into M
        m, batch, a_bs, b_bs = m * batch, 1, 0, 0
    else:
        a_bs, b_bs = (_batch_stride(x.shape, batch_shape, x.shape[-1] * x.shape[-2]) for x in (a, b))
    if m * n * batch == 0:
        return []
    return [Gemm(Ref(a_name), Ref(b_name), Ref(node.outputs[0]), m, n, k, batch, (*a_rc, a_bs), (*b_rc, b_bs),
                 alpha, 0.0, _gemm_tactic(node, ctx, dtype), dtype, ctx.options.tf32)]


@lowering_rule("MatMul")
def _lower_matmul(node: Node, ctx: LoweringContext) -> list:
    return _matmul_ops(node, ctx, node.inputs[0], node.inputs[1], False, False, 1.0)


def _batch_stride(shape: tuple[int, ...], batch_shape: tuple[int, ...], matrix: int) -> int:
    """Element stride between batch matrices: full batch, or 0 when the operand broadcasts (all ones)."""
    own = tuple(shape[:-2])
    if int(np.prod(own, dtype=np.int64)) == 1:
        return 0
    if (1,) * (len(batch_shape) - len(own)) + own == tuple(batch_shape):
        return matrix
    raise Unsupported("MatMul with partially broadcast batch dims")


def epilogue(node: Node, ctx: LoweringContext, bias: str | None, activation: str, alpha: float = 0.01,
              beta: float = 0.0, residual: str | None = None, target: str | None = None,
              bias_axis: int | None = None) -> list:
    """Y = act(Y + bias (+ residual)) in place on ``target`` (default: the node's output), as one generated
    kernel (nothing when there is nothing). ``bias_axis``: the bias is a vector along that axis (a
    convolution's channels); otherwise it broadcasts like an Add operand (a GEMM's columns)."""
    out_name = target or node.outputs[0]
    out = ctx.info(out_name)
    inputs, nodes = [out_name], []
    last = 0
    for extra in (bias, residual):
        if extra:
            inputs.append(extra)
            nodes.append(PwNode.make("Add", (last, len(inputs) - 1), out.dtype))
            last = -1
    if activation:
        op = ACTIVATIONS.get(activation)
        if op is None:
            raise Unsupported(f"epilogue activation {activation}")
        attrs: dict[str, Any] = {}
        if activation == "GeluTanh":
            attrs = {"approximate": "tanh"}
        elif activation == "LeakyRelu":
            attrs = {"alpha": alpha}
        args: list[int] = [last]
        if activation == "Clip":
            lo = ctx.fold(f"{node.name}#lo", np.asarray(alpha, out.dtype))
            hi = ctx.fold(f"{node.name}#hi", np.asarray(beta, out.dtype))
            inputs += [lo.tensor, hi.tensor]
            args = [last, len(inputs) - 2, len(inputs) - 1]
        nodes.append(PwNode.make(op, args, out.dtype, attrs))
    if not nodes:
        return []
    n_in = len(inputs)
    fixed = []
    for j, pw in enumerate(nodes):  # -1 above means "the previous node's result"
        fixed.append(replace(pw, args=tuple(n_in + j - 1 if a == -1 else a for a in pw.args)))
    kernel = ctx.kernel(program_kernel(fixed, out.dtype, [ctx.info(n).dtype for n in inputs]))
    strides = [tuple(1 if d == bias_axis else 0 for d in range(len(out.shape))) if n == bias and bias_axis is not None
               else broadcast_strides(ctx.info(n).shape, out.shape, ctx.strides(n)) for n in inputs]
    return [launch_program(kernel, Ref(out_name), [Ref(n) for n in inputs], out.shape, ctx.strides(out_name),
                           strides)]


@lowering_rule("Gemm")
def _lower_gemm(node: Node, ctx: LoweringContext) -> list:
    a, b, out = ctx.info(node.inputs[0]), ctx.info(node.inputs[1]), ctx.info(node.outputs[0])
    dtype = gemm_dtype([a.dtype, b.dtype, out.dtype], "Gemm")
    ta, tb = node.attr("transA", 0), node.attr("transB", 0)
    m, n = out.shape
    k = a.shape[0] if ta else a.shape[1]
    a_strides = (1, m, 0) if ta else (k, 1, 0)
    b_strides = (1, k, 0) if tb else (n, 1, 0)
    if (ta and m == 1) or (tb and k == 1):
        raise Unsupported("Gemm with a transposed single-row operand")
    ops: list = []
    beta = 0.0
    if len(node.inputs) > 2 and node.inputs[2]:
        c = ctx.info(node.inputs[2])
        if c.dtype != dtype:
            raise Unsupported("Gemm C of another dtype")
        ops.append(copy_launch(ctx, dtype, Ref(node.outputs[0]), Ref(node.inputs[2]), out.shape,
                               contiguous_strides(out.shape), broadcast_strides(c.shape, out.shape)))
        beta = float(node.attr("beta", 1.0))
    if m * n:
        ops.append(Gemm(Ref(node.inputs[0]), Ref(node.inputs[1]), Ref(node.outputs[0]), m, n, k, 1, a_strides,
                        b_strides, float(node.attr("alpha", 1.0)), beta, _gemm_tactic(node, ctx, dtype), dtype,
                        ctx.options.tf32))
    return ops


#: FusedMatMul activation -> the cuBLASLt epilogue computing bias + it inside the GEMM
_LT_EPILOGUES = {"": "bias", "Relu": "relu_bias", "GeluTanh": "gelu_bias"}


@lowering_rule("FusedMatMul")
def _lower_fused_matmul(node: Node, ctx: LoweringContext) -> list:
    """``kiln.FusedMatMul``: with cuBLASLt the bias (and ReLU / tanh-GELU) run in the GEMM's epilogue;
    otherwise (or for other activations) one generated epilogue kernel follows the GEMM."""
    ops: list = _matmul_ops(node, ctx, node.inputs[0], node.inputs[1], bool(node.attr("transA", 0)),
                            bool(node.attr("transB", 0)), float(node.attr("alpha", 1.0)))
    bias = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2] else None
    out = ctx.info(node.outputs[0])
    if bias and ctx.info(bias).dtype != out.dtype:
        raise Unsupported("FusedMatMul bias of another dtype")
    activation = node.attr("activation", "")
    if ctx.options.cublaslt and bias and len(ops) == 1 and ops[0].batch == 1 and ctx.info(bias).shape == (ops[0].n,):
        gemm = ops[0]
        gemm.bias, gemm.tactic = Ref(bias), "cublaslt"
        gemm.epilogue = _LT_EPILOGUES.get(activation, "bias")
        rest = "" if activation in _LT_EPILOGUES else activation
        return ops + epilogue(node, ctx, None, rest)
    return ops + epilogue(node, ctx, bias, activation)
