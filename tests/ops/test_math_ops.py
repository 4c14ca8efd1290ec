"""Math, activation, logic, reduction and random ops (elementwise.py, activations.py, logic.py,
reductions.py, random_ops.py).

Deterministic ops: one-node ONNX models built with onnx.helper run through the public Kiln API and
through onnxruntime (or onnx's ReferenceEvaluator where onnxruntime lacks the op, opset or dtype).
Outputs must match in dtype and shape, and in value exactly, except transcendental functions, whose
onnxruntime kernels are polynomial approximations (those compare within a few float32 ulp).
Build-time shape inference must agree with the real output.

Random ops: dtype, shape, moments of many samples, and that a seed reproduces.
"""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import engine_core as kiln
from engine_core.ops.elementwise import erf
from engine_core.types import np_to_onnx
from tests.ops.harness import Case, build, run_case, run_kiln

RNG = np.random.default_rng(7)
INTS = (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)
FLOATS = (np.float16, np.float32, np.float64)
#: Relative/absolute tolerance for transcendental functions, by output dtype.
APPROX = {np.dtype(np.float16): (2e-3, 1e-3), np.dtype(np.float32): (2e-6, 1e-6), np.dtype(np.float64): (1e-13, 1e-14)}


def rand(*shape: int, dtype: Any = np.float32, low: float = -3.0, high: float = 3.0) -> np.ndarray:
    """Uniform values in [low, high) as ``dtype`` (integers: whole numbers in that range)."""
    values = RNG.uniform(low, high, shape)
    if np.issubdtype(np.dtype(dtype), np.integer):
        values = np.floor(values)
    return values.astype(dtype)


def ints_of(dtype: Any, *shape: int, nonzero: bool = False) -> np.ndarray:
    """Integers spanning the whole range of ``dtype`` (edges included) to catch wrapping errors."""
    info = np.iinfo(dtype)
    values = RNG.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    edges = np.array([info.min, info.max], dtype=dtype)
    values.reshape(-1)[:2] = edges[: values.size]
    if nonzero:
        values[values == 0] = 1
    return values


def check(case: Case) -> None:
    """Exact, or within APPROX for ``approx`` cases; the inferred shape may be unknown only where
    ``shape_known`` is False."""
    (expected,), (actual,), (info,) = run_case(case)
    assert actual.dtype == expected.dtype, f"dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"shape {actual.shape} != {expected.shape}"
    if case.approx:
        rtol, atol = APPROX[expected.dtype]
        np.testing.assert_allclose(actual.astype(np.float64), expected.astype(np.float64), rtol=rtol, atol=atol)
    else:
        np.testing.assert_array_equal(actual, expected)
    assert info.dtype == expected.dtype, f"inferred dtype {info.dtype} != {expected.dtype}"
    if case.shape_known or info.shape is not None:
        assert info.shape == expected.shape, f"inferred shape {info.shape} != {expected.shape}"


# -- elementwise arithmetic ----------------------------------------------------------------------

ARITH_CASES: dict[str, Case] = {}
for _t in INTS:
    _a, _b = ints_of(_t, 3, 4), ints_of(_t, 4, nonzero=True)
    _name = np.dtype(_t).name
    for _op in ("Add", "Sub", "Mul", "Div"):
        ARITH_CASES[f"{_op}_{_name}"] = Case(_op, [_a, _b], reference="ort" if _t in (np.int32, np.int64) else "onnx")
    ARITH_CASES[f"Mod_{_name}"] = Case("Mod", [_a, _b])
    ARITH_CASES[f"Mod_fmod_{_name}"] = Case("Mod", [_a, _b], {"fmod": 1})
for _t in FLOATS:
    _a, _b = rand(2, 3, 4, dtype=_t), rand(3, 1, dtype=_t, low=0.5)
    _name = np.dtype(_t).name
    for _op in ("Add", "Sub", "Mul", "Div"):
        ARITH_CASES[f"{_op}_{_name}"] = Case(_op, [_a, _b], reference="onnx" if _t == np.float16 else "ort")
    ARITH_CASES[f"Mod_fmod_{_name}"] = Case("Mod", [_a, -_b], {"fmod": 1})
