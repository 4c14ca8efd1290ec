"""ONNX importer: ModelProto -> Kiln network IR, with errors like the reference parser's.

Usage follows the reference::

    network = builder.create_network()
    parser = OnnxParser(network, logger)
    if not parser.parse_from_file("model.onnx"):
        for i in range(parser.num_errors):
            print(parser.get_error(i))
"""

from __future__ import annotations

import mmap
import os
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnx.inliner
from onnx import numpy_helper
from onnx.external_data_helper import ExternalDataInfo

from engine_core.errors import ParseError
from engine_core.ir import Graph, Node, Value
from engine_core.logger import DEFAULT_LOGGER, Logger, Severity
from engine_core.ops import get_op
from engine_core.passes.constant_folding import max_constant_bytes
from engine_core.types import onnx_to_np

#: Op implementations follow opset >= 7 semantics (normalizing older attribute forms where they
#: changed). Models declaring an older opset import when each op's schema is unchanged since then.
MIN_OPSET = 7
MAX_OPSET = onnx.defs.onnx_opset_version()

# Bounds on what a model file may ask the importer to build, so a hostile file fails with a reason instead of
# exhausting memory or time. Real models stay far below them: a few levels of Loop/If bodies, attribute lists
# of a few dozen entries (weights are tensors, not attribute lists).
#: Loop/If/Scan bodies nested deeper than this are refused.
MAX_SUBGRAPH_DEPTH = 16
#: Entries in one list attribute (ints, floats, strings, tensors, graphs).
MAX_ATTRIBUTE_ELEMENTS = 1 << 20
#: Bytes in one string attribute.
MAX_ATTRIBUTE_STRING_BYTES = 1 << 24


@dataclass(frozen=True)
class ParserError:
    """One import problem: which node (index, name, op) and why."""

    desc: str
    node_index: int = -1
    node_name: str = ""
    node_operator: str = ""

    def __str__(self) -> str:
        where = f"node {self.node_index} '{self.node_name}' ({self.node_operator}): " if self.node_operator else ""
        return f"{where}{self.desc}"


