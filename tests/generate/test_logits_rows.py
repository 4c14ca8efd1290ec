"""The LM head for the rows a generator reads (engine_core/generate/logits_rows.py): the rewritten ONNX graph gives,
in onnxruntime, the original's logits at the rows named; heads behind row-wise ops are found, other graphs are left
alone; a decoder engine built with it takes ``logits_rows`` and returns one row of logits per sequence."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from engine_core.generate.logits_rows import LOGITS_ROWS, select_logits_rows
from tests.generate.conftest import generative


def _feeds(model: onnx.ModelProto, batch: int, new: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    feeds: dict[str, np.ndarray] = {}
    for value in model.graph.input:
        if value.name == "input_ids":
            feeds[value.name] = rng.integers(0, 200, (batch, new)).astype(np.int64)
        elif value.name == "position_ids":
            feeds[value.name] = np.tile(np.arange(new, dtype=np.int64), (batch, 1))
        elif value.name == "attention_mask":
            feeds[value.name] = np.ones((batch, new), np.int64)
        elif value.name.startswith("past_key_values."):
            dims = value.type.tensor_type.shape.dim
            feeds[value.name] = np.zeros((batch, dims[1].dim_value, 0, dims[3].dim_value), np.float32)
    return feeds


def test_the_rewritten_decoder_gives_the_original_logits_at_the_rows_named():
    import onnxruntime as ort

    original = generative.decoder_model(vocab=300, seed=3)
    rewritten = copy.deepcopy(original)
    assert select_logits_rows(rewritten) and not select_logits_rows(rewritten)  # once
    onnx.checker.check_model(rewritten)
    batch, new = 3, 7
    feeds = _feeds(original, batch, new, np.random.default_rng(0))
    want = ort.InferenceSession(original.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        ["logits"], feeds)[0]
    rows = np.array([6, 7 + 2, 14 + 0], np.int64)  # flat: batch b, column c -> b * new + c
    got = ort.InferenceSession(rewritten.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        ["logits"], {**feeds, LOGITS_ROWS: rows})[0]
    assert got.shape == (3, 1, 300)
    np.testing.assert_allclose(got[:, 0], want.reshape(batch * new, 300)[rows], rtol=1e-5, atol=1e-5)


def _head_graph(tail: list[onnx.NodeProto], head_input: str = "h") -> onnx.ModelProto:
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 5], np.ones(20, np.float32))
    nodes = [helper.make_node("MatMul", [head_input, "w"], ["m"]), *tail]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("h", TensorProto.FLOAT, ["b", "s", 4])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", 5])],
                              initializer=[w, helper.make_tensor("bias", TensorProto.FLOAT, [5], np.ones(5))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_the_head_is_found_through_row_wise_ops_and_other_graphs_are_left_alone():
    through = _head_graph([helper.make_node("Add", ["m", "bias"], ["a"]),
                           helper.make_node("Cast", ["a"], ["logits"], to=TensorProto.FLOAT)])
    assert select_logits_rows(through)
    flatten = next(n for n in through.graph.node if n.op_type == "Flatten")
    assert flatten.input == ["h"] and next(n for n in through.graph.node if n.op_type == "MatMul").input[0] != "h"
    assert [d.dim_param or d.dim_value for d in through.graph.output[0].type.tensor_type.shape.dim] == \
        ["logits_rows_count", 1, 5]
    softmax = _head_graph([helper.make_node("Softmax", ["m"], ["logits"], axis=-1)])  # not row-wise here: across
    before = softmax.SerializeToString()
    assert not select_logits_rows(softmax) and softmax.SerializeToString() == before
    two_inputs = _head_graph([helper.make_node("Add", ["m", "h2"], ["logits"])])  # a second varying input
    assert not select_logits_rows(two_inputs)


@pytest.mark.parametrize("new", [1, 9])
def test_a_decoder_engine_takes_logits_rows_and_runs_the_head_for_them(tiny_engine, new):
    from engine_core.generate import DecoderRunner

    assert tiny_engine.get_tensor_shape("logits")[1] == 1
    runner = DecoderRunner(tiny_engine)
    assert runner.signature.has_logits_rows
    pool = runner.new_pool(block_tokens=8, num_blocks=20)
    logits = runner.prefill(pool, ["a", "b"], [[1, 2, 3][:new] or [1], list(range(10, 10 + new))])
    assert logits.shape == (2, runner.signature.vocab_size)
