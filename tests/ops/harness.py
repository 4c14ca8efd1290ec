"""Shared harness of the one-node op tests: one ``Case`` builds the model and its feeds, ``run_kiln``
runs it through the public API (with build-time shape inference), ``run_reference`` through
onnxruntime or onnx's ReferenceEvaluator. Each test file keeps its own ``check``, since what may be
compared and how closely differs by op family.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import engine_core as kiln
from engine_core.ops import TensorInfo
from engine_core.passes import infer_shapes
from engine_core.types import np_to_onnx


@dataclass
class Case:
    """One node: ``inputs`` in order (None = omitted optional input); ``consts`` are the positions
    given as initializers (their values known when the plan is built); ``outputs`` is a count
    (named out0, out1, ...) or the node's output names ("" = omitted optional output).

    ``rtol``/``atol`` (None: the file's default), ``approx`` and ``shape_known`` are read only by the
    test files' own ``check`` functions."""

    op: str
    inputs: list[np.ndarray | None]
    attrs: dict[str, Any] = field(default_factory=dict)
    opset: int = 21
    outputs: int | tuple[str, ...] = 1
    reference: str = "ort"  # or "onnx" (ReferenceEvaluator) where onnxruntime lacks the op/opset/dtype/semantics
    consts: tuple[int, ...] = ()
    rtol: float | None = None
    atol: float | None = None
    #: Compare within the file's per-dtype tolerance instead of exactly.
    approx: bool = False
    #: False when the output shape depends on a runtime input value (inference may say None).
    shape_known: bool = True

    def output_names(self) -> list[str]:
        return [f"out{i}" for i in range(self.outputs)] if isinstance(self.outputs, int) else list(self.outputs)

    def model(self) -> onnx.ModelProto:
        names = [f"in{i}" if x is not None else "" for i, x in enumerate(self.inputs)]
        while names and names[-1] == "":
            names.pop()
        node = helper.make_node(self.op, names, self.output_names(), **self.attrs)
        graph_inputs = [helper.make_tensor_value_info(n, np_to_onnx(x.dtype), x.shape)
                        for i, (n, x) in enumerate(zip(names, self.inputs)) if n and i not in self.consts]
        inits = [numpy_helper.from_array(self.inputs[i], names[i]) for i in self.consts]
        outputs = [helper.make_empty_tensor_value_info(n) for n in self.output_names() if n]
        graph = helper.make_graph([node], self.op.lower(), graph_inputs, outputs, initializer=inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)], ir_version=10)

    def feeds(self) -> dict[str, np.ndarray]:
        return {f"in{i}": x for i, x in enumerate(self.inputs) if x is not None and i not in self.consts}


def parse(model: onnx.ModelProto) -> kiln.NetworkDefinition:
    """The parsed network; a parse failure fails the test with the parser's errors."""
    network = kiln.Builder().create_network()
    parser = kiln.OnnxParser(network)
    assert parser.parse(model), [str(e) for e in parser.errors]
    return network


def build(model: onnx.ModelProto) -> tuple[kiln.NetworkDefinition, bytes]:
    """The parsed network and its plan, built with the default config."""
    network = parse(model)
    return network, kiln.build_plan(network, kiln.Builder().create_builder_config())


def run_kiln(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> tuple[list[np.ndarray], list[TensorInfo]]:
    """Outputs through the public API, plus what build-time shape inference said of each."""
    network, plan = build(model)
    outputs = kiln.Runtime().load(plan).create_execution_context().infer(feeds)
    infos = infer_shapes(network.graph, {v.name: TensorInfo(v.dtype, v.shape) for v in network.graph.inputs})
    names = [v.name for v in network.graph.outputs]
    return [outputs[n] for n in names], [infos[n] for n in names]


def run_reference(model: onnx.ModelProto, feeds: dict[str, np.ndarray], reference: str = "ort") -> list[np.ndarray]:
    """The reference's outputs: onnxruntime on CPU, or onnx's ReferenceEvaluator for "onnx"."""
    if reference == "onnx":
        with warnings.catch_warnings():  # the reference's own numpy warnings (empty means, ...)
            warnings.simplefilter("ignore", RuntimeWarning)
            return [np.asarray(v) for v in ReferenceEvaluator(model).run(None, feeds)]
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return [np.asarray(v) for v in session.run(None, feeds)]


def run_case(case: Case) -> tuple[list[np.ndarray], list[np.ndarray], list[TensorInfo]]:
    """The reference's outputs, Kiln's, and Kiln's build-time inference of them."""
    model = case.model()
    expected = run_reference(model, case.feeds(), case.reference)
    actual, infos = run_kiln(model, case.feeds())
    return expected, actual, infos


def i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


class Arrays:
    """Random array makers drawing from one file's own generator, so each file's data stay the same
    whichever other test files run."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng

    def f32(self, *shape: int, scale: float = 1.0) -> np.ndarray:
        return (self.rng.standard_normal(shape) * scale).astype(np.float32)

    def u8(self, *shape: int) -> np.ndarray:
        return self.rng.integers(0, 256, shape).astype(np.uint8)