class OnnxParser:
    """Imports ONNX models into a ``NetworkDefinition``."""

    def __init__(self, network: Any, logger: Logger | None = None) -> None:
        self.network = network
        self.logger = logger or DEFAULT_LOGGER
        self.errors: list[ParserError] = []
        self._external = _ExternalData(None)  # the model being parsed: its external tensors' files

    # -- reference API --------------------------------------------------------------------------
    @property
    def num_errors(self) -> int:
        return len(self.errors)

    def get_error(self, index: int) -> ParserError:
        return self.errors[index]

    def clear_errors(self) -> None:
        self.errors.clear()

    def supports_operator(self, op_type: str, domain: str = "") -> bool:
        return get_op(op_type, domain) is not None

    def parse(self, model: bytes | onnx.ModelProto, path: str | None = None) -> bool:
        """Import a serialized model (or a ModelProto); ``path`` resolves external weights."""
        try:
            proto = model if isinstance(model, onnx.ModelProto) else onnx.load_model_from_string(bytes(model))
        except Exception as e:  # onnx raises DecodeError, ValueError, OSError, ...
            self._error(f"not a valid ONNX model: {e}")
            return False
        try:
            depth = _subgraph_depth(proto.graph)
            if depth > MAX_SUBGRAPH_DEPTH:
                raise ParseError(f"subgraphs (Loop/If/Scan bodies) nest {depth} levels deep; Kiln accepts at "
                                 f"most {MAX_SUBGRAPH_DEPTH}")
            self._external = _ExternalData(None if path is None else os.path.dirname(os.path.abspath(path)))
            for tensor in _all_tensors(proto.graph):
                self._external.check(tensor)
        except MemoryError:
            raise  # not a property of the model: the caller's memory limit (a build process's) says why
        except Exception as e:  # noqa: BLE001 - ParseError says why; anything else is a malformed field
            self._error(str(e) if isinstance(e, ParseError) else f"not a valid ONNX model: {e}")
            return False
        try:
            return self._import(proto)
        finally:
            self._external = _ExternalData(None)  # the maps live on in the weights, not in the parser

    def parse_from_file(self, path: str | os.PathLike) -> bool:
        path = os.fspath(path)
        try:
            with open(path, "rb") as f:
                proto = onnx.load_model_from_string(f.read())  # the file's bytes are freed before the import
        except OSError as e:
            self._error(f"cannot read {path}: {e.strerror}")
            return False
        except Exception as e:  # onnx raises DecodeError, ValueError, ...
            self._error(f"not a valid ONNX model: {e}")
            return False
        return self.parse(proto, path=path)

    # -- import -----------------------------------------------------------------------------------
    def _error(self, desc: str, index: int = -1, node: onnx.NodeProto | None = None) -> None:
        name = (node.name or f"{node.op_type}_{index}") if node else ""
        err = ParserError(desc, index, name, node.op_type if node else "")
        self.errors.append(err)
        self.logger.log(Severity.ERROR, f"ONNX import: {err}")

    def _import(self, model: onnx.ModelProto) -> bool:
        opsets = {(imp.domain if imp.domain != "ai.onnx" else ""): imp.version for imp in model.opset_import}
        opset = opsets.get("", MAX_OPSET)
        if not 1 <= opset <= MAX_OPSET:
            self._error(f"default-domain opset {opset} is not supported (Kiln accepts 1-{MAX_OPSET})")
            return False
        if model.functions:
            try:
                model = onnx.inliner.inline_local_functions(model)
            except Exception as e:
                self._error(f"cannot inline the model's local functions: {e}")
                return False
        start = len(self.errors)
        graph = self.import_graph(model.graph, opsets)
        if len(self.errors) > start:
            return False
        try:
            graph.toposort()
        except ValueError as e:
            self._error(str(e))
            return False
        self.network.graph = graph
        return True

    def import_graph(self, g: onnx.GraphProto, opsets: dict[str, int], outer: set[str] | None = None) -> Graph:
        """Convert one GraphProto (also used for Loop/If/Scan bodies, where ``outer`` names the
        tensors visible from enclosing graphs)."""
        graph = Graph(name=g.name or "network", opsets=dict(opsets))
        for init in g.initializer:
            try:
                graph.constants[init.name] = _to_array(init, self._external)
            except MemoryError:
                raise
            except Exception as e:  # noqa: BLE001 - dims that disagree with the data, unknown types, ...
                self._error(f"initializer '{init.name}': {e}")
        for sparse in g.sparse_initializer:
            try:
                graph.constants[sparse.values.name] = _sparse_to_dense(sparse, self._external)
            except Exception as e:  # noqa: BLE001 - as above
                self._error(f"sparse initializer '{sparse.values.name}': {e}")
        graph.inputs = [_value(v) for v in g.input if v.name not in graph.constants]
        graph.outputs = [_value(v) for v in g.output]
        visible = set(outer or ()) | set(graph.constants) | set(graph.input_names) | {""}
        for index, proto in enumerate(g.node):
            node = self._import_node(proto, index, graph, visible)
            if node is not None:
                graph.nodes.append(node)
            visible.update(proto.output)
        return graph

    def _import_node(self, proto: onnx.NodeProto, index: int, graph: Graph, visible: set[str]) -> Node | None:
        domain = proto.domain if proto.domain != "ai.onnx" else ""
        name = proto.name or f"{proto.op_type}_{index}"
        try:
            attrs = {a.name: self._attr_value(a, graph, visible) for a in proto.attribute}
        except Exception as e:
            self._error(f"bad attribute: {e}", index, proto)
            return None
        if domain == "" and proto.op_type == "Constant":
            try:
                graph.constants[proto.output[0]] = _constant_value(attrs)
            except ValueError as e:
                self._error(str(e), index, proto)
            return None
        op = get_op(proto.op_type, domain)
        if op is None:
            self._error(f"unsupported operator {domain + '::' if domain else ''}{proto.op_type}", index, proto)
            return None
        opset = graph.opsets.get(domain, 1)
        if opset < op.min_opset:
            self._error(f"{proto.op_type} is supported from opset {op.min_opset}, model uses {opset}", index, proto)
            return None
        if domain == "" and opset < MIN_OPSET and not _same_schema(proto.op_type, opset, MIN_OPSET):
            self._error(f"{proto.op_type} changed between opset {opset} and {MIN_OPSET}; Kiln implements "
                        f"opset >= {MIN_OPSET} semantics (convert the model with onnx.version_converter)", index, proto)
            return None
        node = Node(
            op_type=proto.op_type,
            inputs=list(proto.input),
            outputs=list(proto.output),
            attrs=attrs,
            name=name,
            domain=domain,
            opset=opset,
            origin=[name],
        )
        if op.normalize is not None:
            try:
                op.normalize(node, graph)
            except Exception as e:
                self._error(f"cannot import: {e}", index, proto)
                return None
        return node

    def _attr_value(self, attr: onnx.AttributeProto, graph: Graph, visible: set[str]) -> Any:
        A = onnx.AttributeProto
        if attr.ref_attr_name:
            raise ParseError(f"attribute '{attr.name}' refers to a function attribute outside a function")
        _check_attribute_size(attr)
        if attr.type == A.GRAPH:
            return self.import_graph(attr.g, graph.opsets, visible)
        if attr.type == A.GRAPHS:
            return [self.import_graph(g, graph.opsets, visible) for g in attr.graphs]
        if attr.type == A.TENSOR:
            return _to_array(attr.t, self._external)
        if attr.type == A.TENSORS:
            return [_to_array(t, self._external) for t in attr.tensors]
        if attr.type == A.SPARSE_TENSOR:
            return _sparse_to_dense(attr.sparse_tensor, self._external)
        if attr.type == A.STRING:
            return attr.s.decode("utf-8", errors="replace")
        if attr.type == A.STRINGS:
            return [s.decode("utf-8", errors="replace") for s in attr.strings]
        if attr.type == A.TYPE_PROTO:
            return attr.tp
        if attr.type == A.TYPE_PROTOS:
            return list(attr.type_protos)
        if attr.type == A.INTS:
            return [int(v) for v in attr.ints]
        if attr.type == A.FLOATS:
            return [float(v) for v in attr.floats]
        return onnx.helper.get_attribute_value(attr)


