"""NetworkDefinition: the reference's INetworkDefinition over Kiln's IR graph."""

from __future__ import annotations

import numpy as np

from engine_core.ir import Dim, Graph, Node, Value
from engine_core.types import DataType, TensorFormat, datatype_of, nptype


def network_tensor_names(graph: Graph) -> set[str]:
    """Every tensor name a network has: inputs, constants, node outputs."""
    return set(graph.input_names) | set(graph.constants) | {o for n in graph.nodes for o in n.outputs if o}


class NetworkTensor:
    """ITensor-like view of a graph input or output.

    ``dtype`` and ``allowed_formats`` are live: setting them on a tensor of a network records the
    I/O binding type/formats the user wants (``network.io_dtypes`` / ``network.io_formats``); the
    model's own type stays in the graph, and the build inserts reformat layers between the two.
    """

    def __init__(self, name: str, dtype: DataType, shape: tuple[int, ...], is_network_input: bool = False,
                 is_network_output: bool = False, network: NetworkDefinition | None = None) -> None:
        self.name = name
        self._dtype = DataType(dtype)
        self.shape = shape
        self.is_network_input = is_network_input
        self.is_network_output = is_network_output
        self._network = network

    def __repr__(self) -> str:
        return f"NetworkTensor(name={self.name!r}, dtype={self.dtype.name}, shape={self.shape})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NetworkTensor) and (self.name, self.dtype, self.shape) == (
            other.name, other.dtype, other.shape)

    __hash__ = None  # type: ignore[assignment]  # mutable view

    @property
    def dtype(self) -> DataType:
        if self._network is not None and self.name in self._network.io_dtypes:
            return datatype_of(self._network.io_dtypes[self.name])
        return self._dtype

    @dtype.setter
    def dtype(self, value: DataType) -> None:
        value = DataType(value)
        if self._network is None:
            self._dtype = value
            return
        self._network.set_io_dtype(self.name, value)

    @property
    def allowed_formats(self) -> int:
        """Bitmask of TensorFormat values the binding may use (all formats when never set)."""
        if self._network is None:
            return _ALL_FORMATS
        return self._network.io_formats.get(self.name, _ALL_FORMATS)

    @allowed_formats.setter
    def allowed_formats(self, mask: int) -> None:
        if self._network is None:
            raise ValueError(f"tensor '{self.name}' is not a network input or output")
        self._network.set_io_formats(self.name, mask)


#: every TensorFormat allowed (the reference's default for an I/O tensor)
_ALL_FORMATS = sum(1 << int(f) for f in TensorFormat)
#: Float types a float I/O tensor's binding may be switched between.
_IO_FLOAT_TYPES = (DataType.FLOAT, DataType.HALF, DataType.BF16)


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
        #: I/O tensor -> numpy dtype of its binding where the user changed it (``tensor.dtype = HALF``)
        self.io_dtypes: dict[str, np.dtype] = {}
        #: I/O tensor -> allowed TensorFormat bitmask where the user set one
        self.io_formats: dict[str, int] = {}

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
        return NetworkTensor(v.name, datatype_of(v.dtype), _dims(v.shape), is_input, not is_input, self)

    def _io_value(self, name: str) -> Value:
        for v in (*self.graph.inputs, *self.graph.outputs):
            if v.name == name:
                return v
        raise ValueError(f"'{name}' is not a network input or output")

    def set_io_dtype(self, name: str, dtype: DataType) -> None:
        """Make the binding of I/O tensor ``name`` ``dtype`` (FLOAT/HALF/BF16 for float tensors).

        Weakly typed builds insert a reformat (Cast) between the binding and the network where the
        types differ; strongly typed builds refuse a type other than the model's.
        """
        value = self._io_value(name)
        dtype = DataType(dtype)
        model = datatype_of(value.dtype)
        if dtype == model:
            self.io_dtypes.pop(name, None)
            return
        if model not in _IO_FLOAT_TYPES or dtype not in _IO_FLOAT_TYPES:
            raise ValueError(f"tensor '{name}' is {model.name} in the model: its binding type can only be "
                             f"switched among FLOAT, HALF and BF16 for float tensors, not to {dtype.name}")
        self.io_dtypes[name] = np.dtype(nptype(dtype))

    def set_io_formats(self, name: str, mask: int) -> None:
        """Record the allowed TensorFormat bitmask of I/O tensor ``name`` (checked by the build)."""
        self._io_value(name)
        mask = int(mask)
        if mask <= 0 or mask & ~_ALL_FORMATS:
            raise ValueError(f"tensor '{name}': allowed_formats {mask:#x} is not a non-empty mask of TensorFormat bits")
        self.io_formats[name] = mask

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
