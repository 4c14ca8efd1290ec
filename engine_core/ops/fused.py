"""Kiln's fused layers (domain "kiln"), produced by the fusion passes (engine_core/passes/fuse_*.py).

Each keeps the exact meaning of the ONNX nodes it replaces: the CPU implementations compute the unfused
math with the registered ONNX ops, and the CUDA backend lowers them to one library call or kernel.

* ``FusedConv(X, W, B?, Z?)``: ``act(Conv(X, W, B) + Z)`` (Z usually has the conv output's shape; it
  broadcasts like Add's operand); Conv attributes plus ``activation``
  ("", "Relu", "Clip", "LeakyRelu", "Sigmoid") with ``activation_alpha`` / ``activation_beta`` (Clip's min
  and max, LeakyRelu's alpha).
* ``FusedMatMul(A, B, bias?)``: ``act(alpha * A' @ B' + bias)`` with MatMul broadcasting; ``transA`` /
  ``transB`` transpose the last two dims; ``activation`` in "", "Relu", "Gelu", "GeluTanh", "Sigmoid", "Tanh".
* ``QMatMul(x_q, x_scale, W_q, w_scale, bias?, y_scale?)``: ``act(float(x_q @ W_q) * x_scale * w_scale[n] +
  bias)``, int8 operands with int32 sums or float8e4m3fn operands with float32 sums (``transB``: W_q is
  [N, K]); ``activation`` as for FusedMatMul. The float result has type ``float_dtype`` (ONNX type number;
  absent or 0: the scales' type). With ``y_scale`` (input 5; input 4 is then "" when there is no bias) the
  layer requantizes: it writes ``QuantizeLinear(result, y_scale)`` in the operand type (round half to even,
  saturate, zero point 0).
* ``PointwiseChain(x0..xn)``: attribute ``body`` (a Graph of pointwise ONNX nodes whose inputs match the
  node's inputs one to one, one output), evaluated element by element.
* ``SkipLayerNorm(x, skip, gamma, beta?, y_scale?, y_zero?, x_scale?, skip_scale?)``, ``AttentionQuantize(q, k, v, mask?, y_scale,
  y_zero?)``: a residual Add + LayerNorm (optionally also quantized, optionally of int8 operands), an Attention
  whose output is quantized.
* ``Rotary(x, cos, sin)``: ``x' * cos + rotate(x') * sin`` with numpy broadcasting, x' = ``Transpose(x, perm)``
  (attribute ``perm``; absent: x itself); ``rotate`` is rotate_half, ``Concat(-x'[..., D/2:], x'[..., :D/2])``, or
  with ``interleaved`` = 1 GPT-J's rotate_every_two (pairs (2i, 2i + 1) become (-x'[2i + 1], x'[2i])). Unlike ONNX's
  RotaryEmbedding, cos and sin are full-width tensors of any broadcastable shape, as exports compute them in-graph.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from engine_core.errors import ExecutionError
from engine_core.ir import Node
from engine_core.ops.registry import (
    GraphInference,
    Interpreter,
    ShapeInferenceError,
    TensorInfo,
    broadcast_shapes,
    get_op,
    register_op,
)

DOMAIN = "kiln"
#: activation name -> (ONNX op, opset, attributes from the fused node's alpha/beta)
ACTIVATIONS: dict[str, tuple[str, int]] = {
    "Relu": ("Relu", 14), "Sigmoid": ("Sigmoid", 13), "Tanh": ("Tanh", 13), "LeakyRelu": ("LeakyRelu", 16),
    "Clip": ("Clip", 13), "Gelu": ("Gelu", 20), "GeluTanh": ("Gelu", 20),
}


def _onnx(op: str, attrs: dict[str, Any] | None = None, opset: int = 21) -> Node:
    return Node(op, [], [], attrs or {}, op, "", opset, [])


def activate(node: Node, y: np.ndarray) -> np.ndarray:
    """The fused node's activation applied with the ONNX op's own CPU implementation."""
    name = node.attr("activation", "")
    if not name:
        return y
    if name not in ACTIVATIONS:
        raise ShapeInferenceError(f"{node}: unknown fused activation '{name}'")
    op, opset = ACTIVATIONS[name]
    attrs: dict[str, Any] = {}
    args: list[Any] = [y]
    if name == "LeakyRelu":
        attrs = {"alpha": float(node.attr("activation_alpha", 0.01))}
    elif name == "GeluTanh":
        attrs = {"approximate": "tanh"}
    elif name == "Clip":
        args += [np.asarray(node.attr("activation_alpha", -np.inf), y.dtype),
                 np.asarray(node.attr("activation_beta", np.inf), y.dtype)]
    result = get_op(op).cpu(_onnx(op, attrs, opset), *args)
    return result[0] if isinstance(result, (list, tuple)) else result


def _conv_node(node: Node) -> Node:
    keep = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")
    return Node("Conv", [], [], {k: v for k, v in node.attrs.items() if k in keep}, node.name, "", 11, [])


def _fused_conv_infer(node: Node, x: TensorInfo, w: TensorInfo, b: TensorInfo | None = None,
                      z: TensorInfo | None = None) -> TensorInfo:
    out = get_op("Conv").infer(_conv_node(node), x, w, *([b] if b is not None else []))
    out = out[0] if isinstance(out, (list, tuple)) else out
    if z is not None:  # Add's broadcasting: the fusion pass cannot see shapes, so Z may widen the output
        if z.dtype != out.dtype:
            raise ShapeInferenceError(f"{node}: residual is {z.dtype}, the convolution computes {out.dtype}")
        if z.shape is None or out.shape is None:
            return TensorInfo(out.dtype, None)
        return TensorInfo(out.dtype, broadcast_shapes(out.shape, z.shape))
    return out


def _fused_conv_cpu(node: Node, x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None,
                    z: np.ndarray | None = None) -> np.ndarray:
    y = get_op("Conv").cpu(_conv_node(node), x, w, *([b] if b is not None else []))
    y = y[0] if isinstance(y, (list, tuple)) else y
    if z is not None:
        y = (y + z).astype(y.dtype, copy=False)
    return activate(node, y)


register_op("FusedConv", infer=_fused_conv_infer, cpu=_fused_conv_cpu, domain=DOMAIN,
            doc="act(Conv(X, W, B) + Z): a convolution with its bias, residual add and activation")


def _swap_last(shape: tuple, flag: Any) -> tuple:
    return (*shape[:-2], shape[-1], shape[-2]) if flag and len(shape) >= 2 else tuple(shape)


def _fused_matmul_infer(node: Node, a: TensorInfo, b: TensorInfo, bias: TensorInfo | None = None) -> TensorInfo:
    if a.shape is None or b.shape is None:
        return TensorInfo(a.dtype, None)
    at = TensorInfo(a.dtype, _swap_last(a.shape, node.attr("transA", 0)))
    bt = TensorInfo(b.dtype, _swap_last(b.shape, node.attr("transB", 0)))
    out = get_op("MatMul").infer(_onnx("MatMul"), at, bt)
    out = out[0] if isinstance(out, (list, tuple)) else out
    if bias is not None and bias.shape is not None and out.shape is not None:
        if broadcast_shapes(out.shape, bias.shape) != tuple(out.shape):
            raise ShapeInferenceError(f"{node}: bias {bias.shape} does not broadcast to the output {out.shape}")
    return out


def _fused_matmul_cpu(node: Node, a: np.ndarray, b: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    if node.attr("transA", 0):
        a = np.swapaxes(a, -1, -2)
    if node.attr("transB", 0):
        b = np.swapaxes(b, -1, -2)
    y = get_op("MatMul").cpu(_onnx("MatMul"), a, b)
    y = y[0] if isinstance(y, (list, tuple)) else y
    alpha = float(node.attr("alpha", 1.0))
    if alpha != 1.0:
        y = (y * alpha).astype(a.dtype, copy=False)
    if bias is not None:
        y = (y + bias).astype(y.dtype, copy=False)
    return activate(node, y)


register_op("FusedMatMul", infer=_fused_matmul_infer, cpu=_fused_matmul_cpu, domain=DOMAIN,
            doc="act(alpha * A' @ B' + bias): a GEMM with its bias and activation")


def _chain_infer(node: Node, *inputs: TensorInfo, scope: Any = None,
                 infer_graph: GraphInference | None = None) -> TensorInfo:
    """The body's output info for these inputs, by shape inference over the body (``infer_graph``: shape inference
    passes itself); the body reads only its own inputs: ``scope`` is unused."""
    if infer_graph is None:
        raise ShapeInferenceError("PointwiseChain's body is inferred by shape inference, which passes itself as "
                                  "infer_graph=")
    body = node.attr("body")
    infos = infer_graph(body, {v.name: info for v, info in zip(body.inputs, inputs)}, values=False)
    return infos[body.outputs[0].name]


def _chain_cpu(node: Node, *inputs: np.ndarray, scope: Any = None, interpreter: Interpreter | None = None
               ) -> np.ndarray:
    if interpreter is None:
        raise ExecutionError("PointwiseChain runs under the interpreter (engine_core.interpret), which passes itself "
                             "as interpreter=")
    body = node.attr("body")
    out = interpreter(body).run({v.name: x for v, x in zip(body.inputs, inputs)})
    return out[body.outputs[0].name]


register_op("PointwiseChain", infer=_chain_infer, cpu=_chain_cpu, domain=DOMAIN,
            doc="a chain of pointwise ops (attribute body) evaluated in one pass")


# -- QMatMul: an INT8 / FP8 E4M3 GEMM from explicit Q/DQ (passes/fuse_qdq_matmul.py) ------------------

#: the largest K whose int32 accumulator cannot overflow (|int8 x int8| <= 128 * 128)
QMATMUL_MAX_K = (2**31 - 1) // (128 * 128)
_FLOATS = ("float32", "float16", "bfloat16")
INT8 = np.dtype(np.int8)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
#: operand types a QMatMul takes; x and W share one, a requantized output has it too
QMATMUL_OPERANDS = (INT8, FP8)


def qmatmul_float_dtype(node: Node, scale_dtype: np.dtype) -> np.dtype:
    """The type of a QMatMul's float result (before any requantization): ``float_dtype``, else the scales'."""
    from engine_core.types import onnx_to_np

    declared = node.attr("float_dtype", 0)
    return np.dtype(onnx_to_np(declared)) if declared else np.dtype(scale_dtype)


def _is_float(dtype: np.dtype) -> bool:
    return np.dtype(dtype).name in _FLOATS


def _qmatmul_infer(node: Node, x: TensorInfo, x_scale: TensorInfo, w: TensorInfo, w_scale: TensorInfo,
                   bias: TensorInfo | None = None, y_scale: TensorInfo | None = None) -> TensorInfo:
    """[..., K] x [K, N] (transB: [N, K]), both int8 or both float8e4m3fn -> [..., N] in ``float_dtype``
    (the operand type with y_scale)."""
    if x.dtype != w.dtype or x.dtype not in QMATMUL_OPERANDS:
        raise ShapeInferenceError(f"{node}: QMatMul needs two int8 or two float8e4m3fn operands, got {x.dtype} "
                                  f"and {w.dtype}")
    if not _is_float(x_scale.dtype) or w_scale.dtype != x_scale.dtype:
        raise ShapeInferenceError(f"{node}: scales must share one float type, got {x_scale.dtype} and {w_scale.dtype}")
    dtype = qmatmul_float_dtype(node, x_scale.dtype)
    if not _is_float(dtype):
        raise ShapeInferenceError(f"{node}: float_dtype must be a float type, got {dtype}")
    for what, info in (("bias", bias), ("y_scale", y_scale)):
        if info is not None and not _is_float(info.dtype):
            raise ShapeInferenceError(f"{node}: {what} must be a float tensor, got {info.dtype}")
    out_dtype = x.dtype if y_scale is not None else dtype
    if x.shape is None or w.shape is None:
        return TensorInfo(out_dtype, None)
    if len(w.shape) != 2 or not x.shape:
        raise ShapeInferenceError(f"{node}: QMatMul needs a 2-D weight and a non-scalar input, got {w.shape}, {x.shape}")
    n, k = w.shape if node.attr("transB", 0) else w.shape[::-1]
    if x.shape[-1] != k:
        raise ShapeInferenceError(f"{node}: input {x.shape} and weight {w.shape} disagree on K")
    if x.dtype == INT8 and k > QMATMUL_MAX_K:  # fp32 sums of e4m3 products (<= 448**2 each) cannot overflow
        raise ShapeInferenceError(f"{node}: K = {k} could overflow the int32 accumulator (at most {QMATMUL_MAX_K})")
    sizes = {"x_scale": (x_scale, (1,)), "w_scale": (w_scale, (1, n)), "bias": (bias, (n,)), "y_scale": (y_scale, (1,))}
    for what, (info, allowed) in sizes.items():
        if info is not None and info.shape is not None and int(np.prod(info.shape)) not in allowed:
            raise ShapeInferenceError(f"{node}: {what} of shape {info.shape} for {n} output columns")
    return TensorInfo(out_dtype, (*x.shape[:-1], n))


def qmatmul_accumulate(x: np.ndarray, w: np.ndarray, trans_b: bool) -> np.ndarray:
    """The accumulator: int8 -> int32, exact (float64 sums of int8 products stay below 2**53).
    float8e4m3fn -> float32: the exact sum rounded once. Why exact: an e4m3 product has at most 8 significant
    bits between 2**-18 and 2**18, so float64 sums of fewer than 2**17 of them lose nothing; the one rounding
    to float32 makes the result independent of summation order (cuBLASLt sums in float32 in its own order:
    it differs from this by at most K * 2**-24 * sum|x_k * w_k| per element)."""
    from engine_core.ops.quantization import exact_matmul

    acc = exact_matmul(x, w.T if trans_b else w)
    return acc.astype(np.float32) if x.dtype == FP8 else acc.astype(np.int32)


def _qmatmul_cpu(node: Node, x: np.ndarray, x_scale: np.ndarray, w: np.ndarray, w_scale: np.ndarray,
                 bias: np.ndarray | None = None, y_scale: np.ndarray | None = None) -> np.ndarray:
    """act(float(acc) * x_scale * w_scale[n] + bias[n]) in float32, stored in ``float_dtype``: the order
    and rounding of the CUDA epilogue kernel, so the two backends agree bit for bit for int8 (up to the
    activation's math library) and up to the accumulator's summation order for fp8. With ``y_scale`` that
    stored value is quantized by QuantizeLinear's own code (int8: round half to even and saturate; fp8:
    round to nearest even, saturating to +-448), so the layer equals QMatMul -> QuantizeLinear exactly."""
    from engine_core.ops.quantization import quantize

    acc = qmatmul_accumulate(x, w, bool(node.attr("transB", 0)))
    f32 = np.float32
    y = acc.astype(f32) * x_scale.astype(f32).reshape(()) * w_scale.astype(f32).reshape(-1)
    if bias is not None:
        y = y + bias.astype(f32).reshape(-1)
    y = activate(node, y).astype(qmatmul_float_dtype(node, x_scale.dtype), copy=False)
    if y_scale is None:
        return y
    return quantize(y, y_scale.reshape(()), None, x.dtype)


register_op("QMatMul", infer=_qmatmul_infer, cpu=_qmatmul_cpu, domain=DOMAIN,
            doc="act(x @ W * x_scale * w_scale[n] + bias) over int8 (int32 sums) or float8e4m3fn (float32 sums) "
                "operands, optionally requantized to the operand type: a Q/DQ MatMul as an INT8 / FP8 GEMM")


# -- QConv: an INT8 convolution from explicit Q/DQ (passes/fuse_qdq_conv.py) -------------------------


def _qconv_infer(node: Node, x: TensorInfo, x_scale: TensorInfo, w: TensorInfo, w_scale: TensorInfo,
                 bias: TensorInfo | None = None, residual: TensorInfo | None = None,
                 y_scale: TensorInfo | None = None, residual_scale: TensorInfo | None = None) -> TensorInfo:
    """[N, C, H, W] int8 (*) [K, C, R, S] int8 -> [N, K, OH, OW] in ``float_dtype`` (int8 with y_scale); a
    residual broadcasts like Add's operand: a float tensor, or int8 with ``residual_scale`` (its
    DequantizeLinear folded in)."""
    if x.dtype != np.int8 or w.dtype != np.int8:
        raise ShapeInferenceError(f"{node}: QConv needs int8 operands, got {x.dtype} and {w.dtype}")
    if not _is_float(x_scale.dtype) or w_scale.dtype != x_scale.dtype:
        raise ShapeInferenceError(f"{node}: scales must share one float type, got {x_scale.dtype} and {w_scale.dtype}")
    dtype = qmatmul_float_dtype(node, x_scale.dtype)
    if not _is_float(dtype):
        raise ShapeInferenceError(f"{node}: float_dtype must be a float type, got {dtype}")
    float_residual = residual if residual_scale is None else None
    for what, info in (("bias", bias), ("residual", float_residual), ("y_scale", y_scale),
                       ("residual_scale", residual_scale)):
        if info is not None and not _is_float(info.dtype):
            raise ShapeInferenceError(f"{node}: {what} must be a float tensor, got {info.dtype}")
    if residual_scale is not None and (residual is None or residual.dtype != np.int8):
        raise ShapeInferenceError(f"{node}: residual_scale needs an int8 residual, got "
                                  f"{None if residual is None else residual.dtype}")
    out_dtype = np.dtype(np.int8) if y_scale is not None else dtype
    if x.shape is None or w.shape is None:
        return TensorInfo(out_dtype, None)
    if len(x.shape) != 4 or len(w.shape) != 4 or int(node.attr("group", 1)) != 1:
        raise ShapeInferenceError(f"{node}: QConv is a 2-D one-group convolution, got {x.shape} and {w.shape}")
    f32 = np.dtype(np.float32)
    out = get_op("Conv").infer(_conv_node(node), TensorInfo(f32, x.shape), TensorInfo(f32, w.shape))
    out = out[0] if isinstance(out, (list, tuple)) else out
    reduction = int(np.prod(w.shape[1:]))
    if reduction > QMATMUL_MAX_K:
        raise ShapeInferenceError(f"{node}: C*R*S = {reduction} could overflow the int32 accumulator "
                                  f"(at most {QMATMUL_MAX_K})")
    k = w.shape[0]
    sizes = {"x_scale": (x_scale, (1,)), "w_scale": (w_scale, (1, k)), "bias": (bias, (k,)), "y_scale": (y_scale, (1,)),
             "residual_scale": (residual_scale, (1,))}
    for what, (info, allowed) in sizes.items():
        if info is not None and info.shape is not None and int(np.prod(info.shape)) not in allowed:
            raise ShapeInferenceError(f"{node}: {what} of shape {info.shape} for {k} output channels")
    if residual is None:
        return TensorInfo(out_dtype, out.shape)
    if residual.shape is None:
        return TensorInfo(out_dtype, None)
    return TensorInfo(out_dtype, broadcast_shapes(out.shape, residual.shape))


def qconv_accumulate(node: Node, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The int32 accumulator of a one-group int8 convolution: im2col and one float64 BLAS product, exact
    (sums of int8 products stay far below 2**53), zero padding (zero point 0)."""
    from engine_core.ops.nn import conv, window_geometry

    win = window_geometry(_conv_node(node), x.shape[2:], w.shape[2:])
    return conv(x.astype(np.float64), w.astype(np.float64), win, 1).astype(np.int32)


