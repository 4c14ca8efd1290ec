"""Strict fp32 (BuilderFlag.TF32 cleared) on the device: convolutions run cuDNN's FFMA engines over NCHW, timed as
tactics, so ResNet-50 stays within a small factor of TF32 (it was 36x slower: 395.6 ms against 10.8 ms at batch
128 on an H100, channels-last graphs left with cuDNN's slow generic engines and no plan timed). The times themselves
are measured by `bash bench/device_session.sh strict` (bench.engine), not here: timed asserts failed under load."""

from __future__ import annotations

import pytest

import engine_core as kiln
from tests.cuda.models import _make_models, resnet_small, small_model_feeds, small_model_profiles
from tests.cuda.test_backend_gpu import _build, _close_to_scale

pytestmark = pytest.mark.gpu

BATCH = 128


def _needs_cudnn() -> None:
    from engine_core.backends.cuda.cudnn_conv import available

    if not available():
        pytest.skip("needs the cuDNN frontend (pip install kiln[gpu]): convolutions would run on the host")


def _conv_layers(engine: kiln.CudaEngine) -> list[dict]:
    return [layer for layer in engine.plan.layers if layer["type"] in ("Conv", "FusedConv")]


def test_strict_fp32_resnet50_convolutions_run_timed_cudnn_plans_over_nchw():
    """Every convolution on cuDNN with plans timed at build, over NCHW (what keeps strict fp32 within a small factor
    of TF32). How fast is a benchmark's question, not a test's: `bash bench/device_session.sh strict` (bench.engine
    fp32 against TF32 at batch 128, torch beside it; on an H100 30.5 ms strict, 7.3 ms TF32, torch eager with
    cudnn.benchmark and TF32 off 38.4 ms: bench/results/engine_strict_fp32_20261127.json)."""
    _needs_cudnn()
    model = _make_models()["resnet50"][0]()  # the full model: 224x224 images
    shape = (BATCH, 3, 224, 224)
    strict = _build(model, "cuda", {"input": (shape, shape, shape)})  # _build clears TF32 unless asked for
    lowering = strict.plan.build_info["cuda"]["lowering"]
    assert lowering["tf32"] is False and lowering["strict_fp32_nchw"] is True
    assert {layer["tactic"] for layer in _conv_layers(strict)} == {"conv:cudnn"}
    timings = strict.plan.build_info["cuda"]["conv_timings_ms"]
    assert timings and all(timings.values()), timings  # every convolution signature had plans timed


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
