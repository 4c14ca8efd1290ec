"""Random generators: RandomNormal/Uniform(+Like), Bernoulli, Multinomial.

All are registered ``deterministic=False`` so that shape inference never folds them into constants.
A ``seed`` attribute makes a node reproducible: every run of it draws the same numbers (the
generator is created from the seed per call). Without a seed, draws come from one process-wide
generator seeded from OS entropy.
"""

from __future__ import annotations

import numpy as np

from engine_core.ir import Node
from engine_core.ops.registry import ShapeInferenceError, TensorInfo, register_op
from engine_core.types import onnx_to_np

_ENTROPY = np.random.default_rng()

#: ONNX TensorProto codes of the dtypes Multinomial may return.
_INT32, _INT64 = 6, 7


def generator(node: Node) -> np.random.Generator:
    """A generator seeded from the node's float ``seed`` (its bit pattern, so that 0.5 and 0.25
    differ), or the shared unseeded one."""
    seed = node.attr("seed")
    if seed is None:
        return _ENTROPY
    return np.random.default_rng(int(np.array(seed, dtype=np.float64).view(np.uint64)))


def _dtype(node: Node, default: np.dtype) -> np.dtype:
    code = node.attr("dtype")
    return np.dtype(default) if code is None else onnx_to_np(code)


def _draw(node: Node, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Normal (mean, scale) or uniform [low, high) samples, by op type, drawn in float64."""
    rng = generator(node)
    if node.op_type.startswith("RandomNormal"):
        values = rng.normal(node.attr("mean", 0.0), node.attr("scale", 1.0), shape)
    else:
        low, high = node.attr("low", 0.0), node.attr("high", 1.0)
        values = rng.uniform(low, high, shape).astype(dtype)
        # a float64 draw just below `high` can round up to it in a narrower dtype: keep [low, high)
        top = np.nextafter(np.asarray(high, dtype), np.asarray(low, dtype))
        return np.minimum(values, top) if high > low else values
    return values.astype(dtype)


# -- RandomNormal / RandomUniform: shape from the attribute ---------------------------------------


def _shape_attr(node: Node) -> tuple[int, ...]:
    shape = node.attr("shape")
    if shape is None:
        raise ShapeInferenceError(f"{node.op_type} needs a 'shape' attribute")
    return tuple(int(d) for d in shape)


def _generator_infer(node: Node) -> TensorInfo:
    return TensorInfo(_dtype(node, np.float32), _shape_attr(node))


def _generator_cpu(node: Node) -> np.ndarray:
    return _draw(node, _shape_attr(node), _dtype(node, np.float32))


for _name in ("RandomNormal", "RandomUniform"):
    register_op(_name, infer=_generator_infer, cpu=_generator_cpu, deterministic=False)


# -- *Like: shape (and default dtype) from the input ----------------------------------------------


def _like_infer(node: Node, x: TensorInfo) -> TensorInfo:
    return TensorInfo(_dtype(node, x.dtype), x.shape)


for _name in ("RandomNormalLike", "RandomUniformLike"):
    register_op(_name, infer=_like_infer, cpu=lambda node, x: _draw(node, x.shape, _dtype(node, x.dtype)),
                deterministic=False)


# -- Bernoulli ---------------------------------------------------------------------------------------


def _bernoulli_cpu(node: Node, p: np.ndarray) -> np.ndarray:
    """1 with probability p (elementwise): a uniform draw in [0, 1) falls below p."""
    u = generator(node).random(p.shape)
    return (u < p.astype(np.float64)).astype(_dtype(node, p.dtype))


register_op("Bernoulli", infer=_like_infer, cpu=_bernoulli_cpu, deterministic=False, min_opset=15)


# -- Multinomial -------------------------------------------------------------------------------------


def _multinomial_infer(node: Node, x: TensorInfo) -> TensorInfo:
    dtype = _dtype(node, np.int32)
    if dtype not in (onnx_to_np(_INT32), onnx_to_np(_INT64)):
        raise ShapeInferenceError(f"Multinomial dtype must be int32 or int64, got {dtype}")
    if x.shape is None:
        return TensorInfo(dtype, None)
    if len(x.shape) != 2:
        raise ShapeInferenceError(f"Multinomial input must be [batch, classes], got shape {x.shape}")
    return TensorInfo(dtype, (x.shape[0], int(node.attr("sample_size", 1))))


def _multinomial_cpu(node: Node, logits: np.ndarray) -> np.ndarray:
    """``sample_size`` class indices per batch row, drawn from softmax(row) (the input holds
    unnormalized log-probabilities). Inverse-CDF sampling for all rows in one searchsorted: row
    ``r``'s CDF is shifted by ``r`` so the rows' ranges do not overlap."""
    batch, classes = logits.shape
    samples = int(node.attr("sample_size", 1))
    z = logits.astype(np.float64)
    weights = np.exp(z - z.max(axis=1, keepdims=True))
    cdf = np.cumsum(weights, axis=1)
    cdf /= cdf[:, -1:]
    rows = np.arange(batch, dtype=np.float64)[:, None]
    u = generator(node).random((batch, samples))
    flat = np.searchsorted((cdf + rows).reshape(-1), (u + rows).reshape(-1), side="right")
    index = flat.reshape(batch, samples) - np.arange(batch)[:, None] * classes
    return np.minimum(index, classes - 1).astype(_dtype(node, np.int32))


register_op("Multinomial", infer=_multinomial_infer, cpu=_multinomial_cpu, deterministic=False)