ARITH_CASES.update({
    "Div_int64_truncates_beyond_2p53": Case("Div", [np.array([2**62 + 1, -(2**62) - 3, -7, 7], np.int64),
                                                    np.array([3, 3, 2, -2], np.int64)]),
    "Div_broadcast_scalar": Case("Div", [rand(2, 3), np.array(0.5, np.float32)], consts=(1,)),
    "Mod_python_sign_int": Case("Mod", [np.array([-7, 7, -7, 7, 0], np.int32), np.array([3, -3, -3, 3, 5], np.int32)]),
    "Mod_opset28_float_fmod0": Case("Mod", [np.array([-7.5, 7.5, -0.0, 5.0, -5.0, np.inf], np.float32),
                                            np.array([2.0, -2.0, 3.0, np.inf, np.inf, 2.0], np.float32)],
                                    opset=28, reference="onnx"),
    "Mod_opset10": Case("Mod", [np.array([-4, 9], np.int64), np.array([3, -2], np.int64)], opset=10),
    "Pow_float": Case("Pow", [rand(3, 4, low=0.1), rand(4)], approx=True),
    "Pow_float_int_exponent": Case("Pow", [rand(3, 4), np.array([0, 1, 2, 3], np.int64)]),
    "Pow_int_float_exponent": Case("Pow", [np.array([1, 2, 3, 4], np.int32), np.array([4.0, 0.5, 2.0, 3.0], np.float32)]),
    "Pow_float16": Case("Pow", [rand(5, dtype=np.float16, low=0.5), rand(5, dtype=np.float16)], approx=True),
    "Pow_opset7": Case("Pow", [rand(2, 3, low=0.1), rand(2, 3)], opset=7, approx=True),
    "Max_variadic": Case("Max", [rand(3, 1), rand(1, 4), rand(4)]),
    "Min_int": Case("Min", [ints_of(np.int16, 2, 3), ints_of(np.int16, 3)], reference="onnx"),
    "Max_uint64": Case("Max", [ints_of(np.uint64, 4), ints_of(np.uint64, 4)], reference="onnx"),
    "Min_single": Case("Min", [rand(3, 2)]),
    "Max_opset8_float16": Case("Max", [rand(2, 3, dtype=np.float16), rand(3, dtype=np.float16)], opset=8,
                               reference="onnx"),
    "Sum_variadic": Case("Sum", [rand(2, 3), rand(3), rand(2, 1)]),
    "Sum_float16": Case("Sum", [rand(4, dtype=np.float16), rand(4, dtype=np.float16)], reference="onnx"),
    "Mean_variadic": Case("Mean", [rand(2, 3), rand(3), rand(2, 1)], approx=True),
    "Mean_double": Case("Mean", [rand(2, 3, dtype=np.float64), rand(2, 3, dtype=np.float64)], reference="onnx"),
})


@pytest.mark.parametrize("name", ARITH_CASES)
def test_arithmetic(name: str) -> None:
    check(ARITH_CASES[name])


def test_integer_pow_and_sum_are_exact_in_int64() -> None:
    """Integer Pow and ReduceSum stay in integers: exact beyond 2**53, where onnxruntime's double
    arithmetic rounds (3**39 comes back as ...256 there, not ...267)."""
    base, exponent = np.array([3, -3, 7, 2], np.int64), np.array([39, 39, 22, 62], np.int64)
    case = Case("Pow", [base, exponent])
    (power,), _ = run_kiln(case.model(), case.feeds())
    assert power.dtype == np.int64
    assert power.tolist() == [int(b) ** int(e) for b, e in zip(base, exponent)]
    x = ints_of(np.int64, 4, 6) // 8
    case = Case("ReduceSum", [x, np.array([1], np.int64)], consts=(1,))
    (total,), _ = run_kiln(case.model(), case.feeds())
    assert total.reshape(-1).tolist() == [sum(int(v) for v in row) for row in x]


def test_gelu_float64_matches_libm_erf() -> None:
    """onnx's reference Gelu is float32-accurate only; against C's erf Kiln's double Gelu agrees to a
    few ulp."""
    x = np.linspace(-6, 6, 97)
    case = Case("Gelu", [x], opset=20)
    (actual,), _ = run_kiln(case.model(), case.feeds())
    expected = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x])
    assert actual.dtype == np.float64
    np.testing.assert_allclose(actual, expected, rtol=2e-15, atol=1e-15)  # 1 + erf cancels for x < 0


# -- unary math ------------------------------------------------------------------------------------

_SPECIALS = np.array([0.0, -0.0, 0.5, -0.5, 1.5, 2.5, -2.5, np.inf, -np.inf, np.nan], np.float32)
EXACT_UNARY = ("Abs", "Neg", "Sign", "Floor", "Ceil", "Round", "Reciprocal", "Sqrt")
APPROX_UNARY = ("Exp", "Log", "Erf", "Sin", "Cos", "Tan", "Atan", "Sinh", "Cosh", "Asinh", "Tanh", "Sigmoid")
#: Unary ops onnxruntime's CPU provider implements for float64.
ORT_DOUBLE_UNARY = {"Abs", "Neg", "Sign", "Floor", "Ceil", "Round", "Reciprocal", "Sqrt", "Exp", "Log", "Sin", "Cos",
                    "Tanh", "Sigmoid"}
