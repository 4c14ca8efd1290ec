"""Plan files: the serialized, versioned result of a build.

Layout (little endian)::

    offset 0   magic            8 bytes  b"KILNPLAN"
           8   format version   u32
          12   flags            u32      (reserved, 0)
          16   metadata length  u64
          24   blob length      u64
          32   sha256           32 bytes over everything after the header
          64   metadata         JSON, utf-8 (engine version, backend, arch, I/O, profiles, layers)
               padding          to a 64-byte boundary
               blob             weights and compiled kernels, each 64-byte aligned

Every read checks the magic, the format version, the lengths and the digest before anything is
interpreted, so a truncated or corrupt file is refused with a message and never executed. Then the
Kiln version that reads it must be one the plan allows (``engine_core.compat``: same major.minor,
or for ``BuilderFlag.VERSION_COMPATIBLE`` plans the builder's version up to the next major); the
device check for CUDA plans follows in the runtime. Compatibility facts live in the metadata
(``build_info["compatibility"]``), which the digest covers, so they need no header change: plans
without them are read as level NONE, not version-compatible — the rules they were built under.

Each I/O entry carries its tensor ``format`` (``TensorFormat`` name, "LINEAR" when absent).
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine_core import compat
from engine_core.errors import PlanFormatError
from engine_core.ir import Graph, Node, Value
from engine_core.types import TensorFormat, TensorIOMode, dtype_from_name, dtype_name
from engine_core.version import PLAN_FORMAT_VERSION, __version__

MAGIC = b"KILNPLAN"
_HEADER = struct.Struct("<8sIIQQ32s")
ALIGN = 64


@dataclass
class IOTensor:
    """One engine input or output, with reference-style dims (-1 = dynamic)."""

    name: str
    mode: TensorIOMode
    dtype: np.dtype
    shape: tuple[int, ...]
    kind: str = "tensor"
    #: memory layout (a ``TensorFormat`` name); every plan's I/O is LINEAR today
    format: str = "LINEAR"


@dataclass
class Plan:
    """Everything a backend needs to run a built network."""

    name: str
    backend: str
    graph: Graph
    io: list[IOTensor]
    #: one dict per optimization profile: input name -> (min, opt, max)
    profiles: list[dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]]
    #: one dict per profile: shape-tensor input name -> (min, opt, max) values
    profile_values: list[dict[str, tuple[tuple[int, ...], ...]]] = field(default_factory=list)
    arch: str = "any"
    device_memory_size: int = 0
    #: per-layer records for the inspector (name, type, tactic, origin, ...), same order as graph.nodes
    layers: list[dict[str, Any]] = field(default_factory=list)
    #: build facts: flags, precision, passes run, build seconds
    build_info: dict[str, Any] = field(default_factory=dict)
    #: compiled device code by name (CUBIN for the CUDA backend)
    kernels: dict[str, bytes] = field(default_factory=dict)
    engine_version: str = __version__

    def compat_meta(self) -> dict[str, Any]:
        """The metadata keys engine_core.compat reads (as ``read_plan_metadata`` returns them)."""
        return {"engine_version": self.engine_version, "backend": self.backend, "arch": self.arch,
                "build_info": self.build_info}


class _Blob:
    """Collects aligned binary sections while metadata is written: views of the arrays, not copies, so that
    serializing a plan holds its weights twice at most (the network's and the plan's), never four times."""

    def __init__(self) -> None:
        self.parts: list[bytes | memoryview] = []
        self.size = 0

    def add(self, data: bytes | memoryview) -> dict[str, int]:
        pad = (-self.size) % ALIGN
        if pad:
            self.parts.append(b"\0" * pad)
            self.size += pad
        ref = {"offset": self.size, "nbytes": len(data)}
        self.parts.append(data)
        self.size += len(data)
        return ref


def _encode_array(a: np.ndarray, blob: _Blob) -> dict[str, Any]:
    a = np.asarray(a)
    if a.dtype.kind in "OSU":
        items = [x.decode("latin-1") if isinstance(x, bytes) else str(x) for x in a.reshape(-1)]
        kinds = ["b" if isinstance(x, bytes) else "s" for x in a.reshape(-1)]
        return {"dtype": "object", "shape": list(a.shape), "items": items, "kinds": kinds}
    data = np.ascontiguousarray(a).reshape(-1).view(np.uint8)  # bytes as a view: ml_dtypes have no buffer format
    return {"dtype": dtype_name(a.dtype), "shape": list(a.shape), **blob.add(memoryview(data))}


def _decode_array(meta: dict[str, Any], blob: memoryview) -> np.ndarray:
    shape = tuple(meta["shape"])
    if meta["dtype"] == "object":
        items = [s.encode("latin-1") if k == "b" else s for s, k in zip(meta["items"], meta["kinds"])]
        out = np.empty(len(items), dtype=object)
        out[:] = items
        return out.reshape(shape)
    dtype = dtype_from_name(meta["dtype"])
    start, nbytes = meta["offset"], meta["nbytes"]
    if start + nbytes > len(blob) or nbytes != int(np.prod(shape)) * dtype.itemsize:
        raise PlanFormatError("plan weight section is out of bounds or inconsistent")
    return np.frombuffer(blob[start : start + nbytes], dtype=dtype).reshape(shape)


def _encode_attr(value: Any, blob: _Blob) -> Any:
    if isinstance(value, np.ndarray):
        return {"__tensor__": _encode_array(value, blob)}
    if isinstance(value, Graph):
        return {"__graph__": _encode_graph(value, blob)}
    if isinstance(value, bytes):
        return {"__bytes__": base64.b64encode(value).decode()}
    if isinstance(value, (list, tuple)):
        return [_encode_attr(v, blob) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if hasattr(value, "SerializeToString"):  # TypeProto attributes
        return {"__proto__": type(value).__name__, "data": base64.b64encode(value.SerializeToString()).decode()}
    return value


def _decode_attr(value: Any, blob: memoryview) -> Any:
    if isinstance(value, list):
        return [_decode_attr(v, blob) for v in value]
    if isinstance(value, dict):
        if "__tensor__" in value:
            return _decode_array(value["__tensor__"], blob)
        if "__graph__" in value:
            return _decode_graph(value["__graph__"], blob)
        if "__bytes__" in value:
            return base64.b64decode(value["__bytes__"])
        if "__proto__" in value:
            import onnx

            proto = getattr(onnx, value["__proto__"])()
            proto.ParseFromString(base64.b64decode(value["data"]))
            return proto
    return value


def _encode_value(v: Value) -> dict[str, Any]:
    return {"name": v.name, "dtype": dtype_name(v.dtype), "shape": None if v.shape is None else list(v.shape),
            "kind": v.kind}


def _encode_graph(g: Graph, blob: _Blob) -> dict[str, Any]:
    return {
        "name": g.name,
        "opsets": g.opsets,
        "inputs": [_encode_value(v) for v in g.inputs],
        "outputs": [_encode_value(v) for v in g.outputs],
        "constants": {k: _encode_array(v, blob) for k, v in g.constants.items()},
        "nodes": [
            {
                "op_type": n.op_type,
                "domain": n.domain,
                "name": n.name,
                "opset": n.opset,
                "inputs": n.inputs,
                "outputs": n.outputs,
                "origin": n.origin,
                "attrs": {k: _encode_attr(v, blob) for k, v in n.attrs.items()},
            }
            for n in g.nodes
        ],
    }


def _decode_graph(d: dict[str, Any], blob: memoryview) -> Graph:
    def value(v: dict[str, Any]) -> Value:
        shape = None if v["shape"] is None else tuple(v["shape"])
        return Value(v["name"], dtype_from_name(v["dtype"]), shape, v.get("kind", "tensor"))

    return Graph(
        name=d["name"],
        opsets=d["opsets"],
        inputs=[value(v) for v in d["inputs"]],
        outputs=[value(v) for v in d["outputs"]],
        constants={k: _decode_array(v, blob) for k, v in d["constants"].items()},
        nodes=[
            Node(n["op_type"], n["inputs"], n["outputs"], {k: _decode_attr(v, blob) for k, v in n["attrs"].items()},
                 n["name"], n["domain"], n["opset"], n["origin"])
            for n in d["nodes"]
        ],
    )


def serialize_plan(plan: Plan) -> bytes:
    blob = _Blob()
    meta = {
        "engine_version": plan.engine_version,
        "name": plan.name,
        "backend": plan.backend,
        "arch": plan.arch,
        "device_memory_size": plan.device_memory_size,
        "io": [{"name": t.name, "mode": t.mode.name, "dtype": dtype_name(t.dtype), "shape": list(t.shape),
                "kind": t.kind, "format": t.format} for t in plan.io],
        "profiles": [{k: [list(s) for s in v] for k, v in p.items()} for p in plan.profiles],
        "profile_values": [{k: [list(s) for s in v] for k, v in p.items()} for p in plan.profile_values],
        "layers": plan.layers,
        "build_info": plan.build_info,
        "graph": _encode_graph(plan.graph, blob),
        "kernels": {k: blob.add(v) for k, v in plan.kernels.items()},
    }
    meta_bytes = json.dumps(meta, separators=(",", ":")).encode()
    body_pad = b"\0" * ((-(_HEADER.size + len(meta_bytes))) % ALIGN)
    digest = hashlib.sha256(meta_bytes + body_pad)
    for part in blob.parts:
        digest.update(part)
    header = _HEADER.pack(MAGIC, PLAN_FORMAT_VERSION, 0, len(meta_bytes), blob.size, digest.digest())
    return b"".join([header, meta_bytes, body_pad, *blob.parts])


def read_plan_metadata(data: bytes | bytearray | memoryview,
                       check_version: bool = True) -> tuple[dict[str, Any], memoryview]:
    """Validate a plan's framing and digest (and, unless ``check_version`` is False, that this Kiln
    may run it); return its metadata and blob. Raises PlanFormatError.

    ``kiln inspect`` reads with ``check_version=False`` to show what a plan from another version needs.
    """
    view = memoryview(data).cast("B")
    if len(view) < _HEADER.size:
        raise PlanFormatError(f"not a Kiln plan: {len(view)} bytes is shorter than the plan header")
    magic, version, _flags, meta_len, blob_len, digest = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise PlanFormatError("not a Kiln plan (bad magic); was it built by Kiln?")
    if _flags != 0:  # reserved; not covered by the checksum, so anything else is damage
        raise PlanFormatError(f"plan header has unknown flags {_flags:#x}; the file is corrupt or from a newer Kiln")
    if version != PLAN_FORMAT_VERSION:
        raise PlanFormatError(f"plan format version {version} is not supported (this Kiln reads {PLAN_FORMAT_VERSION}); rebuild it")
    meta_end = _HEADER.size + meta_len
    blob_start = meta_end + (-meta_end) % ALIGN
    if blob_start + blob_len != len(view):
        raise PlanFormatError(f"plan is truncated or has trailing data: expected {blob_start + blob_len} bytes, got {len(view)}")
    meta_bytes = view[_HEADER.size : meta_end]
    blob = view[blob_start:]
    if hashlib.sha256(view[_HEADER.size :]).digest() != digest:
        raise PlanFormatError("plan checksum mismatch: the file is corrupt")
    try:
        meta = json.loads(bytes(meta_bytes))
    except ValueError as e:
        raise PlanFormatError(f"plan metadata is not valid JSON: {e}") from None
    if not isinstance(meta, dict):
        raise PlanFormatError("plan metadata is malformed: not a JSON object")
    reason = compat.check_version(meta, __version__) if check_version else None
    if reason:
        raise PlanFormatError(reason)
    return meta, blob


def deserialize_plan(data: bytes | bytearray | memoryview, check_version: bool = True) -> Plan:
    meta, blob = read_plan_metadata(data, check_version)
    try:
        return Plan(
            name=meta["name"],
            backend=meta["backend"],
            arch=meta["arch"],
            device_memory_size=meta["device_memory_size"],
            graph=_decode_graph(meta["graph"], blob),
            io=[IOTensor(t["name"], TensorIOMode[t["mode"]], dtype_from_name(t["dtype"]), tuple(t["shape"]),
                         t.get("kind", "tensor"), _tensor_format(t.get("format", "LINEAR"))) for t in meta["io"]],
            profiles=[{k: tuple(tuple(s) for s in v) for k, v in p.items()} for p in meta["profiles"]],
            profile_values=[{k: tuple(tuple(s) for s in v) for k, v in p.items()} for p in meta["profile_values"]],
            layers=meta["layers"],
            build_info=meta["build_info"],
            kernels={k: bytes(blob[r["offset"] : r["offset"] + r["nbytes"]]) for k, r in meta["kernels"].items()},
            engine_version=meta["engine_version"],
        )
    except PlanFormatError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # any shape of damaged JSON
        raise PlanFormatError(f"plan metadata is malformed: {type(e).__name__}: {e}") from None


def _tensor_format(name: Any) -> str:
    if name not in TensorFormat.__members__:
        raise PlanFormatError(f"plan I/O tensor has unknown format {name!r}")
    return str(name)
