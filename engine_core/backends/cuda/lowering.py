"""Lowering: graph + concrete tensor infos -> device steps, tensor layouts/locations and the memory plan.

Pure Python (no GPU): the builder runs it at every profile's shapes to pick tactics, collect the
kernels to embed and size the arena; the runner runs it once per input-shape set and launches the
result. Each layer becomes one step: kernel launches, GEMMs, convolutions, copies, or ``Host`` (the
numpy implementation with explicit copies; reported as tactic "host", never silent).

Layouts: 4-D activations produced by convolutions live channels-last (NHWC) when cuDNN runs them —
tensor-core convolutions want it — and stay so through pointwise layers and pooling, which read any
layout through strides. Strict fp32 convolutions (no TF32) stay NCHW: cuDNN's fast FFMA engines are
NCHW kernels (``LoweringOptions.strict_fp32_nchw``). A layer that needs the logical (linear) layout gets
a visible reformat step in front of it, and graph outputs are always linear.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from engine_core.backends.cuda.int8_conv import lower_qconv
from engine_core.backends.cuda.int8_gemm import lower_qmatmul
from engine_core.backends.cuda.lowering_context import (
    F16,
    F32,
    INT8,
    THREADS,
    Conv,
    Copy,
    Gemm,
    Host,
    Launch,
    Lowered,
    LoweringContext,
    LoweringOptions,
    Ref,
    Step,
    copy_launch,
    grid_for,
    launch_program,
    nhwc_strides,
)
from engine_core.backends.cuda.lowering_context import TensorMap as TensorMap  # re-exported: the step types
from engine_core.backends.cuda.lowering_context import transform_weight as transform_weight  # lived here
from engine_core.backends.cuda.memory import liveness, plan_memory
from engine_core.backends.cuda.pointwise import (
    BF16,
    FLOATS,
    POINTWISE_OPS,
    PwNode,
    Unsupported,
    broadcast_strides,
    contiguous_strides,
    program_kernel,
)
from engine_core.ir import Graph, Node
from engine_core.ops import TensorInfo
from engine_core.ops.registry import normalize_axis

VIEW_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"})
#: storage types of the row kernels (softmax, norms, reductions, pooling)
ROW_SUFFIX = {F32: "f32", F16: "f16", BF16: "bf16"}
GEMM_TACTICS = ("cublas", "kiln_gemm")
#: ops that read and write any layout through strides (a channels-last input keeps its layout)
LAYOUT_AWARE = POINTWISE_OPS | {"Conv", "FusedConv", "PointwiseChain", "BatchNormalization", "MaxPool",
                                "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "Gelu", "QuantizeLinear",
                                "DequantizeLinear", "QConv"}
ACTIVATIONS = {"": None, "Relu": "Relu", "Sigmoid": "Sigmoid", "Tanh": "Tanh", "Gelu": "Gelu",
               "GeluTanh": "Gelu", "LeakyRelu": "LeakyRelu", "Clip": "Clip"}


def _out_layout(node: Node, ctx: LoweringContext, spatial: bool = False) -> str:
    """Layout of a layout-aware node's output: channels-last when a same-shape input is (``spatial``:
    when its first input is, as for pooling), unless the output is a graph output or the layouts
    coincide (H*W == 1 or C == 1)."""
    out = node.outputs[0]
    shape = ctx.info(out).shape
    if out in ctx.graph_outputs or len(shape) != 4 or shape[1] == 1 or shape[2] * shape[3] == 1:
        return "linear"
    if spatial:
        return ctx.layouts.get(node.inputs[0], "linear")
    for name in node.inputs:
        if name and ctx.layouts.get(name) == "nhwc" and ctx.info(name).shape == shape:
            return "nhwc"
    return "linear"


# -- pointwise ---------------------------------------------------------------------------------------


def _pointwise_launch(node: Node, ctx: LoweringContext, nodes: list[PwNode], inputs: list[str]) -> list:
    out_name = node.outputs[0]
    out = ctx.info(out_name)
    if len(inputs) == 0 or any(n == "" for n in inputs):
        raise Unsupported(f"{node.op_type} with missing inputs")
    ctx.layouts[out_name] = _out_layout(node, ctx)
    infos = [ctx.info(n) for n in inputs]
    kernel = ctx.kernel(program_kernel(nodes, out.dtype, [i.dtype for i in infos]))
    if int(np.prod(out.shape)) == 0:
        return []
    return [launch_program(kernel, Ref(out_name), [Ref(n) for n in inputs], out.shape, ctx.strides(out_name),
                           [broadcast_strides(i.shape, out.shape, ctx.strides(n)) for n, i in zip(inputs, infos)])]


def _lower_pointwise(node: Node, ctx: LoweringContext) -> list:
    if node.op_type == "Clip" and node.opset < 11:
        raise Unsupported("Clip before opset 11 keeps bounds in attributes")
    present = [n for n in node.inputs if n]
    args, index = [], 0
    for name in node.inputs:
        args.append(index if name else -1)
        index += bool(name)
    pw = PwNode.make(node.op_type, args, ctx.info(node.outputs[0]).dtype, node.attrs, node.opset)
    return _pointwise_launch(node, ctx, [pw], present)


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
    ctx.layouts[node.outputs[0]] = _out_layout(node, ctx)
    if int(np.prod(out.shape)) == 0:
        return []
    return [launch_program(kernel, Ref(node.outputs[0]), [Ref(n) for n in inputs], out.shape,
                           ctx.strides(node.outputs[0]), strides)]


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


# -- data movement -----------------------------------------------------------------------------------


def _lower_view(node: Node, ctx: LoweringContext) -> list:
    """Views alias their input; only a view that is a graph output needs a copy."""
    if node.outputs[0] not in ctx.graph_outputs:
        return []
    out = ctx.info(node.outputs[0])
    return [Copy(Ref(node.outputs[0]), Ref(node.inputs[0]), int(np.prod(out.shape)) * out.dtype.itemsize)]


def _is_view(node: Node, ctx: LoweringContext) -> bool:
    """A layer whose output is its input's bytes: the view ops, and an Expand with nothing to broadcast at these
    shapes (fuse_attention's key-count Expand of a mask that already has the key count: one per layer)."""
    if not node.inputs or not node.inputs[0] or node.op_type not in VIEW_OPS and node.op_type != "Expand":
        return False
    shape = ctx.info(node.inputs[0]).shape  # unknown: Unsupported (the layer runs on the host)
    return node.op_type in VIEW_OPS or shape == ctx.info(node.outputs[0]).shape


def _lower_transpose(node: Node, ctx: LoweringContext) -> list:
    x, out = ctx.info(node.inputs[0]), ctx.info(node.outputs[0])
    perm = node.attr("perm", None) or list(reversed(range(len(x.shape))))
    src = ctx.strides(node.inputs[0])
    return [copy_launch(ctx, x.dtype, Ref(node.outputs[0]), Ref(node.inputs[0]), out.shape,
                        contiguous_strides(out.shape), [src[p] for p in perm])]


def _lower_expand(node: Node, ctx: LoweringContext) -> list:
    x, out = ctx.info(node.inputs[0]), ctx.info(node.outputs[0])
    return [copy_launch(ctx, x.dtype, Ref(node.outputs[0]), Ref(node.inputs[0]), out.shape,
                        contiguous_strides(out.shape), broadcast_strides(x.shape, out.shape))]


def _lower_concat(node: Node, ctx: LoweringContext) -> list:
    out = ctx.info(node.outputs[0])
    axis = normalize_axis(node.attr("axis"), len(out.shape))
    out_strides = contiguous_strides(out.shape)
    launches, start = [], 0
    for name in node.inputs:
        x = ctx.info(name)
        if int(np.prod(x.shape)):
            dst = Ref(node.outputs[0], start * out_strides[axis] * out.dtype.itemsize)
            launches.append(copy_launch(ctx, x.dtype, dst, Ref(name), x.shape, out_strides, contiguous_strides(x.shape)))
        start += x.shape[axis]
    return launches


def _lower_slice(node: Node, ctx: LoweringContext) -> list:
    x, out = ctx.info(node.inputs[0]), ctx.info(node.outputs[0])
    args = [ctx.value(n) if i < len(node.inputs) and n else None for i, n in enumerate(node.inputs[1:5])]
    if node.opset < 10 or args[0] is None or args[1] is None or any(
            a is None for a, n in zip(args[2:], node.inputs[3:5]) if n):
        raise Unsupported("Slice needs known starts/ends/axes/steps")
    starts, ends = args[0].tolist(), args[1].tolist()
    axes = args[2].tolist() if len(args) > 2 and args[2] is not None else list(range(len(starts)))
    steps = args[3].tolist() if len(args) > 3 and args[3] is not None else [1] * len(starts)
    strides = list(contiguous_strides(x.shape))
    base = 0
    for s, e, a, st in zip(starts, ends, axes, steps):
        a = normalize_axis(a, len(x.shape))
        first, _, _ = slice(s, e, st).indices(x.shape[a])
        base += first * strides[a]
        strides[a] *= st
    return [copy_launch(ctx, x.dtype, Ref(node.outputs[0]), Ref(node.inputs[0], base * x.dtype.itemsize), out.shape,
                        contiguous_strides(out.shape), strides)]


def _lower_split(node: Node, ctx: LoweringContext) -> list:
    """Split: one strided copy per output, each reading the input from its offset along the axis (the
    output shapes, known from shape inference, give the sizes whichever way the split was declared)."""
    x = ctx.info(node.inputs[0])
    axis = normalize_axis(node.attr("axis", 0), len(x.shape))
    strides = contiguous_strides(x.shape)
    ops, start = [], 0
    for name in node.outputs:
        out = ctx.info(name)
        if name and int(np.prod(out.shape, dtype=np.int64)):
            ops.append(copy_launch(ctx, x.dtype, Ref(name), Ref(node.inputs[0], start * strides[axis] * x.dtype.itemsize),
                                   out.shape, contiguous_strides(out.shape), strides))
        start += out.shape[axis]
    return ops


def _lower_gather(node: Node, ctx: LoweringContext) -> list:
    data, idx = ctx.info(node.inputs[0]), ctx.info(node.inputs[1])
    ctx.info(node.outputs[0])
    if idx.dtype not in (np.dtype(np.int64), np.dtype(np.int32)):
        raise Unsupported(f"Gather indices of {idx.dtype}")
    axis = normalize_axis(node.attr("axis", 0), len(data.shape))
    outer = int(np.prod(data.shape[:axis], dtype=np.int64))
    inner_bytes = int(np.prod(data.shape[axis + 1:], dtype=np.int64)) * data.dtype.itemsize
    word = next(w for w in (16, 8, 4, 2, 1) if inner_bytes % w == 0)
    nidx = int(np.prod(idx.shape, dtype=np.int64))
    total = outer * nidx * (inner_bytes // word)
    if total == 0:
        return []
    suffix = "i64" if idx.dtype == np.int64 else "i32"
    return [Launch("gather", f"gather_w{word}_{suffix}", grid_for(total), (THREADS, 1, 1),
                   [(Ref(node.outputs[0]), ctypes.c_void_p), (Ref(node.inputs[0]), ctypes.c_void_p),
                    (Ref(node.inputs[1]), ctypes.c_void_p), (outer, ctypes.c_longlong), (nidx, ctypes.c_longlong),
                    (data.shape[axis], ctypes.c_longlong), (inner_bytes // word, ctypes.c_longlong)])]


# -- row kernels ---------------------------------------------------------------------------------------


def _rows_cols(shape: tuple[int, ...], axis: int) -> tuple[int, int]:
    return int(np.prod(shape[:axis], dtype=np.int64)), int(np.prod(shape[axis:], dtype=np.int64))


def _row_suffix(dtype: np.dtype, what: str) -> str:
    if dtype not in ROW_SUFFIX:
        raise Unsupported(f"{what} over {dtype}")
    return ROW_SUFFIX[dtype]


class AttnMask(ctypes.Structure):
    """Mirror of ``struct KilnAttnMask`` (cuda_kernels/softmax.cu)."""

    _fields_ = [("mb", ctypes.c_longlong), ("mh", ctypes.c_longlong), ("mq", ctypes.c_longlong),
                ("mk", ctypes.c_longlong), ("heads", ctypes.c_int), ("queries", ctypes.c_int),
                ("causal", ctypes.c_int), ("causal_offset", ctypes.c_int)]


def _lower_softmax(node: Node, ctx: LoweringContext) -> list:
    x = ctx.info(node.inputs[0])
    if not x.shape:
        raise Unsupported("Softmax of a scalar")
    suffix = _row_suffix(x.dtype, "Softmax")
    axis = normalize_axis(node.attr("axis", -1 if node.opset >= 13 else 1), len(x.shape))
    if node.opset >= 13 and axis != len(x.shape) - 1:
        raise Unsupported("Softmax over a non-last axis")
    rows, cols = _rows_cols(x.shape, axis)
    if rows * cols == 0:
        return []
    args = [(Ref(node.inputs[0]), ctypes.c_void_p), (Ref(node.outputs[0]), ctypes.c_void_p), (cols, ctypes.c_longlong)]
    if cols <= WARP_ROW_LIMIT:
        return [Launch("softmax", f"softmax_warp_{suffix}", _warp_grid(rows), (THREADS, 1, 1),
                       [*args, (rows, ctypes.c_longlong)])]
    return [Launch("softmax", f"softmax_{suffix}", (rows, 1, 1), (THREADS, 1, 1), args)]


#: rows up to this long run one warp per row (softmax.cu's *_warp kernels)
WARP_ROW_LIMIT = 1024


def _warp_grid(rows: int) -> tuple[int, int, int]:
    return (max(1, (rows + THREADS // 32 - 1) // (THREADS // 32)), 1, 1)


def _norm_geometry(node: Node, ctx: LoweringContext, shape: tuple[int, ...], dtype: np.dtype) -> tuple[str, int, int]:
    """(kernel suffix, rows, cols) of a LayerNormalization / RMSNormalization / SkipLayerNorm over ``shape``;
    raises Unsupported for what the row kernels do not take."""
    if any(node.outputs[2 if node.op_type == "SkipLayerNorm" else 1:]):  # SkipLayerNorm's output 1: int8 of y
        raise Unsupported(f"{node.op_type} with mean/inv-std outputs")
    suffix = _row_suffix(dtype, node.op_type)
    if node.attr("stash_type", 1) != 1:
        raise Unsupported(f"{node.op_type} with a non-fp32 stash_type")
    rows, cols = _rows_cols(shape, normalize_axis(node.attr("axis", -1), len(shape)))
    first = 2 if node.op_type == "SkipLayerNorm" else 1
    for name in node.inputs[first:first + 2]:
        if name and (int(np.prod(ctx.info(name).shape)) != cols or ctx.info(name).dtype != dtype):
            raise Unsupported(f"{node.op_type} scale/bias that broadcast or differ in dtype")
    return suffix, rows, cols


def _norm_tail(node: Node, first: int, y: Ref | None = None) -> list[tuple]:
    """The (scale, bias or null, output, cols placeholder) launch arguments shared by the row-norm kernels; ``y``
    stands in for output 0 (a SkipLayerNorm's may be absent: null, or scratch when a later launch reads it)."""
    bias = node.inputs[first + 1] if len(node.inputs) > first + 1 else ""
    y = y if y is not None else Ref(node.outputs[0]) if node.outputs[0] else None
    return [(Ref(node.inputs[first]), ctypes.c_void_p), (Ref(bias), ctypes.c_void_p) if bias else (0, ctypes.c_void_p),
            (y, ctypes.c_void_p) if y is not None else (0, ctypes.c_void_p)]


def _lower_norm(node: Node, ctx: LoweringContext) -> list:
    """LayerNormalization / RMSNormalization over trailing axes with same-size scale (and bias)."""
    x = ctx.info(node.inputs[0])
    suffix, rows, cols = _norm_geometry(node, ctx, x.shape, x.dtype)
    if rows * cols == 0:
        return []
    kind = "layer_norm" if node.op_type == "LayerNormalization" else "rms_norm"
    return [_norm_launch("layer_norm", kind, suffix, rows, cols, [Ref(node.inputs[0])], node, 1)]


def _norm_launch(module: str, kind: str, suffix: str, rows: int, cols: int, xs: list[Ref], node: Node,
                 first: int, quantized: list[Ref] | None = None, y: Ref | None = None) -> Launch:
    """One row-norm launch: a warp per row held in registers for rows of at most WARP_ROW_LIMIT elements (every
    row read once), else a block per row. ``quantized`` (int8 output, its scale): the warp kernel's ``_q`` form
    also writes the output quantized (callers check cols <= WARP_ROW_LIMIT). ``y``: see _norm_tail."""
    eps = (float(node.attr("epsilon", 1e-5)), ctypes.c_float)
    args = [*[(x, ctypes.c_void_p) for x in xs], *_norm_tail(node, first, y),
            *[(ref, ctypes.c_void_p) for ref in quantized or []]]
    if quantized:
        kind = f"{kind}_q"
    if cols <= WARP_ROW_LIMIT:
        return Launch(module, f"{kind}_warp_{suffix}", _warp_grid(rows), (THREADS, 1, 1),
                      [*args, (cols, ctypes.c_int), eps, (rows, ctypes.c_longlong)])
    return Launch(module, f"{kind}_{suffix}", (rows, 1, 1), (THREADS, 1, 1), [*args, (cols, ctypes.c_longlong), eps])


def _lower_skip_layer_norm(node: Node, ctx: LoweringContext) -> list:
    """``kiln.SkipLayerNorm``: one skip_layer_norm.cu launch when x and skip both have the output's shape; when
    one broadcasts, a generated Add into step-local scratch and the layer_norm.cu kernel (the unfused cost). Int8
    operands (inputs 6, 7: passes/fuse_norm_dequantize.py) take the warp kernel's ``_dq`` form only."""
    out = ctx.info(node.outputs[0] or node.outputs[1])
    dtype = ctx.info(node.inputs[2]).dtype  # gamma's: the layer's float type, also when output 0 is absent
    suffix, rows, cols = _norm_geometry(node, ctx, out.shape, dtype)
    if rows * cols == 0:
        return []
    x, skip = node.inputs[:2]
    quantized = _norm_quantized_output(node, ctx)
    same_shape = all(tuple(ctx.info(n).shape) == tuple(out.shape) for n in (x, skip))
    if len(node.inputs) > 6 and node.inputs[6]:
        return [_dequantizing_skip_norm(node, ctx, suffix, rows, cols, same_shape, quantized)]
    in_kernel = quantized and same_shape and cols <= WARP_ROW_LIMIT  # the warp kernel writes the int8 output too
    y = None if node.outputs[0] or in_kernel else ctx.new_scratch(f"{node.name}#y", dtype, tuple(out.shape))
    if same_shape:
        steps = [_norm_launch("skip_layer_norm", "skip_layer_norm", suffix, rows, cols, [Ref(x), Ref(skip)], node, 2,
                              [Ref(node.outputs[1]), Ref(node.inputs[4])] if in_kernel else None, y)]
    else:
        total = ctx.new_scratch(f"{node.name}#sum", out.dtype, tuple(out.shape))
        kernel = ctx.kernel(program_kernel([PwNode.make("Add", [0, 1], out.dtype)], out.dtype, [out.dtype, out.dtype]))
        strides = [broadcast_strides(ctx.info(n).shape, out.shape, ctx.strides(n)) for n in (x, skip)]
        add = launch_program(kernel, total, [Ref(x), Ref(skip)], out.shape, contiguous_strides(out.shape), strides)
        steps = [add, _norm_launch("layer_norm", "layer_norm", suffix, rows, cols, [total], node, 2, y=y)]
    if quantized and not in_kernel:  # wide or broadcast rows: the unfused QuantizeLinear after the norm
        steps.append(_quantize_launch(ctx, y.tensor if y is not None else node.outputs[0], node.inputs[4],
                                      node.outputs[1]))
    return steps


def _dequantizing_skip_norm(node: Node, ctx: LoweringContext, suffix: str, rows: int, cols: int, same_shape: bool,
                            quantized: bool) -> Launch:
    """skip_layer_norm_dq_warp_*: int8 x and skip dequantized in the kernel (fp32 scales), y and the int8 output
    each written when the layer has it."""
    if not same_shape or cols > WARP_ROW_LIMIT:
        raise Unsupported("SkipLayerNorm of int8 operands that broadcast or rows wider than a warp kernel holds")
    if any(ctx.info(name).dtype != np.float32 for name in node.inputs[6:8]):
        raise Unsupported("SkipLayerNorm dequantizing by non-fp32 scales")
    quantized_args = [Ref(node.outputs[1]), Ref(node.inputs[4])] if quantized else [0, 0]
    args = [*[(Ref(name), ctypes.c_void_p) for name in (*node.inputs[:2], *node.inputs[6:8])], *_norm_tail(node, 2),
            *[(ref, ctypes.c_void_p) for ref in quantized_args],
            (cols, ctypes.c_int), (float(node.attr("epsilon", 1e-5)), ctypes.c_float), (rows, ctypes.c_longlong)]
    return Launch("skip_layer_norm", f"skip_layer_norm_dq_warp_{suffix}", _warp_grid(rows), (THREADS, 1, 1), args)


def _quantize_launch(ctx: LoweringContext, x: str, scale: str, y: str) -> Launch:
    """The generated QuantizeLinear of contiguous ``x`` to int8 ``y`` by one scale (zero point 0): what a fused
    layer that quantizes its output runs when its kernel cannot do it in registers."""
    shape = ctx.info(x).shape
    kernel = ctx.kernel(program_kernel([PwNode.make("QuantizeLinear", [0, 1, -1], INT8)], INT8,
                                       [ctx.info(x).dtype, ctx.info(scale).dtype]))
    strides = contiguous_strides(shape)
    return launch_program(kernel, Ref(y), [Ref(x), Ref(scale)], shape, strides, [strides, (0,) * len(shape)])


def _check_int8_output(ctx: LoweringContext, node: Node) -> None:
    """A fused layer's int8 output (SkipLayerNorm, AttentionQuantize: inputs 4 and 5) takes a float32 scale and a
    zero point that is a constant 0 (or none)."""
    scale, zero = node.inputs[4], node.inputs[5] if len(node.inputs) > 5 else ""
    value = ctx.info(zero).value if zero else np.zeros((), np.int8)
    if value is None or np.any(value) or ctx.info(scale).dtype != np.float32:
        raise Unsupported(f"{node.op_type} quantizing with a zero point other than a constant 0 or a non-fp32 scale")


def _norm_quantized_output(node: Node, ctx: LoweringContext) -> bool:
    """Whether a SkipLayerNorm also writes its output quantized (output 1); raises Unsupported for a zero point
    that is not a constant 0."""
    if len(node.outputs) < 2 or not node.outputs[1]:
        return False
    _check_int8_output(ctx, node)
    return True


_REDUCE_KERNELS = {"ReduceMean": "reduce_rows", "ReduceSum": "reduce_rows", "ReduceMax": "reduce_max_rows",
                   "ReduceMin": "reduce_min_rows"}


def _lower_reduce(node: Node, ctx: LoweringContext) -> list:
    x = ctx.info(node.inputs[0])
    if not x.shape:
        raise Unsupported(f"{node.op_type} of a scalar")
    suffix = _row_suffix(x.dtype, node.op_type)
    if len(node.inputs) > 1 and node.inputs[1]:  # axes as an input (opset 18, or ReduceSum 13)
        axes = ctx.value(node.inputs[1])
        if axes is None:
            raise Unsupported(f"{node.op_type} axes not known")
        axes = axes.reshape(-1).tolist()
    else:
        axes = node.attr("axes", None)
    if not axes:
        raise Unsupported(f"{node.op_type} over all axes / noop_with_empty_axes")
    axes = sorted(normalize_axis(a, len(x.shape)) for a in axes)
    if axes != list(range(axes[0], len(x.shape))):
        raise Unsupported(f"{node.op_type} over non-trailing axes")
    rows, cols = _rows_cols(x.shape, axes[0])
    if rows * cols == 0:
        raise Unsupported(f"{node.op_type} of an empty tensor")
    scale = 1.0 / cols if node.op_type == "ReduceMean" else 1.0
    return [Launch("reduce", f"{_REDUCE_KERNELS[node.op_type]}_{suffix}", (rows, 1, 1), (THREADS, 1, 1),
                   [(Ref(node.inputs[0]), ctypes.c_void_p), (Ref(node.outputs[0]), ctypes.c_void_p),
                    (cols, ctypes.c_longlong), (scale, ctypes.c_float)])]


class PoolGeom(ctypes.Structure):
    """Mirror of ``struct KilnPoolGeom`` (cuda_kernels/pool.cu)."""

    _fields_ = [("xs", ctypes.c_longlong * 4), ("ys", ctypes.c_longlong * 4)] + [
        (name, ctypes.c_int) for name in ("n", "c", "h", "w", "oh", "ow", "kh", "kw", "sh", "sw", "ph", "pw",
                                          "ph_end", "pw_end", "dh", "dw", "channels_last", "count_include_pad")]


def _lower_pool(node: Node, ctx: LoweringContext) -> list:
    x, out = ctx.info(node.inputs[0]), ctx.info(node.outputs[0])
    if len(x.shape) != 4 or any(node.outputs[1:]):
        raise Unsupported(f"{node.op_type} that is not 2-D with one output")
    suffix = _row_suffix(x.dtype, node.op_type)
    n, c, h, w = x.shape
    is_global = node.op_type.startswith("Global")
    kernel = (1, 1) if is_global else tuple(node.attr("kernel_shape"))
    strides = tuple(node.attr("strides", None) or (1, 1))
    dilations = tuple(node.attr("dilations", None) or (1, 1))
    pads = list(node.attr("pads", None) or (0, 0, 0, 0))
    if is_global:
        kernel = (h, w)
    elif node.attr("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        oh, ow = out.shape[2:]
        total = [max((o - 1) * s + (k - 1) * d + 1 - i, 0) for o, s, k, d, i in
                 zip((oh, ow), strides, kernel, dilations, (h, w))]
        lower = node.attr("auto_pad") == "SAME_LOWER"
        begin = [(t + 1) // 2 if lower else t // 2 for t in total]
        pads = [begin[0], begin[1], total[0] - begin[0], total[1] - begin[1]]
    ctx.layouts[node.outputs[0]] = _out_layout(node, ctx, spatial=True)
    geom = PoolGeom()
    geom.xs[:] = ctx.strides(node.inputs[0])
    geom.ys[:] = ctx.strides(node.outputs[0])
    values = dict(n=n, c=c, h=h, w=w, oh=out.shape[2], ow=out.shape[3], kh=kernel[0], kw=kernel[1], sh=strides[0],
                  sw=strides[1], ph=pads[0], pw=pads[1], ph_end=pads[2], pw_end=pads[3], dh=dilations[0],
                  dw=dilations[1], channels_last=int(ctx.layouts[node.outputs[0]] == "nhwc"),
                  count_include_pad=int(node.attr("count_include_pad", 0)))
    for key, value in values.items():
        setattr(geom, key, int(value))
    total = int(np.prod(out.shape, dtype=np.int64))
    if total == 0:
        return []
    kind = "max_pool" if "Max" in node.op_type else "avg_pool"
    # the channels-last kernel: one thread per 16 bytes of contiguous channels, on arena tensors (256-byte
    # aligned; a caller's I/O address might not be 16-byte aligned)
    run = 16 // x.dtype.itemsize
    if ctx.layouts.get(node.inputs[0]) == "nhwc" and node.outputs[0] not in ctx.graph_outputs and geom.ys[1] == 1 \
            and c % run == 0 and max(int(np.prod(x.shape)), total) < 2**31:
        kind, total = f"{kind}_nhwc", total // run
    return [Launch("pool", f"{kind}_{suffix}", grid_for(total), (THREADS, 1, 1),
                   [(Ref(node.inputs[0]), ctypes.c_void_p), (Ref(node.outputs[0]), ctypes.c_void_p),
                    (geom, PoolGeom)])]


# -- GEMM ------------------------------------------------------------------------------------------------


def _gemm_dtype(dtypes: list[np.dtype], what: str) -> np.dtype:
    if len(set(dtypes)) != 1 or dtypes[0] not in ROW_SUFFIX:
        raise Unsupported(f"{what} over {[str(d) for d in dtypes]}")
    return dtypes[0]


def _gemm_tactic(node: Node, ctx: LoweringContext, dtype: np.dtype) -> str:
    return ctx.gemm_choice.get(node.name, GEMM_TACTICS[0]) if dtype == F32 else "cublas"


def _matmul_ops(node: Node, ctx: LoweringContext, a_name: str, b_name: str, trans_a: bool, trans_b: bool,
                alpha: float) -> list[Gemm]:
    """Batched GEMM for MatMul semantics (numpy broadcasting of batch dims), operands optionally transposed
    in their last two dims."""
    a, b, out = ctx.info(a_name), ctx.info(b_name), ctx.info(node.outputs[0])
    dtype = _gemm_dtype([a.dtype, b.dtype, out.dtype], "MatMul")
    if len(a.shape) < 2 or len(b.shape) < 2:
        raise Unsupported("MatMul of a vector")
    m, k = (a.shape[-1], a.shape[-2]) if trans_a else (a.shape[-2], a.shape[-1])
    n = b.shape[-2] if trans_b else b.shape[-1]
    batch_shape = out.shape[:-2]
    batch = int(np.prod(batch_shape, dtype=np.int64))
    a_rc = (1, m) if trans_a else (k, 1)
    b_rc = (1, k) if trans_b else (n, 1)
    if len(b.shape) == 2 and not trans_a:  # weights: fold A's batch into M
        m, batch, a_bs, b_bs = m * batch, 1, 0, 0
    else:
        a_bs, b_bs = (_batch_stride(x.shape, batch_shape, x.shape[-1] * x.shape[-2]) for x in (a, b))
    if m * n * batch == 0:
        return []
    return [Gemm(Ref(a_name), Ref(b_name), Ref(node.outputs[0]), m, n, k, batch, (*a_rc, a_bs), (*b_rc, b_bs),
                 alpha, 0.0, _gemm_tactic(node, ctx, dtype), dtype, ctx.options.tf32)]


def _lower_matmul(node: Node, ctx: LoweringContext) -> list:
    return _matmul_ops(node, ctx, node.inputs[0], node.inputs[1], False, False, 1.0)


def _batch_stride(shape: tuple[int, ...], batch_shape: tuple[int, ...], matrix: int) -> int:
    """Element stride between batch matrices: full batch, or 0 when the operand broadcasts (all ones)."""
    own = tuple(shape[:-2])
    if int(np.prod(own, dtype=np.int64)) == 1:
        return 0
    if (1,) * (len(batch_shape) - len(own)) + own == tuple(batch_shape):
        return matrix
    raise Unsupported("MatMul with partially broadcast batch dims")


def _epilogue(node: Node, ctx: LoweringContext, bias: str | None, activation: str, alpha: float = 0.01,
              beta: float = 0.0, residual: str | None = None, target: str | None = None,
              bias_axis: int | None = None) -> list:
    """Y = act(Y + bias (+ residual)) in place on ``target`` (default: the node's output), as one generated
    kernel (nothing when there is nothing). ``bias_axis``: the bias is a vector along that axis (a
    convolution's channels); otherwise it broadcasts like an Add operand (a GEMM's columns)."""
    out_name = target or node.outputs[0]
    out = ctx.info(out_name)
    inputs, nodes = [out_name], []
    last = 0
    for extra in (bias, residual):
        if extra:
            inputs.append(extra)
            nodes.append(PwNode.make("Add", (last, len(inputs) - 1), out.dtype))
            last = -1
    if activation:
        op = ACTIVATIONS.get(activation)
        if op is None:
            raise Unsupported(f"epilogue activation {activation}")
        attrs: dict[str, Any] = {}
        if activation == "GeluTanh":
            attrs = {"approximate": "tanh"}
        elif activation == "LeakyRelu":
            attrs = {"alpha": alpha}
        args: list[int] = [last]
        if activation == "Clip":
            lo = ctx.fold(f"{node.name}#lo", np.asarray(alpha, out.dtype))
            hi = ctx.fold(f"{node.name}#hi", np.asarray(beta, out.dtype))
            inputs += [lo.tensor, hi.tensor]
            args = [last, len(inputs) - 2, len(inputs) - 1]
        nodes.append(PwNode.make(op, args, out.dtype, attrs))
    if not nodes:
        return []
    n_in = len(inputs)
    fixed = []
    for j, pw in enumerate(nodes):  # -1 above means "the previous node's result"
        fixed.append(replace(pw, args=tuple(n_in + j - 1 if a == -1 else a for a in pw.args)))
    kernel = ctx.kernel(program_kernel(fixed, out.dtype, [ctx.info(n).dtype for n in inputs]))
    strides = [tuple(1 if d == bias_axis else 0 for d in range(len(out.shape))) if n == bias and bias_axis is not None
               else broadcast_strides(ctx.info(n).shape, out.shape, ctx.strides(n)) for n in inputs]
    return [launch_program(kernel, Ref(out_name), [Ref(n) for n in inputs], out.shape, ctx.strides(out_name),
                           strides)]


def _lower_gemm(node: Node, ctx: LoweringContext) -> list:
    a, b, out = ctx.info(node.inputs[0]), ctx.info(node.inputs[1]), ctx.info(node.outputs[0])
    dtype = _gemm_dtype([a.dtype, b.dtype, out.dtype], "Gemm")
    ta, tb = node.attr("transA", 0), node.attr("transB", 0)
    m, n = out.shape
    k = a.shape[0] if ta else a.shape[1]
    a_strides = (1, m, 0) if ta else (k, 1, 0)
    b_strides = (1, k, 0) if tb else (n, 1, 0)
    if (ta and m == 1) or (tb and k == 1):
        raise Unsupported("Gemm with a transposed single-row operand")
    ops: list = []
    beta = 0.0
    if len(node.inputs) > 2 and node.inputs[2]:
        c = ctx.info(node.inputs[2])
        if c.dtype != dtype:
            raise Unsupported("Gemm C of another dtype")
        ops.append(copy_launch(ctx, dtype, Ref(node.outputs[0]), Ref(node.inputs[2]), out.shape,
                               contiguous_strides(out.shape), broadcast_strides(c.shape, out.shape)))
        beta = float(node.attr("beta", 1.0))
    if m * n:
        ops.append(Gemm(Ref(node.inputs[0]), Ref(node.inputs[1]), Ref(node.outputs[0]), m, n, k, 1, a_strides,
                        b_strides, float(node.attr("alpha", 1.0)), beta, _gemm_tactic(node, ctx, dtype), dtype,
                        ctx.options.tf32))
    return ops


#: FusedMatMul activation -> the cuBLASLt epilogue computing bias + it inside the GEMM
_LT_EPILOGUES = {"": "bias", "Relu": "relu_bias", "GeluTanh": "gelu_bias"}


def _lower_fused_matmul(node: Node, ctx: LoweringContext) -> list:
    """``kiln.FusedMatMul``: with cuBLASLt the bias (and ReLU / tanh-GELU) run in the GEMM's epilogue;
    otherwise (or for other activations) one generated epilogue kernel follows the GEMM."""
    ops: list = _matmul_ops(node, ctx, node.inputs[0], node.inputs[1], bool(node.attr("transA", 0)),
                            bool(node.attr("transB", 0)), float(node.attr("alpha", 1.0)))
    bias = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2] else None
    out = ctx.info(node.outputs[0])
    if bias and ctx.info(bias).dtype != out.dtype:
        raise Unsupported("FusedMatMul bias of another dtype")
    activation = node.attr("activation", "")
    if ctx.options.cublaslt and bias and len(ops) == 1 and ops[0].batch == 1 and ctx.info(bias).shape == (ops[0].n,):
        gemm = ops[0]
        gemm.bias, gemm.tactic = Ref(bias), "cublaslt"
        gemm.epilogue = _LT_EPILOGUES.get(activation, "bias")
        rest = "" if activation in _LT_EPILOGUES else activation
        return ops + _epilogue(node, ctx, None, rest)
    return ops + _epilogue(node, ctx, bias, activation)


class FlashGeom(ctypes.Structure):
    """Mirror of ``struct KilnFlashGeom`` (cuda_kernels/flash_attention.cu)."""

    _fields_ = [*[(n, ctypes.c_longlong) for n in ("qb", "qh", "qs", "kb", "kh", "ks", "vb", "vh", "vs", "ob", "oh",
                                                    "os", "mb", "mh", "mq", "mk")],
                *[(n, ctypes.c_int) for n in ("heads", "kv_group", "sq", "skv", "causal", "causal_offset",
                                              "mask_kind")],
                ("scale", ctypes.c_float)]


#: head sizes with a fused flash_attention kernel; query rows and threads per block (cuda_kernels/flash_attention.cu)
FLASH_HEAD_DIMS = (32, 64, 128)
FLASH_ROWS, FLASH_THREADS = 64, 128


def flash_shared_bytes(d: int, suffix: str, full_mask: bool) -> int:
    """Dynamic shared memory of one flash_attention block (``KilnFlashTiles``): Q, a two-stage K/V ring with
    padded rows, and the staged mask (a float bias row per stage, or for a ``full_mask``, one that varies with the
    query, a row per query row of the raw mask or its biases, 16 bytes of padding each)."""
    tf32 = suffix == "tf32"
    keys = 32 if tf32 and d > 64 else 64
    row = d + (4 if tf32 else 8)
    mask = FLASH_ROWS * (keys * 4 + 16) if full_mask else keys * 4
    return (FLASH_ROWS + 4 * keys) * row * (4 if tf32 else 2) + 2 * mask


def _heads_view(ctx: LoweringContext, name: str, heads: int | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, element strides) of an Attention operand as [batch, heads, seq, head_dim]: the 4-D form as it
    is, the 3-D form [batch, seq, heads * head_dim] split by its head count (no copy)."""
    shape, strides = ctx.info(name).shape, ctx.strides(name)
    if len(shape) == 4:
        return tuple(shape), tuple(strides)
    if len(shape) != 3 or not heads or shape[2] % heads:
        raise Unsupported("Attention operand that is neither 4-D nor 3-D with a head count dividing its width")
    d = shape[2] // heads
    return (shape[0], heads, shape[1], d), (strides[0], d * strides[2], strides[1], strides[2])


def _flash_suffix(dtype: np.dtype, ctx: LoweringContext) -> str | None:
    """flash_attention kernel suffix for ``dtype``: fp16/bf16, and fp32 only where TF32 is allowed."""
    if dtype == F32:
        return "tf32" if ctx.options.tf32 else None
    return {F16: "f16", BF16: "bf16"}.get(dtype)


def _lower_attention(node: Node, ctx: LoweringContext) -> list:
    """ONNX Attention without past keys: Y = softmax(scale Q K^T + mask) V, 3-D or 4-D operands; or
    ``kiln.AttentionQuantize``, the same with Y quantized to int8 (inputs 4, 5: its scale and zero point).

    One fused flash_attention launch (Q/K/V/Y through strides: the 3-D form needs no head transposes,
    scores stay on chip; flash_attention_q_* writes the int8 Y) when the type and head size allow;
    otherwise two batched GEMMs around the attention softmax kernel with the scores in a step-local scratch
    buffer (and for AttentionQuantize, Y in another, then the generated QuantizeLinear).
    """
    quantized = node.op_type == "AttentionQuantize"
    if quantized:
        _check_int8_output(ctx, node)
    elif len(node.inputs) > 4 and any(node.inputs[4:]) or any(node.outputs[1:]):
        raise Unsupported("Attention with past key/value or extra outputs")
    dtype = _gemm_dtype([ctx.info(n).dtype for n in node.inputs[:3]], "Attention")
    if node.attr("softcap", 0.0) or node.attr("qk_matmul_output_mode", 0) or node.attr("softmax_precision", None):
        raise Unsupported("Attention softcap / qk output / softmax precision")
    if node.attr("left_window_size", -1) >= 0 or node.attr("right_window_size", -1) >= 0:
        raise Unsupported("Attention with a sliding window")
    q_heads, kv_heads = node.attr("q_num_heads", None), node.attr("kv_num_heads", None)
    (batch, heads, sq, d), q_st = _heads_view(ctx, node.inputs[0], q_heads)
    (_, k_heads, skv, dk), k_st = _heads_view(ctx, node.inputs[1], kv_heads)
    (_, v_heads, _, dv), v_st = _heads_view(ctx, node.inputs[2], kv_heads)
    _, y_st = _heads_view(ctx, node.outputs[0], q_heads)
    if k_heads != v_heads or heads % k_heads or dk != d:
        raise Unsupported("Attention with mismatched key/value heads or head sizes")
    scale = float(node.attr("scale", 0.0) or 1.0 / np.sqrt(d))
    mask = node.inputs[3] if len(node.inputs) > 3 and node.inputs[3] else None
    mask_kind, mask_strides = 0, (0, 0, 0, 0)
    if mask:
        m = ctx.info(mask)
        if not m.shape or m.shape[-1] != skv:
            raise Unsupported("Attention mask shorter than the keys")
        if m.dtype not in (np.bool_, dtype):
            raise Unsupported(f"Attention mask of {m.dtype}")
        mask_kind = 2 if m.dtype == np.bool_ else 1
        mask_strides = broadcast_strides(m.shape, (batch, heads, sq, skv), ctx.strides(mask))
    causal = int(node.attr("is_causal", 0))  # no past keys: the frontier is top-left aligned (key k <= query q)
    if batch * heads * sq * dv == 0:
        return []
    suffix = _flash_suffix(dtype, ctx)
    if suffix and d == dv and d in FLASH_HEAD_DIMS and all(st[3] == 1 for st in (q_st, k_st, v_st, y_st)):
        g = FlashGeom(*q_st[:3], *k_st[:3], *v_st[:3], *y_st[:3], *mask_strides, heads, heads // k_heads, sq, skv,
                      causal, 0, mask_kind, scale)
        args = [*[(Ref(n), ctypes.c_void_p) for n in (*node.inputs[:3], node.outputs[0])],
                (Ref(mask) if mask else 0, ctypes.c_void_p), (g, FlashGeom)]
        if quantized:
            args.append((Ref(node.inputs[4]), ctypes.c_void_p))
        name = f"flash_attention_{'q_' if quantized else ''}{d}_{suffix}"
        full_mask = bool(mask_kind) and g.mq != 0
        return [Launch("flash_attention", name, (-(-sq // FLASH_ROWS), heads, batch), (FLASH_THREADS, 1, 1), args,
                       shared_bytes=flash_shared_bytes(d, suffix, full_mask))]
    if quantized:  # the float attention into step-local scratch, then QuantizeLinear
        y = ctx.new_scratch(f"{node.name}#y", dtype, tuple(ctx.info(node.outputs[0]).shape))
        attention = Node("Attention", node.inputs[:4], [y.tensor], dict(node.attrs), node.name, "", node.opset, [])
        return [*_lower_attention(attention, ctx), _quantize_launch(ctx, y.tensor, node.inputs[4], node.outputs[0])]
    if k_heads != heads:
        raise Unsupported("grouped-query Attention outside the flash kernel")
    return _unfused_attention(node, ctx, dtype, (batch, heads, sq, skv, d, dv), (q_st, k_st, v_st, y_st), scale,
                              causal, mask, mask_kind, mask_strides)


def _unfused_attention(node: Node, ctx: LoweringContext, dtype: np.dtype, dims: tuple[int, ...],
                       views: tuple[tuple[int, ...], ...], scale: float, causal: int, mask: str | None,
                       mask_kind: int, mask_strides: tuple[int, ...]) -> list:
    """S = scale Q K^T (batched GEMM), P = attention softmax(S) in place, Y = P V (batched GEMM); operands
    that are not [batch, heads, seq, dim]-contiguous go through step-local copies."""
    batch, heads, sq, skv, d, dv = dims
    ops: list = []

    def contiguous(name: str, shape: tuple[int, ...], strides: tuple[int, ...], write: bool) -> Ref:
        if tuple(strides) == contiguous_strides(shape):
            return Ref(name)
        ref = ctx.new_scratch(f"{node.name}#{name}#bhsd", dtype, shape)
        if not write:
            ops.append(copy_launch(ctx, dtype, ref, Ref(name), shape, contiguous_strides(shape), strides))
        return ref

    q = contiguous(node.inputs[0], (batch, heads, sq, d), views[0], False)
    k = contiguous(node.inputs[1], (batch, heads, skv, d), views[1], False)
    v = contiguous(node.inputs[2], (batch, heads, skv, dv), views[2], False)
    y = contiguous(node.outputs[0], (batch, heads, sq, dv), views[3], True)
    bh = batch * heads
    s_ref = ctx.new_scratch(f"{node.name}#scores", dtype, (bh, sq, skv))
    ops.append(Gemm(q, k, s_ref, sq, skv, d, bh, (d, 1, sq * d), (1, d, skv * d), scale, 0.0, "cublas", dtype,
                    ctx.options.tf32))
    geom = AttnMask()
    geom.heads, geom.queries = heads, sq
    geom.causal, geom.causal_offset = causal, 0
    args = [(s_ref, ctypes.c_void_p), (s_ref, ctypes.c_void_p), (skv, ctypes.c_longlong), (1.0, ctypes.c_float)]
    suffix = _row_suffix(dtype, "Attention")
    kind = ("attn_softmax", "attn_softmax_add", "attn_softmax_bool")[mask_kind]
    if mask:
        geom.mb, geom.mh, geom.mq, geom.mk = mask_strides
        args.append((Ref(mask), ctypes.c_void_p))
    args.append((geom, AttnMask))
    if skv <= WARP_ROW_LIMIT:
        ops.append(Launch("softmax", f"{kind}_warp_{suffix}", _warp_grid(bh * sq), (THREADS, 1, 1),
                          [*args, (bh * sq, ctypes.c_longlong)]))
    else:
        ops.append(Launch("softmax", f"{kind}_{suffix}", (bh * sq, 1, 1), (THREADS, 1, 1), args))
    ops.append(Gemm(s_ref, v, y, sq, dv, skv, bh, (skv, 1, sq * skv), (dv, 1, skv * dv), 1.0, 0.0, "cublas", dtype,
                    ctx.options.tf32))
    if y.tensor != node.outputs[0]:
        shape = (batch, heads, sq, dv)
        ops.append(copy_launch(ctx, dtype, Ref(node.outputs[0]), y, shape, views[3], contiguous_strides(shape)))
    return ops


# -- convolution ---------------------------------------------------------------------------------------------


def _lower_conv(node: Node, ctx: LoweringContext) -> list:
    """Conv / ``kiln.FusedConv`` (2-D) through cuDNN, channels-last activations and KRSC filters."""
    if not ctx.options.cudnn:
        raise Unsupported("convolution needs the cuDNN frontend (pip install kiln[gpu])")
    x, w, out = ctx.info(node.inputs[0]), ctx.info(node.inputs[1]), ctx.info(node.outputs[0])
    dtype = _gemm_dtype([x.dtype, w.dtype, out.dtype], node.op_type)
    if len(x.shape) != 4 or node.inputs[1] not in ctx.constants:
        raise Unsupported("convolution that is not 2-D with constant weights")
    activation = node.attr("activation", "") if node.op_type == "FusedConv" else ""
    kernel = w.shape[2:]
    strides = tuple(node.attr("strides", None) or (1, 1))
    dilations = tuple(node.attr("dilations", None) or (1, 1))
    pads = list(node.attr("pads", None) or (0, 0, 0, 0))
    auto_pad = node.attr("auto_pad", "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        total = [max((o - 1) * s + (k - 1) * d + 1 - i, 0) for o, s, k, d, i in
                 zip(out.shape[2:], strides, kernel, dilations, x.shape[2:])]
        begin = [(t + 1) // 2 if auto_pad == "SAME_LOWER" else t // 2 for t in total]
        pads = [begin[0], begin[1], total[0] - begin[0], total[1] - begin[1]]
    elif auto_pad == "VALID":
        pads = [0, 0, 0, 0]
    group = int(node.attr("group", 1))
    if w.shape[1] * group != x.shape[1]:
        raise Unsupported("convolution whose group does not match its shapes")
    nchw = conv_layout(dtype, ctx.options) == "linear"
    xin = ctx.as_layout(node.inputs[0], "linear" if nchw else "nhwc")
    # channels-last: a graph output (linear) gets cuDNN's result through a step-local buffer and a reformat
    result = node.outputs[0]
    y_name = result
    if result in ctx.graph_outputs and not nchw:
        y_name = ctx.new_scratch(f"{node.name}#conv", out.dtype, tuple(out.shape)).tensor
    wname = node.inputs[1]
    if not nchw:
        ctx.layouts[y_name] = "nhwc"
        wname = f"{node.inputs[1]}#krsc"
        ctx.weight_transforms[wname] = (node.inputs[1], "krsc")
        ctx.infos[wname] = TensorInfo(w.dtype, w.shape)
    bias = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2] else None
    residual = node.inputs[3] if node.op_type == "FusedConv" and len(node.inputs) > 3 and node.inputs[3] else None
    if bias and (ctx.info(bias).dtype != dtype or ctx.info(bias).shape != (out.shape[1],)):
        raise Unsupported("convolution bias of another dtype or shape")
    conv_shape = (x.shape[0], w.shape[0], *[(i + p0 + p1 - d * (k - 1) - 1) // st + 1 for i, p0, p1, d, k, st in
                                            zip(x.shape[2:], pads[:2], pads[2:], dilations, kernel, strides)])
    if tuple(conv_shape) != tuple(out.shape):  # a residual that broadcasts wider than the convolution
        raise Unsupported(f"FusedConv output {out.shape} is wider than its convolution {tuple(conv_shape)}")
    # cuDNN fuses a same-shape residual and ReLU; anything else follows as one generated epilogue kernel
    fused_residual = residual if residual and ctx.info(residual).shape == out.shape and \
        ctx.info(residual).dtype == dtype else None
    fused_activation = activation if activation in ("", "Relu") and (fused_residual or not residual) else ""
    ctx.renamed[node.inputs[0]] = xin
    if int(np.prod(out.shape)) == 0:
        return []
    alpha, beta = float(node.attr("activation_alpha", 0.01)), float(node.attr("activation_beta", 0.0))
    conv = Conv(Ref(xin), Ref(wname), Ref(y_name), Ref(bias) if bias else None,
                Ref(fused_residual) if fused_residual else None, tuple(x.shape), tuple(w.shape), tuple(out.shape),
                ctx.strides(xin), contiguous_strides(w.shape) if nchw else nhwc_strides(w.shape), ctx.strides(y_name),
                ctx.strides(fused_residual) if fused_residual else None, (pads[0], pads[1]), (pads[2], pads[3]),
                strides, dilations, dtype, fused_activation, tf32=ctx.options.tf32)
    if bias or fused_residual or fused_activation:
        conv.fallback = _epilogue(node, ctx, bias, fused_activation, alpha, beta, fused_residual, y_name,
                                  bias_axis=1)
    if fused_residual or fused_activation:
        conv.rest = _epilogue(node, ctx, None, fused_activation, alpha, beta, fused_residual, y_name)
    rest = _epilogue(node, ctx, None, "" if fused_activation else activation, alpha, beta,
                     None if fused_residual else residual, y_name)
    if y_name != result:
        rest.append(copy_launch(ctx, out.dtype, Ref(result), Ref(y_name), out.shape, contiguous_strides(out.shape),
                                ctx.strides(y_name)))
    return [conv, *rest]


def conv_layout(dtype: np.dtype, options: LoweringOptions) -> str:
    """The layout a float convolution of ``dtype`` reads and writes: "nhwc" (tensor-core engines want it), or
    "linear" (NCHW) for strict fp32, whose fast cuDNN engines are FFMA kernels over NCHW."""
    strict_fp32 = np.dtype(dtype) == F32 and not options.tf32
    return "linear" if strict_fp32 and options.strict_fp32_nchw else "nhwc"


_LOWER = {
    "Transpose": _lower_transpose, "Expand": _lower_expand, "Concat": _lower_concat, "Slice": _lower_slice,
    "Gather": _lower_gather, "Split": _lower_split, "Softmax": _lower_softmax, "LayerNormalization": _lower_norm,
    "SkipLayerNorm": _lower_skip_layer_norm,
    "RMSNormalization": _lower_norm, "ReduceMean": _lower_reduce, "ReduceSum": _lower_reduce,
    "ReduceMax": _lower_reduce, "ReduceMin": _lower_reduce, "MatMul": _lower_matmul, "Gemm": _lower_gemm,
    "FusedMatMul": _lower_fused_matmul, "Attention": _lower_attention, "AttentionQuantize": _lower_attention,
    "Conv": _lower_conv,
    "FusedConv": _lower_conv, "PointwiseChain": _lower_pointwise_chain, "BatchNormalization": _lower_batch_norm,
    "MaxPool": _lower_pool, "AveragePool": _lower_pool, "GlobalAveragePool": _lower_pool,
    "GlobalMaxPool": _lower_pool, "QuantizeLinear": _lower_qdq, "DequantizeLinear": _lower_qdq,
    "QMatMul": lower_qmatmul, "QConv": lower_qconv,
}
_KILN_OPS = frozenset({"FusedMatMul", "FusedConv", "PointwiseChain", "QMatMul", "QConv", "SkipLayerNorm",
                       "AttentionQuantize"})


def _tactic(node: Node, ops: list) -> str:
    conv = next((o for o in ops if isinstance(o, Conv)), None)
    if conv is not None:
        return "conv:cudnn_int8" if conv.int8 else "conv:cudnn"
    gemm = next((o for o in ops if isinstance(o, Gemm)), None)
    if gemm is not None:
        return f"gemm:{gemm.tactic}"
    if node.op_type == "QMatMul" and ops:
        # cublaslt_int8 / cublaslt_fp8, or Kiln's sm_90 INT8 GEMM (one launch)
        return f"gemm:{ops[0].module}" if isinstance(ops[0], Launch) else f"gemm:{ops[0].tactic}"
    if node.op_type == "QConv" and ops:
        gemm = next(o for o in ops if hasattr(o, "acc_dtype"))  # the Int8Gemm step
        return f"conv:{gemm.tactic}" + ("" if gemm.tactic.endswith("requant") else "_im2col")
    if node.op_type in ("Attention", "AttentionQuantize"):
        launch = next((o for o in ops if isinstance(o, Launch) and o.module == "flash_attention"), None)
        return f"kernel:{launch.function.rsplit('_', 2)[0]}" if launch else "kernel:attention_softmax"
    if node.op_type in POINTWISE_OPS or node.op_type in ("PointwiseChain", "Gelu", "BatchNormalization", "QuantizeLinear",
                                                         "DequantizeLinear"):
        launch = next((o for o in ops if isinstance(o, Launch)), None)
        return f"pointwise:{launch.function}" if launch else "pointwise:empty"
    return f"kernel:{node.op_type}"


def lower_node(node: Node, ctx: LoweringContext) -> tuple[str, list, Node]:
    """(tactic name, device ops, the node as lowered) for one layer; ("host", [Host], node) when it has no
    CUDA implementation. Inputs a layer cannot read channels-last are reformatted first (``ctx.pre_steps``)."""
    ctx.scratch = []
    ctx.renamed = {}
    try:
        domain_ok = node.domain in ("", "ai.onnx") or (node.domain == "kiln" and node.op_type in _KILN_OPS)
        if not domain_ok:
            raise Unsupported(f"domain {node.domain}")
        if len(node.outputs) != 1 and node.op_type not in ("LayerNormalization", "MaxPool", "Attention", "Split",
                                                           "SkipLayerNorm"):
            raise Unsupported("multi-output layer")
        for name in node.outputs:
            if name:
                ctx.info(name)
        if node.op_type not in LAYOUT_AWARE or node.op_type in VIEW_OPS:  # a view (Identity too) aliases bytes
            node = _with_linear_inputs(node, ctx)
        if _is_view(node, ctx):
            return "view", _lower_view(node, ctx), node
        if node.op_type == "Split" and node.inputs[0] in ctx.split_written:  # the GEMM wrote the parts
            return "fused:qgemm_split", [], replace(node, inputs=[], outputs=[])
        if node.op_type in POINTWISE_OPS or node.op_type == "Gelu":
            return _tactic(node, ops := _lower_pointwise(node, ctx)), ops, node
        if node.op_type in _LOWER:
            ops = _LOWER[node.op_type](node, ctx)
            if ctx.renamed:
                node = replace(node, inputs=[ctx.renamed.get(n, n) for n in node.inputs])
            if node.outputs and node.outputs[0] in ctx.split_written:
                node = replace(node, outputs=list(ctx.split_readers[node.outputs[0]].outputs))
            return _tactic(node, ops), ops, node
        raise Unsupported(f"no CUDA implementation of {node.op_type}")
    except Unsupported:
        for name in node.outputs:
            ctx.layouts.pop(name, None)
        ctx.scratch = []
        node = _with_linear_inputs(node, ctx)
        return "host", [Host(node)], node


def _with_linear_inputs(node: Node, ctx: LoweringContext) -> Node:
    if not any(ctx.layouts.get(n) == "nhwc" for n in node.inputs if n):
        return node
    inputs = [ctx.as_layout(n, "linear") if n and ctx.layouts.get(n) == "nhwc" else n for n in node.inputs]
    return replace(node, inputs=inputs)


# -- the whole graph --------------------------------------------------------------------------------


def lower_graph(graph: Graph, infos: Mapping[str, TensorInfo], gemm_choice: Mapping[str, str] | None = None,
                options: LoweringOptions | None = None) -> Lowered:
    """Lower every layer that is not a pure shape computation, place tensors, plan the arena."""
    graph_outputs = frozenset(graph.output_names)
    ctx = LoweringContext(dict(infos), graph_outputs, gemm_choice or {}, options or LoweringOptions(), graph.constants)
    io = set(graph.input_names) | graph_outputs
    locations: dict[str, tuple[str, Any]] = {n: ("io", n) for n in io}
    for name in graph.constants:
        locations.setdefault(name, ("weight", name))
    ctx.split_readers = _qmatmul_splits(graph)
    alias: dict[str, str] = {}
    steps: list[Step] = []
    for node in graph.nodes:
        if node.outputs and all(infos.get(o) is not None and infos[o].value is not None for o in node.outputs if o):
            continue  # shape computation: its value is known on the host
        tactic, ops, lowered_node = lower_node(node, ctx)
        steps.extend(ctx.pre_steps)
        ctx.pre_steps = []
        if tactic == "view" and not ops:
            alias[node.outputs[0]] = alias.get(lowered_node.inputs[0], lowered_node.inputs[0])
        steps.append(Step(lowered_node, tactic, ops, list(ctx.scratch)))
    for name in ctx.weight_transforms:
        locations[name] = ("weight", name)
    folded = {}
    for step in steps:
        for name in step.node.inputs + _refs_of(step):
            root = alias.get(name, name)
            if root in ctx.folded_extra:
                folded[root] = ctx.folded_extra[root]
                locations[root] = ("folded", root)
            elif root and root not in locations and ctx.infos.get(root) is not None and ctx.infos[root].value is not None:
                folded[root] = np.ascontiguousarray(ctx.infos[root].value)
                locations[root] = ("folded", root)
    for name in graph.output_names:  # outputs that no step writes: copied from their source
        producer = next((s for s in steps if name in s.node.outputs), None)
        if producer is None and name in infos and infos[name].value is not None and name not in graph.input_names:
            folded.setdefault(f"{name}#value", np.ascontiguousarray(infos[name].value))
            locations[f"{name}#value"] = ("folded", f"{name}#value")
            steps.append(Step(_copy_node(name), "copy", [Copy(Ref(name), Ref(f"{name}#value"),
                                                               folded[f"{name}#value"].nbytes)]))
    sizes, sequence = {}, []
    for step in steps:
        ins = [alias.get(n, n) for n in step.node.inputs if n]
        outs = [n for n in step.node.outputs if n and n not in alias] + step.scratch
        sequence.append((ins, outs))
        for name in outs:
            if name not in locations:
                info = ctx.info(name)
                sizes[name] = int(np.prod(info.shape, dtype=np.int64)) * info.dtype.itemsize
    memory = plan_memory(liveness(sequence, sizes))
    for name, offset in memory.offsets.items():
        locations[name] = ("arena", offset)
    for name, root in alias.items():
        if name not in locations:
            locations[name] = locations.get(root, ("arena", 0))
    return Lowered(steps, locations, memory, folded, list(dict.fromkeys(ctx.kernels)), ctx.infos,
                   dict(ctx.weight_transforms), dict(ctx.layouts))


def _qmatmul_splits(graph: Graph) -> dict[str, Node]:
    """QMatMul output -> the Split along its last axis that is its only reader (merge_parallel_qmatmuls' pattern),
    where the output is no graph output."""
    from engine_core.passes.pattern import Uses

    uses = Uses(graph)
    found = {}
    for node in graph.nodes:
        split = uses.sole_reader(node.outputs[0]) if node.op_type == "QMatMul" else None
        if split is not None and split.op_type == "Split" and split.inputs[0] == node.outputs[0] \
                and split.attr("axis", 0) == -1:
            found[node.outputs[0]] = split
    return found


def _refs_of(step: Step) -> list[str]:
    """Tensors a step's launches read besides its node's inputs (folded per-step constants)."""
    names = []
    for op in step.ops:
        for launch in [op] if isinstance(op, Launch) else op.fallback + op.rest if isinstance(op, Conv) else []:
            names += [r.tensor for r in launch.refs()]
        if hasattr(op, "refs"):  # int8_gemm's steps (that module imports this one) and convolutions: their
            names += [r.tensor for r in op.refs()]  # folded scale vectors
    return names


def _copy_node(name: str) -> Node:
    return Node("Identity", [f"{name}#value"], [name], {}, f"copy_{name}", "", 1, [])
