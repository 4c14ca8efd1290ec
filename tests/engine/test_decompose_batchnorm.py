"""decompose_batchnorm: an inference BatchNormalization that no conv absorbed becomes Mul + Add by per-channel
constants (then one PointwiseChain with the ReLU after it); the numbers against onnxruntime on the CPU backend."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import engine_core as kiln
from engine_core.passes import PIPELINE, decompose_batchnorm, fuse_pointwise_chain
from tests.engine.util import build, float_model, ort_run, parsed_graph


def _params(rng: np.random.Generator, c: int) -> dict[str, np.ndarray]:
    return {"s": (1 + 0.3 * rng.standard_normal(c)).astype(np.float32),
            "b": (0.3 * rng.standard_normal(c)).astype(np.float32),
            "m": (0.3 * rng.standard_normal(c)).astype(np.float32),
            "v": (0.5 + rng.random(c)).astype(np.float32)}


def _bn_relu(rng: np.random.Generator, shape: list, **bn_attrs) -> onnx.ModelProto:
    nodes = [helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], name="bn", **bn_attrs),
             helper.make_node("Relu", ["y"], ["r"], name="relu")]
    return float_model(nodes, {"x": shape}, ["r"], _params(rng, 4))


def _matches_ort(model: onnx.ModelProto, x: np.ndarray, **build_args) -> bytes:
    plan = build(model, {"x": (x.shape, x.shape, x.shape)}, **build_args)
    got = kiln.Runtime().load(plan).create_execution_context().infer({"x": x})
    for name, want in zip([o.name for o in model.graph.output], ort_run(model, {"x": x})):
        np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-6, err_msg=name)
    return plan


@pytest.mark.parametrize("shape", [[2, 4, 5, 6], ["batch", 4, "h", "w"], [3, 4, 7], [3, 4]])
def test_batchnorm_becomes_a_per_channel_mul_and_add(shape):
    """Any rank from 2 on (the constants broadcast as [C, 1, ...] over it), also when the input's dims are
    dynamic: the BN's output keeps its name, the ReLU reads it as before."""
    rng = np.random.default_rng(0)
    graph = parsed_graph(_bn_relu(rng, shape))
    assert decompose_batchnorm(graph) == 1
    mul, add, relu = graph.nodes
    assert [n.op_type for n in graph.nodes] == ["Mul", "Add", "Relu"] and mul.inputs[0] == "x"
    assert add.inputs[0] == mul.outputs[0] and add.outputs == ["y"] and relu.inputs == ["y"]
    assert (mul.origin, add.origin, add.name) == ([], ["bn"], "bn")
    a, b = graph.constants[mul.inputs[1]], graph.constants[add.inputs[1]]
    assert a.shape == b.shape == (4,) + (1,) * (len(shape) - 2) and a.dtype == b.dtype == np.float32
    p = _params(np.random.default_rng(0), 4)
    want_a = p["s"].astype(np.float64) / np.sqrt(p["v"].astype(np.float64) + 1e-5)
    np.testing.assert_allclose(a.reshape(-1), want_a, rtol=1e-7)
    np.testing.assert_allclose(b.reshape(-1), p["b"] - p["m"] * want_a, rtol=1e-6, atol=1e-7)
    assert fuse_pointwise_chain(graph) == 1 and [n.op_type for n in graph.nodes] == ["PointwiseChain"]
    dims = [d if isinstance(d, int) else 3 for d in shape]
    _matches_ort(_bn_relu(np.random.default_rng(0), shape), rng.standard_normal(dims).astype(np.float32))


def test_the_constants_take_the_input_type():
    """A float16 BN: a and b are computed in float64 and rounded once to float16."""
    rng = np.random.default_rng(1)
    model = _bn_relu(rng, [2, 4, 3, 3])
    for init in model.graph.initializer:
        init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float16), init.name))
    for value in (*model.graph.input, *model.graph.output):
        value.type.tensor_type.elem_type = TensorProto.FLOAT16
    graph = parsed_graph(model)
    assert decompose_batchnorm(graph) == 1
    assert {graph.constants[n.inputs[1]].dtype for n in graph.nodes[:2]} == {np.dtype(np.float16)}


