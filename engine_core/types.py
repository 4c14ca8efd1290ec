"""Enums and dtype tables shared by the builder, the runtime and the server.

Names follow the reference API (DataType, TensorIOMode, BuilderFlag, MemoryPoolType, ...) so that
code written against it reads the same against Kiln.
"""

from __future__ import annotations

import enum

import ml_dtypes
import numpy as np
from onnx import TensorProto


class DataType(enum.IntEnum):
    """Element types of engine tensors (reference values first, then the extra ONNX ones)."""

    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    UINT8 = 5
    FP8 = 6
    BF16 = 7
    INT64 = 8
    INT4 = 9
    FP4 = 10
    DOUBLE = 100
    INT16 = 101
    UINT16 = 102
    UINT32 = 103
    UINT64 = 104
    STRING = 105

    @property
    def itemsize(self) -> int:
        return np.dtype(nptype(self)).itemsize


_NP_OF_DT: dict[DataType, np.dtype] = {
    DataType.FLOAT: np.dtype(np.float32),
    DataType.HALF: np.dtype(np.float16),
    DataType.INT8: np.dtype(np.int8),
    DataType.INT32: np.dtype(np.int32),
    DataType.BOOL: np.dtype(np.bool_),
    DataType.UINT8: np.dtype(np.uint8),
    DataType.FP8: np.dtype(ml_dtypes.float8_e4m3fn),
    DataType.BF16: np.dtype(ml_dtypes.bfloat16),
    DataType.INT64: np.dtype(np.int64),
    DataType.INT4: np.dtype(ml_dtypes.int4),
    DataType.FP4: np.dtype(ml_dtypes.float4_e2m1fn),
    DataType.DOUBLE: np.dtype(np.float64),
    DataType.INT16: np.dtype(np.int16),
    DataType.UINT16: np.dtype(np.uint16),
    DataType.UINT32: np.dtype(np.uint32),
    DataType.UINT64: np.dtype(np.uint64),
    DataType.STRING: np.dtype(object),
}
_DT_OF_NP: dict[np.dtype, DataType] = {v: k for k, v in _NP_OF_DT.items()}


def nptype(dt: DataType) -> type:
    """The numpy scalar type of a DataType (like the reference's ``trt.nptype``)."""
    return _NP_OF_DT[DataType(dt)].type


def datatype_of(dtype: np.dtype | type) -> DataType:
    """The DataType of a numpy dtype; strings and bytes map to STRING."""
    dtype = np.dtype(dtype)
    if dtype.kind in "OSU":
        return DataType.STRING
    try:
        return _DT_OF_NP[dtype]
    except KeyError:
        raise TypeError(f"no Kiln DataType for numpy dtype {dtype}") from None


def onnx_to_np(elem_type: int) -> np.dtype:
    """numpy dtype of an ONNX TensorProto element type (float8/bfloat16/int4 via ml_dtypes)."""
    from onnx.helper import tensor_dtype_to_np_dtype

    if elem_type == TensorProto.STRING:
        return np.dtype(object)
    return np.dtype(tensor_dtype_to_np_dtype(elem_type))


def np_to_onnx(dtype: np.dtype) -> int:
    """ONNX TensorProto element type of a numpy dtype."""
    from onnx.helper import np_dtype_to_tensor_dtype

    dtype = np.dtype(dtype)
    if dtype.kind in "OSU":
        return TensorProto.STRING
    return int(np_dtype_to_tensor_dtype(dtype))


def dtype_name(dtype: np.dtype) -> str:
    """Stable string for a numpy dtype, used in plan files ("float32", "bfloat16", "object")."""
    dtype = np.dtype(dtype)
    return "object" if dtype.kind in "OSU" else dtype.name


def dtype_from_name(name: str) -> np.dtype:
    """Inverse of :func:`dtype_name`, covering the ml_dtypes types."""
    if name == "object":
        return np.dtype(object)
    if hasattr(ml_dtypes, name):
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


class TensorIOMode(enum.IntEnum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


class TensorLocation(enum.IntEnum):
    DEVICE = 0
    HOST = 1


class BuilderFlag(enum.IntEnum):
    """Builder switches; the names and meanings are the reference's."""

    FP16 = 0
    BF16 = 1
    INT8 = 2
    FP8 = 3
    TF32 = 4
    REFIT = 5
    DEBUG = 6
    STRICT_TYPES = 7
    STRONGLY_TYPED = 8
    OBEY_PRECISION_CONSTRAINTS = 9
    PREFER_PRECISION_CONSTRAINTS = 10
    SPARSE_WEIGHTS = 11
    VERSION_COMPATIBLE = 12
    WEIGHT_STREAMING = 13
    DIRECT_IO = 14
    DISABLE_TIMING_CACHE = 15


class MemoryPoolType(enum.IntEnum):
    WORKSPACE = 0
    DLA_MANAGED_SRAM = 1
    DLA_LOCAL_DRAM = 2
    DLA_GLOBAL_DRAM = 3
    TACTIC_DRAM = 4
    TACTIC_SHARED_MEMORY = 5


class ExecutionContextAllocationStrategy(enum.IntEnum):
    STATIC = 0
    ON_PROFILE_CHANGE = 1
    USER_MANAGED = 2


class NetworkDefinitionCreationFlag(enum.IntEnum):
    EXPLICIT_BATCH = 0
    STRONGLY_TYPED = 1


class ProfilingVerbosity(enum.IntEnum):
    LAYER_NAMES_ONLY = 0
    NONE = 1
    DETAILED = 2


class LayerInformationFormat(enum.IntEnum):
    ONELINE = 0
    JSON = 1


class HardwareCompatibilityLevel(enum.IntEnum):
    """Which GPUs a plan may run on besides the build GPU's compute capability (reference values).

    NONE: the build GPU's compute capability only. AMPERE_PLUS: any GPU of compute capability 8.0 or
    later (the plan must then carry code every such GPU can load). SAME_COMPUTE_CAPABILITY: any GPU
    of the build GPU's compute capability, without the warning about a different GPU model.
    """

    NONE = 0
    AMPERE_PLUS = 1
    SAME_COMPUTE_CAPABILITY = 2


class TempfileControlFlag(enum.IntEnum):
    """Bit offsets of ``Runtime.tempfile_control_flags`` (``flags |= 1 << int(flag)``)."""

    ALLOW_IN_MEMORY_FILES = 0
    ALLOW_TEMPORARY_FILES = 1


class TensorFormat(enum.IntEnum):
    """Memory layouts of engine I/O tensors (reference values); Kiln plans use LINEAR today."""

    LINEAR = 0
    CHW2 = 1
    HWC8 = 2
    CHW4 = 3
    CHW16 = 4
    CHW32 = 5
    DHWC8 = 6
    CDHW32 = 7
    HWC = 8
    DLA_LINEAR = 9
    DLA_HWC4 = 10
    HWC16 = 11
    DHWC = 12


class EngineCapability(enum.IntEnum):
    STANDARD = 0
    SAFETY = 1
    DLA_STANDALONE = 2


class SerializationFlag(enum.IntEnum):
    """``ISerializationConfig`` flags (bit offsets)."""

    EXCLUDE_WEIGHTS = 0
    EXCLUDE_LEAN_RUNTIME = 1
    INCLUDE_REFIT = 2
