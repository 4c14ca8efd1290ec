"""resolve_shape_operands: shape operands computed from graph inputs' dims become constants and Shape slices.

ViT's front end computes its patch count as ``(h // p) * (w // p)`` and its class token's ``expand(n, -1, -1)``
through Where/Equal: symbolic_shapes stops there, and with it fold_attention_heads for the whole model. After the
pass the same targets are a constant, or a Concat of constants and a Shape slice of the input, which it reads.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from engine_core.ir import Graph
from engine_core.passes import resolve_shape_operands
from engine_core.passes.symbolic import symbolic_shapes
from tests.engine.util import checked_pass, float_model, parsed_graph

n = helper.make_node
I64 = {"i0": np.array(0, np.int64), "i2": np.array(2, np.int64), "i3": np.array(3, np.int64),
       "two": np.array(2, np.int64), "axes0": np.array([0], np.int64), "four": np.array([4], np.int64)}


def _check(model: onnx.ModelProto, feeds: dict[str, np.ndarray], changes: int) -> Graph:
    return checked_pass(model, feeds, resolve_shape_operands, changes)


def _patches() -> onnx.ModelProto:
    """x [B, 4, 8, 8] -> Reshape to [B, 4, (h // 2) * (w // 2) * 4] (dims read from x at run time)."""
    nodes = [n("Shape", ["x"], ["s"]), n("Gather", ["s", "i0"], ["b"], axis=0),
             n("Gather", ["s", "i2"], ["h"], axis=0), n("Gather", ["s", "i3"], ["w"], axis=0),
             n("Div", ["h", "two"], ["hp"]), n("Div", ["w", "two"], ["wp"]), n("Mul", ["hp", "wp"], ["area"]),
             n("Mul", ["area", "four_s"], ["cells"]),
             *[n("Unsqueeze", [d, "axes0"], [f"{d}1"]) for d in ("b", "cells")],
             n("Concat", ["b1", "four", "cells1"], ["target"], axis=0), n("Reshape", ["x", "target"], ["y"])]
    return float_model(nodes, {"x": ["B", 4, 8, 8]}, ["y"], I64 | {"four_s": np.array(4, np.int64)})


def test_arithmetic_on_input_dims_becomes_a_shape_slice_and_constants():
    model = _patches()
    assert symbolic_shapes(parsed_graph(model)).shape("y") is None
    graph = _check(model, {"x": np.arange(2 * 256, dtype=np.float32).reshape(2, 4, 8, 8)}, 1)
    assert symbolic_shapes(graph).shape("y") == (("dim:B", -1), 4, 64)
    assert {node.op_type for node in graph.nodes} == {"Shape", "Concat", "Reshape"}  # the arithmetic is gone


def test_the_expand_idiom_resolves_to_the_batch_dim():
    """torch's ``token.expand(n, -1, -1)``: Where(Equal(t, -1), ones, t) with t = [n, -1, -1]."""
    nodes = [n("Shape", ["x"], ["s"]), n("Gather", ["s", "i0"], ["b"], axis=0), n("Unsqueeze", ["b", "axes0"], ["b1"]),
             n("Concat", ["b1", "minus"], ["t"], axis=0), n("Equal", ["t", "minus_all"], ["is_minus"]),
             n("Where", ["is_minus", "ones", "t"], ["target"]), n("Expand", ["token", "target"], ["y"])]
    inits = I64 | {"minus": np.array([-1, -1], np.int64), "minus_all": np.array([-1, -1, -1], np.int64),
                   "ones": np.ones(3, np.int64), "token": np.ones((1, 1, 4), np.float32)}
    model = float_model(nodes, {"x": ["B", 3]}, ["y"], inits)
    graph = _check(model, {"x": np.zeros((5, 3), np.float32)}, 1)
    assert symbolic_shapes(graph).shape("y") == (("dim:B", -1), 1, 4)


def test_an_operand_that_depends_on_values_stays():
    """The target is a dim of NonZero's result: known at run time only, not a dim of an input."""
    nodes = [n("NonZero", ["x"], ["nz"]), n("Shape", ["nz"], ["s"]), n("Gather", ["s", "one"], ["count"], axis=0),
             n("Mul", ["count", "two"], ["twice"]), n("Unsqueeze", ["twice", "axes0"], ["target"]),
             n("Reshape", ["pairs", "target"], ["y"])]
    model = float_model(nodes, {"x": [4], "pairs": [3, 2]}, ["y"], I64 | {"one": np.array(1, np.int64)})
    feeds = {"x": np.array([1, 0, 2, 3], np.float32), "pairs": np.ones((3, 2), np.float32)}
    assert _check(model, feeds, 0).nodes[-1].inputs[1] == "target"
