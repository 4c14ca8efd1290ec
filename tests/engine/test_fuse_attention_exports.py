"""fuse_attention on the forms today's exporters write (the zoo's transformers), each as a small onnx.helper graph.

- sdpa (torch's scaled_dot_product_attention symbolic: GPT-2, T5, Whisper, Llama, ViT): Q and K^T each multiplied by
  sqrt(scale), a constant or computed at run time from ``q.shape[-1]``; an additive mask made with Where(pad, 0, -inf);
  Where(IsNaN(p), 0, p) after the softmax; the output reshaped to its own shape before the head merge;
- T5: no scaling (Mul by 1), the relative position bias [1, H, S, S] added to the scores, and in its first layer a
  second Transpose of K read for the key length;
- Llama: rotary embeddings on Q and K, K and V repeated per query-head group (``repeat_kv``, with torch's expand
  idiom Where(Equal(shape, -1), 1, shape)).

Each case: the graph as the pipeline hands it to fuse_attention runs on the CPU backend before and after the pass with
the same outputs, the Attention node is there with the inputs and scale the computation means, fold_attention_heads
then removes the head copies where the shapes allow it, and a whole build computes what onnxruntime computes. The fp16
forms also lower for CUDA to the flash kernel (emulated launches against the CPU backend).
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
from engine_core.backends.cuda.lowering import lower_graph
from engine_core.interpret import GraphRunner
from engine_core.ir import Graph, Node
from engine_core.ops import TensorInfo
from engine_core.passes import PIPELINE, fold_attention_heads, fuse_attention, infer_shapes
from tests.cuda.emulate import Emulator
from tests.engine.util import build, ort_run, parsed_graph

HEADS, KV_HEADS, SIZE, SEQ = 4, 2, 8, 6
HIDDEN = HEADS * SIZE
INT64_MAX = np.iinfo(np.int64).max


class _Net:
    """A graph under construction: each ``op`` adds a node and returns its output's name."""

    def __init__(self, rng: np.random.Generator, dtype: int = TensorProto.FLOAT, size: int = SIZE) -> None:
        self.rng, self.dtype, self.np_dtype = rng, dtype, helper.tensor_dtype_to_np_dtype(dtype)
        self.size, self.hidden = size, HEADS * size  # head size, model width
        self.nodes: list[onnx.NodeProto] = []
        self.inits: dict[str, np.ndarray] = {}
        self.inputs: list[onnx.ValueInfoProto] = []

    def const(self, value, dtype=None) -> str:
        name = f"c{len(self.inits)}"
        self.inits[name] = np.asarray(value, dtype or np.asarray(value).dtype)
        return name

    def float(self, value) -> str:
        """A scalar of the graph's float type."""
        return self.const(np.asarray(value, self.np_dtype))

    def weight(self, *shape: int) -> str:
        """A weight scaled to keep activations near 1 (sharp softmaxes would magnify fp16 rounding)."""
        return self.const((self.rng.standard_normal(shape) / math.sqrt(shape[0])).astype(self.np_dtype))

    def op(self, op_type: str, *inputs: str, **attrs) -> str:
        out = f"{op_type.lower()}{len(self.nodes)}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, **attrs))
        return out

    def input(self, name: str, shape: list, dtype: int | None = None) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, dtype or self.dtype, shape))
        return name

    def dims(self, tensor: str, *axes: int) -> list[str]:
        """torch.onnx.export's dynamic dims: Unsqueeze(Gather(Shape(t), axis), [0]) each."""
        shape = self.op("Shape", tensor)
        return [self.op("Unsqueeze", self.op("Gather", shape, self.const(np.int64(a)), axis=0), self.const([0]))
                for a in axes]

    def model(self, output: str) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, "g", self.inputs, [helper.make_tensor_value_info(output, self.dtype, None)],
                                  [numpy_helper.from_array(v, k) for k, v in self.inits.items()])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 10
        return model

    # -- the pieces of a transformer layer ------------------------------------------------------------------------

    def split(self, x: str, heads: int) -> str:
        """The [B, S, heads, D] split of a projection of ``x`` (torch's dynamic target)."""
        return self.op("Reshape", self.op("MatMul", x, self.weight(self.hidden, heads * self.size)),
                       self.op("Concat", *self.dims(x, 0, 1), self.const([-1]), self.const([self.size]), axis=0))

    def heads(self, x: str, heads: int) -> str:
        """The split's [B, H, S, D] transpose."""
        return self.op("Transpose", self.split(x, heads), perm=[0, 2, 1, 3])

    def sdpa_scale(self, q: str, runtime: bool) -> str:
        """sqrt(scale) as torch's sdpa symbolic multiplies Q and K^T by it: a constant, or ViT's run-time one."""
        if not runtime:
            return self.float(math.sqrt(1 / math.sqrt(self.size)))
        last = self.op("Cast", self.op("Slice", self.op("Shape", q), self.const([-1]), self.const([INT64_MAX])), to=1)
        return self.op("Sqrt", self.op("Cast", self.op("Div", self.const(np.float32([1.0])), self.op("Sqrt", last)),
                                       to=1))

    def softmax_times(self, scores: str, v: str, guard: bool) -> str:
        p = self.op("Softmax", scores, axis=-1)
        if guard:  # sdpa: rows with every key masked are NaN, made 0
            p = self.op("Where", self.op("IsNaN", p), self.float(0.0), p)
        return self.op("MatMul", p, v)

    def same_shape(self, out: str, q: str, v: str) -> str:
        """transformers' sdpa path: the output reshaped to [B, -1, Sq, Dv] read from Q and V (its own shape)."""
        batch, = self.dims(out, 0)
        return self.op("Reshape", out, self.op("Concat", batch, self.const([-1]), *self.dims(q, 2), *self.dims(v, 3),
                                               axis=0))

    def merge(self, out: str, x: str) -> str:
        """[B, H, S, D] -> Transpose -> Reshape [B, S, H*D] -> the output projection."""
        merged = self.op("Reshape", self.op("Transpose", out, perm=[0, 2, 1, 3]),
                         self.op("Concat", *self.dims(x, 0, 1), self.const([-1]), axis=0))
        return self.op("MatMul", merged, self.weight(self.hidden, self.hidden))


