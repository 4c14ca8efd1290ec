"""NetworkDefinition: the reference's INetworkDefinition over Kiln's IR graph."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine_core.inspector import network_tensor_names
from engine_core.ir import Dim, Graph, Node, Value
from engine_core.types import DataType, datatype_of, nptype


@dataclass
class NetworkTensor:
    """ITensor-like view of a graph input or output."""

    name: str
    dtype: DataType
    shape: tuple[int, ...]
    is_network_input: bool = False
    is_network_output: bool = False


def _dims(shape: tuple[Dim, ...] | None) -> tuple[int, ...]:
    """Reference-style dims: -1 for every dynamic (symbolic or unknown) dimension."""
    if shape is None:
        return ()
    return tuple(d if isinstance(d, int) and d >= 0 else -1 for d in shape)


class NetworkDefinition:
    """A network being built: filled by ``OnnxParser`` or by ``add_input``/``add_layer``/``mark_output``."""

    def __init__(self, flags: int = 0) -> None:
        self.flags = flags
        self.graph = Graph()
        #: tensors marked with mark_debug (kept through the build; see engine_core.inspector)
        self.debug_tensors: set[str] = set()

    @property
    def name(self) -> str:
        return self.graph.name

    @name.setter
    def name(self, value: str) -> None:
        self.graph.name = value

    @property
    def num_inputs(self) -> int:
        return len(self.graph.inputs)

    @property
    def num_outputs(self) -> int:
        return len(self.graph.outputs)

    @property
    def num_layers(self) -> int:
        return len(self.graph.nodes)

    def _tensor(self, v: Value, is_input: bool) -> NetworkTensor:
        return NetworkTensor(v.name, datatype_of(v.dtype), _dims(v.shape), is_input, not is_input)

    def get_input(self, index: int) -> NetworkTensor:
        return self._tensor(self.graph.inputs[index], True)

    def get_output(self, index: int) -> NetworkTensor:
        return self._tensor(self.graph.outputs[index], False)

    def get_layer(self, index: int) -> Node:
        return self.graph.nodes[index]

    def __iter__(self):
        return iter(self.graph.nodes)

    def add_input(self, name: str, dtype: DataType, shape: tuple[int, ...]) -> NetworkTensor:
        shape = tuple(None if d < 0 else d for d in shape)
        value = Value(name, np.dtype(nptype(dtype)), shape)
        self.graph.inputs.append(value)
        return self._tensor(value, True)

    def add_constant(self, name: str, value: np.ndarray) -> str:
        self.graph.constants[name] = np.asarray(value)
        return name

    def add_layer(self, op_type: str, inputs: list[str], outputs: list[str], **attrs) -> Node:
        """Add an op by ONNX name (e.g. ``add_layer("Relu", ["x"], ["y"])``)."""
        node = Node(op_type, list(inputs), list(outputs), attrs, name=f"{op_type}_{len(self.graph.nodes)}",
                    opset=self.graph.opsets.get("", 21))
        node.origin = [node.name]
        self.graph.nodes.append(node)
        return node

    def mark_output(self, tensor: NetworkTensor | str, dtype: DataType | None = None) -> None:
        name = tensor if isinstance(tensor, str) else tensor.name
        np_dtype = np.dtype(nptype(dtype)) if dtype is not None else np.dtype(np.float32)
        self.graph.outputs.append(Value(name, np_dtype, None))

    # -- debug tensors ----------------------------------------------------------------------------
    def mark_debug(self, tensor: NetworkTensor | str) -> bool:
        """Mark a tensor of the network (input, constant or layer output) as a debug tensor."""
        name = tensor if isinstance(tensor, str) else tensor.name
        if name not in network_tensor_names(self.graph):
            return False
        self.debug_tensors.add(name)
        return True

    def unmark_debug(self, tensor: NetworkTensor | str) -> bool:
        name = tensor if isinstance(tensor, str) else tensor.name
        if name not in self.debug_tensors:
            return False
        self.debug_tensors.discard(name)
        return True

    def is_debug_tensor(self, tensor: NetworkTensor | str) -> bool:
        return (tensor if isinstance(tensor, str) else tensor.name) in self.debug_tensors

    def unmark_output(self, tensor: NetworkTensor | str) -> None:
        name = tensor if isinstance(tensor, str) else tensor.name
        self.graph.outputs = [v for v in self.graph.outputs if v.name != name]
