"""Attention family and recurrent layers (engine_core/ops/attention.py, rnn.py) against references.

Each case is a one-node ONNX model built with onnx.helper, run through the public Kiln API and
through onnxruntime, or onnx's ReferenceEvaluator where onnxruntime lacks the op/opset/feature
(new-opset ops, sliding windows, batch-first recurrent layers, bfloat16). Outputs must match in
dtype and shape, values within a tolerance of a few ulps of the dtype, and build-time shape
inference must predict every output's dtype and shape.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

import engine_core as kiln
from engine_core.errors import KilnError
from tests.ops.harness import Case, parse, run_case, run_kiln

RNG = np.random.default_rng(7)
BF16 = np.dtype(ml_dtypes.bfloat16)

#: (rtol, atol) per output dtype: a few ulps, since references round differently.
TOLERANCE = {np.dtype(np.float32): (2e-5, 2e-6), np.dtype(np.float64): (1e-12, 1e-12),
             np.dtype(np.float16): (2e-3, 2e-3), BF16: (1e-2, 1e-2)}


def rand(*shape: int, dtype: Any = np.float32) -> np.ndarray:
    return RNG.standard_normal(shape).astype(dtype)


def lens(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def check(case: Case) -> None:
    """Within TOLERANCE of the output's dtype; inferred dtype and shape of every output exactly."""
    expected, actual, infos = run_case(case)
    assert len(actual) == len(expected)
    for index, (exp, act, info) in enumerate(zip(expected, actual, infos)):
        exp = np.asarray(exp)
        assert act.dtype == exp.dtype, f"output {index}: dtype {act.dtype} != {exp.dtype}"
        assert act.shape == exp.shape, f"output {index}: shape {act.shape} != {exp.shape}"
        rtol, atol = TOLERANCE[exp.dtype]
        np.testing.assert_allclose(act.astype(np.float64), exp.astype(np.float64), rtol=rtol, atol=atol,
                                   err_msg=f"output {index}")
        assert (info.dtype, info.shape) == (exp.dtype, exp.shape), f"output {index}: inferred {info}"


def attention(inputs: list, attrs: dict | None = None, outputs: tuple[str, ...] = ("Y",), opset: int = 23,
              reference: str = "ort") -> Case:
    return Case("Attention", inputs, attrs or {}, opset, outputs, reference)


ALL_OUTPUTS = ("Y", "present_key", "present_value", "qk")
QK_ONLY = ("Y", "", "", "qk")
F16 = np.float16