def _sdpa(rng: np.random.Generator, dtype: int = TensorProto.FLOAT, size: int = SIZE,
          runtime_scale: bool = False) -> onnx.ModelProto:
    """GPT-2 / Whisper / ViT as sdpa exports them: K^T one Transpose(0, 2, 3, 1) of the split (or a swap of the
    transposed heads, ViT), sqrt(scale) on Q and K^T, a padding mask made additive, the NaN guard, the output
    reshaped to its own shape."""
    n = _Net(rng, dtype, size)
    x, pad = n.input("x", ["batch", SEQ, n.hidden]), n.input("pad", ["batch", SEQ], TensorProto.BOOL)
    q = n.heads(x, HEADS)
    if runtime_scale:
        kt = n.op("Transpose", n.heads(x, HEADS), perm=[0, 1, 3, 2])
    else:
        kt = n.op("Transpose", n.split(x, HEADS), perm=[0, 2, 3, 1])
    v = n.heads(x, HEADS)
    scale = n.sdpa_scale(q, runtime_scale)
    scores = n.op("MatMul", n.op("Mul", q, scale), n.op("Mul", kt, scale))
    mask = n.op("Where", n.op("Unsqueeze", pad, n.const([1, 2])), n.float(0.0), n.float(-np.inf))
    out = n.softmax_times(n.op("Add", scores, mask), v, guard=True)
    return n.model(n.merge(n.same_shape(out, q, v), x))


def _t5(rng: np.random.Generator, dtype: int = TensorProto.FLOAT, size: int = SIZE) -> onnx.ModelProto:
    """T5's encoder layer 0: Q and K^T times 1, a relative position bias [1, H, S, S] (a table gathered by buckets
    sliced to the key length, which a Shape of a second Transpose of K reads) added to the scores."""
    n = _Net(rng, dtype, size)
    x = n.input("x", ["batch", SEQ, n.hidden])
    q = n.heads(x, HEADS)
    k_split = n.split(x, HEADS)
    key_length = n.dims(n.op("Transpose", k_split, perm=[0, 2, 1, 3]), 2)[0]
    buckets = n.op("Slice", n.const(rng.integers(0, 5, (SEQ, SEQ))), n.const([0]), key_length, n.const([1]))
    table = n.const((rng.standard_normal((5, HEADS))).astype(n.np_dtype))
    bias = n.op("Unsqueeze", n.op("Transpose", n.op("Gather", table, buckets), perm=[2, 0, 1]), n.const([0]))
    kt = n.op("Transpose", k_split, perm=[0, 2, 3, 1])
    v = n.heads(x, HEADS)
    one = n.float(1.0)
    scores = n.op("Add", n.op("MatMul", n.op("Mul", q, one), n.op("Mul", kt, one)), bias)
    out = n.softmax_times(scores, v, guard=False)
    return n.model(n.merge(n.same_shape(out, q, v), x))


