"""Plugins: a Python custom op for a custom ONNX domain, through parser, build, plan and runtime."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

import engine_core as kiln
from engine_core.errors import PlanFormatError
from engine_core.ops.registry import TensorInfo, get_op, register_op
from engine_core.plugins import PluginDef, get_plugin_registry, register_plugin
from examples.plugins import scaled_swish


class ScaledSwish(OpRun):  # onnx.reference finds custom ops by class name
    """The same op for onnx's reference evaluator, in float64 then rounded: the independent answer."""

    op_domain = scaled_swish.DOMAIN

    def _run(self, x, beta=1.0, scale=1.0):
        x64 = x.astype(np.float64)
        return ((scale * x64 / (1.0 + np.exp(-beta * x64))).astype(x.dtype),)


def swish_model(beta: float = 1.5, scale: float = 2.0) -> onnx.ModelProto:
    nodes = [
        helper.make_node("Add", ["x", "x"], ["twice"], name="double"),
        helper.make_node("ScaledSwish", ["twice"], ["s"], name="swish", domain=scaled_swish.DOMAIN,
                         beta=beta, scale=scale),
        helper.make_node("Neg", ["s"], ["y"], name="neg"),
    ]
    graph = helper.make_graph(nodes, "plugin_net", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 4])])
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid(scaled_swish.DOMAIN, 1)])


def build_plan(model: onnx.ModelProto) -> bytes:
    builder = kiln.Builder()
    network = builder.create_network()
    parser = kiln.OnnxParser(network)
    assert parser.parse(model), parser.errors
    config = builder.create_builder_config()
    config.backend = "cpu"
    return kiln.build_plan(network, config)


def test_plugin_runs_like_the_reference_and_is_recorded_in_the_plan(rng):
    x = (rng.standard_normal((2, 3, 4)) * 4).astype(np.float32)
    plan = build_plan(swish_model())
    engine = kiln.Runtime().load(plan)
    assert engine.plan.build_info["plugins"] == [{"name": "ScaledSwish", "version": "1", "domain": "com.example.kiln"}]
    got = engine.create_execution_context().infer({"x": x})["y"]
    want = ReferenceEvaluator(swish_model(), new_ops=[ScaledSwish]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)
    assert kiln.Runtime().get_plugin_registry().get_plugin("ScaledSwish", "1") is scaled_swish.PLUGIN


def test_plugin_shape_function_is_used_at_build_time():
    model = swish_model()
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.INT32
    model.graph.node[0].op_type = "Add"
    builder = kiln.Builder()
    network = builder.create_network()
    assert kiln.OnnxParser(network).parse(model)
    config = builder.create_builder_config()
    config.backend = "cpu"
    with pytest.raises(kiln.BuildError, match="ScaledSwish takes a floating-point tensor"):
        kiln.build_plan(network, config)


def test_plan_load_refuses_missing_or_other_version_plugin(monkeypatch):
    plan = build_plan(swish_model())
    plugins = get_plugin_registry()._plugins
    key = scaled_swish.PLUGIN.key
    monkeypatch.setitem(plugins, key, dataclasses.replace(scaled_swish.PLUGIN, version="2"))
    with pytest.raises(PlanFormatError, match="registered at version 2, the plan needs version 1"):
        kiln.Runtime().load(plan)
    monkeypatch.delitem(plugins, key)
    with pytest.raises(PlanFormatError, match="com.example.kiln::ScaledSwish version 1 is not registered"):
        kiln.Runtime().load(plan)
    assert kiln.Runtime().deserialize_cuda_engine(plan) is None


def test_registry_rules():
    registry = get_plugin_registry()
    registry.register(scaled_swish.PLUGIN)  # the same definition again: a no-op
    other = dataclasses.replace(scaled_swish.PLUGIN, version="9")
    with pytest.raises(ValueError, match="already registered"):
        registry.register(other)
    with pytest.raises(ValueError, match="own domain"):
        register_plugin("Relu2", "1", "", scaled_swish.infer, scaled_swish.cpu)
    with pytest.raises(ValueError, match="own domain"):  # standard ops cannot be shadowed
        registry.register(PluginDef("Relu", "1", "ai.onnx.ml", scaled_swish.infer, scaled_swish.cpu))
    if get_op("Direct", "test.kiln.direct") is None:  # an op registered without the plugin API
        register_op("Direct", infer=scaled_swish.infer, cpu=scaled_swish.cpu, domain="test.kiln.direct")
    with pytest.raises(ValueError, match="already registered"):
        registry.register(PluginDef("Direct", "1", "test.kiln.direct", scaled_swish.infer, scaled_swish.cpu))
    op = get_op("ScaledSwish", scaled_swish.DOMAIN)
    assert op is not None and op.infer(None, TensorInfo(np.float16, (3,))).shape == (3,)


def test_cuda_source_compiles_with_nvrtc():
    pytest.importorskip("cuda.bindings.nvrtc")
    try:
        cubin = scaled_swish.PLUGIN.compile_cuda("sm_90")
    except (ImportError, RuntimeError, OSError) as e:  # no usable NVRTC library on this machine
        pytest.skip(f"NVRTC unavailable: {e}")
    assert cubin[:4] == b"\x7fELF"


@pytest.mark.gpu
@pytest.mark.skipif("cuda" not in kiln.available_backends(), reason="needs the CUDA backend")
def test_plugin_in_a_cuda_build(rng):
    x = (rng.standard_normal((2, 3, 4)) * 4).astype(np.float32)
    builder = kiln.Builder()
    network = builder.create_network()
    assert kiln.OnnxParser(network).parse(swish_model())
    config = builder.create_builder_config()
    config.backend = "cuda"
    config.clear_flag(kiln.BuilderFlag.TF32)  # strict fp32: compared with the reference at rtol 1e-5
    engine = kiln.Runtime().load(kiln.build_plan(network, config))
    assert engine.plan.kernels["plugin:com.example.kiln::ScaledSwish"][:4] == b"\x7fELF"
    got = engine.create_execution_context().infer({"x": x})["y"]
    want = ReferenceEvaluator(swish_model(), new_ops=[ScaledSwish]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
