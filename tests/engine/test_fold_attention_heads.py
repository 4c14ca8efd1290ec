"""fold_attention_heads: 4-D Attention between head split/merge copies becomes the 3-D (packed) form.

Each case is checked as a graph (which layers are left, the Attention's inputs and attributes) and as
numbers: the CPU backend runs the graph before and after the pass (equal within 1e-5), and whole builds
are compared with onnxruntime on the unfused model or with a build that leaves the pass out.
"""

from __future__ import annotations

import copy
import math
from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import engine_core as kiln
import engine_core.builder as builder_module
from engine_core.ir import Graph, Node
from engine_core.passes import FUSION_PASSES, PIPELINE, fold_attention_heads, fuse_attention
from engine_core.passes.fold_attention_heads import symbolic_shapes
from tests.engine.util import assert_same_outputs, build, ort_run, parsed_graph
from tools.make_models import MODELS

F = TensorProto.FLOAT
HIDDEN, HEADS, SIZE = 8, 2, 4


def _i64(*values: int) -> np.ndarray:
    return np.array(values, np.int64)


def _model(nodes: list, inputs: list[onnx.ValueInfoProto], outputs: list[str],
           inits: dict[str, np.ndarray]) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info(n, F, None) for n in outputs],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10  # readable by older onnxruntime builds too
    return model


def _dims_of(tensor: str, axes: tuple[int, ...], tail: list[str]) -> tuple[list, str]:
    """torch.onnx.export's dynamic target: Concat(Unsqueeze(Gather(Shape(t), a)) for a in axes, *tail)."""
    nodes = [helper.make_node("Shape", [tensor], [f"{tensor}_shape"])]
    parts = []
    for a in axes:
        nodes += [helper.make_node("Gather", [f"{tensor}_shape", f"axis{a}"], [f"{tensor}_d{a}"], axis=0),
                  helper.make_node("Unsqueeze", [f"{tensor}_d{a}", "zero1"], [f"{tensor}_d{a}_1"])]
        parts.append(f"{tensor}_d{a}_1")
    nodes.append(helper.make_node("Concat", [*parts, *tail], [f"{tensor}_target"], axis=0))
    return nodes, f"{tensor}_target"


