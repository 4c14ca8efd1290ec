"""fuse_norm_dequantize: int8 DequantizeLinears feeding both operands of a kiln.SkipLayerNorm become its inputs 6, 7
(the residual stream quantized too), equal to the unfused graph; the float output goes when only the int8 one is
read; what must stay unfused stays; the CUDA lowering (emulated) is one skip_layer_norm_dq_warp launch."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

import engine_core as kiln
from engine_core.interpret import GraphRunner
from engine_core.passes import eliminate_dead_code, fuse_norm_dequantize, fuse_norm_quantize, fuse_skip_layer_norm
from tests.engine.util import float_model, parsed_graph

COLS = 16
SHAPE = [2, 5, COLS]


def _model(keep_float: bool = False, skip_scale: np.ndarray = np.float32(0.03),
           skip_zero: np.ndarray = np.int8(0)):
    """q = QuantizeLinear(LayerNorm(DQ(Q(x)) + DQ(Q(skip)))); outputs DequantizeLinear(q) (and the float LayerNorm
    output too when ``keep_float``)."""
    rng = np.random.default_rng(0)
    n = helper.make_node
    nodes = [n("QuantizeLinear", ["x", "x_scale", "zero"], ["xq"], name="qx"),
             n("DequantizeLinear", ["xq", "x_scale", "zero"], ["xd"], name="dqx"),
             n("QuantizeLinear", ["skip", "skip_scale", "skip_zero"], ["sq"], name="qs"),
             n("DequantizeLinear", ["sq", "skip_scale", "skip_zero"], ["sd"], name="dqs", axis=-1),
             n("Add", ["xd", "sd"], ["s"], name="residual"),
             n("LayerNormalization", ["s", "gamma", "beta"], ["y"], name="ln", axis=-1, epsilon=1e-5),
             n("QuantizeLinear", ["y", "y_scale", "zero"], ["q"], name="qy"),
             n("DequantizeLinear", ["q", "y_scale", "zero"], ["yq"], name="dqy")]
    inits = {"x_scale": np.float32(0.02), "skip_scale": skip_scale, "zero": np.int8(0), "skip_zero": skip_zero,
             "y_scale": np.float32(0.04), "gamma": rng.standard_normal(COLS).astype(np.float32),
             "beta": rng.standard_normal(COLS).astype(np.float32)}
    return float_model(nodes, {"x": SHAPE, "skip": SHAPE}, ["yq", "y"] if keep_float else ["yq"], inits, opset=19)


def _feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {k: rng.standard_normal(SHAPE).astype(np.float32) for k in ("x", "skip")}


@pytest.mark.parametrize("keep_float", [False, True], ids=["int8-only", "float-kept"])
def test_dequantized_operands_join_the_skip_layer_norm(keep_float):
    model, feeds = _model(keep_float), _feeds()
    graph = parsed_graph(model)
    want = GraphRunner(parsed_graph(model)).run(feeds)
    assert fuse_skip_layer_norm(graph) == 1 and fuse_norm_quantize(graph) == 1 and fuse_norm_dequantize(graph) == 1
    eliminate_dead_code(graph)
    norm = next(n for n in graph.nodes if n.op_type == "SkipLayerNorm")
    assert norm.inputs == ["xq", "sq", "gamma", "beta", "y_scale", "zero", "x_scale", "skip_scale"]
    assert norm.outputs == ["y" if keep_float else "", "q"]
    assert [n.op_type for n in graph.nodes] == ["QuantizeLinear", "QuantizeLinear", "SkipLayerNorm", "DequantizeLinear"]
    got = GraphRunner(graph).run(feeds)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize("case", [dict(skip_scale=np.full(COLS, 0.03, np.float32)), dict(skip_zero=np.int8(2)),
                                  dict(skip_scale=np.float16(0.03))],
                         ids=["per-channel-scale", "zero-point-2", "fp16-scale"])
def test_what_must_stay_unfused_stays(case):
    """One operand the kernel cannot dequantize leaves both as DequantizeLinears (no mixed form)."""
    graph = parsed_graph(_model(**case))
    assert fuse_skip_layer_norm(graph) == 1 and fuse_norm_dequantize(graph) == 0
    assert [n.op_type for n in graph.nodes].count("DequantizeLinear") == 3


@pytest.mark.parametrize("flag", [None, kiln.BuilderFlag.FP16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("keep_float", [False, True], ids=["int8-only", "float-kept"])
def test_cuda_lowering_emulated_equals_the_cpu_backend(tmp_path, monkeypatch, flag, keep_float):
    from engine_core.cuda.nvrtc import compile_kernel_file
    from tests.cuda.emulate import Emulator
    from tests.cuda.models import lowered_at, optimized_graph

    feeds = _feeds()
    graph = optimized_graph(_model(keep_float), feeds, flag)
    lowered = lowered_at(graph, feeds)
    (step,) = [s for s in lowered.steps if s.node.op_type == "SkipLayerNorm"]
    suffix = "f16" if flag is not None else "f32"
    assert [op.function for op in step.ops] == [f"skip_layer_norm_dq_warp_{suffix}"]
    got, want = Emulator(graph, lowered, feeds).run(), GraphRunner(graph).run(feeds)
    steps = np.abs(got["yq"] - want["yq"]) / 0.04  # float64 statistics in the emulator: a tie may round apart
    assert steps.max() <= 1 and np.mean(steps > 0) < 0.05
    if keep_float:
        np.testing.assert_allclose(got["y"], want["y"], rtol=2e-3 if flag is not None else 1e-5,
                                   atol=2e-3 if flag is not None else 1e-5)
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    assert b"skip_layer_norm_dq_warp_f16" in compile_kernel_file("skip_layer_norm", "sm_90")


def _bert_qdq_residual():
    """tools/make_models.py's small bert_qdq_residual (2 layers; the residual Adds quantized as well)."""
    from tests.cuda.models import small_model

    return small_model("bert_qdq_residual")


