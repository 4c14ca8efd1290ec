"""cuBLASLt through ctypes: GEMM with the bias (+ ReLU / tanh-GELU) epilogue fused into the kernel.

Why: a linear layer's bias add and activation then cost nothing beyond the GEMM, where a separate
epilogue kernel would read and write the whole output once more. Row-major Y = act(A @ B + bias) is
computed as the column-major Y^T = B^T A^T, whose per-row bias is our per-column bias[N].
"""

from __future__ import annotations

import ctypes
from functools import cache

import numpy as np

from engine_core.backends.cuda.libraries import load_wheel_library
from engine_core.cuda.driver import CudaError, DeviceBuffer

WORKSPACE_BYTES = 32 << 20
_CUDA_TYPES = {"float32": 0, "float16": 2, "bfloat16": 14}
_COMPUTE_32F, _COMPUTE_32F_FAST_TF32 = 68, 77
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER = 3, 4, 7, 8
_PREF_MAX_WORKSPACE_BYTES = 1
#: Kiln epilogue name -> cublasLtEpilogue_t
EPILOGUES = {"default": 1, "relu": 2, "bias": 4, "relu_bias": 6, "gelu_bias": 36}


class _Heuristic(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t."""

    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


@cache
def library() -> ctypes.CDLL:
    """libcublasLt from the nvidia-cublas wheel (or the system); raises CudaError when absent."""
    return load_wheel_library("cublasLt")


def available() -> bool:
    """True when libcublasLt loads here."""
    try:
        library()
        return True
    except CudaError:
        return False


def check(status: int, what: str) -> None:
    """Raise CudaError naming ``what`` for a non-zero cublasStatus_t."""
    if status != 0:
        raise CudaError(f"{what} failed with cuBLAS status {status}")


def make_layouts(lib: ctypes.CDLL, specs: list[tuple[int, int, int, int]]) -> list[ctypes.c_void_p]:
    """One column-major cublasLtMatrixLayout per (cudaDataType, rows, cols, leading dimension)."""
    layouts = []
    for kind, rows, cols, ld in specs:
        layout = ctypes.c_void_p()
        check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), kind, ctypes.c_uint64(rows), ctypes.c_uint64(cols),
                                              ctypes.c_int64(ld)), "cublasLtMatrixLayoutCreate")
        layouts.append(layout)
    return layouts


def best_algorithm(lib: ctypes.CDLL, handle: ctypes.c_void_p, desc: ctypes.c_void_p,
                   layouts: list[ctypes.c_void_p]) -> _Heuristic | None:
    """cuBLASLt's first heuristic algorithm for A, B, C = D ``layouts`` within WORKSPACE_BYTES; None if none."""
    c = ctypes
    pref = c.c_void_p()
    check(lib.cublasLtMatmulPreferenceCreate(c.byref(pref)), "cublasLtMatmulPreferenceCreate")
    limit = c.c_uint64(WORKSPACE_BYTES)
    check(lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES, c.byref(limit), 8), "PREF")
    heuristic, found = _Heuristic(), c.c_int(0)
    a_l, b_l, y_l = layouts
    status = lib.cublasLtMatmulAlgoGetHeuristic(handle, desc, a_l, b_l, y_l, y_l, pref, 1, c.byref(heuristic),
                                                c.byref(found))
    lib.cublasLtMatmulPreferenceDestroy(pref)
    return heuristic if status == 0 and found.value else None


class _Plan:
    """Descriptors, layouts and the heuristic's algorithm for one GEMM signature."""

    def __init__(self, lib: ctypes.CDLL, handle: ctypes.c_void_p, m: int, n: int, k: int, trans_a: bool,
                 trans_b: bool, dtype: np.dtype, tf32: bool, epilogue: str) -> None:
        c = ctypes
        kind = _CUDA_TYPES.get(np.dtype(dtype).name)
        if kind is None or epilogue not in EPILOGUES:
            raise CudaError(f"cuBLASLt GEMM over {np.dtype(dtype)} with epilogue {epilogue}")
        compute = _COMPUTE_32F_FAST_TF32 if tf32 and kind == 0 else _COMPUTE_32F
        self.desc = c.c_void_p()
        check(lib.cublasLtMatmulDescCreate(c.byref(self.desc), compute, 0), "cublasLtMatmulDescCreate")
        op_a, op_b = c.c_int(int(trans_b)), c.c_int(int(trans_a))  # Lt's A is our B, Lt's B our A
        check(lib.cublasLtMatmulDescSetAttribute(self.desc, _DESC_TRANSA, c.byref(op_a), 4), "TRANSA")
        check(lib.cublasLtMatmulDescSetAttribute(self.desc, _DESC_TRANSB, c.byref(op_b), 4), "TRANSB")
        self.epilogue = c.c_int(EPILOGUES[epilogue])
        check(lib.cublasLtMatmulDescSetAttribute(self.desc, _DESC_EPILOGUE, c.byref(self.epilogue), 4), "EPILOGUE")
        self.layouts = make_layouts(lib, [(kind, *dims) for dims in (
            (k, n, k) if trans_b else (n, k, n), (m, k, m) if trans_a else (k, m, k), (n, m, n))])
        self.heuristic = best_algorithm(lib, handle, self.desc, self.layouts)
        if self.heuristic is None:
            raise CudaError(f"cuBLASLt has no algorithm for {m}x{n}x{k} {np.dtype(dtype)} epilogue {epilogue}")


class CublasLt:
    """One cuBLASLt handle and workspace (per execution context) and its GEMM plans."""

    def __init__(self) -> None:
        self.lib = library()
        self.handle = ctypes.c_void_p()
        check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.workspace = DeviceBuffer(WORKSPACE_BYTES)
        self._plans: dict[tuple, _Plan] = {}

    def matmul(self, a: int, b: int, y: int, bias: int, m: int, n: int, k: int, trans_a: bool, trans_b: bool,
               alpha: float, dtype: np.dtype, tf32: bool, epilogue: str, stream: int) -> None:
        """Row-major Y = epilogue(alpha A @ B + bias); ``bias`` is a device pointer to bias[N] (0: none)."""
        key = (m, n, k, trans_a, trans_b, np.dtype(dtype).name, tf32, epilogue)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _Plan(self.lib, self.handle, m, n, k, trans_a, trans_b, dtype, tf32, epilogue)
        c = ctypes
        if bias:
            pointer = c.c_void_p(bias)
            check(self.lib.cublasLtMatmulDescSetAttribute(plan.desc, _DESC_BIAS_POINTER, c.byref(pointer), 8),
                   "BIAS_POINTER")
        al, be = c.c_float(alpha), c.c_float(0.0)
        a_l, b_l, y_l = plan.layouts
        check(self.lib.cublasLtMatmul(self.handle, plan.desc, c.byref(al), c.c_void_p(b), a_l, c.c_void_p(a), b_l,
                                       c.byref(be), c.c_void_p(y), y_l, c.c_void_p(y), y_l, c.byref(plan.heuristic),
                                       c.c_void_p(self.workspace.ptr), c.c_size_t(WORKSPACE_BYTES), c.c_void_p(stream)),
               "cublasLtMatmul")
