"""fuse_rotary (engine_core/passes/fuse_rotary.py) and ``kiln.Rotary``: rotary embeddings as exporters write them, each
an onnx.helper graph, become one layer that computes exactly what the unfused layers compute on the CPU backend.

The forms: rotate_half with two Slices (static bounds, or torch's run-time ``x.shape[-1] // 2``) or with a Split, and
GPT-J's interleaved rotate_every_two (torch.stack + flatten: Unsqueeze / Concat / Reshape to a target read with
Shape); x the graph input, or Llama's head Transpose, which the fused layer then reads through ``perm``.
"""

from __future__ import annotations

import copy
from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import engine_core as kiln
from engine_core.ir import Graph, Node
from engine_core.ops import TensorInfo, get_op
from engine_core.ops.registry import ShapeInferenceError
from engine_core.passes import PIPELINE, fuse_rotary
from tests.engine.util import assert_same_outputs, build, ort_run, parsed_graph

HEADS, SEQ, WIDTH = 3, 5, 8
INT64_MAX = np.iinfo(np.int64).max
FORMS = ("slices", "runtime_slices", "split", "interleaved")


class _Net:
    """A graph under construction: ``op`` adds a node and returns its output's name."""

    def __init__(self, dtype: int) -> None:
        self.dtype, self.np_dtype = dtype, helper.tensor_dtype_to_np_dtype(dtype)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: dict[str, np.ndarray] = {}

    def const(self, value, dtype=np.int64) -> str:
        name = f"c{len(self.inits)}"
        self.inits[name] = np.asarray(value, dtype)
        return name

    def op(self, op_type: str, *inputs: str, outputs: int = 1, **attrs) -> str | list[str]:
        names = [f"{op_type.lower()}{len(self.nodes)}_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, name=names[0], **attrs))
        return names[0] if outputs == 1 else names


def _rotate_half(n: _Net, x: str, form: str, width: int) -> str:
    """Concat(-x[..., D/2:], x[..., :D/2]) with the halves as ``form`` makes them."""
    if form == "split":
        first, second = n.op("Split", x, n.const([width // 2] * 2), outputs=2, axis=-1)
    else:
        if form == "runtime_slices":  # torch: x.shape[-1] // 2, Unsqueezed, axis 3
            half = n.op("Unsqueeze", n.op("Div", n.op("Gather", n.op("Shape", x), n.const(3), axis=0), n.const(2)),
                        n.const([0]))
            axis = n.const([3])
        else:
            half, axis = n.const([width // 2]), n.const([-1])
        first = n.op("Slice", x, n.const([0]), half, axis, n.const([1]))
        second = n.op("Slice", x, half, n.const([INT64_MAX]), axis, n.const([1]))
    return n.op("Concat", n.op("Neg", second), first, axis=-1)


def _rotate_every_two(n: _Net, x: str) -> str:
    """GPT-J: torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2), as torch.onnx.export writes it."""
    even = n.op("Slice", x, n.const([0]), n.const([INT64_MAX]), n.const([3]), n.const([2]))
    odd = n.op("Slice", x, n.const([1]), n.const([INT64_MAX]), n.const([3]), n.const([2]))
    stacked = n.op("Concat", n.op("Unsqueeze", n.op("Neg", odd), n.const([-1])), n.op("Unsqueeze", even, n.const([-1])),
                   axis=-1)
    target = n.op("Concat", n.op("Slice", n.op("Shape", stacked), n.const([0]), n.const([-2]), n.const([0])),
                  n.const([-1]), axis=0)
    return n.op("Reshape", stacked, target)


def rotary_model(form: str, dtype: int = TensorProto.FLOAT, transposed: bool = True, x_also_output: bool = False,
                 heads: int = HEADS, seq: int = SEQ, width: int = WIDTH) -> onnx.ModelProto:
    """y = x * cos + rotate(x) * sin over x [batch, heads, seq, width] (``transposed``: Llama's head split of a
    [batch, seq, heads, width] input); cos / sin computed in the graph from positions, [seq, width] (interleaved:
    each angle twice in a row, GPT-J's repeat_interleave; else the halves repeated, Llama's Concat(freqs, freqs))."""
    n = _Net(dtype)
    shape = ["batch", seq, heads, width] if transposed else ["batch", heads, seq, width]
    x = n.op("Transpose", "x", perm=[0, 2, 1, 3]) if transposed else "x"
    angles = np.arange(seq)[:, None] * (0.5 ** np.arange(width // 2))[None]
    if form == "interleaved":
        freqs = n.const(np.repeat(angles, 2, axis=-1), np.float32)
    else:
        half = n.const(angles, np.float32)
        freqs = n.op("Concat", half, half, axis=-1)
    cos, sin = (n.op("Cast", n.op(f, freqs), to=dtype) for f in ("Cos", "Sin"))
    rotated = _rotate_every_two(n, x) if form == "interleaved" else _rotate_half(n, x, form, width)
    n.op("Add", n.op("Mul", x, cos), n.op("Mul", rotated, sin))
    outputs = [helper.make_tensor_value_info(n.nodes[-1].output[0], dtype, None)]
    if x_also_output:
        outputs.append(helper.make_tensor_value_info(x, dtype, None))
    graph = helper.make_graph(n.nodes, "rotary", [helper.make_tensor_value_info("x", dtype, shape)], outputs,
                              [numpy_helper.from_array(v, k) for k, v in n.inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def feeds_for(model: onnx.ModelProto, batch: int = 2, seed: int = 0) -> dict[str, np.ndarray]:
    x = model.graph.input[0].type.tensor_type
    shape = [batch, *(d.dim_value for d in x.shape.dim[1:])]
    dtype = helper.tensor_dtype_to_np_dtype(x.elem_type)
    return {"x": np.random.default_rng(seed).standard_normal(shape).astype(dtype)}


def before_fusion(model: onnx.ModelProto) -> Graph:
    """The graph as fuse_rotary sees it in the pipeline."""
    graph = parsed_graph(model)
    for graph_pass in PIPELINE[:PIPELINE.index(fuse_rotary)]:
        graph_pass(graph)
    return graph


def _fused(model: onnx.ModelProto) -> tuple[Graph, Graph]:
    before = before_fusion(model)
    after = copy.deepcopy(before)
    fuse_rotary(after)
    return before, after


def _same_outputs(before: Graph, after: Graph, feeds: dict[str, np.ndarray]) -> None:
    """The fused layer computes with the unfused layers' own arithmetic: equal, not close."""
    assert_same_outputs(before, after, feeds)


@pytest.mark.parametrize("transposed", [True, False], ids=["head_transpose", "plain"])
@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.FLOAT16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("form", FORMS)
def test_each_form_becomes_one_rotary_computing_the_same(form, dtype, transposed):
    model = rotary_model(form, dtype, transposed)
    before, after = _fused(model)
    ops = Counter(n.op_type for n in after.nodes)
    assert ops["Rotary"] == 1 and not ops["Neg"] and not ops["Split"] and not ops["Add"] and not ops["Mul"]
    (node,) = [n for n in after.nodes if n.op_type == "Rotary"]
    assert node.domain == "kiln" and node.attrs.get("interleaved") == int(form == "interleaved")
    if transposed:  # the head Transpose is read through perm, and it goes with the shape arithmetic of the bounds
        assert node.inputs[0] == "x" and node.attrs["perm"] == [0, 2, 1, 3]
        assert not ops["Transpose"] and not ops["Shape"] and not ops["Slice"]
        assert "transpose0_0" in node.origin
    else:
        assert node.inputs[0] == "x" and "perm" not in node.attrs
    assert node.outputs == before.output_names
    _same_outputs(before, after, feeds_for(model))


@pytest.mark.parametrize("form", ["runtime_slices", "interleaved"])
def test_a_build_matches_onnxruntime_at_every_batch(form):
    model = rotary_model(form)
    plan = build(model, {"x": ((1, SEQ, HEADS, WIDTH), (2, SEQ, HEADS, WIDTH), (4, SEQ, HEADS, WIDTH))})
    engine = kiln.Runtime().load(plan)
    assert [layer["type"] for layer in engine.plan.layers].count("Rotary") == 1
    context = engine.create_execution_context()
    for batch in (1, 3):
        feeds = feeds_for(model, batch, seed=batch)
        got = context.infer(feeds)[model.graph.output[0].name]
        np.testing.assert_allclose(got, ort_run(model, feeds)[0], rtol=1e-6, atol=1e-6)


def test_a_transpose_read_elsewhere_stays_and_the_rotary_reads_its_output():
    model = rotary_model("runtime_slices", x_also_output=True)
    before, after = _fused(model)
    (node,) = [n for n in after.nodes if n.op_type == "Rotary"]
    assert "perm" not in node.attrs and node.inputs[0] == "transpose0_0"
    assert [n.op_type for n in after.nodes].count("Transpose") == 1
    _same_outputs(before, after, feeds_for(model))


def _replace_node(model: onnx.ModelProto, index: int, node: onnx.NodeProto) -> onnx.ModelProto:
    model = copy.deepcopy(model)
    model.graph.node[index].CopyFrom(node)
    return model


def _index(model: onnx.ModelProto, op_type: str, nth: int = 0) -> int:
    return [i for i, n in enumerate(model.graph.node) if n.op_type == op_type][nth]


def test_what_is_not_a_rotation_by_half_stays():
    """Swapped halves (Concat(-x[..., :D/2], x[..., D/2:]) rotates the other way), halves of the wrong size, and a
    cos factor of another tensor than the rotated one are not rotary embeddings: nothing fuses."""
    model = rotary_model("slices")
    concat = model.graph.node[_index(model, "Concat", 1)]
    neg = model.graph.node[_index(model, "Neg")]
    first, second = concat.input[1], neg.input[0]
    swapped = _replace_node(model, _index(model, "Neg"), helper.make_node("Neg", [first], list(neg.output)))
    swapped = _replace_node(swapped, _index(swapped, "Concat", 1),
                            helper.make_node("Concat", [neg.output[0], second], list(concat.output), axis=-1))
    quarter = copy.deepcopy(model)
    bound = next(i for i in quarter.graph.initializer if list(numpy_helper.to_array(i).reshape(-1)) == [WIDTH // 2])
    bound.CopyFrom(numpy_helper.from_array(np.array([WIDTH // 4], np.int64), bound.name))
    mul, sin = model.graph.node[_index(model, "Mul")], model.graph.node[_index(model, "Mul", 1)].input[1]
    other = _replace_node(model, _index(model, "Mul"), helper.make_node("Mul", [sin, mul.input[1]], list(mul.output)))
    for case in (swapped, quarter, other):
        graph = before_fusion(case)
        assert fuse_rotary(graph) == 0


def test_the_op_infers_the_broadcast_shape_of_x_transposed():
    rotary = get_op("Rotary", "kiln")
    node = Node("Rotary", ["x", "c", "s"], ["y"], {"perm": [0, 2, 1, 3]}, "r", "kiln", 1)
    f16 = np.dtype(np.float16)
    info = rotary.infer(node, TensorInfo(f16, (2, 5, 3, 8)), TensorInfo(f16, (5, 8)), TensorInfo(f16, (1, 1, 5, 8)))
    assert info == TensorInfo(f16, (2, 3, 5, 8))
    with pytest.raises(ShapeInferenceError):  # an odd last dim has no pairs
        rotary.infer(node, TensorInfo(f16, (2, 5, 3, 7)), TensorInfo(f16, (5, 7)), TensorInfo(f16, (5, 7)))
