"""Global pooling on the CUDA backend: channels-last inputs take pool.cu's pool_band_nhwc (a block per image and
group of channel runs, its threads spread over the positions; split into bands of rows when there are few blocks),
long linear (NCHW) inputs reduce.cu's row reduction. Without a GPU: the kernels the lowering picks, and the lowered
launches emulated on the host against the CPU backend. On the device (``gpu``): the CUDA backend against the CPU
backend and each storage type against numpy. How fast against the per-output kernel (pool2d_nhwc) it replaced:
`python -m bench.global_pool` (device_session.sh's `pool` stage)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import engine_core as kiln
from bench.global_pool import device_setup, run_launches
from engine_core.backends.cuda.lowering import LoweringOptions, lower_graph
from engine_core.backends.cuda.lowering_context import THREADS, Launch
from engine_core.interpret import GraphRunner
from tests.cuda.emulate import Emulator
from tests.cuda.test_backend_cpu import _graph_and_infos

#: the pools of ``pool_model``: node name -> (op type, attributes; None: the input's spatial size as kernel_shape)
POOLS = {"gap": ("GlobalAveragePool", {}), "gmp": ("GlobalMaxPool", {}), "avg_full": ("AveragePool", None)}
ONNX_TYPE = {np.dtype(np.float16): TensorProto.FLOAT16, np.dtype(np.float32): TensorProto.FLOAT}


def pool_model(shape: tuple[int, int, int, int], dtype) -> onnx.ModelProto:
    """x -> 1x1 Conv with identity weights -> h -> GlobalAveragePool, GlobalMaxPool and an AveragePool whose window
    is the whole input (no padding) -> three outputs. Why the Conv: the lowering gives convolutions channels-last
    outputs (NCHW under strict fp32), so the pools read the layout under test; identity weights keep h exactly
    the feed (fp16-representable values: exact through fp16 and TF32 convolutions), so outputs compare tightly."""
    n, c, h, w = shape
    elem = ONNX_TYPE[np.dtype(dtype)]
    weight = np.eye(c, dtype=dtype).reshape(c, c, 1, 1)
    nodes = [helper.make_node("Conv", ["x", "w"], ["h"], name="conv")]
    for name, (op, attrs) in POOLS.items():
        nodes.append(helper.make_node(op, ["h"], [name], name=name, **(attrs if attrs is not None else
                                                                       {"kernel_shape": [h, w]})))
    graph = helper.make_graph(nodes, "global_pool", [helper.make_tensor_value_info("x", elem, ["batch", c, h, w])],
                              [helper.make_tensor_value_info(name, elem, ["batch", c, 1, 1]) for name in POOLS],
                              [numpy_helper.from_array(weight, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def pool_feed(shape: tuple[int, ...], dtype, seed: int = 0) -> np.ndarray:
    """N(0.5, 1) values rounded to fp16 (exact in fp32, TF32 and fp16); the offset keeps means away from zero, so
    a relative tolerance means something."""
    x = np.random.default_rng(seed).standard_normal(shape) + 0.5
    return x.astype(np.float16).astype(dtype)


def _launches(lowered, name: str) -> list[Launch]:
    (step,) = [s for s in lowered.steps if s.node.name == name]
    return [op for op in step.ops if isinstance(op, Launch)]


# -- without a GPU: the lowering's choice, emulated ----------------------------------------------------------------

#: (shape, dtype, strict NCHW fp32, {pool: the functions of its launches}, bands: grid z of the first launch)
CHOICES = [
    # batch 1: one block per channel group would read 12,544 positions alone; 112 bands of one row, then the bands
    ((1, 32, 112, 112), np.float16, False,
     {"gap": ["avg_pool_global_nhwc_f16"] * 2, "gmp": ["max_pool_global_nhwc_f16"] * 2,
      "avg_full": ["avg_pool_global_nhwc_f16"] * 2}, 112),
    ((4, 96, 56, 56), np.float16, False, {"gap": ["avg_pool_global_nhwc_f16"] * 2}, 56),
    # 20 channels: not a multiple of 8 fp16 (16 bytes), so one channel a lane; 5 runs of 4 fp32
    ((2, 20, 7, 7), np.float16, False,
     {"gap": ["avg_pool_global_nhwc_scalar_f16"], "gmp": ["max_pool_global_nhwc_scalar_f16"],
      "avg_full": ["avg_pool_global_nhwc_scalar_f16"]}, 1),
    ((2, 20, 7, 7), np.float32, False, {"gap": ["avg_pool_global_nhwc_f32"], "gmp": ["max_pool_global_nhwc_f32"]}, 1),
    # 5 groups of 32 runs x 3 images: a 7x7 window is short, no split
    ((3, 1152, 7, 7), np.float16, False, {"gap": ["avg_pool_global_nhwc_f16"]}, 1),
    # strict fp32: NCHW convolutions, so linear pools: a row reduction over 1,024 positions, pool2d over 49
    ((2, 8, 32, 32), np.float32, True, {"gap": ["reduce_rows_f32"], "gmp": ["reduce_max_rows_f32"],
                                        "avg_full": ["reduce_rows_f32"]}, 1),
    ((2, 8, 7, 7), np.float32, True, {"gap": ["avg_pool_f32"], "gmp": ["max_pool_f32"]}, 1),
]


@pytest.mark.parametrize("shape, dtype, strict, functions, bands", CHOICES)
def test_lowering_picks_the_global_kernel_and_emulates_like_the_cpu_backend(shape, dtype, strict, functions, bands):
    options = LoweringOptions(cudnn=True, strict_fp32_nchw=strict)
    graph, infos = _graph_and_infos(pool_model(shape, dtype), {"x": shape})
    lowered = lower_graph(graph, infos, None, options)
    assert lowered.layouts.get("h", "linear") == ("linear" if strict else "nhwc")
    for name, want in functions.items():
        launches = _launches(lowered, name)
        assert [launch.function for launch in launches] == want, name
        for launch in launches:
            assert launch.block[0] * launch.block[1] * launch.block[2] <= THREADS
        if launches[0].module == "pool" and "global" in launches[0].function:
            assert launches[0].grid[1:] == (shape[0], bands), (name, launches[0].grid)
            vec = 1 if "scalar" in want[0] else 16 // np.dtype(dtype).itemsize
            assert launches[0].grid[0] * launches[0].block[0] * vec >= shape[1]  # every channel has a lane
    feeds = {"x": pool_feed(shape, dtype)}
    got = Emulator(graph, lowered, feeds).run()
    want = GraphRunner(graph).run(feeds)
    for name in POOLS:
        np.testing.assert_allclose(got[name].astype(np.float32), want[name].astype(np.float32), rtol=2e-3, atol=1e-3,
                                   err_msg=name)


def test_padded_or_partial_windows_keep_the_windowed_kernels():
    """An AveragePool as large as the input but padded, or a MaxPool over part of it, is no global pool."""
    shape = (2, 16, 7, 7)
    n = helper.make_node
    nodes = [n("Conv", ["x", "w"], ["h"], name="conv"),
             n("AveragePool", ["h"], ["padded"], kernel_shape=[7, 7], pads=[1, 1, 1, 1], name="padded"),
             n("MaxPool", ["h"], ["part"], kernel_shape=[7, 6], name="part")]
    graph = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, list(shape))],
                              [helper.make_tensor_value_info("padded", TensorProto.FLOAT16, [2, 16, 3, 3]),
                               helper.make_tensor_value_info("part", TensorProto.FLOAT16, [2, 16, 1, 2])],
                              [numpy_helper.from_array(np.eye(16, dtype=np.float16).reshape(16, 16, 1, 1), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    graph, infos = _graph_and_infos(model, {"x": shape})
    lowered = lower_graph(graph, infos, None, LoweringOptions(cudnn=True))
    # graph outputs: pool2d (the channels-last kernel's 16-byte stores need arena outputs)
    assert [op.function for op in _launches(lowered, "padded")] == ["avg_pool_f16"]
    assert [op.function for op in _launches(lowered, "part")] == ["max_pool_f16"]
    feeds = {"x": pool_feed(shape, np.float16)}
    got, want = Emulator(graph, lowered, feeds).run(), GraphRunner(graph).run(feeds)
    for name in ("padded", "part"):
        np.testing.assert_allclose(got[name].astype(np.float32), want[name].astype(np.float32), rtol=2e-3, atol=1e-3)


# -- on the device --------------------------------------------------------------------------------------------------

#: the shapes of the brief: EfficientNet-B0's first squeeze-and-excitation pool at batch 1, a mid-network one at
#: batch 4, channels that are no multiple of 16 bytes, the last block's pool at batch 128
DEVICE_SHAPES = [(1, 32, 112, 112), (4, 96, 56, 56), (2, 20, 7, 7), (128, 1152, 7, 7)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", DEVICE_SHAPES)
@pytest.mark.parametrize("precision", ["fp16", "tf32", "fp32"])
def test_global_pools_match_the_cpu_backend(shape, precision):
    """fp16 and TF32 run the convolution channels-last (pool_band_nhwc); strict fp32 runs it NCHW (the row
    reduction for long windows). Max pools are exact; means differ by fp32 summation order, and in fp16 by the
    rounding of the band means (batch 1) and of the result."""
    from tests.cuda.test_backend_gpu import _build

    dtype = np.float16 if precision == "fp16" else np.float32
    model = pool_model(shape, dtype)
    flags = (kiln.BuilderFlag.TF32,) if precision == "tf32" else ()
    profile = {"x": (shape, shape, shape)}
    gpu = _build(model, "cuda", profile, flags)
    cpu = _build(model, "cpu", profile)
    feeds = {"x": pool_feed(shape, dtype)}
    got = gpu.create_execution_context().infer(feeds)
    want = cpu.create_execution_context().infer(feeds)
    tactics = {layer["name"]: layer["tactic"] for layer in gpu.plan.layers}
    assert tactics["gap"] == "kernel:GlobalAveragePool" and tactics["avg_full"] == "kernel:AveragePool", tactics
    np.testing.assert_array_equal(got["gmp"], want["gmp"])
    rtol, atol = (2e-3, 1e-3) if precision == "fp16" else (1e-5, 1e-6)
    for name in ("gap", "avg_full"):
        np.testing.assert_allclose(got[name].astype(np.float32), want[name].astype(np.float32), rtol=rtol, atol=atol,
                                   err_msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [(np.float32, 1e-5), (np.float16, 2e-3), (ml_dtypes.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("shape", [*DEVICE_SHAPES, (1, 8, 3, 5), (2, 1000, 1, 1), (3, 264, 9, 17)])
@pytest.mark.parametrize("op", ["GlobalAveragePool", "GlobalMaxPool"])
def test_band_kernel_matches_numpy_in_every_storage_type(op, shape, dtype, tol):
    from engine_core.cuda import driver

    x = pool_feed(shape, np.float32).astype(dtype)
    module, _, _, launches, buffers = device_setup(op, x)
    assert all("global" in launch.function for launch in launches), [launch.function for launch in launches]
    run_launches(module, launches, buffers, 0)
    driver.synchronize()
    got = buffers["y"].to_array(np.dtype(dtype), (shape[0], shape[1], 1, 1)).astype(np.float32)
    values = x.astype(np.float32)
    if op == "GlobalMaxPool":
        np.testing.assert_array_equal(got, values.max(axis=(2, 3), keepdims=True))
    else:
        np.testing.assert_allclose(got, values.mean(axis=(2, 3), keepdims=True), rtol=tol, atol=tol)
