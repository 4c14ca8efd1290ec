"""NVRTC: CUDA C source -> CUBIN for one GPU architecture, cached on disk.

The cache key is (source, architecture, options, NVRTC version): a kernel compiles once per machine,
and plans embed the CUBIN so a deserialized plan never compiles. Headers such as cuda_fp16.h come
from the nvidia-cuda-runtime / nvidia-cuda-cccl wheels (``nvidia/cu13/include``).
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import cuda_kernels
from engine_core.errors import KilnError

KERNEL_DIR = Path(cuda_kernels.__file__).resolve().parent
#: kernel files using architecture-specific instructions: stem -> {GPU arch: the NVRTC target with those features}.
#: Why: Hopper's wgmma exists only for "sm_90a" code, which runs on sm_90 GPUs alone; other targets compile the
#: file as it is (its kernels then trap, and the lowering never launches them there)
ARCH_FEATURES: dict[str, dict[str, str]] = {"qgemm_sm90": {"sm_90": "sm_90a"}}


class CompileError(KilnError):
    """NVRTC rejected a kernel; the message carries NVRTC's log."""


def kernel_sources() -> dict[str, Path]:
    """Every kernel file shipped with Kiln, by stem (one kernel family per .cu file)."""
    return {p.stem: p for p in sorted(KERNEL_DIR.glob("*.cu"))}


@cache
def include_paths() -> tuple[str, ...]:
    """CUDA header directories from the nvidia-* wheels (cu13 first), then CUDA_HOME."""
    found = []
    for base in map(Path, sys.path):
        for sub in ("nvidia/cu13/include", "nvidia/cu13/include/cccl", "nvidia/cuda_runtime/include",
                    "nvidia/cuda_cccl/include"):
            if (base / sub).is_dir():
                found.append(str(base / sub))
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and Path(cuda_home, "include").is_dir():
        found.append(str(Path(cuda_home, "include")))
    return tuple(dict.fromkeys(found))


def _check(result: tuple, what: str, program=None) -> tuple:
    from cuda.bindings import nvrtc

    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        log = _log(program) if program is not None else ""
        raise CompileError(f"{what} failed: {err.name}{chr(10) + log if log else ''}")
    return tuple(rest)


def _log(program) -> str:
    from cuda.bindings import nvrtc

    _, size = nvrtc.nvrtcGetProgramLogSize(program)
    buf = b" " * size
    nvrtc.nvrtcGetProgramLog(program, buf)
    return buf.decode(errors="replace").strip("\x00 \n")


def nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    major, minor = _check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    return f"{major}.{minor}"


def cache_dir() -> Path:
    return Path(os.environ.get("KILN_CACHE_DIR", Path.home() / ".cache" / "kiln")) / "kernels"


def compile_cubin(source: str, name: str = "kernel.cu", arch: str = "sm_90",
                  options: Sequence[str] = (), use_cache: bool = True, headers: Sequence[str] = ()) -> bytes:
    """Compile ``source`` to a CUBIN for ``arch`` (e.g. "sm_90"); raises CompileError with NVRTC's log.
    ``headers``: the text of the files it includes, part of the cache key (an edited header compiles anew)."""
    from cuda.bindings import nvrtc

    opts = [f"--gpu-architecture={arch}", "--std=c++17", "-default-device", *options]
    opts += [f"--include-path={p}" for p in include_paths()]
    key = hashlib.sha256("\0".join([source, arch, *opts, nvrtc_version(), *headers]).encode()).hexdigest()
    path = cache_dir() / f"{key}.cubin"
    if use_cache and path.is_file():
        return path.read_bytes()
    (program,) = _check(nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        _check(nvrtc.nvrtcCompileProgram(program, len(opts), [o.encode() for o in opts]), f"compiling {name}", program)
        (size,) = _check(nvrtc.nvrtcGetCUBINSize(program), "nvrtcGetCUBINSize")
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(program)
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(cubin)
        os.replace(tmp, path)  # atomic: a concurrent reader never sees half a file
    return cubin


def compile_kernel_files(stems: Sequence[str], arch: str = "sm_90") -> dict[str, bytes]:
    """`compile_kernel_file` for each of `stems`, in parallel threads (NVRTC releases the interpreter lock while
    it compiles). Why: on a fresh machine the first CUDA build compiled Kiln's kernel files one after another, ~50 of
    its ~65 s (#36's cold build time); each file is its own program, so they compile side by side."""
    stems = list(dict.fromkeys(stems))
    if len(stems) < 2:
        return {stem: compile_kernel_file(stem, arch) for stem in stems}
    with ThreadPoolExecutor(max_workers=min(len(stems), os.cpu_count() or 1),
                            thread_name_prefix="kiln-nvrtc") as pool:
        return dict(zip(stems, pool.map(lambda stem: compile_kernel_file(stem, arch), stems)))


def compile_kernel_file(stem: str, arch: str = "sm_90", options: Sequence[str] = ()) -> bytes:
    """Compile one of Kiln's own kernels by file stem (e.g. "softmax") for ``arch`` (or the feature target
    ``ARCH_FEATURES`` names for it)."""
    path = kernel_sources()[stem]
    target = ARCH_FEATURES.get(stem, {}).get(arch, arch)
    headers = [h.read_text() for h in sorted(KERNEL_DIR.glob("*.cuh"))]  # Kiln's shared headers (kiln_reduce.cuh)
    return compile_cubin(path.read_text(), path.name, target, [f"--include-path={KERNEL_DIR}", *options],
                         headers=headers)
