"""collapse_layout_chains: a Transpose that per-token ops separate from its inverse cancels; chains keep their outputs.

Each case runs the graph on the CPU backend before and after the pass (equal outputs) and checks which Transposes are
left. The negative cases (a weight of unknown size, ops along another axis, a bias that differs per token, a Transpose
something else reads) keep the graph as it was.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import helper

import engine_core as kiln
from engine_core.interpret import GraphRunner
from engine_core.ir import Graph
from engine_core.passes import PIPELINE, collapse_layout_chains
from engine_core.passes.symbolic import symbolic_shapes
from tests.engine.mha_export import EMBED, HEADS, SEQ, SIZE, mha_model
from tests.engine.util import build, checked_pass, float_model, ort_run, parsed_graph

n = helper.make_node
RNG = np.random.default_rng(7)


def _weights(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _check(model: onnx.ModelProto, feeds: dict[str, np.ndarray], changes: int) -> Graph:
    """Run the pass on the parsed model: it makes ``changes`` rewrites and keeps every output; the graph after it."""
    return checked_pass(model, feeds, collapse_layout_chains, changes, rtol=1e-5, atol=1e-5)


def _perms(graph: Graph) -> list[list[int]]:
    return [list(node.attr("perm")) for node in graph.nodes if node.op_type == "Transpose"]


def _token_chain(middle: list, extra: dict[str, np.ndarray], outputs: tuple[str, ...] = ("y",)) -> onnx.ModelProto:
    """x [B, S, E] -> transpose(1, 0) -> ``middle`` (reads "t", writes "m") -> transpose(1, 0) -> y."""
    nodes = [n("Transpose", ["x"], ["t"], perm=[1, 0, 2]), *middle, n("Transpose", ["m"], ["y"], perm=[1, 0, 2])]
    return float_model(nodes, {"x": ["B", SEQ, EMBED]}, list(outputs), extra)


def _x(batch: int = 3) -> dict[str, np.ndarray]:
    return {"x": RNG.standard_normal((batch, SEQ, EMBED)).astype(np.float32)}


def test_a_transpose_undone_after_per_token_ops_cancels():
    middle = [n("MatMul", ["t", "w"], ["mm"]), n("Add", ["mm", "b"], ["biased"]),
              n("LayerNormalization", ["biased", "gamma", "beta"], ["ln"], axis=2), n("Relu", ["ln"], ["r"]),
              n("Mul", ["r", "half"], ["m"])]
    extra = {"w": _weights(EMBED, 6), "b": _weights(1, 1, 6), "gamma": _weights(6), "beta": _weights(6),
             "half": np.array(0.5, np.float32)}
    graph = _check(_token_chain(middle, extra), _x(), 1)
    assert _perms(graph) == []
    assert [node.op_type for node in graph.nodes] == ["MatMul", "Add", "LayerNormalization", "Relu", "Mul"]
    assert next(node for node in graph.nodes if node.op_type == "LayerNormalization").attr("axis") == -1


def test_the_sequence_first_out_projection_keeps_only_the_head_merge():
    """[B, H, S, D] -> permute(2, 0, 1, 3) -> view [S*B, E] -> Gemm -> view [S, B, E] -> transpose(1, 0) -> + r."""
    nodes = [n("Transpose", ["a"], ["seq_first"], perm=[2, 0, 1, 3]),
             n("Reshape", ["seq_first", "rows"], ["flat"]), n("Gemm", ["flat", "w", "b"], ["proj"], transB=1),
             n("Reshape", ["proj", "lbe"], ["back"]), n("Transpose", ["back"], ["batch_first"], perm=[1, 0, 2]),
             n("Add", ["batch_first", "r"], ["y"])]
    inits = {"rows": np.array([-1, EMBED], np.int64), "lbe": np.array([SEQ, -1, EMBED], np.int64),
             "w": _weights(EMBED, EMBED), "b": _weights(EMBED)}
    model = float_model(nodes, {"a": ["B", HEADS, SEQ, SIZE], "r": ["B", SEQ, EMBED]}, ["y"], inits)
    feeds = {"a": RNG.standard_normal((2, HEADS, SEQ, SIZE)).astype(np.float32),
             "r": RNG.standard_normal((2, SEQ, EMBED)).astype(np.float32)}
    graph = _check(model, feeds, 1)
    assert _perms(graph) == [[0, 2, 1, 3]]
    transpose = next(node for node in graph.nodes if node.op_type == "Transpose")
    merge = next(node for node in graph.nodes if transpose.outputs[0] in node.inputs)
    assert merge.op_type == "Reshape" and graph.constants[merge.inputs[1]].tolist() == [0, SEQ, EMBED]
    assert symbolic_shapes(graph).shapes[merge.outputs[0]] == (("dim:B", -1), SEQ, EMBED)  # what folding needs


def test_a_transpose_read_by_several_projections_is_rewritten_in_every_branch():
    """x -> transpose(1, 0) -> three projections, each -> view [S, B*H, D] -> transpose -> view [B, H, S, D]."""
    nodes = [n("Transpose", ["x"], ["t"], perm=[1, 0, 2])]
    inits: dict[str, np.ndarray] = {"per_head": np.array([SEQ, 2 * HEADS, SIZE], np.int64),
                                    "four_d": np.array([2, HEADS, SEQ, SIZE], np.int64)}
    for name in "qkv":
        nodes += [n("MatMul", ["t", f"w_{name}"], [f"{name}_p"]),
                  n("Reshape", [f"{name}_p", "per_head"], [f"{name}_h"]),
                  n("Transpose", [f"{name}_h"], [f"{name}_t"], perm=[1, 0, 2]),
                  n("Reshape", [f"{name}_t", "four_d"], [name])]
        inits[f"w_{name}"] = _weights(EMBED, EMBED)
    model = float_model(nodes, {"x": [2, SEQ, EMBED]}, list("qkv"), inits)
    assert _perms(_check(model, _x(2), 1)) == [[0, 2, 1, 3]] * 3  # was 4 Transposes; the head splits fold_attention_heads folds


def test_shape_reads_of_a_removed_tensor_give_the_same_dims():
    middle = [n("MatMul", ["t", "w"], ["m"]), n("Shape", ["t"], ["dims"]), n("Shape", ["t"], ["batch"], start=1,
                                                                                end=2)]
    model = _token_chain(middle, {"w": _weights(EMBED, EMBED)}, ("y", "dims", "batch"))
    graph = _check(model, _x(4), 1)
    assert _perms(graph) == []
    got = GraphRunner(graph).run(_x(4))
    assert got["dims"].tolist() == [SEQ, 4, EMBED] and got["batch"].tolist() == [4]


def test_the_mha_export_loses_every_transpose_and_gather_in_the_pipeline():
    model = mha_model(RNG, layers=2)
    graph = parsed_graph(model)
    for graph_pass in PIPELINE:
        graph_pass(graph)
    counts = Counter(node.op_type for node in graph.nodes)
    assert counts["Transpose"] == 0 and counts["Gather"] == 0
    assert counts["Attention"] == 2 and all(node.attr("q_num_heads") == HEADS for node in graph.nodes
                                            if node.op_type == "Attention")
    feeds = _x(3)
    np.testing.assert_allclose(GraphRunner(graph).run(feeds)["y"], ort_run(model, feeds)[0], rtol=1e-5, atol=1e-5)


def test_a_weight_input_needs_a_known_size_not_a_constant():
    """Only the weight's shape matters: [E, 3] as a graph input commutes with the transposes, [E, N] does not."""
    for columns, changes in ((3, 1), ("N", 0)):
        nodes = [n("Transpose", ["x"], ["t"], perm=[1, 0, 2]), n("MatMul", ["t", "w"], ["m"]),
                 n("Transpose", ["m"], ["y"], perm=[1, 0, 2])]
        model = float_model(nodes, {"x": ["B", SEQ, EMBED], "w": [EMBED, columns]}, ["y"], {})
        assert len(_perms(_check(model, _x() | {"w": _weights(EMBED, 3)}, changes))) == 2 - 2 * changes