ATTENTION_CASES: dict[str, Case] = {
    "mha_4d": attention([rand(2, 3, 4, 8), rand(2, 3, 6, 8), rand(2, 3, 6, 8)]),
    "gqa_4d_causal_diff_v_size": attention([rand(2, 4, 3, 8), rand(2, 2, 5, 8), rand(2, 2, 5, 6)], {"is_causal": 1}),
    "mqa_3d_scaled": attention([rand(2, 3, 32), rand(2, 5, 8), rand(2, 5, 8)],
                               {"q_num_heads": 4, "kv_num_heads": 1, "scale": 0.2}),
    "past_present_float_mask": attention(
        [rand(2, 4, 3, 8), rand(2, 2, 5, 8), rand(2, 2, 5, 6), rand(3, 9), rand(2, 2, 4, 8), rand(2, 2, 4, 6)],
        {"is_causal": 1}, ALL_OUTPUTS),
    "past_present_3d_qk_raw_with_softcap": attention(
        [rand(2, 3, 16), rand(2, 5, 16), rand(2, 5, 12), rand(2, 1, 3, 9), rand(2, 2, 4, 8), rand(2, 2, 4, 6)],
        {"q_num_heads": 2, "kv_num_heads": 2, "softcap": 1.5}, ALL_OUTPUTS),
    "qk_softcapped": attention([rand(2, 4, 3, 8), rand(2, 2, 5, 8), rand(2, 2, 5, 8), rand(3, 5)],
                               {"softcap": 1.5, "qk_matmul_output_mode": 1}, QK_ONLY),
    "qk_with_float_bias": attention([rand(2, 4, 3, 8), rand(2, 2, 5, 8), rand(2, 2, 5, 8), rand(2, 4, 3, 5)],
                                    {"qk_matmul_output_mode": 2}, QK_ONLY),
    "qk_softmax_gqa_3d": attention([rand(2, 3, 32), rand(2, 5, 16), rand(2, 5, 8)],
                                   {"q_num_heads": 4, "kv_num_heads": 2, "qk_matmul_output_mode": 3}, QK_ONLY),
    "bool_mask_4d": attention([rand(2, 3, 4, 8), rand(2, 3, 6, 8), rand(2, 3, 6, 8), RNG.random((2, 3, 4, 6)) > 0.3]),
    # Bool masks: onnxruntime adds the lowest float, the spec -inf; the reference follows the spec.
    "bool_mask_qk_bias_past": attention(
        [rand(2, 4, 3, 8), rand(2, 2, 5, 8), rand(2, 2, 5, 6), RNG.random((2, 1, 3, 9)) > 0.3, rand(2, 2, 4, 8),
         rand(2, 2, 4, 6)], {"qk_matmul_output_mode": 2, "scale": 0.3}, ALL_OUTPUTS, reference="onnx"),
    "fully_masked_row_is_zero": attention(
        [rand(1, 2, 2, 8), rand(1, 2, 2, 8), rand(1, 2, 2, 8), np.array([[True, True], [False, False]])],
        {"qk_matmul_output_mode": 3}, QK_ONLY, reference="onnx"),
    "short_mask_padded": attention([rand(1, 2, 3, 8), rand(1, 2, 6, 8), rand(1, 2, 6, 8), rand(3, 4)],
                                   reference="onnx"),
    "fp16_softmax_in_float": attention([rand(2, 4, 3, 8, dtype=F16), rand(2, 2, 5, 8, dtype=F16),
                                        rand(2, 2, 5, 6, dtype=F16)], {"softmax_precision": 1}, reference="onnx"),
    "bf16_causal_mask": attention([rand(2, 3, 4, 8, dtype=BF16), rand(2, 3, 6, 8, dtype=BF16),
                                   rand(2, 3, 6, 8, dtype=BF16), rand(2, 1, 4, 6, dtype=BF16)], {"is_causal": 1},
                                  reference="onnx"),
    "nonpad_kv_causal_opset24": attention(
        [rand(2, 4, 3, 8), rand(2, 2, 6, 8), rand(2, 2, 6, 6), None, None, None, np.array([4, 6], np.int64)],
        {"is_causal": 1}, opset=24),
    "nonpad_kv_negative_offset": attention(
        [rand(1, 2, 4, 8), rand(1, 2, 4, 8), rand(1, 2, 4, 8), None, None, None, np.array([2], np.int64)],
        {"is_causal": 1}, opset=24, reference="onnx"),
    "window_left_causal_with_past": attention(
        [rand(2, 3, 4, 8), rand(2, 3, 2, 8), rand(2, 3, 2, 8), None, rand(2, 3, 5, 8), rand(2, 3, 5, 8)],
        {"is_causal": 1, "left_window_size": 2}, ALL_OUTPUTS[:3], opset=25, reference="onnx"),
    "window_bidirectional_ext_cache": attention(
        [rand(2, 3, 4, 8), rand(2, 3, 8, 8), rand(2, 3, 8, 8), rand(3, 4, 8), None, None, np.array([5, 8], np.int64)],
        {"left_window_size": 1, "right_window_size": 2}, opset=25, reference="onnx"),
}


@pytest.mark.parametrize("name", ATTENTION_CASES)
def test_attention(name: str) -> None:
    check(ATTENTION_CASES[name])


def rotary(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, pos: np.ndarray | None = None, **attrs: Any) -> Case:
    return Case("RotaryEmbedding", [x, cos, sin, pos], attrs, opset=23)


POS = np.array([[0, 5, 9], [3, 1, 7]], np.int64)
OTHER_CASES: dict[str, Case] = {
    "rope_4d_positions": rotary(rand(2, 4, 3, 8), rand(10, 4), rand(10, 4), POS),
    "rope_3d_interleaved_partial": rotary(rand(2, 3, 32), rand(10, 2), rand(10, 2), POS, num_heads=4,
                                          interleaved=1, rotary_embedding_dim=4),
    "rope_no_positions_fp16": rotary(rand(2, 4, 3, 8, dtype=F16), rand(2, 3, 4, dtype=F16), rand(2, 3, 4, dtype=F16)),
    "rope_no_positions_partial": rotary(rand(2, 2, 3, 8), rand(2, 3, 3), rand(2, 3, 3), rotary_embedding_dim=6),
}
for rule, extra in {"linear": [], "gated": [rand(2, 5, 8)], "delta": [None, RNG.random((2, 5, 2), np.float32)],
                    "gated_delta": [rand(2, 5, 2) * 0.1, RNG.random((2, 5, 1), np.float32)]}.items():
    OTHER_CASES[f"linear_attention_{rule}_gqa_past"] = Case(
        "LinearAttention", [rand(2, 5, 16), rand(2, 5, 8), rand(2, 5, 6), rand(2, 2, 4, 3), *extra],
        {"update_rule": rule, "q_num_heads": 4, "kv_num_heads": 2}, 27, ("output", "present_state"), "onnx")