UNARY_CASES: dict[str, Case] = {}
for _op in EXACT_UNARY + APPROX_UNARY:
    for _t in FLOATS:
        if _op == "Erf" and _t == np.float64:
            continue  # onnx's reference Erf is float32-accurate: see test_erf_matches_libm_in_double
        _x = np.concatenate([rand(20, dtype=_t), _SPECIALS.astype(_t)])
        if _op in ("Log", "Sqrt"):
            _x = np.abs(_x)
        _ort = _t == np.float32 or (_t == np.float64 and _op in ORT_DOUBLE_UNARY)
        UNARY_CASES[f"{_op}_{np.dtype(_t).name}"] = Case(_op, [_x], approx=_op in APPROX_UNARY,
                                                          reference="ort" if _ort else "onnx")
for _op in ("Asin", "Acos", "Atanh"):
    UNARY_CASES[_op] = Case(_op, [rand(3, 4, low=-0.99, high=0.99)], approx=True)
UNARY_CASES["Acosh"] = Case("Acosh", [rand(3, 4, low=1.0, high=9.0)], approx=True)
for _t in (np.int8, np.int32, np.int64):
    for _op in ("Abs", "Neg", "Sign"):
        UNARY_CASES[f"{_op}_{np.dtype(_t).name}"] = Case(_op, [ints_of(_t, 10)], reference="onnx")
UNARY_CASES.update({
    "Round_half_even": Case("Round", [np.array([0.5, 1.5, 2.5, -0.5, -1.5, 2.4999, 1e8 + 0.5], np.float64)]),
    "Erf_int32": Case("Erf", [np.array([-3, -1, 0, 1, 2], np.int32)], reference="onnx"),
    "IsNaN": Case("IsNaN", [_SPECIALS]),
    "IsNaN_float16_opset13": Case("IsNaN", [_SPECIALS.astype(np.float16)], opset=13),
    "IsInf": Case("IsInf", [_SPECIALS]),
    "IsInf_positive_only": Case("IsInf", [_SPECIALS.astype(np.float64)], {"detect_negative": 0}),
    "IsInf_negative_only": Case("IsInf", [_SPECIALS], {"detect_positive": 0}),
    "Clip_attrs_opset10": Case("Clip", [rand(3, 4)], {"min": -1.0, "max": 0.5}, opset=10),
    "Clip_attr_max_only_opset7": Case("Clip", [rand(3, 4)], {"max": 0.5}, opset=7),
    "Clip_inputs_opset11": Case("Clip", [rand(3, 4), np.array(-0.5, np.float32), np.array(1.0, np.float32)],
                                opset=11, consts=(1, 2)),
    "Clip_runtime_bounds": Case("Clip", [rand(3, 4), np.array(-0.5, np.float32), np.array(1.0, np.float32)]),
    "Clip_min_only": Case("Clip", [rand(3, 4), np.array(0.0, np.float32)]),
    "Clip_max_only": Case("Clip", [rand(3, 4), None, np.array(0.0, np.float32)]),
    "Clip_int64": Case("Clip", [ints_of(np.int64, 10), np.array(-5, np.int64), np.array(2**40, np.int64)]),
    "Clip_uint8": Case("Clip", [ints_of(np.uint8, 10), np.array(10, np.uint8), np.array(200, np.uint8)]),
    "Clip_min_above_max": Case("Clip", [rand(6), np.array(1.0, np.float32), np.array(-1.0, np.float32)]),
    "Clip_float16": Case("Clip", [rand(6, dtype=np.float16), np.array(-1, np.float16), np.array(1, np.float16)]),
})


@pytest.mark.parametrize("name", UNARY_CASES)
def test_unary(name: str) -> None:
    check(UNARY_CASES[name])


def test_erf_matches_libm_in_double() -> None:
    """numpy has no erf: Kiln's series/continued-fraction evaluation must match C's erf to ~1 ulp."""
    x = np.concatenate([np.linspace(-7, 7, 2001), [1e-300, -1e-10, 2.9999999, 3.0, 3.0000001, 27.0]])
    expected = np.array([math.erf(v) for v in x])
    np.testing.assert_allclose(erf(x), expected, rtol=1.5e-15, atol=1e-300)
    assert np.isnan(erf(np.array([np.nan])))[0]
    np.testing.assert_array_equal(erf(np.array([np.inf, -np.inf, 0.0, -0.0])), [1.0, -1.0, 0.0, -0.0])


