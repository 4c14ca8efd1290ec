"""CPU backend: a plan runs on the host through the reference interpreter (engine_core.interpret).

A "cpu" plan is the graph after the passes, with no lowering step: the runtime executes it with the interpreter over
that graph (`plan_runner`). The interpreter itself sits below the passes, which run it too (constant folding, shape
inference's small values), as do calibration and the CUDA backend's host fallback.
"""

from __future__ import annotations

from engine_core.interpret import GraphRunner
from engine_core.plan import Plan


def plan_runner(plan: Plan) -> GraphRunner:
    """What the runtime runs a plan's layers on the host with: the interpreter over the plan's graph (each
    intermediate freed after its last reader; constants shared with the plan, so a refit is seen)."""
    return GraphRunner(plan.graph)
