"""Greedy token choice on the device (cuda_kernels/sampling.cu), for decode steps whose every sequence is greedy.

A step otherwise copies each sequence's logits to the host for an argmax there: at 64 sequences and a 128k
vocabulary that is 33 MB across PCIe and as many bytes for the host to scan, every token. The kernel finds each
row's argmax where the logits are (numpy's rule: the first index of the largest value, NaN above all) and one int32
per sequence comes back. Compiled with NVRTC on first use, like the KV kernels (device_kv.py).
"""

from __future__ import annotations

import ctypes
from functools import cache
from typing import Any

from engine_core.cuda.driver import Module, compute_capability, launch_held

#: cuda_kernels/sampling.cu (a kernel family of this package's, not of engine plans)
SAMPLING_KERNEL_FILE = "sampling"
#: threads per row (the kernel's KILN_ARGMAX_THREADS)
THREADS = 256


@cache
def _module(arch: str) -> Module:
    from engine_core.cuda.nvrtc import compile_kernel_file

    return Module(compile_kernel_file(SAMPLING_KERNEL_FILE, arch))


@cache
def _kernel(name: str) -> Any:
    """The kernel ``name`` for this GPU (its module compiled and loaded once per process)."""
    major, minor = compute_capability()
    return _module(f"sm_{major}{minor}").function(name)


def launch_rows_argmax(logits: int, offsets: int, rows: int, vocab: int, out: int, stream: int) -> None:
    """Enqueue on ``stream``: ``out[r]`` (device int32) = the argmax of the ``vocab`` float32 logits starting
    ``offsets[r]`` (device int64, elements) past ``logits``, for each of ``rows`` rows."""
    launch_held(_kernel("rows_argmax_f32"), rows, THREADS,
                [ctypes.c_uint64(logits), ctypes.c_uint64(offsets), ctypes.c_int(vocab), ctypes.c_uint64(out)],
                stream)
