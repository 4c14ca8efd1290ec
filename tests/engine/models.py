"""Small ONNX models built with onnx.helper for the engine tests (deterministic weights)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def _init(rng: np.random.Generator, name: str, shape: tuple[int, ...], scale: float = 0.2) -> onnx.TensorProto:
    return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)


def mlp(opset: int = 17) -> onnx.ModelProto:
    """x[N,16] -> Gemm -> Relu -> MatMul + Add -> Softmax -> y[N,4]."""
    rng = np.random.default_rng(1)
    nodes = [
        helper.make_node("Gemm", ["x", "W1", "b1"], ["h1"], transB=1),
        helper.make_node("Relu", ["h1"], ["h2"]),
        helper.make_node("MatMul", ["h2", "W2"], ["h3"]),
        helper.make_node("Add", ["h3", "b2"], ["h4"]),
        helper.make_node("Softmax", ["h4"], ["y"], axis=-1),
    ]
    inits = [_init(rng, "W1", (32, 16)), _init(rng, "b1", (32,)), _init(rng, "W2", (32, 4)), _init(rng, "b2", (4,))]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def small_cnn(opset: int = 17) -> onnx.ModelProto:
    """x[N,3,16,16] -> Conv+BN+Relu -> MaxPool -> Conv+Relu -> GlobalAveragePool -> Flatten -> Gemm -> y[N,10]."""
    rng = np.random.default_rng(2)
    nodes = [
        helper.make_node("Conv", ["x", "c1w", "c1b"], ["c1"], pads=[1, 1, 1, 1], kernel_shape=[3, 3]),
        helper.make_node("BatchNormalization", ["c1", "bn_s", "bn_b", "bn_m", "bn_v"], ["bn"], epsilon=1e-5),
        helper.make_node("Relu", ["bn"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "c2w"], ["c2"], pads=[1, 1, 1, 1], kernel_shape=[3, 3], strides=[1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("GlobalAveragePool", ["r2"], ["gap"]),
        helper.make_node("Flatten", ["gap"], ["flat"], axis=1),
        helper.make_node("Gemm", ["flat", "fcw", "fcb"], ["y"], transB=1),
    ]
    inits = [
        _init(rng, "c1w", (8, 3, 3, 3)), _init(rng, "c1b", (8,)),
        numpy_helper.from_array((1 + 0.1 * rng.standard_normal(8)).astype(np.float32), "bn_s"),
        _init(rng, "bn_b", (8,)), _init(rng, "bn_m", (8,)),
        numpy_helper.from_array((0.5 + rng.random(8)).astype(np.float32), "bn_v"),
        _init(rng, "c2w", (16, 8, 3, 3)), _init(rng, "fcw", (10, 16)), _init(rng, "fcb", (10,)),
    ]
    graph = helper.make_graph(nodes, "small_cnn",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 10])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def add_sub() -> onnx.ModelProto:
    """Two inputs a, b [N,4] -> sum, diff: the smallest two-input model."""
    nodes = [helper.make_node("Add", ["a", "b"], ["sum"]), helper.make_node("Sub", ["a", "b"], ["diff"])]
    io = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", 4])  # noqa: E731
    graph = helper.make_graph(nodes, "add_sub", [io("a"), io("b")], [io("sum"), io("diff")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
