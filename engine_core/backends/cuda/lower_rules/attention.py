"""Lowering rule of attention: ONNX Attention and ``kiln.AttentionQuantize``, one fused flash_attention launch
where it applies (an ``SdpaLaunch``, which cuDNN's fused attention runs instead, where the build may use cuDNN and
it takes the layer: cudnn_attention.py), else two batched GEMMs around the attention softmax.
"""

from __future__ import annotations

import ctypes

import numpy as np

from engine_core.backends.cuda.cudnn_attention import SdpaLaunch, sdpa_for
from engine_core.backends.cuda.lower_rules.common import (
    WARP_ROW_LIMIT,
    check_int8_output,
    gemm_dtype,
    quantize_launch,
    row_suffix,
    warp_grid,
)
from engine_core.backends.cuda.lowering_context import (
    F16,
    F32,
    THREADS,
    Gemm,
    Launch,
    LoweringContext,
    Ref,
    copy_launch,
    lowering_rule,
)
from engine_core.backends.cuda.pointwise import (
    BF16,
    Unsupported,
    broadcast_strides,
    contiguous_strides,
)
from engine_core.ir import Node


class AttnMask(ctypes.Structure):
    """Mirror of ``struct KilnAttnMask`` (cuda_kernels/softmax.cu)."""

    _fields_ = [("mb", ctypes.c_longlong), ("mh", ctypes.c_longlong), ("mq", ctypes.c_longlong),
                ("mk", ctypes.c_longlong), ("heads", ctypes.c_int), ("queries", ctypes.c_int),
                ("causal", ctypes.c_int), ("causal_offset", ctypes.c_int)]


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


@lowering_rule("Attention", "AttentionQuantize")
def _lower_attention(node: Node, ctx: LoweringContext) -> list:
    """ONNX Attention without past keys: Y = softmax(scale Q K^T + mask) V, 3-D or 4-D operands; or
    ``kiln.AttentionQuantize``, the same with Y quantized to int8 (inputs 4, 5: its scale and zero point).

    One fused flash_attention launch (Q/K/V/Y through strides: the 3-D form needs no head transposes,
    scores stay on chip; flash_attention_q_* writes the int8 Y) when the type and head size allow, carrying the
    same attention for cuDNN's SDPA (``SdpaLaunch``) when ``LoweringOptions.cudnn`` is on and cuDNN takes it
    (``sdpa_for``; not AttentionQuantize, whose flash kernel writes int8 itself);
    otherwise two batched GEMMs around the attention softmax kernel with the scores in a step-local scratch
    buffer (and for AttentionQuantize, Y in another, then the generated QuantizeLinear).
    """
    quantized = node.op_type == "AttentionQuantize"
    if quantized:
        check_int8_output(ctx, node)
    elif len(node.inputs) > 4 and any(node.inputs[4:]) or any(node.outputs[1:]):
        raise Unsupported("Attention with past key/value or extra outputs")
    dtype = gemm_dtype([ctx.info(n).dtype for n in node.inputs[:3]], "Attention")
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
        launch = Launch("flash_attention", name, (-(-sq // FLASH_ROWS), heads, batch), (FLASH_THREADS, 1, 1), args,
                        shared_bytes=flash_shared_bytes(d, suffix, full_mask))
        sdpa = None if quantized or not ctx.options.cudnn else sdpa_for(
            (*node.inputs[:3], node.outputs[0], mask), (batch, heads, k_heads, sq, skv, d, dv),
            (q_st, k_st, v_st, y_st), dtype, scale, bool(causal), mask_kind, mask_strides)
        return [launch if sdpa is None else SdpaLaunch(**vars(launch), sdpa=sdpa)]
    if quantized:  # the float attention into step-local scratch, then QuantizeLinear
        y = ctx.new_scratch(f"{node.name}#y", dtype, tuple(ctx.info(node.outputs[0]).shape))
        attention = Node("Attention", node.inputs[:4], [y.tensor], dict(node.attrs), node.name, "", node.opset, [])
        return [*_lower_attention(attention, ctx), quantize_launch(ctx, y.tensor, node.inputs[4], node.outputs[0])]
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
    suffix = row_suffix(dtype, "Attention")
    kind = ("attn_softmax", "attn_softmax_add", "attn_softmax_bool")[mask_kind]
    if mask:
        geom.mb, geom.mh, geom.mq, geom.mk = mask_strides
        args.append((Ref(mask), ctypes.c_void_p))
    args.append((geom, AttnMask))
    if skv <= WARP_ROW_LIMIT:
        ops.append(Launch("softmax", f"{kind}_warp_{suffix}", warp_grid(bh * sq), (THREADS, 1, 1),
                          [*args, (bh * sq, ctypes.c_longlong)]))
    else:
        ops.append(Launch("softmax", f"{kind}_{suffix}", (bh * sq, 1, 1), (THREADS, 1, 1), args))
    ops.append(Gemm(s_ref, v, y, sq, dv, skv, bh, (skv, 1, sq * skv), (dv, 1, skv * dv), 1.0, 0.0, "cublas", dtype,
                    ctx.options.tf32))
    if y.tensor != node.outputs[0]:
        shape = (batch, heads, sq, dv)
        ops.append(copy_launch(ctx, dtype, Ref(node.outputs[0]), y, shape, views[3], contiguous_strides(shape)))
    return ops
