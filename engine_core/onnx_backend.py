"""ONNX backend adapter: Kiln behind ``onnx.backend.base.Backend``, for tools that speak that API.

    import engine_core.onnx_backend as backend
    rep = backend.prepare(model, device="CPU")
    outputs = rep.run([x])            # or backend.run_model(model, [x])

Each input shape seen at run time is built once (a fixed profile) and cached in the rep.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep, Device, DeviceType, namedtupledict

import engine_core as kiln
from engine_core.errors import ParseError


def _backend_for(device: str) -> str:
    kind = Device(device).type
    if kind == DeviceType.CPU:
        return "cpu"
    if kind == DeviceType.CUDA and "cuda" in kiln.available_backends():
        return "cuda"
    raise RuntimeError(f"device {device} is not available to Kiln (backends here: {kiln.available_backends()})")


class KilnBackendRep(BackendRep):
    """A prepared model: parsed once, built per distinct input-shape signature."""

    def __init__(self, network: kiln.NetworkDefinition, backend: str) -> None:
        self.network = network
        self.backend = backend
        self.builder = kiln.Builder()
        self._contexts: dict[tuple, kiln.ExecutionContext] = {}
        self.input_names = [v.name for v in network.graph.inputs]
        self.output_names = [v.name for v in network.graph.outputs]

    def _context(self, feeds: dict[str, Any]) -> kiln.ExecutionContext:
        key = tuple((n, getattr(v, "shape", None)) for n, v in feeds.items())
        if key not in self._contexts:
            config = self.builder.create_builder_config()
            config.backend = self.backend
            config.clear_flag(kiln.BuilderFlag.TF32)  # onnx's backend contract: fp32 results, as onnxruntime's
            profile = self.builder.create_optimization_profile()
            for name, value in feeds.items():
                if isinstance(value, np.ndarray):
                    profile.set_shape(name, value.shape, value.shape, value.shape)
            config.add_optimization_profile(profile)
            plan = kiln.build_plan(self.network, config)
            self._contexts[key] = kiln.Runtime().load(plan).create_execution_context()
        return self._contexts[key]

    def run(self, inputs: Any, **kwargs: Any) -> tuple[Any, ...]:
        if isinstance(inputs, dict):
            feeds = dict(inputs)
        else:
            inputs = [inputs] if isinstance(inputs, np.ndarray) else list(inputs)
            feeds = dict(zip(self.input_names, inputs))
        outputs = self._context(feeds).infer(feeds)
        return namedtupledict("Outputs", self.output_names)(*[outputs[n] for n in self.output_names])


class KilnBackend(Backend):
    @classmethod
    def is_compatible(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> bool:
        network = kiln.Builder().create_network()
        return kiln.OnnxParser(network).parse(model)

    @classmethod
    def prepare(cls, model: onnx.ModelProto | bytes | str, device: str = "CPU", **kwargs: Any) -> KilnBackendRep:
        network = kiln.Builder().create_network()
        parser = kiln.OnnxParser(network)
        ok = parser.parse_from_file(model) if isinstance(model, str) else parser.parse(model)
        if not ok:
            raise ParseError("; ".join(str(e) for e in parser.errors))
        return KilnBackendRep(network, _backend_for(device))

    @classmethod
    def run_model(cls, model: onnx.ModelProto, inputs: Any, device: str = "CPU", **kwargs: Any) -> tuple[Any, ...]:
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(cls, node: onnx.NodeProto, inputs: Sequence[np.ndarray], device: str = "CPU",
                 outputs_info: Any = None, **kwargs: Any) -> tuple[Any, ...]:
        """Run a single node: wrap it in a one-node model with inputs typed from the arrays."""
        from engine_core.types import np_to_onnx

        graph_inputs = [onnx.helper.make_tensor_value_info(name, np_to_onnx(np.asarray(x).dtype), np.shape(x))
                        for name, x in zip(node.input, inputs) if name]
        graph_outputs = [onnx.helper.make_empty_tensor_value_info(name) for name in node.output if name]
        graph = onnx.helper.make_graph([node], "run_node", graph_inputs, graph_outputs)
        opset = kwargs.get("opset_version", onnx.defs.onnx_opset_version())
        model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid(node.domain or "", opset)])
        return cls.run_model(model, [x for name, x in zip(node.input, inputs) if name], device)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        try:
            _backend_for(device)
            return True
        except (RuntimeError, ValueError):
            return False


prepare = KilnBackend.prepare
run_model = KilnBackend.run_model
run_node = KilnBackend.run_node
supports_device = KilnBackend.supports_device
