"""ConstantOfShape on the CUDA backend: a fill launch, not a host layer (checked by emulating the launches)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tests.cuda.test_backend_cpu import _emulate_vs_ort


def _full_like_model(value: onnx.TensorProto, dtype: int) -> onnx.ModelProto:
    """y = Min(x, full_like(x, value)): torch.full_like as exported (ConstantOfShape of Shape(x)), as T5's
    relative-position buckets use it. The tests' 64 x 80 fill is over shape inference's VALUE_LIMIT, so its value
    is not folded at build time and the layer is lowered."""
    nodes = [helper.make_node("Shape", ["x"], ["shape"]),
             helper.make_node("ConstantOfShape", ["shape"], ["fill"], value=value),
             helper.make_node("Min", ["x", "fill"], ["y"])]
    graph = helper.make_graph(nodes, "full_like", [helper.make_tensor_value_info("x", dtype, ["b", 80])],
                              [helper.make_tensor_value_info("y", dtype, ["b", 80])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("dtype, value", [
    (TensorProto.INT64, helper.make_tensor("v", TensorProto.INT64, [1], [15])),
    (TensorProto.FLOAT, helper.make_tensor("v", TensorProto.FLOAT, [1], [0.25])),
])
def test_constant_of_shape_lowers_to_a_fill_and_matches_onnxruntime(dtype, value):
    rng = np.random.default_rng(3)
    x = (rng.integers(0, 30, (64, 80)) if dtype == TensorProto.INT64 else rng.standard_normal((64, 80)))
    x = x.astype(np.int64 if dtype == TensorProto.INT64 else np.float32)
    lowered = _emulate_vs_ort(_full_like_model(value, dtype), {"x": x})
    tactics = lowered.tactics()
    assert "host" not in tactics.values(), tactics
    assert any(step.node.op_type == "ConstantOfShape" for step in lowered.steps)
