"""Strided views in the CUDA lowering: a Split of an arena tensor is views of it at offsets (layout "strided"), and
views of those (Reshape, Transpose, Expand, a one-input Concat) stay views where strides can describe them. Readers
that take strides (pointwise kernels, Concat, Transpose, flash attention) read them in place; any other reader, a
Reshape that strides cannot describe and a graph output get a copy. Every case is emulated on the host
(tests/cuda/emulate.py) against the reference interpreter."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from engine_core.backends.cuda.lower_rules.movement import reshape_strides
from engine_core.backends.cuda.lowering import LoweringOptions
from tests.cuda.test_channels_last_concat import _emulated_matches_cpu, _lowered


def _numpy_view_strides(a: np.ndarray, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    view = a.view()
    try:
        view.shape = shape  # numpy refuses (AttributeError) where the reshape needs a copy
    except AttributeError:
        return None
    return tuple(s // a.itemsize for s in view.strides)


@pytest.mark.parametrize("picked, shape", [
    ((slice(None), slice(None), slice(0, 8)), (4, 1, 2, 4)),      # a Split part of [B, 1, 3E] into heads
    ((slice(None), slice(None), slice(8, 16)), (4, 8)),           # ... and flattened (the unit dim dropped)
    ((slice(None), slice(None), slice(0, 8)), (32,)),             # rows that are not contiguous: a copy
    ((slice(None), 0, slice(0, 8)), (2, 2, 2, 4)),
    ((slice(None), slice(None), slice(0, 24, 2)), (4, 12)),       # a step: the inner stride is 2
    ((slice(None), slice(None), slice(0, 24, 2)), (4, 3, 4)),
    ((slice(0, 1), slice(None), slice(None)), (1, 24)),
    ((slice(None), slice(None), slice(None)), (1, 4, 1, 24, 1)),  # new unit dims
])
def test_reshape_strides_finds_the_views_numpy_finds(picked, shape):
    a = np.arange(4 * 1 * 24, dtype=np.float32).reshape(4, 1, 24)[picked]
    want = _numpy_view_strides(a, shape)
    got = reshape_strides(a.shape, tuple(s // a.itemsize for s in a.strides), shape)
    assert (got is None) == (want is None), (got, want)
    if got is not None:  # unit dims: any stride reads the same element
        assert [g for g, d in zip(got, shape) if d != 1] == [w for w, d in zip(want, shape) if d != 1]
        np.testing.assert_array_equal(np.lib.stride_tricks.as_strided(a, shape, [g * a.itemsize for g in got]),
                                      a.reshape(shape))


def test_reshape_strides_of_every_regrouping_of_a_split_part():
    """Every shape of 2 x 3 x 4 x 5 elements (a part of [2, 3, 4, 10]) against numpy."""
    base = np.zeros((2, 3, 4, 10), np.float16)[..., 5:]
    dims = [1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 24, 30, 40, 60, 120]
    for rank in (1, 2, 3):
        for shape in itertools.product(dims, repeat=rank):
            if int(np.prod(shape)) == base.size:
                want = _numpy_view_strides(base, shape)
                got = reshape_strides(base.shape, tuple(s // 2 for s in base.strides), shape)
                assert (got is None) == (want is None), shape


def _split_model(dtype: int) -> onnx.ModelProto:
    """h = x @ w [4, 24] split into a, b, c [4, 8]; a read as heads [4, 2, 4] (a Mul), transposed to [2, 4, 4] and
    flattened to [2, 16] (no strides describe that: a copy); b transposed straight into a graph output; c a graph
    output itself; k = Concat(b, c) (a strided reader); x's own Split (a graph input: copies)."""
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    w = numpy_helper.from_array((np.random.default_rng(1).standard_normal((6, 24)) * 0.3).astype(np_dtype), "w")
    const = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (
        ("parts", [8, 8, 8]), ("heads", [4, 2, 4]), ("flat", [2, 16]), ("halves", [3, 3]))]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("Split", ["h", "parts"], ["a", "b", "c"], axis=-1, name="split"),
             helper.make_node("Reshape", ["a", "heads"], ["a_heads"], name="a_heads"),
             helper.make_node("Mul", ["a_heads", "a_heads"], ["y_sq"]),
             helper.make_node("Transpose", ["a_heads"], ["a_t"], perm=[1, 0, 2], name="a_t"),
             helper.make_node("Reshape", ["a_t", "flat"], ["a_flat"], name="a_flat"),
             helper.make_node("Neg", ["a_flat"], ["y_flat"]),
             helper.make_node("Transpose", ["b"], ["y_bt"], perm=[1, 0], name="b_t"),
             helper.make_node("Identity", ["c"], ["y_c"], name="c_out"),
             helper.make_node("Concat", ["b", "c"], ["y_cat"], axis=0, name="cat"),
             helper.make_node("Split", ["x", "halves"], ["x0", "x1"], axis=1, name="x_split"),
             helper.make_node("Sub", ["x0", "x1"], ["y_x"])]
    outputs = [helper.make_tensor_value_info(n, dtype, None) for n in ("y_sq", "y_flat", "y_bt", "y_c", "y_cat", "y_x")]
    graph = helper.make_graph(nodes, "split_views", [helper.make_tensor_value_info("x", dtype, [4, 6])], outputs,
                              initializer=[w, *const])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.FLOAT16], ids=["fp32", "fp16"])
def test_split_parts_are_views_read_in_place_or_copied_where_they_must_be(dtype):
    x = np.random.default_rng(0).standard_normal((4, 6)).astype(helper.tensor_dtype_to_np_dtype(dtype))
    graph, lowered = _lowered(_split_model(dtype), {"x": x.shape}, LoweringOptions())
    steps = {s.node.name: s for s in lowered.steps}
    assert steps["split"].tactic == "view" and not steps["split"].ops
    assert all(lowered.layouts[p] == "strided" for p in ("a", "b", "c"))
    assert steps["a_heads"].tactic == steps["a_t"].tactic == "view" and lowered.layouts["a_t"] == "strided"
    # [2, 4, 4] at strides (4, 24, 1) has no [2, 16] view: one reformat copy, then the Reshape is a plain view
    assert [s.node.inputs[0] for s in lowered.steps if s.tactic.startswith("reformat")] == ["a_t"]
    assert len(steps["b_t"].ops) == 1  # a graph output: the strided copy out of the packed tensor
    assert len(steps["x_split"].ops) == 2  # x is the caller's buffer: no view at an offset into it
    _emulated_matches_cpu(graph, lowered, {"x": x}, 1e-3 if dtype == TensorProto.FLOAT16 else 1e-6)
