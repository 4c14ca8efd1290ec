"""split_packed_projections: q/k/v picked out of one packed projection become one projection each (no copy).

Each case runs the graph on the CPU backend before and after the pass (equal outputs) and checks the Gathers and
GEMMs left. Negative cases: a weight that is no constant, a packed tensor something else reads, a Gather along
another axis, a layout that moves the other dims too, one index picked twice.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
from onnx import helper

from engine_core.ir import Graph
from engine_core.passes import split_packed_projections
from tests.engine.mha_export import EMBED, SEQ, mha_model
from tests.engine.util import checked_pass, float_model

n = helper.make_node
RNG = np.random.default_rng(11)
PACKED = 3 * EMBED


def _check(model: onnx.ModelProto, feeds: dict[str, np.ndarray], changes: int) -> Graph:
    return checked_pass(model, feeds, split_packed_projections, changes, rtol=1e-5, atol=1e-5)


def _ops(graph: Graph) -> Counter:
    return Counter(node.op_type for node in graph.nodes)


def _packed(layout: list, picks: list, inputs: dict | None = None, weight: np.ndarray | None = None,
            outputs: tuple[str, ...] = ("q", "k", "v")) -> onnx.ModelProto:
    """x [B, S, E] -> MatMul(w [E, 3E]) + b -> ``layout`` (reads "proj", writes "packed") -> ``picks``."""
    inits = {"b": RNG.standard_normal(PACKED).astype(np.float32), "i0": np.array(0, np.int64),
             "i1": np.array(1, np.int64), "i2": np.array(2, np.int64), "i_1": np.array(-1, np.int64),
             "three_e": np.array([0, 0, 3, EMBED], np.int64), "e_three": np.array([0, 0, EMBED, 3], np.int64),
             "axes0": np.array([0], np.int64), "axes_2": np.array([-2], np.int64)}
    if weight is not None:
        inits["w"] = weight
    nodes = [n("MatMul", ["x", "w"], ["mm"]), n("Add", ["mm", "b"], ["proj"]), *layout, *picks]
    return float_model(nodes, inputs or {"x": ["B", SEQ, EMBED]}, list(outputs), inits)


def _x(batch: int = 2) -> dict[str, np.ndarray]:
    return {"x": RNG.standard_normal((batch, SEQ, EMBED)).astype(np.float32)}


def _w() -> np.ndarray:
    return RNG.standard_normal((EMBED, PACKED)).astype(np.float32)


TORCH_LAYOUT = [n("Reshape", ["proj", "three_e"], ["unflat"]), n("Unsqueeze", ["unflat", "axes0"], ["u"]),
                n("Transpose", ["u"], ["moved"], perm=[3, 1, 2, 0, 4]), n("Squeeze", ["moved", "axes_2"], ["packed"])]
TORCH_PICKS = [n("Gather", ["packed", f"i{i}"], [name], axis=0) for i, name in enumerate("qkv")]


def test_torch_s_unflatten_transpose_squeeze_gather_becomes_three_projections():
    graph = _check(_packed(TORCH_LAYOUT, TORCH_PICKS, weight=_w()), _x(), 3)
    ops = _ops(graph)
    assert ops["Gather"] == 0 and ops["Transpose"] == 0 and ops["MatMul"] == 3 and ops["Add"] == 3
    assert all(graph.constants[node.inputs[1]].shape == (EMBED, EMBED) for node in graph.nodes
               if node.op_type == "MatMul")


def test_an_index_into_the_unflattened_dim_and_interleaved_columns():
    for target, axis in (("three_e", -2), ("e_three", 3)):  # proj[..., i, :] and proj[..., :, i] (every third)
        picks = [n("Gather", ["packed", index], [name], axis=axis) for index, name in zip(("i0", "i_1"), "qk")]
        graph = _check(_packed([n("Reshape", ["proj", target], ["packed"])], picks, weight=_w(), outputs=("q", "k")),
                       _x(3), 2)
        assert _ops(graph)["Gather"] == 0 and _ops(graph)["Reshape"] == 0


def test_a_gemm_projection_with_transposed_weight():
    nodes = [n("Gemm", ["x", "w", "b"], ["proj"], transB=1), n("Reshape", ["proj", "n3e"], ["packed"]),
             *[n("Gather", ["packed", f"i{i}"], [name], axis=1) for i, name in enumerate("qkv")]]
    inits = {"w": RNG.standard_normal((PACKED, EMBED)).astype(np.float32),
             "b": RNG.standard_normal(PACKED).astype(np.float32), "n3e": np.array([-1, 3, EMBED], np.int64),
             **{f"i{i}": np.array(i, np.int64) for i in range(3)}}
    model = float_model(nodes, {"x": ["N", EMBED]}, list("qkv"), inits)
    graph = _check(model, {"x": RNG.standard_normal((4, EMBED)).astype(np.float32)}, 3)
    assert _ops(graph) == Counter({"Gemm": 3})


def test_the_mha_export_keeps_its_outputs():
    model = mha_model(RNG)
    feeds = _x(3)
    graph = _check(model, feeds, 3)
    assert not any(node.op_type == "Gather" and node.inputs[0].endswith("packed") for node in graph.nodes)


def test_a_weight_that_is_no_constant_stays():
    model = _packed(TORCH_LAYOUT, TORCH_PICKS, inputs={"x": ["B", SEQ, EMBED], "w": [EMBED, PACKED]})
    assert _ops(_check(model, _x() | {"w": _w()}, 0))["Gather"] == 3


def test_a_packed_tensor_something_else_reads_stays():
    picks = [*TORCH_PICKS, n("ReduceSum", ["packed"], ["total"], keepdims=0)]
    model = _packed(TORCH_LAYOUT, picks, weight=_w(), outputs=("q", "k", "v", "total"))
    assert _ops(_check(model, _x(), 0))["Gather"] == 3


def test_a_gather_along_another_axis_stays():
    picks = [n("Gather", ["packed", "i0"], ["q"], axis=1)]
    assert _ops(_check(_packed(TORCH_LAYOUT, picks, weight=_w(), outputs=("q",)), _x(), 0))["Gather"] == 1


def test_a_layout_that_moves_the_other_dims_stays():
    layout = [n("Reshape", ["proj", "three_e"], ["unflat"]), n("Transpose", ["unflat"], ["packed"], perm=[2, 1, 0, 3])]
    picks = [n("Gather", ["packed", f"i{i}"], [name], axis=0) for i, name in enumerate("qkv")]
    assert _ops(_check(_packed(layout, picks, weight=_w()), _x(), 0))["Gather"] == 3


def test_an_index_picked_twice_stays():
    picks = [n("Gather", ["packed", "i0"], ["q"], axis=0), n("Gather", ["packed", "i0"], ["k"], axis=0)]
    assert _ops(_check(_packed(TORCH_LAYOUT, picks, weight=_w(), outputs=("q", "k")), _x(), 0))["Gather"] == 2
