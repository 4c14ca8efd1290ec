"""Control flow, sequences, optionals, strings, ai.onnx.ml and training optimizers.

Each test builds a small ONNX model with onnx.helper, runs it through the public Kiln API (parse ->
build_plan -> Runtime -> infer) and through onnxruntime, or onnx's ReferenceEvaluator where
onnxruntime lacks the op; outputs must match, dtype included (exactly, except where a tolerance
says why not).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import engine_core as kiln
from engine_core.interpret import GraphRunner
from engine_core.ir import Graph
from engine_core.ops import TensorInfo, get_op
from engine_core.passes import infer_shapes
from engine_core.plan import deserialize_plan

F, I64, B, S = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL, TensorProto.STRING
RNG = np.random.default_rng(0)


# -- helpers ------------------------------------------------------------------------------------


def vi(name: str, elem: int, shape: list | None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def seq_vi(name: str, elem: int) -> onnx.ValueInfoProto:
    return helper.make_value_info(name, helper.make_sequence_type_proto(helper.make_tensor_type_proto(elem, None)))


def model(nodes: list, inputs: list, outputs: list, inits: list | None = None, opset: int = 21,
          extra_opsets: dict[str, int] | None = None) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits or [])
    imports = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, v) for d, v in (extra_opsets or {}).items()]
    m = helper.make_model(graph, opset_imports=imports)
    m.ir_version = 10
    return m


def build(m: onnx.ModelProto, feeds: dict[str, Any]) -> bytes:
    """Plan bytes, with a profile pinned at the feeds' shapes (tensor inputs only)."""
    builder = kiln.Builder()
    network = builder.create_network()
    parser = kiln.OnnxParser(network)
    assert parser.parse(m.SerializeToString()), [str(e) for e in parser.errors]
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    for name, value in feeds.items():
        if isinstance(value, np.ndarray):
            profile.set_shape(name, value.shape, value.shape, value.shape)
    if profile:
        config.add_optimization_profile(profile)
    return kiln.build_plan(network, config)


def run_kiln(m: onnx.ModelProto, feeds: dict[str, Any]) -> list[Any]:
    context = kiln.Runtime().load(build(m, feeds)).create_execution_context()
    outputs = context.infer(feeds)
    return [outputs[o.name] for o in m.graph.output]


def run_graph(m: onnx.ModelProto, feeds: dict[str, Any]) -> list[Any]:
    """Parse and run with the CPU GraphRunner directly (no builder): for graph I/O the builder
    does not take yet."""
    network = kiln.Builder().create_network()
    assert kiln.OnnxParser(network).parse(m)
    out = GraphRunner(network.graph).run(feeds)
    return [out[o.name] for o in m.graph.output]


def run_ort(m: onnx.ModelProto, feeds: dict[str, Any]) -> list[Any]:
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def run_ref(m: onnx.ModelProto, feeds: dict[str, Any]) -> list[Any]:
    return ReferenceEvaluator(m).run(None, feeds)


def assert_same(actual: Any, expected: Any, rtol: float = 0.0, where: str = "output") -> None:
    """Equal values of equal dtype, through lists (sequences) and None (empty optionals)."""
    if isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), f"{where}: {actual!r} vs {expected!r}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, rtol, f"{where}[{i}]")
        return
    if expected is None:
        assert actual is None, f"{where}: expected an empty optional"
        return
    actual, expected = np.asarray(actual), np.asarray(expected)
    if expected.dtype.kind in "OSU":
        assert actual.dtype.kind in "OSU" and actual.tolist() == expected.astype(object).tolist(), where
        return
    assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype}, expected {expected.dtype}"
    assert actual.shape == expected.shape, f"{where}: shape {actual.shape}, expected {expected.shape}"
    if rtol:
        np.testing.assert_allclose(actual, expected, rtol=rtol, err_msg=where)
    else:
        np.testing.assert_array_equal(actual, expected, err_msg=where)


def check(m: onnx.ModelProto, feeds: dict[str, Any], reference: str = "ort", rtol: float = 0.0) -> list[Any]:
    expected = run_ort(m, feeds) if reference == "ort" else run_ref(m, feeds)
    actual = run_kiln(m, feeds)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_same(a, e, rtol, m.graph.output[i].name)
    return actual


