"""Helpers for engine tests: build a model with one profile, run a model on onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.helper
import onnx.numpy_helper

import engine_core as kiln


def float_model(nodes: list, inputs: dict[str, list], outputs: list[str], inits: dict[str, np.ndarray],
                opset: int = 17) -> onnx.ModelProto:
    """A model of ``nodes`` with float32 inputs (name -> shape), float32 outputs of any shape and initializers,
    IR version 10 (readable by older onnxruntime builds too: the GPU machine's)."""
    f32 = onnx.TensorProto.FLOAT
    graph = onnx.helper.make_graph(
        nodes, "g", [onnx.helper.make_tensor_value_info(n, f32, s) for n, s in inputs.items()],
        [onnx.helper.make_tensor_value_info(n, f32, None) for n in outputs],
        [onnx.numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])
    model.ir_version = 10
    return model


def parsed_graph(model: onnx.ModelProto):
    """The network graph of ``model`` as the ONNX parser makes it (no passes run)."""
    network = kiln.Builder().create_network()
    assert kiln.OnnxParser(network).parse(model.SerializeToString())
    return network.graph


def assert_same_outputs(before, after, feeds: dict[str, np.ndarray], rtol: float = 0.0, atol: float = 0.0) -> None:
    """The CPU backend computes every output of graph ``before`` on graph ``after`` too: equal with the default
    tolerances (a rewrite that keeps the arithmetic), else within ``rtol`` / ``atol``."""
    from engine_core.interpret import GraphRunner

    want, got = GraphRunner(before).run(feeds), GraphRunner(after).run(feeds)
    assert want.keys() == got.keys()
    for name, value in want.items():
        if rtol or atol:
            np.testing.assert_allclose(got[name], value, rtol=rtol, atol=atol, err_msg=name)
        else:
            np.testing.assert_array_equal(got[name], value, err_msg=name)


def checked_pass(model: onnx.ModelProto, feeds: dict[str, np.ndarray], graph_pass, changes: int,
                 rtol: float = 0.0, atol: float = 0.0):
    """``graph_pass`` run on the parsed ``model``: it makes ``changes`` rewrites and keeps every output
    (``assert_same_outputs``); the graph after it."""
    graph = parsed_graph(model)
    assert graph_pass(graph) == changes
    assert_same_outputs(parsed_graph(model), graph, feeds, rtol, atol)
    return graph


def build(model: onnx.ModelProto, shapes: dict[str, tuple], backend: str = "cpu") -> bytes:
    """Parse ``model`` and build it with one profile: ``shapes[name] = (min, opt, max)``, in strict fp32 (TF32,
    a new config's default, cleared: CUDA builds are compared with fp32 references)."""
    builder = kiln.Builder()
    network = builder.create_network()
    parser = kiln.OnnxParser(network)
    assert parser.parse(model.SerializeToString()), [str(e) for e in parser.errors]
    config = builder.create_builder_config()
    config.backend = backend
    config.clear_flag(kiln.BuilderFlag.TF32)
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in shapes.items():
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    return kiln.build_plan(network, config)


def ort_run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)

