"""CUDA kernels: every .cu file compiles with NVRTC for sm_90 (no GPU needed); GPU tests check numbers."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from engine_core.cuda import CompileError, compile_cubin, kernel_sources
from engine_core.cuda.nvrtc import compile_kernel_file


@pytest.mark.parametrize("stem", sorted(kernel_sources()))
def test_kernel_compiles_for_sm90(stem, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    cubin = compile_kernel_file(stem, arch="sm_90")
    assert cubin[:4] == b"\x7fELF"  # CUBIN is an ELF image
    assert list(tmp_path.rglob("*.cubin")), "compiled kernels are cached on disk"


def test_every_kernel_file_is_embedded_in_cuda_plans():
    """A launch names its module; the runner only has the modules prepare_plan compiled (pointwise.cu is the
    template of the generated pointwise module; kv_cache.cu and sampling.cu are the generative runner's,
    engine_core/generate/device_kv.py and device_argmax.py, launched beside plans, never by them)."""
    from engine_core.backends.cuda import KERNEL_FILES, ON_DEMAND_KERNEL_FILES
    from engine_core.generate.device_argmax import SAMPLING_KERNEL_FILE
    from engine_core.generate.device_kv import KV_KERNEL_FILE

    outside_plans = {"pointwise", KV_KERNEL_FILE, SAMPLING_KERNEL_FILE}
    assert sorted(KERNEL_FILES + ON_DEMAND_KERNEL_FILES) == sorted(set(kernel_sources()) - outside_plans)


def test_compile_errors_carry_the_nvrtc_log(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    with pytest.raises(CompileError, match="undefined_thing"):
        compile_cubin('extern "C" __global__ void k() { undefined_thing(); }', "broken.cu")


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, suffix, tol", [(np.float32, "f32", 1e-6), (np.float16, "f16", 2e-3),
                                                (ml_dtypes.bfloat16, "bf16", 1e-2)])
@pytest.mark.parametrize("rows, cols", [(1, 1), (7, 1000), (64, 4097)])
def test_softmax_kernel_matches_numpy(dtype, suffix, tol, rows, cols):
    import ctypes

    from engine_core.cuda import driver
    from engine_core.cuda.driver import DeviceBuffer, Module, launch

    major, minor = driver.compute_capability()
    module = Module(compile_kernel_file("softmax", arch=f"sm_{major}{minor}"))
    x = (np.random.default_rng(0).standard_normal((rows, cols)) * 4).astype(dtype)
    dx, dy = DeviceBuffer.from_array(x), DeviceBuffer(x.nbytes)
    launch(module.function(f"softmax_{suffix}"), (rows, 1, 1), (256, 1, 1),
           [(dx.ptr, ctypes.c_void_p), (dy.ptr, ctypes.c_void_p), (cols, ctypes.c_longlong)])
    driver.synchronize()
    y = dy.to_array(x.dtype, x.shape).astype(np.float32)
    np.testing.assert_allclose(y, _softmax(x.astype(np.float32)), rtol=tol, atol=tol)


def test_an_edited_header_recompiles_the_kernel_files_that_include_it(tmp_path, monkeypatch):
    """The NVRTC cache key covers Kiln's shared headers: a cached CUBIN of the old header is not reused."""
    from engine_core.cuda import nvrtc

    kernels, cache = tmp_path / "kernels", tmp_path / "cache"
    kernels.mkdir()
    monkeypatch.setattr(nvrtc, "KERNEL_DIR", kernels)
    monkeypatch.setenv("KILN_CACHE_DIR", str(cache))
    (kernels / "k.cu").write_text('#include "h.cuh"\nextern "C" __global__ void k(float* y) { *y = VALUE; }\n')
    (kernels / "h.cuh").write_text("#define VALUE 1.0f\n")
    first = nvrtc.compile_kernel_file("k")
    assert nvrtc.compile_kernel_file("k") == first  # unchanged: the cached CUBIN
    (kernels / "h.cuh").write_text("#define VALUE 2.0f\n")
    assert nvrtc.compile_kernel_file("k") != first
    assert len(list((cache / "kernels").glob("*.cubin"))) == 2