OTHER_CASES["linear_attention_fp16_scale"] = Case(
    "LinearAttention", [rand(1, 3, 8, dtype=F16), rand(1, 3, 8, dtype=F16), rand(1, 3, 8, dtype=F16), None,
                        (rand(1, 3, 8) * 0.1).astype(F16), RNG.random((1, 3, 2)).astype(F16)],
    {"q_num_heads": 2, "kv_num_heads": 2, "scale": 0.5}, 27, ("output", "present_state"), "onnx")
for name, inputs, attrs in [
    ("bias_past_silu", [rand(2, 3, 6), rand(3, 1, 4), rand(3), rand(2, 3, 3)], {"activation": "silu"}),
    ("short_input", [rand(1, 2, 2), rand(2, 1, 5)], {}),
    ("fp16_swish", [rand(2, 3, 6, dtype=F16), rand(3, 1, 3, dtype=F16)], {"activation": "swish"}),
]:
    OTHER_CASES[f"causal_conv_{name}"] = Case("CausalConvWithState", inputs, attrs, 27,
                                              ("output", "present_state"), "onnx")
OTHER_CASES["swiglu_alpha"] = Case("SwiGLU", [rand(3, 4), rand(3, 4)], {"alpha": 1.7}, 28, reference="onnx")
OTHER_CASES["swiglu_fp16"] = Case("SwiGLU", [rand(3, 4, dtype=F16), rand(3, 4, dtype=F16)], {}, 28, reference="onnx")


@pytest.mark.parametrize("name", OTHER_CASES)
def test_rope_linear_attention_conv_swiglu(name: str) -> None:
    check(OTHER_CASES[name])


# -- recurrent layers ----------------------------------------------------------------------------

GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}


def recurrent(op: str, seq: int = 5, batch: int = 3, inputs: int = 4, hidden: int = 3, direction: str = "forward",
              sequence_lens: np.ndarray | None = None, initial: bool = True, opset: int = 22, **attrs: Any) -> Case:
    """A layer with bias, optional lengths and (optionally) initial states / peepholes."""
    dirs, gates = (2 if direction == "bidirectional" else 1), GATES[op]
    values = [rand(seq, batch, inputs), rand(dirs, gates * hidden, inputs), rand(dirs, gates * hidden, hidden),
              rand(dirs, 2 * gates * hidden), sequence_lens, rand(dirs, batch, hidden) if initial else None]
    outputs = ("Y", "Y_h")
    if op == "LSTM":
        values += [rand(dirs, batch, hidden), rand(dirs, 3 * hidden)] if initial else []
        outputs += ("Y_c",)
    return Case(op, values, {"hidden_size": hidden, "direction": direction, **attrs}, opset, outputs)


RECURRENT_CASES: dict[str, Case] = {}
for _op in GATES:
    for _direction in ("forward", "reverse", "bidirectional"):
        RECURRENT_CASES[f"{_op}_{_direction}_lengths_clip"] = recurrent(
            _op, direction=_direction, sequence_lens=lens(5, 2, 4), clip=0.7)
    RECURRENT_CASES[f"{_op}_zero_length_defaults"] = recurrent(_op, sequence_lens=lens(0, 5, 3), initial=False)
    RECURRENT_CASES[f"{_op}_opset7"] = recurrent(_op, opset=7)
