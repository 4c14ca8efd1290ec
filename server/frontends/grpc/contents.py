"""Typed tensor data (`InferTensorContents`) -> numpy; the gRPC-only form of tensor data.

Raw bytes (`raw_input_contents` / `raw_output_contents`) use the core's codec (`server.core.tensors`), shared
with the HTTP binary extension and shared memory. FP16 and BF16 have no typed field, so they travel only raw.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from server.core.errors import invalid
from server.core.tensors import element_count
from server.core.types import numpy_dtype
from server.protos import grpc_service_pb2 as pb

# The `InferTensorContents` field that carries each datatype's typed form.
CONTENTS_FIELDS: dict[str, str] = {
    "BOOL": "bool_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}

# The numpy type each typed field's values arrive in, before narrowing to the tensor's datatype.
_WIDE_DTYPES: dict[str, type] = {
    "bool_contents": np.bool_,
    "int_contents": np.int64,
    "int64_contents": np.int64,
    "uint_contents": np.uint64,
    "uint64_contents": np.uint64,
    "fp32_contents": np.float32,
    "fp64_contents": np.float64,
}


def has_data(contents: pb.InferTensorContents) -> bool:
    """Whether any typed field holds values."""
    return bool(contents.ListFields())


def from_contents(contents: pb.InferTensorContents, datatype: str, shape: Sequence[int]) -> np.ndarray:
    """Decode typed `contents`; values out of the datatype's range are refused, not wrapped."""
    dtype = numpy_dtype(datatype)
    field = CONTENTS_FIELDS.get(datatype)
    if field is None:
        raise invalid(f"{datatype} data must be sent as raw_input_contents (it has no typed contents field)")
    stray = [f.name for f, _ in contents.ListFields() if f.name != field]
    if stray:
        raise invalid(f"{datatype} data belongs in contents.{field}, not in {', '.join(stray)}")
    values = getattr(contents, field)
    count = element_count(shape)
    if len(values) != count:
        raise invalid(f"expected {count} values in contents.{field} for shape {list(shape)}, got {len(values)}")
    if datatype == "BYTES":
        array = np.empty(count, dtype=np.object_)
        array[:] = list(values)
        return array.reshape(shape)
    wide = np.fromiter(values, dtype=_WIDE_DTYPES[field], count=count)
    if dtype.kind in "iu" and count and wide.dtype != dtype:
        info = np.iinfo(dtype)
        if wide.min() < info.min or wide.max() > info.max:
            raise invalid(f"contents.{field} has values outside the range of {datatype}")
    return wide.astype(dtype, copy=False).reshape(shape)
