"""``CudaContextState``'s side of the backend interface (``engine_core.backends.base.ContextState``).

The runtime's ExecutionContext hands itself to these; each reads what the context holds (its profiler and debug
listener, bound addresses, output allocators, memory strategy) and calls the runner's own ``infer``,
``infer_batch``, ``execute`` or ``warm_up``, whose signatures tests and benchmarks use directly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from engine_core.backends.base import RunningContext
from engine_core.backends.cuda.runner_binding import ShapesNeedValues, _Binding
from engine_core.backends.cuda.runner_staging import StagedCopies, _synchronize
from engine_core.batching import Span
from engine_core.cuda.view import DeviceView
from engine_core.errors import ExecutionError, ShapeError
from engine_core.inspector import active_debug, profiler_for
from engine_core.types import ExecutionContextAllocationStrategy


class ContextOpsMixin:
    """The ExecutionContext operations of a CUDA context (mixed into ``runner.CudaContextState``)."""

    if TYPE_CHECKING:  # what the operations use of CudaContextState
        _io_slots: Any  # runner_staging.IoSlots
        _run_lock: Any  # threading.RLock

        def bind(self, shapes: Any, values: Mapping[str, np.ndarray] | None = None) -> _Binding: ...

        def _staging(self, binding: _Binding, shapes: Any, slot: int = 0) -> tuple[dict[str, Any], StagedCopies]: ...

        def _run_tail(self, binding: _Binding, values: Mapping[str, np.ndarray],
                      profiler: Any = None) -> dict[str, np.ndarray]: ...

        def _tail_debugged(self, binding: _Binding, debug: tuple[Any, Sequence[str]] | None) -> bool: ...

        def infer(self, feeds: Mapping[str, np.ndarray], profiler: Any = None,
                  debug: tuple[Any, Sequence[str]] | None = None) -> dict[str, np.ndarray]: ...

        def infer_batch(self, inputs: Mapping[str, Sequence[np.ndarray | DeviceView]], spans: Sequence[Span],
                        total: int, destinations: Sequence[Mapping[str, DeviceView]], profiler: Any = None,
                        debug: tuple[Any, Sequence[str]] | None = None) -> list[dict[str, np.ndarray]]: ...

        def execute(self, shapes: Any, addresses: Mapping[str, int], stream: int, profiler: Any = None,
                    values: Mapping[str, np.ndarray] | None = None, debug: tuple[Any, Sequence[str]] | None = None,
                    consumed_event: Any = None, staged: Any = None, binding: Any = None) -> None: ...

        def warm_up(self, feeds: Mapping[str, np.ndarray]) -> None: ...

    @property
    def concurrent_runs(self) -> int:
        """One run per staging slot (runner_staging says why two)."""
        return int(self._io_slots.count)

    def infer_feeds(self, ctx: RunningContext, feeds: Mapping[str, Any]) -> dict[str, Any]:
        """Host arrays in and out, through the pinned mirrors."""
        return self.infer(feeds, profiler_for(ctx), active_debug(ctx))

    def infer_parts(self, ctx: RunningContext, inputs: Mapping[str, Sequence[np.ndarray | DeviceView]],
                    spans: Sequence[Span], total: int,
                    destinations: Sequence[Mapping[str, DeviceView]]) -> list[dict[str, np.ndarray]]:
        return self.infer_batch(inputs, spans, total, destinations, profiler_for(ctx), active_debug(ctx))

    def execute_bound(self, ctx: RunningContext, stream: int) -> None:
        """Device addresses, launches on ``stream``; output allocators provide device memory for unbound outputs
        (their shapes must be known before the run). A binding with a host tail (data-dependent output shapes)
        runs its device part here and its tail on the host (``_execute_bound_split``)."""
        missing = [n for n in ctx._input_names if n not in ctx._input_shapes]
        if missing:
            raise ShapeError(f"set_input_shape was not called for inputs {missing}")
        if ctx.strategy == ExecutionContextAllocationStrategy.USER_MANAGED and ctx._device_memory is None:
            raise ExecutionError("this context's device memory is user-managed: call set_device_memory first")
        data_dependent = any(any(d < 0 for d in ctx.get_tensor_shape(name)) for name in ctx._output_names)
        if data_dependent:
            _refuse_fixed_addresses(ctx)
        try:
            with self._run_lock:
                binding = self.bind(ctx._input_shapes)
        except ShapesNeedValues:
            if not data_dependent:
                raise
            self._execute_bound_on_host(ctx, stream)  # integer inputs decide shapes: infer binds on their values
            return
        if binding.tail is not None:
            if self._tail_debugged(binding, active_debug(ctx)):
                self._execute_bound_on_host(ctx, stream)
            else:
                self._execute_bound_split(ctx, binding, stream)
            return
        addresses, allocated = _output_addresses(ctx, ctx._output_names, stream)
        self.execute(ctx._input_shapes, addresses, int(stream), profiler_for(ctx),
                     debug=active_debug(ctx), consumed_event=ctx._input_consumed_event or None, binding=binding)
        for allocator, name, shape in allocated:
            allocator.notify_shape(name, tuple(shape))

    def _execute_bound_split(self, ctx: RunningContext, binding: _Binding, stream: int) -> None:
        """The device part on ``stream`` from the bound addresses (a CUDA graph once warm, as any run), the boundary
        tensors (and graph inputs the tail reads) copied to pinned host mirrors in the same run, one wait, the host
        tail, then each output it computed to its output allocator's memory (sized as it turned out: TensorRT's
        IOutputAllocator contract) or its fixed address, and ``notify_shape``. The inputs never make a round trip
        through the host; the outputs are ready when this returns. Boundary tensors that are no graph output live in
        the binding's own device buffers (its staging)."""
        tail = binding.tail
        assert tail is not None
        outputs = set(ctx._output_names)
        consumed, profiler = ctx._input_consumed_event or None, profiler_for(ctx)
        reads = [*tail.boundary, *tail.graph_inputs]
        with self._io_slots.take() as slot:
            with self._run_lock:
                stages, _ = self._staging(binding, ctx._input_shapes, slot)
            addresses, allocated = _output_addresses(ctx, [n for n in binding.output_names if n in outputs], stream)
            for name in tail.boundary:
                if name not in outputs:
                    addresses[name] = stages[name].device.ptr
            unset = [name for name in reads if name not in addresses]
            if unset:
                raise ExecutionError(f"no device address set for {unset}")
            staged = StagedCopies(downloads=tuple((stages[n].host.ptr, addresses[n], stages[n].nbytes)
                                                  for n in reads if stages[n].nbytes))
            # the tail reads graph inputs after the run: only then are they consumed
            self.execute(ctx._input_shapes, addresses, int(stream), profiler, debug=active_debug(ctx),
                         consumed_event=None if tail.graph_inputs else consumed, staged=staged, binding=binding)
            _synchronize(stream)
            if consumed and tail.graph_inputs:
                from engine_core.cuda.driver import record_event

                record_event(consumed, int(stream))
            results = self._run_tail(binding, {name: stages[name].array for name in reads}, profiler)
        for allocator, name, shape in allocated:
            allocator.notify_shape(name, tuple(shape))
        _deliver_host_outputs(ctx, results, stream)

    def _execute_bound_on_host(self, ctx: RunningContext, stream: int) -> None:
        """A run the device path cannot plan from the input shapes alone (shapes that wait for integer inputs'
        values, debug tensors inside a host tail): as ``infer`` does (binding on those values, or the whole graph
        on the host), from the inputs read at their device addresses once ``stream`` has produced them; each output
        then goes to its allocator's memory or fixed address (``_deliver_host_outputs``). The copies are
        synchronous, so the outputs are ready when this returns."""
        from engine_core.cuda.driver import copy_to_host

        _refuse_fixed_addresses(ctx)
        _synchronize(stream)
        feeds = {name: copy_to_host(ctx._addresses[name], np.dtype(ctx.engine._tensor(name).dtype),
                                    tuple(ctx._input_shapes[name])) for name in ctx._input_names}
        results = self.infer(feeds, profiler_for(ctx), active_debug(ctx))
        _deliver_host_outputs(ctx, results, stream)

    def warm_up_feeds(self, ctx: RunningContext, zeros: Mapping[str, np.ndarray]) -> None:
        """Bind the zeros' shapes on the context (as ``infer`` would) and capture their CUDA graphs."""
        ctx._input_shapes.update({name: value.shape for name, value in zeros.items()})
        ctx._inferred = None
        self.warm_up(zeros)