def test_batchnorms_it_leaves_alone():
    """Training mode; statistics that are graph inputs (not constants); a BN no pointwise layer is next to (its
    output a graph output, or read by a conv: Mul + Add would be one kernel just as the BN is); a BN the conv before
    it absorbs (fold_conv_batchnorm, which runs first, folds it)."""
    rng = np.random.default_rng(2)
    assert decompose_batchnorm(parsed_graph(_bn_relu(rng, [2, 4, 3, 3], training_mode=1))) == 0
    params = _params(rng, 4)
    del params["s"]
    relu = [helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], name="bn"),
            helper.make_node("Relu", ["y"], ["r"], name="relu")]
    assert decompose_batchnorm(parsed_graph(float_model(relu, {"x": [2, 4, 3, 3], "s": [4]}, ["r"], params))) == 0
    assert decompose_batchnorm(parsed_graph(float_model(relu, {"x": [2, 4, 3, 3]}, ["y", "r"], _params(rng, 4)))) == 0
    w = rng.standard_normal((4, 4, 1, 1)).astype(np.float32)
    conv_after = [helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], name="bn"),
                  helper.make_node("Conv", ["y", "w"], ["c"], name="conv")]
    model = float_model(conv_after, {"x": [2, 4, 3, 3]}, ["c"], {"w": w, **_params(rng, 4)})
    assert decompose_batchnorm(parsed_graph(model)) == 0
    conv_before = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
                   helper.make_node("BatchNormalization", ["c", "s", "b", "m", "v"], ["y"], name="bn"),
                   helper.make_node("Relu", ["y"], ["r"], name="relu")]
    graph = parsed_graph(float_model(conv_before, {"x": [2, 4, 5, 5]}, ["r"], {"w": w, **_params(rng, 4)}))
    for graph_pass in PIPELINE:
        graph_pass(graph)
    assert [n.op_type for n in graph.nodes] == ["FusedConv"]


def test_a_pointwise_layer_before_the_batchnorm_also_takes_it_in():
    """Add -> BN (the BN the Add's only reader): the chain is Add, Mul, Add."""
    rng = np.random.default_rng(4)
    nodes = [helper.make_node("Add", ["x", "x"], ["d"], name="double"),
             helper.make_node("BatchNormalization", ["d", "s", "b", "m", "v"], ["y"], name="bn")]
    model = float_model(nodes, {"x": [2, 4, 3, 3]}, ["y"], _params(rng, 4))
    graph = parsed_graph(model)
    assert decompose_batchnorm(graph) == 1 and [n.op_type for n in graph.nodes] == ["Add", "Mul", "Add"]
    _matches_ort(model, rng.standard_normal((2, 4, 3, 3)).astype(np.float32))


def test_optimization_level_0_keeps_the_batchnorm_layer():
    """The pass is a fusion step (it exists for the pointwise chain after it): with fusions off, one layer."""
    rng = np.random.default_rng(3)
    model = _bn_relu(rng, [2, 4, 3, 3])
    builder = kiln.Builder()
    network = builder.create_network()
    assert kiln.OnnxParser(network).parse(model.SerializeToString())
    config = builder.create_builder_config()
    config.backend = "cpu"
    config.builder_optimization_level = 0
    plan = kiln.Runtime().load(kiln.build_plan(network, config)).plan
    assert [layer["type"] for layer in plan.layers] == ["BatchNormalization", "Relu"]
    fused = kiln.Runtime().load(_matches_ort(model, rng.standard_normal((2, 4, 3, 3)).astype(np.float32))).plan
    assert [(layer["type"], layer["origin"]) for layer in fused.layers] == [("PointwiseChain", ["bn", "relu"])]
