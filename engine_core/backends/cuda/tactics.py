"""Tactic selection: time each candidate implementation of a layer and keep the fastest.

The timer is a parameter so the choice logic is testable without a GPU (a fake timer), and the
builder passes a CUDA-event timer on the device. A candidate that fails to run is skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np

from engine_core.backends.cuda.lowering import GEMM_TACTICS, Gemm

Timer = Callable[[str], float]


def choose_tactic(candidates: Sequence[str], timer: Timer) -> tuple[str, dict[str, float]]:
    """(fastest candidate, milliseconds per candidate); failures are recorded as inf."""
    if not candidates:
        raise ValueError("no candidate tactics")
    times: dict[str, float] = {}
    for name in candidates:
        try:
            times[name] = float(timer(name))
        except Exception:
            times[name] = float("inf")
    best = min(candidates, key=lambda n: (times[n], candidates.index(n)))
    if times[best] == float("inf"):
        best = candidates[0]
    return best, times


def time_first_runnable(candidates: Iterable[int], timer: Callable[[int], float], limit: int) -> dict[int, float]:
    """Milliseconds of the first ``limit`` candidates (in order) that run; one whose timer raises (a cuDNN plan
    deselected for its numerics, or one that does not build here) is skipped and does not count. Why: strict fp32
    deselects cuDNN's tensor-core plans, which head the heuristics' order, so timing the first ``limit`` indices
    timed none of them and the build kept an untimed plan."""
    times: dict[int, float] = {}
    for candidate in candidates:
        if len(times) >= limit:
            break
        try:
            times[candidate] = float(timer(candidate))
        except Exception:
            continue
    return times


def gemm_timer(op: Gemm, gemm_function, repeats: int = 10) -> Timer:
    """A timer running ``op`` with random operands (the shapes the builder picked: each profile's opt)."""
    from cuda.bindings import driver

    from engine_core.backends.cuda.cublas import Cublas
    from engine_core.backends.cuda.gemm import run_kiln_gemm
    from engine_core.cuda.driver import DeviceBuffer, check

    rng = np.random.default_rng(0)

    def operand(rows: int, cols: int, batch_stride: int) -> DeviceBuffer:
        count = rows * cols + batch_stride * (op.batch - 1)
        return DeviceBuffer.from_array(rng.standard_normal(count).astype(np.float32))

    a, b = operand(op.m, op.k, op.a_strides[2]), operand(op.k, op.n, op.b_strides[2])
    y = DeviceBuffer(op.m * op.n * op.batch * 4)
    stream = int(check(driver.cuStreamCreate(0), "cuStreamCreate"))
    cublas: list[Cublas] = []

    def run(tactic: str) -> None:
        if tactic == "cublas":
            if not cublas:
                cublas.append(Cublas())
            cublas[0].gemm(a.ptr, b.ptr, y.ptr, op.m, op.n, op.k, op.batch, op.trans_a, op.trans_b,
                           op.a_strides[2], op.b_strides[2], op.alpha, 0.0, stream)
        else:
            run_kiln_gemm(gemm_function, op, a.ptr, b.ptr, y.ptr, stream)

    def timer(tactic: str) -> float:
        start = check(driver.cuEventCreate(0), "cuEventCreate")
        stop = check(driver.cuEventCreate(0), "cuEventCreate")
        run(tactic)  # warm-up (library initialisation, caches)
        check(driver.cuEventRecord(start, stream), "cuEventRecord")
        for _ in range(repeats):
            run(tactic)
        check(driver.cuEventRecord(stop, stream), "cuEventRecord")
        check(driver.cuEventSynchronize(stop), "cuEventSynchronize")
        ms = check(driver.cuEventElapsedTime(start, stop), "cuEventElapsedTime")
        return float(ms) / repeats

    return timer


__all__ = ["GEMM_TACTICS", "choose_tactic", "gemm_timer", "time_first_runnable"]
