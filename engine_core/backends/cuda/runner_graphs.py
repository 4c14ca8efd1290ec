"""CUDA graph capture and replay of a binding's runs: the eager first run, the capture, the once-per-binding check
that a replay reproduces a layer-by-layer run, and the captured graphs kept per I/O addresses (``GraphsMixin``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from engine_core.backends.cuda.runner_binding import Shapes, _Binding
from engine_core.backends.cuda.runner_schedule import RunSchedule
from engine_core.backends.cuda.runner_staging import StagedCopies
from engine_core.cuda.driver import (
    check,
    launch_graph,
)
from engine_core.logger import DEFAULT_LOGGER, Severity

#: captured graphs kept per input-shape binding (one per distinct set of I/O addresses)
MAX_GRAPHS_PER_SHAPE = 4


class _Graph:
    """An instantiated CUDA graph (and the graph it came from), destroyed with the object."""

    def __init__(self, graph: Any, exec_: Any) -> None:
        self.graph, self.exec = graph, exec_

    def __del__(self) -> None:
        try:
            from cuda.bindings import driver

            driver.cuGraphExecDestroy(self.exec)
            driver.cuGraphDestroy(self.graph)
        except Exception:
            pass


class GraphsMixin:
    """CudaContextState's runs through captured CUDA graphs."""

    def _execute_locked(self, shapes: Shapes, addresses: Mapping[str, int], stream: int, profiler: Any = None,
                        values: Mapping[str, np.ndarray] | None = None, debug: tuple[Any, Sequence[str]] | None = None,
                        consumed_event: Any = None, staged: StagedCopies | None = None, binding: _Binding | None = None
                        ) -> None:
        """Launch every step on ``stream`` (never a default stream); host syncs happen only around
        host-fallback layers (``binding``: ``bind(shapes, values)``'s, when the caller has it).

        Why CUDA graphs: a layer costs ~10 us of Python to launch, more than most kernels run. The
        second run with the same shapes and I/O addresses is captured into a graph; later runs with
        those addresses replay it with one launch. Plans with host-fallback layers (they synchronize) and plans
        built with ``BuilderConfig.cuda_graphs = False`` (or run under KILN_CUDA_GRAPHS=0) always launch layer by
        layer; with a ``profiler`` (IProfiler) each layer is timed with CUDA events and reported after the run.
        Streamed weights' uploads (copy stream) are part of the capture. ``debug``: (IDebugListener,
        tensor names): runs launch layer by layer (no replay) and report each tensor after its layer.
        ``consumed_event``: a CUevent recorded once no later step reads an input (captured as an
        external event node, so replays record it too). ``staged``: host <-> device copies of the I/O
        (``infer``'s pinned mirrors) enqueued before and after the run, and captured with it: a replay is then
        one launch for copies and run together (each driver call releases the interpreter lock, and with
        other threads busy getting it back costs up to a switch interval).
        """
        binding = binding or self.bind(shapes, values)
        names = tuple(sorted(debug[1])) if debug is not None else ()
        schedule = binding.schedule(bool(consumed_event), names)
        self._ensure_slots(schedule)
        listener = debug[0] if names else None
        if profiler is not None:
            self._launch_profiled(binding, schedule, addresses, stream, profiler, consumed_event, listener, staged)
            return
        if listener is not None:
            self._launch_all(binding, schedule, addresses, stream, consumed_event, listener=listener,
                             staged=staged)
            return
        if not self.graphs_possible(binding):
            self._launch_all(binding, schedule, addresses, stream, consumed_event, staged=staged)
            return
        key = graph_key(addresses, consumed_event, staged)
        graph = binding.graphs.get(key)
        if graph is None:
            binding.runs += 1
            if binding.runs < 2:  # first run eagerly: library initialisation must not be captured
                self._launch_all(binding, schedule, addresses, stream, consumed_event, staged=staged)
                return
            graph = self._capture(binding, schedule, addresses, stream, consumed_event, staged)
            if graph is None:
                return
            if not binding.verified:
                if self._replay_matches(binding, graph, schedule, addresses, stream, consumed_event, staged):
                    binding.verified = True
                elif not binding.conv_bias_only and binding.has_conv_epilogues:
                    binding.conv_bias_only = True  # next runs: capture again with cuDNN doing conv + bias only
                    binding.runs = 0
                    # the replay was wrong
                    self._launch_all(binding, schedule, addresses, stream, consumed_event, staged=staged)
                    return
                else:
                    binding.verified = binding.graph_failed = True
                    DEFAULT_LOGGER.log(Severity.WARNING, f"CUDA plan '{self.engine.plan.name}': a captured CUDA graph "
                                       "did not reproduce the layer-by-layer results for these shapes; they run "
                                       "without graph replay")
                    # the replay was wrong
                    self._launch_all(binding, schedule, addresses, stream, consumed_event, staged=staged)
                    return
            if len(binding.graphs) >= MAX_GRAPHS_PER_SHAPE:
                binding.graphs.pop(next(iter(binding.graphs)))
            binding.graphs[key] = graph
        self._replay(graph, stream)

    def _replay(self, graph: _Graph, stream: int) -> None:
        """One launch of a captured run (counted in ``graph_replays``), keeping the interpreter lock."""
        launch_graph(graph.exec, stream)
        self.graph_replays += 1

    def graphs_possible(self, binding: _Binding) -> bool:
        """Whether runs of ``binding`` may be captured and replayed (host-fallback layers synchronize; a
        capture that failed or did not reproduce stays off; BuilderConfig.cuda_graphs / KILN_CUDA_GRAPHS=0)."""
        return self.use_graphs and not binding.has_host and not binding.graph_failed

    def _replay_matches(self, binding: _Binding, graph: _Graph, schedule: Any, addresses: Mapping[str, int],
                        stream: int, consumed_event: Any, staged: StagedCopies | None = None) -> bool:
        """Once per binding: run layer by layer, then replay the captured graph on the same inputs, and compare
        the outputs. Why: a library call that is not capture-safe (host-side argument staging, say) would
        otherwise replay wrong results silently; such bindings keep launching layer by layer."""
        from cuda.bindings import driver

        outputs = [(name, binding.lowered.infos[name]) for name in binding.output_names
                   if name in addresses and binding.lowered.infos.get(name) is not None]

        def fetch() -> list[np.ndarray]:
            check(driver.cuStreamSynchronize(stream), "cuStreamSynchronize")
            arrays = []
            for name, info in outputs:
                out = np.empty(info.shape, info.dtype)
                if out.nbytes:
                    check(driver.cuMemcpyDtoH(out.ctypes.data, addresses[name], out.nbytes), "cuMemcpyDtoH")
                arrays.append(out)
            return arrays

        self._launch_all(binding, schedule, addresses, stream, consumed_event, staged=staged)
        want = fetch()
        check(driver.cuGraphLaunch(graph.exec, stream), "cuGraphLaunch")
        return all(outputs_match(a, b) for a, b in zip(want, fetch()))

    def _capture(self, binding: _Binding, schedule: RunSchedule, addresses: Mapping[str, int], stream: int,
                 consumed_event: Any, staged: StagedCopies | None = None) -> _Graph | None:
        """Capture one run into an instantiated graph; on failure, run eagerly and stop trying."""
        from cuda.bindings import driver

        mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        check(driver.cuStreamBeginCapture(stream, mode), "cuStreamBeginCapture")
        try:
            self._launch_all(binding, schedule, addresses, stream, consumed_event, capturing=True, staged=staged)
        except Exception:
            driver.cuStreamEndCapture(stream)
            binding.graph_failed = True
            raise
        graph = check(driver.cuStreamEndCapture(stream), "cuStreamEndCapture")
        try:
            return _Graph(graph, check(driver.cuGraphInstantiate(graph, 0), "cuGraphInstantiate"))
        except Exception:
            binding.graph_failed = True
            self._launch_all(binding, schedule, addresses, stream, consumed_event, staged=staged)
            return None


