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
from engine_core.backends.cuda.runner_staging import _synchronize
from engine_core.batching import Span
from engine_core.cuda.view import DeviceView
from engine_core.errors import ExecutionError, ShapeError
from engine_core.inspector import active_debug, profiler_for
from engine_core.types import ExecutionContextAllocationStrategy


class ContextOpsMixin:
    """The ExecutionContext operations of a CUDA context (mixed into ``runner.CudaContextState``)."""

    if TYPE_CHECKING:  # what the operations use of CudaContextState
        _io_slots: Any  # runner_staging.IoSlots

        def infer(self, feeds: Mapping[str, np.ndarray], profiler: Any = None,
                  debug: tuple[Any, Sequence[str]] | None = None) -> dict[str, np.ndarray]: ...

        def infer_batch(self, inputs: Mapping[str, Sequence[np.ndarray | DeviceView]], spans: Sequence[Span],
                        total: int, destinations: Sequence[Mapping[str, DeviceView]], profiler: Any = None,
                        debug: tuple[Any, Sequence[str]] | None = None) -> list[dict[str, np.ndarray]]: ...

        def execute(self, shapes: Any, addresses: Mapping[str, int], stream: int, profiler: Any = None,
                    values: Mapping[str, np.ndarray] | None = None, debug: tuple[Any, Sequence[str]] | None = None,
                    consumed_event: Any = None, staged: Any = None) -> None: ...

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
        (their shapes must be known before the run)."""
        missing = [n for n in ctx._input_names if n not in ctx._input_shapes]
        if missing:
            raise ShapeError(f"set_input_shape was not called for inputs {missing}")
        if ctx.strategy == ExecutionContextAllocationStrategy.USER_MANAGED and ctx._device_memory is None:
            raise ExecutionError("this context's device memory is user-managed: call set_device_memory first")
        if any(any(d < 0 for d in ctx.get_tensor_shape(name)) for name in ctx._output_names):
            self._execute_bound_on_host(ctx, stream)
            return
        addresses, allocated = dict(ctx._addresses), []
        for name in ctx._output_names:
            allocator = ctx._allocators.get(name)
            if allocator is None:
                continue
            shape = ctx.get_tensor_shape(name)
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(ctx.engine._tensor(name).dtype).itemsize
            addresses[name] = _allocated(allocator, name, addresses.get(name, 0), nbytes, stream)
            allocated.append((allocator, name, shape))
        self.execute(ctx._input_shapes, addresses, int(stream), profiler_for(ctx),
                     debug=active_debug(ctx), consumed_event=ctx._input_consumed_event or None)
        for allocator, name, shape in allocated:
            allocator.notify_shape(name, tuple(shape))

    def _execute_bound_on_host(self, ctx: RunningContext, stream: int) -> None:
        """A run whose output shapes depend on input values (NonZero, NonMaxSuppression, ...): the device path
        cannot size those outputs before running, so, as ``infer`` does, the whole graph runs on the host (logged
        once, in ``host_fallback``): the inputs are read from their device addresses once ``stream`` has
        produced them, and each data-dependent output goes to the memory its output allocator returns for the
        size it turned out to have (TensorRT's IOutputAllocator contract), then ``notify_shape``. The copies
        are synchronous, so the outputs are ready when this returns."""
        from engine_core.cuda.driver import copy_to_device, copy_to_host

        for name in ctx._output_names:  # before the run: a fixed address can't take rows counted while running
            if name not in ctx._allocators and any(d < 0 for d in ctx.get_tensor_shape(name)):
                raise ExecutionError(f"output '{name}' has a data-dependent shape: set an output allocator for it "
                                     "(set_output_allocator); a fixed address cannot be sized before the run")
        _synchronize(stream)
        feeds = {name: copy_to_host(ctx._addresses[name], np.dtype(ctx.engine._tensor(name).dtype),
                                    tuple(ctx._input_shapes[name])) for name in ctx._input_names}
        results = self.infer(feeds, profiler_for(ctx), active_debug(ctx))
        for name in ctx._output_names:
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

    def warm_up_feeds(self, ctx: RunningContext, zeros: Mapping[str, np.ndarray]) -> None:
        """Bind the zeros' shapes on the context (as ``infer`` would) and capture their CUDA graphs."""
        ctx._input_shapes.update({name: value.shape for name, value in zeros.items()})
        ctx._inferred = None
        self.warm_up(zeros)


def _allocated(allocator: Any, name: str, previous: int, nbytes: int, stream: int) -> int:
    """The device address ``allocator`` gives output ``name`` for ``nbytes`` (TensorRT's reallocate_output_async,
    256-byte alignment); no memory for a non-empty output is an error."""
    address = allocator.reallocate_output_async(name, previous, nbytes, 256, int(stream))
    if not address and nbytes:
        raise ExecutionError(f"output allocator returned no memory for '{name}' ({nbytes} bytes)")
    return int(address or 0)