# -- If -----------------------------------------------------------------------------------------


def _if_model() -> onnx.ModelProto:
    """Branches read x and w from the enclosing graph; they disagree on the output shape."""
    then_b = helper.make_graph([helper.make_node("Add", ["x", "w"], ["t"])], "then", [], [vi("t", F, [2, 3])])
    else_b = helper.make_graph([helper.make_node("ReduceSum", ["x"], ["e"], keepdims=1)], "else", [], [vi("e", F, None)])
    nodes = [helper.make_node("If", ["c"], ["y"], then_branch=then_b, else_branch=else_b)]
    w = helper.make_tensor("w", F, [3], [1.5, -2.0, 0.25])
    return model(nodes, [vi("c", B, []), vi("x", F, [2, 3])], [vi("y", F, None)], [w])


@pytest.mark.parametrize("cond", [True, False])
def test_if_branches_read_outer_scope(cond: bool) -> None:
    check(_if_model(), {"c": np.array(cond), "x": RNG.standard_normal((2, 3)).astype(np.float32)})


def test_if_shape_known_only_when_branches_agree() -> None:
    network = kiln.Builder().create_network()
    kiln.OnnxParser(network).parse(_if_model())
    infos = infer_shapes(network.graph, {"c": TensorInfo(np.bool_, ()), "x": TensorInfo(np.float32, (2, 3))})
    assert infos["y"].dtype == np.float32 and infos["y"].shape is None
    infos = infer_shapes(network.graph, {"c": TensorInfo.of(np.array(True)), "x": TensorInfo(np.float32, (2, 3))})
    assert infos["y"].shape == (2, 3)  # a known condition picks the branch


