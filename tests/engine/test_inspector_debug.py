"""EngineInspector under each ProfilingVerbosity, the CLI's layer dump/profile, debug tensors, error recorders."""

from __future__ import annotations

import ctypes
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import engine_core as kiln
from engine_core.cli import main
from engine_core.error_recorder import ErrorCode, ErrorRecorder
from engine_core.inspector import IDebugListener
from engine_core.types import LayerInformationFormat, ProfilingVerbosity, TensorLocation


def conv_bn_relu(rng: np.random.Generator, batch: int | str = 1) -> onnx.ModelProto:
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.uniform(0.5, 1.5, 4).astype(np.float32), "gamma"),
             numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "beta"),
             numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "mean"),
             numpy_helper.from_array(rng.uniform(0.5, 2, 4).astype(np.float32), "var")]
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"], ["bn"], name="bn"),
             helper.make_node("Relu", ["bn"], ["y"], name="relu")]
    graph = helper.make_graph(nodes, "cbr", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 5, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 4, 5, 5])], inits)
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])


def build(model: onnx.ModelProto, verbosity=ProfilingVerbosity.LAYER_NAMES_ONLY, debug=(), dynamic=False,
          builder: kiln.Builder | None = None, fuse: bool = True) -> bytes | None:
    builder = builder or kiln.Builder()
    network = builder.create_network()
    assert kiln.OnnxParser(network).parse(model)
    for name in debug:
        assert network.mark_debug(name)
    config = builder.create_builder_config()
    config.backend = "cpu"
    config.profiling_verbosity = verbosity
    config.builder_optimization_level = 3 if fuse else 0  # 0: no fusions, one layer per ONNX node
    if dynamic:
        profile = builder.create_optimization_profile()
        profile.set_shape("x", (1, 3, 5, 5), (2, 3, 5, 5), (4, 3, 5, 5))
        config.add_optimization_profile(profile)
    return builder.build_serialized_network(network, config)


def test_inspector_honours_profiling_verbosity(rng):
    model = conv_bn_relu(rng, batch="N")
    engines = {v: kiln.Runtime().load(build(model, v, dynamic=True, fuse=False)) for v in ProfilingVerbosity}
    for verbosity, engine in engines.items():
        assert engine.profiling_verbosity == verbosity
    none = engines[ProfilingVerbosity.NONE].create_engine_inspector()
    assert none.get_layer_information(0, LayerInformationFormat.ONELINE) == ""
    info = json.loads(none.get_engine_information(LayerInformationFormat.JSON))
    assert info["layers"] == [] and info["num_layers"] == 2 and info["io"][0]["name"] == "x"

    names = engines[ProfilingVerbosity.LAYER_NAMES_ONLY].create_engine_inspector()
    assert json.loads(names.get_layer_information(0, LayerInformationFormat.JSON)) == {
        "name": "conv", "type": "Conv", "tactic": "cpu:numpy"}
    assert names.get_engine_information(LayerInformationFormat.ONELINE).splitlines() == [
        "conv [Conv] tactic=cpu:numpy", "relu [Relu] tactic=cpu:numpy"]

    engine = engines[ProfilingVerbosity.DETAILED]
    detailed = engine.create_engine_inspector()
    layer = json.loads(detailed.get_layer_information(0, LayerInformationFormat.JSON))
    assert layer["origin"] == ["conv", "bn"] and layer["output_shapes_opt"] == [[2, 4, 5, 5]]
    assert "output_shapes" not in layer
    context = engine.create_execution_context()
    assert context.set_input_shape("x", (3, 3, 5, 5))
    detailed.execution_context = context
    layer = json.loads(detailed.get_layer_information(1, LayerInformationFormat.JSON))
    assert layer["output_shapes"] == [[3, 4, 5, 5]]
    assert "origin=relu shapes=[[3, 4, 5, 5]]" in detailed.get_layer_information(1, LayerInformationFormat.ONELINE)
    with pytest.raises(IndexError):
        detailed.get_layer_information(2, LayerInformationFormat.JSON)


def test_cli_dump_layer_info_and_profile(tmp_path, capsys, rng):
    model_path, plan_path = tmp_path / "m.onnx", tmp_path / "m.plan"
    onnx.save(conv_bn_relu(rng), model_path)
    assert main(["build", str(model_path), "-o", str(plan_path), "--dump-layer-info",
                 "--profiling-verbosity", "detailed", "--refit"]) == 0
    out = capsys.readouterr().out
    dump = json.loads(out[: out.index("\n}\n") + 2])
    assert dump["profiling_verbosity"] == "DETAILED" and [lay["name"] for lay in dump["layers"]] == ["conv", "bn", "relu"]
    assert dump["layers"][0]["inputs"] == ["x", "W"]  # REFIT: BN not folded into the conv
    assert main(["run", str(plan_path), "--profile", "--iterations", "2"]) == 0
    out = capsys.readouterr().out
    assert "mean ms" in out and all(name in out for name in ("conv", "bn", "relu"))


class Recorder(IDebugListener):
    def __init__(self) -> None:
        self.seen: list[tuple[str, TensorLocation, kiln.DataType, tuple[int, ...], np.ndarray]] = []

    def process_debug_tensor(self, addr, location, type, shape, name, stream):
        nbytes = int(np.prod(shape)) * 4
        value = np.frombuffer((ctypes.c_char * nbytes).from_address(addr), np.float32).reshape(shape).copy()
        self.seen.append((name, location, type, tuple(shape), value))
        return True