def _bert_block(rng: np.random.Generator, form: str = "constant", extra: str = "") -> onnx.ModelProto:
    """x [B, S, 8] -> Q/K/V linear -> Reshape [B, S, 2, 4] -> Transpose -> scaled masked softmax -> merge -> linear.

    ``form``: "constant" Reshape targets [0, 0, 2, 4] / [0, 0, 8]; "dynamic" the exporter's Shape -> Gather ->
    Unsqueeze -> Concat targets; "sliced" those, the merge target as Shape -> Slice(0, -2) -> Concat, and position
    embeddings added first (positions sliced from a buffer: the sequence length becomes a new symbol);
    "seq_first" a dynamic split target [S, B, 2, 4] (not the head split).
    ``extra``: "q_read_twice" (Q's transposed heads also feed a Relu output), "merge_is_output" (the merge
    Transpose's result is a graph output).
    """
    nodes, outputs = [], ["y"]
    inits = {f"w{t}": (rng.standard_normal((HIDDEN, HIDDEN)) * 0.3).astype(np.float32) for t in "qkvo"}
    inits |= {f"b{t}": (rng.standard_normal(HIDDEN) * 0.1).astype(np.float32) for t in "qkv"}
    inits |= {"heads_shape": _i64(0, 0, HEADS, SIZE), "merge_shape": _i64(0, 0, HIDDEN), "axis0": np.int64(0),
              "axis1": np.int64(1), "zero1": _i64(0), "one1": _i64(1), "h": _i64(HEADS), "d": _i64(SIZE), "hd": _i64(HIDDEN),
              "minus2": _i64(-2), "sqrt_d": np.float32(math.sqrt(SIZE))}
    src = "x"
    if form == "sliced":  # HF BERT's embeddings: position ids sliced from a buffer up to the sequence length
        inits |= {"positions": np.arange(16, dtype=np.int64)[None],
                  "pos_table": (rng.standard_normal((16, HIDDEN)) * 0.1).astype(np.float32)}
        nodes += [helper.make_node("Shape", ["x"], ["x_seq"], start=1, end=2),
                  helper.make_node("Slice", ["positions", "zero1", "x_seq", "one1"], ["pos_ids"]),
                  helper.make_node("Gather", ["pos_table", "pos_ids"], ["pos_emb"]),
                  helper.make_node("Add", ["x", "pos_emb"], ["xe"])]
        src = "xe"
    for t in "qkv":
        nodes += [helper.make_node("MatMul", [src, f"w{t}"], [f"{t}_mm"]),
                  helper.make_node("Add", [f"{t}_mm", f"b{t}"], [f"{t}3"])]
        target = "heads_shape"
        if form != "constant":
            shape_nodes, target = _dims_of(f"{t}3", (1, 0) if form == "seq_first" else (0, 1), ["h", "d"])
            nodes += shape_nodes
        nodes += [helper.make_node("Reshape", [f"{t}3", target], [f"{t}4"], name=f"split_{t}"),
                  helper.make_node("Transpose", [f"{t}4"], [f"{t}h"], name=f"heads_{t}", perm=[0, 2, 1, 3])]
    nodes += [helper.make_node("Transpose", ["kh"], ["kt"], perm=[0, 1, 3, 2]),
              helper.make_node("MatMul", ["qh", "kt"], ["s"], name="scores"),
              helper.make_node("Div", ["s", "sqrt_d"], ["ss"], name="scale"),
              helper.make_node("Add", ["ss", "mask"], ["sm"], name="mask_add"),
              helper.make_node("Softmax", ["sm"], ["p"], name="softmax", axis=-1),
              helper.make_node("MatMul", ["p", "vh"], ["ctx"], name="context"),
              helper.make_node("Transpose", ["ctx"], ["ctx_t"], name="merge_t", perm=[0, 2, 1, 3])]
    target = "merge_shape"
    if form == "sliced":  # torch: ctx.size()[:-2] + (hidden,)
        nodes += [helper.make_node("Shape", ["ctx_t"], ["ctx_shape"]),
                  helper.make_node("Slice", ["ctx_shape", "zero1", "minus2"], ["ctx_lead"]),
                  helper.make_node("Concat", ["ctx_lead", "hd"], ["ctx_target"], axis=0)]
        target = "ctx_target"
    elif form != "constant":
        shape_nodes, target = _dims_of("ctx_t", (0, 1), ["hd"])
        nodes += shape_nodes
    nodes += [helper.make_node("Reshape", ["ctx_t", target], ["merged"], name="merge"),
              helper.make_node("MatMul", ["merged", "wo"], ["y"], name="out_proj")]
    if extra == "q_read_twice":
        nodes.append(helper.make_node("Relu", ["qh"], ["q_relu"]))
        outputs.append("q_relu")
    elif extra == "merge_is_output":
        outputs.append("ctx_t")
    dims = ["batch", "seq"] if form != "constant" else [2, 6]
    inputs = [helper.make_tensor_value_info("x", F, [*dims, HIDDEN]),
              helper.make_tensor_value_info("mask", F, [dims[0], 1, 1, dims[1]])]
    return _model(nodes, inputs, outputs, inits)


def _bert_feeds(rng: np.random.Generator, batch: int = 2, seq: int = 6) -> dict[str, np.ndarray]:
    mask = np.zeros((batch, 1, 1, seq), np.float32)
    mask[0, ..., seq - 2:] = -10000.0  # padded tail on the first sequence
    return {"x": rng.standard_normal((batch, seq, HIDDEN)).astype(np.float32), "mask": mask}


