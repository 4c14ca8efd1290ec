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

Requantizing epilogue (the guide's "fused requantize"): when the layer's result (after its activation) is
read only by a ``QuantizeLinear`` to int8 with one scale and zero point 0 -- BERT's FFN1 GELU output feeding
FFN2's input quantization -- that QuantizeLinear joins the layer: ``QMatMul(x_q, x_scale, W_q, w_scale,
bias or "", y_scale)`` writes int8 (``saturate(rint(y / y_scale))``, exactly QuantizeLinear), and the next
DequantizeLinear -> QMatMul reads it with no float tensor in between.

Reduced precision: the precision pass leaves Q/DQ scales in their own type and declares a DequantizeLinear's
16-bit output with ``output_dtype``; the fused layer's float result then has that type (attribute
``float_dtype``, an ONNX type number, set when it differs from the scales' type) while its epilogue still
computes in float32 with the exact scales.

``fold_constants`` must leave the weight's DequantizeLinear in place (``keeps_int8_weight``): folded, the
weight would be a float constant and its int8 form lost.

``BuilderConfig.int8_gemm = False`` (default from ``KILN_INT8_GEMM=0``) turns the pass off (and
``keeps_int8_weight`` with it): the Q/DQ pairs then run as fake-quantizing pointwise kernels and the MatMuls
as float GEMMs of the dequantized (folded) weights -- the same values up to float rounding, for comparing the
INT8 GEMM path against (``bench.int8`` variant ``int8_explicit_floatgemm``).