def _rotary(n: _Net, t: str) -> str:
    """Llama's rotary embedding of [B, H, S, D]: t * cos + rotate_half(t) * sin."""
    angles = np.arange(SEQ)[:, None] * (0.5 ** np.arange(n.size // 2))[None]
    cos, sin = (n.const(np.concatenate([f(angles)] * 2, -1)[None, None].astype(n.np_dtype)) for f in (np.cos, np.sin))
    half = n.const([n.size // 2])
    first, second = n.op("Slice", t, n.const([0]), half, n.const([3])), n.op("Slice", t, half, n.const([INT64_MAX]),
                                                                               n.const([3]))
    rotated = n.op("Concat", n.op("Neg", second), first, axis=-1)
    return n.op("Add", n.op("Mul", t, cos), n.op("Mul", rotated, sin))


def _repeat_kv(n: _Net, t: str, groups: int, batch_dim: str = "") -> str:
    """transformers' repeat_kv: Unsqueeze(2) -> Expand [B, KV, n, S, D] (torch's expand: Where(Equal(s, -1), 1, s))
    -> Reshape [B, KV * n, S, D]; ``batch_dim``: a constant batch size to expand to instead of K's own."""
    b, h, s, d = n.dims(t, 0, 1, 2, 3)
    sizes = n.op("Reshape", n.op("Concat", n.const([int(batch_dim)]) if batch_dim else b, h, n.const([groups]), s, d,
                                 axis=0), n.const([-1]))
    ones = n.op("ConstantOfShape", n.op("Shape", sizes), value=numpy_helper.from_array(np.array([1], np.int64)))
    sizes = n.op("Where", n.op("Equal", sizes, n.op("Mul", ones, n.const(np.int64(-1)))), ones, sizes)
    expanded = n.op("Expand", n.op("Unsqueeze", t, n.const([2])), sizes)
    b, h, s, d = n.dims(t, 0, 1, 2, 3)
    return n.op("Reshape", expanded, n.op("Concat", b, n.op("Mul", h, n.const(np.int64(groups))), s, d, axis=0))


def _llama(rng: np.random.Generator, dtype: int = TensorProto.FLOAT, size: int = SIZE,
           batch_dim: str = "") -> onnx.ModelProto:
    """Llama: rotary Q and K, grouped-query K/V (KV_HEADS for HEADS) repeated with repeat_kv, sdpa's scaling, a
    padding mask and the NaN guard, the output reshaped to its own shape (V's Shape read for it)."""
    n = _Net(rng, dtype, size)
    x, pad = n.input("x", ["batch", SEQ, n.hidden]), n.input("pad", ["batch", SEQ], TensorProto.BOOL)
    q = _rotary(n, n.heads(x, HEADS))
    k = _repeat_kv(n, _rotary(n, n.heads(x, KV_HEADS)), HEADS // KV_HEADS, batch_dim)
    v = _repeat_kv(n, n.heads(x, KV_HEADS), HEADS // KV_HEADS, batch_dim)
    scale = n.sdpa_scale(q, False)
    scores = n.op("MatMul", n.op("Mul", q, scale), n.op("Mul", n.op("Transpose", k, perm=[0, 1, 3, 2]), scale))
    mask = n.op("Where", n.op("Unsqueeze", pad, n.const([1, 2])), n.float(0.0), n.float(-np.inf))
    out = n.softmax_times(n.op("Add", scores, mask), v, guard=True)
    return n.model(n.merge(n.same_shape(out, q, v), x))


def _feeds(model: onnx.ModelProto, rng: np.random.Generator, batch: int = 3) -> dict[str, np.ndarray]:
    """x, and a padding mask with the last keys of one sequence and every key of another masked."""
    x = model.graph.input[0].type.tensor_type
    hidden = x.shape.dim[2].dim_value
    feeds = {"x": rng.standard_normal((batch, SEQ, hidden)).astype(helper.tensor_dtype_to_np_dtype(x.elem_type))}
    if any(i.name == "pad" for i in model.graph.input):
        pad = np.ones((batch, SEQ), bool)
        pad[0, SEQ - 2:] = False
        pad[1] = False
        feeds["pad"] = pad
    return feeds


def _before_fusion(model: onnx.ModelProto) -> Graph:
    """The graph as fuse_attention sees it in the pipeline."""
    graph = parsed_graph(model)
    for graph_pass in PIPELINE[:PIPELINE.index(fuse_attention)]:
        graph_pass(graph)
    return graph


def _fused(model: onnx.ModelProto, rng: np.random.Generator) -> tuple[Graph, Node]:
    """The graph after fuse_attention (one Attention, its outputs those of the graph before it) and its Attention."""
    before = _before_fusion(model)
    after = copy.deepcopy(before)
    assert fuse_attention(after) == 1
    ops = Counter(n.op_type for n in after.nodes)
    assert ops["Attention"] == 1 and not ops["Softmax"] and not ops["IsNaN"]
    feeds = _feeds(model, rng)
    expected, got = GraphRunner(before).run(feeds), GraphRunner(after).run(feeds)
    for name in before.output_names:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-5, err_msg=name)
    return after, next(n for n in after.nodes if n.op_type == "Attention")


def _folds_and_matches_onnxruntime(model: onnx.ModelProto, graph: Graph, rng: np.random.Generator) -> None:
    """fold_attention_heads packs the Attention (no head Transposes left), and a build matches onnxruntime."""
    assert fold_attention_heads(graph) == 1
    assert not [n for n in graph.nodes if n.op_type == "Transpose" and n.attrs.get("perm") == [0, 2, 1, 3]]
    feeds = _feeds(model, rng)
    plan = build(model, {k: ((1, *v.shape[1:]), v.shape, (4, *v.shape[1:])) for k, v in feeds.items()})
    got = kiln.Runtime().load(plan).create_execution_context().infer(feeds)
    np.testing.assert_allclose(got[model.graph.output[0].name], ort_run(model, feeds)[0], rtol=1e-4, atol=1e-5)


# -- the forms --------------------------------------------------------------------------------------------------------


def test_sdpa_constant_scale_mask_guard_and_same_shape_reshape(rng):
    model = _sdpa(rng)
    graph, attention = _fused(model, rng)
    assert attention.attrs == {"scale": pytest.approx(1 / math.sqrt(SIZE))}
    assert len(attention.inputs) == 4  # the additive mask (Where(pad, 0, -inf)), as it is or expanded to the keys
    # the Attention writes what the Reshape to its own shape wrote: the head merge Transpose reads it
    assert any(n.op_type == "Transpose" and n.inputs == attention.outputs for n in graph.nodes)
    _folds_and_matches_onnxruntime(model, graph, rng)


def test_sdpa_scale_computed_at_run_time_from_the_head_size(rng):
    """ViT's sdpa: sqrt(1 / sqrt(q.shape[-1])) on Q and on K^T (a swap of the transposed heads); the head size is
    the Reshape target's constant, so the scale is a number."""
    model = _sdpa(rng, runtime_scale=True)
    graph, attention = _fused(model, rng)
    assert attention.attrs == {"scale": pytest.approx(1 / math.sqrt(SIZE))}
    assert not [n for n in graph.nodes if n.op_type in ("Sqrt", "Div")]  # the scale's arithmetic went with it
    _folds_and_matches_onnxruntime(model, graph, rng)


def test_a_run_time_scale_of_an_unknown_head_size_is_the_default_scale(rng):
    """Q/K/V [b, h, s, d] graph inputs, d unknown until run time: Attention's default scale, 1 / sqrt(d)."""
    n = _Net(rng)
    q, k, v = (n.input(t, ["b", "h", "s", "d"]) for t in "qkv")
    scale = n.sdpa_scale(q, runtime=True)
    out = n.softmax_times(n.op("MatMul", n.op("Mul", q, scale), n.op("Mul", n.op("Transpose", k, perm=[0, 1, 3, 2]),
                                                                      scale)), v, guard=False)
    graph = _before_fusion(n.model(out))
    before = copy.deepcopy(graph)
    assert fuse_attention(graph) == 1
    (attention,) = [node for node in graph.nodes if node.op_type == "Attention"]
    assert attention.inputs == ["q", "k", "v"] and "scale" not in attention.attrs
    for d in (4, 16):
        feeds = {t: rng.standard_normal((2, 3, 5, d)).astype(np.float32) for t in "qkv"}
        np.testing.assert_allclose(GraphRunner(graph).run(feeds)[out], GraphRunner(before).run(feeds)[out],
                                   rtol=1e-5, atol=1e-6)


def test_t5_unscaled_with_a_position_bias_and_a_second_key_transpose(rng):
    model = _t5(rng)
    graph, attention = _fused(model, rng)
    assert attention.attrs == {"scale": 1.0}
    producers = graph.producers()
    # the bias [1, H, S, S] as it is (Attention broadcasts it over the batch); K the existing [B, H, S, D] transpose
    assert producers[attention.inputs[3]].op_type == "Unsqueeze"
    assert producers[attention.inputs[1]].op_type == "Transpose"
    _folds_and_matches_onnxruntime(model, graph, rng)  # the key length's Shape now reads K's packed source


def test_llama_grouped_query_attention_reads_k_and_v_unrepeated(rng):
    model = _llama(rng)
    graph, attention = _fused(model, rng)
    assert attention.attrs == {"scale": pytest.approx(1 / math.sqrt(SIZE))}
    assert not [n for n in graph.nodes if n.op_type == "Expand" and n.outputs[0] != attention.inputs[-1]]
    infos = infer_shapes(graph, {"x": TensorInfo(np.float32, (3, SEQ, HIDDEN)), "pad": TensorInfo(np.bool_, (3, SEQ))})
    assert infos[attention.inputs[0]].shape == (3, HEADS, SEQ, SIZE)
    assert infos[attention.inputs[1]].shape == infos[attention.inputs[2]].shape == (3, KV_HEADS, SEQ, SIZE)
    feeds = _feeds(model, rng)
    plan = build(model, {k: (v.shape, v.shape, v.shape) for k, v in feeds.items()})
    got = kiln.Runtime().load(plan).create_execution_context().infer(feeds)
    np.testing.assert_allclose(got[model.graph.output[0].name], ort_run(model, feeds)[0], rtol=1e-4, atol=1e-5)


def test_a_repeat_that_also_broadcasts_the_batch_stays_a_repeat(rng):
    """K/V expanded to a constant batch (not K's own dim, which may be 1): Attention reads the repeated K/V."""
    graph, attention = _fused(_llama(rng, batch_dim="3"), rng)
    producers = graph.producers()
    assert [producers[t].op_type for t in attention.inputs[1:3]] == ["Reshape", "Reshape"]
    infos = infer_shapes(graph, {"x": TensorInfo(np.float32, (3, SEQ, HIDDEN)), "pad": TensorInfo(np.bool_, (3, SEQ))})
    assert infos[attention.inputs[1]].shape == (3, HEADS, SEQ, SIZE)


def test_fp16_constant_factors_give_the_exact_scale(rng):
    """sqrt(1 / sqrt(d)) rounded to fp16 twice is 1 / sqrt(d) within that rounding: the exact scale, not the
    product of the rounded factors."""
    _, attention = _fused(_sdpa(rng, dtype=TensorProto.FLOAT16), rng)
    rounded = float(np.float16(math.sqrt(1 / math.sqrt(SIZE)))) ** 2
    assert rounded != 1 / math.sqrt(SIZE) and attention.attrs["scale"] == 1 / math.sqrt(SIZE)


def test_a_per_feature_factor_on_q_is_part_of_q_not_of_the_scale(rng):
    """Q * w with w [D] (not one element) is no scale: Q is the product, the scale only the scalar."""
    n = _Net(rng)
    q, k, v = (n.input(t, [2, HEADS, SEQ, SIZE]) for t in "qkv")
    weighted = n.op("Mul", q, n.weight(SIZE))
    scores = n.op("Div", n.op("MatMul", weighted, n.op("Transpose", k, perm=[0, 1, 3, 2])), n.float(4.0))
    graph = _before_fusion(n.model(n.softmax_times(scores, v, guard=False)))
    assert fuse_attention(graph) == 1
    (attention,) = [node for node in graph.nodes if node.op_type == "Attention"]
    assert attention.inputs == [weighted, "k", "v"] and attention.attrs == {"scale": 0.25}


def test_a_masked_fill_mask_is_inverted_for_attention(rng):
    """Where(drop, -inf, scores) (masked_fill: true where a key is hidden) gives Attention Not(drop)."""
    n = _Net(rng)
    q, k, v = (n.input(t, [2, HEADS, SEQ, SIZE]) for t in "qkv")
    drop = n.input("drop", [2, 1, 1, SEQ], TensorProto.BOOL)
    scores = n.op("Mul", n.op("MatMul", q, n.op("Transpose", k, perm=[0, 1, 3, 2])), n.float(0.5))
    out = n.softmax_times(n.op("Where", drop, n.float(-np.inf), scores), v, guard=False)
    graph = _before_fusion(n.model(out))
    before = copy.deepcopy(graph)
    assert fuse_attention(graph) == 1
    (attention,) = [node for node in graph.nodes if node.op_type == "Attention"]
    assert graph.producers()[attention.inputs[3]].op_type == "Not"
    feeds = {t: rng.standard_normal((2, HEADS, SEQ, SIZE)).astype(np.float32) for t in "qkv"}
    feeds["drop"] = np.zeros((2, 1, 1, SEQ), bool)
    feeds["drop"][0, ..., 2:] = True
    np.testing.assert_allclose(GraphRunner(graph).run(feeds)[out], GraphRunner(before).run(feeds)[out],
                               rtol=1e-5, atol=1e-6)


# -- lowering for CUDA (no GPU: the emulated launches) -----------------------------------------------------------------


@pytest.mark.parametrize("make", [_sdpa, _t5, _llama], ids=["sdpa", "t5", "llama"])
def test_fp16_forms_lower_to_the_flash_kernel(rng, make):
    """Each form's Attention (the T5 bias [1, H, S, S], grouped-query K/V, the additive padding mask) runs as one
    flash_attention launch, which the emulation computes as the CPU backend does."""
    model = make(rng, dtype=TensorProto.FLOAT16, size=32)  # the flash kernel's head sizes are 32, 64, 128
    feeds = _feeds(model, rng, batch=2)
    graph = parsed_graph(model)
    for graph_pass in PIPELINE:
        graph_pass(graph)
    infos = infer_shapes(graph, {k: TensorInfo(v.dtype, v.shape) for k, v in feeds.items()}, values=True)
    lowered = lower_graph(graph, infos)
    (step,) = [s for s in lowered.steps if s.node.op_type == "Attention"]
    assert step.tactic == "kernel:flash_attention" and [o.function for o in step.ops] == ["flash_attention_32_f16"]
    got, want = Emulator(graph, lowered, feeds).run(), GraphRunner(graph).run(feeds)
    for name, value in want.items():  # fp16 results, fp32 accumulation in the kernel: errors of a few fp16 ulps
        np.testing.assert_allclose(got[name].astype(np.float32), value.astype(np.float32), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("make", [_sdpa, _t5, _llama], ids=["sdpa", "t5", "llama"])
def test_fp16_forms_run_the_flash_kernel_on_the_gpu(rng, make, monkeypatch):
    """On the device: the additive padding mask, T5's per-head bias [1, H, S, S] (a mask stride per head, none per
    batch) and grouped-query K/V through flash_attention_64_f16 compute what the CPU backend computes (built without
    cuDNN, whose SDPA would take some of them: test_cudnn_attention_gpu.py)."""
    monkeypatch.setattr("engine_core.backends.cuda.cudnn_conv.available", lambda: False)
    model = make(rng, dtype=TensorProto.FLOAT16, size=64)
    feeds = _feeds(model, rng, batch=3)
    shapes = {k: ((1, *v.shape[1:]), v.shape, (4, *v.shape[1:])) for k, v in feeds.items()}
    gpu = kiln.Runtime().load(build(model, shapes, backend="cuda"))
    assert [layer["tactic"] for layer in gpu.plan.layers if layer["type"] == "Attention"] == ["kernel:flash_attention"]
    got = gpu.create_execution_context().infer(feeds)
    want = kiln.Runtime().load(build(model, shapes)).create_execution_context().infer(feeds)
    for name, value in want.items():
        np.testing.assert_allclose(got[name].astype(np.float32), value.astype(np.float32), rtol=1e-2, atol=1e-2)
