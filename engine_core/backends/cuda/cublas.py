"""cuBLAS through ctypes (the nvidia-cublas wheel's libcublas): strided-batched GEMM in fp32, TF32,
fp16 and bf16 (fp32 accumulation for every type).

Why ctypes: the wheel ships the library, and one entry point (cublasGemmStridedBatchedEx) is all the
runner needs; nvmath-python would add a dependency for the same call.
"""

from __future__ import annotations

import ctypes
from functools import cache

import numpy as np

from engine_core.backends.cuda import cublaslt
from engine_core.backends.cuda.libraries import load_wheel_library
from engine_core.cuda.driver import CudaError

_OP_N, _OP_T = 0, 1
WORKSPACE_BYTES = 32 << 20
#: numpy dtype name -> cudaDataType
_CUDA_TYPES = {"float32": 0, "float16": 2, "bfloat16": 14}
_COMPUTE_32F, _COMPUTE_32F_FAST_TF32 = 68, 77
_GEMM_DEFAULT = -1


@cache
def library() -> ctypes.CDLL:
    """libcublas, loaded after libcublasLt (which it needs)."""
    cublaslt.library()
    return load_wheel_library("cublas")


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CudaError(f"{what} failed with cuBLAS status {status}")


class Cublas:
    """One cuBLAS handle (per execution context: handles are not thread-safe across streams)."""

    def __init__(self) -> None:
        lib = library()
        self.lib = lib
        self.handle = ctypes.c_void_p()
        _check(lib.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate")
        c = ctypes
        lib.cublasGemmStridedBatchedEx.argtypes = [
            c.c_void_p, c.c_int, c.c_int, c.c_int, c.c_int, c.c_int, c.c_void_p,
            c.c_void_p, c.c_int, c.c_int, c.c_longlong, c.c_void_p, c.c_int, c.c_int, c.c_longlong,
            c.c_void_p, c.c_void_p, c.c_int, c.c_int, c.c_longlong, c.c_int, c.c_int, c.c_int]
        self._stream: int | None = None
        # A fixed workspace: cuBLAS then allocates nothing while a CUDA graph is being captured.
        from engine_core.cuda.driver import DeviceBuffer

        self._workspace = DeviceBuffer(WORKSPACE_BYTES)
        _check(lib.cublasSetWorkspace_v2(self.handle, ctypes.c_void_p(self._workspace.ptr),
                                         ctypes.c_size_t(WORKSPACE_BYTES)), "cublasSetWorkspace")

    def set_stream(self, stream: int) -> None:
        if stream != self._stream:
            _check(self.lib.cublasSetStream_v2(self.handle, ctypes.c_void_p(stream)), "cublasSetStream")
            self._stream = stream

    def gemm(self, a: int, b: int, y: int, m: int, n: int, k: int, batch: int, trans_a: bool, trans_b: bool,
             a_batch_stride: int, b_batch_stride: int, alpha: float, beta: float, stream: int,
             dtype: np.dtype = np.dtype(np.float32), tf32: bool = False) -> None:
        """Row-major Y = alpha A@B + beta Y, computed as the column-major Y^T = B^T A^T.

        All operands share ``dtype`` (fp32, fp16 or bf16); accumulation is fp32, with TF32 tensor-core
        math for fp32 operands when ``tf32`` (the builder's TF32 flag)."""
        self.set_stream(stream)
        op_a, lda = (_OP_T, m) if trans_a else (_OP_N, k)
        op_b, ldb = (_OP_T, k) if trans_b else (_OP_N, n)
        kind = _CUDA_TYPES.get(np.dtype(dtype).name)
        if kind is None:
            raise CudaError(f"cuBLAS GEMM over {np.dtype(dtype)}")
        compute = _COMPUTE_32F_FAST_TF32 if tf32 and kind == 0 else _COMPUTE_32F
        al, be = ctypes.c_float(alpha), ctypes.c_float(beta)
        _check(self.lib.cublasGemmStridedBatchedEx(
            self.handle, op_b, op_a, n, m, k, ctypes.byref(al), b, kind, ldb, b_batch_stride, a, kind, lda,
            a_batch_stride, ctypes.byref(be), y, kind, n, m * n, batch, compute, _GEMM_DEFAULT),
            "cublasGemmStridedBatchedEx")

    def __del__(self) -> None:
        try:
            self.lib.cublasDestroy_v2(self.handle)
        except Exception:
            pass