def test_debug_tensors_reach_the_listener(rng):
    model = conv_bn_relu(rng)
    x = rng.standard_normal((1, 3, 5, 5)).astype(np.float32)
    engine = kiln.Runtime().load(build(model, debug=["c", "bn"]))
    assert engine.is_debug_tensor("c") and engine.is_debug_tensor("bn") and not engine.is_debug_tensor("y")
    assert [n.op_type for n in engine.plan.graph.nodes] == ["Conv", "BatchNormalization", "Relu"]  # c kept
    with_c = onnx.ModelProto()
    with_c.CopyFrom(model)
    with_c.graph.output.extend([helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("c", "bn")])
    want_y, want_c, want_bn = ort.InferenceSession(with_c.SerializeToString()).run(None, {"x": x})

    context = engine.create_execution_context()
    listener = Recorder()
    assert context.set_debug_listener(listener) and context.get_debug_listener() is listener
    context.infer({"x": x})
    assert listener.seen == []  # debug state is off until switched on
    assert not context.set_tensor_debug_state("y", True)  # not marked at build time
    assert context.set_tensor_debug_state("bn", True) and context.get_debug_state("bn")
    np.testing.assert_allclose(context.infer({"x": x})["y"], want_y, rtol=1e-5, atol=1e-5)
    assert [s[:4] for s in listener.seen] == [("bn", TensorLocation.HOST, kiln.DataType.FLOAT, (1, 4, 5, 5))]
    np.testing.assert_allclose(listener.seen[0][4], want_bn, rtol=1e-5, atol=1e-5)

    listener.seen.clear()
    assert context.set_all_tensors_debug_state(True)
    out = np.empty((1, 4, 5, 5), np.float32)
    context.set_tensor_address("x", x.ctypes.data)
    context.set_tensor_address("y", out.ctypes.data)
    assert context.execute_async_v3(0)
    assert [s[0] for s in listener.seen] == ["c", "bn"]  # in layer order
    np.testing.assert_allclose(listener.seen[0][4], want_c, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out, want_y, rtol=1e-5, atol=1e-5)


def test_mark_debug_checks_the_name(rng):
    network = kiln.Builder().create_network()
    assert kiln.OnnxParser(network).parse(conv_bn_relu(rng))
    assert not network.mark_debug("nope")
    assert network.mark_debug("W") and network.is_debug_tensor("W")
    assert network.unmark_debug("W") and not network.unmark_debug("W")


def test_error_recorders_collect_errors_per_object(rng):
    builder = kiln.Builder(kiln.Logger(kiln.Severity.INTERNAL_ERROR))
    builder.error_recorder = ErrorRecorder()
    assert build(conv_bn_relu(rng, batch="N"), builder=builder) is None  # dynamic without a profile
    assert builder.error_recorder.num_errors() == 1
    assert builder.error_recorder.get_error_code(0) == ErrorCode.INVALID_CONFIG
    assert "dynamic shapes" in builder.error_recorder.get_error_desc(0)

    runtime = kiln.Runtime(kiln.Logger(kiln.Severity.INTERNAL_ERROR))
    runtime.error_recorder = ErrorRecorder(capacity=2)
    assert runtime.deserialize_cuda_engine(b"garbage") is None
    engine = runtime.deserialize_cuda_engine(build(conv_bn_relu(rng)))
    context = engine.create_execution_context()
    assert engine.error_recorder is runtime.error_recorder and context.error_recorder is runtime.error_recorder
    assert not context.set_input_shape("x", (2, 3, 5, 5))
    assert not context.set_tensor_address("nope", 0)  # third error: over capacity
    recorder = runtime.error_recorder
    assert recorder.num_errors() == 2 and recorder.has_overflowed()
    assert [recorder.get_error_code(i) for i in range(2)] == [ErrorCode.INVALID_ARGUMENT] * 2
    assert "not a Kiln plan" in recorder.get_error_desc(0) and "outside optimization profile" in recorder.get_error_desc(1)
    own = ErrorRecorder()
    context.error_recorder = own  # a context's own recorder takes over from the engine's
    assert not context.execute_async_v3(0)
    assert own.get_error_code(0) == ErrorCode.FAILED_EXECUTION and recorder.num_errors() == 2
    recorder.clear()
    assert recorder.num_errors() == 0 and not recorder.has_overflowed()


class LayerTimes(kiln.IProfiler):
    def __init__(self) -> None:
        self.layers: list[str] = []

    def report_layer_time(self, layer_name: str, ms: float) -> None:
        assert ms >= 0
        self.layers.append(layer_name)


def test_profiler_immediate_and_deferred(rng):
    context = kiln.Runtime().load(build(conv_bn_relu(rng))).create_execution_context()
    x = rng.standard_normal((1, 3, 5, 5)).astype(np.float32)
    assert not context.report_to_profiler()  # no profiler attached
    context.profiler = profiler = LayerTimes()
    context.infer({"x": x})
    assert profiler.layers == ["conv"]  # BN folded into the conv, the ReLU fused with it
    context.enqueue_emits_profile = False
    context.infer({"x": x})
    context.infer({"x": x})
    assert profiler.layers == ["conv"]
    assert context.report_to_profiler()
    assert profiler.layers == ["conv"] * 2  # only the latest run's times
    assert context.report_to_profiler() and len(profiler.layers) == 2


def test_profiler_for_backends_taking_a_profiler_object(rng):
    from engine_core.inspector import profiler_for

    context = kiln.Runtime().load(build(conv_bn_relu(rng))).create_execution_context()
    assert profiler_for(context) is None
    context.profiler = profiler = LayerTimes()
    assert profiler_for(context) is profiler
    context.enqueue_emits_profile = False
    stand_in = profiler_for(context)
    stand_in.report_layer_time("conv", 0.5)
    assert profiler.layers == [] and context.report_to_profiler() and profiler.layers == ["conv"]
