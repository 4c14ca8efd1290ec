"""Kiln's own tiled GEMM kernel (cuda_kernels/gemm.cu): its launch, for the runner and for the tactic timer
that compares it with cuBLAS (tactics.gemm_timer)."""

from __future__ import annotations

import ctypes
from typing import Any

from engine_core.backends.cuda.lowering_context import Gemm
from engine_core.cuda.driver import launch


def run_kiln_gemm(function: Any, op: Gemm, a: int, b: int, y: int, stream: int) -> None:
    """Kiln's own tiled GEMM (cuda_kernels/gemm.cu): 64x64 tiles, 256 threads."""
    grid = ((op.n + 63) // 64, (op.m + 63) // 64, op.batch)
    c = ctypes
    launch(function, grid, (256, 1, 1), [
        (a, c.c_void_p), (b, c.c_void_p), (y, c.c_void_p), (op.m, c.c_int), (op.n, c.c_int), (op.k, c.c_int),
        (op.a_strides[0], c.c_longlong), (op.a_strides[1], c.c_longlong), (op.a_strides[2], c.c_longlong),
        (op.b_strides[0], c.c_longlong), (op.b_strides[1], c.c_longlong), (op.b_strides[2], c.c_longlong),
        (op.m * op.n, c.c_longlong), (op.alpha, c.c_float), (op.beta, c.c_float)], stream=stream)