def test_bert_with_an_int8_residual_stream_keeps_it_int8_between_layers():
    """Every encoder SkipLayerNorm reads int8 operands; all but the last (the model's output) write int8 only; the
    attention output projections and FFN2s requantize too (6 int8-output QMatMuls); no DequantizeLinear is left; the
    fp16 build stays within the fp32 build's rounding (an int8 flip is one step of a residual scale)."""
    from collections import Counter

    from engine_core.passes.fuse_qdq_matmul import requantizes
    from tests.cuda.models import bert_feeds, build_engine

    model = _bert_qdq_residual()
    shapes = {n: ((1, 8), (2, 16), (4, 32)) for n in ("input_ids", "attention_mask", "token_type_ids")}
    engines = {flag: build_engine(model, "cpu", shapes, flag) for flag in (None, kiln.BuilderFlag.FP16)}
    for engine in engines.values():
        nodes = engine.plan.graph.nodes
        types = Counter(n.op_type for n in nodes)
        assert types["QMatMul"] == 13 and not types["DequantizeLinear"] and types["QuantizeLinear"] == 1  # pooler's
        norms = [n for n in nodes if n.op_type == "SkipLayerNorm"]
        assert [len(n.inputs) for n in norms] == [6, 8, 8, 8, 8]  # the embeddings' sum stays float
        assert [n.outputs[0] for n in norms[:-1]] == [""] * 4 and norms[-1].outputs[0]
        assert sum(requantizes(n) for n in nodes) == 6
    feeds = bert_feeds(4, 32)
    got = engines[kiln.BuilderFlag.FP16].create_execution_context().infer(feeds)
    want = engines[None].create_execution_context().infer(feeds)
    for name, value in want.items():
        scale = float(np.abs(value).max())
        error = np.abs(got[name].astype(np.float64) - value)
        assert float(error.max()) <= 5e-2 * scale and float(error.mean()) <= 5e-3 * scale, (name, error.max())


def test_bert_with_an_int8_residual_stream_emulated_on_cuda_equals_the_cpu_backend():
    from tests.cuda.emulate import Emulator
    from tests.cuda.models import bert_feeds, lowered_at, optimized_graph

    feeds = bert_feeds(2, 16)
    graph = optimized_graph(_bert_qdq_residual(), feeds, kiln.BuilderFlag.FP16)
    lowered = lowered_at(graph, feeds)
    norms = [s for s in lowered.steps if s.node.op_type == "SkipLayerNorm"]
    assert [op.function for s in norms[1:] for op in s.ops] == ["skip_layer_norm_dq_warp_f16"] * 4
    got, want = Emulator(graph, lowered, feeds).run(), GraphRunner(graph).run(feeds)
    for name, value in want.items():  # LayerNorm statistics in float64 there: an int8 flip propagates a little
        scale = float(np.abs(value).max())
        assert float(np.abs(got[name] - value).max()) <= 3e-2 * scale, name


@pytest.mark.gpu
@pytest.mark.parametrize("flag", [None, kiln.BuilderFlag.FP16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("keep_float", [False, True], ids=["int8-only", "float-kept"])
def test_skip_layer_norm_dq_on_the_gpu_matches_the_cpu_backend(flag, keep_float):
    """The kernel against the CPU backend's plan of the same build: int8 within one step (float statistics in
    another order), the float output within rounding. ``yq`` is the int8 output dequantized in the build's float
    type, which the two backends round apart by a fraction of a step in fp16."""
    from tests.cuda.models import build_engine

    model, feeds = _model(keep_float), _feeds()
    shapes = {name: (value.shape,) * 3 for name, value in feeds.items()}
    gpu, cpu = (build_engine(model, backend, shapes, flag) for backend in ("cuda", "cpu"))
    assert {layer["type"]: layer["tactic"] for layer in gpu.plan.layers}["SkipLayerNorm"] == "kernel:SkipLayerNorm"
    got, want = (engine.create_execution_context().infer(feeds) for engine in (gpu, cpu))
    steps = np.rint(np.abs(got["yq"] - want["yq"]) / 0.04)
    assert steps.max() <= 1 and np.mean(steps > 0) < 0.05
    if keep_float:
        np.testing.assert_allclose(got["y"], want["y"], rtol=2e-3, atol=2e-3)