def _channels(value: np.ndarray) -> np.ndarray:
    """A per-tensor or per-channel float32 vector shaped to broadcast along an NCHW tensor's channels."""
    value = value.astype(np.float32)
    return value.reshape(()) if value.size == 1 else value.reshape(1, -1, 1, 1)


def qconv_residual(node: Node, residual: np.ndarray, residual_scale: np.ndarray | None) -> np.ndarray:
    """The residual as the float32 addend: a float residual as it is; an int8 one as its DequantizeLinear
    stored it (int8 * scale in float32, rounded to ``float_dtype``), so the fused layer equals the unfused graph."""
    if residual_scale is None:
        return residual.astype(np.float32)
    value = dequantized_operand(residual, residual_scale, qmatmul_float_dtype(node, residual_scale.dtype))
    return value.astype(np.float32, copy=False)


def _qconv_cpu(node: Node, x: np.ndarray, x_scale: np.ndarray, w: np.ndarray, w_scale: np.ndarray,
               bias: np.ndarray | None = None, residual: np.ndarray | None = None,
               y_scale: np.ndarray | None = None, residual_scale: np.ndarray | None = None) -> np.ndarray:
    """act(float(acc) * x_scale * w_scale[k] + bias[k] + residual) in float32, stored in ``float_dtype``:
    the order and rounding of the CUDA epilogue kernel (engine_core/backends/cuda/int8_conv.py), so the two
    backends agree bit for bit (up to the activation's math library). With ``y_scale`` the stored value is
    quantized by QuantizeLinear's own code, so the layer equals QConv -> QuantizeLinear exactly."""
    from engine_core.ops.quantization import quantize

    acc = qconv_accumulate(node, x, w)
    y = acc.astype(np.float32) * x_scale.astype(np.float32).reshape(()) * _channels(w_scale)
    if bias is not None:
        y = y + _channels(bias)
    if residual is not None:
        y = y + qconv_residual(node, residual, residual_scale)
    y = activate(node, y).astype(qmatmul_float_dtype(node, x_scale.dtype), copy=False)
    if y_scale is None:
        return y
    return quantize(y, y_scale.reshape(()), None, np.dtype(np.int8))


