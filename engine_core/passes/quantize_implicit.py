"""Implicit INT8 quantization: calibrated ranges -> Q/DQ pairs in front of the layers that run in INT8.

With ``BuilderFlag.INT8`` and a calibrator (no Q/DQ in the model), the reference quantizes the
weighted layers: Convolution, Deconvolution, fully connected / GEMM and MatMul. Kiln makes that
quantization explicit in the graph, so every backend sees the same thing a QAT export gives it:

- convolutions over input channels that are not a multiple of 4 (an RGB stem) stay float (see ``_can_quantize``);
- each float activation input of such a layer gets ``QuantizeLinear -> DequantizeLinear`` with the
  per-tensor scale ``amax / 127`` from calibration (int8, symmetric, zero point 0; the reference's
  implicit range is [-127, 127]); one pair per tensor, shared by all its quantized readers;
- so does the shortcut of a residual ``Add`` whose other operand a quantized Conv produces (ResNet's identity
  shortcut, ``_shortcut``), as explicitly quantized CNNs place it and the reference runs it: the convolution then
  reads the shortcut as int8 and the block's output has only quantized readers, so the convolution producing it
  requantizes instead of writing float for a separate QuantizeLinear kernel (the H100 profile of implicit INT8
  ResNet-50 had 12 such kernels: 5.3 ms at batch 128 against 3.5 ms for the explicit model);
- each constant weight becomes an int8 constant (max-abs symmetric, per output channel for Conv,
  ConvTranspose with group 1, Gemm and 2-D MatMul weights, else per tensor) read through a
  ``DequantizeLinear``; biases stay float (the reference adds them in float in the epilogue).

On the CPU backend the pairs simulate INT8 numerics exactly; a GPU backend fuses DQ -> layer -> into
an int8 kernel (int32 accumulation). Layers without a calibrated range for an activation input
(shape computations, tensors calibration never saw) stay float. The pass runs after the precision
pass: scales take the float type the tensor has then (float16 under FP16), so types stay consistent.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from engine_core.errors import BuildError
from engine_core.ir import Graph, Node
from engine_core.logger import Logger, Severity
from engine_core.passes.fuse_qdq_conv import INT8_CHANNEL_MULTIPLE
from engine_core.types import BuilderFlag

if TYPE_CHECKING:
    from engine_core.builder_config import BuilderConfig
    from engine_core.network import NetworkDefinition

#: Layers the reference runs in INT8 in implicit mode (the guide's weighted operations).
QUANTIZABLE_OPS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})
#: Inputs of each quantizable op that are data/weights (others, e.g. biases, stay float).
QUANTIZED_INPUTS = {"Conv": (0, 1), "ConvTranspose": (0, 1), "Gemm": (0, 1), "MatMul": (0, 1)}
#: Symmetric int8 range of implicit quantization.
INT8_MAX = 127.0
#: Name prefixes of the nodes this pass inserts (the quantization report finds quantized layers by them).
Q_PREFIX, DQ_PREFIX = "int8_q:", "int8_dq:"
_QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})


@dataclass
class Int8Policy:
    """What the INT8 flag asks of this build."""

    #: "implicit": calibrate, then insert Q/DQ (quantize_implicit); "explicit": the model's Q/DQ rule
    mode: str
    calibrator: Any = None
    warnings: list[str] = field(default_factory=list)

    @property
    def implicit(self) -> bool:
        return self.mode == "implicit"


def has_qdq(graph: Graph) -> bool:
    """Whether the model is explicitly quantized (any ONNX QuantizeLinear/DequantizeLinear)."""
    return any(n.op_type in _QDQ_OPS and not n.domain for n in graph.nodes)


def int8_policy(config: BuilderConfig, network: NetworkDefinition, logger: Logger | None = None) -> Int8Policy | None:
    """None without ``BuilderFlag.INT8``; "explicit" for Q/DQ models (a calibrator is then ignored, as
    in the reference); "implicit" with ``config.int8_calibrator``; else a BuildError saying what to set."""
    if not config.get_flag(BuilderFlag.INT8):
        return None
    calibrator = getattr(config, "int8_calibrator", None)
    if has_qdq(network.graph):
        policy = Int8Policy("explicit")
        if calibrator is not None:
            policy.warnings.append("the network has Q/DQ layers (explicit quantization): int8_calibrator is ignored")
    elif calibrator is None:
        raise BuildError("BuilderFlag.INT8 is set but the network has no Q/DQ layers and config.int8_calibrator "
                         "is not set: give a calibrator (kiln build --calib-data DIR) or a Q/DQ model")
    else:
        policy = Int8Policy("implicit", calibrator)
    if logger is not None:
        for message in policy.warnings:
            logger.log(Severity.WARNING, message)
    return policy


def quantize_implicit(graph: Graph, ranges: Mapping[str, float]) -> int:
    """Insert Q/DQ for INT8 in front of every quantizable layer with calibrated input ranges;
    returns the number of layers quantized. ``ranges``: tensor name -> amax (from calibrate())."""
    if not ranges:
        return 0
    dtypes = _float_dtypes(graph)
    producers = graph.producers()
    opset = max(13, graph.opsets.get("", 13))
    inserted: dict[str, str] = {}  # tensor -> its dequantized replacement
    new_nodes: list[Node] = []
    quantized_convs: set[str] = set()  # outputs of the Convs quantized so far
    quantized = 0

    def dequantized(node: Node, index: int) -> str:
        name = node.inputs[index]
        if name not in inserted:
            if name in graph.constants:
                inserted[name] = _quantize_weight(graph, node, index, opset, new_nodes)
            else:
                amax = _range_of(name, ranges, producers)
                inserted[name] = _quantize_activation(graph, name, amax, dtypes[name], opset, new_nodes)
        return inserted[name]

    for node in graph.nodes:
        if node.op_type in QUANTIZABLE_OPS and not node.domain and _can_quantize(node, graph, ranges, producers, dtypes):
            for index in QUANTIZED_INPUTS[node.op_type]:
                node.inputs[index] = dequantized(node, index)
            if node.op_type == "Conv":
                quantized_convs.add(node.outputs[0])
            quantized += 1
        index = _shortcut(node, graph, ranges, producers, dtypes, quantized_convs)
        if index is not None:
            node.inputs[index] = dequantized(node, index)
        new_nodes.append(node)
    graph.nodes = new_nodes
    return quantized


def _shortcut(node: Node, graph: Graph, ranges: Mapping[str, float], producers: dict[str, Node],
              dtypes: dict[str, np.dtype], quantized_convs: set[str]) -> int | None:
    """The input index of a residual Add's shortcut to quantize: the Add has two computed operands, exactly one
    of them a quantized Conv's output, and the other a calibrated float tensor not quantized yet (a projection
    shortcut is itself a quantized Conv's output, which its convolution writes quantized already)."""
    if node.op_type != "Add" or node.domain or len(node.inputs) != 2 or any(i in graph.constants for i in node.inputs):
        return None
    from_conv = [name in quantized_convs for name in node.inputs]
    if sum(from_conv) != 1:
        return None
    index = from_conv.index(False)
    return index if _calibrated_activation(node.inputs[index], ranges, producers, dtypes) else None


