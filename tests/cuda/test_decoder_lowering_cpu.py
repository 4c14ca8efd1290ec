"""A decoder step with a KV cache (examples/generative.py's tiny decoder) as the CUDA backend lowers it for the
generator's decode shapes: one new token per sequence after a past, a padded row, fp32 and fp16 with the KV I/O in
fp16 as `build_decoder_engine` binds it. The attention fuses (into the flash kernel in fp16), the head Transposes of
the one new token are aliases, and every launch, emulated on the host (tests/cuda/emulate.py), gives what the
reference interpreter gives for the same graph. The same decoder rewritten the way GPT-2 exports its attention (one
packed q/k/v projection and a Split, a one-input Concat of the first past) lowers the Split and that Concat to views.
"""

from __future__ import annotations

from collections import Counter
from functools import partial
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

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
        elif v.name == "logits_rows":  # build_decoder_engine's input (logits_rows.py): row b's one token is at b
            feeds[v.name] = np.arange(BATCH, dtype=v.dtype)
        else:
            feeds[v.name] = (rng.standard_normal((BATCH, v.shape[1], PAST, v.shape[3])) * 0.5).astype(v.dtype)
    return feeds


def _lowered_decode_step(model_path: Path, fp16: bool):
    """(graph after the builder's passes, decode feeds, the CUDA lowering at their shapes)."""
    builder = kiln.Builder()
    network = builder.create_network()
    assert kiln.OnnxParser(network).parse_from_file(str(model_path))
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
    return graph, feeds, lower_graph(graph, infos, None, LoweringOptions(cudnn=False, tf32=False))


def _emulates_like_the_interpreter(graph, lowered, feeds, fp16: bool) -> None:
    got, want = Emulator(graph, lowered, feeds).run(), GraphRunner(graph).run(feeds)
    tolerance = 1.5e-2 if fp16 else 2e-5  # fp16: the flash kernel rounds once, the interpreter after every op
    for name, value in want.items():
        np.testing.assert_allclose(got[name].astype(np.float32), value.astype(np.float32), rtol=tolerance,
                                   atol=tolerance, err_msg=name)


@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16"])
def test_a_decode_step_lowers_with_fused_attention_and_emulates_like_the_interpreter(tmp_path, fp16):
    directory = load_example("generative.py").write_tiny_decoder(tmp_path / "1", head_dim=32)  # a flash head size
    graph, feeds, lowered = _lowered_decode_step(directory / "model.onnx", fp16)
    steps = Counter(s.node.op_type for s in lowered.steps)
    assert steps["Attention"] == 2 and not steps["Softmax"], steps
    # the head split and merge of one new token move only dims of size 1: aliases, not copies
    assert {s.tactic for s in lowered.steps if s.node.op_type == "Transpose"} == {"view"}
    if fp16:  # (strict fp32 attention runs as GEMMs around a softmax kernel: the flash kernel computes in TF32)
        assert {s.tactic for s in lowered.steps if s.node.op_type == "Attention"} == {"kernel:flash_attention"}
    _emulates_like_the_interpreter(graph, lowered, feeds, fp16)


def _gpt2_style(model: onnx.ModelProto, layers: int) -> onnx.ModelProto:
    """``model`` (the tiny decoder) with GPT-2's export forms: each layer's q, k, v projections one MatMul by the
    three weights side by side, one bias Add and a Split along the last axis into the three (c_attn); and the first
    past read through a Concat of that one input (the export's ``/Concat``)."""
    graph = model.graph
    weights = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    readers = {name: [n for n in graph.node if name in n.input] for name in weights}
    for layer in range(layers):
        parts = [f"l{layer}.{p}" for p in "qkv"]
        matmuls = [readers[f"{p}.weight"][0] for p in parts]
        adds = [next(n for n in graph.node if n.op_type == "Add" and m.output[0] in n.input) for m in matmuls]
        for name, value in ((f"l{layer}.qkv.weight", np.concatenate([weights[f"{p}.weight"] for p in parts], 1)),
                            (f"l{layer}.qkv.bias", np.concatenate([weights[f"{p}.bias"] for p in parts]))):
            graph.initializer.append(numpy_helper.from_array(value, name))
        width = weights[f"{parts[0]}.bias"].shape[0]
        graph.initializer.append(numpy_helper.from_array(np.array([width] * 3, np.int64), f"l{layer}.qkv.split"))
        packed = [helper.make_node("MatMul", [matmuls[0].input[0], f"l{layer}.qkv.weight"], [f"l{layer}.qkv.mm"]),
                  helper.make_node("Add", [f"l{layer}.qkv.mm", f"l{layer}.qkv.bias"], [f"l{layer}.qkv"]),
                  helper.make_node("Split", [f"l{layer}.qkv", f"l{layer}.qkv.split"], [a.output[0] for a in adds],
                                   axis=-1, name=f"l{layer}.qkv.Split")]
        at = list(graph.node).index(matmuls[0])
        for node in (*matmuls, *adds):
            graph.node.remove(node)
        for offset, node in enumerate(packed):
            graph.node.insert(at + offset, node)
    for node in graph.node:
        node.input[:] = ["past0" if i == "past_key_values.0.key" else i for i in node.input]
    graph.node.insert(0, helper.make_node("Concat", ["past_key_values.0.key"], ["past0"], axis=-2, name="/Concat"))
    onnx.checker.check_model(model)
    return model


