"""Operator implementations. Importing this package registers every op (see registry.py)."""

from engine_core.ops import (  # noqa: F401  (imported for their registrations)
    activations,
    attention,
    cast,
    control_flow,
    elementwise,
    fused,
    image,
    indexing,
    logic,
    ml,
    nn,
    normalization,
    pooling,
    quantization,
    random_ops,
    reductions,
    rnn,
    sequence,
    signal,
    strings,
    tensor,
    training,
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
