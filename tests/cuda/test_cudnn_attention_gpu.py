"""cuDNN's SDPA as Kiln's Attention on the device: each lowered ``SdpaLaunch`` run through ``CudnnAttentions`` on
device buffers against the CPU backend (BERT's packed heads and padding mask, causal, grouped-query, Whisper's
sequence of 1500, bf16), whole engines taking it (the plan's tactic, eager, captured and replayed runs), the flash
kernel running the layer when cuDNN declines, and no frontend object left at exit."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto

from engine_core.backends.cuda.cudnn_attention import CudnnAttentions, SdpaLaunch
from engine_core.backends.cuda.cudnn_conv import available
from engine_core.interpret import GraphRunner
from tests.cuda.models import build_engine
from tests.cuda.test_cudnn_attention_cpu import attention, attention_op, feeds_for, lowered
from tests.cuda.test_cudnn_release import _run

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not available(), reason="needs the cuDNN frontend (pip install kiln[gpu])")]

CASES = {
    "bert-base b4 s128, packed heads, padding mask": dict(batch=4, heads=12, seq=128, three_d=True,
                                                          mask=[4, 1, 1, 128]),
    "causal d128 b2 h4 s256": dict(heads=4, seq=256, dim=128, causal=1),
    "causal, 64 queries over 192 keys": dict(seq=64, kv_seq=192, causal=1),
    "grouped-query 8/2 heads, packed, padding mask": dict(heads=8, kv_heads=2, seq=128, three_d=True,
                                                          mask=[2, 1, 1, 128]),
    "whisper-tiny encoder b2 s1500 h6 d64": dict(batch=2, heads=6, seq=1500, three_d=True),
    "per-head bias [1,H,S,S] (T5)": dict(heads=4, seq=64, mask=[1, 4, 64, 64]),
    "bf16 causal, mask [B,1,Sq,Skv]": dict(dtype=TensorProto.BFLOAT16, seq=128, causal=1, mask=[2, 1, 128, 128]),
}


def _tolerance(case: dict) -> float:
    """fp16 / bf16 operands with fp32 softmax and sums: errors of a few 1e-3 (bf16 1e-2) on outputs of size ~1."""
    return 3e-2 if case.get("dtype") == TensorProto.BFLOAT16 else 1e-2


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_cudnn_sdpa_computes_what_the_cpu_backend_computes(case):
    """The layer's cuDNN graph run on device copies of the feeds (not through an engine): cuDNN must take it, and
    the description it is built from (strides, bias, causal, heads) must mean what the CPU backend computes."""
    from cuda.bindings import driver

    from engine_core.cuda.driver import DeviceBuffer, check

    model = attention(**case)
    feeds = feeds_for(model)
    graph, low = lowered(model, feeds)
    _, op = attention_op(low)
    assert isinstance(op, SdpaLaunch)
    y_info = low.infos["y"]
    buffers = {name: DeviceBuffer.from_array(np.ascontiguousarray(value)) for name, value in feeds.items()}
    buffers["y"] = DeviceBuffer(int(np.prod(y_info.shape)) * y_info.dtype.itemsize)
    stream = int(check(driver.cuStreamCreate(0), "cuStreamCreate"))
    attentions = CudnnAttentions()
    try:
        ran = attentions.run(op, lambda ref: buffers[ref.tensor].ptr + ref.offset, stream)
        assert ran, attentions.declined
        check(driver.cuStreamSynchronize(stream), "cuStreamSynchronize")
    finally:
        driver.cuStreamDestroy(stream)
        attentions.close()
    got = buffers["y"].to_array(y_info.dtype, y_info.shape).astype(np.float32)
    want = GraphRunner(graph).run(feeds)["y"].astype(np.float32)
    tol = _tolerance(case)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def _engines(model, feeds):
    """(CUDA engine, CPU engine) of ``model`` at the feeds' fixed shapes."""
    shapes = {name: (value.shape,) * 3 for name, value in feeds.items()}
    return build_engine(model, "cuda", shapes), build_engine(model, "cpu", shapes)


@pytest.mark.parametrize("case", ["bert-base b4 s128, packed heads, padding mask", "causal d128 b2 h4 s256"])
def test_engines_run_attention_through_cudnn_eager_captured_and_replayed(case):
    """A whole fp16 engine: the plan says cuDNN's SDPA, and the first (eager) run, the captured one and replays
    with new inputs each compute what the CPU backend computes."""
    model = attention(**CASES[case])
    gpu, cpu = _engines(model, feeds_for(model))
    assert {layer["name"]: layer["tactic"] for layer in gpu.plan.layers}["attention"] == "attention:cudnn_sdpa"
    gctx, cctx = gpu.create_execution_context(), cpu.create_execution_context()
    tol = _tolerance(CASES[case])
    for seed in range(4):
        feeds = feeds_for(model, seed)
        got, want = gctx.infer(feeds)["y"].astype(np.float32), cctx.infer(feeds)["y"].astype(np.float32)
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=f"run {seed}")


def test_the_flash_kernel_runs_the_layer_when_cudnn_declines(monkeypatch):
    """cuDNN failing to build the graph (check_support, no engine) is no error: the flash launch computes it."""
    tried = []

    def declined(self, op):
        tried.append(op.key())
        raise RuntimeError("[cudnn_frontend] Error: GRAPH_NOT_SUPPORTED (stand-in)")

    monkeypatch.setattr(CudnnAttentions, "_graph", declined)
    case = CASES["grouped-query 8/2 heads, packed, padding mask"]
    model = attention(**case)
    feeds = feeds_for(model)
    gpu, cpu = _engines(model, feeds)
    gctx, cctx = gpu.create_execution_context(), cpu.create_execution_context()
    for _ in range(3):
        got, want = gctx.infer(feeds)["y"].astype(np.float32), cctx.infer(feeds)["y"].astype(np.float32)
        np.testing.assert_allclose(got, want, rtol=5e-3, atol=5e-3)
    assert len(tried) == 1  # declined once, remembered


def test_no_leaked_cudnn_instances_at_exit_with_an_attention_context_kept_alive():
    result = _run("""
        from tests.cuda.test_cudnn_attention_cpu import attention, feeds_for
        from tests.cuda.models import build_engine

        model = attention(batch=2, heads=4, seq=64, three_d=True, mask=[2, 1, 1, 64])
        feeds = feeds_for(model)
        ENGINE = build_engine(model, "cuda", {name: (v.shape,) * 3 for name, v in feeds.items()})
        CONTEXT = ENGINE.create_execution_context()  # kept until exit, as a server keeps its models
        for _ in range(3):  # eager, captured, replayed
            CONTEXT.infer(feeds)
        print("ran", {layer["tactic"] for layer in ENGINE.plan.layers})
    """)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "attention:cudnn_sdpa" in result.stdout, result.stdout
    assert "leaked" not in result.stderr, result.stderr[-4000:]