def _same_schema(op_type: str, old: int, new: int) -> bool:
    """True when the default-domain op has the same schema version at opsets ``old`` and ``new``."""
    try:
        return onnx.defs.get_schema(op_type, old).since_version == onnx.defs.get_schema(op_type, new).since_version
    except onnx.defs.SchemaError:
        return False


def _value(v: onnx.ValueInfoProto) -> Value:
    """Graph I/O: dtype and shape with ints, symbolic names (str) or None for unknown dims."""
    t = v.type
    if t.HasField("tensor_type"):
        tt = t.tensor_type
        dtype = onnx_to_np(tt.elem_type) if tt.elem_type else np.dtype(np.float32)
        shape = None
        if tt.HasField("shape"):
            shape = tuple(
                d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim
            )
        return Value(v.name, dtype, shape)
    for kind, field in (("sequence", "sequence_type"), ("optional", "optional_type"), ("map", "map_type")):
        if t.HasField(field):
            return Value(v.name, np.dtype(object), None, kind)
    return Value(v.name, np.dtype(np.float32), None)


def _check_attribute_size(attr: onnx.AttributeProto) -> None:
    """Refuse list and string attributes too large for any real model, before converting them to Python."""
    count = max(len(attr.ints), len(attr.floats), len(attr.strings), len(attr.tensors), len(attr.graphs),
                len(attr.sparse_tensors), len(attr.type_protos))
    if count > MAX_ATTRIBUTE_ELEMENTS:
        raise ParseError(f"attribute '{attr.name}' has {count} entries; Kiln accepts at most {MAX_ATTRIBUTE_ELEMENTS} "
                         "(store large values as tensors)")
    size = max([len(attr.s), *(len(s) for s in attr.strings)])
    if size > MAX_ATTRIBUTE_STRING_BYTES:
        raise ParseError(f"attribute '{attr.name}' holds a string of {size} bytes; Kiln accepts at most "
                         f"{MAX_ATTRIBUTE_STRING_BYTES}")


def _declared_bytes(dims: Any, elem_type: int) -> int:
    """Bytes a tensor of these dims takes once materialized (Python ints: hostile dims must not overflow)."""
    count = 1
    for d in dims:
        if d < 0:
            raise ParseError(f"negative dimension {d} in {list(dims)}")
        count *= int(d)
    itemsize = onnx_to_np(elem_type).itemsize if elem_type else 1
    return count * max(itemsize, 1)


def _check_tensor_size(name: str, dims: Any, elem_type: int, what: str = "tensor") -> int:
    size = _declared_bytes(dims, elem_type)
    if size > max_constant_bytes():
        raise ParseError(f"{what} '{name}' of shape {list(dims)} would take {size} bytes, over Kiln's limit of "
                         f"{max_constant_bytes()} bytes for one constant (KILN_MAX_CONSTANT_BYTES)")
    return size


