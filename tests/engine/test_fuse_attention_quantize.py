"""fuse_attention_quantize: an Attention read only by an int8 QuantizeLinear becomes one kiln.AttentionQuantize,
equal to the unfused pair; what must stay unfused stays; the CUDA lowering (emulated) is one flash_attention_q
launch, or for a head size without a flash kernel the batched-GEMM attention into scratch and a QuantizeLinear
kernel."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import engine_core as kiln
from engine_core.interpret import GraphRunner
from engine_core.passes import fuse_attention_quantize
from tests.engine.util import build, parsed_graph

SCALE = 0.01


def _model(dim: int = 32, mask_rows: int = 1, scale=np.float32(SCALE), zero=np.int8(0), keep_y: bool = False):
    """q = QuantizeLinear(Attention(q, k, v, mask), scale, zero), fp16 3-D operands [2, 16, 4 * dim] (4 heads); the
    additive mask is [2, 1, mask_rows, 16] (1: one row for every query, BERT's padding mask)."""
    n = helper.make_node
    width = 4 * dim
    qdq = ["y", "scale", "zero"] if zero is not None else ["y", "scale"]
    nodes = [n("Attention", ["q", "k", "v", "mask"], ["y"], name="attention", q_num_heads=4, kv_num_heads=4),
             n("QuantizeLinear", qdq, ["yq"], name="quantize")]
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT16, [2, 16, width]) for name in "qkv"]
    inputs.append(helper.make_tensor_value_info("mask", TensorProto.FLOAT16, [2, 1, mask_rows, 16]))
    outputs = [helper.make_tensor_value_info("yq", TensorProto.INT8 if zero is None or zero.dtype == np.int8
                                             else TensorProto.UINT8, None)]
    if keep_y:
        outputs.append(helper.make_tensor_value_info("y", TensorProto.FLOAT16, None))
    inits = [numpy_helper.from_array(np.asarray(scale), "scale")]
    if zero is not None:
        inits.append(numpy_helper.from_array(np.asarray(zero), "zero"))
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    return model


def _feeds(dim: int = 32, mask_rows: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    feeds = {name: rng.standard_normal((2, 16, 4 * dim)).astype(np.float16) for name in "qkv"}
    feeds["mask"] = np.zeros((2, 1, mask_rows, 16), np.float16)
    feeds["mask"][1, ..., 11:] = -10000  # batch 1's last keys are padding
    return feeds


def test_quantize_of_an_attention_becomes_one_layer():
    model, feeds = _model(), _feeds()
    graph = parsed_graph(model)
    want = GraphRunner(parsed_graph(model)).run(feeds)
    assert fuse_attention_quantize(graph) == 1
    (node,) = graph.nodes
    assert (node.domain, node.op_type) == ("kiln", "AttentionQuantize")
    assert node.inputs == ["q", "k", "v", "mask", "scale", "zero"] and node.outputs == ["yq"]
    assert node.origin == ["attention", "quantize"] and node.attrs["q_num_heads"] == 4
    got = GraphRunner(graph).run(feeds)
    assert got["yq"].dtype == np.int8 and np.abs(got["yq"]).max() > 50  # the scale uses the int8 range
    np.testing.assert_array_equal(got["yq"], want["yq"])


@pytest.mark.parametrize("case", [dict(scale=np.full(128, SCALE, np.float32)), dict(zero=np.int8(3)),
                                  dict(zero=np.uint8(0)), dict(keep_y=True)],
                         ids=["per-channel-scale", "zero-point-3", "uint8", "float-output-also-read"])
def test_what_must_stay_unfused_stays(case):
    graph = parsed_graph(_model(**case))
    assert fuse_attention_quantize(graph) == 0
    assert [n.op_type for n in graph.nodes] == ["Attention", "QuantizeLinear"]


@pytest.mark.parametrize("dim, mask_rows, launches", [
    (32, 1, ["flash_attention_q_32_f16"]),   # BERT's padding mask: one staged bias row per key tile
    (32, 16, ["flash_attention_q_32_f16"]),  # a mask per query row: [64][64] staged biases
    # no flash kernel for 48: Q, K, V to [batch, heads, seq, dim] copies, the GEMMs around the softmax, Y's copy
    # back to [batch, seq, heads * dim], then the QuantizeLinear kernel
    (48, 1, ["pw", "pw", "pw", "Gemm", "attn_softmax_add_warp_f16", "Gemm", "pw", "pw"]),
], ids=["flash-row-mask", "flash-full-mask", "unfused"])
def test_cuda_lowering_emulated_equals_the_cpu_backend(dim, mask_rows, launches):
    from engine_core.backends.cuda.lowering import Launch, flash_shared_bytes
    from tests.cuda.emulate import Emulator
    from tests.cuda.models import lowered_at, optimized_graph

    model, feeds = _model(dim, mask_rows), _feeds(dim, mask_rows)
    graph = optimized_graph(model, feeds)
    lowered = lowered_at(graph, feeds)
    (step,) = [s for s in lowered.steps if s.node.op_type == "AttentionQuantize"]
    assert [type(op).__name__ if not isinstance(op, Launch) else op.function if op.program is None
            else op.function.split("_")[0] for op in step.ops] == launches
    if dim == 32:
        assert step.tactic == "kernel:flash_attention_q" and step.scratch == []
        assert step.ops[0].shared_bytes == flash_shared_bytes(32, "f16", mask_rows > 1) \
            == (64 + 4 * 64) * 40 * 2 + 2 * (64 * (64 * 4 + 16) if mask_rows > 1 else 64 * 4)
    got, want = Emulator(graph, lowered, feeds).run(), GraphRunner(graph).run(feeds)
    steps = np.abs(got["yq"].astype(np.int32) - want["yq"])  # float64 softmax in the emulator: ties may round apart
    assert steps.max() <= 1 and np.mean(steps > 0) < 0.02


def test_the_quantizing_kernels_compile_for_sm90(tmp_path, monkeypatch):
    from engine_core.cuda.nvrtc import compile_kernel_file

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    cubin = compile_kernel_file("flash_attention", "sm_90")
    for name in ("flash_attention_q_64_f16", "flash_attention_q_128_bf16", "flash_attention_q_32_tf32",
                 "flash_attention_64_f16"):
        assert name.encode() in cubin


@pytest.mark.gpu
@pytest.mark.parametrize("dim, mask_rows", [(64, 1), (64, 16), (128, 1)])
def test_flash_attention_q_on_the_gpu_matches_the_cpu_backend(dim, mask_rows):
    """The kernel's int8 output against the CPU backend's Attention -> QuantizeLinear: the fp16 attention values
    differ by a few 1e-3, so a value near a rounding boundary may land one step apart."""
    model, feeds = _model(dim, mask_rows), _feeds(dim, mask_rows)
    shapes = {name: (value.shape,) * 3 for name, value in feeds.items()}
    gpu = kiln.Runtime().load(build(model, shapes, "cuda"))
    assert {layer["type"]: layer["tactic"] for layer in gpu.plan.layers}["AttentionQuantize"] == "kernel:flash_attention_q"
    got = gpu.create_execution_context().infer(feeds)["yq"]
    want = kiln.Runtime().load(build(model, shapes)).create_execution_context().infer(feeds)["yq"]
    assert got.dtype == np.int8 and np.abs(want).max() > 50
    steps = np.abs(got.astype(np.int32) - want)
    assert steps.max() <= 1 and np.mean(steps > 0) < 0.05
