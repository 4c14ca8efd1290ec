"""Strict fp32 convolutions (no TF32) without a GPU: they lower to NCHW cuDNN graphs (cuDNN's FFMA engines are
NCHW kernels), compute what the CPU backend computes (emulated launches), and the autotuner times plans that
build instead of the first indices, which strict fp32 deselects."""

from __future__ import annotations

import numpy as np
import pytest

from engine_core.backends.cuda.cudnn_conv import (
    AUTOTUNE_PLANS,
    STRICT_FP32_AUTOTUNE_PLANS,
    autotune_plans,
    strict_fp32,
)
from engine_core.backends.cuda.lowering import Conv, LoweringOptions, conv_layout, nhwc_strides
from engine_core.backends.cuda.pointwise import contiguous_strides
from engine_core.backends.cuda.tactics import time_first_runnable
from tests.cuda.models import resnet_small
from tests.cuda.test_backend_cpu import _emulate_vs_cpu

F32, F16 = np.dtype(np.float32), np.dtype(np.float16)
#: what the builder passes for a strict fp32 CUDA build (BuilderFlag.TF32 cleared)
STRICT = {"cudnn": True, "strict_fp32_nchw": True}
#: the random-weight logits reach ~4,000: summation order alone moves near-zero ones by ~1e-3 (3e-7 of the scale)
LOGIT_ATOL = 1e-2


def _convs(lowered) -> list[Conv]:
    return [op for step in lowered.steps for op in step.ops if isinstance(op, Conv)]


def test_only_strict_fp32_convolutions_run_nchw():
    assert conv_layout(F32, LoweringOptions(**STRICT)) == "linear"
    assert conv_layout(F32, LoweringOptions(tf32=True, **STRICT)) == "nhwc"  # TF32 tensor cores want NHWC
    assert conv_layout(F16, LoweringOptions(**STRICT)) == "nhwc"
    assert conv_layout(F32, LoweringOptions(cudnn=True)) == "nhwc"  # a plan built before the option: as it was


def test_strict_fp32_resnet_lowers_nchw_without_reformats_and_matches_the_cpu():
    x = np.random.default_rng(0).standard_normal((2, 3, 64, 64)).astype(np.float32)
    lowered = _emulate_vs_cpu(resnet_small(), {"input": x}, STRICT, rtol=1e-4, atol=LOGIT_ATOL)
    convs = _convs(lowered)
    assert len(convs) > 20 and all(strict_fp32(c) for c in convs)
    for conv in convs:
        assert conv.x_strides == contiguous_strides(conv.x_dims)
        assert conv.w_strides == contiguous_strides(conv.w_dims) and not conv.w.tensor.endswith("#krsc")
        assert conv.y_strides == contiguous_strides(conv.y_dims)
    assert not lowered.weight_transforms  # filters used as ONNX stores them (KCRS)
    assert not any(step.tactic.startswith("reformat") for step in lowered.steps)
    assert {step.tactic for step in lowered.steps if step.node.op_type in ("Conv", "FusedConv")} == {"conv:cudnn"}


def test_tf32_resnet_stays_channels_last():
    x = np.random.default_rng(1).standard_normal((2, 3, 64, 64)).astype(np.float32)
    lowered = _emulate_vs_cpu(resnet_small(), {"input": x}, {**STRICT, "tf32": True}, rtol=1e-4, atol=LOGIT_ATOL)
    assert all(c.x_strides == nhwc_strides(c.x_dims) and c.w.tensor.endswith("#krsc") for c in _convs(lowered))
    assert any(step.tactic.startswith("reformat") for step in lowered.steps)  # the NCHW image goes NHWC


def test_the_autotuner_times_plans_that_build_not_the_first_indices():
    """Strict fp32 deselects cuDNN's tensor-core plans, which come first in the heuristics' order: they must be
    skipped without counting, or nothing is timed and the build keeps an untimed plan."""
    deselected = {0, 1, 2, 3, 5}

    def timer(index: int) -> float:
        if index in deselected:
            raise RuntimeError("Deselecting execution plan")
        return 10.0 - index

    times = time_first_runnable(range(20), timer, limit=4)
    assert list(times) == [4, 6, 7, 8]
    assert min(times, key=times.__getitem__) == 8
    assert time_first_runnable(range(3), timer, limit=4) == {}  # none builds: the caller keeps heuristics' first


def test_strict_fp32_times_more_plans():
    x, w = (2, 8, 6, 6), (8, 8, 3, 3)
    args = [None] * 5 + [x, w, x, contiguous_strides(x), contiguous_strides(w), contiguous_strides(x), None,
                         (1, 1), (1, 1), (1, 1), (1, 1)]
    assert autotune_plans(Conv(*args, F32)) == STRICT_FP32_AUTOTUNE_PLANS > AUTOTUNE_PLANS
    assert autotune_plans(Conv(*args, F32, tf32=True)) == AUTOTUNE_PLANS
    assert autotune_plans(Conv(*args, F16)) == AUTOTUNE_PLANS


@pytest.mark.parametrize("tf32", [False, True])
def test_the_builder_records_the_nchw_choice_for_the_runner(tf32):
    """The runner lowers again from the options the plan records (runner.lowering_options): the builder passes
    strict_fp32_nchw, and TF32 comes from the flag."""
    import engine_core as kiln
    from engine_core.backends.cuda import runner

    plan = kiln.plan.Plan.__new__(kiln.plan.Plan)
    plan.build_info = {"cuda": {"lowering": {"tf32": tf32, "cudnn": True, "strict_fp32_nchw": True}}}
    options = runner.lowering_options(plan)
    assert options.strict_fp32_nchw and conv_layout(F32, options) == ("nhwc" if tf32 else "linear")