def test_erf_float32_is_float32_accurate() -> None:
    """float32 input is computed in float32 (fewer terms): within a few float32 ulp of C's erf."""
    x = np.linspace(-6, 6, 4001, dtype=np.float32)
    actual = erf(x)
    assert actual.dtype == np.float32
    expected = np.array([math.erf(float(v)) for v in x])
    np.testing.assert_allclose(actual, expected, rtol=8 * np.finfo(np.float32).eps, atol=1e-30)


# -- activations -------------------------------------------------------------------------------------

_ACT_INPUT = np.concatenate([rand(30), np.array([0.0, 1.0, -1.0, 25.0, -25.0], np.float32)])
ACTIVATION_CASES: dict[str, Case] = {
    "Relu": Case("Relu", [_ACT_INPUT]),
    "Relu_int8_opset14": Case("Relu", [ints_of(np.int8, 10)], opset=14),
    "Relu_opset7": Case("Relu", [_ACT_INPUT], opset=7),
    "LeakyRelu": Case("LeakyRelu", [_ACT_INPUT], {"alpha": 0.2}),
    "LeakyRelu_default": Case("LeakyRelu", [_ACT_INPUT]),
    # onnx's reference multiplies in float16 by alpha rounded to float16; Kiln rounds once from float32
    "LeakyRelu_float16": Case("LeakyRelu", [_ACT_INPUT.astype(np.float16)], {"alpha": 0.1}, reference="onnx",
                              approx=True),
    "PRelu_broadcast": Case("PRelu", [rand(2, 3, 4), rand(3, 1)]),
    "PRelu_scalar_slope": Case("PRelu", [rand(2, 3), np.array([0.25], np.float32)], consts=(1,)),
    "PRelu_int32": Case("PRelu", [np.array([-4, 5, -6], np.int32), np.array([2, 3, -1], np.int32)], reference="onnx"),
    "PRelu_opset7": Case("PRelu", [rand(2, 3), rand(3)], opset=7),
    "Elu": Case("Elu", [_ACT_INPUT], {"alpha": 2.0}, approx=True),
    "Celu": Case("Celu", [_ACT_INPUT], {"alpha": 2.0}, approx=True),
    "Celu_opset12": Case("Celu", [_ACT_INPUT], opset=12, approx=True),
    "Selu": Case("Selu", [_ACT_INPUT], approx=True),
    "Selu_attrs": Case("Selu", [_ACT_INPUT], {"alpha": 2.0, "gamma": 3.0}, approx=True),
    "Sigmoid_extremes": Case("Sigmoid", [np.array([-200.0, -50.0, 0.0, 50.0, 200.0], np.float32)], approx=True),
    "HardSigmoid": Case("HardSigmoid", [_ACT_INPUT], {"alpha": 0.3, "beta": 0.4}, approx=True),
    "HardSigmoid_default": Case("HardSigmoid", [_ACT_INPUT], approx=True),
    "HardSwish": Case("HardSwish", [_ACT_INPUT], approx=True),
    "Softplus": Case("Softplus", [np.concatenate([_ACT_INPUT, np.array([100.0, -100.0], np.float32)])], approx=True),
    "Softsign": Case("Softsign", [_ACT_INPUT], approx=True),
    "Tanh_float64": Case("Tanh", [_ACT_INPUT.astype(np.float64)], approx=True),
    "ThresholdedRelu": Case("ThresholdedRelu", [_ACT_INPUT], {"alpha": 0.5}),
    "ThresholdedRelu_default": Case("ThresholdedRelu", [_ACT_INPUT]),
    "Gelu": Case("Gelu", [_ACT_INPUT], opset=20, approx=True),
    "Gelu_tanh": Case("Gelu", [_ACT_INPUT], {"approximate": "tanh"}, opset=20, approx=True),
    "Mish": Case("Mish", [_ACT_INPUT], opset=18, approx=True),
    "Swish": Case("Swish", [_ACT_INPUT], {"alpha": 1.5}, opset=24, reference="onnx", approx=True),
    "Shrink": Case("Shrink", [_ACT_INPUT], {"lambd": 1.0, "bias": 0.5}),
    "Shrink_int8": Case("Shrink", [np.arange(-6, 7, dtype=np.int8)], {"lambd": 2.0, "bias": 1.0}),
}


@pytest.mark.parametrize("name", ACTIVATION_CASES)
def test_activation(name: str) -> None:
    check(ACTIVATION_CASES[name])


# -- logic -------------------------------------------------------------------------------------------

