"""Shape inference: concrete dtypes/shapes (and small values) of every tensor for given inputs.

Runs each op's ``infer`` rule in graph order. Small tensors whose inputs all have known values are
also evaluated (with the op's CPU implementation), so shape computations such as
Shape -> Gather -> Concat -> Reshape resolve at build time like in the reference builder.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from engine_core.errors import ShapeError
from engine_core.interpret import run_node
from engine_core.ir import Graph, has_subgraph
from engine_core.ops.registry import ShapeInferenceError, TensorInfo, get_op

#: Values with at most this many elements are propagated (shape tensors, scalars, small tables).
VALUE_LIMIT = 4096


def stand_in_shape(shape: Sequence[Any]) -> tuple[int, ...]:
    """A declared shape with every unknown dim (symbolic or negative) taken as 1: what passes that need only ranks
    and types (reduce_precision, decompose_batchnorm) infer with, as no rank or type depends on those dims."""
    return tuple(d if isinstance(d, int) and d >= 0 else 1 for d in shape)


def stand_in_infos(graph: Graph, *, values: bool = True) -> dict[str, TensorInfo] | None:
    """Types and shapes of every tensor with each unknown input dim taken as 1 (``stand_in_shape``), for passes that
    need only types and ranks; None when the graph cannot be typed so."""
    inputs = {v.name: TensorInfo(v.dtype, stand_in_shape(v.shape) if v.is_tensor and v.shape is not None else None)
              for v in graph.inputs}
    try:
        return infer_shapes(graph, inputs, values=values)
    except ShapeError:
        return None


def infer_shapes(graph: Graph, inputs: Mapping[str, TensorInfo], *, values: bool = True) -> dict[str, TensorInfo]:
    """Return TensorInfo for every tensor of ``graph`` given infos for its inputs.

    Raises ShapeError naming the layer (and its ONNX origin) when an op rejects its inputs.
    """
    infos: dict[str, TensorInfo] = {name: TensorInfo.of(v) for name, v in graph.constants.items()
                                    if v.size <= VALUE_LIMIT}
    for name, v in graph.constants.items():
        if name not in infos:
            infos[name] = TensorInfo(v.dtype, v.shape)
    infos.update(inputs)
    for node in graph.nodes:
        op = get_op(node.op_type, node.domain)
        if op is None:
            raise ShapeError(f"layer {node}: unsupported op {node.op_type}")
        args = [infos.get(name) if name else None for name in node.inputs]
        missing = [n for n, a in zip(node.inputs, args) if n and a is None]
        if missing:
            raise ShapeError(f"layer {node}: inputs {missing} are unknown")
        try:  # ops with bodies see the enclosing infos, as their CPU implementations see the scope, and infer them here
            result = (op.infer(node, *args, scope=infos, infer_graph=infer_shapes) if has_subgraph(node)
                      else op.infer(node, *args))
        except ShapeInferenceError as e:
            raise ShapeError(f"layer {node}: {e}") from None
        except Exception as e:
            if any(a is not None and a.shape is None for a in args):
                result = [TensorInfo(args[0].dtype if args and args[0] else np.float32, None)] * len(node.outputs)
            else:
                raise ShapeError(f"layer {node}: shape inference failed: {type(e).__name__}: {e}") from e
        results = list(result) if isinstance(result, (list, tuple)) else [result]
        if values and op.deterministic and _all_values_known(args) and _small(results):
            try:
                computed = run_node(node, [a.value if a is not None else None for a in args])
                results = [TensorInfo.of(v) if isinstance(v, np.ndarray) else r
                           for v, r in zip(computed, results)]
            except Exception:
                pass  # values are an optimization; the infer result stands
        for name, info in zip(node.outputs, results):
            if name:
                infos[name] = info
    return infos


def _all_values_known(args: list[TensorInfo | None]) -> bool:
    present = [a for a in args if a is not None]
    return bool(present) and all(a.value is not None for a in present)


def _small(results: list[TensorInfo]) -> bool:
    return all(r.shape is None or int(np.prod(r.shape)) <= VALUE_LIMIT for r in results)