register_op("QConv", infer=_qconv_infer, cpu=_qconv_cpu, domain=DOMAIN,
            doc="act(conv(int8 x, int8 W) (int32 sums) * x_scale * w_scale[k] + bias + residual), optionally "
                "requantized to int8 (inputs: x, x_scale, W, w_scale, bias, residual, y_scale, residual_scale; "
                "an int8 residual is dequantized by residual_scale): a Q/DQ Conv as an INT8 implicit GEMM")


# -- SkipLayerNorm: a residual Add and the LayerNormalization reading it (passes/fuse_skip_layer_norm.py) -----


def _skip_layer_norm_infer(node: Node, x: TensorInfo, skip: TensorInfo, scale: TensorInfo,
                           bias: TensorInfo | None = None, y_scale: TensorInfo | None = None,
                           y_zero: TensorInfo | None = None, x_scale: TensorInfo | None = None,
                           skip_scale: TensorInfo | None = None) -> TensorInfo | list[TensorInfo]:
    """LayerNormalization's output for x + skip (which broadcast like Add's operands, one type; int8 operands with
    their scales are dequantized to the LayerNorm's type, gamma's); with ``y_scale`` also that output quantized to
    int8 (output 1)."""
    for name, value, value_scale in (("x", x, x_scale), ("skip", skip, skip_scale)):
        if (value.dtype == INT8) != (value_scale is not None):
            raise ShapeInferenceError(f"{node}: an int8 {name} takes a scale (input {6 if name == 'x' else 7}), "
                                      f"a float one none")
        if value_scale is not None and value_scale.shape is not None and int(np.prod(value_scale.shape)) != 1:
            raise ShapeInferenceError(f"{node}: {name} is dequantized by one scale")
    x_type, skip_type = (scale.dtype if v.dtype == INT8 else v.dtype for v in (x, skip))
    if x_type != skip_type:
        raise ShapeInferenceError(f"{node}: x and skip differ in type ({x_type}, {skip_type})")
    shape = None if x.shape is None or skip.shape is None else broadcast_shapes(x.shape, skip.shape)
    y = get_op("LayerNormalization").infer(node, TensorInfo(x_type, shape), scale, bias)[0]
    if y_scale is None:
        return y
    if (y_scale.shape is not None and int(np.prod(y_scale.shape)) != 1) or (y_zero is not None and y_zero.dtype != INT8):
        raise ShapeInferenceError(f"{node}: the quantized output takes one scale and an int8 zero point")
    return [y, TensorInfo(INT8, y.shape)]