_STRINGS_A = np.array(["a", "bc", "", "x"], dtype=object)
_STRINGS_B = np.array(["a", "b", "", "y"], dtype=object)
LOGIC_CASES: dict[str, Case] = {}
for _op in ("Equal", "Greater", "Less", "GreaterOrEqual", "LessOrEqual"):
    for _t in (np.int32, np.int64, np.float32, np.float64, np.uint8):
        _a = rand(3, 4, dtype=_t, low=0, high=4)
        _b = rand(4, dtype=_t, low=0, high=4)
        LOGIC_CASES[f"{_op}_{np.dtype(_t).name}"] = Case(_op, [_a, _b], reference="onnx" if _t == np.uint8 else "ort")
    LOGIC_CASES[f"{_op}_float16"] = Case(_op, [rand(5, dtype=np.float16), rand(5, dtype=np.float16)], reference="onnx")
LOGIC_CASES.update({
    "Equal_nan": Case("Equal", [_SPECIALS, _SPECIALS]),
    "Equal_bool": Case("Equal", [np.array([True, False, True]), np.array([True, True, False])]),
    "Equal_string_opset19": Case("Equal", [_STRINGS_A, _STRINGS_B], opset=19),
    "Greater_opset7": Case("Greater", [rand(2, 3), rand(3)], opset=7),
    "LessOrEqual_opset12": Case("LessOrEqual", [rand(2, 3), rand(3)], opset=12),
    "Where": Case("Where", [rand(3, 1) > 0, rand(3, 4), rand(4)]),
    "Where_int64": Case("Where", [rand(4) > 0, ints_of(np.int64, 4), ints_of(np.int64, 1)]),
    "Where_string": Case("Where", [np.array([True, False, False, True]), _STRINGS_A, _STRINGS_B]),
    "Where_opset9": Case("Where", [rand(2, 2) > 0, rand(2, 2), rand(2, 2)], opset=9),
    "Not": Case("Not", [rand(3, 4) > 0]),
})
_BOOLS = (np.array([True, True, False, False]), np.array([True, False, True, False]))
for _op in ("And", "Or", "Xor"):
    LOGIC_CASES[_op] = Case(_op, list(_BOOLS))
    LOGIC_CASES[f"{_op}_broadcast"] = Case(_op, [rand(2, 3, 4) > 0, rand(4) > 0])
for _t in (np.uint8, np.uint16, np.uint32, np.uint64):
    _x, _y = ints_of(_t, 6), np.array([0, 1, 3, 7, 2, 1], _t)
    LOGIC_CASES[f"BitShift_left_{np.dtype(_t).name}"] = Case("BitShift", [_x, _y], {"direction": "LEFT"})
    LOGIC_CASES[f"BitShift_right_{np.dtype(_t).name}"] = Case("BitShift", [_x, _y], {"direction": "RIGHT"})
for _t in INTS:
    _a, _b = ints_of(_t, 2, 3), ints_of(_t, 3)
    for _op in ("BitwiseAnd", "BitwiseOr", "BitwiseXor"):
        LOGIC_CASES[f"{_op}_{np.dtype(_t).name}"] = Case(_op, [_a, _b], opset=18)
    LOGIC_CASES[f"BitwiseNot_{np.dtype(_t).name}"] = Case("BitwiseNot", [_a], opset=18)


@pytest.mark.parametrize("name", LOGIC_CASES)
def test_logic(name: str) -> None:
    check(LOGIC_CASES[name])


def test_bitshift_opset28_signed_and_out_of_range_amounts() -> None:
    """Opset 28 defines signed shifts (arithmetic right shift) and amounts outside [0, bits):
    the sign fill alone (-1 for negative X shifted right, else 0)."""
    x = np.array([-8, -8, 5, -1, 64, -128, 3, -3], np.int8)
    y = np.array([1, 9, 1, 8, 1, 1, -1, -1], np.int8)
    (right,), _ = run_kiln(Case("BitShift", [x, y], {"direction": "RIGHT"}, opset=28).model(), {"in0": x, "in1": y})
    np.testing.assert_array_equal(right, np.array([-4, -1, 2, -1, 32, -64, 0, -1], np.int8))
    (left,), _ = run_kiln(Case("BitShift", [x, y], {"direction": "LEFT"}, opset=28).model(), {"in0": x, "in1": y})
    np.testing.assert_array_equal(left, np.array([-16, 0, 10, 0, -128, 0, 0, 0], np.int8))
    assert right.dtype == left.dtype == np.int8


# -- reductions --------------------------------------------------------------------------------------

REDUCE_OPS = ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
              "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare")