def test_ops_along_another_axis_stop_the_chain():
    for middle in ([n("Softmax", ["t"], ["m"], axis=0)], [n("LayerNormalization", ["t", "g1"], ["m"], axis=1)]):
        model = _token_chain(middle, {"g1": np.ones((3, EMBED), np.float32)})
        feeds = _x(3)
        assert len(_perms(_check(model, feeds, 0))) == 2


def test_a_bias_that_differs_per_token_stops_the_chain():
    model = _token_chain([n("Add", ["t", "bias"], ["m"])], {"bias": _weights(SEQ, 1, EMBED)})
    assert len(_perms(_check(model, _x(), 0))) == 2


def test_a_transpose_something_else_reads_stays():
    middle = [n("MatMul", ["t", "w"], ["m"]), n("Add", ["t", "t"], ["twice"])]
    model = _token_chain(middle, {"w": _weights(EMBED, EMBED)}, ("y", "twice"))
    assert len(_perms(_check(model, _x(), 0))) == 2


def test_a_lone_transpose_stays():
    model = float_model([n("Transpose", ["x"], ["t"], perm=[1, 0, 2]), n("MatMul", ["t", "w"], ["y"])],
                        {"x": ["B", SEQ, EMBED]}, ["y"], {"w": _weights(EMBED, EMBED)})
    assert _perms(_check(model, _x(), 0)) == [[1, 0, 2]]