def _untyped_if_model() -> onnx.ModelProto:
    """Branches declare no output types (as bodies inlined from function expansions do); the If
    output is then concatenated with an int64 tensor, so its dtype must be inferred right."""
    untyped = [helper.make_value_info(n, onnx.TypeProto()) for n in ("t", "e")]
    then_b = helper.make_graph([helper.make_node("Cast", ["x"], ["t"], to=I64)], "then", [], [untyped[0]])
    else_b = helper.make_graph([helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Concat", ["s", "s"], ["e"], axis=0)],
                               "else", [], [untyped[1]])
    nodes = [helper.make_node("If", ["c"], ["y"], then_branch=then_b, else_branch=else_b),
             helper.make_node("Concat", ["y", "tail"], ["z"], axis=0)]
    tail = helper.make_tensor("tail", I64, [1], [7])
    return model(nodes, [vi("c", B, []), vi("x", F, [2])], [vi("z", I64, None)], [tail])


def test_if_infers_untyped_branches_from_the_scope() -> None:
    network = kiln.Builder().create_network()
    kiln.OnnxParser(network).parse(_untyped_if_model())
    (node,) = [n for n in network.graph.nodes if n.op_type == "If"]
    scope = {"x": TensorInfo(np.float32, (2,)), "c": TensorInfo(np.bool_, ())}
    (info,) = get_op("If").infer(node, scope["c"], scope=scope, infer_graph=infer_shapes)
    assert (info.dtype, info.shape) == (np.int64, (2,))  # both branches give int64 [2]


@pytest.mark.parametrize("cond", [True, False])
def test_untyped_if_builds_and_runs(cond: bool) -> None:
    check(_untyped_if_model(), {"c": np.array(cond), "x": np.array([1.5, -2.0], np.float32)})


# -- Loop ---------------------------------------------------------------------------------------


def _loop_model(trip: bool, cond: bool) -> onnx.ModelProto:
    """y += x * i while i < limit (the body's condition), for at most M iterations; scan output y."""
    body = helper.make_graph(
        [
            helper.make_node("Cast", ["i"], ["fi"], to=F),
            helper.make_node("Mul", ["x", "fi"], ["step"]),
            helper.make_node("Add", ["y_in", "step"], ["y_out"]),
            helper.make_node("Less", ["i", "limit"], ["c_out"]),
            helper.make_node("Identity", ["y_out"], ["scan"]),
        ],
        "body",
        [vi("i", I64, []), vi("c_in", B, []), vi("y_in", F, [3])],
        [vi("c_out", B, []), vi("y_out", F, [3]), vi("scan", F, [3])],
    )
    inputs = [vi("y0", F, [3]), vi("x", F, [3]), vi("limit", I64, [])]
    names = ["", "", "y0"]
    if trip:
        inputs.append(vi("M", I64, []))
        names[0] = "M"
    if cond:
        inputs.append(vi("c", B, []))
        names[1] = "c"
    nodes = [helper.make_node("Loop", names, ["y", "ys"], body=body)]
    return model(nodes, inputs, [vi("y", F, [3]), vi("ys", F, None)])


@pytest.mark.parametrize(("trip", "cond", "m", "limit"), [
    (True, True, 5, 10),    # trip count ends it
    (True, True, 9, 3),     # the body's condition ends it
    (True, False, 4, 1),    # no condition input: the body's condition still ends it
    (False, True, 0, 6),    # while loop
    (True, True, 0, 6),     # zero iterations: empty scan output
])
def test_loop_forms(trip: bool, cond: bool, m: int, limit: int) -> None:
    feeds = {"y0": np.array([1.0, -2.0, 0.5], np.float32), "x": np.array([0.5, 1.0, 3.0], np.float32),
             "limit": np.array(limit, np.int64)}
    if trip:
        feeds["M"] = np.array(m, np.int64)
    if cond:
        feeds["c"] = np.array(True)
    check(_loop_model(trip, cond), feeds)


def test_loop_plan_round_trip_keeps_the_body() -> None:
    """The plan serializes the body graph; the deserialized plan runs it (and a second context too)."""
    m = _loop_model(True, True)
    feeds = {"y0": np.zeros(3, np.float32), "x": np.ones(3, np.float32), "limit": np.array(100, np.int64),
             "M": np.array(4, np.int64), "c": np.array(True)}
    plan_bytes = build(m, feeds)
    plan = deserialize_plan(plan_bytes)
    (loop,) = [n for n in plan.graph.nodes if n.op_type == "Loop"]
    body = loop.attrs["body"]
    assert isinstance(body, Graph)
    assert [n.op_type for n in body.nodes] == ["Cast", "Mul", "Add", "Less", "Identity"]
    assert [v.name for v in body.inputs] == ["i", "c_in", "y_in"]
    engine = kiln.Runtime().load(plan_bytes)
    expected = run_ort(m, feeds)
    for _ in range(2):
        out = engine.create_execution_context().infer(feeds)
        assert_same(out["y"], expected[0])
        assert_same(out["ys"], expected[1])
    np.testing.assert_array_equal(out["ys"][:, 0], [0, 1, 3, 6])


def test_loop_carries_a_sequence() -> None:
    """Loop-carried sequence (SequenceInsert in the body), concatenated after the loop."""
    body = helper.make_graph(
        [
            helper.make_node("Cast", ["i"], ["fi"], to=F),
            helper.make_node("Unsqueeze", ["fi", "axis0"], ["item"]),
            helper.make_node("SequenceInsert", ["s_in", "item"], ["s_out"]),
            helper.make_node("Identity", ["c_in"], ["c_out"]),
        ],
        "body", [vi("i", I64, []), vi("c_in", B, []), seq_vi("s_in", F)], [vi("c_out", B, []), seq_vi("s_out", F)],
    )
    nodes = [
        helper.make_node("SequenceEmpty", [], ["s0"], dtype=F),
        helper.make_node("Loop", ["M", "", "s0"], ["s"], body=body),
        helper.make_node("ConcatFromSequence", ["s"], ["y"], axis=0),
        helper.make_node("SequenceLength", ["s"], ["n"]),
    ]
    axis0 = helper.make_tensor("axis0", I64, [1], [0])
    m = model(nodes, [vi("M", I64, [])], [vi("y", F, None), vi("n", I64, [])], [axis0])
    out = check(m, {"M": np.array(4, np.int64)})
    np.testing.assert_array_equal(out[0], [0, 1, 2, 3])


# -- Scan ---------------------------------------------------------------------------------------


def _scan_body() -> onnx.GraphProto:
    """state += a_t * b_t; scan outputs: the running state and a_t - b_t."""
    return helper.make_graph(
        [helper.make_node("Mul", ["a", "b"], ["ab"]), helper.make_node("Add", ["s_in", "ab"], ["s_out"]),
         helper.make_node("Sub", ["a", "b"], ["d"]), helper.make_node("Identity", ["s_out"], ["run"])],
        "body", [vi("s_in", F, [2]), vi("a", F, [2]), vi("b", F, [2])],
        [vi("s_out", F, [2]), vi("run", F, [2]), vi("d", F, [2])],
    )


def test_scan_axes_and_directions() -> None:
    nodes = [helper.make_node("Scan", ["s0", "A", "Bt"], ["s", "runs", "diffs"], body=_scan_body(), num_scan_inputs=2,
                              scan_input_axes=[0, -1], scan_input_directions=[0, 1],
                              scan_output_axes=[1, 0], scan_output_directions=[0, 1])]
    m = model(nodes, [vi("s0", F, [2]), vi("A", F, [4, 2]), vi("Bt", F, [2, 4])],
              [vi("s", F, [2]), vi("runs", F, None), vi("diffs", F, None)], opset=16)
    feeds = {"s0": np.array([1.0, -1.0], np.float32), "A": np.arange(8, dtype=np.float32).reshape(4, 2),
             "Bt": np.arange(8, dtype=np.float32).reshape(2, 4) * 0.5}
    out = check(m, feeds)
    assert out[1].shape == (2, 4) and out[2].shape == (4, 2)
    network = kiln.Builder().create_network()
    kiln.OnnxParser(network).parse(m)
    infos = infer_shapes(network.graph, {k: TensorInfo(v.dtype, v.shape) for k, v in feeds.items()})
    assert (infos["runs"].shape, infos["diffs"].shape) == ((2, 4), (4, 2))


def test_scan_opset8_batch_and_directions() -> None:
    """Opset 8: batch axis 0, scan axis 1, per-input ``directions``."""
    nodes = [helper.make_node("Scan", ["", "s0", "A", "Bb"], ["s", "runs", "diffs"], body=_scan_body(),
                              num_scan_inputs=2, directions=[1, 0])]
    m = model(nodes, [vi("s0", F, [3, 2]), vi("A", F, [3, 5, 2]), vi("Bb", F, [3, 5, 2])],
              [vi("s", F, [3, 2]), vi("runs", F, [3, 5, 2]), vi("diffs", F, [3, 5, 2])], opset=8)
    feeds = {"s0": RNG.standard_normal((3, 2)).astype(np.float32),
             "A": RNG.standard_normal((3, 5, 2)).astype(np.float32),
             "Bb": RNG.standard_normal((3, 5, 2)).astype(np.float32)}
    check(m, feeds)


# -- sequences and optionals ----------------------------------------------------------------------


def test_sequence_ops_pipeline() -> None:
    nodes = [
        helper.make_node("SplitToSequence", ["x", "sizes"], ["s"], axis=1),
        helper.make_node("SequenceInsert", ["s", "z", "one"], ["s2"]),
        helper.make_node("SequenceErase", ["s2", "minus1"], ["s3"]),
        helper.make_node("SequenceAt", ["s3", "one"], ["at1"]),
        helper.make_node("SequenceLength", ["s3"], ["n"]),
        helper.make_node("ConcatFromSequence", ["s3"], ["cat"], axis=-1),
        helper.make_node("SplitToSequence", ["x"], ["cols"], axis=1, keepdims=0),
        helper.make_node("ConcatFromSequence", ["cols"], ["stacked"], axis=-1, new_axis=1),
        helper.make_node("SequenceConstruct", ["x", "x"], ["pair"]),
        helper.make_node("ConcatFromSequence", ["pair"], ["pair_cat"], axis=0),
    ]
    inits = [helper.make_tensor("sizes", I64, [3], [1, 2, 3]), helper.make_tensor("one", I64, [], [1]),
             helper.make_tensor("minus1", I64, [], [-1])]
    m = model(nodes, [vi("x", F, [2, 6]), vi("z", F, [2, 4])],
              [vi(n, F, None) for n in ("at1", "cat", "stacked", "pair_cat")] + [vi("n", I64, [])], inits)
    feeds = {"x": np.arange(12, dtype=np.float32).reshape(2, 6), "z": -np.ones((2, 4), np.float32)}
    check(m, feeds)
    network = kiln.Builder().create_network()
    kiln.OnnxParser(network).parse(m)
    infos = infer_shapes(network.graph, {"x": TensorInfo(np.float32, (2, 6)), "z": TensorInfo(np.float32, (2, 4))})
    assert infos["stacked"].shape == (2, 6) and infos["pair_cat"].shape == (4, 6)  # element infos flow through
    assert int(infos["n"].value) == 3  # the length is known at build time: Split 3, Insert 1, Erase 1


def test_sequence_map_with_tensor_argument_and_outer_read() -> None:
    """Per element: y = e * k + bias (k is a tensor argument, bias is read from the outer graph)."""
    body = helper.make_graph(
        [helper.make_node("Mul", ["e", "k"], ["ek"]), helper.make_node("Add", ["ek", "bias"], ["y"]),
         helper.make_node("Shape", ["e"], ["shape"])],
        "body", [vi("e", F, None), vi("k", F, [])], [vi("y", F, None), vi("shape", I64, [1])],
    )
    nodes = [helper.make_node("SplitToSequence", ["x", "sizes"], ["s"]),
             helper.make_node("SequenceMap", ["s", "k"], ["ys", "shapes"], body=body),
             helper.make_node("ConcatFromSequence", ["ys"], ["y"], axis=0),
             helper.make_node("ConcatFromSequence", ["shapes"], ["lens"], axis=0)]
    inits = [helper.make_tensor("sizes", I64, [3], [2, 0, 3]), helper.make_tensor("bias", F, [], [0.5])]
    m = model(nodes, [vi("x", F, [5]), vi("k", F, [])], [vi("y", F, None), vi("lens", I64, None)], inits)
    out = check(m, {"x": np.arange(5, dtype=np.float32), "k": np.array(2.0, np.float32)})
    np.testing.assert_array_equal(out[1], [2, 0, 3])


def test_sequence_graph_io() -> None:
    """Sequences as graph inputs and outputs cross the runtime as python lists."""
    nodes = [helper.make_node("SequenceInsert", ["s", "x"], ["s2"]),
             helper.make_node("SequenceAt", ["s2", "zero"], ["first"])]
    m = model(nodes, [seq_vi("s", F), vi("x", F, [2])], [seq_vi("s2", F), vi("first", F, None)],
              [helper.make_tensor("zero", I64, [], [0])])
    feeds = {"s": [np.array([1.0], np.float32), np.array([2.0, 3.0, 4.0], np.float32)], "x": np.ones(2, np.float32)}
    out = run_kiln(m, feeds)
    assert_same(out, run_ref(m, feeds))
    assert len(feeds["s"]) == 2  # the input list is not modified in place


def test_optional_ops() -> None:
    """A present and an empty optional; the empty one is replaced by -w through an If (w is read
    only by the branches: see test_tensor_read_by_a_node_and_a_later_body)."""
    then_b = helper.make_graph([helper.make_node("Neg", ["w"], ["v"])], "then", [], [vi("v", F, [3])])
    else_b = helper.make_graph([helper.make_node("Identity", ["w"], ["v2"])], "else", [], [vi("v2", F, [3])])
    nodes = [helper.make_node("Optional", ["x"], ["full"]), helper.make_node("Identity", ["x"], ["w"]),
             helper.make_node("Optional", [], ["empty"], type=helper.make_tensor_type_proto(F, None)),
             helper.make_node("OptionalHasElement", ["full"], ["has_full"]),
             helper.make_node("OptionalHasElement", ["empty"], ["has_empty"]),
             helper.make_node("OptionalHasElement", [""], ["has_none"]),
             helper.make_node("OptionalGetElement", ["full"], ["got"]),
             helper.make_node("Not", ["has_empty"], ["missing"]),
             helper.make_node("If", ["missing"], ["y"], then_branch=then_b, else_branch=else_b)]
    m = model(nodes, [vi("x", F, [3])], [vi(n, B, []) for n in ("has_full", "has_empty", "has_none")]
              + [vi("got", F, [3]), vi("y", F, [3])], opset=18)
    out = check(m, {"x": np.array([1.0, -2.0, 3.0], np.float32)})
    assert [bool(v) for v in out[:3]] == [True, False, False]


# -- strings ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("attrs", "x"), [
    ({"case_change_action": "UPPER", "is_case_sensitive": 0, "stopwords": ["the", "A"]},
     np.array([["The", "cat", "a", "Sat", "the"]], dtype=object)),
    ({"case_change_action": "LOWER", "is_case_sensitive": 1, "stopwords": ["The"]},
     np.array(["The", "the", "School"], dtype=object)),
    ({"case_change_action": "NONE", "stopwords": ["x"]}, np.array(["x", "x"], dtype=object)),
])
def test_string_normalizer(attrs: dict, x: np.ndarray) -> None:
    m = model([helper.make_node("StringNormalizer", ["x"], ["y"], locale="C", **attrs)], [vi("x", S, list(x.shape))],
              [vi("y", S, None)], opset=10)
    check(m, {"x": x})


