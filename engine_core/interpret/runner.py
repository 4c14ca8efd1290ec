"""The reference interpreter: runs a graph's layers with the numpy implementations in the op registry.

Constant folding, shape inference (small values), INT8 calibration, the CPU backend and the CUDA backend's host
fallback all run layers through here. It needs the op registry only; importing ``engine_core`` registers every op
(``engine_core.ops``). Ops with bodies (If, Loop, Scan, SequenceMap, fused chains) do not import it back: they are
called with ``interpreter=GraphRunner`` and build their bodies' runners with it.

A graph's layers run in order; every intermediate array is dropped right after its last reader
(liveness computed once per graph), so peak memory stays close to the planner's estimate.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from engine_core.errors import ExecutionError, KilnError
from engine_core.ir import Graph, Node, has_subgraph, subgraph_reads
from engine_core.ops.registry import get_op

#: Called after each layer with (layer name, milliseconds): the IProfiler hook.
LayerTimer = Callable[[str, float], None]


def as_outputs(result: np.ndarray | Sequence[np.ndarray] | None) -> list[np.ndarray]:
    """Normalize an op implementation's return value to a list of outputs."""
    if isinstance(result, (list, tuple)):
        return list(result)
    return [result]


def run_node(node: Node, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
    """Run one node's numpy implementation, returning one array per (declared) output."""
    op = get_op(node.op_type, node.domain)
    if op is None:
        raise ExecutionError(f"layer {node}: no CPU implementation for {node.op_type}")
    result = op.cpu(node, *inputs, interpreter=GraphRunner) if has_subgraph(node) else op.cpu(node, *inputs)
    outputs = as_outputs(result)
    return [o if o is None or isinstance(o, list) else np.asarray(o) for o in outputs]


class GraphRunner:
    """Executes one graph (a plan's main graph, or a Loop/If/Scan body)."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        keep = set(graph.output_names)
        last_use: dict[str, int] = {}
        for index, node in enumerate(graph.nodes):
            for name in (*node.inputs, *subgraph_reads(node)):  # bodies read the enclosing scope too
                last_use[name] = index
        self._free_after: list[list[str]] = [[] for _ in graph.nodes]
        for name, index in last_use.items():
            if name and name not in keep and name not in graph.constants:
                self._free_after[index].append(name)

    def run(
        self,
        feeds: Mapping[str, np.ndarray],
        outer: Mapping[str, np.ndarray] | None = None,
        timer: LayerTimer | None = None,
    ) -> dict[str, np.ndarray]:
        """Run with ``feeds`` for the graph inputs; ``outer`` holds enclosing-scope tensors."""
        env: dict[str, np.ndarray | None] = dict(outer or {})
        env.update(self.graph.constants)
        env.update(feeds)
        env[""] = None
        for index, node in enumerate(self.graph.nodes):
            try:
                args = [env[name] for name in node.inputs]
            except KeyError as e:
                raise ExecutionError(f"layer {node}: input tensor {e} was never computed") from None
            start = time.perf_counter() if timer else 0.0
            try:
                results = run_node(node, args) if not has_subgraph(node) else run_scoped(node, args, env)
            except KilnError as e:
                raise ExecutionError(f"layer {node}: {e}") from e
            except Exception as e:  # numpy errors in user-visible form, naming the layer
                raise ExecutionError(f"layer {node} failed: {type(e).__name__}: {e}") from e
            if timer:
                timer(node.name, (time.perf_counter() - start) * 1e3)
            for name, value in zip(node.outputs, results):
                if name:
                    env[name] = value
            for name in self._free_after[index]:
                env.pop(name, None)
        try:
            return {name: env[name] for name in self.graph.output_names}
        except KeyError as e:
            raise ExecutionError(f"graph output {e} was never computed") from None


def run_scoped(node: Node, args: list, env: Mapping[str, np.ndarray | None]) -> list[np.ndarray]:
    """Ops with bodies see enclosing tensors: they take the environment as a keyword, and the interpreter that
    runs their bodies as another."""
    op = get_op(node.op_type, node.domain)
    assert op is not None
    return as_outputs(op.cpu(node, *args, scope=env, interpreter=GraphRunner))
