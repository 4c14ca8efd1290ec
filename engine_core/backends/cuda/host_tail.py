"""The host tail of a CUDA plan: the layers from the first data-dependent ones on, run with numpy after the device part.

Why: a layer whose output size depends on tensor data (NonMaxSuppression, NonZero, Unique, Compress, a TopK whose K is
computed, ...) cannot be planned before it runs, and neither can any layer that reads its output. One such layer used to
send the whole graph to the host: a YOLO-style detector ran its convolutions in numpy (0.04x torch.compile on an H100).
Now the graph is cut at these shapes: every layer with an output of unknown shape, and every layer that reads (directly,
or from a body) what such a layer wrote, is the tail; the rest is the device part, lowered as a graph of its own whose
outputs are the graph outputs it computes and the boundary tensors the tail reads. The runner runs the device part (a
CUDA graph like any other plan's), brings the boundary tensors to the host with one copy each, and runs the tail with
the reference interpreter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from engine_core.backends.cuda.pointwise import Unsupported
from engine_core.interpret import GraphRunner
from engine_core.ir import Graph, Node, Value, subgraph_reads
from engine_core.ops import TensorInfo

#: ops whose output sizes depend on tensor data (not only on shapes or shape values): the build cuts a plan at these
#: without input values; any other layer whose output shape is unknown may be waiting for an input's value (a Reshape
#: to a fed shape), which the runner supplies before it cuts there
DATA_DEPENDENT_OPS = frozenset({"NonZero", "NonMaxSuppression", "Unique", "Compress", "Loop", "If", "Scan"})


@dataclass(frozen=True)
class HostTail:
    """One cut of a graph: the device part and the host tail, both as graphs over the original's tensors."""

    #: every layer the tail does not need: the graph's inputs; outputs are the graph outputs it computes, then the
    #: boundary tensors (``boundary``)
    device: Graph
    #: the tail's layers in graph order; inputs are what they read from the device part and the graph inputs, outputs
    #: the graph outputs they compute
    graph: Graph
    #: values known on the host at these shapes (folded shape computations) that the tail reads
    known: Mapping[str, np.ndarray] = field(default_factory=dict)
    #: why the cut is there (the first data-dependent layers)
    reason: str = ""

    @property
    def layers(self) -> list[str]:
        """Names of the tail's layers (the plan's "host" layers)."""
        return [node.name for node in self.graph.nodes]

    @cached_property
    def written(self) -> frozenset[str]:
        """Every tensor the tail's layers write (none of them exists on the device)."""
        return frozenset(o for node in self.graph.nodes for o in node.outputs if o)

    @cached_property
    def boundary(self) -> list[str]:
        """Tensors the device part computes for the tail (each copied to the host once a run)."""
        device = set(self.device.output_names)
        return [name for name in self.graph.input_names if name in device]

    @cached_property
    def graph_inputs(self) -> list[str]:
        """Graph inputs the tail reads itself."""
        inputs = set(self.device.input_names)
        return [name for name in self.graph.input_names if name in inputs]

    @cached_property
    def _runner(self) -> GraphRunner:
        return GraphRunner(self.graph)

    def run(self, values: Mapping[str, np.ndarray],
            timer: Callable[[str, float], None] | None = None) -> dict[str, np.ndarray]:
        """The tail's graph outputs from ``values`` of its inputs (``timer(layer, ms)`` per layer, if given)."""
        return self._runner.run({**self.known, **values}, timer=timer)

    def info(self) -> dict[str, object]:
        """What a plan's build info records of the cut."""
        return {"layers": self.layers, "boundary": self.boundary, "reason": self.reason}


def split_host_tail(graph: Graph, infos: Mapping[str, TensorInfo], values_given: bool = False) -> HostTail | None:
    """The cut of ``graph`` at ``infos`` (shape inference at one set of input shapes), or None when every tensor's
    shape is known. ``values_given``: the inputs' values were part of the inference, so a shape still unknown depends
    on data and the cut may start at any layer; otherwise only at ``DATA_DEPENDENT_OPS``, and an unknown shape
    elsewhere raises Unsupported (the caller binds again with input values)."""
    def unknown(name: str) -> bool:
        info = infos.get(name)
        return info is None or info.shape is None

    firsts: list[Node] = []

    def starts_tail(node: Node) -> bool:
        missing = [o for o in node.outputs if o and unknown(o)]
        if missing and not values_given and node.op_type not in DATA_DEPENDENT_OPS:
            raise Unsupported(f"the shape of '{missing[0]}' ({node.op_type} '{node.name}') depends on input values")
        if missing:
            firsts.append(node)
        return bool(missing)

    tail = downstream(graph, starts_tail)
    if not tail:
        return None
    return _cut(graph, infos, tail, "data-dependent output shapes from " + ", ".join(
        f"{n.op_type} '{n.name}'" for n in firsts) + " on")


def downstream(graph: Graph, starts: Callable[[Node], bool]) -> list[Node]:
    """The layers (graph order) for which ``starts`` holds, and every layer that reads what one of them wrote."""
    tail: list[Node] = []
    written: set[str] = set()
    for node in graph.nodes:
        if any(name in written for name in _reads(node)) or starts(node):
            tail.append(node)
            written.update(o for o in node.outputs if o)
    return tail


def data_dependent_layers(graph: Graph) -> list[Node]:
    """The layers a cut at ``DATA_DEPENDENT_OPS`` would put on the host, known from the graph alone (for builds
    whose lowering waits for input values)."""
    return downstream(graph, lambda node: node.op_type in DATA_DEPENDENT_OPS)


def _reads(node: Node) -> Iterable[str]:
    return (*node.inputs, *subgraph_reads(node))


def _cut(graph: Graph, infos: Mapping[str, TensorInfo], tail: list[Node], reason: str) -> HostTail:
    in_tail = {id(node) for node in tail}
    device_nodes = [node for node in graph.nodes if id(node) not in in_tail]
    written_by_tail = {o for node in tail for o in node.outputs if o}
    reads = [name for name in dict.fromkeys(r for node in tail for r in _reads(node))
             if name and name not in written_by_tail and name not in graph.constants]
    known = {name: infos[name].value for name in reads
             if name not in graph.input_names and infos.get(name) is not None and infos[name].value is not None}
    fed = [name for name in reads if name not in known]

    def value(name: str) -> Value:
        info = infos[name]
        return Value(name, np.dtype(info.dtype), info.shape)

    outputs = [v for v in graph.outputs if v.name not in written_by_tail]
    listed = {v.name for v in outputs} | set(graph.input_names)
    outputs += [value(name) for name in fed if name not in listed]
    device = Graph(name=graph.name, inputs=list(graph.inputs), outputs=outputs, nodes=device_nodes,
                   constants=graph.constants, opsets=graph.opsets)
    inputs = {v.name: v for v in graph.inputs}
    host = Graph(name=f"{graph.name}#host_tail", inputs=[inputs.get(name) or value(name) for name in fed],
                 outputs=[v for v in graph.outputs if v.name in written_by_tail], nodes=tail,
                 constants=graph.constants, opsets=graph.opsets)
    return HostTail(device, host, known, reason)
