"""Build real model architectures as ONNX files with seeded random weights (no downloads).

    python tools/make_models.py --out models/ [--models resnet50,bert_base] [--small]

Models: resnet50, resnet50_qdq (explicit Q/DQ: per-channel int8 weights, per-tensor activations;
needs onnxruntime for its activation scales), mobilenetv2, bert_base (dynamic batch and sequence),
``bert(cls_only=True)``: the same encoder answering only the CLS vector (load_tests/gpu_serving.py),
gpt2 (decoder block stack), yolo_nms (a YOLO-style detector head ending in NonMaxSuppression). ``--small`` keeps every
architecture but shrinks widths/depths/resolution, for tests. Each builder returns a ModelProto
whose graph uses the op forms that PyTorch's exporter emits (Erf-GELU, Shape->Gather->Reshape, ...).
"""

from __future__ import annotations

import argparse
import math
import os
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


class GraphMaker:
    """Accumulates nodes and seeded initializers; ``op`` returns the output name(s)."""

    def __init__(self, name: str, seed: int) -> None:
        self.name = name
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.count = 0

    def fresh(self, hint: str) -> str:
        self.count += 1
        return f"{hint}_{self.count}"

    def const(self, value: np.ndarray, hint: str = "c") -> str:
        name = self.fresh(hint)
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def weight(self, shape: Sequence[int], fan_in: int | None = None, hint: str = "w") -> str:
        fan_in = fan_in or int(np.prod(shape[1:])) or 1
        return self.const((self.rng.standard_normal(shape) * math.sqrt(2.0 / fan_in)).astype(np.float32), hint)

    def op(self, op_type: str, inputs: Sequence[str], outputs: int = 1, **attrs) -> str | list[str]:
        names = [self.fresh(op_type.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, name=self.fresh(op_type), **attrs))
        return names[0] if outputs == 1 else names

    def model(self, inputs: list[onnx.ValueInfoProto], outputs: list[tuple[str, str, int, list]]) -> onnx.ModelProto:
        """``outputs``: (internal name, public name, elem type, shape) — renamed with Identity."""
        out_infos = []
        for internal, public, elem, shape in outputs:
            self.nodes.append(helper.make_node("Identity", [internal], [public], name=self.fresh("out")))
            out_infos.append(helper.make_tensor_value_info(public, elem, shape))
        graph = helper.make_graph(self.nodes, self.name, inputs, out_infos, self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="kiln-make-models")
        onnx.checker.check_model(model)
        return model

    # -- layers -----------------------------------------------------------------------------------
    def conv_bn(self, x: str, cin: int, cout: int, k: int, stride: int = 1, groups: int = 1, act: str | None = "Relu") -> str:
        w = self.weight((cout, cin // groups, k, k))
        y = self.op("Conv", [x, w], kernel_shape=[k, k], strides=[stride, stride], pads=[k // 2] * 4, group=groups)
        scale = self.const((1 + 0.1 * self.rng.standard_normal(cout)).astype(np.float32), "bn_scale")
        bias = self.const((0.1 * self.rng.standard_normal(cout)).astype(np.float32), "bn_bias")
        mean = self.const((0.1 * self.rng.standard_normal(cout)).astype(np.float32), "bn_mean")
        var = self.const((0.5 + self.rng.random(cout)).astype(np.float32), "bn_var")
        y = self.op("BatchNormalization", [y, scale, bias, mean, var], epsilon=1e-5)
        if act == "Relu":
            y = self.op("Relu", [y])
        elif act == "Relu6":
            y = self.op("Clip", [y, self.const(np.float32(0)), self.const(np.float32(6))])
        elif act == "SiLU":
            y = self.op("Mul", [y, self.op("Sigmoid", [y])])
        return y

    def linear(self, x: str, din: int, dout: int) -> str:
        w = self.const((self.rng.standard_normal((din, dout)) * 0.02).astype(np.float32), "linear_w")
        b = self.const(np.zeros(dout, np.float32) + (0.01 * self.rng.standard_normal(dout)).astype(np.float32), "linear_b")
        return self.op("Add", [self.op("MatMul", [x, w]), b])

    def layer_norm(self, x: str, dim: int) -> str:
        gamma = self.const((1 + 0.05 * self.rng.standard_normal(dim)).astype(np.float32), "ln_g")
        beta = self.const((0.05 * self.rng.standard_normal(dim)).astype(np.float32), "ln_b")
        return self.op("LayerNormalization", [x, gamma, beta], axis=-1, epsilon=1e-5)

    def gelu_erf(self, x: str) -> str:
        """0.5 * x * (1 + erf(x / sqrt(2))), as exported from torch.nn.GELU()."""
        e = self.op("Erf", [self.op("Div", [x, self.const(np.float32(math.sqrt(2)))])])
        return self.op("Mul", [self.op("Mul", [x, self.const(np.float32(0.5))]),
                               self.op("Add", [e, self.const(np.float32(1))])])

    def gelu_tanh(self, x: str) -> str:
        """GPT-2's tanh GELU: 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3)))."""
        cube = self.op("Pow", [x, self.const(np.float32(3))])
        inner = self.op("Add", [x, self.op("Mul", [cube, self.const(np.float32(0.044715))])])
        t = self.op("Tanh", [self.op("Mul", [inner, self.const(np.float32(math.sqrt(2 / math.pi)))])])
        return self.op("Mul", [self.op("Mul", [x, self.const(np.float32(0.5))]), self.op("Add", [t, self.const(np.float32(1))])])

    def dim(self, x: str, index: int) -> str:
        """A 1-element int64 tensor holding x.shape[index] (the exporter's Shape->Gather->Unsqueeze)."""
        g = self.op("Gather", [self.op("Shape", [x]), self.const(np.int64(index))], axis=0)
        return self.op("Unsqueeze", [g, self.const(np.array([0], np.int64))])


def _image_input(size: int) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, size, size])


def resnet50(image_size: int = 224, width: int = 64, blocks: Sequence[int] = (3, 4, 6, 3), classes: int = 1000) -> onnx.ModelProto:
    """ResNet-50 v1.5 (stride on the 3x3 conv), BN after every conv, as torchvision exports it."""
    g = GraphMaker("resnet50", seed=50)
    x = g.conv_bn("input", 3, width, 7, stride=2)
    x = g.op("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = width
    for stage, count in enumerate(blocks):
        mid = width * 2**stage
        cout = mid * 4
        for i in range(count):
            stride = 2 if i == 0 and stage > 0 else 1
            y = g.conv_bn(x, cin, mid, 1)
            y = g.conv_bn(y, mid, mid, 3, stride=stride)
            y = g.conv_bn(y, mid, cout, 1, act=None)
            shortcut = g.conv_bn(x, cin, cout, 1, stride=stride, act=None) if i == 0 else x
            x = g.op("Relu", [g.op("Add", [y, shortcut])])
            cin = cout
    x = g.op("Flatten", [g.op("GlobalAveragePool", [x])], axis=1)
    logits = g.op("Gemm", [x, g.weight((classes, cin)), g.const(np.zeros(classes, np.float32))], transB=1)
    return g.model([_image_input(image_size)], [(logits, "logits", TensorProto.FLOAT, ["batch", classes])])


def mobilenetv2(image_size: int = 224, width_mult: float = 1.0, classes: int = 1000) -> onnx.ModelProto:
    """MobileNetV2: inverted residuals with depthwise convs and ReLU6 (Clip)."""
    g = GraphMaker("mobilenetv2", seed=2)
    c = lambda v: max(8, int(v * width_mult + 4) // 8 * 8)  # noqa: E731
    settings = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]
    cin = c(32)
    x = g.conv_bn("input", 3, cin, 3, stride=2, act="Relu6")
    for t, ch, n, s in settings:
        cout = c(ch)
        for i in range(n):
            stride = s if i == 0 else 1
            hidden = cin * t
            y = g.conv_bn(x, cin, hidden, 1, act="Relu6") if t != 1 else x
            y = g.conv_bn(y, hidden, hidden, 3, stride=stride, groups=hidden, act="Relu6")
            y = g.conv_bn(y, hidden, cout, 1, act=None)
            x = g.op("Add", [x, y]) if stride == 1 and cin == cout else y
            cin = cout
    last = c(1280) if width_mult > 1 else 1280
    x = g.conv_bn(x, cin, last, 1, act="Relu6")
    x = g.op("Flatten", [g.op("GlobalAveragePool", [x])], axis=1)
    logits = g.op("Gemm", [x, g.weight((classes, last)), g.const(np.zeros(classes, np.float32))], transB=1)
    return g.model([_image_input(image_size)], [(logits, "logits", TensorProto.FLOAT, ["batch", classes])])


def _attention_heads(g: GraphMaker, x: str, heads: int, head_dim: int) -> str:
    """[B, S, H*D] -> [B, H, S, D] via Reshape(0, 0, H, D) + Transpose."""
    shaped = g.op("Reshape", [x, g.const(np.array([0, 0, heads, head_dim], np.int64))])
    return g.op("Transpose", [shaped], perm=[0, 2, 1, 3])


def _merge_heads(g: GraphMaker, x: str, hidden: int) -> str:
    merged = g.op("Transpose", [x], perm=[0, 2, 1, 3])
    return g.op("Reshape", [merged, g.const(np.array([0, 0, hidden], np.int64))])


def bert(layers: int = 12, hidden: int = 768, heads: int = 12, ffn: int = 3072, vocab: int = 30522,
         max_positions: int = 512, cls_only: bool = False) -> onnx.ModelProto:
    """BERT encoder with dynamic batch and sequence: input_ids, attention_mask -> hidden states, pooled.

    ``cls_only``: the one output is ``cls`` = last_hidden_state[:, 0, :] ([batch, hidden]): the encoder's full
    cost with a 3 KB answer, so a serving benchmark measures the server rather than the output copy.
    """
    g = GraphMaker("bert", seed=7)
    d = hidden // heads
    emb = lambda rows: g.const((g.rng.standard_normal((rows, hidden)) * 0.02).astype(np.float32), "emb")  # noqa: E731
    seq = g.op("Squeeze", [g.dim("input_ids", 1), g.const(np.array([0], np.int64))])
    positions = g.op("Range", [g.const(np.int64(0)), seq, g.const(np.int64(1))])
    x = g.op("Add", [g.op("Gather", [emb(vocab), "input_ids"]), g.op("Gather", [emb(max_positions), positions])])
    x = g.op("Add", [x, g.op("Gather", [emb(2), "token_type_ids"])])
    x = g.layer_norm(x, hidden)
    # mask bias [B,1,1,S]: 0 where attended, -10000 where padded
    mask = g.op("Cast", [g.op("Unsqueeze", ["attention_mask", g.const(np.array([1, 2], np.int64))])], to=TensorProto.FLOAT)
    bias = g.op("Mul", [g.op("Sub", [g.const(np.float32(1)), mask]), g.const(np.float32(-10000))])
    scale = g.const(np.float32(1 / math.sqrt(d)))
    for _ in range(layers):
        q, k, v = (_attention_heads(g, g.linear(x, hidden, hidden), heads, d) for _ in range(3))
        scores = g.op("Add", [g.op("Mul", [g.op("MatMul", [q, g.op("Transpose", [k], perm=[0, 1, 3, 2])]), scale]), bias])
        attn = g.op("MatMul", [g.op("Softmax", [scores], axis=-1), v])
        x = g.layer_norm(g.op("Add", [x, g.linear(_merge_heads(g, attn, hidden), hidden, hidden)]), hidden)
        h = g.gelu_erf(g.linear(x, hidden, ffn))
        x = g.layer_norm(g.op("Add", [x, g.linear(h, ffn, hidden)]), hidden)
    cls = g.op("Gather", [x, g.const(np.int64(0))], axis=1)
    ids = lambda n: helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "sequence"])  # noqa: E731
    inputs = [ids("input_ids"), ids("attention_mask"), ids("token_type_ids")]
    if cls_only:
        return g.model(inputs, [(cls, "cls", TensorProto.FLOAT, ["batch", hidden])])
    pooled = g.op("Tanh", [g.linear(cls, hidden, hidden)])
    return g.model(
        inputs,
        [(x, "last_hidden_state", TensorProto.FLOAT, ["batch", "sequence", hidden]),
         (pooled, "pooler_output", TensorProto.FLOAT, ["batch", hidden])],
    )


def gpt2(layers: int = 12, hidden: int = 768, heads: int = 12, vocab: int = 50257, max_positions: int = 1024) -> onnx.ModelProto:
    """GPT-2 decoder stack (pre-LN, fused QKV projection, causal mask, tanh GELU, tied LM head)."""
    g = GraphMaker("gpt2", seed=3)
    d = hidden // heads
    wte_value = (g.rng.standard_normal((vocab, hidden)) * 0.02).astype(np.float32)
    wte = g.const(wte_value, "wte")
    wpe = g.const((g.rng.standard_normal((max_positions, hidden)) * 0.01).astype(np.float32), "wpe")
    seq_1d = g.dim("input_ids", 1)
    seq = g.op("Squeeze", [seq_1d, g.const(np.array([0], np.int64))])
    positions = g.op("Range", [g.const(np.int64(0)), seq, g.const(np.int64(1))])
    x = g.op("Add", [g.op("Gather", [wte, "input_ids"]), g.op("Gather", [wpe, positions])])
    square = g.op("Concat", [seq_1d, seq_1d], axis=0)
    causal = g.op("Cast", [g.op("Trilu", [g.op("ConstantOfShape", [square], value=helper.make_tensor(
        "one", TensorProto.INT64, [1], [1]))], upper=0)], to=TensorProto.BOOL)
    neg = g.const(np.float32(-1e4))
    scale = g.const(np.float32(1 / math.sqrt(d)))
    for _ in range(layers):
        h = g.layer_norm(x, hidden)
        qkv = g.linear(h, hidden, 3 * hidden)
        q, k, v = g.op("Split", [qkv, g.const(np.array([hidden] * 3, np.int64))], outputs=3, axis=-1)
        q, k, v = (_attention_heads(g, t, heads, d) for t in (q, k, v))
        scores = g.op("Mul", [g.op("MatMul", [q, g.op("Transpose", [k], perm=[0, 1, 3, 2])]), scale])
        scores = g.op("Where", [causal, scores, neg])
        attn = g.op("MatMul", [g.op("Softmax", [scores], axis=-1), v])
        x = g.op("Add", [x, g.linear(_merge_heads(g, attn, hidden), hidden, hidden)])
        m = g.gelu_tanh(g.linear(g.layer_norm(x, hidden), hidden, 4 * hidden))
        x = g.op("Add", [x, g.linear(m, 4 * hidden, hidden)])
    x = g.layer_norm(x, hidden)
    logits = g.op("MatMul", [x, g.const(np.ascontiguousarray(wte_value.T), "lm_head")])
    return g.model([helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])],
                   [(logits, "logits", TensorProto.FLOAT, ["batch", "sequence", vocab])])


