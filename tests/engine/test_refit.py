"""Refit: BuilderFlag.REFIT keeps named weights unfolded; Refitter swaps them as a rebuild would."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import engine_core as kiln
from engine_core.error_recorder import ErrorCode, ErrorRecorder
from engine_core.refit import Refitter


def _weights(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "W": rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
        "B": rng.standard_normal(4).astype(np.float32),
        "gamma": rng.uniform(0.5, 1.5, 4).astype(np.float32),
        "beta": rng.standard_normal(4).astype(np.float32),
        "mean": rng.standard_normal(4).astype(np.float32),
        "var": rng.uniform(0.5, 2.0, 4).astype(np.float32),
    }


def conv_bn_model(weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    """Conv -> BatchNormalization -> Relu -> Reshape(shape initializer) -> Mul by a constant scale."""
    nodes = [
        helper.make_node("Conv", ["x", "W", "B"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"], ["bn"], name="bn"),
        helper.make_node("Relu", ["bn"], ["r"], name="relu"),
        helper.make_node("Reshape", ["r", "shape"], ["flat"], name="flatten"),
        helper.make_node("Mul", ["flat", "scale"], ["y"], name="scale_mul"),
    ]
    inits = [numpy_helper.from_array(v, k) for k, v in weights.items()]
    inits += [numpy_helper.from_array(np.array([1, -1], np.int64), "shape"),
              numpy_helper.from_array(np.array(0.5, np.float32), "scale")]
    graph = helper.make_graph(nodes, "conv_bn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 5, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])


def build(model: onnx.ModelProto, refit: bool) -> kiln.CudaEngine:
    builder = kiln.Builder()
    network = builder.create_network()
    assert kiln.OnnxParser(network).parse(model)
    config = builder.create_builder_config()
    config.backend = "cpu"
    if refit:
        config.set_flag(kiln.BuilderFlag.REFIT)
    return kiln.Runtime().load(kiln.build_plan(network, config))


@pytest.fixture
def x(rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal((1, 3, 5, 5)).astype(np.float32)


def test_refit_flag_keeps_initializers_unfolded(rng, x):
    model = conv_bn_model(_weights(rng))
    plain, refittable = build(model, refit=False), build(model, refit=True)
    assert not plain.refittable and refittable.refittable
    assert plain.plan.build_info["passes"]["fold_conv_batchnorm"] == 1
    assert refittable.plan.build_info["passes"]["fold_conv_batchnorm"] == 0
    assert [n.op_type for n in refittable.plan.graph.nodes] == ["Conv", "BatchNormalization", "Relu", "Reshape", "Mul"]
    # the int64 shape initializer is no weight: not refittable
    assert Refitter(refittable).get_all_weights() == ["B", "W", "beta", "gamma", "mean", "scale", "var"]
    want = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_allclose(refittable.create_execution_context().infer({"x": x})["y"], want, rtol=1e-5, atol=1e-5)


def test_refit_matches_a_rebuild_with_the_new_weights(rng, x):
    old, new = _weights(rng), _weights(rng)
    engine = build(conv_bn_model(old), refit=True)
    context = engine.create_execution_context()  # exists before the refit: sees the new weights after it
    before = context.infer({"x": x})["y"]
    refitter = Refitter(engine, kiln.Logger())
    for name in ("W", "gamma", "var"):
        assert refitter.set_named_weights(name, new[name])
    partial = {**old, **{k: new[k] for k in ("W", "gamma", "var")}}
    assert refitter.get_missing_weights() == []
    assert refitter.refit_cuda_engine()
    rebuilt = build(conv_bn_model(partial), refit=True).create_execution_context().infer({"x": x})["y"]
    got = context.infer({"x": x})["y"]
    np.testing.assert_array_equal(got, rebuilt)
    assert not np.array_equal(got, before)
    want = ort.InferenceSession(conv_bn_model(partial).SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # the serialized engine carries the refit weights
    reloaded = kiln.Runtime().load(engine.serialize()).create_execution_context()
    np.testing.assert_array_equal(reloaded.infer({"x": x})["y"], rebuilt)


def test_refitter_rejects_bad_weights_and_records_errors(rng):
    engine = build(conv_bn_model(_weights(rng)), refit=True)
    recorder = ErrorRecorder()
    engine.error_recorder = recorder
    refitter = Refitter(engine)
    assert not refitter.set_named_weights("shape", np.array([1, -1]))  # int shape input: not a weight
    assert not refitter.set_named_weights("W", np.zeros((4, 3, 3), np.float32))  # wrong count
    assert refitter.set_named_weights("B", np.arange(4, dtype=np.float64))  # same count, cast to float32
    assert refitter.get_named_weights("B").dtype == np.float32
    assert recorder.num_errors() == 2
    assert recorder.get_error_code(0) == ErrorCode.INVALID_ARGUMENT and "'shape'" in recorder.get_error_desc(0)
    assert "36" in recorder.get_error_desc(1)


def test_refitter_refuses_engine_built_without_refit(rng):
    with pytest.raises(ValueError, match="REFIT"):
        Refitter(build(conv_bn_model(_weights(rng)), refit=False))


@pytest.mark.gpu
@pytest.mark.skipif("cuda" not in kiln.available_backends(), reason="needs the CUDA backend")
def test_refit_on_the_cuda_backend_updates_existing_contexts(rng, x):
    old, new = _weights(rng), _weights(rng)
    builder = kiln.Builder()
    network = builder.create_network()
    assert kiln.OnnxParser(network).parse(conv_bn_model(old))
    config = builder.create_builder_config()
    config.backend = "cuda"
    config.clear_flag(kiln.BuilderFlag.TF32)  # strict fp32: compared with onnxruntime at rtol 1e-4
    config.set_flag(kiln.BuilderFlag.REFIT)
    engine = kiln.Runtime().load(kiln.build_plan(network, config))
    context = engine.create_execution_context()
    context.infer({"x": x})  # binds (and may capture a CUDA graph) before the refit
    refitter = Refitter(engine)
    for name, value in new.items():
        assert refitter.set_named_weights(name, value)
    assert refitter.refit_cuda_engine()
    want = ort.InferenceSession(conv_bn_model(new).SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_allclose(context.infer({"x": x})["y"], want, rtol=1e-4, atol=1e-5)
    fresh = kiln.Runtime().load(engine.serialize()).create_execution_context()
    np.testing.assert_allclose(fresh.infer({"x": x})["y"], want, rtol=1e-4, atol=1e-5)


def test_constant_folds_of_weights_are_skipped_and_refit(rng):
    """MatMul(x, Transpose(Wt)): without REFIT the transpose is folded into a new constant."""
    wt = rng.standard_normal((3, 4)).astype(np.float32)
    nodes = [helper.make_node("Transpose", ["Wt"], ["W"], name="t"), helper.make_node("MatMul", ["x", "W"], ["y"])]
    graph = helper.make_graph(nodes, "mm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
                              [numpy_helper.from_array(wt, "Wt")])
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])
    assert build(model, refit=False).plan.build_info["passes"]["fold_constants"] == 1
    engine = build(model, refit=True)
    assert engine.plan.build_info["passes"]["fold_constants"] == 0
    x = rng.standard_normal((2, 4)).astype(np.float32)
    new = rng.standard_normal((3, 4)).astype(np.float32)
    refitter = Refitter(engine)
    assert refitter.get_all_weights() == ["Wt"]
    assert refitter.set_named_weights("Wt", new) and refitter.refit_cuda_engine()
    np.testing.assert_array_equal(engine.create_execution_context().infer({"x": x})["y"], x @ new.T)
