"""Channels-last global pooling on the GPU: pool.cu's pool_band_nhwc against pool2d_nhwc, the per-output kernel it
replaced (a thread per 16-byte run of an output walking the whole window), on the same fp16 input.

    python -m bench.global_pool [--out bench/results]

Each shape's GlobalAveragePool is lowered on its own (the launches the CUDA backend makes for a channels-last input)
and both kernels' launches are timed with CUDA events over 50 runs after a warm one; prints microseconds, the band
kernel's launches and bandwidth, and the speed-up, and writes ``global_pool_<time>.json``. The device helpers here
are also what tests/cuda/test_global_pool_gpu.py checks the kernels' values with.
"""

from __future__ import annotations

import argparse
import ctypes
from typing import Any

import numpy as np

from engine_core.backends.cuda.lower_rules.pool import PoolGeom, _pool_geom
from engine_core.backends.cuda.lowering_context import (
    LOWERING_RULES,
    THREADS,
    Launch,
    LoweringContext,
    LoweringOptions,
    Ref,
    grid_for,
)
from engine_core.ir import Node
from engine_core.ops import TensorInfo

#: EfficientNet-B0's first squeeze-and-excitation pool at batch 1 and its last block's, at batch 1 and 128
SHAPES = [(1, 32, 112, 112), (1, 1152, 7, 7), (128, 32, 112, 112), (128, 1152, 7, 7)]


def lower_one(op: str, shape: tuple[int, int, int, int], dtype) -> tuple[LoweringContext, Node, list[Launch]]:
    """One channels-last pool lowered on its own: its context (tensor infos, scratch), node and launches."""
    n, c, h, w = shape
    attrs = {"kernel_shape": [h, w]} if op == "AveragePool" else {}
    node = Node(op, ["x"], ["y"], attrs, "pool", "", 17)
    infos = {"x": TensorInfo(np.dtype(dtype), shape), "y": TensorInfo(np.dtype(dtype), (n, c, 1, 1))}
    ctx = LoweringContext(infos, frozenset(), {}, LoweringOptions(), {}, layouts={"x": "nhwc"})
    return ctx, node, LOWERING_RULES[op](node, ctx)


def run_launches(module: Any, launches: list[Launch], buffers: dict, stream: int) -> None:
    """The launches as the runner makes them (a parameter block of addresses: the geometry struct by value)."""
    from engine_core.backends.cuda.runner_binding import _PreparedLaunch

    for op in launches:
        _PreparedLaunch(op, module.function(op.function)).run(lambda ref: buffers[ref.tensor].ptr + ref.offset,
                                                             stream)


def device_setup(op: str, x: np.ndarray) -> tuple[Any, LoweringContext, Node, list[Launch], dict]:
    """The pool module, the lowered launches for ``x`` (NCHW values) and device buffers (x stored channels-last)."""
    from engine_core.cuda import driver
    from engine_core.cuda.driver import DeviceBuffer, Module
    from engine_core.cuda.nvrtc import compile_kernel_file

    major, minor = driver.compute_capability()
    module = Module(compile_kernel_file("pool", arch=f"sm_{major}{minor}"))
    ctx, node, launches = lower_one(op, x.shape, x.dtype)
    buffers = {"x": DeviceBuffer.from_array(np.ascontiguousarray(x.transpose(0, 2, 3, 1)))}
    for name in ["y", *ctx.scratch]:
        info = ctx.infos[name]
        buffers[name] = DeviceBuffer(int(np.prod(info.shape)) * info.dtype.itemsize)
    return module, ctx, node, launches, buffers


def device_ms(module: Any, launches: list[Launch], buffers: dict, runs: int = 50) -> float:
    """Milliseconds per run of ``launches`` (CUDA events on a stream of their own, after one warm run)."""
    from engine_core.cuda.driver import EventTimer, Stream

    stream = Stream()
    run_launches(module, launches, buffers, stream.handle)
    timer = EventTimer(stream.handle)
    timer.start()
    for _ in range(runs):
        run_launches(module, launches, buffers, stream.handle)
    return timer.stop() / runs


def compare(shape: tuple[int, int, int, int]) -> dict[str, Any]:
    """pool2d_nhwc and pool_band_nhwc on one fp16 shape: both times, the band kernel's launches and bandwidth."""
    x = (np.random.default_rng(0).standard_normal(shape) + 0.5).astype(np.float16)
    module, ctx, node, launches, buffers = device_setup("GlobalAveragePool", x)
    runs = shape[0] * shape[1] // 8
    old = [Launch("pool", "avg_pool_nhwc_f16", grid_for(runs), (THREADS, 1, 1),
                  [(Ref("x"), ctypes.c_void_p), (Ref("y"), ctypes.c_void_p), (_pool_geom(node, ctx), PoolGeom)])]
    old_ms, new_ms = device_ms(module, old, buffers), device_ms(module, launches, buffers)
    return {"shape": list(shape), "pool2d_nhwc_us": old_ms * 1e3, "pool_band_nhwc_us": new_ms * 1e3,
            "speedup": old_ms / new_ms, "band_launches": len(launches), "band_gb_per_s": x.nbytes / new_ms / 1e6}


def main(argv: list[str] | None = None) -> int:
    from bench.engine import write_results
    from engine_core.cuda.driver import device_name

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    rows = [compare(shape) for shape in SHAPES]
    print(f"{'shape':>22} {'pool2d_nhwc us':>15} {'band us':>9} {'x':>6} {'launches':>8} {'GB/s':>6}")
    for r in rows:
        print(f"{str(tuple(r['shape'])):>22} {r['pool2d_nhwc_us']:>15.1f} {r['pool_band_nhwc_us']:>9.1f} "
              f"{r['speedup']:>6.2f} {r['band_launches']:>8} {r['band_gb_per_s']:>6.0f}")
    write_results(args.out, "global_pool", {"device": device_name(), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
