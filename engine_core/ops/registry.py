"""The op registry: one registration per ONNX operator.

Each ``OpDef`` says, for one ``(domain, op_type)``:
- ``infer``: output dtypes/shapes from input ``TensorInfo``s (shape inference, needed at build time
  and by ``ExecutionContext.infer_shapes``). Must be cheap: no tensor math on full-size data.
- ``cpu``: the numpy implementation run by the reference interpreter (engine_core.interpret; vectorized, no
  per-element Python loops).
- ``normalize`` (optional): the import rule, turning older-opset forms into the canonical form the
  other two functions expect (e.g. Squeeze's ``axes`` attribute (opset < 13) into an input).

Signatures (``node`` is an ``engine_core.ir.Node``; ``node.attr(key, default)`` reads attributes,
``node.opset`` is the opset version of its domain)::

    infer(node, *inputs: TensorInfo | None) -> TensorInfo | Sequence[TensorInfo]
    cpu(node, *inputs: np.ndarray | None) -> np.ndarray | Sequence[np.ndarray]
    normalize(node, graph) -> None          # may edit node in place, add constants to graph

Ops whose node carries a ``Graph`` attribute (a body: If, Loop, Scan, SequenceMap, PointwiseChain) are also given
what runs that body, so that no op imports the interpreters back (they import this registry)::

    infer(node, *inputs, scope=infos, infer_graph=engine_core.passes.shape_inference.infer_shapes)
    cpu(node, *inputs, scope=env, interpreter=engine_core.interpret.GraphRunner)

``scope`` holds the enclosing graphs' tensors (infos); shape inference and the interpreter pass themselves.

An omitted optional input arrives as None. ``TensorInfo.value`` holds the tensor's value when it is
known at build time (constants, shape computations); ops that need an input's value to know their
output shape (Reshape, Expand, Slice, ...) read it from there, and report ``shape=None`` when it is
unknown — then shapes are found at run time (data-dependent). Infer functions may raise
``ShapeInferenceError`` with a message naming what is wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from engine_core.errors import KilnError
from engine_core.ir import Graph, Node

Shape = tuple[int, ...]


class ShapeInferenceError(KilnError):
    """Inputs that an op cannot accept (rank, broadcasting, attribute values, ...)."""


@dataclass
class TensorInfo:
    """What is known about a tensor before running: dtype, concrete shape (None if data-dependent)
    and, for small tensors computable at build time, the value itself."""

    dtype: np.dtype
    shape: Shape | None
    value: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.dtype = np.dtype(self.dtype)
        if self.shape is not None:
            self.shape = tuple(int(d) for d in self.shape)

    @property
    def rank(self) -> int | None:
        return None if self.shape is None else len(self.shape)

    @staticmethod
    def of(array: np.ndarray) -> TensorInfo:
        array = np.asarray(array)
        return TensorInfo(array.dtype, array.shape, array)


InferFn = Callable[..., "TensorInfo | Sequence[TensorInfo]"]
CpuFn = Callable[..., "np.ndarray | Sequence[np.ndarray]"]
NormalizeFn = Callable[[Node, Any], None]


class BodyRunner(Protocol):
    """Runs one body graph (engine_core.interpret.GraphRunner)."""

    def run(self, feeds: Mapping[str, Any], outer: Mapping[str, Any] | None = None) -> dict[str, Any]: ...


#: What ops with bodies get as ``interpreter=``: builds a body's runner (the class engine_core.interpret.GraphRunner).
Interpreter = Callable[[Graph], BodyRunner]
#: What infer rules of ops with bodies get as ``infer_graph=``: engine_core.passes.shape_inference.infer_shapes
#: (called as ``infer_graph(graph, infos, values=...)``).
GraphInference = Callable[..., "dict[str, TensorInfo]"]


@dataclass(frozen=True)
class OpDef:
    op_type: str
    infer: InferFn
    cpu: CpuFn
    domain: str = ""
    normalize: NormalizeFn | None = None
    #: False for ops whose output depends on more than their inputs (random ops): never folded.
    deterministic: bool = True
    #: Inclusive opset range the implementation follows; the parser refuses nodes outside it.
    min_opset: int = 1
    doc: str = ""


_REGISTRY: dict[tuple[str, str], OpDef] = {}

#: Domains that mean the standard ONNX operator set.
DEFAULT_DOMAINS = ("", "ai.onnx")


def _key(domain: str, op_type: str) -> tuple[str, str]:
    return ("" if domain in DEFAULT_DOMAINS else domain, op_type)


def register_op(
    op_type: str,
    *,
    infer: InferFn,
    cpu: CpuFn,
    domain: str = "",
    normalize: NormalizeFn | None = None,
    deterministic: bool = True,
    min_opset: int = 1,
    doc: str = "",
) -> OpDef:
    """Register one operator; registering the same (domain, op_type) twice is a bug."""
    key = _key(domain, op_type)
    if key in _REGISTRY:
        raise RuntimeError(f"op {domain or 'ai.onnx'}::{op_type} registered twice")
    op = OpDef(op_type, infer, cpu, key[0], normalize, deterministic, min_opset, doc)
    _REGISTRY[key] = op
    return op


def get_op(op_type: str, domain: str = "") -> OpDef | None:
    return _REGISTRY.get(_key(domain, op_type))


def registered_ops() -> list[OpDef]:
    return sorted(_REGISTRY.values(), key=lambda o: (o.domain, o.op_type))


# -- helpers shared by many registrations -----------------------------------------------------


def broadcast_shapes(*shapes: Shape) -> Shape:
    """Numpy/ONNX multidirectional broadcasting; raises ShapeInferenceError on mismatch."""
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        raise ShapeInferenceError(f"shapes {list(shapes)} cannot be broadcast together") from None


def normalize_axis(axis: int, rank: int) -> int:
    """Map a possibly negative axis into [0, rank); raises ShapeInferenceError when out of range."""
    if not -rank <= axis < max(rank, 1):
        raise ShapeInferenceError(f"axis {axis} is out of range for rank {rank}")
    return axis % rank if rank else 0


def same_as_input(index: int = 0) -> InferFn:
    """Infer rule: one output with the dtype and shape of input ``index`` (unary ops)."""

    def infer(node: Node, *inputs: TensorInfo | None) -> TensorInfo:
        x = inputs[index]
        assert x is not None
        return TensorInfo(x.dtype, x.shape)

    return infer


def broadcast_infer(out_dtype: np.dtype | None = None) -> InferFn:
    """Infer rule for elementwise n-ary ops: broadcast shape, dtype of input 0 or ``out_dtype``."""

    def infer(node: Node, *inputs: TensorInfo | None) -> TensorInfo:
        present = [i for i in inputs if i is not None]
        known = [i.shape for i in present if i.shape is not None]
        shape = broadcast_shapes(*known) if len(known) == len(present) else None
        return TensorInfo(out_dtype if out_dtype is not None else present[0].dtype, shape)

    return infer
