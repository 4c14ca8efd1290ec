"""Throughput with and without dynamic batching, at client concurrency 1 / 8 / 64.

    python -m load_tests.batching_bench [--concurrency 1,8,64] [--kind KIND_CPU|KIND_GPU] [--json-file out.json]
    python -m load_tests.batching_bench --in-process --kind KIND_GPU     # scheduler + engine, no HTTP

Writes a repository with one MLP (FP32 [256] -> 1024 -> 256, ReLU) served twice: `mlp_direct` (each request
runs alone) and `mlp_batched` (`dynamic_batching`, max_batch_size 32, preferred 8/16/32, 500 us delay), starts
`python -m server` on it, and measures both with `load_tests.perf` (stable windows, real tritonclient workers).
Each row also shows inference_count / execution_count from the server's statistics: the average batch the
server actually ran. `--in-process` loads the same two model versions through the server's own loading path
(`server.core.model.load_model_version`) and drives their schedulers from asyncio clients directly: the figures
then show what batching does for the engine without HTTP and client costs (and need no web stack, so they run
where only numpy/onnx are installed, e.g. the GPU device).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from load_tests import harness

ROOT = Path(__file__).resolve().parents[1]
MODELS = {
    "mlp_direct": "",
    "mlp_batched": ("dynamic_batching { preferred_batch_size: [ 8, 16, 32 ] "
                    "max_queue_delay_microseconds: 500 }"),
}


def mlp_model(width: int = 256, hidden: int = 1024, seed: int = 0) -> onnx.ModelProto:
    """Y = relu(X @ W1 + b1) @ W2: enough work per item that batching has something to amortize."""
    rng = np.random.default_rng(seed)
    weights = [numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32), name)
               for name, shape in (("W1", (width, hidden)), ("W2", (hidden, width)))]
    weights.append(numpy_helper.from_array(np.zeros(hidden, np.float32), "b1"))
    nodes = [helper.make_node("MatMul", ["X", "W1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["r"]), helper.make_node("MatMul", ["r", "W2"], ["Y"])]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["n", width])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["n", width])], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def write_repository(directory: Path, kind: str) -> Path:
    data = mlp_model().SerializeToString()
    for name, batching in MODELS.items():
        (directory / name / "1").mkdir(parents=True, exist_ok=True)
        (directory / name / "1" / "model.onnx").write_bytes(data)
        (directory / name / "config.pbtxt").write_text(
            f'name: "{name}"\nmax_batch_size: 32\ninstance_group [{{ count: 1 kind: {kind} }}]\n{batching}\n')
    return directory


def start_server(repository: Path, http_port: int, log_path: Path, blas_threads: int) -> subprocess.Popen:
    """The server, with OpenBLAS limited to `blas_threads` per call: on a small shared CPU box, several
    multi-threaded GEMMs at once thrash (a batch-2 GEMM measured 23 ms instead of 0.5 ms on 2 loaded cores)."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": str(blas_threads), "OMP_NUM_THREADS": str(blas_threads)}
    command = harness.kiln_command(repository, [http_port, http_port + 1, http_port + 2], "--plan-cache-dir", "",
                                   "--drain-delay", "0")
    process = harness.start(command, log_path, env=env)
    try:
        harness.wait_ready(process, harness.http_ready(f"http://127.0.0.1:{http_port}/v2/health/ready"), log_path,
                           timeout_s=120, interval_s=0.2)
    except RuntimeError:
        process.terminate()
        raise
    return process


def counts(port: int, model: str) -> tuple[int, int]:
    import httpx

    stats = httpx.get(f"http://127.0.0.1:{port}/v2/models/{model}/stats", timeout=5).json()["model_stats"][0]
    return stats["inference_count"], stats["execution_count"]


def measure(port: int, model: str, concurrency: list[int], args: argparse.Namespace) -> list[dict]:
    from load_tests import perf

    rows = []
    for level in concurrency:
        before = counts(port, model)
        perf_args = perf.build_parser().parse_args([
            "-m", model, "-u", f"127.0.0.1:{port}", "--concurrency-range", f"{level}:{level}:1",
            "-p", str(args.interval_ms), "-r", str(args.max_trials), "--warmup", "0.5",
            "--processes", str(args.processes), "-q"])
        perf_args.argv = []
        result = perf.run(perf_args)["results"][0]
        after = counts(port, model)
        inferences, executions = after[0] - before[0], after[1] - before[1]
        rows.append({"model": model, "concurrency": level, "throughput": result["throughput_infer_per_s"], "errors": result["errors"],
                     "latency_us": result["latency_us"],
                     "avg_batch": round(inferences / executions, 2) if executions else None})
    return rows


