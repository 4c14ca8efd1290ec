"""Raw tensor bytes <-> numpy, in the layout Triton uses for binary data, shared memory and gRPC raw contents.

Elements are flattened row-major little-endian; BOOL is one byte per element; each BYTES element is a
4-byte little-endian length followed by its bytes. Frontends and the shared-memory code all use these two
functions, so every path decodes the same way.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

from .errors import invalid
from .types import numpy_dtype

_LENGTH = struct.Struct("<I")


def element_count(shape: Sequence[int]) -> int:
    """Number of elements of `shape`; negative dims are a client error."""
    count = 1
    for d in shape:
        d = int(d)  # exact Python ints: int64 products of hostile shapes wrap
        if d < 0:
            raise invalid(f"shape {list(shape)} has a negative dimension")
        count *= d
    return count


def serialize_bytes(array: np.ndarray) -> bytes:
    """BYTES elements (bytes or str) as length-prefixed bytes."""
    parts: list[bytes] = []
    for item in array.reshape(-1):
        data = item.encode() if isinstance(item, str) else bytes(item)
        parts.append(_LENGTH.pack(len(data)))
        parts.append(data)
    return b"".join(parts)


def deserialize_bytes(raw: bytes | memoryview, count: int) -> np.ndarray:
    """Length-prefixed bytes as an object array of `count` elements; the buffer must be used up exactly."""
    view = memoryview(raw)
    if count * 4 > len(view):  # checked before allocating: a huge claimed shape must not exhaust memory
        raise invalid(f"BYTES data of {len(view)} bytes cannot hold {count} elements (4-byte length each)")
    items = np.empty(count, dtype=np.object_)
    offset = 0
    for i in range(count):
        if offset + 4 > len(view):
            raise invalid(f"BYTES data ends after {i} of {count} elements")
        (length,) = _LENGTH.unpack_from(view, offset)
        offset += 4
        if offset + length > len(view):
            raise invalid(f"BYTES element {i} claims {length} bytes, only {len(view) - offset} remain")
        items[i] = bytes(view[offset:offset + length])
        offset += length
    if offset != len(view):
        raise invalid(f"BYTES data has {len(view) - offset} bytes after its {count} elements")
    return items


def from_raw(raw: bytes | memoryview, datatype: str, shape: Sequence[int]) -> np.ndarray:
    """Decode raw bytes of a tensor; INVALID_ARGUMENT when the size does not match datatype and shape."""
    count = element_count(shape)
    shape = tuple(map(int, shape))
    if datatype == "BYTES":
        return deserialize_bytes(raw, count).reshape(shape)
    dtype = numpy_dtype(datatype)
    if len(raw) != count * dtype.itemsize:
        raise invalid(f"expected {count * dtype.itemsize} bytes for {datatype} {list(shape)}, got {len(raw)}")
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def to_raw(array: np.ndarray, datatype: str) -> bytes:
    """Encode a tensor as raw bytes (the inverse of `from_raw`)."""
    if datatype == "BYTES":
        return serialize_bytes(array)
    return np.ascontiguousarray(array, dtype=numpy_dtype(datatype)).tobytes()


def raw_size(array: np.ndarray, datatype: str) -> int:
    """Bytes `to_raw` would produce, without producing them for fixed-size types."""
    if datatype == "BYTES":
        return sum(4 + len(x.encode() if isinstance(x, str) else bytes(x)) for x in array.reshape(-1))
    return int(array.size) * numpy_dtype(datatype).itemsize
