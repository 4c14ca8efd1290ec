"""Example plugin: ``com.example.kiln::ScaledSwish``, y = scale * x * sigmoid(beta * x).

Import this module (it registers the plugin) before parsing a model that uses the op or loading a
plan built from one; plans record "ScaledSwish" version "1" and refuse to load without it.

    from examples.plugins import scaled_swish  # registers the plugin
    node = onnx.helper.make_node("ScaledSwish", ["x"], ["y"], domain=scaled_swish.DOMAIN, beta=1.5, scale=2.0)
"""

from __future__ import annotations

import numpy as np

from engine_core.ir import Node
from engine_core.ops.registry import ShapeInferenceError, TensorInfo
from engine_core.plugins import PluginDef, get_plugin_registry

DOMAIN = "com.example.kiln"
NAME = "ScaledSwish"
VERSION = "1"

#: CUDA C kernel for CUDA builds (compiled with NVRTC; one thread per element).
CUDA_SOURCE = r"""
extern "C" __global__ void scaled_swish(const float* x, float* y, long long n, float beta, float scale) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = x[i];
        y[i] = scale * v / (1.0f + __expf(-beta * v));
    }
}
"""


def infer(node: Node, x: TensorInfo | None) -> TensorInfo:
    """Elementwise: same shape and dtype as ``x``; floating-point inputs only."""
    assert x is not None
    if x.dtype.kind != "f":
        raise ShapeInferenceError(f"{NAME} takes a floating-point tensor, got {x.dtype}")
    return TensorInfo(x.dtype, x.shape)


def cpu(node: Node, x: np.ndarray) -> np.ndarray:
    """Computed in the input's precision; sigmoid via tanh, which cannot overflow for large |x|."""
    beta = x.dtype.type(node.attr("beta", 1.0))
    scale = x.dtype.type(node.attr("scale", 1.0))
    half = x.dtype.type(0.5)
    return (scale * x * (half * np.tanh(half * beta * x) + half)).astype(x.dtype)


PLUGIN = PluginDef(NAME, VERSION, DOMAIN, infer, cpu, cuda_source=CUDA_SOURCE,
                   doc="scale * x * sigmoid(beta * x)")
get_plugin_registry().register(PLUGIN)
