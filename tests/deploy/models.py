"""A model whose run time the request chooses, so tests can hold requests in flight for as long as they need."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

SLOW_SIZE = 32
SLOW_CONFIG = 'name: "slow"\nmax_batch_size: 0\ninstance_group [ { count: 2 kind: KIND_CPU } ]\n'


def slow_model(size: int = SLOW_SIZE) -> onnx.ModelProto:
    """Y = sum(tanh(...tanh(expand(X) @ W)...)) with the Loop's trip count N (shape [1]) as an input: time grows with N."""
    body = helper.make_graph(
        [helper.make_node("MatMul", ["acc_in", "W"], ["mm"]), helper.make_node("Tanh", ["mm"], ["acc_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_in", TensorProto.FLOAT, [size, size])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_out", TensorProto.FLOAT, [size, size])])
    weight = helper.make_tensor("W", TensorProto.FLOAT, [size, size], np.eye(size, dtype=np.float32).ravel())
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [size, size])
    scalar = helper.make_tensor("scalar", TensorProto.INT64, [0], [])
    nodes = [helper.make_node("Expand", ["X", "shape"], ["X0"]),
             helper.make_node("Reshape", ["N", "scalar"], ["trips"]),
             helper.make_node("Loop", ["trips", "", "X0"], ["acc"], body=body),
             helper.make_node("ReduceSum", ["acc"], ["Y"], keepdims=0)]
    graph = helper.make_graph(nodes, "slow",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1]),
                               helper.make_tensor_value_info("N", TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [])], [weight, shape, scalar])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def slow_expected(x: float, n: int, size: int = SLOW_SIZE) -> np.float32:
    """What `slow_model` returns, computed independently by onnxruntime."""
    import onnxruntime

    session = onnxruntime.InferenceSession(slow_model(size).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"X": np.array([x], np.float32), "N": np.array([n], np.int64)})[0]


def write_slow_repository(repo: Path) -> Path:
    (repo / "slow" / "1").mkdir(parents=True, exist_ok=True)
    onnx.save(slow_model(), repo / "slow" / "1" / "model.onnx")
    (repo / "slow" / "config.pbtxt").write_text(SLOW_CONFIG)
    return repo
