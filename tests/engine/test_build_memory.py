"""A build holds each weight once besides the plan it writes: the passes work on views of the network's weights."""

from __future__ import annotations

import tracemalloc

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import engine_core as kiln
from engine_core.builder import _working_copy
from engine_core.ir import Graph, Node


def _weighty_model(rows: int = 2048, cols: int = 2048) -> tuple[onnx.ModelProto, int]:
    """x[N, rows] @ W[rows, cols] + b: 16 MiB of float32 weights by default."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((rows, cols), dtype=np.float32)
    bias = rng.standard_normal(cols, dtype=np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", rows])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", cols])],
                              [numpy_helper.from_array(weight, "W"), numpy_helper.from_array(bias, "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), weight.nbytes + bias.nbytes


def _config(builder: kiln.Builder, rows: int) -> kiln.BuilderConfig:
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    profile.set_shape("x", (1, rows), (2, rows), (4, rows))
    config.add_optimization_profile(profile)
    return config


def test_build_allocates_the_plan_not_a_second_copy_of_the_weights():
    model, weights = _weighty_model()
    builder = kiln.Builder()
    network = builder.create_network()
    assert kiln.OnnxParser(network).parse(model)
    config = _config(builder, 2048)
    tracemalloc.start()
    try:
        plan = kiln.build_plan(network, config)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(plan) > weights
    assert peak < 1.5 * weights, f"build peak {peak} bytes for {weights} bytes of weights"


def test_working_copy_shares_weights_read_only_and_leaves_the_network_as_it_was():
    graph = Graph()
    writable = np.arange(4, dtype=np.float32)
    graph.constants["c"] = writable
    body = Graph(name="body", constants={"k": np.ones(2, np.float32)})
    graph.nodes.append(Node("If", ["cond"], ["y"], {"then_branch": body, "else_branch": body}))
    copy = _working_copy(graph)
    shared = copy.constants["c"]
    assert np.shares_memory(shared, writable) and not shared.flags.writeable and writable.flags.writeable
    assert np.shares_memory(copy.nodes[0].attrs["then_branch"].constants["k"], body.constants["k"])
    assert copy.nodes[0] is not graph.nodes[0] and copy.constants is not graph.constants
    copy.constants["c"] = shared * 2  # a pass replaces a constant: the network keeps its own
    np.testing.assert_array_equal(graph.constants["c"], np.arange(4, dtype=np.float32))
