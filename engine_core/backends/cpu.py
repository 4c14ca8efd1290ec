"""CPU backend: a plan runs on the host through the reference interpreter (engine_core.interpret).

A "cpu" plan is the graph after the passes, with no lowering step: compiling adds nothing to the plan, and the
runtime executes it with the interpreter over that graph (`plan_runner`). The interpreter itself sits below the
passes, which run it too (constant folding, shape inference's small values), as do calibration and the CUDA
backend's host fallback. Tensor "addresses" here are host pointers (``array.ctypes.data``) and execution is
synchronous. ``CpuBackend`` is this backend behind the interface of ``engine_core.backends.base``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import numpy as np

from engine_core.backends.base import BackendBuild, Inferred, RunningContext
from engine_core.batching import Span, gather_rows, split_outputs
from engine_core.builder_config import BuilderConfig
from engine_core.cuda.view import DeviceRows, DeviceView
from engine_core.errors import ExecutionError, ShapeError
from engine_core.inspector import run_with_debug
from engine_core.interpret import GraphRunner
from engine_core.ir import Graph
from engine_core.plan import Plan
from engine_core.timing_cache import TimingCache


def plan_runner(plan: Plan) -> GraphRunner:
    """What the runtime runs a plan's layers on the host with: the interpreter over the plan's graph (each
    intermediate freed after its last reader; constants shared with the plan, so a refit is seen)."""
    return GraphRunner(plan.graph)


def host_array(address: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """A numpy view of host memory at ``address`` (CPU-backend tensor addresses, shape inputs' values)."""
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if nbytes == 0:
        return np.empty(shape, dtype)
    buf = (ctypes.c_char * nbytes).from_address(address)
    return np.frombuffer(buf, dtype=dtype).reshape(shape)  # type: ignore[call-overload]  # a ctypes array is a buffer


class CpuBackend:
    """The "cpu" backend: nothing to compile (tactics stay "cpu:numpy"), plans run through the interpreter."""

    name = "cpu"
    uses_timing_cache = False  # nothing is timed
    workspace_limited = False  # activations are host memory

    def int8_convolutions(self) -> bool:
        """Never: the interpreter runs Q/DQ convolutions as float convolutions of the dequantized weights."""
        return False

    def compile(self, graph: Graph, inferred: Inferred, config: BuilderConfig,
                cache: TimingCache | None) -> BackendBuild:
        """No kernels, no arch, the builder's memory estimate, no build info of its own."""
        return BackendBuild()

    def load(self, plan: Plan) -> CpuEngineState:
        return CpuEngineState(plan)


class CpuEngineState:
    """Per engine: the interpreter over the plan's graph, shared by the engine's contexts."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.runner = plan_runner(plan)

    def create_context(self, streamed: Iterable[str] = ()) -> CpuContextState:
        """Weights always stay in host memory: ``streamed`` changes nothing."""
        return CpuContextState(self)

    def refit(self, weights: Mapping[str, np.ndarray]) -> None:
        """Nothing to do: the runner reads the plan graph's constants, which the refit replaced."""


class CpuContextState:
    """Per execution context: the runs of a CPU plan (the context holds all the state there is)."""

    #: one thread at a time (ExecutionContext.concurrent_runs): only the CUDA backend has per-run staging slots
    concurrent_runs = 1

    def __init__(self, engine: CpuEngineState) -> None:
        self.engine = engine

    def infer_feeds(self, ctx: RunningContext, feeds: Mapping[str, Any]) -> dict[str, Any]:
        """The interpreter over the feeds, layer times to the context's profiler, debug tensors to its listener."""
        timer = ctx.profiler.report_layer_time if ctx.profiler is not None else None
        return run_with_debug(ctx, feeds, timer, self.engine.runner)

    def infer_parts(self, ctx: RunningContext, inputs: Mapping[str, Sequence[np.ndarray | DeviceView]],
                    spans: Sequence[Span], total: int,
                    destinations: Sequence[Mapping[str, DeviceView]]) -> list[dict[str, np.ndarray]]:
        """numpy gathers, runs through the context's ``infer`` and splits; device memory is refused."""
        engine_name = ctx.engine.name
        for name, values in inputs.items():
            if any(isinstance(v, (DeviceView, DeviceRows)) for v in values):
                raise TypeError(f"input '{name}' is given in device memory, which needs a CUDA engine; "
                                f"engine '{engine_name}' runs on the CPU backend")
        if any(destinations):
            raise TypeError(f"destinations are DeviceViews, which need a CUDA engine; engine '{engine_name}' "
                            "runs on the CPU backend")
        outputs = ctx.infer({name: gather_rows(cast(Sequence[np.ndarray], values), total) for name, values in inputs.items()})
        return split_outputs(outputs, spans, total)

    def execute_bound(self, ctx: RunningContext, stream: int) -> None:
        """Synchronous: inputs copied from their host addresses, outputs copied to theirs (or to memory their
        output allocators give); ``stream`` is not used."""
        missing = ctx.infer_shapes()
        if missing:
            raise ShapeError(f"set_input_shape was not called for inputs {missing}")
        feeds = {}
        for name in ctx._input_names:
            if name not in ctx._addresses:
                raise ExecutionError(f"no address set for input '{name}'")
            tensor = ctx.engine._tensor(name)
            feeds[name] = host_array(ctx._addresses[name], tensor.dtype, ctx._input_shapes[name]).copy()
        outputs = self.infer_feeds(ctx, feeds)
        for name in ctx._output_names:
            _deliver(ctx, name, np.asarray(outputs[name], dtype=ctx.engine._tensor(name).dtype))

    def use_memory(self, address: int, size: int) -> None:
        """Recorded by the context only: activations are host memory the interpreter allocates."""

    def warm_up_feeds(self, ctx: RunningContext, zeros: Mapping[str, np.ndarray]) -> None:
        """One run on zeros."""
        ctx.infer(zeros)


def _deliver(ctx: RunningContext, name: str, value: np.ndarray) -> None:
    """Copy one output to its bound address, or to memory its output allocator provides."""
    allocator = ctx._allocators.get(name)
    address = ctx._addresses.get(name)
    if allocator is not None:
        address = allocator.reallocate_output_async(name, address or 0, value.nbytes, 256, 0)
        if address is None or (address == 0 and value.nbytes):
            raise ExecutionError(f"output allocator returned no memory for '{name}' ({value.nbytes} bytes)")
        allocator.notify_shape(name, tuple(value.shape))
    elif address is None:
        raise ExecutionError(f"no address or output allocator set for output '{name}'")
    if value.nbytes:
        np.copyto(host_array(address, value.dtype, value.shape), value)
