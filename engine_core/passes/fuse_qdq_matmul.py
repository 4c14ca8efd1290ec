"""Explicit Q/DQ around a MatMul/Gemm -> one ``kiln.QMatMul`` (an INT8 GEMM with a float epilogue).

Pattern (the TensorRT guide's "fuse Q/DQ with weighted node"):
``DequantizeLinear(x_q int8, x_scale, zp 0) -> MatMul/Gemm <- DequantizeLinear(W_q int8 constant, w_scale, zp 0)``,
optionally followed by ``Add(bias)`` and an activation (Relu, Gelu, Sigmoid, Tanh), becomes
``QMatMul(x_q, x_scale, W_q, w_scale, bias?)``. ``x_scale`` is per tensor; ``w_scale`` per tensor or one
value per output column (Gemm ``transB=1`` weights are [N, K]: attribute ``transB``).

Why: the GEMM then reads int8 operands and accumulates in int32 (INT8 tensor cores) and the dequantization
(``acc * x_scale * w_scale[n]``), bias and activation run in one epilogue; the unfused graph multiplies two
dequantized float tensors. Only symmetric int8 (zero points 0) fuses: an asymmetric or uint8 zero point
would need correction terms, so such graphs stay as they are. The activation's DequantizeLinear stays when
other layers read it (dead-code elimination drops it otherwise).

``fold_constants`` must leave the weight's DequantizeLinear in place (``keeps_int8_weight``): folded, the
weight would be a float constant and its int8 form lost.
"""

from __future__ import annotations

import numpy as np

from engine_core.ir import Graph, Node
from engine_core.passes.pattern import Uses, is_op, known_rank, other_input, replace_nodes

INT8 = np.dtype(np.int8)
#: ONNX activation op -> QMatMul activation name (Gelu's approximate attribute picks GeluTanh)
_ACTIVATIONS = {"Relu": "Relu", "Sigmoid": "Sigmoid", "Tanh": "Tanh"}


def _float_constant(graph: Graph, name: str) -> np.ndarray | None:
    value = graph.constants.get(name)
    return value if isinstance(value, np.ndarray) and (value.dtype.kind == "f" or value.dtype.name == "bfloat16") \
        else None


def _zero_point_ok(graph: Graph, dq: Node) -> bool:
    """No zero point, or a constant int8 zero point that is all zeros (symmetric quantization)."""
    if len(dq.inputs) < 3 or not dq.inputs[2]:
        return True
    zero = graph.constants.get(dq.inputs[2])
    return isinstance(zero, np.ndarray) and zero.dtype == INT8 and not np.any(zero)


def _plain_dq(graph: Graph, dq: Node | None) -> bool:
    """A DequantizeLinear with a constant float scale, zero point 0, no blocks and no output type override."""
    return is_op(dq, "DequantizeLinear") and len(dq.inputs) >= 2 and _float_constant(graph, dq.inputs[1]) is not None \
        and not dq.attr("block_size", 0) and not dq.attr("output_dtype", 0) and _zero_point_ok(graph, dq)


def _quantized_dtype(graph: Graph, uses: Uses, dq: Node) -> np.dtype | None:
    """The integer type DequantizeLinear reads: its zero point's, else the producer's output type."""
    if len(dq.inputs) > 2 and dq.inputs[2] and dq.inputs[2] in graph.constants:
        return graph.constants[dq.inputs[2]].dtype
    source = dq.inputs[0]
    if source in graph.constants:
        return graph.constants[source].dtype
    value = next((v for v in graph.inputs if v.name == source), None)
    if value is not None:
        return value.dtype
    q = uses.producers.get(source)
    if not is_op(q, "QuantizeLinear"):
        return None
    if len(q.inputs) > 2 and q.inputs[2]:
        zero = graph.constants.get(q.inputs[2])
        return zero.dtype if zero is not None else None
    if q.attr("output_dtype", 0):
        from engine_core.types import onnx_to_np

        return np.dtype(onnx_to_np(q.attr("output_dtype")))
    return np.dtype(np.uint8)  # QuantizeLinear's default


def _activation_dq(graph: Graph, uses: Uses, name: str) -> Node | None:
    """The DequantizeLinear producing ``name`` when it dequantizes an int8 tensor with one scale."""
    dq = uses.producers.get(name)
    if not _plain_dq(graph, dq) or _quantized_dtype(graph, uses, dq) != INT8:
        return None
    return dq if _float_constant(graph, dq.inputs[1]).size == 1 else None


def _weight_dq(graph: Graph, uses: Uses, name: str, trans_b: int) -> Node | None:
    """The DequantizeLinear producing ``name`` from a 2-D int8 constant, scaled per tensor or per output
    column (axis 1 of [K, N]; axis 0 of a transB [N, K] weight)."""
    dq = uses.producers.get(name)
    if not _plain_dq(graph, dq):
        return None
    weight = graph.constants.get(dq.inputs[0])
    if not isinstance(weight, np.ndarray) or weight.dtype != INT8 or weight.ndim != 2:
        return None
    scale = _float_constant(graph, dq.inputs[1])
    if scale.size == 1:
        return dq
    columns = 0 if trans_b else 1
    axis = int(dq.attr("axis", 1))
    axis = axis + 2 if axis < 0 else axis
    return dq if scale.ndim == 1 and axis == columns and scale.size == weight.shape[columns] else None