def yolo_nms(image_size: int = 320, width: int = 32, classes: int = 80, anchors: int = 3,
             max_boxes: int = 100, iou: float = 0.45, score: float = 0.25) -> onnx.ModelProto:
    """A YOLO-style detector: SiLU conv backbone (stride 16), box/objectness/class head, decode, NMS.

    Outputs: boxes [B, N, 4] (x1, y1, x2, y2 in pixels), scores [B, classes, N], and
    selected_indices [K, 3] (batch, class, box) — K is data-dependent.
    """
    g = GraphMaker("yolo_nms", seed=11)
    x, cin = "input", 3
    for cout in (width, width * 2, width * 4, width * 8):
        x = g.conv_bn(x, cin, cout, 3, stride=2, act="SiLU")
        cin = cout
    per = 5 + classes
    head = g.op("Conv", [x, g.weight((anchors * per, cin)  + (1, 1)), g.const(np.zeros(anchors * per, np.float32))],
                kernel_shape=[1, 1])
    grid = image_size // 16
    n = anchors * grid * grid
    pred = g.op("Transpose", [g.op("Reshape", [head, g.const(np.array([0, anchors, per, grid * grid], np.int64))])],
                perm=[0, 1, 3, 2])
    pred = g.op("Sigmoid", [g.op("Reshape", [pred, g.const(np.array([0, n, per], np.int64))])])
    xy, wh, obj, cls = g.op("Split", [pred, g.const(np.array([2, 2, 1, classes], np.int64))], outputs=4, axis=2)
    gy, gx = np.meshgrid(np.arange(grid), np.arange(grid), indexing="ij")
    cells = np.tile(np.stack([gx, gy], -1).reshape(1, grid * grid, 2), (anchors, 1, 1)).reshape(1, n, 2)
    anchor_wh = np.repeat(np.array([[10, 13], [30, 61], [62, 45]], np.float32)[:anchors] * (image_size / 320), grid * grid, 0)
    center = g.op("Mul", [g.op("Add", [g.op("Mul", [xy, g.const(np.float32(2))]),
                                        g.const((cells - 0.5).astype(np.float32))]), g.const(np.float32(16))])
    size = g.op("Mul", [g.op("Pow", [g.op("Mul", [wh, g.const(np.float32(2))]), g.const(np.float32(2))]),
                        g.const(anchor_wh.reshape(1, n, 2))])
    half = g.op("Mul", [size, g.const(np.float32(0.5))])
    boxes = g.op("Concat", [g.op("Sub", [center, half]), g.op("Add", [center, half])], axis=2)
    scores = g.op("Transpose", [g.op("Mul", [cls, obj])], perm=[0, 2, 1])
    selected = g.op("NonMaxSuppression", [boxes, scores, g.const(np.array([max_boxes], np.int64)),
                                          g.const(np.array([iou], np.float32)), g.const(np.array([score], np.float32))])
    return g.model([_image_input(image_size)], [
        (boxes, "boxes", TensorProto.FLOAT, ["batch", n, 4]),
        (scores, "scores", TensorProto.FLOAT, ["batch", classes, n]),
        (selected, "selected_indices", TensorProto.INT64, ["detections", 3]),
    ])


