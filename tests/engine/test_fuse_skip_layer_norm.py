"""fuse_skip_layer_norm: a residual Add read only by a last-axis LayerNormalization -> kiln.SkipLayerNorm, equal to
onnxruntime on the unfused model; what must stay unfused stays; the CUDA lowering (emulated) runs one kernel,
or an Add plus the LayerNorm kernel when an operand broadcasts."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import engine_core as kiln
from engine_core.interpret import GraphRunner
from engine_core.passes import fuse_skip_layer_norm
from tests.engine.util import build, ort_run, parsed_graph

F = TensorProto.FLOAT


def _model(skip_shape: list[int], readers: int = 1, axis: int = -1, stats: bool = False) -> onnx.ModelProto:
    """h = x @ W; y = LayerNorm(h + skip) (and, with readers=2, also Relu(h + skip))."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32) * 0.3, "W"),
             numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "gamma"),
             numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "beta")]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
             helper.make_node("Add", ["h", "skip"], ["s"], name="residual"),
             helper.make_node("LayerNormalization", ["s", "gamma", "beta"], ["y", "mean"] if stats else ["y"],
                              name="ln", axis=axis, epsilon=1e-5)]
    outputs = [helper.make_tensor_value_info("y", F, None)]
    if readers == 2:
        nodes.append(helper.make_node("Relu", ["s"], ["r"], name="relu"))
        outputs.append(helper.make_tensor_value_info("r", F, None))
    graph = helper.make_graph(nodes, "skip_ln", [helper.make_tensor_value_info("x", F, [2, 5, 16]),
                                                 helper.make_tensor_value_info("skip", F, skip_shape)], outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model



def _feeds(skip_shape: list[int]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {"x": rng.standard_normal((2, 5, 16)).astype(np.float32),
            "skip": rng.standard_normal(skip_shape).astype(np.float32)}


@pytest.mark.parametrize("skip_shape", [[2, 5, 16], [1, 5, 16]], ids=["same", "broadcast"])
def test_residual_add_and_layer_norm_become_one_node_equal_to_onnxruntime(skip_shape):
    model, feeds = _model(skip_shape), _feeds(skip_shape)
    graph = parsed_graph(model)
    assert fuse_skip_layer_norm(graph) == 1
    assert [n.op_type for n in graph.nodes] == ["MatMul", "SkipLayerNorm"]
    node = graph.nodes[1]
    assert node.domain == "kiln" and node.inputs == ["h", "skip", "gamma", "beta"] and node.origin == ["residual", "ln"]
    want = ort_run(model, feeds)[0]
    np.testing.assert_array_equal(GraphRunner(graph).run(feeds)["y"], GraphRunner(parsed_graph(model)).run(feeds)["y"])
    plan = build(model, {k: (v.shape,) * 3 for k, v in feeds.items()})
    got = kiln.Runtime().load(plan).create_execution_context().infer(feeds)["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", [dict(readers=2), dict(axis=1), dict(stats=True)],
                         ids=["sum-read-twice", "not-last-axis", "mean-output"])
def test_what_must_stay_unfused_stays(case):
    graph = parsed_graph(_model([2, 5, 16], **case))
    assert fuse_skip_layer_norm(graph) == 0
    assert "SkipLayerNorm" not in [n.op_type for n in graph.nodes]


@pytest.mark.parametrize("skip_shape, warp_limit, launches",
                         [([2, 5, 16], 1024, ["skip_layer_norm_warp_f32"]), ([1, 5, 16], 1024, ["pw", "layer_norm_warp_f32"]),
                          ([2, 5, 16], 8, ["skip_layer_norm_f32"]), ([1, 5, 16], 8, ["pw", "layer_norm_f32"])],
                         ids=["one-kernel", "broadcast", "one-kernel-wide-rows", "broadcast-wide-rows"])
def test_cuda_lowering_emulated_equals_the_cpu_backend(tmp_path, monkeypatch, skip_shape, warp_limit, launches):
    """Rows up to WARP_ROW_LIMIT run a warp per row (here 16 <= 1024), longer ones a block per row (the limit set
    to 8)."""
    from engine_core.backends.cuda import KERNEL_FILES
    from engine_core.backends.cuda.lower_rules import norm
    from engine_core.cuda.nvrtc import compile_kernel_file
    from tests.cuda.emulate import Emulator
    from tests.cuda.models import lowered_at, optimized_graph

    monkeypatch.setattr(norm, "WARP_ROW_LIMIT", warp_limit)  # read by the norm rules
    feeds = _feeds(skip_shape)
    graph = optimized_graph(_model(skip_shape), feeds)
    lowered = lowered_at(graph, feeds)
    (step,) = [s for s in lowered.steps if s.node.op_type == "SkipLayerNorm"]
    assert [op.function.split("_")[0] if op.program is not None else op.function for op in step.ops] == launches
    got = Emulator(graph, lowered, feeds).run()["y"]
    np.testing.assert_allclose(got, GraphRunner(graph).run(feeds)["y"], rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    assert "skip_layer_norm" in KERNEL_FILES and all(
        name in compile_kernel_file("skip_layer_norm", "sm_90") for name in (b"skip_layer_norm_f16", b"skip_layer_norm_warp_f16"))
