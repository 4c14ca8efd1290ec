"""What every cuDNN frontend graph user of the CUDA backend shares (convolutions, attention): the graph
finalisation, and ``CudnnGraphs``: one handle per execution context, the workspace its graphs run with, the stream
the handle is set to, and their release before the interpreter finalizes nanobind.

Release: the frontend's graphs and tensors are nanobind objects, which must be gone before the interpreter
finalizes nanobind (else "nanobind: leaked N instances" at exit). A context's ``CudnnGraphs`` drops them with it,
or on ``close()``; those still alive at exit (a server's) are closed by an atexit hook.
"""

from __future__ import annotations

import atexit
import gc
import weakref
from typing import Any

from engine_core.cuda.driver import DeviceBuffer


def plan_graph(cudnn: Any, graph: Any, check: bool = True, heuristics: bool = True) -> None:
    """A described cuDNN graph validated, lowered to an operation graph, and given the execution plans of the
    heuristics (mode A, then the fallback list); with ``check``, the plans' support checked too. Without
    ``heuristics`` the graph gets no plans (the caller adds a remembered one: cudnn_plan_cache.py)."""
    graph.validate()
    graph.build_operation_graph()
    if not heuristics:
        return
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    if check:
        graph.check_support()


#: every cuDNN handle made: destroying one while graphs built on it are alive (garbage collection order at
#: exit) crashed processes in native code, so handles live as long as the process
_HANDLES: list[Any] = []


class CudnnGraphs:
    """One cuDNN handle (per execution context), the workspace its graphs run with and the stream it is set to.
    Subclasses keep the graphs they built and drop them in ``close``."""

    def __init__(self) -> None:
        import cudnn

        self.cudnn = cudnn
        self.handle = cudnn.create_handle()
        _HANDLES.append(self.handle)  # never destroyed: graphs built on it may outlive this object
        self._workspace: DeviceBuffer | None = None
        self._stream: int | None = None
        #: bumped when the workspace is reallocated (CUDA graphs captured with the old one are stale)
        self.workspace_generation = 0
        _LIVE.add(self)

    def close(self) -> None:
        """Drop every cuDNN graph built here (a later run builds again); the handle and workspace stay (a run on
        another thread may still hold them)."""

    def _grow_workspace(self, nbytes: int, floor: int) -> None:
        """A workspace of at least ``nbytes`` (allocated at ``floor`` or more, so it rarely grows again)."""
        if self._workspace is None or self._workspace.nbytes < nbytes:
            self._workspace = DeviceBuffer(max(nbytes, floor))
            self.workspace_generation += 1

    def _use_stream(self, stream: int) -> None:
        """The handle's work goes on ``stream`` (set only when it changes)."""
        if stream != self._stream:
            self.cudnn.set_stream(self.handle, stream)
            self._stream = stream


#: every CudnnGraphs alive, for the exit hook
_LIVE: weakref.WeakSet[CudnnGraphs] = weakref.WeakSet()


@atexit.register
def close_all() -> None:
    """Close every live CudnnGraphs and collect cycles, so no cuDNN frontend object outlives the interpreter's
    finalization of nanobind (atexit hooks run before it; contexts kept by a server until exit are still alive)."""
    for graphs in list(_LIVE):
        graphs.close()
    gc.collect()