#: Opset where ``axes`` became an input.
AXES_INPUT_SINCE = {op: 13 if op == "ReduceSum" else 18 for op in REDUCE_OPS}
REDUCE_CASES: dict[str, Case] = {}
for _op in REDUCE_OPS:
    _x = rand(3, 4, 5, low=0.1, high=2.0) if _op == "ReduceLogSum" else rand(3, 4, 5)
    _approx = _op in ("ReduceMean", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSum", "ReduceL1",
                      "ReduceSumSquare", "ReduceProd")
    _new, _old = AXES_INPUT_SINCE[_op], AXES_INPUT_SINCE[_op] - 1
    REDUCE_CASES.update({
        f"{_op}_attr_axes_opset{_old}": Case(_op, [_x], {"axes": [0, -1], "keepdims": 0}, opset=_old, approx=_approx),
        f"{_op}_default_axes_opset11": Case(_op, [_x], opset=11, approx=_approx),
        f"{_op}_input_axes": Case(_op, [_x, np.array([1], np.int64)], opset=_new, consts=(1,), approx=_approx),
        f"{_op}_input_axes_no_keepdims": Case(_op, [_x, np.array([-1, 0], np.int64)], {"keepdims": 0}, opset=_new,
                                               consts=(1,), approx=_approx),
        f"{_op}_all_axes": Case(_op, [_x], {"keepdims": 0}, opset=_new, approx=_approx),
        f"{_op}_noop_empty_axes": Case(_op, [_x, np.zeros(0, np.int64)], {"noop_with_empty_axes": 1},
                                       opset=_new, consts=(1,), approx=_approx),
        # the spec leaves an empty mean undefined: onnxruntime says 0, onnx's reference (and Kiln) NaN
        f"{_op}_empty_set": Case(_op, [np.zeros((2, 0, 4), np.float32), np.array([1], np.int64)], opset=_new,
                                 consts=(1,), reference="onnx" if _op == "ReduceMean" else "ort"),
        f"{_op}_scalar_input": Case(_op, [np.array(1.5, np.float32)], opset=_new, approx=_approx),
    })
