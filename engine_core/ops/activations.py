"""Activation functions (Relu family, Sigmoid family, Gelu, Softplus, Swish, ...).

Each is ``float_math`` over a small numpy expression: computed in float32 for narrow floats (float16,
bfloat16) and returned in the input's dtype. Attribute defaults are the spec's. (SwiGLU is
registered with the attention ops, in attention.py.)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from engine_core.ir import Node
from engine_core.ops.elementwise import compute_dtype, erf, float_math, in_compute_dtype, is_integer, quiet
from engine_core.ops.registry import (
    ShapeInferenceError,
    TensorInfo,
    broadcast_shapes,
    register_op,
    same_as_input,
)

#: Selu's defaults, the float32 values of the constants from the SNN paper.
SELU_ALPHA = 1.67326319217681884765625
SELU_GAMMA = 1.05070102214813232421875


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + e^-x); e^-x overflowing to inf for very negative x correctly gives 0."""
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + e^x) without overflow for large x."""
    return np.logaddexp(0.0, x)


def _attr_activation(op_type: str, fn: Callable[[Node, np.ndarray], np.ndarray], min_opset: int = 1) -> None:
    """Register a unary activation whose formula reads the node's attributes."""

    @quiet
    def cpu(node: Node, x: np.ndarray) -> np.ndarray:
        return in_compute_dtype(lambda v: fn(node, v), x)

    register_op(op_type, infer=same_as_input(), cpu=cpu, min_opset=min_opset)


register_op("Relu", infer=same_as_input(), cpu=lambda node, x: np.maximum(x, np.zeros((), x.dtype)))
register_op("Sigmoid", infer=same_as_input(), cpu=float_math(sigmoid))
register_op("Tanh", infer=same_as_input(), cpu=float_math(np.tanh))
register_op("Softplus", infer=same_as_input(), cpu=float_math(softplus))
register_op("Softsign", infer=same_as_input(), cpu=float_math(lambda x: x / (1.0 + np.abs(x))))
register_op("Mish", infer=same_as_input(), cpu=float_math(lambda x: x * np.tanh(softplus(x))), min_opset=18)
register_op("HardSwish", infer=same_as_input(),
            cpu=float_math(lambda x: x * np.clip(x / 6.0 + 0.5, 0.0, 1.0)), min_opset=14)

_attr_activation("LeakyRelu", lambda node, x: np.where(x < 0, node.attr("alpha", 0.01) * x, x))
_attr_activation("ThresholdedRelu", lambda node, x: np.where(x > node.attr("alpha", 1.0), x, 0.0), min_opset=10)
_attr_activation("Elu", lambda node, x: np.where(x > 0, x, node.attr("alpha", 1.0) * np.expm1(x)))
_attr_activation(
    "Celu",
    lambda node, x: np.maximum(x, 0.0) + np.minimum(0.0, node.attr("alpha", 1.0) * np.expm1(x / node.attr("alpha", 1.0))),
    min_opset=12,
)
_attr_activation(
    "Selu",
    lambda node, x: node.attr("gamma", SELU_GAMMA) * np.where(x > 0, x, node.attr("alpha", SELU_ALPHA) * np.expm1(x)),
)
_attr_activation(
    "HardSigmoid",
    lambda node, x: np.clip(node.attr("alpha", 0.2) * x + node.attr("beta", 0.5), 0.0, 1.0),
)
_attr_activation("Swish", lambda node, x: x * sigmoid(node.attr("alpha", 1.0) * x), min_opset=24)


def _gelu(node: Node, x: np.ndarray) -> np.ndarray:
    """approximate="none": x/2 (1 + erf(x/sqrt 2)); "tanh": the tanh approximation."""
    approximate = node.attr("approximate", "none")
    if approximate == "tanh":
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)
        return 0.5 * x * (1.0 + np.tanh(inner))
    if approximate != "none":
        raise ShapeInferenceError(f"Gelu approximate must be 'none' or 'tanh', got {approximate!r}")
    return (0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))).astype(x.dtype)


_attr_activation("Gelu", _gelu, min_opset=20)


@quiet
def _shrink_cpu(node: Node, x: np.ndarray) -> np.ndarray:
    """x+bias below -lambd, x-bias above lambd, 0 between. Integer inputs are allowed: the formula
    runs in float64 and is cast back."""
    lambd, bias = node.attr("lambd", 0.5), node.attr("bias", 0.0)
    v = x.astype(compute_dtype(x.dtype), copy=False)
    y = np.where(v < -lambd, v + bias, np.where(v > lambd, v - bias, 0.0))
    return y.astype(x.dtype)


register_op("Shrink", infer=same_as_input(), cpu=_shrink_cpu, min_opset=9)




# -- PRelu (slope input) ----------------------------------------------------------------------


def _prelu_infer(node: Node, x: TensorInfo, slope: TensorInfo) -> TensorInfo:
    """slope broadcasts to X (unidirectionally): the output has X's shape."""
    if x.shape is not None and slope.shape is not None and broadcast_shapes(x.shape, slope.shape) != x.shape:
        raise ShapeInferenceError(f"PRelu slope {slope.shape} does not broadcast to X {x.shape}")
    return TensorInfo(x.dtype, x.shape)


@quiet
def _prelu_cpu(node: Node, x: np.ndarray, slope: np.ndarray) -> np.ndarray:
    if is_integer(x.dtype):
        return np.where(x < 0, x * slope.astype(x.dtype), x).astype(x.dtype)
    work = compute_dtype(x.dtype)
    v = x.astype(work, copy=False)
    return np.where(v < 0, v * slope.astype(work), v).astype(x.dtype)


register_op("PRelu", infer=_prelu_infer, cpu=_prelu_cpu)