@pytest.mark.parametrize("attrs", [{}, {"delimiter": "-"}, {"delimiter": "-", "maxsplit": 1}, {"maxsplit": 2}])
def test_string_split(attrs: dict) -> None:
    """Against onnx's reference (Python's str.split): onnxruntime gives an empty string 0 pieces
    even with an explicit delimiter, where str.split (and onnx's reference) give one, ""."""
    m = model([helper.make_node("StringSplit", ["x"], ["parts", "n"], **attrs)], [vi("x", S, [2, 2])],
              [vi("parts", S, None), vi("n", I64, [2, 2])], opset=20)
    check(m, {"x": np.array([["a-b-c", "  two  words here "], ["", "x--y"]], dtype=object)}, reference="onnx")


def test_string_concat_and_regex() -> None:
    nodes = [helper.make_node("StringConcat", ["x", "suffix"], ["y"]),
             helper.make_node("RegexFullMatch", ["y"], ["ok"], pattern=r"[a-z]+@(example|test)\.com")]
    m = model(nodes, [vi("x", S, [2, 2]), vi("suffix", S, [2])], [vi("y", S, [2, 2]), vi("ok", B, [2, 2])], opset=20)
    check(m, {"x": np.array([["bob", "Al"], ["éva", "zed"]], dtype=object),
              "suffix": np.array(["@example.com", "@test.com"], dtype=object)})


