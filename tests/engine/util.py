"""Helpers for engine tests: build a model with one profile, run a model on onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx

import engine_core as kiln


def parsed_graph(model: onnx.ModelProto):
    """The network graph of ``model`` as the ONNX parser makes it (no passes run)."""
    network = kiln.Builder().create_network()
    assert kiln.OnnxParser(network).parse(model.SerializeToString())
    return network.graph


def build(model: onnx.ModelProto, shapes: dict[str, tuple], backend: str = "cpu") -> bytes:
    """Parse ``model`` and build it with one profile: ``shapes[name] = (min, opt, max)``."""
    builder = kiln.Builder()
    network = builder.create_network()
    parser = kiln.OnnxParser(network)
    assert parser.parse(model.SerializeToString()), [str(e) for e in parser.errors]
    config = builder.create_builder_config()
    config.backend = backend
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in shapes.items():
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    return kiln.build_plan(network, config)


def ort_run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)

