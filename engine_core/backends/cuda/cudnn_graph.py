"""What every cuDNN frontend graph of the CUDA backend goes through once described (convolutions, attention)."""

from __future__ import annotations

from typing import Any


def plan_graph(cudnn: Any, graph: Any, check: bool = True) -> None:
    """A described cuDNN graph validated, lowered to an operation graph, and given the execution plans of the
    heuristics (mode A, then the fallback list); with ``check``, the plans' support checked too."""
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    if check:
        graph.check_support()
