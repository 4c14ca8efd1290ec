"""The backend interface: what the builder and the runtime call, and nothing else of a backend.

The split of ONNX Runtime's execution providers and tinygrad's runners: at build time a backend compiles the graph
after the passes (``Backend.compile`` -> ``BackendBuild``: per-layer tactics, kernels, arena size, what it records);
at run time it loads a plan (``Backend.load`` -> ``EngineState``, per engine) and makes per-context state
(``EngineState.create_context`` -> ``ContextState``) that runs the execution context's operations. The builder and
the runtime hold no backend-specific branches: they ask ``backends.registry.get_backend(name)`` and call these.

Why Protocols: the CUDA backend's states (``backends/cuda/runner.py``) predate this interface and tests reach
into them; they satisfy it structurally, as any later backend may, without a common base class.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from engine_core.batching import Span
from engine_core.builder_config import BuilderConfig
from engine_core.cuda.view import DeviceView
from engine_core.ir import Graph
from engine_core.ops import TensorInfo
from engine_core.plan import Plan
from engine_core.timing_cache import TimingCache

#: shape inference of the graph after the passes at every (profile, min/opt/max) point, as the builder made it
Inferred = Mapping[tuple[int, int], Mapping[str, TensorInfo]]


@dataclass
class BackendBuild:
    """What a backend's compile step adds to the plan the builder writes."""

    #: layer name -> the implementation chosen for it; layers left out keep "<backend>:numpy"
    tactics: dict[str, str] = field(default_factory=dict)
    #: kernel module name -> code (CUBINs), saved in the plan
    kernels: dict[str, bytes] = field(default_factory=dict)
    #: what the kernels run on ("any": no device code)
    arch: str = "any"
    #: activation bytes a context needs; None: the builder's estimate (live tensors in layer order) stands
    device_memory_size: int | None = None
    #: recorded as ``build_info[<backend name>]`` when not empty (how it lowered, timings, fallbacks)
    info: dict[str, Any] = field(default_factory=dict)


class Backend(Protocol):
    """One backend: build-time compile and run-time load. Registered by name in ``backends.registry``."""

    #: the plan's ``backend`` field ("cpu", "cuda")
    name: str
    #: whether compile times tactics: the builder then hands it the config's timing cache (making one when none is
    #: set), else None, so a CPU build leaves ``config.timing_cache`` as it was
    uses_timing_cache: bool
    #: whether activations live in device memory bounded by the config's WORKSPACE pool (the CPU's are host memory)
    workspace_limited: bool

    def int8_convolutions(self) -> bool:
        """Whether Q/DQ convolutions of a build for this backend run in INT8 here (fuse_qdq_conv's default)."""
        ...

    def compile(self, graph: Graph, inferred: Inferred, config: BuilderConfig,
                cache: TimingCache | None) -> BackendBuild:
        """The build step after the passes and shape inference: tactics, kernels, memory, build info."""
        ...

    def load(self, plan: Plan) -> EngineState:
        """Per-engine state for ``plan`` (weights, kernels); raises PlanFormatError when this machine cannot run it."""
        ...


class EngineState(Protocol):
    """Per engine: shared by its contexts, kept for the engine's life."""

    def create_context(self, streamed: Iterable[str] = ()) -> ContextState:
        """A new context's state; ``streamed``: the weights the engine's weight-streaming budget leaves in host
        memory (the budget cannot change while contexts exist, so weights are placed now)."""
        ...

    def refit(self, weights: Mapping[str, np.ndarray]) -> None:
        """New values of weights already swapped into the plan's graph: update any copies the backend made."""
        ...


class RunningContext(Protocol):
    """What a backend reads of the runtime's ExecutionContext, handed to each ContextState operation (the runtime
    imports the backends, so they describe the context instead of importing it, as the inspector does)."""

    engine: Any  # runtime.CudaEngine
    profiler: Any  # IProfiler | None
    strategy: Any  # ExecutionContextAllocationStrategy
    _input_names: list[str]
    _output_names: list[str]
    _input_shapes: dict[str, tuple[int, ...]]
    _addresses: dict[str, int]
    _allocators: dict[str, Any]  # output name -> IOutputAllocator
    _inferred: dict[str, TensorInfo] | None
    _device_memory: tuple[int, int] | None
    _input_consumed_event: int

    def infer_shapes(self) -> list[str]: ...

    def get_tensor_shape(self, name: str) -> tuple[int, ...]: ...

    def infer(self, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]: ...


class ContextState(Protocol):
    """Per execution context: the operations ExecutionContext delegates, each given the context it runs for."""

    @property
    def concurrent_runs(self) -> int:
        """How many threads may run ``infer_feeds`` / ``infer_parts`` at once."""
        ...

    def infer_feeds(self, ctx: RunningContext, feeds: Mapping[str, Any]) -> dict[str, Any]:
        """One run on host values (inputs' shapes already set and checked); every graph output by name."""
        ...

    def infer_parts(self, ctx: RunningContext, inputs: Mapping[str, Sequence[np.ndarray | DeviceView]],
                    spans: Sequence[Span], total: int,
                    destinations: Sequence[Mapping[str, DeviceView]]) -> list[dict[str, np.ndarray]]:
        """``infer_batch`` once its parts are checked: gather ``total`` rows, run once, hand each span its rows."""
        ...

    def execute_bound(self, ctx: RunningContext, stream: int) -> None:
        """``execute_async_v3``: run on the addresses set with ``set_tensor_address``; raises KilnError."""
        ...

    def use_memory(self, address: int, size: int) -> None:
        """Activations go to caller-owned memory from now on (``set_device_memory``)."""
        ...

    def warm_up_feeds(self, ctx: RunningContext, zeros: Mapping[str, np.ndarray]) -> None:
        """``warm_up`` on zeros of the shapes to warm (their values do not decide shapes)."""
        ...