def _refuse_fixed_addresses(ctx: RunningContext) -> None:
    """Before a run: a fixed address can't take rows counted while running (an output allocator can)."""
    for name in ctx._output_names:
        if name not in ctx._allocators and any(d < 0 for d in ctx.get_tensor_shape(name)):
            raise ExecutionError(f"output '{name}' has a data-dependent shape: set an output allocator for it "
                                 "(set_output_allocator); a fixed address cannot be sized before the run")


def _output_addresses(ctx: RunningContext, names: Sequence[str],
                      stream: int) -> tuple[dict[str, int], list[tuple[Any, str, tuple[int, ...]]]]:
    """The bound addresses, with memory from their output allocators for ``names`` (shapes known before the run);
    and (allocator, name, shape) of each allocated output, to notify once the run is enqueued."""
    addresses, allocated = dict(ctx._addresses), []
    for name in names:
        allocator = ctx._allocators.get(name)
        if allocator is None:
            continue
        shape = ctx.get_tensor_shape(name)
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(ctx.engine._tensor(name).dtype).itemsize
        addresses[name] = _allocated(allocator, name, addresses.get(name, 0), nbytes, stream)
        allocated.append((allocator, name, shape))
    return addresses, allocated


def _deliver_host_outputs(ctx: RunningContext, results: Mapping[str, np.ndarray], stream: int) -> None:
    """Host-computed outputs to the device: each to the memory its output allocator returns for the size it turned
    out to have (then ``notify_shape``), or to its fixed address; synchronous copies."""
    from engine_core.cuda.driver import copy_to_device

    for name in ctx._output_names:
        if name not in results:
            continue
        value = np.ascontiguousarray(results[name])
        allocator = ctx._allocators.get(name)
        if allocator is not None:
            address = _allocated(allocator, name, ctx._addresses.get(name, 0), value.nbytes, stream)
        else:
            address = ctx._addresses[name]
        if value.nbytes:
            copy_to_device(int(address), value)
        if allocator is not None:
            allocator.notify_shape(name, tuple(value.shape))


def _allocated(allocator: Any, name: str, previous: int, nbytes: int, stream: int) -> int:
    """The device address ``allocator`` gives output ``name`` for ``nbytes`` (TensorRT's reallocate_output_async,
    256-byte alignment); no memory for a non-empty output is an error."""
    address = allocator.reallocate_output_async(name, previous, nbytes, 256, int(stream))
    if not address and nbytes:
        raise ExecutionError(f"output allocator returned no memory for '{name}' ({nbytes} bytes)")
    return int(address or 0)