# -- ai.onnx.ml ---------------------------------------------------------------------------------

ML = {"ai.onnx.ml": 4}


@pytest.mark.parametrize(("attrs", "x", "out_type", "reference"), [
    ({"keys_floats": [1.5, -0.0, float("nan")], "values_strings": ["a", "zero", "nan"], "default_string": "?"},
     np.array([[1.5, np.nan], [0.0, 7.0]], np.float32), S, "ort"),
    ({"keys_strings": ["x", "y"], "values_int64s": [10, 20]}, np.array(["y", "q", "x"], dtype=object), I64, "ort"),
    ({"keys_tensor": helper.make_tensor("k", TensorProto.INT64, [3], [5, 1, 3]),  # onnxruntime lacks int16 values
      "values_tensor": helper.make_tensor("v", TensorProto.INT16, [3], [50, 10, 30]),
      "default_tensor": helper.make_tensor("d", TensorProto.INT16, [1], [-7])},
     np.array([3, 4, 5, 1], np.int64), TensorProto.INT16, "onnx"),
])
def test_label_encoder(attrs: dict, x: np.ndarray, out_type: int, reference: str) -> None:
    in_type = {np.dtype(np.float32): F, np.dtype(np.int64): I64}.get(x.dtype, S)
    m = model([helper.make_node("LabelEncoder", ["x"], ["y"], domain="ai.onnx.ml", **attrs)],
              [vi("x", in_type, list(x.shape))], [vi("y", out_type, list(x.shape))], extra_opsets=ML)
    check(m, {"x": x}, reference=reference)


