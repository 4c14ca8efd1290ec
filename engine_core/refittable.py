"""Refittable weights: which constants a plan built with ``BuilderFlag.REFIT`` keeps as its own, named weights.

Every floating-point ONNX initializer / network constant stays its own, named constant: graph passes that would
consume one (constant folding, Conv+BN folding) are kept from seeing it, because a folded result could not be
recomputed from a new value of only one of its inputs. Integer constants stay foldable: they feed shape
computations, and changing them would change the engine's structure, not its weights.

The build, the runtime and the CUDA runner read this; the Refitter that replaces the weights of a built engine
(engine_core.refit) sits on top of the runtime.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np

from engine_core.ir import Graph, subgraph_reads
from engine_core.types import BuilderFlag

if TYPE_CHECKING:
    from engine_core.builder_config import BuilderConfig
    from engine_core.plan import Plan

#: build_info key listing the names of the refittable weights of a plan.
BUILD_INFO_KEY = "refittable_weights"


def refittable_names(graph: Graph) -> list[str]:
    """Weights a refit may replace: the graph's floating-point constants, by name."""
    return sorted(name for name, value in graph.constants.items()
                  if isinstance(value, np.ndarray) and value.dtype.kind in "fc")


@contextmanager
def unfolded_weights(graph: Graph, config: BuilderConfig) -> Iterator[dict[str, Any]]:
    """While the graph passes run, hide refittable weights from ``graph.constants`` (REFIT only).

    Passes only fold what they find in ``graph.constants``, so a hidden weight is never folded
    into another constant; afterwards the weights still in use come back under their names.
    Yields the build_info entries to record (empty without REFIT).
    """
    info: dict[str, Any] = {}
    if not config.get_flag(BuilderFlag.REFIT):
        yield info
        return
    hidden = {name: graph.constants.pop(name) for name in refittable_names(graph)}
    try:
        yield info
    finally:
        used = {i for node in graph.nodes for i in (*node.inputs, *subgraph_reads(node))} | set(graph.output_names)
        for name, value in hidden.items():
            if name in used:
                graph.constants[name] = value
        info[BUILD_INFO_KEY] = sorted(n for n in hidden if n in graph.constants)


def plan_refittable(plan: Plan) -> bool:
    """True when the plan was built with REFIT (``CudaEngine.refittable``)."""
    return "REFIT" in plan.build_info.get("flags", [])
