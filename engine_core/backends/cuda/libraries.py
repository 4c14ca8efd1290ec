"""The NVIDIA wheels' shared libraries (libcublas, libcublasLt), loaded through ctypes.

Its own module so that cublas.py and cublaslt.py both use it without importing each other.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys

from engine_core.cuda.driver import CudaError


def load_wheel_library(stem: str) -> ctypes.CDLL:
    """``lib<stem>.so`` from the nvidia-cublas wheel (cu13 or older layout), torch's copy, or the system;
    raises CudaError when absent."""
    patterns = (f"nvidia/cu13/lib/lib{stem}.so*", f"nvidia/cublas/lib/lib{stem}.so*", f"torch/lib/lib{stem}.so*")
    for base in sys.path:
        for pattern in patterns:
            found = sorted(p for p in glob.glob(os.path.join(base, pattern))
                           if os.path.basename(p).startswith(f"lib{stem}.so"))
            if found:
                return ctypes.CDLL(found[0], mode=ctypes.RTLD_GLOBAL)
    for name in (f"lib{stem}.so.13", f"lib{stem}.so.12", f"lib{stem}.so"):
        try:
            return ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
    raise CudaError(f"lib{stem} not found (install nvidia-cublas)")