def _to_array(tensor: onnx.TensorProto, external: _ExternalData) -> np.ndarray:
    _check_tensor_size(tensor.name, tensor.dims, tensor.data_type)
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        return external.array(tensor)
    return numpy_helper.to_array(tensor)


def _subgraph_depth(graph: onnx.GraphProto) -> int:
    """How many levels of bodies (graph attributes) `graph` contains; 0 for none."""
    depth = 0
    for node in graph.node:
        for attr in node.attribute:
            for body in [attr.g] if attr.HasField("g") else list(attr.graphs):
                depth = max(depth, 1 + _subgraph_depth(body))
    return depth


def _all_tensors(graph: onnx.GraphProto) -> Any:
    """Every TensorProto of `graph` and its bodies: initializers, sparse values/indices, tensor attributes."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield from (sparse.values, sparse.indices)
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            for sparse in [attr.sparse_tensor] if attr.HasField("sparse_tensor") else []:
                yield from (sparse.values, sparse.indices)
            for sparse in attr.sparse_tensors:
                yield from (sparse.values, sparse.indices)
            for body in [attr.g] if attr.HasField("g") else list(attr.graphs):
                yield from _all_tensors(body)


#: ONNX types whose external bytes are not one numpy element each (packed 4/2/6-bit): unpacked, so copied.
_PACKED_TYPES = frozenset({onnx.TensorProto.INT4, onnx.TensorProto.UINT4, onnx.TensorProto.FLOAT4E2M1,
                           onnx.TensorProto.INT2, onnx.TensorProto.UINT2, onnx.TensorProto.FLOAT6E2M3,
                           onnx.TensorProto.FLOAT6E3M2})


class _ExternalData:
    """The external tensors of one model, confined to `base_dir` (the model file's directory).

    A tensor becomes a read-only view of a memory map of its file: the weights stay in the page cache instead of
    being read into the model and copied again into arrays, so a model whose weights are several GB imports in
    little more than its graph. Packed types, misaligned offsets and big-endian hosts read (copy) the bytes.
    Locations that resolve outside the directory (absolute paths, '..', links pointing out) are refused, and
    so is external data altogether when the model came without a path: relative locations would otherwise
    resolve against the cwd. A file truncated while its map is in use ends the process (SIGBUS): replace
    weight files by renaming, as exporters do.
    """

    def __init__(self, base_dir: str | None) -> None:
        self.base_dir = base_dir
        self._maps: dict[str, mmap.mmap | None] = {}  # real path -> its map (None: read, not mapped)

    def check(self, tensor: onnx.TensorProto) -> None:
        """Refuse an external tensor that could not load (before the import: the error names the tensor)."""
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            self._locate(tensor)

    def array(self, tensor: onnx.TensorProto) -> np.ndarray:
        """The tensor's values: a read-only view of its file's map, or an array of its bytes where one cannot be."""
        location, target, offset, size = self._locate(tensor)
        dtype = onnx_to_np(tensor.data_type)
        view = self._map(target) if _mappable(tensor.data_type, offset, size) else None
        if view is not None:
            array = np.frombuffer(view, dtype=dtype, count=size // dtype.itemsize, offset=offset)
            return array.reshape(tuple(tensor.dims))
        loaded = onnx.TensorProto()
        loaded.CopyFrom(tensor)  # header only (the data is elsewhere); the caller's model stays as it was
        del loaded.external_data[:]
        loaded.data_location = onnx.TensorProto.DEFAULT
        loaded.raw_data = _read(target, offset, size, tensor.name, location)
        return numpy_helper.to_array(loaded)

    def _locate(self, tensor: onnx.TensorProto) -> tuple[str, str, int, int]:
        """(location, confined real path, offset, bytes) of an external tensor; ParseError when it cannot load."""
        info = ExternalDataInfo(tensor)
        if self.base_dir is None:
            raise ParseError(f"tensor '{tensor.name}' keeps its data in the external file '{info.location}'; "
                             "parse the model from its file (parse_from_file, or parse(..., path=))")
        size = _check_tensor_size(tensor.name, tensor.dims, tensor.data_type, "external tensor")
        if info.length and info.length != size:
            raise ParseError(f"external tensor '{tensor.name}' declares {info.length} bytes, its shape "
                             f"{list(tensor.dims)} needs {size}")
        offset = info.offset or 0
        target = _confined(self.base_dir, info.location, tensor.name)
        try:
            held = max(os.stat(target).st_size - offset, 0)
        except OSError as e:
            raise ParseError(f"external tensor '{tensor.name}': cannot read '{info.location}': {e.strerror}") from None
        if held < size:
            raise ParseError(f"external tensor '{tensor.name}': '{info.location}' holds {held} bytes from offset "
                             f"{offset}, the tensor needs {size}")
        return info.location, target, offset, size

    def _map(self, target: str) -> mmap.mmap | None:
        """`target`'s read-only map, made once per file; None where the file cannot be mapped (then it is read)."""
        if target not in self._maps:
            self._maps[target] = _map_file(target) if len(self._maps) < _max_mapped_files() else None
        return self._maps[target]


def _max_mapped_files() -> int:
    """Files one model maps at most. Before Python 3.13 each map holds a duplicate of its file's descriptor while
    the weights live: a quarter of the process's descriptors, the rest left to its sockets and files."""
    if sys.version_info >= (3, 13):
        return sys.maxsize
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 256
    return sys.maxsize if soft == resource.RLIM_INFINITY else soft // 4


def _mappable(data_type: int, offset: int, size: int) -> bool:
    """Whether the tensor's bytes are its numpy array as they lie in the file (so a view of the map can be it)."""
    itemsize = onnx_to_np(data_type).itemsize
    return (size > 0 and data_type not in _PACKED_TYPES and data_type != onnx.TensorProto.STRING
            and sys.byteorder == "little" and offset % max(itemsize, 1) == 0)


def _map_file(target: str) -> mmap.mmap | None:
    options = {"trackfd": False} if sys.version_info >= (3, 13) else {}  # no descriptor held per map
    try:
        with open(target, "rb") as handle:
            return mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ, **options)
    except (OSError, ValueError):  # a file system without mmap, an empty file: read instead
        return None


