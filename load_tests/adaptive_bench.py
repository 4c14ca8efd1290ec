"""Latency with traffic-adaptive profiles vs one profile, on mixed-length traffic (CPU or GPU backend).

    python -m load_tests.adaptive_bench [--seconds 8] [--concurrency 8,32] [--kind KIND_CPU|KIND_GPU]

A token MLP (X [n, s, 64] -> 256 -> 64 per token, ReLU) gets traffic whose lengths are 80% short (8..32
tokens) and 20% long (384..512). Three set-ups run the same seeded traffic through the server's own loading
path and dynamic batcher (in process, no HTTP, so the figures are the engine + batcher's):

* `exact`: dynamic batching without padding: only requests of equal length share a batch.
* `padded-1-profile`: `kiln_pad_batch`: requests are padded to the longest one in their batch; one profile
  (1..4096 tokens), so a short request may be padded to 512.
* `padded-adaptive`: the histogram the model recorded during the `padded-1-profile` run is fitted into
  profiles (`server.core.adaptive.fit_profiles`, as `--adaptive-profiles` does) and the plan rebuilt with
  them; requests are only padded together within a profile.

Per set-up: throughput, p50/p99 latency of short and of long requests, the average batch, and padding waste
(token rows executed / token rows requested). Prints a table and writes bench/results/adaptive_<time>.json.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # one BLAS thread per worker: what serving uses

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WIDTH, HIDDEN = 64, 256
SHORT, LONG = (8, 32), (384, 512)
LONG_SHARE = 0.2


def token_mlp(seed: int = 0) -> onnx.ModelProto:
    """Y = relu(X @ W1) @ W2 per token: work proportional to the (padded) token count."""
    rng = np.random.default_rng(seed)
    weights = [numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32), name)
               for name, shape in (("W1", (WIDTH, HIDDEN)), ("W2", (HIDDEN, WIDTH)))]
    nodes = [helper.make_node("MatMul", ["X", "W1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "W2"], ["Y"])]
    graph = helper.make_graph(nodes, "tokens",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["n", "s", WIDTH])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["n", "s", WIDTH])], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def config(name: str, pad: bool, kind: str) -> str:
    parameters = 'parameters { key: "kiln_pad_batch" value: { string_value: "true" } }' if pad else ""
    return (f'name: "{name}"\nmax_batch_size: 8\n'
            f'input [{{ name: "X" data_type: TYPE_FP32 dims: [ -1, {WIDTH} ] }}]\n'
            f'output [{{ name: "Y" data_type: TYPE_FP32 dims: [ -1, {WIDTH} ] }}]\n'
            f'instance_group [{{ count: 2 kind: {kind} }}]\n'
            f'dynamic_batching {{ max_queue_delay_microseconds: 2000 }}\n{parameters}\n')


def load(repository: Path, name: str, pad: bool, kind: str, profiles=None):
    """One model version, loaded exactly as the server loads it (optionally with fitted profiles)."""
    from server.core.model import load_model_version
    from server.core.model_config import parse_config_text
    from server.repository import read_source

    directory = repository / name
    (directory / "1").mkdir(parents=True, exist_ok=True)
    onnx.save(token_mlp(), directory / "1" / "model.onnx")
    (directory / "config.pbtxt").write_text(config(name, pad, kind))
    source = read_source(name, directory)
    return load_model_version(source, 1, parse_config_text(source.config_text, name), 4, profiles)


class TokenCounter:
    """Wraps the batcher's executors to count token rows executed (padding included): `execute` runs padded
    batches, `execute_parts` batches of equal shapes (the engine gathers them)."""

    def __init__(self, execute, execute_parts) -> None:
        self.execute, self.execute_parts = execute, execute_parts
        self.rows = 0

    def __call__(self, context, inputs):
        x = inputs["X"]
        self.rows += x.shape[0] * x.shape[1]
        return self.execute(context, inputs)

    def parts(self, context, parts, destinations=None):
        self.rows += sum(p["X"].shape[0] * p["X"].shape[1] for p in parts)
        return self.execute_parts(context, parts, destinations)


async def _client(version, seed: int, stop_at: float, record: list[tuple[bool, float, int]]) -> None:
    from server.core.scheduler import Job

    rng = np.random.default_rng(seed)
    while time.perf_counter() < stop_at:
        long = rng.random() < LONG_SHARE
        n = int(rng.integers(*(LONG if long else SHORT), endpoint=True))
        x = rng.standard_normal((1, n, WIDTH)).astype(np.float32)
        version.traffic.record({"X": x})  # what ServerCore does for every request
        started = time.perf_counter()
        await version.scheduler.submit(Job({"X": x}, 1))
        record.append((long, time.perf_counter() - started, n))


async def drive(version, concurrency: int, seconds: float, seed: int) -> dict:
    scheduler = version.scheduler
    counter = scheduler._execute
    if not isinstance(counter, TokenCounter):  # bench-only hook: the padding waste is otherwise invisible
        counter = scheduler._execute = TokenCounter(scheduler._execute, scheduler._execute_parts)
        scheduler._execute_parts = counter.parts
    warm: list = []
    await asyncio.gather(*(_client(version, seed + i, time.perf_counter() + 0.5, warm) for i in range(concurrency)))
    counter.rows, executions = 0, version.statistics.execution_count
    record: list[tuple[bool, float, int]] = []
    started = time.perf_counter()
    await asyncio.gather(*(_client(version, seed + 100 + i, started + seconds, record) for i in range(concurrency)))
    elapsed = time.perf_counter() - started
    executed = version.statistics.execution_count - executions
    row = {"concurrency": concurrency, "requests": len(record), "throughput": round(len(record) / elapsed, 1),
           "avg_batch": round(len(record) / executed, 2) if executed else None,
           "padding_waste": round(counter.rows / max(sum(n for _, _, n in record), 1), 2),
           "profiles": version.engine.num_optimization_profiles, "backend": version.engine.backend}
    for label, is_long in (("short", False), ("long", True)):
        ms = np.array([t for flag, t, _ in record if flag == is_long]) * 1e3
        row[f"{label}_p50_ms"] = round(float(np.percentile(ms, 50)), 2) if ms.size else None
        row[f"{label}_p99_ms"] = round(float(np.percentile(ms, 99)), 2) if ms.size else None
    return row


def run(levels: list[int], seconds: float, kind: str) -> list[dict]:
    from server import plan_cache
    from server.core.adaptive import describe, fit_profiles

    plan_cache.configure("")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="kiln-adaptive-") as tmp:
        repository = Path(tmp)
        exact = load(repository, "exact", False, kind)
        padded = load(repository, "padded", True, kind)
        rows += asyncio.run(drive_levels("exact", exact, levels, seconds))  # one loop per version: the
        rows += asyncio.run(drive_levels("padded-1-profile", padded, levels, seconds))  # batcher binds to it
        fitted = fit_profiles(padded.traffic, padded.profile_ranges(), 4)
        print(f"fitted to {padded.traffic.requests} requests: {describe(fitted)}")
        adaptive = load(repository, "padded", True, kind, fitted)
        rows += asyncio.run(drive_levels("padded-adaptive", adaptive, levels, seconds))
        for version in (exact, padded, adaptive):
            version.close()
    return rows


async def drive_levels(setup: str, version, levels: list[int], seconds: float) -> list[dict]:
    return [{"setup": setup, **await drive(version, level, seconds, 1)} for level in levels]


def print_table(rows: list[dict]) -> None:
    columns = ["setup", "concurrency", "profiles", "throughput", "avg_batch", "padding_waste", "short_p50_ms",
               "short_p99_ms", "long_p50_ms", "long_p99_ms"]
    print(" | ".join(f"{c:>16}" for c in columns))
    for row in sorted(rows, key=lambda r: (r["concurrency"], r["setup"])):
        print(" | ".join(f"{row[c]!s:>16}" for c in columns))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--concurrency", default="8,32")
    parser.add_argument("--kind", default="KIND_CPU", choices=["KIND_CPU", "KIND_GPU"])
    parser.add_argument("--json-file", help="default: bench/results/adaptive_<time>.json")
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    rows = run(levels, args.seconds, args.kind)
    print_table(rows)
    path = Path(args.json_file or ROOT / "bench" / "results" / f"adaptive_{time.strftime('%Y%m%dT%H%M%S')}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    command = "python -m load_tests.adaptive_bench " + " ".join(argv if argv is not None else os.sys.argv[1:])
    path.write_text(json.dumps({"command": command.strip(), "seconds": args.seconds, "rows": rows}, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