def resnet50_qdq(image_size: int = 224, width: int = 64, blocks: Sequence[int] = (3, 4, 6, 3), classes: int = 1000,
                 calib_batches: int = 4, calib_batch_size: int = 4) -> onnx.ModelProto:
    """ResNet-50 (the builder above) explicitly quantized the way a QAT export looks: BN folded into the
    convs, per-channel int8 weights (int8 initializer -> DequantizeLinear, axis = output channel),
    per-tensor int8 activations (QuantizeLinear -> DequantizeLinear) in front of every Conv/Gemm and on
    the residual input of every Add. Activation scales are max |x| / 127 over seeded N(0, 1) images
    (run through onnxruntime on the float model, so the scales do not depend on Kiln)."""
    model = resnet50(image_size, width, blocks, classes)
    _fold_batchnorm(model.graph)
    graph = model.graph
    weights = {t.name: t for t in graph.initializer}
    quantized = {n.input[0] for n in graph.node if n.op_type in ("Conv", "Gemm")}
    quantized |= {n.input[1] for n in graph.node if n.op_type == "Add" and n.input[1] not in weights}
    targets: dict[int, list[tuple[int, int | None]]] = {}
    for k, node in enumerate(graph.node):
        if node.op_type in ("Conv", "Gemm"):
            targets[k] = [(0, None), (1, 0)]  # (input, weight axis): Gemm weights are (classes, cin) with transB
        elif node.op_type == "Add" and node.input[1] in quantized:
            targets[k] = [(1, None)]
    rng = np.random.default_rng(2024)
    feeds = [{"input": rng.standard_normal((calib_batch_size, 3, image_size, image_size)).astype(np.float32)}
             for _ in range(calib_batches)]
    insert_qdq(model, targets, feeds)
    graph.name = "resnet50_qdq"
    onnx.checker.check_model(model)
    return model