def _confined(base_dir: str, location: str, name: str) -> str:
    """The real path of `location` under `base_dir`; ParseError when it resolves outside the directory."""
    root = os.path.realpath(base_dir)
    target = os.path.realpath(os.path.join(root, location))
    if os.path.isabs(location) or os.path.commonpath([root, target]) != root:
        raise ParseError(f"external tensor '{name}': location '{location}' is outside the model's directory")
    return target


def _read(target: str, offset: int, size: int, name: str, location: str) -> bytes:
    try:
        with open(target, "rb") as handle:
            handle.seek(offset)
            data = handle.read(size)
    except OSError as e:
        raise ParseError(f"external tensor '{name}': cannot read '{location}': {e.strerror}") from None
    if len(data) != size:
        raise ParseError(f"external tensor '{name}': '{location}' holds {len(data)} bytes from offset {offset}, "
                         f"the tensor needs {size}")
    return data


def _sparse_to_dense(sparse: onnx.SparseTensorProto, external: _ExternalData) -> np.ndarray:
    _check_tensor_size(sparse.values.name, sparse.dims, sparse.values.data_type, "sparse tensor")
    values = _to_array(sparse.values, external)
    indices = _to_array(sparse.indices, external).astype(np.int64)
    dims = tuple(sparse.dims)
    dense = np.zeros(dims, dtype=values.dtype)
    if indices.ndim == 1:
        dense.reshape(-1)[indices] = values
    else:
        dense[tuple(indices.T)] = values
    return dense


def _constant_value(attrs: dict[str, Any]) -> np.ndarray:
    """The tensor a Constant node produces, from whichever value attribute it carries."""
    if "value" in attrs:
        return np.asarray(attrs["value"])
    if "sparse_value" in attrs:
        return np.asarray(attrs["sparse_value"])
    forms = {
        "value_float": np.float32,
        "value_floats": np.float32,
        "value_int": np.int64,
        "value_ints": np.int64,
        "value_string": object,
        "value_strings": object,
    }
    for key, dtype in forms.items():
        if key in attrs:
            value = attrs[key]
            if dtype is object:
                value = [s.encode() if isinstance(s, str) else s for s in np.atleast_1d(value)]
                return np.array(value if key.endswith("s") else value[0], dtype=object)
            return np.array(value, dtype=dtype)
    raise ValueError(f"Constant node has no value attribute (has {sorted(attrs)})")