def _gpt2_block(rng: np.random.Generator) -> onnx.ModelProto:
    """Fused QKV linear -> Split -> Reshape [0, -1, 2, 4]; K^T as one Transpose(0, 2, 3, 1); causal Where mask;
    merge Reshape [0, 0, -1]."""
    seq = 5
    nodes = [helper.make_node("MatMul", ["x", "wqkv"], ["qkv_mm"]),
             helper.make_node("Add", ["qkv_mm", "bqkv"], ["qkv"]),
             helper.make_node("Split", ["qkv", "sizes"], ["q3", "k3", "v3"], axis=-1)]
    for t in "qkv":
        nodes.append(helper.make_node("Reshape", [f"{t}3", "heads_shape"], [f"{t}4"], name=f"split_{t}"))
    nodes += [helper.make_node("Transpose", ["q4"], ["qh"], perm=[0, 2, 1, 3]),
              helper.make_node("Transpose", ["v4"], ["vh"], perm=[0, 2, 1, 3]),
              helper.make_node("Transpose", ["k4"], ["kt"], perm=[0, 2, 3, 1]),
              helper.make_node("MatMul", ["qh", "kt"], ["s"]), helper.make_node("Mul", ["s", "scale"], ["ss"]),
              helper.make_node("Where", ["causal", "ss", "fill"], ["sm"]),
              helper.make_node("Softmax", ["sm"], ["p"], axis=-1), helper.make_node("MatMul", ["p", "vh"], ["ctx"]),
              helper.make_node("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["ctx_t", "merge_shape"], ["y"], name="merge")]
    inits = {"wqkv": (rng.standard_normal((HIDDEN, 3 * HIDDEN)) * 0.3).astype(np.float32),
             "bqkv": (rng.standard_normal(3 * HIDDEN) * 0.1).astype(np.float32), "sizes": _i64(HIDDEN, HIDDEN, HIDDEN),
             "heads_shape": _i64(0, -1, HEADS, SIZE), "merge_shape": _i64(0, 0, -1),
             "scale": np.float32(1 / math.sqrt(SIZE)), "fill": np.float32(-1e4),
             "causal": np.tril(np.ones((seq, seq), bool))[None, None]}
    return _model(nodes, [helper.make_tensor_value_info("x", F, ["batch", seq, HIDDEN])], ["y"], inits)



def _fused(model: onnx.ModelProto) -> Graph:
    """The graph as fold_attention_heads sees it in the pipeline: every pass before it has run."""
    graph = parsed_graph(model)
    for graph_pass in PIPELINE[:PIPELINE.index(fold_attention_heads)]:
        graph_pass(graph)
    return graph


def _attention(graph: Graph) -> Node:
    (node,) = [n for n in graph.nodes if n.op_type == "Attention"]
    return node


def _same_numbers(before: Graph, after: Graph, feeds: dict[str, np.ndarray]) -> None:
    """The CPU backend computes the same outputs on both graphs."""
    assert_same_outputs(before, after, feeds, rtol=1e-5, atol=1e-5)


def _folded(model: onnx.ModelProto) -> tuple[Graph, Graph]:
    """(graph before the pass, graph after it), asserting it folded the one Attention."""
    before = _fused(model)
    after = copy.deepcopy(before)
    assert fold_attention_heads(after) == 1
    return before, after


# -- folds ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["constant", "dynamic", "sliced"])
def test_bert_block_attention_reads_and_writes_the_packed_tensors(rng, form):
    before, after = _folded(_bert_block(rng, form))
    attention = _attention(after)
    assert attention.inputs[:3] == ["q3", "k3", "v3"] and attention.outputs == ["merged"]
    # the mask as it is, or (key count not provable: fuse_attention) through an Expand to the key count
    mask = attention.inputs[3]
    assert mask == "mask" or [n.inputs[0] for n in after.nodes if mask in n.outputs and n.op_type == "Expand"] == ["mask"]
    assert attention.attrs == {"scale": pytest.approx(0.5), "q_num_heads": HEADS, "kv_num_heads": HEADS}
    assert attention.opset == _attention(before).opset
    assert {"split_q", "heads_q", "split_k", "heads_k", "split_v", "heads_v", "scores", "softmax", "context",
            "merge_t", "merge"} <= set(attention.origin)
    ops = Counter(n.op_type for n in after.nodes)
    assert ops["Reshape"] == ops["Transpose"] == 0
    # the merge target's Shape read the removed [B, S, H, D] tensor: it now reads Q's packed input
    assert not [n for n in after.nodes if "ctx_t" in n.inputs or "ctx" in n.inputs]
    assert {n.inputs[0] for n in after.nodes if n.op_type == "Shape"} <= {"x", "q3", "k3", "v3"}
    for batch, seq in [(2, 6)] + ([(3, 4)] if form != "constant" else []):
        _same_numbers(before, after, _bert_feeds(rng, batch, seq))


def test_dynamic_batch_targets_resolve_symbolically(rng):
    """Shape -> Gather -> Unsqueeze -> Concat gives [batch, seq, 2, 4] for every input shape."""
    sym = symbolic_shapes(_fused(_bert_block(rng, "dynamic")))
    batch, seq = ("dim:batch", -1), ("dim:seq", -1)  # named dims: one symbol per name
    assert sym.values["q3_target"] == [batch, seq, HEADS, SIZE]
    assert sym.shapes["q4"] == (batch, seq, HEADS, SIZE) and sym.shapes["merged"] == (batch, seq, HIDDEN)


def test_dynamic_batch_block_builds_and_matches_onnxruntime(rng):
    model = _bert_block(rng, "dynamic")
    plan = build(model, {"x": ((1, 1, HIDDEN), (2, 6, HIDDEN), (4, 8, HIDDEN)),
                         "mask": ((1, 1, 1, 1), (2, 1, 1, 6), (4, 1, 1, 8))})
    context = kiln.Runtime().load(plan).create_execution_context()
    for batch, seq in ((1, 3), (4, 8)):
        feeds = _bert_feeds(rng, batch, seq)
        np.testing.assert_allclose(context.infer(feeds)["y"], ort_run(model, feeds)[0], rtol=1e-4, atol=1e-5)


def test_gpt2_block_with_split_inferred_dims_and_a_causal_mask(rng):
    model = _gpt2_block(rng)
    before, after = _folded(model)
    attention = _attention(after)
    assert attention.inputs == ["q3", "k3", "v3", "causal"] and attention.outputs == ["y"]
    assert attention.attrs["q_num_heads"] == attention.attrs["kv_num_heads"] == HEADS
    assert not [n for n in after.nodes if n.op_type in ("Reshape", "Transpose")]  # incl. fuse_attention's K one
    x = rng.standard_normal((3, 5, HIDDEN)).astype(np.float32)
    _same_numbers(before, after, {"x": x})
    plan = build(model, {"x": ((1, 5, HIDDEN), (2, 5, HIDDEN), (3, 5, HIDDEN))})
    out = kiln.Runtime().load(plan).create_execution_context().infer({"x": x})
    np.testing.assert_allclose(out["y"], ort_run(model, {"x": x})[0], rtol=1e-4, atol=1e-5)


def test_folding_twice_changes_nothing(rng):
    _, after = _folded(_bert_block(rng))
    assert fold_attention_heads(after) == 0


# -- stays 4-D ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form,extra", [("constant", "q_read_twice"), ("constant", "merge_is_output"),
                                        ("seq_first", "")])