#: elements compared at a time where a replay's output is not bit-identical (bounds the float64 copies)
COMPARE_CHUNK = 1 << 22


def outputs_match(want: np.ndarray, got: np.ndarray) -> bool:
    """Whether a replay's output ``got`` reproduces the layer-by-layer ``want``: bit-identical (the usual case, a
    memcmp), else floats within 1e-3 of the largest magnitude with NaNs in the same places, compared in chunks.
    Why chunks: a decoder step's present keys and values are gigabytes, and whole float64 copies of them made
    each new shape's first capture take seconds."""
    if want.shape != got.shape or want.dtype != got.dtype:
        return False
    if not want.size or np.array_equal(want.reshape(-1).view(np.uint8), got.reshape(-1).view(np.uint8)):
        return True
    if not (want.dtype.kind in "fc" or want.dtype.name == "bfloat16"):
        return False
    a, b = want.reshape(-1), got.reshape(-1)
    parts = [(a[i:i + COMPARE_CHUNK].astype(np.float64), b[i:i + COMPARE_CHUNK].astype(np.float64))
             for i in range(0, a.size, COMPARE_CHUNK)]
    scale = max([1.0] + [float(np.nanmax(np.abs(x))) for x, _ in parts if not np.isnan(x).all()])
    for x, y in parts:
        nan = np.isnan(x)
        if not np.array_equal(nan, np.isnan(y)) or (not nan.all() and float(np.nanmax(np.abs(x - y))) > 1e-3 * scale):
            return False
    return True


def graph_key(addresses: Mapping[str, int], consumed_event: Any, staged: StagedCopies | None = None) -> tuple:
    """What a captured graph depends on beyond its binding: the I/O addresses, the input-consumed event and the
    staged copies captured with it."""
    return (*sorted(addresses.items()), ("#consumed", int(consumed_event or 0)), ("#staged", staged))