def dequantized_operand(value: np.ndarray, scale: np.ndarray | None, dtype: np.dtype) -> np.ndarray:
    """A fused layer's operand as the DequantizeLinear it absorbed stored it: int8 * scale in float32, rounded to
    ``dtype`` (the DequantizeLinear's output type); a float operand (no scale) as it is."""
    if scale is None:
        return value
    return (value.astype(np.float32) * scale.astype(np.float32).reshape(())).astype(dtype)


def _skip_layer_norm_cpu(node: Node, x: np.ndarray, skip: np.ndarray, scale: np.ndarray,
                         bias: np.ndarray | None = None, y_scale: np.ndarray | None = None,
                         y_zero: np.ndarray | None = None, x_scale: np.ndarray | None = None,
                         skip_scale: np.ndarray | None = None) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """LayerNormalization(x + skip), the sum stored in x's type first: exactly the unfused Add -> LayerNorm
    (the LayerNorm's axis is the last, so a broadcast sum normalizes like the unfused one); int8 x / skip are first
    dequantized by DequantizeLinear's arithmetic (passes/fuse_norm_dequantize.py); with ``y_scale`` also
    QuantizeLinear(y, y_scale, y_zero) to int8, by QuantizeLinear's own code (passes/fuse_norm_quantize.py)."""
    from engine_core.ops.quantization import quantize

    x, skip = dequantized_operand(x, x_scale, scale.dtype), dequantized_operand(skip, skip_scale, scale.dtype)
    total = np.add(x, skip, dtype=x.dtype)
    y = get_op("LayerNormalization").cpu(node, total, scale, bias)[0]
    if y_scale is None:
        return y
    return y, quantize(y, y_scale.reshape(()), None if y_zero is None else y_zero.reshape(()), INT8)


