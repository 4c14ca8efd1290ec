"""Small ONNX models shared by the CUDA tests (CPU emulation and GPU runs)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


def _model(nodes, inputs, outputs, inits=(), opset: int = OPSET) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "m", inputs, outputs, [numpy_helper.from_array(v, k) for k, v in inits])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def vi(name: str, dtype: int, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def mlp(din: int = 64, hidden: int = 256, dout: int = 32, seed: int = 0) -> onnx.ModelProto:
    """x[B, din] -> Gemm(transB) -> Relu -> MatMul -> Add -> Sigmoid -> Softmax."""
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((hidden, din)) / np.sqrt(din)).astype(np.float32)
    b1 = (0.1 * rng.standard_normal(hidden)).astype(np.float32)
    w2 = (rng.standard_normal((hidden, dout)) / np.sqrt(hidden)).astype(np.float32)
    b2 = (0.1 * rng.standard_normal(dout)).astype(np.float32)
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], transB=1, name="fc1"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w2"], ["m"], name="fc2"),
             helper.make_node("Add", ["m", "b2"], ["a"], name="bias2"),
             helper.make_node("Tanh", ["a"], ["t"], name="tanh"),
             helper.make_node("Softmax", ["t"], ["y"], axis=-1, name="softmax")]
    return _model(nodes, [vi("x", TensorProto.FLOAT, ["batch", din])], [vi("y", TensorProto.FLOAT, ["batch", dout])],
                  [("w1", w1), ("b1", b1), ("w2", w2), ("b2", b2)])


def op_mix() -> onnx.ModelProto:
    """Broadcasting, Transpose, Concat, Slice, Expand, Where, Cast, Clip, Gather, ReduceMean,
    batched MatMul with a broadcast operand, Gemm with transA, LayerNorm, Softmax, a reshape view, and a
    host-fallback layer (CumSum) in the middle."""
    rng = np.random.default_rng(1)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    inits = [("bias", f(1, 5, 1)), ("gamma", f(6)), ("beta", f(6)), ("wb", f(6, 4)), ("gw", f(3, 7)),
             ("emb", f(10, 6)), ("starts", np.array([1], np.int64)), ("ends", np.array([5], np.int64)),
             ("axes", np.array([2], np.int64)), ("steps", np.array([2], np.int64)), ("lo", np.float32(-0.5)),
             ("hi", np.float32(0.7)), ("shape4", np.array([2, 5, 6, 1], np.int64)), ("ax1", np.array([1], np.int64)),
             ("eshape", np.array([2, 5, 6], np.int64)), ("red_axes", np.array([-1], np.int64))]
    n = helper.make_node
    nodes = [
        n("Add", ["x", "bias"], ["xb"], name="add_bcast"),                        # [2,5,6]
        n("Transpose", ["xb"], ["xt"], perm=[0, 2, 1], name="transpose"),         # [2,6,5]
        n("Transpose", ["xt"], ["xtt"], perm=[0, 2, 1], name="transpose_back"),   # [2,5,6]
        n("Concat", ["xb", "xtt"], ["cat"], axis=2, name="concat"),               # [2,5,12]
        n("Slice", ["cat", "starts", "ends", "axes", "steps"], ["sl"], name="slice"),  # [2,5,2]
        n("Greater", ["xb", "xtt"], ["gt"], name="greater"),
        n("Where", ["gt", "xb", "bias"], ["wh"], name="where"),
        n("Clip", ["wh", "lo", "hi"], ["cl"], name="clip"),
        n("Cast", ["gt"], ["gtf"], to=TensorProto.FLOAT, name="cast"),
        n("Mul", ["cl", "gtf"], ["mu"], name="mul"),
        n("CumSum", ["mu", "ax1"], ["cs"], name="cumsum_host"),
        n("LayerNormalization", ["cs", "gamma", "beta"], ["ln"], axis=-1, epsilon=1e-5, name="layer_norm"),
        n("MatMul", ["ln", "wb"], ["mm"], name="matmul_w"),                       # [2,5,4]
        n("MatMul", ["ln", "xt"], ["bmm"], name="matmul_batched"),                # [2,5,5]
        n("Softmax", ["bmm"], ["sm"], axis=-1, name="softmax"),
        n("ReduceMean", ["sm"], ["rm"], axes=[-1], keepdims=1, name="reduce_mean"),
        n("Expand", ["rm", "eshape"], ["ex"], name="expand"),                     # [2,5,6]
        n("Reshape", ["ex", "shape4"], ["rs"], name="reshape_view"),
        n("Sqrt", ["rs"], ["sq"], name="sqrt"),
        n("Gather", ["emb", "ids"], ["g"], axis=0, name="gather"),                # [2,3,6]
        n("Constant", [], ["g2shape"], value=numpy_helper.from_array(np.array([3, 12], np.int64))),
        n("Reshape", ["g", "g2shape"], ["g2"], name="flatten_ids"),               # [3,12]
        n("Gemm", ["gw", "g2"], ["gm"], transA=1, name="gemm_ta"),                # [7,12]
        n("Exp", ["sl"], ["out_exp"], name="exp"),
    ]
    outputs = [vi("mm", TensorProto.FLOAT, [2, 5, 4]), vi("sq", TensorProto.FLOAT, [2, 5, 6, 1]),
               vi("gm", TensorProto.FLOAT, [7, 12]), vi("out_exp", TensorProto.FLOAT, [2, 5, 2]),
               vi("rs", TensorProto.FLOAT, [2, 5, 6, 1])]
    return _model(nodes, [vi("x", TensorProto.FLOAT, [2, 5, 6]), vi("ids", TensorProto.INT64, [2, 3])], outputs, inits)


def bert_small() -> onnx.ModelProto:
    """tools/make_models.py's small bert_base (2 layers, hidden 64, dynamic batch and sequence)."""
    return small_model("bert_base")


