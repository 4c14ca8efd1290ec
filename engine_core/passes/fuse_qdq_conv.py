"""Explicit Q/DQ around a 2-D Conv -> one ``kiln.QConv`` (an INT8 implicit GEMM with a float epilogue).

Pattern (the TensorRT guide's "fuse Q/DQ with weighted node", as QAT exports and tools/make_models.py's
``resnet50_qdq`` write it):
``DequantizeLinear(x_q int8, x_scale) -> Conv(group 1) <- DequantizeLinear(W_q int8 [K, C, R, S] constant,
w_scale per tensor or per output channel (axis 0))``, zero points 0, then optionally a bias (the Conv's input 2,
or an ``Add`` of a per-channel constant), a residual ``Add`` of another float tensor (ResNet's shortcut, which
arrives through its own DequantizeLinear), an activation (Relu, Sigmoid, Tanh, Gelu) and a
``QuantizeLinear`` to int8 (one scale, zero point 0) that is the activation's only reader. It becomes
``QConv(x_q, x_scale, W_q, w_scale, bias or "", residual or "", y_scale?, residual_scale?)`` with the Conv's
attributes and ``activation``; a residual produced by a per-tensor int8 DequantizeLinear is read as that int8
tensor with ``residual_scale`` (the DequantizeLinear folds in).

Why: the convolution then reads int8 operands and sums in int32 (INT8 tensor cores through an implicit GEMM,
engine_core/backends/cuda/int8_conv.py), and dequantization, bias, residual, activation and the next layer's
quantization run in one epilogue that stores int8: ResNet's activations move between layers as int8.

Only symmetric int8 fuses (a zero point would need correction terms); grouped and non-2-D convolutions stay
as they are.

**On for CUDA builds whose cuDNN builds INT8 graphs** (the builder probes it, ``int8_convolutions``), off for
the CPU backend; ``BuilderConfig.int8_conv = True`` / ``False`` (default from ``KILN_INT8_CONV=1`` / ``0``)
forces it either way. On the H100 (2026-11-23, bench/int8.py, ResNet-50 made Q/DQ at batch 128) float
convolutions of the dequantized weights ran 9.47 ms, the QConv path (52 cuDNN INT8 graphs,
engine_core/backends/cuda/cudnn_conv.py) 5.97 ms with the RGB stem still padded into INT8 (2.6 ms of it; now it
stays float, ``INT8_CHANNEL_MULTIPLE``); Kiln's fp16 build of the float model 4.64 ms.
``fold_constants`` must leave the weight's DequantizeLinear in place for this pass to see the int8
weight: ``keeps_int8_conv_weight`` says which ones (it mirrors this pass's conditions, so a kept weight is
always fused rather than dequantized at run time).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import numpy as np

from engine_core.builder_config import build_knobs
from engine_core.ir import Graph, Node
from engine_core.passes.fuse_qdq_matmul import (
    INT8,
    _activation,
    _activation_dq,
    _dq_output_dtype,
    _float_constant,
    _plain_dq,
    _quantized_dtype,
    _requantize_scale,
)
from engine_core.passes.pattern import Uses, fuse_matches, is_op, other_input
from engine_core.types import np_to_onnx

#: Conv attributes QConv keeps (group is always 1)
CONV_ATTRS = ("auto_pad", "dilations", "kernel_shape", "pads", "strides")


#: input channels must be a multiple of this for a convolution to run in INT8. The GPU's INT8 kernels (cuDNN's,
#: cuBLASLt's IMMA) need C % 4 == 0; padded to 4, ResNet-50's RGB stem cost 2.6 ms at batch 128 on the H100
#: (bench/results/int8_20261123T154039.json: im2col, IMMA GEMM, epilogue) where its fp16 convolution takes 0.21
#: ms, so such a layer stays a float convolution of the dequantized weight (TensorRT also keeps the RGB stem
#: out of INT8)
INT8_CHANNEL_MULTIPLE = 4


def _weight_dq(graph: Graph, uses: Uses, name: str) -> Node | None:
    """The DequantizeLinear producing ``name`` from a 4-D int8 constant over a multiple of
    ``INT8_CHANNEL_MULTIPLE`` input channels, scaled per tensor or per output channel (axis 0)."""
    dq = uses.producers.get(name)
    if not _plain_dq(graph, dq):
        return None
    weight = graph.constants.get(dq.inputs[0])
    if not isinstance(weight, np.ndarray) or weight.dtype != INT8 or weight.ndim != 4 \
            or weight.shape[1] % INT8_CHANNEL_MULTIPLE:
        return None
    scale = _float_constant(graph, dq.inputs[1])
    if scale.size == 1:
        return dq
    axis = int(dq.attr("axis", 1))
    return dq if scale.ndim == 1 and axis in (0, -4) and scale.size == weight.shape[0] else None


def _int8_activation_dq(graph: Graph, uses: Uses, name: str) -> Node | None:
    """The per-tensor DequantizeLinear of an int8 tensor producing ``name`` (int8 checked here too: the
    MatMul helpers may learn other operand types)."""
    dq = _activation_dq(graph, uses, name)
    return dq if dq is not None and _quantized_dtype(graph, uses, dq) == INT8 else None


def _int8_requantize_scale(graph: Graph, q: Node | None, tail: str) -> str | None:
    """The scale of ``q`` when it quantizes ``tail`` to int8 with one scale and zero point 0."""
    scale = _requantize_scale(graph, q, tail)
    if scale is None:
        return None
    if len(q.inputs) > 2 and q.inputs[2]:
        return scale if graph.constants[q.inputs[2]].dtype == INT8 else None
    return scale if q.attr("output_dtype", 0) == np_to_onnx(INT8) else None


def _plain_conv(node: Node | None) -> bool:
    """A Conv with two or three inputs and one group (the weight's rank is checked with the weight)."""
    return is_op(node, "Conv") and 2 <= len(node.inputs) <= 3 and int(node.attr("group", 1)) == 1


def _channel_bias(graph: Graph, name: str, channels: int, added: bool) -> str | None:
    """A float constant adding one value per output channel, as its 1-D form: the Conv's own bias is [K];
    an ``Add`` operand (``added``) broadcasts from the right, so only [K, 1, 1] or [1, K, 1, 1] is per channel."""
    value = _float_constant(graph, name)
    if value is None or value.size != channels or value.ndim == 0 or value.ndim > 4:
        return None
    if not added:
        return name if value.ndim == 1 else None
    if value.ndim < 3 or value.shape[-3] != channels:
        return None
    return graph.add_constant(f"{name}_vector", value.reshape(-1))


def _residual(graph: Graph, add: Node | None, tail: str) -> str | None:
    """The other operand of ``add`` when it is a computed (non-constant) tensor other than ``tail``."""
    if not is_op(add, "Add"):
        return None
    other = other_input(add, tail)
    return other if other and other != tail and other not in graph.constants else None


def _int8_residual(graph: Graph, uses: Uses, residual: str, float_dtype: np.dtype) -> tuple[str, str]:
    """(residual, residual_scale): the int8 tensor and scale of the per-tensor DequantizeLinear producing a
    float residual (ResNet's shortcut arrives that way), else (residual, ""). Why: the convolution then reads the
    shortcut as int8 (a quarter of fp32's bytes) and the DequantizeLinear has no reader left."""
    dq = _int8_activation_dq(graph, uses, residual)
    if dq is None or _dq_output_dtype(graph, dq) != float_dtype:
        return residual, ""
    return dq.inputs[0], dq.inputs[1]


def _match(graph: Graph, uses: Uses, conv: Node, requantize: bool, removed: set[int]) -> tuple[Node, list[Node]] | None:
    """The QConv node replacing ``conv`` (and the nodes it covers, a requantizing QuantizeLinear last), or
    None. The chain stops at nodes an earlier match covered (``removed``: an Add two convolutions feed)."""
    if not _plain_conv(conv):
        return None

    def reader(tensor: str) -> Node | None:
        node = uses.sole_reader(tensor)
        return None if node is None or id(node) in removed else node

    x_dq = _int8_activation_dq(graph, uses, conv.inputs[0])
    w_dq = _weight_dq(graph, uses, conv.inputs[1])
    if x_dq is None or w_dq is None:
        return None
    x_scale, w_scale = graph.constants[x_dq.inputs[1]], graph.constants[w_dq.inputs[1]]
    float_dtype = _dq_output_dtype(graph, x_dq)
    if x_scale.dtype != w_scale.dtype or float_dtype != _dq_output_dtype(graph, w_dq):
        return None
    channels = graph.constants[w_dq.inputs[0]].shape[0]
    bias = ""
    if len(conv.inputs) > 2 and conv.inputs[2]:
        bias = _channel_bias(graph, conv.inputs[2], channels, added=False)
        if bias is None:
            return None
    covered, tail = [conv], conv.outputs[0]
    step = reader(tail)
    if not bias and is_op(step, "Add"):
        found = _channel_bias(graph, other_input(step, tail) or "", channels, added=True)
        if found:
            bias, tail = found, step.outputs[0]
            covered.append(step)
            step = reader(tail)
    residual = _residual(graph, step, tail) or ""
    residual_scale = ""
    if residual:
        covered.append(step)
        tail = step.outputs[0]
        step = reader(tail)
        residual, residual_scale = _int8_residual(graph, uses, residual, float_dtype)
    activation = _activation(step)
    if activation is not None:
        covered.append(step)
        tail = step.outputs[0]
    inputs = [x_dq.inputs[0], x_dq.inputs[1], w_dq.inputs[0], w_dq.inputs[1], bias, residual]
    q = reader(tail) if requantize else None
    y_scale = _int8_requantize_scale(graph, q, tail)
    if y_scale is not None:
        covered.append(q)
        tail = q.outputs[0]
    inputs.append(y_scale or "")
    if residual_scale:
        inputs.append(residual_scale)
    while not inputs[-1]:
        inputs.pop()
    attrs = {k: conv.attrs[k] for k in CONV_ATTRS if k in conv.attrs}
    attrs["activation"] = activation or ""
    if float_dtype != x_scale.dtype:
        attrs["float_dtype"] = np_to_onnx(float_dtype)
    node = Node("QConv", inputs, [tail], attrs, conv.name, "kiln", 1, [o for n in covered for o in n.origin])
    return node, covered


#: the build's choice (``int8_convolutions``): CUDA builds whose cuDNN runs INT8 graphs turn the pass on
_BUILD_CHOICE: ContextVar[bool] = ContextVar("int8_convolutions", default=False)


def enabled() -> bool:
    """Whether Q/DQ convolutions become QConv: the build's ``BuilderConfig.int8_conv`` (outside a build
    ``KILN_INT8_CONV=1`` / ``0``) forces it, else the build's choice (on for CUDA builds with cuDNN INT8, off
    otherwise: see the module docstring)."""
    forced = build_knobs().int8_conv
    return forced if forced is not None else _BUILD_CHOICE.get()


@contextmanager
def int8_convolutions(on: bool) -> Iterator[None]:
    """Within the block, ``enabled()`` is ``on`` unless ``int8_conv`` forces it (the builder sets it per build:
    constant folding and this pass must agree on which weights stay int8)."""
    token = _BUILD_CHOICE.set(on)
    try:
        yield
    finally:
        _BUILD_CHOICE.reset(token)


def fuse_qdq_conv(graph: Graph, *, requantize: bool = True) -> int:
    """Fuse every eligible Q/DQ Conv chain in place (only when ``enabled()``); returns how many QConv layers
    were made. ``requantize=False`` leaves every QuantizeLinear a layer of its own (to compare against)."""
    if not enabled():
        return 0
    uses = Uses(graph)
    return fuse_matches(graph, ("Conv",), lambda conv, removed: _match(graph, uses, conv, requantize, removed))


def requantizes(node: Node) -> bool:
    """Whether a QConv writes int8 through its requantizing epilogue (it has the output scale, input 6)."""
    return node.op_type == "QConv" and len(node.inputs) > 6 and bool(node.inputs[6])


def keeps_int8_conv_weight(graph: Graph, node: Node, uses: Uses) -> bool:
    """Whether constant folding must leave ``node`` alone: a DequantizeLinear of a 4-D int8 constant that
    this pass will fuse -- every reader a one-group Conv taking it as the weight (input 1) and an int8
    per-tensor DequantizeLinear as input 0. Folded, the weight would be a float constant and the
    convolution could not run on int8 operands."""
    if not enabled() or not is_op(node, "DequantizeLinear") or node.inputs[0] not in graph.constants:
        return False
    readers = uses.consumers.get(node.outputs[0], [])
    if not readers or node.outputs[0] in uses.outputs:
        return False
    return all(_plain_conv(r) and r.inputs[1] == node.outputs[0] and r.inputs[0] != node.outputs[0]
               and _weight_dq(graph, uses, r.inputs[1]) is node and _int8_activation_dq(graph, uses, r.inputs[0])
               is not None for r in readers)