def test_binarizer_and_array_feature_extractor() -> None:
    nodes = [helper.make_node("Binarizer", ["x"], ["b"], domain="ai.onnx.ml", threshold=0.25),
             helper.make_node("ArrayFeatureExtractor", ["x", "cols"], ["picked"], domain="ai.onnx.ml"),
             helper.make_node("ArrayFeatureExtractor", ["v", "cols"], ["picked1d"], domain="ai.onnx.ml")]
    m = model(nodes, [vi("x", F, [2, 3, 4]), vi("v", F, [4])],
              [vi("b", F, None), vi("picked", F, None), vi("picked1d", F, None)],
              [helper.make_tensor("cols", I64, [3], [3, 0, 3])], extra_opsets=ML)
    check(m, {"x": RNG.standard_normal((2, 3, 4)).astype(np.float32), "v": np.arange(4, dtype=np.float32)})


def _tree_ensemble(aggregate: int, post: int) -> onnx.ModelProto:
    """Two trees over 3 features: tree 0 = [x0 <= 0.5] -> (x2 in {1, 4}) ; tree 1 = a single split
    with missing values going true. Leaves feed 2 targets."""
    modes = helper.make_tensor("modes", TensorProto.UINT8, [4], [0, 6, 3, 1])
    node = helper.make_node(
        "TreeEnsemble", ["x"], ["y"], domain="ai.onnx.ml",
        nodes_featureids=[0, 2, 1, 1], nodes_modes=modes,
        nodes_splits=helper.make_tensor("splits", F, [4], [0.5, float("nan"), -1.0, 2.0]),
        nodes_truenodeids=[1, 0, 2, 3], nodes_trueleafs=[0, 1, 1, 1],
        nodes_falsenodeids=[2, 1, 3, 4], nodes_falseleafs=[0, 1, 1, 1],
        nodes_missing_value_tracks_true=[0, 0, 1, 0],
        membership_values=helper.make_tensor("members", F, [3], [1.0, 4.0, float("nan")]),
        leaf_targetids=[0, 1, 1, 0, 1], leaf_weights=helper.make_tensor("w", F, [5], [1.0, 2.0, -1.5, 0.25, 4.0]),
        tree_roots=[0, 3], n_targets=2, aggregate_function=aggregate, post_transform=post,
    )
    return model([node], [vi("x", F, [6, 3])], [vi("y", F, [6, 2])], extra_opsets={"ai.onnx.ml": 5})