def _fold_batchnorm(graph: onnx.GraphProto) -> None:
    """Conv -> BatchNormalization pairs become one Conv with scaled weights and a bias (QAT exports do this)."""
    inits = {t.name: t for t in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    drop = set()
    for bn in graph.node:
        if bn.op_type != "BatchNormalization":  # checked first: Constant nodes have no inputs
            continue
        conv = producers.get(bn.input[0])
        if conv is None or conv.op_type != "Conv":
            continue
        gamma, beta, mean, var = (numpy_helper.to_array(inits[i]).astype(np.float64) for i in bn.input[1:5])
        eps = next((a.f for a in bn.attribute if a.name == "epsilon"), 1e-5)
        w = numpy_helper.to_array(inits[conv.input[1]]).astype(np.float64)
        s = gamma / np.sqrt(var + eps)
        inits[conv.input[1]].CopyFrom(numpy_helper.from_array((w * s.reshape(-1, 1, 1, 1)).astype(np.float32),
                                                              conv.input[1]))
        bias_name = conv.input[1] + "_bias"
        graph.initializer.append(numpy_helper.from_array((beta - mean * s).astype(np.float32), bias_name))
        conv.input.append(bias_name)
        conv.output[0] = bn.output[0]
        drop.add(id(bn))
    kept = [n for n in graph.node if id(n) not in drop]
    used = {i for n in kept for i in n.input}
    del graph.node[:]
    graph.node.extend(kept)
    unused = [t for t in graph.initializer if t.name not in used]
    for t in unused:
        graph.initializer.remove(t)


def insert_qdq(model: onnx.ModelProto, targets: dict[int, list[tuple[int, int | None]]],
               feeds: list[dict[str, np.ndarray]]) -> onnx.ModelProto:
    """Make ``model`` explicitly quantized in place: for node k of ``targets``, each (input index, weight axis)
    becomes an int8 initializer read through a per-channel DequantizeLinear (axis given) or a per-tensor
    QuantizeLinear -> DequantizeLinear of the activation (axis None; scale max |x| / 127 over ``feeds``, run
    through onnxruntime on the float model). A tensor read by several targets is quantized once. Why public:
    bench/int8.py quantizes real exported models with the same rules."""
    graph = model.graph
    weights = {t.name: t for t in graph.initializer}
    activations = sorted({graph.node[k].input[i] for k, wanted in targets.items() for i, axis in wanted if axis is None})
    amax = _amax_over_feeds(model, activations, feeds)
    nodes: list[onnx.NodeProto] = []
    replaced: dict[str, str] = {}
    for k, node in enumerate(graph.node):
        for index, axis in targets.get(k, []):
            name = node.input[index]
            if name not in replaced:
                replaced[name] = (_dequantized_weight(graph, weights[name], axis, nodes) if axis is not None
                                  else _fake_quantized(graph, name, amax[name], nodes))
            node.input[index] = replaced[name]
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    return model


def _fake_quantized(graph: onnx.GraphProto, name: str, amax: float, nodes: list[onnx.NodeProto]) -> str:
    """name -> QuantizeLinear(int8, amax/127) -> DequantizeLinear; returns the dequantized tensor."""
    scale, zero = f"{name}_scale", f"{name}_zero"
    graph.initializer.extend([numpy_helper.from_array(np.array(max(amax, 1e-8) / 127, np.float32), scale),
                              numpy_helper.from_array(np.array(0, np.int8), zero)])
    nodes.append(helper.make_node("QuantizeLinear", [name, scale, zero], [f"{name}_q"], name=f"{name}_Q"))
    nodes.append(helper.make_node("DequantizeLinear", [f"{name}_q", scale, zero], [f"{name}_dq"], name=f"{name}_DQ"))
    return f"{name}_dq"


def _dequantized_weight(graph: onnx.GraphProto, init: onnx.TensorProto, axis: int, nodes: list[onnx.NodeProto]) -> str:
    """A float weight -> int8 initializer (symmetric, per channel along ``axis``) + DequantizeLinear."""
    w = numpy_helper.to_array(init)
    amax = np.abs(np.moveaxis(w, axis, 0)).reshape(w.shape[axis], -1).max(axis=1)
    scale = np.where(amax > 0, amax / 127, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale.reshape([-1 if d == axis else 1 for d in range(w.ndim)])), -127, 127).astype(np.int8)
    name = init.name
    graph.initializer.remove(init)
    graph.initializer.extend([numpy_helper.from_array(q, f"{name}_int8"),
                              numpy_helper.from_array(scale, f"{name}_scale"),
                              numpy_helper.from_array(np.zeros(scale.shape, np.int8), f"{name}_zero")])
    nodes.append(helper.make_node("DequantizeLinear", [f"{name}_int8", f"{name}_scale", f"{name}_zero"],
                                  [f"{name}_dq"], name=f"{name}_DQ", axis=axis))
    return f"{name}_dq"