REDUCE_CASES.update({
    "ReduceSum_int32": Case("ReduceSum", [ints_of(np.int32, 4, 6) // 8, np.array([0], np.int64)], consts=(1,)),
    "ReduceSum_float16": Case("ReduceSum", [rand(4, 8, dtype=np.float16), np.array([1], np.int64)], consts=(1,),
                              approx=True),
    "ReduceSum_runtime_axes": Case("ReduceSum", [rand(3, 4), np.array([1], np.int64)], approx=True,
                                   shape_known=False),
    "ReduceMax_int8": Case("ReduceMax", [ints_of(np.int8, 4, 6)], {"axes": [1]}, opset=13),
    "ReduceMin_uint8": Case("ReduceMin", [ints_of(np.uint8, 4, 6)], {"axes": [0]}, opset=13),
    "ReduceMax_bool_opset20": Case("ReduceMax", [rand(3, 4) > 0, np.array([1], np.int64)], opset=20, consts=(1,)),
    "ReduceMin_bool_opset20": Case("ReduceMin", [rand(3, 4) > 0, np.array([0], np.int64)], opset=20, consts=(1,)),
    "ReduceMax_int32_empty": Case("ReduceMax", [np.zeros((0, 3), np.int32), np.array([0], np.int64)], opset=18,
                                  consts=(1,), reference="onnx"),
    "ReduceProd_int64": Case("ReduceProd", [rand(3, 4, dtype=np.int64, low=-4, high=5), np.array([1], np.int64)],
                             opset=18, consts=(1,)),
    "ReduceL1_int32": Case("ReduceL1", [ints_of(np.int32, 3, 4) // 4], {"axes": [1]}, opset=13),
    "ReduceLogSumExp_large": Case("ReduceLogSumExp", [np.array([[1000.0, 1000.0], [-1000.0, -np.inf]], np.float32)],
                                  {"axes": [1]}, opset=13, approx=True),
    "ReduceMean_float64": Case("ReduceMean", [rand(3, 4, dtype=np.float64)], {"axes": [1]}, opset=13, approx=True),
})


@pytest.mark.parametrize("name", REDUCE_CASES)
def test_reduction(name: str) -> None:
    check(REDUCE_CASES[name])


_TIES = np.array([[1, 3, 3, 0], [2, 2, 1, 2], [5, 0, 5, 5]], np.float32)
ARG_CASES: dict[str, Case] = {}
for _op in ("ArgMax", "ArgMin"):
    ARG_CASES.update({
        f"{_op}_default": Case(_op, [rand(3, 4, 5)]),
        f"{_op}_axis_no_keepdims": Case(_op, [rand(3, 4, 5)], {"axis": -1, "keepdims": 0}),
        f"{_op}_ties_first": Case(_op, [_TIES], {"axis": 1}),
        f"{_op}_ties_last": Case(_op, [_TIES], {"axis": 1, "select_last_index": 1}),
        f"{_op}_ties_last_axis0": Case(_op, [_TIES.T.copy()], {"axis": 0, "select_last_index": 1, "keepdims": 0}),
        f"{_op}_int32": Case(_op, [ints_of(np.int32, 4, 3)], {"axis": 0}),
        f"{_op}_float16_opset11": Case(_op, [rand(4, 3, dtype=np.float16)], {"axis": 1}, opset=11, reference="onnx"),
    })


@pytest.mark.parametrize("name", ARG_CASES)
def test_arg_extreme(name: str) -> None:
    check(ARG_CASES[name])


SCAN_CASES: dict[str, Case] = {}
for _op, _opset, _ref in (("CumSum", 14, "ort"), ("CumProd", 26, "onnx")):
    for _attrs in ({}, {"exclusive": 1}, {"reverse": 1}, {"exclusive": 1, "reverse": 1}):
        _label = "_".join(_attrs) or "inclusive"
        SCAN_CASES[f"{_op}_{_label}"] = Case(_op, [rand(3, 4, low=0.5, high=1.5), np.array(1, np.int64)], _attrs,
                                             opset=_opset, reference=_ref, approx=True)
    SCAN_CASES[f"{_op}_int32_axis_neg"] = Case(_op, [rand(2, 3, 4, dtype=np.int32, low=-3, high=4),
                                                     np.array(-1, np.int32)], {"exclusive": 1}, opset=_opset,
                                               reference=_ref)
    SCAN_CASES[f"{_op}_int64_axis0"] = Case(_op, [rand(5, 3, dtype=np.int64, low=-9, high=9), np.array(0, np.int64)],
                                            {"reverse": 1}, opset=_opset, reference=_ref)
SCAN_CASES["CumSum_opset11"] = Case("CumSum", [rand(6, dtype=np.float64), np.array(0, np.int32)], opset=11,
                                    approx=True)
SCAN_CASES["CumSum_empty_axis"] = Case("CumSum", [np.zeros((2, 0), np.float32), np.array(1, np.int64)],
                                       {"exclusive": 1}, reference="onnx")


@pytest.mark.parametrize("name", SCAN_CASES)
def test_scan(name: str) -> None:
    check(SCAN_CASES[name])


# -- random ------------------------------------------------------------------------------------------


def build_context(node: onnx.NodeProto, inputs: list[onnx.ValueInfoProto], opset: int = 22):
    graph = helper.make_graph([node], "random", inputs, [helper.make_empty_tensor_value_info("out")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    _, plan = build(model)
    return kiln.Runtime().load(plan).create_execution_context()


def sample(op: str, feeds: dict[str, np.ndarray] | None = None, **attrs: Any) -> tuple[np.ndarray, np.ndarray]:
    """Two runs of one random node (same context)."""
    feeds = feeds or {}
    inputs = [helper.make_tensor_value_info(k, np_to_onnx(v.dtype), v.shape) for k, v in feeds.items()]
    context = build_context(helper.make_node(op, list(feeds), ["out"], **attrs), inputs)
    return context.infer(feeds)["out"], context.infer(feeds)["out"]


N = 200_000


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16])
def test_random_normal_moments_and_dtype(dtype: int) -> None:
    first, second = sample("RandomNormal", shape=[N // 100, 100], mean=2.0, scale=0.5, dtype=dtype)
    assert first.shape == (N // 100, 100)
    assert first.dtype == helper.tensor_dtype_to_np_dtype(dtype)
    values = first.astype(np.float64)
    assert abs(values.mean() - 2.0) < 0.01 and abs(values.std() - 0.5) < 0.01
    assert not np.array_equal(first, second), "unseeded runs must differ"


def test_random_uniform_range_and_moments() -> None:
    first, _ = sample("RandomUniform", shape=[N], low=-1.0, high=3.0)
    assert first.dtype == np.float32 and first.shape == (N,)
    assert first.min() >= -1.0 and first.max() < 3.0
    assert abs(first.mean() - 1.0) < 0.02 and abs(first.var() - 16 / 12) < 0.02


def test_random_uniform_never_reaches_high_in_a_narrow_dtype() -> None:
    """float64 draws just below `high` round up to it in float16 (~50 of 200k here): the op clamps."""
    first, _ = sample("RandomUniform", shape=[200_000], low=-1.0, high=3.0, dtype=TensorProto.FLOAT16)
    assert first.dtype == np.float16 and first.min() >= -1.0 and first.max() < 3.0


@pytest.mark.parametrize("op", ["RandomNormal", "RandomUniform"])
def test_seed_reproduces_across_runs_and_plans(op: str) -> None:
    first, second = sample(op, shape=[3, 4], seed=3.0)
    third, _ = sample(op, shape=[3, 4], seed=3.0)
    other, _ = sample(op, shape=[3, 4], seed=4.0)
    np.testing.assert_array_equal(first, second)
    np.testing.assert_array_equal(first, third)
    assert not np.array_equal(first, other)


@pytest.mark.parametrize("op", ["RandomNormalLike", "RandomUniformLike"])
def test_like_ops_take_shape_and_dtype_from_input(op: str) -> None:
    x = np.zeros((N // 100, 100), np.float64)
    first, second = sample(op, {"x": x})
    assert first.shape == x.shape and first.dtype == np.float64
    expected_mean = 0.0 if "Normal" in op else 0.5
    assert abs(first.mean() - expected_mean) < 0.01
    assert not np.array_equal(first, second)
    cast, _ = sample(op, {"x": x}, dtype=TensorProto.FLOAT16, seed=1.0)
    assert cast.dtype == np.float16 and cast.shape == x.shape


def test_bernoulli_frequencies_dtype_and_seed() -> None:
    p = np.repeat(np.array([[0.0, 0.2, 0.7, 1.0]], np.float32), N // 4, axis=0)
    first, second = sample("Bernoulli", {"p": p})
    assert first.dtype == np.float32 and first.shape == p.shape
    assert set(np.unique(first)) <= {0.0, 1.0}
    np.testing.assert_allclose(first.mean(axis=0), [0.0, 0.2, 0.7, 1.0], atol=0.01)
    assert not np.array_equal(first, second)
    seeded, again = sample("Bernoulli", {"p": p}, seed=5.0, dtype=TensorProto.INT32)
    assert seeded.dtype == np.int32
    np.testing.assert_array_equal(seeded, again)


def test_multinomial_frequencies_dtype_and_seed() -> None:
    probs = np.array([[0.1, 0.2, 0.7], [0.5, 0.5, 0.0]])
    logits = np.log(np.maximum(probs, 1e-30)).astype(np.float32) + np.array([[3.0], [-2.0]], np.float32)
    first, second = sample("Multinomial", {"x": logits}, sample_size=N // 4)
    assert first.dtype == np.int32 and first.shape == (2, N // 4)
    for row, p in zip(first, probs):
        np.testing.assert_allclose(np.bincount(row, minlength=3) / row.size, p, atol=0.01)
    assert not np.array_equal(first, second)
    seeded, again = sample("Multinomial", {"x": logits}, sample_size=10, seed=2.0, dtype=TensorProto.INT64)
    assert seeded.dtype == np.int64 and seeded.shape == (2, 10)
    np.testing.assert_array_equal(seeded, again)


def test_random_ops_are_not_folded_at_build_time() -> None:
    """A generator feeding another op must run per inference, not become a build-time constant."""
    nodes = [helper.make_node("RandomUniform", [], ["r"], shape=[4]),
             helper.make_node("Add", ["r", "x"], ["out"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    _, plan = build(model)
    context = kiln.Runtime().load(plan).create_execution_context()
    x = np.zeros(4, np.float32)
    assert not np.array_equal(context.infer({"x": x})["out"], context.infer({"x": x})["out"])


@pytest.mark.parametrize(("op", "opset"), [("Gelu", 19), ("Swish", 23), ("BitwiseAnd", 17), ("CumProd", 25)])
def test_ops_are_refused_before_the_opset_that_introduced_them(op: str, opset: int) -> None:
    x = np.ones(3, np.int32 if op.startswith("Bitwise") else np.float32)
    inputs = [x, x] if op == "BitwiseAnd" else [x, np.array(0, np.int64)] if op == "CumProd" else [x]
    network = kiln.Builder().create_network()
    parser = kiln.OnnxParser(network)
    assert not parser.parse(Case(op, inputs, opset=opset).model())
    assert f"{op} is supported from opset {opset + 1}" in str(parser.get_error(0))


# -- dtype rules worth a direct statement ------------------------------------------------------------


def test_bfloat16_math_keeps_dtype() -> None:
    """Narrow floats are computed in float32 and rounded back once (onnxruntime has no bfloat16 CPU
    kernels for these, so the reference is float32 math rounded to bfloat16)."""
    x = rand(16).astype(ml_dtypes.bfloat16)
    for op, fn in (("Exp", np.exp), ("Sigmoid", lambda v: 1 / (1 + np.exp(-v))), ("Neg", np.negative)):
        case = Case(op, [x], opset=22)
        (actual,), (info,) = run_kiln(case.model(), case.feeds())
        assert actual.dtype == info.dtype == np.dtype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(actual, fn(x.astype(np.float32)).astype(ml_dtypes.bfloat16))
