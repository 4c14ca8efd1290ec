"""Lowering rules of the pointwise family: ONNX pointwise ops, ``kiln.PointwiseChain``, Quantize/DequantizeLinear
and inference BatchNormalization, each one generated kernel (engine_core/backends/cuda/pointwise.py).
"""

from __future__ import annotations

import numpy as np

from engine_core.backends.cuda.lower_rules.common import (
    out_layout,
)
from engine_core.backends.cuda.lowering_context import (
    LoweringContext,
    Ref,
    launch_program,
    lowering_rule,
)
from engine_core.backends.cuda.pointwise import (
    FLOATS,
    POINTWISE_OPS,
    PwNode,
    Unsupported,
    broadcast_strides,
    program_kernel,
)
from engine_core.ir import Graph, Node
from engine_core.ops import TensorInfo
from engine_core.ops.registry import normalize_axis


def _pointwise_launch(node: Node, ctx: LoweringContext, nodes: list[PwNode], inputs: list[str]) -> list:
    out_name = node.outputs[0]
    out = ctx.info(out_name)
    if len(inputs) == 0 or any(n == "" for n in inputs):
        raise Unsupported(f"{node.op_type} with missing inputs")
    ctx.layouts[out_name] = out_layout(node, ctx)
    infos = [ctx.info(n) for n in inputs]
    kernel = ctx.kernel(program_kernel(nodes, out.dtype, [i.dtype for i in infos]))
    if int(np.prod(out.shape)) == 0:
        return []
    return [launch_program(kernel, Ref(out_name), [Ref(n) for n in inputs], out.shape, ctx.strides(out_name),
                           [broadcast_strides(i.shape, out.shape, ctx.strides(n)) for n, i in zip(inputs, infos)])]


def lower_pointwise(node: Node, ctx: LoweringContext) -> list:
    if node.op_type == "Clip" and node.opset < 11:
        raise Unsupported("Clip before opset 11 keeps bounds in attributes")
    present = [n for n in node.inputs if n]
    args, index = [], 0
    for name in node.inputs:
        args.append(index if name else -1)
        index += bool(name)
    pw = PwNode.make(node.op_type, args, ctx.info(node.outputs[0]).dtype, node.attrs, node.opset)
    return _pointwise_launch(node, ctx, [pw], present)


@lowering_rule("PointwiseChain")
def _lower_pointwise_chain(node: Node, ctx: LoweringContext) -> list:
    """``kiln.PointwiseChain``: its body (pointwise ONNX nodes) becomes one generated kernel."""
    from engine_core.passes import infer_shapes

    body: Graph = node.attr("body")
    inputs = list(node.inputs)
    if body is None or len(body.inputs) != len(inputs) or len(body.outputs) != 1:
        raise Unsupported("PointwiseChain without a one-output body matching its inputs")
    infos = {v.name: TensorInfo(ctx.info(n).dtype, ctx.info(n).shape) for v, n in zip(body.inputs, inputs)}
    inner = infer_shapes(body, infos, values=False)
    index = {v.name: i for i, v in enumerate(body.inputs)}
    nodes: list[PwNode] = []
    for sub in body.nodes:
        qdq = sub.op_type in ("QuantizeLinear", "DequantizeLinear")  # per tensor (fuse_pointwise_chain checks)
        if sub.op_type not in POINTWISE_OPS and sub.op_type not in ("Gelu", "LeakyRelu") and not qdq:
            raise Unsupported(f"{sub.op_type} inside a PointwiseChain")
        args = []
        for name in sub.inputs:
            if not name:
                args.append(-1)
            elif name in index:
                args.append(index[name])
            elif name in body.constants:
                raise Unsupported("constant inside a PointwiseChain body")
            else:
                raise Unsupported(f"PointwiseChain body reads unknown '{name}'")
        if qdq:  # the generated code takes (x, scale, zero point or -1); the output type carries the rest
            args += [-1] * (3 - len(args))
        nodes.append(PwNode.make(sub.op_type, args, inner[sub.outputs[0]].dtype, {} if qdq else sub.attrs, sub.opset))
        index[sub.outputs[0]] = len(inputs) + len(nodes) - 1
    if index.get(body.outputs[0].name) != len(inputs) + len(nodes) - 1:
        raise Unsupported("PointwiseChain body output is not its last node")
    return _pointwise_launch(node, ctx, nodes, inputs)