RECURRENT_CASES.update({
    "GRU_linear_before_reset_bidirectional": recurrent("GRU", direction="bidirectional", linear_before_reset=1,
                                                       sequence_lens=lens(3, 5, 1)),
    "LSTM_input_forget_reverse": recurrent("LSTM", direction="reverse", input_forget=1, sequence_lens=lens(4, 1, 5)),
    "RNN_leaky_relu_alpha": recurrent("RNN", activations=["LeakyRelu"], activation_alpha=[0.3]),
    "GRU_hardsigmoid_affine": recurrent("GRU", activations=["HardSigmoid", "Affine"], activation_alpha=[0.3, 0.5],
                                        activation_beta=[0.4, 0.1]),
    "GRU_bidirectional_mixed_defaults": recurrent(
        "GRU", direction="bidirectional", activations=["Sigmoid", "ScaledTanh", "HardSigmoid", "Elu"],
        activation_alpha=[0.3, 0.5, 0.6], activation_beta=[0.4, 0.1]),
    "LSTM_softsign_softplus_relu": recurrent("LSTM", activations=["Softsign", "Softplus", "Relu"]),
    "LSTM_thresholded_relu": recurrent("LSTM", activations=["Sigmoid", "ThresholdedRelu", "Tanh"],
                                       activation_alpha=[0.2]),
})


@pytest.mark.parametrize("name", RECURRENT_CASES)
def test_recurrent(name: str) -> None:
    check(RECURRENT_CASES[name])


@pytest.mark.parametrize("op", list(GATES))
def test_recurrent_batch_first(op: str) -> None:
    """layout=1 (onnxruntime does not run it): batch-first X, states and outputs."""
    base = recurrent(op, direction="bidirectional")
    inputs = [base.inputs[0].swapaxes(0, 1).copy(), *base.inputs[1:4], None]
    inputs += [x.swapaxes(0, 1).copy() for x in base.inputs[5:7]] + base.inputs[7:]
    check(Case(op, inputs, {**base.attrs, "layout": 1}, 22, base.outputs, "onnx"))


def test_recurrent_batch_first_matches_seq_first() -> None:
    """layout=1 with sequence lengths gives the transposed results of layout=0 (no reference runs both)."""
    seq_first = recurrent("LSTM", direction="bidirectional", sequence_lens=lens(2, 5, 4))
    expected, _ = run_kiln(seq_first.model(), seq_first.feeds())
    inputs = [x if x is None or i in (1, 2, 3, 4, 7) else x.swapaxes(0, 1).copy() for i, x in enumerate(seq_first.inputs)]
    batch_first = Case("LSTM", inputs, {**seq_first.attrs, "layout": 1}, 22, seq_first.outputs)
    actual, _ = run_kiln(batch_first.model(), batch_first.feeds())
    np.testing.assert_array_equal(actual[0], expected[0].transpose(2, 0, 1, 3))
    for act, exp in zip(actual[1:], expected[1:]):
        np.testing.assert_array_equal(act, exp.swapaxes(0, 1))


# -- errors are reported at build time, naming the problem ---------------------------------------


@pytest.mark.parametrize("case, message", [
    (attention([rand(1, 3, 2, 8), rand(1, 2, 2, 8), rand(1, 2, 2, 8)]), "multiple"),
    (attention([rand(1, 2, 8), rand(1, 2, 8), rand(1, 2, 8)]), "q_num_heads"),
    (attention([rand(1, 2, 2, 8), rand(1, 2, 2, 8), rand(1, 2, 2, 8)], {"q_num_heads": 2, "kv_num_heads": 2},
               opset=25), "must not be set"),
    (attention([rand(1, 2, 2, 8), rand(1, 2, 2, 8), rand(1, 2, 2, 8), None, rand(1, 2, 1, 8)]), "together"),
    (attention([rand(1, 2, 2, 8), rand(1, 2, 3, 8), rand(1, 2, 3, 8), rand(3, 2, 3)]), "attn_mask"),
    (attention([rand(1, 2, 2, 8), rand(1, 2, 3, 8), rand(1, 2, 3, 8), rand(2, 4)]), "attn_mask"),
    (rotary(rand(1, 2, 3, 8), rand(4, 3), rand(4, 3), np.zeros((1, 3), np.int64)), "last dim of 4"),
    (recurrent("LSTM", direction="bidirectional", activations=["Sigmoid", "Tanh"]), "activations"),
    (recurrent("GRU", activations=["Sigmoid", "Bogus"]), "Bogus"),
    (Case("LinearAttention", [rand(1, 2, 8)] * 3, {"q_num_heads": 2, "kv_num_heads": 2}, 27, ("o", "s")), "decay"),
    (Case("SwiGLU", [rand(2, 3), rand(1, 3)], {}, 28), "equal shapes"),
])
def test_build_errors(case: Case, message: str) -> None:
    network = parse(case.model())
    with pytest.raises(KilnError, match=message):
        kiln.build_plan(network, kiln.Builder().create_builder_config())