FP8 (E4M3): the same pattern over ``float8e4m3fn`` tensors (opset 19+) fuses into a QMatMul with fp8
operands whose accumulator is float32 (Hopper's FP8 tensor cores through cuBLASLt). x and W must share the
type (int8 x fp8 does not fuse); zero points must be absent or 0 (ONNX requires 0 for float8 anyway). The
weight may be scaled per tensor or per output column: cuBLASLt's own A/B scales are per tensor only, but the
CUDA lowering applies both scales in its pointwise epilogue (see backends/cuda/int8_gemm.py), so a
per-column scale costs nothing there. A following ``QuantizeLinear`` to float8e4m3fn (per tensor, saturate=1)
is the requantizing epilogue as for int8. E5M2 and the "fnuz" types stay unfused.
"""

from __future__ import annotations

import numpy as np

from engine_core.builder_config import build_knobs
from engine_core.ir import Graph, Node
from engine_core.ops.fused import INT8, QMATMUL_OPERANDS
from engine_core.passes.pattern import Uses, fuse_matches, is_op, known_rank, other_input
from engine_core.types import np_to_onnx, onnx_to_np

FLOAT_TYPES = ("float32", "float16", "bfloat16")
#: ONNX activation op -> QMatMul activation name (Gelu's approximate attribute picks GeluTanh)
_ACTIVATIONS = {"Relu": "Relu", "Sigmoid": "Sigmoid", "Tanh": "Tanh"}


def _float_constant(graph: Graph, name: str) -> np.ndarray | None:
    value = graph.constants.get(name)
    return value if isinstance(value, np.ndarray) and (value.dtype.kind == "f" or value.dtype.name == "bfloat16") \
        else None


def _zero_point_ok(graph: Graph, dq: Node) -> bool:
    """No zero point, or a constant int8 / float8e4m3fn zero point that is all zeros (symmetric)."""
    if len(dq.inputs) < 3 or not dq.inputs[2]:
        return True
    zero = graph.constants.get(dq.inputs[2])
    return isinstance(zero, np.ndarray) and zero.dtype in QMATMUL_OPERANDS and not np.any(zero.astype(np.float32))


def _dq_output_dtype(graph: Graph, dq: Node) -> np.dtype | None:
    """The float type a DequantizeLinear writes: its ``output_dtype`` (set by the precision pass), else its
    scale's; None for a non-float type."""
    declared = dq.attr("output_dtype", 0)
    dtype = np.dtype(onnx_to_np(declared)) if declared else graph.constants[dq.inputs[1]].dtype
    return dtype if dtype.name in FLOAT_TYPES else None


def _plain_dq(graph: Graph, dq: Node | None) -> bool:
    """A DequantizeLinear with a constant float scale, zero point 0, no blocks, writing a float type."""
    return is_op(dq, "DequantizeLinear") and len(dq.inputs) >= 2 and _float_constant(graph, dq.inputs[1]) is not None \
        and not dq.attr("block_size", 0) and _zero_point_ok(graph, dq) and _dq_output_dtype(graph, dq) is not None


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


def _activation_dq(graph: Graph, uses: Uses, name: str, types: tuple[np.dtype, ...] = (INT8,)) -> Node | None:
    """The DequantizeLinear producing ``name`` when it dequantizes a tensor of one of ``types`` (int8 unless
    told: fuse_qdq_conv reads int8 only) with one scale."""
    dq = uses.producers.get(name)
    if not _plain_dq(graph, dq) or _quantized_dtype(graph, uses, dq) not in types:
        return None
    return dq if _float_constant(graph, dq.inputs[1]).size == 1 else None


def _weight_dq(graph: Graph, uses: Uses, name: str, trans_b: int) -> Node | None:
    """The DequantizeLinear producing ``name`` from a 2-D int8 or float8e4m3fn constant, scaled per tensor or
    per output column (axis 1 of [K, N]; axis 0 of a transB [N, K] weight)."""
    dq = uses.producers.get(name)
    if not _plain_dq(graph, dq):
        return None
    weight = graph.constants.get(dq.inputs[0])
    if not isinstance(weight, np.ndarray) or weight.dtype not in QMATMUL_OPERANDS or weight.ndim != 2:
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


def _requantize_scale(graph: Graph, q: Node | None, tail: str, dtype: np.dtype = INT8) -> str | None:
    """The scale of ``q`` when it quantizes ``tail`` the way a requantizing epilogue can: to the operands'
    ``dtype`` (an all-zero zero point of that type, or none and ``output_dtype`` that type), one constant
    float scale, no blocks, the default saturation and precision."""
    if not is_op(q, "QuantizeLinear") or len(q.inputs) < 2 or q.inputs[0] != tail:
        return None
    scale = _float_constant(graph, q.inputs[1])
    if scale is None or scale.size != 1 or q.attr("block_size", 0) or q.attr("precision", 0) \
            or not q.attr("saturate", 1):
        return None
    if len(q.inputs) > 2 and q.inputs[2]:
        zero = graph.constants.get(q.inputs[2])
        return q.inputs[1] if _zero_point_ok(graph, q) and zero.dtype == dtype else None
    return q.inputs[1] if q.attr("output_dtype", 0) == np_to_onnx(dtype) else None


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


def _match(graph: Graph, uses: Uses, mm: Node, requantize: bool) -> tuple[Node, list[Node]] | None:
    """The QMatMul node replacing ``mm`` (and the nodes it covers, a requantizing QuantizeLinear last), or
    None."""
    operands = _gemm_operands(mm)
    if operands is None:
        return None
    trans_b, gemm_c = operands
    x_dq = _activation_dq(graph, uses, mm.inputs[0], QMATMUL_OPERANDS)
    w_dq = _weight_dq(graph, uses, mm.inputs[1], trans_b)
    if x_dq is None or w_dq is None:
        return None
    operand = graph.constants[w_dq.inputs[0]].dtype
    if _quantized_dtype(graph, uses, x_dq) != operand:  # int8 x fp8: no tensor-core GEMM takes the mix
        return None
    x_scale, w_scale = graph.constants[x_dq.inputs[1]], graph.constants[w_dq.inputs[1]]
    float_dtype = _dq_output_dtype(graph, x_dq)
    if x_scale.dtype != w_scale.dtype or float_dtype != _dq_output_dtype(graph, w_dq):
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
    activation = _activation(step)
    if activation is not None:
        covered.append(step)
        tail = step.outputs[0]
    inputs = [x_dq.inputs[0], x_dq.inputs[1], w_dq.inputs[0], w_dq.inputs[1], bias]
    q = uses.sole_reader(tail) if requantize else None
    y_scale = _requantize_scale(graph, q, tail, operand)
    if y_scale is not None:
        covered.append(q)
        inputs.append(y_scale)
        tail = q.outputs[0]
    attrs = {"transB": trans_b, "activation": activation or ""}
    if float_dtype != x_scale.dtype:
        attrs["float_dtype"] = np_to_onnx(float_dtype)
    node = Node("QMatMul", inputs, [tail], attrs, mm.name, "kiln", 1, [o for n in covered for o in n.origin])
    return node, covered


def enabled() -> bool:
    """Whether Q/DQ MatMuls become QMatMul: the build's ``BuilderConfig.int8_gemm``; outside a build, unless
    ``KILN_INT8_GEMM=0``."""
    return build_knobs().int8_gemm


def fuse_qdq_matmul(graph: Graph, *, requantize: bool = True) -> int:
    """Fuse every eligible Q/DQ MatMul/Gemm chain in place (when ``enabled()``); returns how many QMatMul layers
    were made. ``requantize=False`` leaves every QuantizeLinear a layer of its own (to compare against)."""
    if not enabled():
        return 0
    uses = Uses(graph)
    return fuse_matches(graph, ("MatMul", "Gemm"), lambda mm, _: _match(graph, uses, mm, requantize))


def requantizes(node: Node) -> bool:
    """Whether a QMatMul writes its operand type (int8 / fp8) through its requantizing epilogue (it has the
    output scale, input 5)."""
    return node.op_type == "QMatMul" and len(node.inputs) > 5 and bool(node.inputs[5])


def keeps_int8_weight(graph: Graph, node: Node, uses: Uses) -> bool:
    """Whether constant folding must leave ``node`` alone: a DequantizeLinear of an int8 or float8e4m3fn 2-D
    constant with zero point 0 whose every reader is a MatMul/Gemm taking it as the weight (input 1) and a
    dequantized tensor as input 0 -- the layers this pass turns into INT8 / FP8 GEMMs, which read the weight
    in its quantized type."""
    if not enabled() or not _plain_dq(graph, node) or node.inputs[0] not in graph.constants:
        return False
    weight = graph.constants[node.inputs[0]]
    readers = uses.consumers.get(node.outputs[0], [])
    if weight.dtype not in QMATMUL_OPERANDS or weight.ndim != 2 or not readers:
        return False
    return all(is_op(r, "MatMul", "Gemm") and r.inputs[1] == node.outputs[0] and r.inputs[0] != node.outputs[0]
               and is_op(uses.producers.get(r.inputs[0]), "DequantizeLinear") for r in readers)