@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16"])
def test_the_packed_projection_split_and_a_one_input_concat_are_views(tmp_path, fp16):
    """GPT-2's q/k/v Split of c_attn's output is three views of it at their offsets (movement._lower_split), read
    through its strides by the head Reshapes and Transposes (views of views), the K/V Concats and the flash kernel:
    no copies, no reformats. Its one-input Concat of the first past is a view of the past."""
    directory = load_example("generative.py").write_tiny_decoder(tmp_path / "1", head_dim=32)
    path = tmp_path / "gpt2_style.onnx"
    onnx.save(_gpt2_style(onnx.load(str(directory / "model.onnx")), layers=2), str(path))
    graph, feeds, lowered = _lowered_decode_step(path, fp16)
    tactics = {s.node.name: s.tactic for s in lowered.steps}
    assert tactics["l0.qkv.Split"] == tactics["l1.qkv.Split"] == tactics["/Concat"] == "view"
    assert not any(s.tactic.startswith("reformat") for s in lowered.steps), [s.node.name for s in lowered.steps]
    split = next(s for s in lowered.steps if s.node.name == "l0.qkv.Split")
    packed = split.node.inputs[0]
    for index, part in enumerate(split.node.outputs):  # each part: the packed tensor's bytes from its offset on
        assert lowered.layouts[part] == "strided"
        assert lowered.locations[part] == ("arena", lowered.locations[packed][1] + index * 64 * (2 if fp16 else 4))
    attention = next(s for s in lowered.steps if s.node.op_type == "Attention")
    assert lowered.layouts[attention.node.inputs[0]] == "strided"  # the query's head view of its part
    _emulates_like_the_interpreter(graph, lowered, feeds, fp16)


@pytest.mark.gpu
def test_the_gpt2_style_decode_step_on_the_gpu_matches_the_cpu_engine(tmp_path):
    """On the device: the flash kernel reads the query straight out of the packed projection (a Split view) and the
    concat kernel the new key and value, in the fp16 decoder engine the generator builds; logits and presents as
    the CPU engine computes them."""
    from engine_core.generate import build_decoder_engine

    directory = load_example("generative.py").write_tiny_decoder(tmp_path / "1", head_dim=32)
    path = tmp_path / "gpt2_style.onnx"
    onnx.save(_gpt2_style(onnx.load(str(directory / "model.onnx")), layers=2), str(path))
    engines = {backend: build_decoder_engine(path, max_batch_size=4, max_context=64, backend=backend,
                                             fp16=backend == "cuda") for backend in ("cpu", "cuda")}
    steps = {layer["name"]: layer["tactic"] for layer in engines["cuda"].plan.layers}
    assert steps["l0.qkv.Split"] == steps["/Concat"] == "view", steps
    feeds = _decode_feeds(engines["cpu"].plan.graph, np.random.default_rng(1))
    outputs = {}
    for backend, engine in engines.items():
        half = {k: v.astype(np.float16) if backend == "cuda" and k.startswith("past_") else v for k, v in feeds.items()}
        outputs[backend] = engine.create_execution_context().infer(half)
    for name, want in outputs["cpu"].items():
        np.testing.assert_allclose(outputs["cuda"][name].astype(np.float32), want, rtol=2e-2, atol=2e-2, err_msg=name)