def residual_adds(graph: onnx.GraphProto) -> list[int]:
    """Indices of a post-LN transformer's residual Adds: read by one LayerNormalization only, one operand itself a
    LayerNormalization's output (the skip). The embeddings' sum has no such operand, so it stays float."""
    norms = {n.output[0] for n in graph.node if n.op_type == "LayerNormalization"}
    readers = Counter(i for n in graph.node for i in n.input)
    norm_inputs = {n.input[0] for n in graph.node if n.op_type == "LayerNormalization"}
    return [k for k, n in enumerate(graph.node)
            if n.op_type == "Add" and readers[n.output[0]] == 1 and n.output[0] in norm_inputs
            and any(i in norms for i in n.input)]


def bert_qdq(layers: int = 12, hidden: int = 768, heads: int = 12, ffn: int = 3072, vocab: int = 30522,
             max_positions: int = 512, calib_batches: int = 4, calib_batch: int = 4, calib_sequence: int = 32,
             residual: bool = False) -> onnx.ModelProto:
    """BERT (the builder above) explicitly quantized the way a QAT export looks: every linear layer's weight
    as an int8 initializer read through a per-output-column DequantizeLinear (axis 1 of [K, N]) and its input
    through QuantizeLinear -> DequantizeLinear (int8, per tensor, zero point 0; one pair per tensor, shared by
    the Q/K/V projections). Attention's activation x activation MatMuls stay float. ``residual``: both operands
    of every residual Add too (``residual_adds``), so the residual stream between layers is int8 as well. Activation
    scales are max |x| / 127 over seeded random token batches, run through onnxruntime on the float model."""
    model = bert(layers, hidden, heads, ffn, vocab, max_positions)
    graph = model.graph
    weights = {t.name: t for t in graph.initializer}
    linear = [n for n in graph.node if n.op_type == "MatMul" and n.input[1] in weights]
    rng = np.random.default_rng(2025)
    feeds = [{"input_ids": rng.integers(0, vocab, (calib_batch, calib_sequence)).astype(np.int64),
              "attention_mask": np.ones((calib_batch, calib_sequence), np.int64),
              "token_type_ids": rng.integers(0, 2, (calib_batch, calib_sequence)).astype(np.int64)}
             for _ in range(calib_batches)]
    linear_ids = {id(n) for n in linear}
    targets = {k: [(0, None), (1, 1)] for k, n in enumerate(graph.node) if id(n) in linear_ids}
    if residual:
        targets |= {k: [(0, None), (1, None)] for k in residual_adds(graph)}
    insert_qdq(model, targets, feeds)
    graph.name = "bert_qdq_residual" if residual else "bert_qdq"
    onnx.checker.check_model(model)
    return model