def _bias(graph: Graph, name: str, columns: int, out_rank: int | None) -> str | None:
    """A constant adding one value per output column ([N], or [1, ..., 1, N] when the GEMM output is known
    to have at least that rank, else Add would widen it); its 1-D form."""
    value = _float_constant(graph, name)
    if value is None or value.ndim == 0 or value.shape[-1] != columns or any(d != 1 for d in value.shape[:-1]):
        return None
    if value.ndim > 1 and (out_rank or 0) < value.ndim:
        return None
    return name if value.ndim == 1 else graph.add_constant(f"{name}_vector", value.reshape(-1))


def _activation(node: Node | None) -> str | None:
    if is_op(node, "Gelu"):
        return "GeluTanh" if node.attr("approximate", "none") == "tanh" else "Gelu"
    return _ACTIVATIONS.get(node.op_type) if is_op(node, *_ACTIVATIONS) else None


def _gemm_operands(mm: Node) -> tuple[int, str] | None:
    """(transB, bias or "") of a MatMul/Gemm this pass can take: Gemm without transA, alpha 1, and a C that
    is a per-column bias with beta 1."""
    if is_op(mm, "MatMul") and len(mm.inputs) == 2:
        return 0, ""
    if not is_op(mm, "Gemm") or mm.attr("transA", 0) or float(mm.attr("alpha", 1.0)) != 1.0:
        return None
    trans_b = int(mm.attr("transB", 0))
    if len(mm.inputs) < 3 or not mm.inputs[2]:
        return trans_b, ""
    if float(mm.attr("beta", 1.0)) != 1.0:
        return None
    return trans_b, mm.inputs[2]


def _match(graph: Graph, uses: Uses, mm: Node) -> tuple[Node, list[Node]] | None:
    """The QMatMul node replacing ``mm`` (and the nodes it covers), or None."""
    operands = _gemm_operands(mm)
    if operands is None:
        return None
    trans_b, gemm_c = operands
    x_dq = _activation_dq(graph, uses, mm.inputs[0])
    w_dq = _weight_dq(graph, uses, mm.inputs[1], trans_b)
    if x_dq is None or w_dq is None:
        return None
    x_scale, w_scale = graph.constants[x_dq.inputs[1]], graph.constants[w_dq.inputs[1]]
    if x_scale.dtype != w_scale.dtype:
        return None
    columns = graph.constants[w_dq.inputs[0]].shape[0 if trans_b else 1]
    out_rank = 2 if is_op(mm, "Gemm") else known_rank(graph, uses, mm.inputs[0])
    bias = _bias(graph, gemm_c, columns, 2) if gemm_c else ""
    if bias is None:
        return None
    covered, tail = [mm], mm.outputs[0]
    step = uses.sole_reader(tail)
    if not bias and is_op(step, "Add"):
        found = _bias(graph, other_input(step, tail) or "", columns, out_rank)
        if found:
            bias, tail = found, step.outputs[0]
            covered.append(step)
            step = uses.sole_reader(tail)
    if bias and graph.constants[bias].dtype != x_scale.dtype:
        return None
    activation = _activation(step)
    if activation is not None:
        covered.append(step)
        tail = step.outputs[0]
    node = Node("QMatMul", [x_dq.inputs[0], x_dq.inputs[1], w_dq.inputs[0], w_dq.inputs[1], bias], [tail],
                {"transB": trans_b, "activation": activation or ""}, mm.name, "kiln", 1,
                [o for n in covered for o in n.origin])
    return node, covered


def fuse_qdq_matmul(graph: Graph) -> int:
    """Fuse every eligible Q/DQ MatMul/Gemm chain in place; returns how many QMatMul layers were made."""
    uses = Uses(graph)
    fused: dict[int, Node] = {}
    removed: set[int] = set()
    for mm in list(graph.nodes):
        if id(mm) in removed or not is_op(mm, "MatMul", "Gemm"):
            continue
        match = _match(graph, uses, mm)
        if match is None:
            continue
        node, covered = match
        fused[id(covered[-1])] = node
        removed.update(id(n) for n in covered)
    replace_nodes(graph, fused, removed)
    return len(fused)


def keeps_int8_weight(graph: Graph, node: Node, uses: Uses) -> bool:
    """Whether constant folding must leave ``node`` alone: a DequantizeLinear of an int8 2-D constant with
    zero point 0 whose every reader is a MatMul/Gemm taking it as the weight (input 1) and a dequantized
    tensor as input 0 -- the layers this pass turns into INT8 GEMMs, which read the weight as int8."""
    if not _plain_dq(graph, node) or node.inputs[0] not in graph.constants:
        return False
    weight = graph.constants[node.inputs[0]]
    readers = uses.consumers.get(node.outputs[0], [])
    if weight.dtype != INT8 or weight.ndim != 2 or not readers:
        return False
    return all(is_op(r, "MatMul", "Gemm") and r.inputs[1] == node.outputs[0] and r.inputs[0] != node.outputs[0]
               and is_op(uses.producers.get(r.inputs[0]), "DequantizeLinear") for r in readers)