def _calibrated_activation(name: str, ranges: Mapping[str, float], producers: dict[str, Node],
                           dtypes: dict[str, np.dtype]) -> bool:
    """A float tensor with a positive calibrated range that no Q/DQ produces (not quantized already)."""
    producer = producers.get(name)
    if producer is not None and producer.op_type in _QDQ_OPS:
        return False
    return dtypes.get(name) is not None and (_range_of(name, ranges, producers) or 0) > 0


def _can_quantize(node: Node, graph: Graph, ranges: Mapping[str, float], producers: dict[str, Node],
                  dtypes: dict[str, np.dtype]) -> bool:
    """Every data input is a float constant, or a float tensor with a positive calibrated range; a Conv's input
    channels a multiple of INT8_CHANNEL_MULTIPLE (an RGB stem stays float, as fuse_qdq_conv leaves it: padded
    into INT8 it ran 12x slower than its fp16 convolution, and unfused its dequantized weight would not be a
    constant)."""
    weight = graph.constants.get(node.inputs[1]) if node.op_type == "Conv" and len(node.inputs) > 1 else None
    if weight is not None and weight.ndim > 1 and weight.shape[1] % INT8_CHANNEL_MULTIPLE:
        return False
    for index in QUANTIZED_INPUTS[node.op_type]:
        if index >= len(node.inputs) or not node.inputs[index]:
            return False
        name = node.inputs[index]
        if name in graph.constants:
            if graph.constants[name].dtype.kind != "f" or not graph.constants[name].size:
                return False
            continue
        if not _calibrated_activation(name, ranges, producers, dtypes):
            return False
    return True