TREE_X = np.array([[0.0, 0.0, 1.0], [0.0, 5.0, 2.0], [1.0, np.nan, 4.0], [1.0, -3.0, 0.0], [0.5, 2.0, 4.0],
                   [np.nan, 1.0, 1.0]], np.float32)


@pytest.mark.parametrize("aggregate", [0, 1, 2, 3])
def test_tree_ensemble_aggregates(aggregate: int) -> None:
    """AVERAGE/SUM/MIN/MAX against onnxruntime (a target no leaf reaches is 0 there; onnx's
    reference leaves the dtype's extreme value in it)."""
    check(_tree_ensemble(aggregate, 0), {"x": TREE_X}, rtol=1e-7)


@pytest.mark.parametrize("post", [1, 2])
def test_tree_ensemble_post_transform(post: int) -> None:
    """SOFTMAX (1) and LOGISTIC (2) as the spec numbers them, applied to onnxruntime's raw scores
    (onnxruntime 1.32 swaps the two numbers, so it cannot be the reference here)."""
    raw = run_ort(_tree_ensemble(0, 0), {"x": TREE_X})[0].astype(np.float64)
    if post == 1:
        expected = np.exp(raw - raw.max(axis=1, keepdims=True))
        expected /= expected.sum(axis=1, keepdims=True)
    else:
        expected = 1 / (1 + np.exp(-raw))
    assert_same(run_kiln(_tree_ensemble(0, post), {"x": TREE_X})[0], expected.astype(np.float32), rtol=1e-6)