register_op("SkipLayerNorm", infer=_skip_layer_norm_infer, cpu=_skip_layer_norm_cpu, domain=DOMAIN,
            doc="LayerNormalization(x + skip) (attributes axis, epsilon, stash_type): a residual Add and the "
                "LayerNorm reading it, in one kernel; inputs 4, 5 (y_scale, y_zero) add output 1, the result "
                "quantized to int8 (QuantizeLinear); inputs 6, 7 (x_scale, skip_scale) dequantize int8 x and skip "
                "(DequantizeLinear to gamma's type); output 0 may be absent (\"\") when only the int8 one is read")


# -- AttentionQuantize: an Attention and the QuantizeLinear of its output (passes/fuse_attention_quantize.py) ---


def _attention_quantize_infer(node: Node, q: TensorInfo, k: TensorInfo, v: TensorInfo, attn_mask: TensorInfo | None,
                              y_scale: TensorInfo, y_zero: TensorInfo | None = None) -> TensorInfo:
    """Attention's output Y (no past keys) as int8."""
    if (y_scale.shape is not None and int(np.prod(y_scale.shape)) != 1) or (y_zero is not None and y_zero.dtype != INT8):
        raise ShapeInferenceError(f"{node}: the quantized output takes one scale and an int8 zero point")
    return TensorInfo(INT8, get_op("Attention").infer(node, q, k, v, attn_mask)[0].shape)


