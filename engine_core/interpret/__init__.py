"""The reference interpreter over the op registry (numpy): used by constant folding, shape inference, calibration,
the CPU backend and the CUDA backend's host fallback."""

from engine_core.interpret.runner import GraphRunner, LayerTimer, as_outputs, run_node, run_scoped

__all__ = ["GraphRunner", "LayerTimer", "as_outputs", "run_node", "run_scoped"]