def test_a_transpose_a_matrix_product_reads_stays_out_of_chains():
    """K's head split then K^T: merging them would hide the form fuse_attention reads (and the GEMM's transB)."""
    nodes = [n("Transpose", ["k"], ["kh"], perm=[0, 2, 1, 3]), n("Transpose", ["kh"], ["kt"], perm=[0, 1, 3, 2]),
             n("MatMul", ["q", "kt"], ["y"])]
    model = float_model(nodes, {"k": ["B", SEQ, HEADS, SIZE], "q": ["B", HEADS, SEQ, SIZE]}, ["y"], {})
    feeds = {"k": RNG.standard_normal((2, SEQ, HEADS, SIZE)).astype(np.float32),
             "q": RNG.standard_normal((2, HEADS, SEQ, SIZE)).astype(np.float32)}
    assert _perms(_check(model, feeds, 0)) == [[0, 2, 1, 3], [0, 1, 3, 2]]


def test_the_mha_export_lowers_to_gemms_and_attention_only():
    """The CUDA lowering (launches emulated on the host) of the whole pipeline's graph: no copy kernel is left."""
    from tests.cuda.test_backend_cpu import _emulate_vs_cpu

    lowered = _emulate_vs_cpu(mha_model(RNG, layers=2), _x(3), {"cudnn": True}, rtol=1e-5, atol=1e-5)
    kernels = Counter(step.node.op_type for step in lowered.steps if step.tactic != "view")
    assert kernels["Transpose"] == 0 and kernels["Gather"] == 0 and kernels["Attention"] == 2


@pytest.mark.gpu
def test_the_mha_export_on_the_gpu_computes_what_onnxruntime_does():
    model = mha_model(RNG, layers=2)
    feeds = _x(3)
    shapes = {"x": ((1, SEQ, EMBED), (3, SEQ, EMBED), (8, SEQ, EMBED))}
    engine = kiln.Runtime().load(build(model, shapes, backend="cuda"))
    assert not [layer for layer in engine.plan.layers if layer["type"] in ("Transpose", "Gather")]
    got = engine.create_execution_context().infer(feeds)
    np.testing.assert_allclose(got["y"], ort_run(model, feeds)[0], rtol=1e-4, atol=1e-4)
