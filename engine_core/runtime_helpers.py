"""Runtime helpers that read a plan or a context without being the runtime's objects: activation memory per
profile, streamable weights per layer, whether shapes need input values, format descriptions.
``engine_core.runtime`` uses (and re-exports) them; this module does not import the runtime.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from engine_core.errors import ShapeError
from engine_core.ops import TensorInfo
from engine_core.passes import infer_shapes
from engine_core.plan import Plan
from engine_core.refittable import refittable_names
from engine_core.types import DataType, TensorFormat
from engine_core.weight_streaming import LayerWeights


def _shapes_need_values(plan: Plan, feeds: Mapping[str, np.ndarray]) -> bool:
    """Whether some output's shape depends on input values, not only on the feeds' shapes."""
    graph = plan.graph
    infos = {v.name: TensorInfo(v.dtype, tuple(feeds[v.name].shape)) for v in graph.inputs}
    try:
        inferred = infer_shapes(graph, infos, values=True)
    except ShapeError:  # an op needs a value to say its shape
        return True
    return any(inferred.get(name) is None or inferred[name].shape is None for name in graph.output_names)


def _streamable_weights_per_layer(plan: Plan) -> list[LayerWeights]:
    """Each layer's streamable weights (floating-point constants) in run order; [] without WEIGHT_STREAMING."""
    if "WEIGHT_STREAMING" not in plan.build_info.get("flags", []):
        return []
    from engine_core.ir import subgraph_reads

    graph = plan.graph
    names = set(refittable_names(graph))
    return [(node.name, [(n, int(graph.constants[n].nbytes))
                         for n in dict.fromkeys((*node.inputs, *subgraph_reads(node))) if n in names])
            for node in graph.nodes]


def _profile_device_memory(plan: Plan, profile_index: int) -> int:
    """Activation memory of one profile. CUDA plans: the per-profile arena sizes the build records
    (``build_info["cuda"]["device_memory_per_profile"]``), else the engine-wide size, an upper bound.
    CPU plans: the build's own estimate (live-tensor peak) at the profile's max shapes."""
    if plan.backend != "cpu":
        cuda_info = plan.build_info.get("cuda") or {}
        recorded = cuda_info.get("device_memory_per_profile") if isinstance(cuda_info, dict) else None
        if isinstance(recorded, list) and len(recorded) == len(plan.profiles):
            return int(recorded[profile_index])
        return plan.device_memory_size
    from engine_core.builder import _activation_peak_bytes, _infos_for

    graph = plan.graph
    values = plan.profile_values[profile_index] if plan.profile_values else {}
    infos = _infos_for(graph, {k: v[2] for k, v in plan.profiles[profile_index].items()},
                       {k: v[2] for k, v in values.items()})
    return _activation_peak_bytes(graph, infer_shapes(graph, infos))


#: vectorized formats: (scalars per vector, position of the channel dim counted from the end)
_VECTORIZED = {
    TensorFormat.CHW2: (2, 3), TensorFormat.CHW4: (4, 3), TensorFormat.CHW16: (16, 3), TensorFormat.CHW32: (32, 3),
    TensorFormat.HWC8: (8, 3), TensorFormat.HWC16: (16, 3), TensorFormat.DLA_HWC4: (4, 3),
    TensorFormat.DHWC8: (8, 4), TensorFormat.CDHW32: (32, 4),
}
_WIDTH_WORDS = {2: "Two", 4: "Four", 16: "Sixteen", 32: "Thirty-two"}
_DTYPE_WORDS = {DataType.FLOAT: "FP32", DataType.HALF: "FP16", DataType.DOUBLE: "FP64"}


def format_description(fmt: TensorFormat, dtype: DataType) -> str:
    """The reference's human-readable format text, e.g. "Row major linear FP32 format"."""
    dt = _DTYPE_WORDS.get(dtype, dtype.name)
    width = _VECTORIZED.get(fmt, (1, 0))[0]
    if fmt == TensorFormat.LINEAR:
        return f"Row major linear {dt} format"
    if fmt == TensorFormat.DLA_LINEAR:
        return f"DLA row major linear {dt} format"
    if fmt in (TensorFormat.HWC, TensorFormat.DHWC):
        return f"Channel major {dt} format"
    if fmt in (TensorFormat.HWC8, TensorFormat.HWC16, TensorFormat.DHWC8, TensorFormat.DLA_HWC4):
        return f"Channel major {dt} format where C % {width} == 0"
    return f"{_WIDTH_WORDS[width]} wide channel vectorized row major {dt} format"


