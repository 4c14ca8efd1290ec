"""Sequence and Optional ops (SequenceConstruct/At/Insert/..., SplitToSequence, SequenceMap, Optional*).

Run-time representation: a sequence is a python list of arrays, an optional is its element or None.
Ops never mutate a list they are given (a sequence may be read by several layers), they build a
new one.

Build-time representation: like every non-tensor value, a sequence's ``TensorInfo`` has dtype
object and shape None. ``SequenceInfo`` adds what is known of its elements (and its length), so
that ``SequenceAt`` / ``ConcatFromSequence`` can still report a dtype and shape downstream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from engine_core.errors import ExecutionError
from engine_core.ir import Graph, Node
from engine_core.ops.control_flow import body_runner, declared_info, infer_body, run_body
from engine_core.ops.registry import (
    GraphInference,
    Interpreter,
    ShapeInferenceError,
    TensorInfo,
    normalize_axis,
    register_op,
)
from engine_core.types import onnx_to_np

OBJECT = np.dtype(object)


@dataclass
class SequenceInfo(TensorInfo):
    """Build-time info of a sequence: dtype object, shape None, plus its elements' common info."""

    elem: TensorInfo | None = None
    length: int | None = None


def sequence_info(elem: TensorInfo | None = None, length: int | None = None) -> SequenceInfo:
    return SequenceInfo(OBJECT, None, None, elem, length)


def elem_of(info: TensorInfo | None) -> TensorInfo | None:
    """The element info of a sequence input, when the producer recorded it."""
    return info.elem if isinstance(info, SequenceInfo) else None


def merge_elems(a: TensorInfo | None, b: TensorInfo | None) -> TensorInfo | None:
    """Element info common to two sets of elements: dtype if it agrees, shape if it agrees."""
    if a is None or b is None:
        return None
    if a.dtype != b.dtype:
        raise ShapeInferenceError(f"sequence elements must share one dtype, got {a.dtype} and {b.dtype}")
    return TensorInfo(a.dtype, a.shape if a.shape == b.shape else None)


def position(value: Any, length: int, *, inclusive_end: bool, op: str) -> int:
    """A scalar position in [-n, n-1] (or [-n, n] where inserting at the end is allowed) as an index."""
    pos = int(np.asarray(value).reshape(-1)[0])
    high = length if inclusive_end else length - 1
    if not -length <= pos <= high:
        raise ExecutionError(f"{op} position {pos} is out of range for a sequence of {length}")
    return pos + length if pos < 0 else pos


def as_sequence(value: Any, op: str) -> list[Any]:
    if not isinstance(value, list):
        raise ExecutionError(f"{op} expects a sequence, got {type(value).__name__}")
    return value


# -- SequenceEmpty / SequenceConstruct / SequenceLength -------------------------------------------


def _empty_dtype(node: Node) -> np.dtype:
    return onnx_to_np(node.attr("dtype", 1))


register_op(
    "SequenceEmpty",
    infer=lambda node: sequence_info(TensorInfo(_empty_dtype(node), None), 0),
    cpu=lambda node: [[]],
    min_opset=11,
)


def _construct_infer(node: Node, *xs: TensorInfo) -> SequenceInfo:
    elem: TensorInfo | None = TensorInfo(xs[0].dtype, xs[0].shape)
    for x in xs[1:]:
        elem = merge_elems(elem, x)
    return sequence_info(elem, len(xs))


register_op("SequenceConstruct", infer=_construct_infer, cpu=lambda node, *xs: [list(xs)], min_opset=11)


def _length_infer(node: Node, seq: TensorInfo) -> TensorInfo:
    if isinstance(seq, SequenceInfo) and seq.length is not None:
        return TensorInfo.of(np.array(seq.length, dtype=np.int64))
    return TensorInfo(np.int64, ())


register_op(
    "SequenceLength",
    infer=_length_infer,
    cpu=lambda node, seq: np.array(len(as_sequence(seq, "SequenceLength")), dtype=np.int64),
    min_opset=11,
)


# -- SequenceInsert / SequenceErase / SequenceAt ---------------------------------------------------