async def _client_loop(scheduler, width: int, stop_at: float, latencies: list[float], seed: int) -> None:
    from server.core.scheduler import Job

    rng = np.random.default_rng(seed)
    while time.perf_counter() < stop_at:
        x = rng.standard_normal((1, width)).astype(np.float32)
        started = time.perf_counter()
        await scheduler.submit(Job({"X": x}, 1))
        latencies.append(time.perf_counter() - started)


async def _drive(version, level: int, seconds: float) -> tuple[float, list[float], int]:
    """Warm up, then `level` clients for `seconds`: (requests/s, latencies in s, executions the model ran)."""
    latencies: list[float] = []
    warm_until = time.perf_counter() + 0.3
    await asyncio.gather(*(_client_loop(version.scheduler, 256, warm_until, [], i) for i in range(level)))
    executions = version.statistics.execution_count
    started = time.perf_counter()
    await asyncio.gather(*(_client_loop(version.scheduler, 256, started + seconds, latencies, i)
                           for i in range(level)))
    elapsed = time.perf_counter() - started
    return len(latencies) / elapsed, latencies, version.statistics.execution_count - executions


async def _measure_version(model: str, version, levels: list[int], seconds: float) -> list[dict]:
    rows = []
    for level in levels:
        throughput, latencies, executions = await _drive(version, level, seconds)
        us = np.asarray(latencies) * 1e6
        rows.append({"model": model, "concurrency": level, "throughput": throughput, "errors": 0,
                     "latency_us": {"p50": float(np.percentile(us, 50)), "p99": float(np.percentile(us, 99))},
                     "avg_batch": round(len(latencies) / executions, 2) if executions else None,
                     "backend": version.engine.backend})
    return rows


def measure_in_process(repository: Path, levels: list[int], seconds: float) -> list[dict]:
    """Each model version loaded as the server loads it; its scheduler driven by `level` concurrent clients."""
    from server import plan_cache
    from server.core.model import load_model_version
    from server.core.model_config import parse_config_text
    from server.repository import read_source

    plan_cache.configure("")
    rows = []
    for model in MODELS:
        source = read_source(model, repository / model)
        version = load_model_version(source, 1, parse_config_text(source.config_text, model), 4)
        try:
            rows += asyncio.run(_measure_version(model, version, levels, seconds))  # one loop: schedulers bind to it
        finally:
            version.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m load_tests.batching_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,8,64", help="comma-separated client concurrency levels")
    parser.add_argument("--kind", default="KIND_CPU", choices=["KIND_CPU", "KIND_GPU", "KIND_AUTO"])
    parser.add_argument("--interval-ms", type=int, default=2000)
    parser.add_argument("--max-trials", type=int, default=5)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--port", type=int, default=18300)
    parser.add_argument("--blas-threads", type=int, default=1, help="OPENBLAS_NUM_THREADS for the server")
    parser.add_argument("--json-file", default=None)
    parser.add_argument("--in-process", action="store_true", help="drive the schedulers directly (no server)")
    parser.add_argument("--seconds", type=float, default=3.0, help="--in-process: measured seconds per level")
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory(prefix="kiln-batching-bench-") as tmp:
        repository = write_repository(Path(tmp) / "models", args.kind)
        if args.in_process:
            rows = measure_in_process(repository, levels, args.seconds)
        else:
            server = start_server(repository, args.port, Path(tmp) / "server.log", args.blas_threads)
            try:
                rows = [row for model in MODELS for row in measure(args.port, model, levels, args)]
            finally:
                server.terminate()
                server.wait(timeout=30)
    print(f"{'model':<12} {'conc':>5} {'infer/s':>9} {'p50 us':>9} {'p99 us':>9} {'avg batch':>9}")
    for row in rows:
        latency = row["latency_us"]
        print(f"{row['model']:<12} {row['concurrency']:>5} {row['throughput']:>9.1f} {latency.get('p50', 0):>9.0f} "
              f"{latency.get('p99', 0):>9.0f} {row['avg_batch'] or 0:>9}")
    if args.json_file:
        Path(args.json_file).write_text(json.dumps({"kind": args.kind, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