def _attention_quantize_cpu(node: Node, q: np.ndarray, k: np.ndarray, v: np.ndarray, attn_mask: np.ndarray | None,
                            y_scale: np.ndarray, y_zero: np.ndarray | None = None) -> np.ndarray:
    """QuantizeLinear(Attention(q, k, v, mask)) by the two ops' own code: Y in q's type, then int8."""
    from engine_core.ops.quantization import quantize

    y = get_op("Attention").cpu(node, q, k, v, attn_mask)[0]
    return quantize(y, y_scale.reshape(()), None if y_zero is None else y_zero.reshape(()), INT8)


register_op("AttentionQuantize", infer=_attention_quantize_infer, cpu=_attention_quantize_cpu, domain=DOMAIN,
            doc="QuantizeLinear(Attention(q, k, v, attn_mask), y_scale, y_zero) to int8 (Attention's attributes, "
                "no past keys; one scale, zero point 0): the attention kernel writes the int8 tensor the next "
                "QMatMul reads instead of a float one a QuantizeLinear reads back")


# -- Rotary: rotary position embeddings written out op by op (passes/fuse_rotary.py) ---------------------------------


def _rotary_source(node: Node, x: TensorInfo) -> TensorInfo:
    """x as the rotation reads it: transposed by ``perm`` when the node has one."""
    perm = node.attr("perm")
    if not perm or x.shape is None:
        return x
    if sorted(perm) != list(range(len(x.shape))):
        raise ShapeInferenceError(f"{node}: perm {perm} for an input of rank {len(x.shape)}")
    return TensorInfo(x.dtype, tuple(x.shape[p] for p in perm))