def _insert_infer(node: Node, seq: TensorInfo, x: TensorInfo, pos: TensorInfo | None = None) -> SequenceInfo:
    length = seq.length if isinstance(seq, SequenceInfo) else None
    elem = TensorInfo(x.dtype, x.shape)
    if length != 0:
        elem = merge_elems(elem_of(seq), elem) if elem_of(seq) is not None else TensorInfo(x.dtype, None)
    return sequence_info(elem, None if length is None else length + 1)


def _insert_cpu(node: Node, seq: list, x: np.ndarray, pos: np.ndarray | None = None) -> list:
    seq = as_sequence(seq, "SequenceInsert")
    at = len(seq) if pos is None else position(pos, len(seq), inclusive_end=True, op="SequenceInsert")
    return [[*seq[:at], x, *seq[at:]]]


register_op("SequenceInsert", infer=_insert_infer, cpu=_insert_cpu, min_opset=11)


def _erase_infer(node: Node, seq: TensorInfo, pos: TensorInfo | None = None) -> SequenceInfo:
    length = seq.length if isinstance(seq, SequenceInfo) else None
    return sequence_info(elem_of(seq), None if not length else length - 1)


def _erase_cpu(node: Node, seq: list, pos: np.ndarray | None = None) -> list:
    seq = as_sequence(seq, "SequenceErase")
    at = len(seq) - 1 if pos is None else position(pos, len(seq), inclusive_end=False, op="SequenceErase")
    if not seq:
        raise ExecutionError("SequenceErase on an empty sequence")
    return [[*seq[:at], *seq[at + 1:]]]


register_op("SequenceErase", infer=_erase_infer, cpu=_erase_cpu, min_opset=11)


def _at_infer(node: Node, seq: TensorInfo, pos: TensorInfo) -> TensorInfo:
    elem = elem_of(seq)
    return TensorInfo(elem.dtype, elem.shape) if elem is not None else TensorInfo(OBJECT, None)


def _at_cpu(node: Node, seq: list, pos: np.ndarray) -> np.ndarray:
    seq = as_sequence(seq, "SequenceAt")
    return seq[position(pos, len(seq), inclusive_end=False, op="SequenceAt")]


register_op("SequenceAt", infer=_at_infer, cpu=_at_cpu, min_opset=11)


# -- ConcatFromSequence / SplitToSequence ----------------------------------------------------------


def _concat_axis(node: Node, rank: int) -> int:
    """ConcatFromSequence's axis; with new_axis=1 it may also name the position after the last dim."""
    new_axis = int(node.attr("new_axis", 0))
    return normalize_axis(int(node.attr("axis")), rank + new_axis)


def _concat_infer(node: Node, seq: TensorInfo) -> TensorInfo:
    elem = elem_of(seq)
    if elem is None:
        return TensorInfo(OBJECT, None)
    length = seq.length if isinstance(seq, SequenceInfo) else None
    if elem.shape is None or length is None:
        return TensorInfo(elem.dtype, None)
    axis = _concat_axis(node, len(elem.shape))
    if node.attr("new_axis", 0):
        return TensorInfo(elem.dtype, (*elem.shape[:axis], length, *elem.shape[axis:]))
    shape = list(elem.shape)
    shape[axis] *= length
    return TensorInfo(elem.dtype, tuple(shape))


def _concat_cpu(node: Node, seq: list) -> np.ndarray:
    seq = as_sequence(seq, "ConcatFromSequence")
    if not seq:
        raise ExecutionError("ConcatFromSequence of an empty sequence")
    axis = _concat_axis(node, np.ndim(seq[0]))
    return np.stack(seq, axis=axis) if node.attr("new_axis", 0) else np.concatenate(seq, axis=axis)


register_op("ConcatFromSequence", infer=_concat_infer, cpu=_concat_cpu, min_opset=11)


