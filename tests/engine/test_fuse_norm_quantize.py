"""fuse_norm_quantize: an int8 QuantizeLinear of a kiln.SkipLayerNorm's output becomes that layer's second output,
equal to the unfused pair; what must stay unfused stays; the CUDA lowering (emulated) writes both outputs in one
warp-per-row kernel, or the norm kernel and a QuantizeLinear kernel for rows too wide for a warp."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from engine_core.interpret import GraphRunner
from engine_core.passes import fuse_norm_quantize, fuse_skip_layer_norm
from tests.engine.util import float_model, parsed_graph

COLS = 16


def _model(scale: np.ndarray = np.float32(0.05), zero: np.ndarray | None = np.int8(0)):
    """y = LayerNorm(x @ W + skip); q = QuantizeLinear(y, scale, zero); outputs y and DequantizeLinear(q)."""
    rng = np.random.default_rng(0)
    n = helper.make_node
    qdq = ["y", "scale", "zero"] if zero is not None else ["y", "scale"]
    nodes = [n("MatMul", ["x", "W"], ["h"], name="mm"), n("Add", ["h", "skip"], ["s"], name="residual"),
             n("LayerNormalization", ["s", "gamma", "beta"], ["y"], name="ln", axis=-1, epsilon=1e-5),
             n("QuantizeLinear", qdq, ["q"], name="quantize", axis=-1),
             n("DequantizeLinear", ["q", *qdq[1:]], ["yq"], name="dequantize", axis=-1)]
    inits = {"W": rng.standard_normal((COLS, COLS)).astype(np.float32) * 0.3,
             "gamma": rng.standard_normal(COLS).astype(np.float32), "beta": rng.standard_normal(COLS).astype(np.float32),
             "scale": scale} | ({"zero": zero} if zero is not None else {})
    return float_model(nodes, {"x": [2, 5, COLS], "skip": [2, 5, COLS]}, ["y", "yq"], inits, opset=19)


def _feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {k: rng.standard_normal((2, 5, COLS)).astype(np.float32) for k in ("x", "skip")}


def test_quantize_of_a_skip_layer_norm_becomes_its_second_output():
    model, feeds = _model(), _feeds()
    graph = parsed_graph(model)
    want = GraphRunner(parsed_graph(model)).run(feeds)
    assert fuse_skip_layer_norm(graph) == 1 and fuse_norm_quantize(graph) == 1
    assert [n.op_type for n in graph.nodes] == ["MatMul", "SkipLayerNorm", "DequantizeLinear"]
    norm = graph.nodes[1]
    assert norm.inputs == ["h", "skip", "gamma", "beta", "scale", "zero"] and norm.outputs == ["y", "q"]
    assert norm.origin == ["residual", "ln", "quantize"]
    got = GraphRunner(graph).run(feeds)
    for name in ("y", "yq"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize("case", [dict(scale=np.full(COLS, 0.05, np.float32)), dict(zero=np.int8(3)),
                                  dict(zero=np.uint8(0))], ids=["per-channel-scale", "zero-point-3", "uint8"])
def test_what_must_stay_unfused_stays(case):
    graph = parsed_graph(_model(**case))
    assert fuse_skip_layer_norm(graph) == 1 and fuse_norm_quantize(graph) == 0
    assert "QuantizeLinear" in [n.op_type for n in graph.nodes]


@pytest.mark.parametrize("warp_limit, launches", [(1024, ["skip_layer_norm_q_warp_f32"]),
                                                  (8, ["skip_layer_norm_f32", "pw"])], ids=["warp", "wide-rows"])
def test_cuda_lowering_emulated_equals_the_cpu_backend(tmp_path, monkeypatch, warp_limit, launches):
    from engine_core.backends.cuda.lower_rules import norm
    from engine_core.cuda.nvrtc import compile_kernel_file
    from tests.cuda.emulate import Emulator
    from tests.cuda.models import lowered_at, optimized_graph

    monkeypatch.setattr(norm, "WARP_ROW_LIMIT", warp_limit)  # read by the norm rules
    feeds = _feeds()
    graph = optimized_graph(_model(), feeds)
    lowered = lowered_at(graph, feeds)
    (step,) = [s for s in lowered.steps if s.node.op_type == "SkipLayerNorm"]
    assert [op.function.split("_")[0] if op.program is not None else op.function for op in step.ops] == launches
    got, want = Emulator(graph, lowered, feeds).run(), GraphRunner(graph).run(feeds)
    np.testing.assert_allclose(got["y"], want["y"], rtol=1e-5, atol=1e-5)
    steps = np.abs(got["yq"] - want["yq"]) / 0.05  # float64 statistics in the emulator: a tie may round apart
    assert steps.max() <= 1 and np.mean(steps > 0) < 0.05
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    assert b"skip_layer_norm_q_warp_f16" in compile_kernel_file("skip_layer_norm", "sm_90")