def _range_of(name: str, ranges: Mapping[str, float], producers: dict[str, Node]) -> float | None:
    """A tensor's calibrated amax; through float->float Casts (reformat layers of the precision pass)."""
    seen = 0
    while name not in ranges and seen < 8:
        producer = producers.get(name)
        if producer is None or producer.op_type != "Cast" or producer.domain:
            return None
        name, seen = producer.inputs[0], seen + 1
    value = ranges.get(name)
    return float(value) if value is not None and np.isfinite(value) else None


def _quantize_activation(graph: Graph, name: str, amax: float | None, dtype: np.dtype, opset: int,
                         nodes: list[Node]) -> str:
    """x -> Q(int8, amax/127) -> DQ: appends the pair, returns the dequantized tensor."""
    scale = graph.add_constant(f"{name}_int8_scale", np.array(float(amax or 0) / INT8_MAX, dtype=dtype))
    zero = graph.add_constant(f"{name}_int8_zero", np.array(0, np.int8))
    q = graph.unique_name(f"{name}_int8")
    dq = graph.unique_name(f"{name}_dq")
    nodes.append(Node("QuantizeLinear", [name, scale, zero], [q], name=Q_PREFIX + name, opset=opset))
    nodes.append(Node("DequantizeLinear", [q, scale, zero], [dq], name=DQ_PREFIX + name, opset=opset))
    return dq


def _weight_axis(node: Node, index: int, weight: np.ndarray) -> int | None:
    """The output-channel axis of a weight for per-channel scales (None: per tensor)."""
    if index != 1:
        return None
    if node.op_type == "Conv":
        return 0
    if node.op_type == "ConvTranspose":
        return 1 if node.attr("group", 1) == 1 else None
    if node.op_type == "Gemm":
        return 0 if node.attr("transB", 0) else 1
    if node.op_type == "MatMul" and weight.ndim == 2:
        return 1
    return None


def _quantize_weight(graph: Graph, node: Node, index: int, opset: int, nodes: list[Node]) -> str:
    """A float weight -> int8 constant (symmetric, max-abs) + DequantizeLinear; returns its output."""
    name = node.inputs[index]
    w = graph.constants[name]
    axis = _weight_axis(node, index, w)
    w32 = w.astype(np.float32)
    if axis is None:
        amax = np.array(np.abs(w32).max())
    else:
        amax = np.abs(np.moveaxis(w32, axis, 0)).reshape(w.shape[axis], -1).max(axis=1)
    scale = np.where(amax > 0, amax / INT8_MAX, 1.0).astype(np.float32)
    shaped = scale if axis is None else scale.reshape([-1 if d == axis else 1 for d in range(w.ndim)])
    q = np.clip(np.rint(w32 / shaped), -INT8_MAX, INT8_MAX).astype(np.int8)
    q_name = graph.add_constant(f"{name}_int8", q)
    scale_name = graph.add_constant(f"{name}_int8_scale", scale.astype(w.dtype))
    zero_name = graph.add_constant(f"{name}_int8_zero", np.zeros(scale.shape, np.int8))
    out = graph.unique_name(f"{name}_dq")
    attrs = {"axis": axis} if axis is not None else {}
    nodes.append(Node("DequantizeLinear", [q_name, scale_name, zero_name], [out], attrs=attrs,
                      name=DQ_PREFIX + name, opset=opset))
    return out


def _float_dtypes(graph: Graph) -> dict[str, np.dtype]:
    """The float type of every float tensor (enough to type the scales): Cast gives its target,
    DequantizeLinear its scale's type, other layers the type of their first float input."""
    from engine_core.types import onnx_to_np

    dtypes: dict[str, np.dtype] = {n: v.dtype for n, v in graph.constants.items() if v.dtype.kind == "f"}
    dtypes.update({v.name: v.dtype for v in graph.inputs if v.dtype.kind == "f" or v.dtype.name == "bfloat16"})
    for node in graph.nodes:
        if node.op_type == "Cast" and not node.domain:
            out: np.dtype | None = np.dtype(onnx_to_np(node.attr("to")))
        elif node.op_type == "DequantizeLinear" and not node.domain and len(node.inputs) > 1:
            out = dtypes.get(node.inputs[1])
        elif node.op_type in ("QuantizeLinear", "Shape", "Size", "NonZero", "ArgMax", "ArgMin"):
            out = None
        else:
            out = next((dtypes[i] for i in node.inputs if i in dtypes), None)
        if out is not None and (out.kind == "f" or out.name == "bfloat16"):
            for name in node.outputs:
                if name:
                    dtypes[name] = out
    return dtypes