def split_sizes(dim: int, split: np.ndarray | None) -> list[int] | None:
    """Chunk sizes along the split axis; None means "chunks of 1, squeezed if keepdims=0"."""
    if split is None:
        return None
    split = np.asarray(split)
    if split.ndim == 0:
        size = int(split)
        if size <= 0:
            raise ShapeInferenceError(f"SplitToSequence split {size} must be positive")
        return [size] * (dim // size) + ([dim % size] if dim % size else [])
    sizes = [int(s) for s in split.reshape(-1)]
    if sum(sizes) != dim or any(s < 0 for s in sizes):
        raise ShapeInferenceError(f"SplitToSequence sizes {sizes} do not add up to the axis length {dim}")
    return sizes


def _split_infer(node: Node, x: TensorInfo, split: TensorInfo | None = None) -> SequenceInfo:
    if x.shape is None or (split is not None and split.value is None):
        return sequence_info(TensorInfo(x.dtype, None))
    axis = normalize_axis(int(node.attr("axis", 0)), len(x.shape))
    sizes = split_sizes(x.shape[axis], None if split is None else split.value)
    if sizes is None:
        keep = node.attr("keepdims", 1)
        shape = x.shape[:axis] + ((1,) if keep else ()) + x.shape[axis + 1:]
        return sequence_info(TensorInfo(x.dtype, shape), x.shape[axis])
    shapes = {x.shape[:axis] + (s,) + x.shape[axis + 1:] for s in sizes}
    return sequence_info(TensorInfo(x.dtype, shapes.pop() if len(shapes) == 1 else None), len(sizes))


def _split_cpu(node: Node, x: np.ndarray, split: np.ndarray | None = None) -> list:
    axis = normalize_axis(int(node.attr("axis", 0)), x.ndim)
    sizes = split_sizes(x.shape[axis], split)
    if sizes is None:
        parts = np.split(x, x.shape[axis], axis=axis)
        return [parts if node.attr("keepdims", 1) else [np.squeeze(p, axis=axis) for p in parts]]
    return [np.split(x, np.cumsum(sizes)[:-1], axis=axis)]


register_op("SplitToSequence", infer=_split_infer, cpu=_split_cpu, min_opset=11)


# -- SequenceMap --------------------------------------------------------------------------------


def _map_infer(node: Node, *inputs: TensorInfo | None, scope: Any = None,
               infer_graph: GraphInference | None = None) -> list[SequenceInfo]:
    """Element infos from the body run on the inputs' element infos (given the enclosing scope)."""
    body: Graph = node.attr("body")
    length = inputs[0].length if isinstance(inputs[0], SequenceInfo) else None
    elems = [(elem_of(i) or TensorInfo(OBJECT, None)) if i is None or i.dtype == OBJECT else i for i in inputs]
    outs = infer_body(body, elems, scope, infer_graph) or [declared_info(v) for v in body.outputs]
    return [sequence_info(TensorInfo(o.dtype, o.shape), length) for o in outs]


def _map_cpu(node: Node, seq: list, *extra: Any, scope: Any = None,
             interpreter: Interpreter | None = None) -> list[list]:
    """Run the body once per element; sequence arguments give their i-th element, tensors all of them."""
    body: Graph = node.attr("body")
    seq = as_sequence(seq, "SequenceMap")
    for other in extra:
        if isinstance(other, list) and len(other) != len(seq):
            raise ExecutionError(f"SequenceMap sequences have different lengths {len(seq)} and {len(other)}")
    runner = body_runner(body, interpreter)
    outputs: list[list] = [[] for _ in body.outputs]
    for i, item in enumerate(seq):
        args = [item, *(a[i] if isinstance(a, list) else a for a in extra)]
        for acc, value in zip(outputs, run_body(body, dict(zip(body.input_names, args)), scope, runner)):
            acc.append(value)
    return outputs


register_op("SequenceMap", infer=_map_infer, cpu=_map_cpu, min_opset=17)


# -- Optional / OptionalHasElement / OptionalGetElement --------------------------------------------


def _optional_infer(node: Node, x: TensorInfo | None = None) -> TensorInfo:
    """An optional's info is its element's (what OptionalGetElement will give), or unknown."""
    if x is not None:
        return x
    return TensorInfo(OBJECT, None)


def _optional_cpu(node: Node, x: Any = None) -> list:
    return [x]


register_op("Optional", infer=_optional_infer, cpu=_optional_cpu, min_opset=15)


register_op(
    "OptionalHasElement",
    infer=lambda node, x=None: TensorInfo(np.bool_, ()),
    cpu=lambda node, x=None: np.array(x is not None),
    min_opset=15,
)


def _get_element_cpu(node: Node, x: Any) -> list:
    if x is None:
        raise ExecutionError("OptionalGetElement of an empty optional")
    return [x]


register_op("OptionalGetElement", infer=lambda node, x: x, cpu=_get_element_cpu, min_opset=15)