def bert_feeds(batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, seq), np.int64)
    mask[:, seq - seq // 4:] = 0
    return {"input_ids": rng.integers(0, 1000, (batch, seq)).astype(np.int64), "attention_mask": mask,
            "token_type_ids": rng.integers(0, 2, (batch, seq)).astype(np.int64)}


def _make_models():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    from make_models import MODELS

    return MODELS


def resnet_small() -> onnx.ModelProto:
    """tools/make_models.py's small resnet50 (64x64 images, dynamic batch)."""
    return _make_models()["resnet50"][1]()


def mobilenet_small() -> onnx.ModelProto:
    """tools/make_models.py's small mobilenetv2 (depthwise convolutions, Clip activations)."""
    return _make_models()["mobilenetv2"][1]()


def attention_fp16(batch: int = 2, heads: int = 4, seq: int = 16, dim: int = 32, causal: int = 0) -> onnx.ModelProto:
    """ONNX Attention (opset 23) over fp16 Q/K/V [B, H, S, D] with an additive fp16 mask."""
    return attention_model(batch, heads, seq, dim, causal)


def attention_model(batch: int = 2, heads: int = 4, seq: int = 16, dim: int = 32, causal: int = 0,
                    dtype: int = TensorProto.FLOAT16, kv_heads: int | None = None, three_d: bool = False,
                    mask: str | list[int] = "add", kv_seq: int | None = None,
                    quantize: bool = False) -> onnx.ModelProto:
    """ONNX Attention (opset 23): 4-D Q/K/V [B, H, S, D] or the 3-D form [B, S, H*D] with head counts
    (``kv_heads`` < ``heads``: grouped-query); ``mask`` "add" (same type, [B, 1, Sq, Skv]), "row" (same type,
    [B, 1, 1, Skv]: BERT's padding mask), "bool" ([Sq, Skv]), an additive mask's own shape, or "" (none);
    ``quantize``: an int8 QuantizeLinear after it (the builder fuses the pair into kiln.AttentionQuantize)."""
    kv_heads, kv_seq = kv_heads or heads, kv_seq or seq
    if three_d:
        q_shape, kv_shape = [batch, seq, heads * dim], [batch, kv_seq, kv_heads * dim]
        attrs = {"q_num_heads": heads, "kv_num_heads": kv_heads}
    else:
        q_shape, kv_shape, attrs = [batch, heads, seq, dim], [batch, kv_heads, kv_seq, dim], {}
    inputs = [vi("q", dtype, q_shape), vi("k", dtype, kv_shape), vi("v", dtype, kv_shape)]
    if isinstance(mask, list):
        inputs.append(vi("mask", dtype, mask))
    elif mask:
        inputs.append(vi("mask", TensorProto.BOOL, [seq, kv_seq]) if mask == "bool"
                      else vi("mask", dtype, [batch, 1, 1 if mask == "row" else seq, kv_seq]))
    nodes = [helper.make_node("Attention", [i.name for i in inputs], ["y"], is_causal=causal, name="attention",
                              **attrs)]
    inits, out = [], vi("y", dtype, q_shape)
    if quantize:
        nodes.append(helper.make_node("QuantizeLinear", ["y", "scale", "zero"], ["yq"], name="quantize"))
        inits = [helper.make_tensor("scale", TensorProto.FLOAT, [], [0.02]),
                 helper.make_tensor("zero", TensorProto.INT8, [], [0])]
        out = vi("yq", TensorProto.INT8, q_shape)
    graph = helper.make_graph(nodes, "attn", inputs, [out], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


def attention_inputs(model, rng, additive_mask: Callable[[list[int], np.dtype], np.ndarray]) -> dict[str, np.ndarray]:
    """Seeded inputs of a one-Attention model, in its input order: Q/K/V standard normal, a boolean "mask" as a
    band, an additive one from ``additive_mask(shape, dtype)``."""
    feeds = {}
    for value in model.graph.input:
        shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        if value.name != "mask":
            feeds[value.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype == np.bool_:
            feeds["mask"] = np.tril(np.ones(shape, bool), 3)
        else:
            feeds["mask"] = additive_mask(shape, dtype)
    return feeds


def attention_feeds(model, rng, masked_from: int = 12) -> dict[str, np.ndarray]:
    """Seeded Q/K/V (and a mask hiding batch 1's last keys, or a boolean band) for ``attention_model``."""

    def batch_1_padded(shape: list[int], dtype: np.dtype) -> np.ndarray:
        mask = np.zeros(shape, dtype)
        mask[1, :, :, masked_from:] = -10000
        return mask

    return attention_inputs(model, rng, batch_1_padded)


def cnn_fp16() -> onnx.ModelProto:
    """An fp16 CNN: Conv+Relu, MaxPool, BatchNormalization, strided Conv, residual Add, AveragePool, GlobalAveragePool, Gemm."""
    rng = np.random.default_rng(3)
    h = lambda *s: (rng.standard_normal(s) * 0.2).astype(np.float16)  # noqa: E731
    n = helper.make_node
    inits = [("w1", h(8, 3, 3, 3)), ("b1", h(8)), ("s", (1 + h(8)).astype(np.float16)), ("bb", h(8)), ("m", h(8)),
             ("var", np.abs(1 + h(8)).astype(np.float16)), ("w2", h(16, 8, 3, 3)), ("w3", h(16, 16, 1, 1)),
             ("fc", h(16, 10)), ("fcb", h(10))]
    nodes = [n("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             n("Relu", ["c1"], ["r1"], name="relu1"),
             n("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2], name="pool1"),
             n("BatchNormalization", ["p1", "s", "bb", "m", "var"], ["bn"], name="bn"),
             n("Conv", ["bn", "w2"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2], name="conv2"),
             n("Conv", ["c2", "w3"], ["c3"], name="conv3"),
             n("Add", ["c2", "c3"], ["res"], name="residual"),
             n("Relu", ["res"], ["r2"], name="relu2"),
             n("AveragePool", ["r2"], ["p2"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[1, 1], name="avgpool"),
             n("GlobalAveragePool", ["p2"], ["g"], name="gap"),
             n("Flatten", ["g"], ["f"], name="flatten"),
             n("Gemm", ["f", "fc", "fcb"], ["y"], name="fc")]
    return _model(nodes, [vi("x", TensorProto.FLOAT16, ["batch", 3, 16, 16])],
                  [vi("y", TensorProto.FLOAT16, ["batch", 10]), vi("r2", TensorProto.FLOAT16, ["batch", 16, 4, 4])],
                  inits)


def make_models_names() -> list[str]:
    """Every model tools/make_models.py builds (its MODELS keys): the GPU model tests cover each one."""
    return sorted(_make_models())


def small_model(name: str) -> onnx.ModelProto:
    """tools/make_models.py's small variant of ``name`` (the size its tests use)."""
    return _make_models()[name][1]()


#: image side of each small image model in tools/make_models.py's MODELS (the rest use 64)
SMALL_IMAGE_SIZE = {"yolo_nms": 128}


def small_model_feeds(name: str, batch: int, seed: int, seq: int = 16) -> dict[str, np.ndarray]:
    """Seeded inputs for ``small_model(name)``: images N(0, 1), token ids below the small vocab (1000)."""
    if name.startswith("bert"):
        return bert_feeds(batch, seq, seed)
    rng = np.random.default_rng(seed)
    if name == "gpt2":
        return {"input_ids": rng.integers(0, 1000, (batch, seq)).astype(np.int64)}
    size = SMALL_IMAGE_SIZE.get(name, 64)
    return {"input": rng.standard_normal((batch, 3, size, size)).astype(np.float32)}


def small_model_profiles(name: str, batches: tuple[int, int, int] = (1, 2, 4),
                         seqs: tuple[int, int, int] = (8, 16, 32)) -> dict[str, tuple]:
    """One optimization profile (input -> (min, opt, max)) with a dynamic batch (and sequence for text)."""
    if name.startswith("bert"):
        return {n: tuple(zip(batches, seqs)) for n in ("input_ids", "attention_mask", "token_type_ids")}
    if name == "gpt2":
        return {"input_ids": tuple(zip(batches, seqs))}
    size = SMALL_IMAGE_SIZE.get(name, 64)
    return {"input": tuple((b, 3, size, size) for b in batches)}


def build_engine(model: onnx.ModelProto, backend: str, profiles: dict[str, tuple], flag=None, flags=(),
                 debug=()):
    """An engine of ``model`` for ``backend`` with one profile (input -> (min, opt, max)); ``flag`` (e.g.
    BuilderFlag.FP16) and ``flags`` set on the config, the ``debug`` tensors marked. TF32 (a new config's default)
    is cleared unless asked for: without flags an engine computes strict fp32, what the tolerances assume."""
    import engine_core as kiln

    builder = kiln.Builder()
    net = builder.create_network()
    assert kiln.OnnxParser(net).parse(model)
    for name in debug:
        assert net.mark_debug(name)
    config = builder.create_builder_config()
    config.backend = backend
    config.clear_flag(kiln.BuilderFlag.TF32)
    for one in ([flag] if flag is not None else []) + list(flags):
        config.set_flag(one)
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in profiles.items():
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    return kiln.Runtime().load(kiln.build_plan(net, config))


def optimized_graph(model: onnx.ModelProto, feeds: dict[str, np.ndarray], flag=None):
    """The graph exactly as the builder optimizes it (precision pass included: a CPU build's plan graph), for
    one profile at the feeds' shapes."""
    return build_engine(model, "cpu", {name: (value.shape,) * 3 for name, value in feeds.items()}, flag).plan.graph


def lowered_at(graph, feeds: dict[str, np.ndarray], options=None):
    """``graph`` lowered for the CUDA backend at the feeds' shapes (shape values folded), with ``options`` (a
    LoweringOptions; default: none set)."""
    from engine_core.backends.cuda.lowering import lower_graph
    from engine_core.ops import TensorInfo
    from engine_core.passes import infer_shapes

    infos = infer_shapes(graph, {v.name: TensorInfo(v.dtype, feeds[v.name].shape) for v in graph.inputs}, values=True)
    return lower_graph(graph, infos, None, options)


def pipeline_lowered(model: onnx.ModelProto, feeds: dict[str, np.ndarray]):
    """(graph after the whole optimization pipeline without the precision pass, its CUDA lowering)."""
    import copy

    import engine_core as kiln
    from engine_core.passes import PIPELINE

    net = kiln.Builder().create_network()
    assert kiln.OnnxParser(net).parse(model)
    graph = copy.deepcopy(net.graph)
    for graph_pass in PIPELINE:
        graph_pass(graph)
    return graph, lowered_at(graph, feeds)
