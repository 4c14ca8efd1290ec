"""What the builder records beside the graph passes: refit, debug tensors, plugins, profiling verbosity and
compatibility. ``build_extras`` wraps the passes (some of these must act while they run: refittable weights stay
unfolded, debug tensors stay alive as graph outputs) and yields the entries for ``Plan.build_info``.

Build side only: what reads these entries back (the inspector, the runtime's debug tensors, compatibility checks at
load) lives below, in engine_core/inspector.py, engine_core/compat.py and engine_core/refittable.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np

from engine_core.compat import COMPAT_KEY, build_record
from engine_core.inspector import DEBUG_KEY, VERBOSITY_KEY
from engine_core.ir import Graph, Value
from engine_core.plugins import BUILD_INFO_KEY as PLUGINS_KEY
from engine_core.plugins import plugins_used
from engine_core.refittable import unfolded_weights
from engine_core.types import ProfilingVerbosity

if TYPE_CHECKING:
    from engine_core.builder_config import BuilderConfig
    from engine_core.network import NetworkDefinition


@contextmanager
def build_extras(graph: Graph, network: NetworkDefinition, config: BuilderConfig) -> Iterator[dict[str, Any]]:
    """Wrap the builder's graph passes: refit, debug tensors, plugins, profiling verbosity,
    compatibility (hardware level, VERSION_COMPATIBLE; refused here if the backend cannot honour it).

    Yields a dict that holds, once the block ends, the entries to add to ``Plan.build_info``.
    """
    info: dict[str, Any] = {VERBOSITY_KEY: ProfilingVerbosity(config.profiling_verbosity).name,
                            COMPAT_KEY: build_record(config)}
    with ExitStack() as stack:
        refit_info = stack.enter_context(unfolded_weights(graph, config))
        debug_info = stack.enter_context(kept_debug_tensors(graph, getattr(network, "debug_tensors", ())))
        yield info
    info.update(refit_info)
    info.update(debug_info)
    used = plugins_used(graph)
    if used:
        info[PLUGINS_KEY] = used


@contextmanager
def kept_debug_tensors(graph: Graph, names: Any) -> Iterator[dict[str, Any]]:
    """Debug tensors are graph outputs while the passes run, so none is fused away or removed."""
    info: dict[str, Any] = {}
    extra = [n for n in sorted(names) if n not in set(graph.output_names)]
    graph.outputs.extend(Value(n, np.dtype(np.float32), None) for n in extra)
    try:
        yield info
    finally:
        graph.outputs = [v for v in graph.outputs if v.name not in set(extra)]
        if names:
            info[DEBUG_KEY] = sorted(names)