def test_blocks_whose_copies_are_needed_stay_4d(rng, form, extra):
    """A transposed tensor read twice, a graph output in the middle, a Reshape that does not split heads
    ([S, B, H, D]: its first axis is the sequence) all keep the 4-D Attention and the copies."""
    model = _bert_block(rng, form, extra)
    graph = _fused(model)
    assert fold_attention_heads(graph) == 0
    attention = _attention(graph)
    assert attention.inputs[:3] == ["qh", "kh", "vh"] and "q_num_heads" not in attention.attrs
    feeds = _bert_feeds(rng, 2, 3 if form == "seq_first" else 6)  # batch != seq: a wrong fold would show
    if form == "seq_first":  # its scores are [S, H, B, B]: a mask of [1, 1, 1, B] fits them
        feeds["mask"] = np.zeros((1, 1, 1, 2), np.float32)
    plan = build(model, {k: (v.shape, v.shape, v.shape) for k, v in feeds.items()})
    out = kiln.Runtime().load(plan).create_execution_context().infer(feeds)
    for name, ref in zip([o.name for o in model.graph.output], ort_run(model, feeds)):
        np.testing.assert_allclose(out[name], ref, rtol=1e-4, atol=1e-5, err_msg=name)


def test_attention_without_head_copies_is_left_alone(rng):
    """fuse_attention's own test model: Q/K/V come straight from 4-D inputs, the output is a graph output."""
    q, k, v = (helper.make_tensor_value_info(t, F, [1, 2, 5, 4]) for t in "qkv")
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]),
             helper.make_node("Softmax", ["s"], ["p"], axis=-1), helper.make_node("MatMul", ["p", "v"], ["y"])]
    graph = parsed_graph(_model(nodes, [q, k, v], ["y"], {}))
    assert fuse_attention(graph) == 1 and fold_attention_heads(graph) == 0