@pytest.mark.parametrize(("mode", "weights", "strings"), [
    ("TF", None, False), ("IDF", [0.5, 2.0, 1.0, 3.0, 4.0], False), ("TFIDF", [0.5, 2.0, 1.0, 3.0, 4.0], True),
])
def test_tfidf_vectorizer(mode: str, weights: list | None, strings: bool) -> None:
    pool = [2, 3, 5, 4, 5, 6, 7, 8]  # 1-grams 2, 3; 2-grams (5, 4), (5, 6), (7, 8)
    attrs: dict[str, Any] = dict(mode=mode, min_gram_length=1, max_gram_length=2, max_skip_count=2,
                                 ngram_counts=[0, 2], ngram_indexes=[4, 0, 1, 2, 3])
    attrs["pool_strings" if strings else "pool_int64s"] = [str(p) for p in pool] if strings else pool
    if weights:
        attrs["weights"] = weights
    x = np.array([[2, 5, 1, 4, 3, 5, 6, 7], [5, 4, 5, 6, 7, 9, 8, 3]], np.int64)
    feed = x.astype(str).astype(object) if strings else x
    m = model([helper.make_node("TfIdfVectorizer", ["x"], ["y"], **attrs)], [vi("x", S if strings else I64, [2, 8])],
              [vi("y", F, [2, 5])], opset=9)
    check(m, {"x": feed})


# -- training optimizers ------------------------------------------------------------------------


@pytest.mark.parametrize(("op", "groups", "attrs"), [
    ("Adagrad", 3, {"decay_factor": 0.1, "epsilon": 1e-5, "norm_coefficient": 0.01}),
    ("Adam", 4, {"alpha": 0.9, "beta": 0.8, "epsilon": 1e-4, "norm_coefficient": 0.01, "norm_coefficient_post": 0.02}),
    ("Momentum", 3, {"alpha": 0.9, "beta": 0.5, "mode": "standard", "norm_coefficient": 0.01}),
    ("Momentum", 3, {"alpha": 0.9, "beta": 0.5, "mode": "nesterov", "norm_coefficient": 0.01}),
])
@pytest.mark.parametrize("step", [0, 3])
def test_optimizers(op: str, groups: int, attrs: dict, step: int) -> None:
    """Two tensors per group, against onnx's reference. Kiln computes in float64 and rounds once;
    the reference rounds every float32 step, and X - R*update cancels digits, hence rtol 1e-5."""
    shapes = [[3], [2, 2]]
    names = [f"{g}{k}" for g in "XGVH"[:groups] for k in range(2)]
    inputs = [vi("R", F, []), vi("T", I64, [])] + [vi(n, F, shapes[int(n[1])]) for n in names]
    out_names = [f"{n}_new" for n in names if not n.startswith("G")]
    node = helper.make_node(op, ["R", "T", *names], out_names, domain="ai.onnx.preview.training", **attrs)
    m = model([node], inputs, [vi(n, F, shapes[int(n[1])]) for n in out_names],
              extra_opsets={"ai.onnx.preview.training": 1})
    feeds = {"R": np.array(0.1, np.float32), "T": np.array(step, np.int64)}
    feeds.update({n: (RNG.random(shapes[int(n[1])]) + (1 if n[0] == "H" else 0)).astype(np.float32) for n in names})
    check(m, feeds, reference="onnx", rtol=1e-5)


# -- the CPU backend's liveness and body reads ----------------------------------------------------


def test_tensor_read_by_a_node_and_a_later_body() -> None:
    body = helper.make_graph([helper.make_node("Add", ["acc_in", "x"], ["acc_out"]),
                              helper.make_node("Identity", ["c_in"], ["c_out"])],
                             "body", [vi("i", I64, []), vi("c_in", B, []), vi("acc_in", F, [2])],
                             [vi("c_out", B, []), vi("acc_out", F, [2])])
    nodes = [helper.make_node("Neg", ["x"], ["nx"]), helper.make_node("Loop", ["M", "", "nx"], ["y"], body=body)]
    m = model(nodes, [vi("x", F, [2]), vi("M", I64, [])], [vi("y", F, [2])])
    feeds = {"x": np.array([1.0, 2.0], np.float32), "M": np.array(3, np.int64)}
    assert_same(run_graph(m, feeds), run_ort(m, feeds))
