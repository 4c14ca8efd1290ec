"""Operator implementations. Importing this package registers every op (see registry.py)."""

from engine_core.ops import (  # noqa: F401  (imported for their registrations)
    elementwise,
    nn,
    tensor,
)
from engine_core.ops.registry import (
    OpDef,
    ShapeInferenceError,
    TensorInfo,
    get_op,
    register_op,
    registered_ops,
)

__all__ = ["OpDef", "ShapeInferenceError", "TensorInfo", "get_op", "register_op", "registered_ops"]
