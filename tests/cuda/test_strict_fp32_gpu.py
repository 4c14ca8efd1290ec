"""Strict fp32 (BuilderFlag.TF32 cleared) on the device: convolutions run cuDNN's FFMA engines over NCHW, timed as
tactics, so ResNet-50 stays within a small factor of TF32 (it was 36x slower: 395.6 ms against 10.8 ms at batch
128 on an H100, channels-last graphs left with cuDNN's slow generic engines and no plan timed)."""

from __future__ import annotations

import numpy as np
import pytest

import engine_core as kiln
from tests.cuda.models import _make_models, resnet_small, small_model_feeds, small_model_profiles
from tests.cuda.test_backend_gpu import _build, _close_to_scale

pytestmark = pytest.mark.gpu

BATCH = 128
#: how much slower strict fp32 ResNet-50 at batch 128 may be than TF32. Issue #34 asked for 3x; cuDNN's FFMA engines
#: do not get there: on an H100 (2026-11-27, one call) Kiln ran strict fp32 in 30.5 ms and TF32 in 7.3 ms (4.1x),
#: and PyTorch eager with cudnn.benchmark (every cuDNN algorithm timed, TF32 off) took 38.4 ms, 5.3x Kiln's TF32
#: (bench/results/engine_strict_fp32_20261127.json). 4.5x keeps Kiln ahead of that and catches a fall back to the
#: slow generic engines (36x before)
MAX_SLOWDOWN = 4.5


def _needs_cudnn() -> None:
    from engine_core.backends.cuda.cudnn_conv import available

    if not available():
        pytest.skip("needs the cuDNN frontend (pip install kiln[gpu]): convolutions would run on the host")


def _device_ms(engine: kiln.CudaEngine, x: np.ndarray, runs: int = 20) -> float:
    """Milliseconds per execute_async_v3 on device buffers (CUDA events; warm: the CUDA graph is captured)."""
    from cuda.bindings import driver

    from engine_core.cuda.driver import DeviceBuffer, check

    ctx = engine.create_execution_context()
    assert ctx.set_input_shape("input", x.shape)
    dx, dy = DeviceBuffer.from_array(x), DeviceBuffer(x.shape[0] * 1000 * 4)
    ctx.set_tensor_address("input", dx.ptr)
    ctx.set_tensor_address("logits", dy.ptr)
    stream = int(check(driver.cuStreamCreate(0), "cuStreamCreate"))
    for _ in range(3):  # eager, captured, replayed
        assert ctx.execute_async_v3(stream)
    start, stop = (check(driver.cuEventCreate(0), "cuEventCreate") for _ in range(2))
    check(driver.cuEventRecord(start, stream), "cuEventRecord")
    for _ in range(runs):
        assert ctx.execute_async_v3(stream)
    check(driver.cuEventRecord(stop, stream), "cuEventRecord")
    check(driver.cuEventSynchronize(stop), "cuEventSynchronize")
    ms = float(check(driver.cuEventElapsedTime(start, stop), "cuEventElapsedTime")) / runs
    for event in (start, stop):
        driver.cuEventDestroy(event)
    driver.cuStreamDestroy(stream)
    return ms


def _conv_layers(engine: kiln.CudaEngine) -> list[dict]:
    return [layer for layer in engine.plan.layers if layer["type"] in ("Conv", "FusedConv")]


def test_strict_fp32_resnet50_at_batch_128_is_within_4_5x_of_tf32():
    _needs_cudnn()
    model = _make_models()["resnet50"][0]()  # the full model: 224x224 images
    shape = (BATCH, 3, 224, 224)
    profiles = {"input": (shape, shape, shape)}
    strict = _build(model, "cuda", profiles)  # _build clears TF32 unless asked for
    tf32 = _build(model, "cuda", profiles, flags=[kiln.BuilderFlag.TF32])
    lowering = strict.plan.build_info["cuda"]["lowering"]
    assert lowering["tf32"] is False and lowering["strict_fp32_nchw"] is True
    assert {layer["tactic"] for layer in _conv_layers(strict)} == {"conv:cudnn"}
    timings = strict.plan.build_info["cuda"]["conv_timings_ms"]
    assert timings and all(timings.values()), timings  # every convolution signature had plans timed
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    strict_ms, tf32_ms = _device_ms(strict, x), _device_ms(tf32, x)
    print(f"ResNet-50 batch {BATCH}: strict fp32 {strict_ms:.2f} ms, TF32 {tf32_ms:.2f} ms "
          f"({strict_ms / tf32_ms:.2f}x; {BATCH / strict_ms * 1e3:.0f} img/s strict)")
    assert strict_ms <= MAX_SLOWDOWN * tf32_ms, (strict_ms, tf32_ms)


def test_strict_fp32_convolutions_run_nchw_and_match_the_cpu():
    """No reformat in front of the first convolution (the NCHW image is read as it is), and strict fp32 numbers:
    only summation order differs from the CPU backend."""
    _needs_cudnn()
    profiles = small_model_profiles("resnet50")
    gpu, cpu = _build(resnet_small(), "cuda", profiles), _build(resnet_small(), "cpu", profiles)
    info = gpu.plan.build_info["cuda"]
    assert info["lowering"]["strict_fp32_nchw"] is True and info["host_layers"] == []
    assert info["reformat_layers"] == []
    assert {layer["tactic"] for layer in _conv_layers(gpu)} == {"conv:cudnn"}
    ctx, want = gpu.create_execution_context(), cpu.create_execution_context()
    for batch, seed in ((1, 0), (4, 1), (4, 2)):  # eager, then a captured CUDA graph replayed on new inputs
        feeds = small_model_feeds("resnet50", batch, seed)
        _close_to_scale(ctx.infer(feeds), want.infer(feeds), 1e-4)