@lowering_rule("QuantizeLinear", "DequantizeLinear")
def _lower_qdq(node: Node, ctx: LoweringContext) -> list:
    """QuantizeLinear / DequantizeLinear (per-tensor or per-axis, int8/uint8/int16/uint16) as pointwise
    kernels; the scale and zero point broadcast along ``axis``. Blocked quantization stays on the host."""
    x, out = ctx.info(node.inputs[0]), ctx.info(node.outputs[0])
    if node.attr("block_size", 0) or (node.op_type == "QuantizeLinear" and node.attr("saturate", 1) != 1):
        raise Unsupported(f"{node.op_type} with blocks or saturate=0")
    inputs = [n for n in node.inputs if n]
    strides = [broadcast_strides(x.shape, out.shape, ctx.strides(node.inputs[0]))]
    for name in inputs[1:]:
        info = ctx.info(name)
        size = int(np.prod(info.shape, dtype=np.int64))
        if size == 1:
            strides.append((0,) * len(out.shape))
            continue
        axis = node.attr("axis", 1)
        if not -len(x.shape) <= axis < len(x.shape):
            raise Unsupported(f"{node.op_type} axis {axis} for rank {len(x.shape)}")
        axis = normalize_axis(axis, len(x.shape))
        if len(info.shape) == 1 and info.shape[0] == x.shape[axis]:
            strides.append(tuple(1 if d == axis else 0 for d in range(len(out.shape))))
        else:
            raise Unsupported(f"{node.op_type} scale/zero point of shape {info.shape}")
    args = [0, 1, 2 if len(inputs) > 2 else -1]
    pw = PwNode.make(node.op_type, args, out.dtype, {}, node.opset)
    kernel = ctx.kernel(program_kernel([pw], out.dtype, [ctx.info(n).dtype for n in inputs]))
    ctx.layouts[node.outputs[0]] = out_layout(node, ctx)
    if int(np.prod(out.shape)) == 0:
        return []
    return [launch_program(kernel, Ref(node.outputs[0]), [Ref(n) for n in inputs], out.shape,
                           ctx.strides(node.outputs[0]), strides)]


@lowering_rule("BatchNormalization")
def _lower_batch_norm(node: Node, ctx: LoweringContext) -> list:
    """Inference BatchNormalization = x * a + b with per-channel a, b computed on the host."""
    x = ctx.info(node.inputs[0])
    values = [ctx.value(n) for n in node.inputs[1:5]]
    if any(v is None for v in values) or len(x.shape) < 2 or x.dtype not in FLOATS or node.attr("training_mode", 0):
        raise Unsupported("BatchNormalization with non-constant statistics")
    scale, bias, mean, var = (np.asarray(v, np.float64) for v in values)
    a = scale / np.sqrt(var + float(node.attr("epsilon", 1e-5)))
    b = bias - mean * a
    shape = (x.shape[1],) + (1,) * (len(x.shape) - 2)
    ra = ctx.fold(f"{node.name}#a", a.reshape(shape).astype(x.dtype))
    rb = ctx.fold(f"{node.name}#b", b.reshape(shape).astype(x.dtype))
    nodes = [PwNode.make("Mul", (0, 1), x.dtype), PwNode.make("Add", (3, 2), x.dtype)]
    return _pointwise_launch(node, ctx, nodes, [node.inputs[0], ra.tensor, rb.tensor])
