"""Shape and data-movement ops: Reshape, Shape, Transpose, Concat, Slice, Gather, Cast, ..."""

from __future__ import annotations

import numpy as np

from engine_core.ir import Node
from engine_core.ops.registry import ShapeInferenceError, TensorInfo, register_op, same_as_input


def reshape_target(shape_in: tuple[int, ...], target: np.ndarray, allowzero: int) -> tuple[int, ...]:
    """Resolve ONNX Reshape's target (0 = copy dim unless allowzero, -1 = infer)."""
    dims = [int(d) for d in target]
    if not allowzero:
        dims = [shape_in[i] if d == 0 and i < len(shape_in) else d for i, d in enumerate(dims)]
    if dims.count(-1) > 1:
        raise ShapeInferenceError(f"Reshape target {dims} has more than one -1")
    total = int(np.prod(shape_in))
    if -1 in dims:
        known = int(np.prod([d for d in dims if d != -1]))
        if known == 0 or total % known:
            raise ShapeInferenceError(f"cannot reshape {shape_in} to {dims}")
        dims[dims.index(-1)] = total // known
    if int(np.prod(dims)) != total:
        raise ShapeInferenceError(f"cannot reshape {shape_in} ({total} elements) to {dims}")
    return tuple(dims)


def _reshape_infer(node: Node, x: TensorInfo, shape: TensorInfo) -> TensorInfo:
    if x.shape is None or shape.value is None:
        return TensorInfo(x.dtype, None)
    return TensorInfo(x.dtype, reshape_target(x.shape, shape.value, node.attr("allowzero", 0)))


def _reshape_cpu(node: Node, x: np.ndarray, shape: np.ndarray) -> np.ndarray:
    return x.reshape(reshape_target(x.shape, shape, node.attr("allowzero", 0)))


def _reshape_normalize(node: Node, graph) -> None:
    """Opset < 5 carried the target shape as an attribute; make it an input."""
    if "shape" in node.attrs and len(node.inputs) == 1:
        node.inputs.append(graph.add_constant(f"{node.name}_shape", np.array(node.attrs.pop("shape"), np.int64)))


register_op("Reshape", infer=_reshape_infer, cpu=_reshape_cpu, normalize=_reshape_normalize)


def _shape_slice(node: Node, rank: int) -> slice:
    start, end = node.attr("start", 0), node.attr("end", None)
    return slice(start, end)


def _shape_infer(node: Node, x: TensorInfo) -> TensorInfo:
    if x.shape is None:
        return TensorInfo(np.int64, None)
    value = np.array(x.shape[_shape_slice(node, len(x.shape))], dtype=np.int64)
    return TensorInfo.of(value)


register_op(
    "Shape",
    infer=_shape_infer,
    cpu=lambda node, x: np.array(x.shape[_shape_slice(node, x.ndim)], dtype=np.int64),
)

register_op("Identity", infer=same_as_input(), cpu=lambda node, x: x)
