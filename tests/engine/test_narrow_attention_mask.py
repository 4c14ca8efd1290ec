"""narrow_attention_mask: the Hugging Face padding mask, expanded to [batch, 1, queries, keys] then inverted, is
computed on the [batch, 1, 1, keys] tensor instead (same outputs); Expands that change the key dim, and masks whose
intermediates something else reads, stay; after the whole pipeline the flash kernel gets one bias row per key."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from engine_core.interpret import GraphRunner
from engine_core.passes import narrow_attention_mask
from tests.engine.util import parsed_graph

HEADS, DIM = 2, 32


def _model(key_dim_of_mask: str = "S", extra_output: str = "", layers: int = 1):
    """Attention(q, k, v, mask) with mask = Where(Cast(1 - e, bool), -65504, 1 - e), e = Cast(Expand(
    attention_mask[:, None, None, :], [B, 1, S, S]), float): _prepare_4d_attention_mask as torch.onnx exports it.
    ``key_dim_of_mask`` "1": the padding mask reduced to [B, 1] first (the Expand then widens the key dim).
    ``layers`` > 1: that many Attentions read the one mask, each through the key-count Expand fuse_attention puts in
    front of a mask whose key dim the shapes do not prove (BERT exported with transformers' masking_utils)."""
    n = helper.make_node
    nodes = [n("Shape", ["attention_mask"], ["shape"]),
             n("Gather", ["shape", "zero"], ["b"], axis=0), n("Gather", ["shape", "one"], ["s"], axis=0),
             n("Unsqueeze", ["b", "axis0"], ["b1"]), n("Unsqueeze", ["s", "axis0"], ["s1"]),
             n("Concat", ["b1", "ones", "s1", "s1"], ["target"], axis=0)]
    if key_dim_of_mask == "1":
        nodes.append(n("ReduceMin", ["attention_mask", "axis1"], ["padding"], keepdims=1))
        source = "padding"
    else:
        source = "attention_mask"
    nodes += [n("Unsqueeze", [source, "axes12"], ["m4"]), n("Expand", ["m4", "target"], ["e"]),
              n("Cast", ["e"], ["f"], to=TensorProto.FLOAT), n("Sub", ["one_f", "f"], ["inverted"]),
              n("Cast", ["inverted"], ["masked"], to=TensorProto.BOOL),
              n("Where", ["masked", "lowest", "inverted"], ["mask"])]
    if layers == 1:
        nodes.append(n("Attention", ["q", "k", "v", "mask"], ["y"], name="attention"))
    for layer in range(layers if layers > 1 else 0):  # layer l's query is the previous layer's output
        query = "q" if layer == 0 else f"y{layer - 1}"
        nodes += [n("Shape", ["k"], [f"keys{layer}"], start=-2, end=-1),
                  n("Expand", ["mask", f"keys{layer}"], [f"mask{layer}"]),
                  n("Attention", [query, "k", "v", f"mask{layer}"], ["y" if layer == layers - 1 else f"y{layer}"],
                    name=f"attention{layer}")]
    inits = {"zero": np.array(0, np.int64), "one": np.array(1, np.int64), "axis0": np.array([0], np.int64),
             "axis1": np.array([1], np.int64), "ones": np.array([1], np.int64), "axes12": np.array([1, 2], np.int64),
             "one_f": np.array(1.0, np.float32), "lowest": np.array(-65504.0, np.float32)}
    qkv = ["B", HEADS, "S", DIM]
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, qkv) for name in "qkv"]
    inputs.append(helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["B", "S"]))
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("y", extra_output) if name]
    graph = helper.make_graph(nodes, "g", inputs, outputs, [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    return model


def _feeds(batch: int = 2, seq: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(4)
    feeds = {name: rng.standard_normal((batch, HEADS, seq, DIM)).astype(np.float32) for name in "qkv"}
    feeds["attention_mask"] = np.ones((batch, seq), np.int64)
    feeds["attention_mask"][1, seq - 3:] = 0  # the second sequence ends in padding
    return feeds


def test_the_expanded_padding_mask_is_computed_unexpanded():
    model, feeds = _model(), _feeds()
    graph = parsed_graph(model)
    want = GraphRunner(parsed_graph(model)).run(feeds)
    assert narrow_attention_mask(graph) == 1
    cast = next(node for node in graph.nodes if node.op_type == "Cast" and node.outputs == ["f"])
    assert cast.inputs == ["m4"]  # the Expand's input: [B, 1, 1, S]
    got = GraphRunner(graph).run(feeds)
    np.testing.assert_array_equal(got["y"], want["y"])
    assert narrow_attention_mask(graph) == 0  # nothing left to narrow


@pytest.mark.parametrize("key_dim_of_mask", ["S", "1"], ids=["keys", "one-key-widened"])
def test_one_mask_read_by_every_layer_through_key_count_expands_is_computed_unexpanded(key_dim_of_mask):
    """The mask every layer reads (through its own key-count Expand) is narrowed once for all of them; the key-count
    Expands stay, now copying [B, 1, 1, S]. Behind them an Expand may even widen the key dim (from a [B, 1] padding
    summary): the key-count Expand then widens the narrowed mask to the same values."""
    model, feeds = _model(key_dim_of_mask, layers=3), _feeds()
    graph = parsed_graph(model)
    want = GraphRunner(parsed_graph(model)).run(feeds)
    assert narrow_attention_mask(graph) == 3
    cast = next(node for node in graph.nodes if node.op_type == "Cast" and node.outputs == ["f"])
    assert cast.inputs == ["m4"]
    assert [node.inputs[0] for node in graph.nodes if node.op_type == "Expand"] == ["m4", "mask", "mask", "mask"]
    assert narrow_attention_mask(graph) == 0  # nothing left to narrow
    got = GraphRunner(graph).run(feeds)
    np.testing.assert_array_equal(got["y"], want["y"])


@pytest.mark.parametrize("case", [dict(key_dim_of_mask="1"), dict(extra_output="inverted")],
                         ids=["expand-widens-the-key-dim", "intermediate-read-elsewhere"])
def test_what_must_stay_expanded_stays(case):
    graph = parsed_graph(_model(**case))
    assert narrow_attention_mask(graph) == 0
    cast = next(node for node in graph.nodes if node.op_type == "Cast" and node.outputs == ["f"])
    assert cast.inputs == ["e"]


@pytest.mark.parametrize("layers", [1, 2])
def test_after_the_pipeline_the_flash_kernel_stages_one_bias_row_per_key_tile(layers):
    from engine_core.backends.cuda.lowering import flash_shared_bytes
    from tests.cuda.emulate import Emulator
    from tests.cuda.models import lowered_at, optimized_graph

    feeds = _feeds(2, 40)
    graph = optimized_graph(_model(layers=layers), feeds)
    assert "Expand" not in [node.op_type for node in graph.nodes if node.inputs[0] != "mask"]
    lowered = lowered_at(graph, feeds, _tf32())
    steps = [s for s in lowered.steps if s.node.op_type == "Attention"]
    assert len(steps) == layers
    np.testing.assert_allclose(Emulator(graph, lowered, feeds).run()["y"], GraphRunner(graph).run(feeds)["y"],
                               rtol=1e-4, atol=1e-4)
    for step in steps:
        (launch,) = step.ops
        assert launch.function == "flash_attention_32_tf32"
        assert launch.args[5][0].mq == 0 and launch.shared_bytes == flash_shared_bytes(32, "tf32", False)


def _tf32():
    from engine_core.backends.cuda.lowering import LoweringOptions

    return LoweringOptions(tf32=True)


# -- a real export: transformers' masking_utils mask (tests/data/bert_tiny_exported.onnx, tools/export_tiny_bert.py) --

EXPORTED_BERT = Path(__file__).parents[1] / "data" / "bert_tiny_exported.onnx"
#: the Constant masking_utils compares its query index Range with (``q_idx >= 0``: always true)
QUERY_BOUND = "/inner/Constant_19_output_0"


def _exported_bert(query_bound: int = 0) -> onnx.ModelProto:
    model = onnx.load(str(EXPORTED_BERT))
    constant = next(node for node in model.graph.node if node.output[0] == QUERY_BOUND)
    constant.attribute[0].t.CopyFrom(numpy_helper.from_array(np.array(query_bound, np.int64)))
    return model


def _bert_feeds(batch: int = 3, seq: int = 16) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    mask = np.ones((batch, seq), np.int64)
    mask[1, seq - 5:] = 0  # padded tails on two sequences
    mask[2, seq - 1:] = 0
    return {"input_ids": rng.integers(0, 64, (batch, seq)), "attention_mask": mask,
            "token_type_ids": np.zeros((batch, seq), np.int64)}


def test_the_exported_masking_utils_mask_becomes_one_bias_row_a_layer():
    """The export ands the padding mask with ``q_idx >= 0`` ([1, 1, queries, 1]) before its Expand: that term is
    true everywhere, so the mask is computed on [batch, 1, 1, keys], each layer's key-count Expand is a view (no
    launch) and the flash kernel stages one bias row; the outputs match onnxruntime's with padding."""
    from tests.cuda.emulate import Emulator
    from tests.cuda.models import lowered_at, optimized_graph
    from tests.engine.util import ort_run

    model, feeds = _exported_bert(), _bert_feeds()
    graph = optimized_graph(model, feeds)
    lowered = lowered_at(graph, feeds, _tf32())
    attention = [s for s in lowered.steps if s.node.op_type == "Attention"]
    assert len(attention) == 2
    for step in attention:
        (launch,) = step.ops
        assert launch.function == "flash_attention_32_tf32" and launch.args[5][0].mq == 0
    assert all(s.tactic == "view" for s in lowered.steps if s.node.op_type == "Expand")
    want = ort_run(model, feeds)[0]
    np.testing.assert_allclose(GraphRunner(graph).run(feeds)["output"], want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(Emulator(graph, lowered, feeds).run()["output"], want, rtol=1e-3, atol=1e-3)


def test_a_query_term_that_masks_keeps_the_full_mask():
    """``q_idx >= 1`` masks the first query row: not true everywhere, so the mask stays [batch, 1, queries, keys]
    (and the outputs still match onnxruntime's, fully masked row and all)."""
    from tests.cuda.models import lowered_at, optimized_graph
    from tests.engine.util import ort_run

    model, feeds = _exported_bert(query_bound=1), _bert_feeds()
    graph = optimized_graph(model, feeds)
    for step in lowered_at(graph, feeds, _tf32()).steps:
        if step.node.op_type == "Attention":
            (launch,) = step.ops
            assert launch.function == "flash_attention_32_tf32" and launch.args[5][0].mq != 0
    np.testing.assert_allclose(GraphRunner(graph).run(feeds)["output"], ort_run(model, feeds)[0], rtol=1e-4,
                               atol=1e-4)