def _amax_over_feeds(model: onnx.ModelProto, names: list[str], feeds: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """max |x| of each named tensor over the feeds, computed by onnxruntime on the float model."""
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names)
    probe.ir_version = min(probe.ir_version, 10)  # onnxruntime builds that predate IR 14 refuse newer files
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    amax = dict.fromkeys(names, 0.0)
    for feed in feeds:
        for name, value in zip(names, session.run(names, feed)):
            amax[name] = max(amax[name], float(np.abs(value).max()))
    return amax


#: name -> (full-size builder, small builder for tests)
MODELS: dict[str, tuple[Callable[[], onnx.ModelProto], Callable[[], onnx.ModelProto]]] = {
    "resnet50": (resnet50, lambda: resnet50(image_size=64)),
    "resnet50_qdq": (resnet50_qdq, lambda: resnet50_qdq(image_size=64)),
    "mobilenetv2": (mobilenetv2, lambda: mobilenetv2(image_size=64, width_mult=0.5, classes=100)),
    "bert_base": (bert, lambda: bert(layers=2, hidden=64, heads=4, ffn=128, vocab=1000, max_positions=128)),
    "gpt2": (gpt2, lambda: gpt2(layers=2, hidden=64, heads=4, vocab=1000, max_positions=128)),
    "yolo_nms": (yolo_nms, lambda: yolo_nms(image_size=128, width=8, classes=8, score=0.5)),
    "bert_qdq": (bert_qdq, lambda: bert_qdq(layers=2, hidden=64, heads=4, ffn=128, vocab=1000, max_positions=128)),
    "bert_qdq_residual": (lambda: bert_qdq(residual=True),
                          lambda: bert_qdq(layers=2, hidden=64, heads=4, ffn=128, vocab=1000, max_positions=128,
                                           residual=True)),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="models", help="output directory")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    ap.add_argument("--small", action="store_true", help="reduced sizes (same architectures), for tests")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for name in args.models.split(","):
        if name not in MODELS:
            ap.error(f"unknown model '{name}' (choose from {', '.join(MODELS)})")
        model = MODELS[name][1 if args.small else 0]()
        path = os.path.join(args.out, f"{name}.onnx")
        onnx.save(model, path)
        params = sum(int(np.prod(i.dims)) for i in model.graph.initializer)
        print(f"{path}: {len(model.graph.node)} nodes, {params / 1e6:.1f} M parameters")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