def _rotary_infer(node: Node, x: TensorInfo, cos: TensorInfo, sin: TensorInfo) -> TensorInfo:
    """x's type, the broadcast shape of x' (x transposed by perm), cos and sin; x' has an even last dim."""
    if not x.dtype == cos.dtype == sin.dtype:
        raise ShapeInferenceError(f"{node}: x, cos and sin differ in type ({x.dtype}, {cos.dtype}, {sin.dtype})")
    source = _rotary_source(node, x)
    if source.shape is None or cos.shape is None or sin.shape is None:
        return TensorInfo(x.dtype, None)
    if not source.shape or source.shape[-1] % 2:
        raise ShapeInferenceError(f"{node}: rotating pairs of the last dim needs it even, not {source.shape}")
    return TensorInfo(x.dtype, broadcast_shapes(source.shape, cos.shape, sin.shape))


def rotated(x: np.ndarray, interleaved: bool) -> np.ndarray:
    """rotate_half (``Concat(-x[..., D/2:], x[..., :D/2])``) or, interleaved, rotate_every_two (each pair (a, b) of
    the last axis becomes (-b, a))."""
    if interleaved:
        pairs = x.reshape(*x.shape[:-1], -1, 2)
        return np.stack([np.negative(pairs[..., 1]), pairs[..., 0]], axis=-1).reshape(x.shape)
    half = x.shape[-1] // 2
    return np.concatenate([np.negative(x[..., half:]), x[..., :half]], axis=-1)


def _rotary_cpu(node: Node, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x' * cos + rotate(x') * sin by the ONNX Mul and Add implementations, each result rounded to x's type as the
    unfused layers round it."""
    perm = node.attr("perm")
    source = np.transpose(x, perm) if perm else x
    mul, add = get_op("Mul").cpu, get_op("Add").cpu
    return add(node, mul(node, source, cos), mul(node, rotated(source, bool(node.attr("interleaved", 0))), sin))


register_op("Rotary", infer=_rotary_infer, cpu=_rotary_cpu, domain=DOMAIN,
            doc="x' * cos + rotate(x') * sin, x' = Transpose(x, perm) (or x), rotate = rotate_half or (interleaved) "
                "rotate_every_two, cos and sin full-width and broadcast: a rotary position embedding as exports "
                "write it (Slice / Neg / Concat / Mul / Add) in one layer")
