"""Network IR: a flat, topologically ordered list of nodes over named tensors.

Weights live once in ``Graph.constants`` (name -> ndarray); nodes refer to them by name like to any
other tensor. Shapes of graph inputs may hold symbolic dims (str) or None (unknown); intermediate
tensors carry no shape in the IR: they are computed per concrete input shape by shape inference
(``engine_core.passes.shape_inference``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Dim = int | str | None


@dataclass
class Value:
    """A graph input or output: name, element type and (possibly symbolic) shape.

    ``kind`` is "tensor" for ordinary tensors, or "sequence" / "optional" / "map" for the other
    ONNX value types (a python list, a value-or-None, a dict at run time): those carry no shape.
    """

    name: str
    dtype: np.dtype
    shape: tuple[Dim, ...] | None = None
    kind: str = "tensor"

    def __post_init__(self) -> None:
        self.dtype = np.dtype(self.dtype)
        if self.shape is not None:
            self.shape = tuple(self.shape)

    @property
    def is_tensor(self) -> bool:
        return self.kind == "tensor"

    @property
    def is_dynamic(self) -> bool:
        if not self.is_tensor:
            return False
        return self.shape is None or any(not isinstance(d, int) or d < 0 for d in self.shape)


@dataclass
class Node:
    """One operation. ``inputs`` may contain "" for an omitted optional input.

    ``opset`` is the opset version of the node's domain in the model it came from, so that op
    implementations can follow version-specific semantics. ``origin`` lists the ONNX node names the
    node stands for (more than one after a fusion), for the inspector and error messages.
    """

    op_type: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    name: str = ""
    domain: str = ""
    opset: int = 0
    origin: list[str] = field(default_factory=list)
    #: layer precision constraint (``layer.precision``): a float numpy dtype, None when not set.
    #: Build-time only (the reduce_precision pass realizes it as tensor dtypes and Casts).
    precision_constraint: np.dtype | None = None
    #: output type constraints (``layer.set_output_type``): output index -> numpy dtype
    output_type_constraints: dict[int, np.dtype] = field(default_factory=dict)

    def attr(self, key: str, default: Any = None) -> Any:
        return self.attrs.get(key, default)

    # -- precision constraints (the reference's ILayer API; enforced by passes.reduce_precision) --
    @property
    def precision(self) -> Any:
        """The constrained compute type (a DataType); FLOAT when no constraint is set, as in the reference."""
        from engine_core.types import DataType, datatype_of

        return DataType.FLOAT if self.precision_constraint is None else datatype_of(self.precision_constraint)

    @precision.setter
    def precision(self, dtype: Any) -> None:
        self.precision_constraint = _float_dtype(dtype, f"precision of layer {self}")

    @property
    def precision_is_set(self) -> bool:
        return self.precision_constraint is not None

    def reset_precision(self) -> None:
        self.precision_constraint = None

    def set_output_type(self, index: int, dtype: Any) -> None:
        """Constrain output ``index`` to ``dtype`` (a Cast is inserted after the layer when needed)."""
        if not 0 <= index < len(self.outputs):
            raise IndexError(f"layer {self} has {len(self.outputs)} outputs, no output {index}")
        self.output_type_constraints[index] = _float_dtype(dtype, f"output {index} type of layer {self}")

    def get_output_type(self, index: int) -> Any:
        """The constrained type of output ``index`` (FLOAT when none is set, as in the reference)."""
        from engine_core.types import DataType, datatype_of

        dtype = self.output_type_constraints.get(index)
        return DataType.FLOAT if dtype is None else datatype_of(dtype)

    def output_type_is_set(self, index: int) -> bool:
        return index in self.output_type_constraints

    def reset_output_type(self, index: int) -> None:
        self.output_type_constraints.pop(index, None)

    def __str__(self) -> str:
        return f"{self.op_type} '{self.name}'"


@dataclass
class Graph:
    """A whole network (or a subgraph of Loop/If/Scan)."""

    name: str = "network"
    inputs: list[Value] = field(default_factory=list)
    outputs: list[Value] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    constants: dict[str, np.ndarray] = field(default_factory=dict)
    opsets: dict[str, int] = field(default_factory=lambda: {"": 21})
    _ids: Any = field(default_factory=lambda: itertools.count(), repr=False, compare=False)

    # -- queries --------------------------------------------------------------------------------
    @property
    def input_names(self) -> list[str]:
        return [v.name for v in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [v.name for v in self.outputs]

    def producers(self) -> dict[str, Node]:
        """Tensor name -> the node that writes it."""
        return {out: n for n in self.nodes for out in n.outputs if out}

    def consumers(self) -> dict[str, list[Node]]:
        """Tensor name -> the nodes that read it (each node once per tensor)."""
        result: dict[str, list[Node]] = {}
        for n in self.nodes:
            for name in dict.fromkeys(i for i in n.inputs if i):
                result.setdefault(name, []).append(n)
        return result

    def unique_name(self, hint: str) -> str:
        """A tensor/node name not used anywhere in the graph yet."""
        taken = set(self.constants) | {v.name for v in self.inputs} | {
            t for n in self.nodes for t in (*n.inputs, *n.outputs, n.name)
        }
        while True:
            name = f"{hint}__{next(self._ids)}"
            if name not in taken:
                return name

    # -- edits used by passes -------------------------------------------------------------------
    def add_constant(self, hint: str, value: np.ndarray) -> str:
        name = self.unique_name(hint)
        self.constants[name] = np.asarray(value)
        return name

    def rename_tensor_uses(self, old: str, new: str) -> None:
        """Make every reader of ``old`` read ``new`` instead (graph outputs keep their names)."""
        for n in self.nodes:
            n.inputs = [new if i == old else i for i in n.inputs]

    def toposort(self) -> None:
        """Order nodes so that every node comes after the producers of its inputs.

        Raises ValueError naming a node on a cycle, or one that reads a tensor nobody produces.
        """
        available = set(self.constants) | set(self.input_names) | {""}
        pending = list(self.nodes)
        ordered: list[Node] = []
        while pending:
            progress = False
            rest = []
            for n in pending:
                if all(i in available for i in n.inputs):
                    ordered.append(n)
                    available.update(n.outputs)
                    progress = True
                else:
                    rest.append(n)
            if not progress:
                produced = {o for n in rest for o in n.outputs}
                n = rest[0]
                missing = [i for i in n.inputs if i not in available]
                if any(m in produced for m in missing):
                    raise ValueError(f"graph has a cycle through node {n} (inputs {missing})")
                raise ValueError(f"node {n} reads tensor(s) {missing} that no node or input produces")
            pending = rest
        self.nodes = ordered


#: Types a precision constraint may name (the floating-point compute types Kiln builds).
CONSTRAINABLE_DTYPES = ("float32", "float16", "bfloat16")


def _float_dtype(dtype: Any, what: str) -> np.dtype:
    """A DataType (or numpy dtype) as a numpy dtype, refusing types no layer can be constrained to."""
    from engine_core.types import DataType, nptype

    np_dtype = np.dtype(nptype(dtype)) if isinstance(dtype, DataType) else np.dtype(dtype)
    if np_dtype.name not in CONSTRAINABLE_DTYPES:
        raise ValueError(f"{what}: {np_dtype.name} is not supported (use FLOAT, HALF or BF16)")
    return np_dtype


def has_subgraph(node: Node) -> bool:
    """True for control-flow nodes (Loop/If/Scan/SequenceMap) that carry Graph attributes."""
    return any(isinstance(v, Graph) or (isinstance(v, list) and v and isinstance(v[0], Graph))
               for v in node.attrs.values())


def subgraph_reads(node: Node) -> set[str]:
    """Names the bodies of ``node`` read from enclosing scopes (at any depth): they must stay alive
    until ``node`` has run, like its inputs."""
    reads: set[str] = set()
    for value in node.attrs.values():
        for sub in value if isinstance(value, list) else [value]:
            if isinstance(sub, Graph):
                produced = set(sub.constants) | set(sub.input_names) | {o for n in sub.nodes for o in n.outputs}
                for n in sub.nodes:
                    reads.update(i for i in n.inputs if i and i not in produced)
                    reads.update(subgraph_reads(n) - produced)
                reads.update(o for o in sub.output_names if o not in produced)
    return reads