# -- the pipeline and tools/make_models.py's architectures -------------------------------------------------------


def test_fold_runs_right_after_fuse_attention():
    names = [p.__name__ for p in FUSION_PASSES]
    assert names.index("fold_attention_heads") == names.index("fuse_attention") + 1


def _without_fold(monkeypatch: pytest.MonkeyPatch) -> None:
    passes = tuple(p for p in FUSION_PASSES if p is not fold_attention_heads)
    monkeypatch.setattr(builder_module, "FUSION_PASSES", passes)


def _token_feeds(rng: np.random.Generator, batch: int, seq: int) -> dict[str, np.ndarray]:
    mask = np.ones((batch, seq), np.int64)
    mask[0, seq // 2:] = 0
    return {"input_ids": rng.integers(0, 1000, (batch, seq)).astype(np.int64), "attention_mask": mask,
            "token_type_ids": (np.arange(seq) >= seq // 2).astype(np.int64)[None].repeat(batch, 0)}


@pytest.mark.parametrize("name", ["bert_base", "gpt2"])
def test_small_bert_and_gpt2_fold_every_layer_and_compute_the_same(rng, monkeypatch, name):
    model = MODELS[name][1]()
    graph = parsed_graph(model)
    for graph_pass in PIPELINE:
        graph_pass(graph)
    attentions = [n for n in graph.nodes if n.op_type == "Attention"]
    assert len(attentions) == 2 and all(n.attrs["q_num_heads"] == n.attrs["kv_num_heads"] == 4 for n in attentions)
    assert not [n for n in graph.nodes if n.op_type in ("Reshape", "Transpose")]

    names = ["input_ids"] + (["attention_mask", "token_type_ids"] if name == "bert_base" else [])
    feeds = _token_feeds(rng, 2, 7)
    feeds = {k: feeds[k] for k in names}
    shapes = {k: ((1, 1), (2, 8), (2, 16)) for k in names}
    after = kiln.Runtime().load(build(model, shapes)).create_execution_context().infer(feeds)
    _without_fold(monkeypatch)
    before = kiln.Runtime().load(build(model, shapes)).create_execution_context().infer(feeds)
    for output in after:
        np.testing.assert_allclose(after[output], before[output], rtol=1e-5, atol=1e-5, err_msg=output)
