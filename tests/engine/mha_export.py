"""An ``nn.MultiheadAttention`` (batch_first) block as torch.onnx.export writes it, built with onnx.helper.

``F.multi_head_attention_forward`` works sequence-first: x [B, L, E] -> transpose(1, 0) -> one in-projection of 3E
columns -> ``unflatten(-1, (3, E)).unsqueeze(0).transpose(0, -2).squeeze(-2)`` -> q, k, v = proj[0], proj[1],
proj[2] -> view [L, B*H, D] -> transpose -> view [B, H, L, D] -> scaled dot-product attention -> permute(2, 0, 1, 3)
-> view [L*B, E] -> out-projection (Gemm) -> view [L, B, E] -> transpose(1, 0) -> + x. Every target is computed from
Shape nodes of the tensors, as the exporter writes it for a dynamic batch. Shared by the pass tests.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

EMBED, HEADS, SEQ = 8, 2, 5
SIZE = EMBED // HEADS


def mha_model(rng: np.random.Generator, layers: int = 1) -> onnx.ModelProto:
    """``layers`` pre-LN blocks ``x + mha(ln(x))`` on x [B, SEQ, EMBED] (B dynamic)."""
    nodes: list[onnx.NodeProto] = []
    inits = {"axis0": np.array(0, np.int64), "axis1": np.array(1, np.int64), "axis2": np.array(2, np.int64),
             "zero1": np.array([0], np.int64), "embed1": np.array([EMBED], np.int64),
             "minus1": np.array([-1], np.int64),
             "minus2": np.array([-2], np.int64), "three_e": np.array([3, EMBED], np.int64),
             "heads": np.array(HEADS, np.int64), "heads1": np.array([HEADS], np.int64),
             "size1": np.array([SIZE], np.int64), "scale": np.array(SIZE ** -0.25, np.float32)}
    x = "x"
    for i in range(layers):
        x = _block(nodes, inits, rng, x, f"l{i}_")
    nodes.append(helper.make_node("Identity", [x], ["y"]))
    graph = helper.make_graph(nodes, "mha", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", SEQ, EMBED])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def _block(nodes: list[onnx.NodeProto], inits: dict[str, np.ndarray], rng: np.random.Generator, x: str,
           p: str) -> str:
    """One block's nodes (names prefixed ``p``) appended to ``nodes``; returns its output."""

    def node(op: str, inputs: list[str], out: str, **attrs) -> str:
        nodes.append(helper.make_node(op, inputs, [p + out], name=p + out, **attrs))
        return p + out

    inits |= {p + "gamma": rng.standard_normal(EMBED).astype(np.float32),
              p + "beta": rng.standard_normal(EMBED).astype(np.float32),
              p + "w_in": (rng.standard_normal((EMBED, 3 * EMBED)) / 3).astype(np.float32),
              p + "b_in": rng.standard_normal(3 * EMBED).astype(np.float32),
              p + "w_out": (rng.standard_normal((EMBED, EMBED)) / 3).astype(np.float32),
              p + "b_out": rng.standard_normal(EMBED).astype(np.float32)}
    ln = node("LayerNormalization", [x, p + "gamma", p + "beta"], "ln", axis=-1)
    xt = node("Transpose", [ln], "xt", perm=[1, 0, 2])
    shape = node("Shape", [xt], "shape")
    seq, batch = node("Gather", [shape, "axis0"], "seq", axis=0), node("Gather", [shape, "axis1"], "batch", axis=0)
    proj = node("Add", [p + "b_in", node("MatMul", [xt, p + "w_in"], "mm")], "proj")
    lead = node("Slice", [node("Shape", [proj], "proj_shape"), "zero1", "minus1"], "lead")
    split = node("Reshape", [proj, node("Concat", [lead, "three_e"], "unflat", axis=0)], "unflattened")
    moved = node("Transpose", [node("Unsqueeze", [split, "zero1"], "unsq")], "moved", perm=[3, 1, 2, 0, 4])
    packed = node("Squeeze", [moved, "minus2"], "packed")
    seq1 = node("Unsqueeze", [seq, "zero1"], "seq1")
    batch1 = node("Unsqueeze", [batch, "zero1"], "batch1")
    bh1 = node("Unsqueeze", [node("Mul", [batch, "heads"], "bh"), "zero1"], "bh1")
    per_head = node("Concat", [seq1, bh1, "size1"], "per_head", axis=0)
    four_d = node("Concat", [batch1, "heads1", seq1, "size1"], "four_d", axis=0)
    qkv = []
    for j, name in enumerate("qkv"):
        picked = node("Gather", [packed, f"axis{j}"], name, axis=0)
        heads_first = node("Transpose", [node("Reshape", [picked, per_head], name + "_h")], name + "_t",
                           perm=[1, 0, 2])
        qkv.append(node("Reshape", [heads_first, four_d], name + "4"))
    q = node("Mul", [qkv[0], "scale"], "q_scaled")
    kt = node("Mul", [node("Transpose", [qkv[1]], "kt", perm=[0, 1, 3, 2]), "scale"], "kt_scaled")
    probs = node("Softmax", [node("MatMul", [q, kt], "scores")], "probs", axis=-1)
    seq_first = node("Transpose", [node("MatMul", [probs, qkv[2]], "att")], "seq_first", perm=[2, 0, 1, 3])
    rows1 = node("Unsqueeze", [node("Mul", [seq, batch], "rows"), "zero1"], "rows1")
    flat = node("Reshape", [seq_first, node("Concat", [rows1, "embed1"], "rows_e", axis=0)], "flat")
    out = node("Gemm", [flat, p + "w_out", p + "b_out"], "out_proj", transB=1)
    width1 = node("Unsqueeze", [node("Gather", [node("Shape", [out], "out_shape"), "axis1"], "width", axis=0),
                                "zero1"], "width1")
    back = node("Reshape", [out, node("Concat", [seq1, batch1, width1], "lbe", axis=0)], "back")
    return node("Add", [node("Transpose", [back], "batch_first", perm=[1, 0, 2]), x], "residual")
