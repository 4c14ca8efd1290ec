"""Attention family: Attention, RotaryEmbedding, LinearAttention, CausalConvWithState, SwiGLU.

The arithmetic follows the ONNX function bodies step by step *in the input's dtype* (scale Q and K
by sqrt(scale), MatMul, softcap, add the bias, softmax, MatMul), because float16/bfloat16 results
depend on where each rounding happens and the conformance data was produced that way. Grouped-query
attention never materializes repeated K/V heads: query heads are viewed as (kv_heads, group) and
the matmul broadcasts over the group axis, which is the spec's interleaved repeat
([h0, h0, h1, h1, ...]).

FlexAttention is not an operator of the installed onnx (1.23), so it is not registered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from onnx import helper

from engine_core.ir import Node
from engine_core.ops.registry import ShapeInferenceError, TensorInfo, broadcast_shapes, register_op

Shape = tuple[int, ...]

#: qk_matmul_output_mode values (the 4th Attention output).
QK_RAW, QK_SOFTCAPPED, QK_WITH_BIAS, QK_SOFTMAX = 0, 1, 2, 3


# -- shared helpers ------------------------------------------------------------------------------


def split_heads(x: np.ndarray, heads: int) -> np.ndarray:
    """(batch, seq, heads * size) -> (batch, heads, seq, size): the packed 3-D layout unpacked."""
    b, s, hidden = x.shape
    if hidden % heads:
        raise ShapeInferenceError(f"hidden size {hidden} is not divisible by {heads} heads")
    return x.reshape(b, s, heads, hidden // heads).transpose(0, 2, 1, 3)


def merge_heads(x: np.ndarray) -> np.ndarray:
    """(batch, heads, seq, size) -> (batch, seq, heads * size)."""
    b, h, s, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, s, h * d)


def grouped_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` where ``a`` has ``groups`` times as many heads (axis 1) as ``b``.

    Query head ``h`` pairs with kv head ``h // groups``, as if ``b`` were repeated head by head,
    without the copy. The result keeps ``a``'s dtype (numpy returns float32 for bfloat16).
    """
    batch, heads, m, k = a.shape
    kv_heads = b.shape[1]
    if heads % kv_heads:
        raise ShapeInferenceError(f"{heads} query heads cannot share {kv_heads} key/value heads")
    grouped = a.reshape(batch, kv_heads, heads // kv_heads, m, k)
    out = np.matmul(grouped, b[:, :, None])
    return out.reshape(batch, heads, m, out.shape[-1]).astype(a.dtype, copy=False)


def _strattr(node: Node, key: str, default: str) -> str:
    value = node.attr(key, default)
    return value.decode() if isinstance(value, bytes) else str(value)


# -- Attention -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionShapes:
    """Head layout of one Attention call, derived from input ranks/shapes and attributes."""

    packed: bool  # 3-D (batch, seq, heads * size) inputs
    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    past_len: int
    head_size: int
    v_head_size: int

    @property
    def total_len(self) -> int:
        return self.past_len + self.kv_len


def attention_shapes(node: Node, q: Shape, k: Shape, v: Shape, past: Shape | None) -> AttentionShapes:
    """Validate ranks and head counts; raises ShapeInferenceError naming the mismatch."""
    if not len(q) == len(k) == len(v) or len(q) not in (3, 4):
        raise ShapeInferenceError(f"Attention needs Q, K, V all 3-D or all 4-D, got {q}, {k}, {v}")
    q_heads, kv_heads = node.attr("q_num_heads"), node.attr("kv_num_heads")
    if len(q) == 3:
        if q_heads is None or kv_heads is None:
            raise ShapeInferenceError("3-D Attention inputs need q_num_heads and kv_num_heads")
        for name, hidden, heads in (("Q", q[2], q_heads), ("K", k[2], kv_heads), ("V", v[2], kv_heads)):
            if heads <= 0 or hidden % heads:
                raise ShapeInferenceError(f"{name} hidden size {hidden} is not divisible by {heads} heads")
        head, v_head = q[2] // q_heads, v[2] // kv_heads
        if k[2] // kv_heads != head:
            raise ShapeInferenceError(f"Q and K head sizes differ: {head} vs {k[2] // kv_heads}")
        q_len, kv_len = q[1], k[1]
    else:
        if node.opset >= 25 and (q_heads is not None or kv_heads is not None):
            raise ShapeInferenceError("q_num_heads/kv_num_heads must not be set for 4-D Attention inputs")
        q_heads, kv_heads = q[1], k[1]
        head, v_head = q[3], v[3]
        if k[3] != head or v[1] != kv_heads:
            raise ShapeInferenceError(f"Attention K/V shapes {k}, {v} do not match Q {q}")
        q_len, kv_len = q[2], k[2]
    if kv_heads <= 0 or q_heads % kv_heads:
        raise ShapeInferenceError(f"q_num_heads {q_heads} is not a multiple of kv_num_heads {kv_heads}")
    if not q[0] == k[0] == v[0] or k[1 if len(k) == 3 else 2] != v[1 if len(v) == 3 else 2]:
        raise ShapeInferenceError(f"Attention batch/sequence sizes differ: Q {q}, K {k}, V {v}")
    past_len = 0
    if past is not None:
        if len(past) != 4 or past[0] != q[0] or past[1] != kv_heads or past[3] != head:
            raise ShapeInferenceError(f"past_key shape {past} does not match ({q[0]}, {kv_heads}, *, {head})")
        past_len = past[2]
    return AttentionShapes(len(q) == 3, q[0], q_heads, kv_heads, q_len, kv_len, past_len, head, v_head)


def _check_attention_inputs(past_key, past_value, nonpad) -> None:
    if (past_key is None) != (past_value is None):
        raise ShapeInferenceError("past_key and past_value must be given together")
    if nonpad is not None and past_key is not None:
        raise ShapeInferenceError("nonpad_kv_seqlen cannot be combined with past_key/past_value")


def _attention_infer(node: Node, q: TensorInfo, k: TensorInfo, v: TensorInfo, attn_mask=None,
                     past_key=None, past_value=None, nonpad=None) -> list[TensorInfo]:
    _check_attention_inputs(past_key, past_value, nonpad)
    shapes = [q.shape, k.shape, v.shape] + ([past_key.shape] if past_key is not None else [])
    if any(s is None for s in shapes):
        return [TensorInfo(q.dtype, None), TensorInfo(k.dtype, None), TensorInfo(v.dtype, None),
                TensorInfo(q.dtype, None)]
    a = attention_shapes(node, q.shape, k.shape, v.shape, past_key.shape if past_key is not None else None)
    if attn_mask is not None and attn_mask.shape is not None:
        _check_mask(attn_mask.shape, (a.batch, a.q_heads, a.q_len, a.total_len))
    y = (a.batch, a.q_len, a.q_heads * a.v_head_size) if a.packed else (a.batch, a.q_heads, a.q_len, a.v_head_size)
    return [
        TensorInfo(q.dtype, y),
        TensorInfo(k.dtype, (a.batch, a.kv_heads, a.total_len, a.head_size)),
        TensorInfo(v.dtype, (a.batch, a.kv_heads, a.total_len, a.v_head_size)),
        TensorInfo(q.dtype, (a.batch, a.q_heads, a.q_len, a.total_len)),
    ]


def _check_mask(mask: Shape, scores: Shape) -> None:
    """attn_mask must broadcast to the scores; its last dim may be shorter (padded as masked)."""
    padded = (*mask[:-1], scores[-1]) if mask else mask
    if len(mask) > 4 or (mask and mask[-1] > scores[-1]) or not _broadcasts_to(padded, scores):
        raise ShapeInferenceError(f"attn_mask shape {mask} does not fit attention scores {scores}")


def _broadcasts_to(shape: Shape, target: Shape) -> bool:
    try:
        return broadcast_shapes(shape, target) == tuple(target)
    except ShapeInferenceError:
        return False


def _neg_inf_where(allowed: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Additive bias: 0 where allowed, -inf elsewhere (select, never 0 * -inf)."""
    return np.where(allowed, dtype.type(0), dtype.type(-np.inf))


def _frontier_diff(q_len: int, kv_len: int, offset: int | np.ndarray) -> np.ndarray:
    """(query absolute position) - (key index): (q, kv), or (batch, 1, q, kv) for per-batch offsets."""
    diff = np.arange(q_len)[:, None] - np.arange(kv_len)[None, :]
    if np.ndim(offset) > 0:
        return diff + np.reshape(offset, (-1, 1, 1, 1))
    return diff + int(offset)


def attention_bias(node: Node, dtype: np.dtype, q_len: int, total_len: int, past_len: int,
                   attn_mask: np.ndarray | None, nonpad: np.ndarray | None) -> np.ndarray:
    """The additive bias of the scores: attn_mask, causal frontier, sliding window, kv padding.

    The causal/window frontier is bottom-right aligned: ``offset`` is the past length (internal
    cache) or ``nonpad_kv_seqlen - q_len`` per batch (external cache).
    """
    if attn_mask is not None:
        pad = total_len - attn_mask.shape[-1]
        if pad > 0:  # a mask shorter than the keys masks the rest
            fill = False if attn_mask.dtype == np.bool_ else -np.inf
            attn_mask = np.pad(attn_mask, [(0, 0)] * (attn_mask.ndim - 1) + [(0, pad)], constant_values=fill)
        attn_mask = _neg_inf_where(attn_mask, dtype) if attn_mask.dtype == np.bool_ else attn_mask.astype(dtype)
    offset = nonpad.reshape(-1).astype(np.int64) - q_len if nonpad is not None else past_len
    bias = np.zeros((q_len, total_len), dtype)
    if attn_mask is not None:
        bias = bias + attn_mask
    if node.attr("is_causal", 0):
        bias = bias + _neg_inf_where(_frontier_diff(q_len, total_len, offset) >= 0, dtype)
    left, right = node.attr("left_window_size", -1), node.attr("right_window_size", -1)
    if left < -1 or right < -1:
        raise ShapeInferenceError(f"window sizes must be -1 or >= 0, got {left}, {right}")
    if left >= 0 or right >= 0:
        diff = _frontier_diff(q_len, total_len, offset)
        allowed = np.ones(diff.shape, np.bool_)
        if left >= 0:
            allowed &= diff <= left
        if right >= 0:
            allowed &= -diff <= right
        bias = bias + _neg_inf_where(allowed, dtype)
    if nonpad is not None:
        valid = np.arange(total_len)[None, :] < nonpad.reshape(-1, 1)
        bias = bias + _neg_inf_where(valid, dtype).reshape(len(valid), 1, 1, total_len)
    return bias


def softmax_guarded(x: np.ndarray, masked_rows: np.ndarray) -> np.ndarray:
    """Softmax over the last axis; rows with no attendable key come out all zero, not NaN."""
    x_max = np.max(x, axis=-1, keepdims=True)
    zero, one = np.zeros((), x.dtype), np.ones((), x.dtype)
    e = np.exp(x - np.where(np.isneginf(x_max), zero, x_max))
    s = np.sum(e, axis=-1, keepdims=True)
    p = e / np.where(s == zero, one, s)
    return np.where(masked_rows, zero, p)


def softcap(x: np.ndarray, cap: float) -> np.ndarray:
    """``cap * tanh(x / cap)``: bounds the logits smoothly; 0 disables it."""
    return np.tanh(x / cap) * cap if cap > 0 else x


def _attention_cpu(node: Node, q: np.ndarray, k: np.ndarray, v: np.ndarray, attn_mask=None,
                   past_key=None, past_value=None, nonpad=None) -> list[np.ndarray]:
    _check_attention_inputs(past_key, past_value, nonpad)
    a = attention_shapes(node, q.shape, k.shape, v.shape, None if past_key is None else past_key.shape)
    if a.packed:
        q, k, v = split_heads(q, a.q_heads), split_heads(k, a.kv_heads), split_heads(v, a.kv_heads)
    # The caches are fed back step after step: hand them out contiguous (3-D inputs give transposed views).
    present_key = np.ascontiguousarray(k if past_key is None else np.concatenate([past_key, k], axis=2))
    present_value = np.ascontiguousarray(v if past_value is None else np.concatenate([past_value, v], axis=2))

    scale = node.attr("scale")
    scale = q.dtype.type(np.sqrt(1 / np.sqrt(a.head_size) if scale is None else scale))
    raw = grouped_matmul(q * scale, present_key.transpose(0, 1, 3, 2) * scale)
    capped = softcap(raw, node.attr("softcap", 0.0))
    bias = attention_bias(node, q.dtype, a.q_len, a.total_len, a.past_len, attn_mask, nonpad)
    biased = capped + bias
    precision = node.attr("softmax_precision")
    scores = biased if precision is None else biased.astype(helper.tensor_dtype_to_np_dtype(precision))
    masked_rows = np.isneginf(np.max(bias, axis=-1, keepdims=True))
    probs = softmax_guarded(scores, masked_rows)

    mode = node.attr("qk_matmul_output_mode", QK_RAW)
    qk_out = {QK_RAW: raw, QK_SOFTCAPPED: capped, QK_WITH_BIAS: biased, QK_SOFTMAX: probs}.get(mode)
    if qk_out is None:
        raise ShapeInferenceError(f"qk_matmul_output_mode {mode} is not one of 0-3")
    y = grouped_matmul(probs.astype(q.dtype), present_value)
    return [merge_heads(y) if a.packed else y, present_key, present_value,
            np.broadcast_to(qk_out, raw.shape).astype(q.dtype)]


register_op("Attention", infer=_attention_infer, cpu=_attention_cpu, min_opset=23,
            doc="scaled dot-product attention (MHA/GQA/MQA, masks, KV cache, softcap, windows)")


# -- RotaryEmbedding -----------------------------------------------------------------------------


def _rotary_infer(node: Node, x: TensorInfo, cos: TensorInfo, sin: TensorInfo, pos=None) -> TensorInfo:
    if x.rank is not None and x.rank not in (3, 4):
        raise ShapeInferenceError(f"RotaryEmbedding input must be 3-D or 4-D, got rank {x.rank}")
    if x.rank == 3 and not node.attr("num_heads"):
        raise ShapeInferenceError("RotaryEmbedding with a 3-D input needs num_heads")
    if x.shape is not None and cos.shape is not None and sin.shape is not None:
        head_size = x.shape[3] if x.rank == 4 else x.shape[2] // node.attr("num_heads")
        half = (node.attr("rotary_embedding_dim", 0) or head_size) // 2
        if cos.shape[-1] != half or sin.shape[-1] != half:
            raise ShapeInferenceError(f"cos/sin caches {cos.shape}, {sin.shape} need a last dim of {half}")
    return TensorInfo(x.dtype, x.shape)


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> np.ndarray:
    """Rotate pairs of ``x`` (last axis) by angles given as cos/sin (broadcast to half its size).

    Pairs are (i, i + half) or, interleaved, (2i, 2i + 1).
    """
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = np.split(x, 2, axis=-1)
    real = cos * x1 - sin * x2
    imag = sin * x1 + cos * x2
    if interleaved:
        return np.stack([real, imag], axis=-1).reshape(x.shape)
    return np.concatenate([real, imag], axis=-1)


def _rotary_cpu(node: Node, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, pos=None) -> np.ndarray:
    packed = x.ndim == 3
    # Work in (batch, heads, seq, head_size); cos/sin become (batch, 1, seq, dim / 2).
    heads = split_heads(x, node.attr("num_heads")) if packed else x
    head_size = heads.shape[-1]
    dim = node.attr("rotary_embedding_dim", 0) or head_size
    if dim > head_size or dim % 2:
        raise ShapeInferenceError(f"rotary_embedding_dim {dim} must be even and at most head size {head_size}")
    if pos is not None:
        cos, sin = cos[pos], sin[pos]
    if cos.shape[-1] != dim // 2 or sin.shape[-1] != dim // 2:
        raise ShapeInferenceError(f"cos/sin caches' last dim {cos.shape[-1]} must be rotary dim / 2 = {dim // 2}")
    rotated = rotate(heads[..., :dim], cos[:, None], sin[:, None], bool(node.attr("interleaved", 0)))
    out = np.concatenate([rotated.astype(x.dtype, copy=False), heads[..., dim:]], axis=-1)
    return merge_heads(out) if packed else out


register_op("RotaryEmbedding", infer=_rotary_infer, cpu=_rotary_cpu, min_opset=23,
            doc="rotary position embedding (RoPE), full or partial, half-split or interleaved")


# -- LinearAttention -----------------------------------------------------------------------------

_UPDATE_RULES = ("linear", "gated", "delta", "gated_delta")


@dataclass(frozen=True)
class LinearAttentionShapes:
    batch: int
    steps: int
    q_heads: int
    kv_heads: int
    key_size: int
    value_size: int


def linear_attention_shapes(node: Node, q: Shape, k: Shape, v: Shape) -> LinearAttentionShapes:
    q_heads, kv_heads = node.attr("q_num_heads"), node.attr("kv_num_heads")
    if q_heads is None or kv_heads is None:
        raise ShapeInferenceError("LinearAttention needs q_num_heads and kv_num_heads")
    if q_heads <= 0 or kv_heads <= 0 or q_heads % kv_heads:
        raise ShapeInferenceError(f"q_num_heads {q_heads} must be a positive multiple of kv_num_heads {kv_heads}")
    if not len(q) == len(k) == len(v) == 3:
        raise ShapeInferenceError(f"LinearAttention query/key/value must be 3-D, got {q}, {k}, {v}")
    if q[2] % q_heads or k[2] % kv_heads or v[2] % kv_heads:
        raise ShapeInferenceError(f"hidden sizes {q[2]}, {k[2]}, {v[2]} do not divide into {q_heads}/{kv_heads} heads")
    if q[2] // q_heads != k[2] // kv_heads or not q[:2] == k[:2] == v[:2]:
        raise ShapeInferenceError(f"LinearAttention shapes do not match: {q}, {k}, {v}")
    return LinearAttentionShapes(q[0], q[1], q_heads, kv_heads, q[2] // q_heads, v[2] // kv_heads)


def _update_rule(node: Node, decay, beta) -> tuple[bool, bool]:
    """(gated, delta) for the node's update_rule, checking that decay/beta come exactly when needed."""
    rule = _strattr(node, "update_rule", "gated_delta")
    if rule not in _UPDATE_RULES:
        raise ShapeInferenceError(f"update_rule '{rule}' is not one of {_UPDATE_RULES}")
    gated, delta = rule in ("gated", "gated_delta"), rule in ("delta", "gated_delta")
    if gated != (decay is not None) or delta != (beta is not None):
        raise ShapeInferenceError(f"update_rule '{rule}' {'needs' if gated else 'forbids'} decay and "
                                  f"{'needs' if delta else 'forbids'} beta")
    return gated, delta


def _linear_attention_infer(node: Node, q: TensorInfo, k: TensorInfo, v: TensorInfo, past=None,
                            decay=None, beta=None) -> list[TensorInfo]:
    _update_rule(node, decay, beta)
    state_dtype = past.dtype if past is not None else q.dtype
    if q.shape is None or k.shape is None or v.shape is None:
        return [TensorInfo(q.dtype, None), TensorInfo(state_dtype, None)]
    s = linear_attention_shapes(node, q.shape, k.shape, v.shape)
    state = (s.batch, s.kv_heads, s.key_size, s.value_size)
    if past is not None and past.shape is not None and past.shape != state:
        raise ShapeInferenceError(f"past_state shape {past.shape} is not {state}")
    return [TensorInfo(q.dtype, (s.batch, s.steps, s.q_heads * s.value_size)), TensorInfo(state_dtype, state)]


def _per_head(x: np.ndarray, s: LinearAttentionShapes, sizes: Sequence[int], name: str) -> np.ndarray:
    """(batch, T, heads * d) gate input -> float32 (batch, heads, T, d) for d = last dim / kv_heads."""
    if x.ndim != 3 or x.shape[-1] not in sizes:
        raise ShapeInferenceError(f"{name} shape {x.shape} must be (batch, T, one of {list(sizes)})")
    return split_heads(x, 1 if x.shape[-1] == 1 else s.kv_heads).astype(np.float32)


def _linear_attention_cpu(node: Node, q: np.ndarray, k: np.ndarray, v: np.ndarray, past=None,
                          decay=None, beta=None) -> list[np.ndarray]:
    gated, delta = _update_rule(node, decay, beta)
    s = linear_attention_shapes(node, q.shape, k.shape, v.shape)
    group = s.q_heads // s.kv_heads
    # Query heads viewed as (kv_heads, group) so each reads its kv head's state without copies.
    q4 = split_heads(q, s.q_heads).astype(np.float32).reshape(s.batch, s.kv_heads, group, s.steps, s.key_size)
    k4 = split_heads(k, s.kv_heads).astype(np.float32)
    v4 = split_heads(v, s.kv_heads).astype(np.float32)
    g4 = _per_head(decay, s, (s.kv_heads, s.kv_heads * s.key_size), "decay") if gated else None
    b4 = _per_head(beta, s, (s.kv_heads, 1), "beta") if delta else None
    state_shape = (s.batch, s.kv_heads, s.key_size, s.value_size)
    if past is not None and past.shape != state_shape:
        raise ShapeInferenceError(f"past_state shape {past.shape} is not {state_shape}")
    state = np.zeros(state_shape, np.float32) if past is None else past.astype(np.float32)
    scale = node.attr("scale", 0.0) or 1 / np.sqrt(s.key_size)
    out = np.empty((s.batch, s.kv_heads, group, s.steps, s.value_size), np.float32)
    for t in range(s.steps):  # the recurrence is sequential in time; each step is batched math
        k_t, v_t = k4[:, :, t], v4[:, :, t]
        if gated:
            state = state * np.exp(g4[:, :, t])[..., None]
        if delta:
            retrieved = np.matmul(k_t[:, :, None], state)[:, :, 0]  # S^T k
            v_t = b4[:, :, t] * (v_t - retrieved)
        state = state + k_t[..., :, None] * v_t[..., None, :]
        out[:, :, :, t] = scale * np.matmul(q4[:, :, :, t], state)
    output = out.reshape(s.batch, s.q_heads, s.steps, s.value_size)
    return [merge_heads(output).astype(q.dtype), state.astype(past.dtype if past is not None else q.dtype)]


register_op("LinearAttention", infer=_linear_attention_infer, cpu=_linear_attention_cpu, min_opset=27,
            doc="recurrent linear attention (linear / gated / delta / gated_delta update rules)")


# -- CausalConvWithState -------------------------------------------------------------------------

_CONV_ACTIVATIONS = ("none", "silu", "swish")


def _causal_conv_infer(node: Node, x: TensorInfo, w: TensorInfo, bias=None, past=None) -> list[TensorInfo]:
    if _strattr(node, "activation", "none") not in _CONV_ACTIVATIONS:
        raise ShapeInferenceError(f"activation must be one of {_CONV_ACTIVATIONS}")
    if x.shape is None or w.shape is None:
        return [TensorInfo(x.dtype, x.shape), TensorInfo(x.dtype, None)]
    if len(x.shape) != 3 or len(w.shape) != 3 or w.shape[0] != x.shape[1] or w.shape[1] != 1:
        raise ShapeInferenceError(f"CausalConvWithState needs input (B, C, L) and weight (C, 1, k), got "
                                  f"{x.shape} and {w.shape}")
    state = (x.shape[0], x.shape[1], w.shape[2] - 1)
    if past is not None and past.shape is not None and past.shape != state:
        raise ShapeInferenceError(f"past_state shape {past.shape} is not {state}")
    return [TensorInfo(x.dtype, x.shape), TensorInfo(x.dtype, state)]


def _causal_conv_cpu(node: Node, x: np.ndarray, w: np.ndarray, bias=None, past=None) -> list[np.ndarray]:
    batch, channels, _ = x.shape
    taps = w.shape[2]
    if past is None:
        past = np.zeros((batch, channels, taps - 1), x.dtype)
    padded = np.concatenate([past.astype(x.dtype, copy=False), x], axis=2)
    windows = np.lib.stride_tricks.sliding_window_view(padded, taps, axis=2)  # (B, C, L, k)
    y = np.einsum("bclk,ck->bcl", windows.astype(np.float32), w[:, 0].astype(np.float32))
    if bias is not None:
        y = y + bias.astype(np.float32)[:, None]
    if _strattr(node, "activation", "none") in ("silu", "swish"):
        y = y.astype(x.dtype).astype(np.float32)  # the conv output is rounded before the activation
        y = y / (1 + np.exp(-y))
    return [y.astype(x.dtype), padded[:, :, padded.shape[2] - (taps - 1):]]


register_op("CausalConvWithState", infer=_causal_conv_infer, cpu=_causal_conv_cpu, min_opset=27,
            doc="stateful causal depthwise conv1d with optional fused SiLU")


# -- SwiGLU --------------------------------------------------------------------------------------


def _swiglu_infer(node: Node, a: TensorInfo, b: TensorInfo) -> TensorInfo:
    if a.dtype != b.dtype or (a.shape is not None and b.shape is not None and a.shape != b.shape):
        raise ShapeInferenceError(f"SwiGLU inputs must have equal shapes and dtypes, got {a.shape} {a.dtype} "
                                  f"and {b.shape} {b.dtype} (no broadcasting)")
    return TensorInfo(a.dtype, a.shape)


def _swiglu_cpu(node: Node, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if a.shape != b.shape:
        raise ShapeInferenceError(f"SwiGLU inputs must have equal shapes, got {a.shape} and {b.shape}")
    alpha = node.attr("alpha", 1.0)
    gate = a * (1 / (1 + np.exp(-alpha * a))).astype(a.dtype)
    return (gate * b).astype(a.dtype)


register_op("SwiGLU", infer=_swiglu_infer, cpu=_swiglu_cpu, min_opset=28,
            doc="Swish(A) * B gated activation")
