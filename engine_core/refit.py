"""Refit: replace a built engine's named weights without rebuilding it (IRefitter).

Which weights a plan can refit, and how the build keeps them unfolded: engine_core.refittable.

Refitting while execution contexts exist follows the reference: contexts keep working and see
the new weights from their next run on; a run in flight during ``refit_cuda_engine`` is undefined.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from engine_core.error_recorder import ErrorCode, report_error
from engine_core.logger import DEFAULT_LOGGER, Logger, Severity
from engine_core.plan import serialize_plan
from engine_core.refittable import BUILD_INFO_KEY, plan_refittable

if TYPE_CHECKING:
    from engine_core.runtime import CudaEngine

class Refitter:
    """Updates the weights of a refittable engine (IRefitter)."""

    def __init__(self, engine: CudaEngine, logger: Logger | None = None) -> None:
        if not plan_refittable(engine.plan):
            raise ValueError(f"engine '{engine.name}' was not built with BuilderFlag.REFIT and cannot be refit")
        self.engine = engine
        self.logger = logger or DEFAULT_LOGGER
        self.error_recorder = getattr(engine, "error_recorder", None)
        self._names = list(engine.plan.build_info.get(BUILD_INFO_KEY, []))
        self._pending: dict[str, np.ndarray] = {}

    def _error(self, code: ErrorCode, msg: str) -> bool:
        report_error(self, code, msg)
        return False

    def set_named_weights(self, name: str, weights: np.ndarray) -> bool:
        """Stage new values for weights ``name``; same element count as the built weights."""
        current = self.engine.plan.graph.constants.get(name) if name in self._names else None
        if current is None:
            return self._error(ErrorCode.INVALID_ARGUMENT, f"refit: '{name}' is not a refittable weight of this engine")
        array = np.asarray(weights)
        if array.size != current.size:
            return self._error(ErrorCode.INVALID_ARGUMENT, f"refit: weights '{name}' have {array.size} values, "
                               f"the engine's have {current.size} (shape {list(current.shape)})")
        if array.dtype.kind not in "fciu":
            return self._error(ErrorCode.INVALID_ARGUMENT, f"refit: weights '{name}' have dtype {array.dtype}")
        self._pending[name] = np.ascontiguousarray(array.astype(current.dtype).reshape(current.shape))
        return True

    def get_named_weights(self, name: str) -> np.ndarray | None:
        """Weights staged for ``name``, else the engine's current ones (None for an unknown name)."""
        if name in self._pending:
            return self._pending[name]
        return self.engine.plan.graph.constants.get(name) if name in self._names else None

    def unset_named_weights(self, name: str) -> bool:
        return self._pending.pop(name, None) is not None

    def get_missing_weights(self) -> list[str]:
        """Weights that must also be supplied before a refit: none, since no weight is combined
        with another at build time (REFIT keeps each one unfolded)."""
        return []

    def get_all_weights(self) -> list[str]:
        return list(self._names)

    def refit_cuda_engine(self) -> bool:
        """Apply the staged weights; the engine then behaves as if built with them."""
        missing = self.get_missing_weights()
        if missing:
            return self._error(ErrorCode.INVALID_STATE, f"refit: weights {missing} are still missing")
        apply_weights(self.engine, self._pending)
        self.logger.log(Severity.INFO, f"refit {len(self._pending)} weights of engine '{self.engine.name}'")
        self._pending = {}
        return True

    refit_cuda_engine_async = refit_cuda_engine


def apply_weights(engine: CudaEngine, weights: dict[str, np.ndarray]) -> None:
    """Swap weights into the engine's graph (shared with all its contexts) and its serialized plan."""
    if not weights:
        return
    engine.plan.graph.constants.update(weights)
    engine._serialized = serialize_plan(engine.plan)
    # the backend's copies: the CUDA backend overwrites its device copies in place, so every context (and every
    # captured CUDA graph, which holds their addresses) reads the new values from its next launch on
    if engine.backend_state is not None:  # a described engine (Runtime.describe) has no copies to update
        engine.backend_state.refit(weights)
