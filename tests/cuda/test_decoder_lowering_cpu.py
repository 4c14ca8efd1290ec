"""A decoder step with a KV cache (examples/generative.py's tiny decoder) as the CUDA backend lowers it for the
generator's decode shapes: one new token per sequence after a past, a padded row, fp32 and fp16 with the KV I/O in
fp16 as `build_decoder_engine` binds it. The attention fuses (into the flash kernel in fp16), the head Transposes of
the one new token are aliases, and every launch, emulated on the host (tests/cuda/emulate.py), gives what the
reference interpreter gives for the same graph."""

from __future__ import annotations

from collections import Counter
from functools import partial

import numpy as np
import pytest

import engine_core as kiln
from engine_core.backends.cuda.lowering import LoweringOptions, lower_graph
from engine_core.builder import _working_copy
from engine_core.generate.decoder import _half_kv_io
from engine_core.interpret import GraphRunner
from engine_core.ops import TensorInfo
from engine_core.passes import FUSION_PASSES, PRE_PASSES, infer_shapes
from engine_core.passes.reduce_precision import precision_policy, reduce_precision
from tests.cuda.emulate import Emulator
from tests.support.examples import load_example

BATCH, PAST = 3, 20


def _decode_feeds(graph, rng: np.random.Generator) -> dict[str, np.ndarray]:
    feeds = {}
    for v in graph.inputs:
        if v.name == "input_ids":
            feeds[v.name] = rng.integers(0, 200, (BATCH, 1)).astype(v.dtype)
        elif v.name == "position_ids":
            feeds[v.name] = np.full((BATCH, 1), PAST, v.dtype)
        elif v.name == "attention_mask":
            feeds[v.name] = np.ones((BATCH, PAST + 1), v.dtype)
            feeds[v.name][0, :4] = 0  # a left-padded row, as the generator batches shorter pasts
        else:
            feeds[v.name] = (rng.standard_normal((BATCH, v.shape[1], PAST, v.shape[3])) * 0.5).astype(v.dtype)
    return feeds


@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16"])
def test_a_decode_step_lowers_with_fused_attention_and_emulates_like_the_interpreter(tmp_path, fp16):
    directory = load_example("generative.py").write_tiny_decoder(tmp_path / "1", head_dim=32)  # a flash head size
    builder = kiln.Builder()
    network = builder.create_network()
    assert kiln.OnnxParser(network).parse_from_file(str(directory / "model.onnx"))
    config = builder.create_builder_config()
    if fp16:
        config.set_flag(kiln.BuilderFlag.FP16)
        _half_kv_io(network)
    graph = _working_copy(network.graph)
    for graph_pass in (*PRE_PASSES, partial(reduce_precision, policy=precision_policy(config, network)),
                       *FUSION_PASSES):
        graph_pass(graph)
    feeds = _decode_feeds(graph, np.random.default_rng(0))
    infos = infer_shapes(graph, {k: TensorInfo(x.dtype, x.shape) for k, x in feeds.items()})
    lowered = lower_graph(graph, infos, None, LoweringOptions(cudnn=False, tf32=False))
    steps = Counter(s.node.op_type for s in lowered.steps)
    assert steps["Attention"] == 2 and not steps["Softmax"], steps
    # the head split and merge of one new token move only dims of size 1: aliases, not copies
    assert {s.tactic for s in lowered.steps if s.node.op_type == "Transpose"} == {"view"}
    if fp16:  # (strict fp32 attention runs as GEMMs around a softmax kernel: the flash kernel computes in TF32)
        assert {s.tactic for s in lowered.steps if s.node.op_type == "Attention"} == {"kernel:flash_attention"}
    got, want = Emulator(graph, lowered, feeds).run(), GraphRunner(graph).run(feeds)
    tolerance = 1.5e-2 if fp16 else 2e-5  # fp16: the flash kernel rounds once, the interpreter after every op
    for name, value in want.items():
        np.testing.assert_allclose(got[name].astype(np.float32), value.astype(np.float32), rtol=tolerance,
                                   atol=tolerance, err_msg=name)
