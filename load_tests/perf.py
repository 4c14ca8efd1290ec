"""`kiln perf` / `python -m load_tests.perf`: a perf_analyzer-style load generator for KServe v2 servers.

    python -m load_tests.perf -m simple_cnn -u 127.0.0.1:8000 --concurrency-range 1:64:x2 --json-file out.json
    python -m load_tests.perf -m add_sub -i grpc -u 127.0.0.1:8001 --request-rate-range 100:400:100

For each load level it warms up, then measures windows of `--measurement-interval` ms until the throughput of
the last 3 windows is within `--stability-percentage` of their mean (or `--max-trials` windows), and reports the
last 3 windows together: throughput, p50/p90/p95/p99 latency, the server's queue/compute split (delta of the
statistics extension over those windows) and the client's CPU use. Requests come from `--processes` worker
processes (load_tests/worker.py) so one Python client process is never the bottleneck; a worker above 90 % of a
core is flagged. Everything is bounded: windows, per-request timeout, drain time; targets are 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import csv
import json
import multiprocessing as mp
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from load_tests import shm
from load_tests.stats import is_stable, latency_summary_us, server_split
from load_tests.worker import InputSpec, WorkerConfig, worker_main

LOCAL_HOSTS = ("127.0.0.1", "localhost")
STABLE_WINDOWS = 3
CLIENT_BUSY = 0.9  # a worker using more than this share of a core may be limiting the measurement
READY_TIMEOUT_S = 60.0


# ----------------------------------------------------------------------------------------------- arguments

def parse_range(text: str) -> list[float]:
    """`start:end:step` -> the levels; step `xN` multiplies, `N` adds; `start` alone is one level; `a,b,c` lists
    the levels themselves.

    `1:64:x2` -> 1, 2, 4, ..., 64; `1,16,64` -> 1, 16, 64. Bounded: at most 64 levels.
    """
    if "," in text:
        return _parse_list(text)
    parts = text.split(":")
    start = float(parts[0])
    end = float(parts[1]) if len(parts) > 1 else start
    step = parts[2] if len(parts) > 2 else "1"
    multiply = step.startswith("x")
    factor = float(step[1:] if multiply else step)
    if start <= 0 or end < start or (multiply and factor <= 1) or (not multiply and factor <= 0):
        raise argparse.ArgumentTypeError(f"bad range '{text}': want start:end[:step|:xfactor] with 0 < start <= end")
    levels, value = [], start
    while value <= end * (1 + 1e-9) and len(levels) < 64:
        levels.append(value)
        value = value * factor if multiply else value + factor
    return levels


def _parse_list(text: str) -> list[float]:
    try:
        levels = [float(item) for item in text.split(",") if item.strip()]
    except ValueError:
        levels = []
    if not levels or any(level <= 0 for level in levels) or len(levels) > 64:
        raise argparse.ArgumentTypeError(f"bad level list '{text}': want up to 64 positive numbers, comma-separated")
    return levels


def parse_shape(text: str) -> tuple[str, tuple[int, ...]]:
    name, _, dims = text.rpartition(":")
    if not name:
        raise argparse.ArgumentTypeError(f"bad --shape '{text}': want NAME:d1,d2,...")
    return name, tuple(int(d) for d in dims.split(",") if d)


def local_url(text: str) -> str:
    """`host:port` (tritonclient's form) restricted to this machine."""
    host = urlsplit(f"//{text}").hostname
    if host not in LOCAL_HOSTS:
        raise argparse.ArgumentTypeError(f"only 127.0.0.1 targets are allowed, got '{text}'")
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kiln perf", description=__doc__.splitlines()[0])
    p.add_argument("-m", "--model-name", required=True)
    p.add_argument("-x", "--model-version", default="")
    p.add_argument("-u", "--url", type=local_url, default="127.0.0.1:8000", help="host:port (127.0.0.1 only)")
    p.add_argument("-i", "--protocol", choices=["http", "grpc"], default="http")
    p.add_argument("--input-tensor-format", choices=["binary", "json"], default="binary",
                   help="HTTP tensor encoding of inputs and outputs (gRPC is always binary)")
    p.add_argument("--response-compression", choices=["none", "gzip", "deflate"], default="none",
                   help="HTTP: the Accept-Encoding to send (default none, as perf_analyzer)")
    p.add_argument("--shared-memory", choices=list(shm.KINDS), default="none",
                   help="tensors in system (/dev/shm) or CUDA shared memory, registered once per client process "
                        "(perf_analyzer's --shared-memory)")
    p.add_argument("--output-shared-memory-size", type=int, default=shm.DEFAULT_OUTPUT_BYTES, metavar="BYTES",
                   help="region size of an output whose size the metadata does not fix (default 102400)")
    p.add_argument("--input-data", choices=["random", "zero"], default="random",
                   help="input values: random (integers 0..99) or all zeros (e.g. valid token ids and masks)")
    p.add_argument("-b", "--batch-size", type=int, default=1, help="replaces a leading -1 dim of each input")
    p.add_argument("--shape", type=parse_shape, action="append", default=[], metavar="NAME:D1,D2",
                   help="full shape of an input (repeatable); needed for dynamic dims other than the batch")
    p.add_argument("--input", dest="only_inputs", action="append", default=[], metavar="NAME",
                   help="send only these inputs (default: all in the model metadata)")
    p.add_argument("--output", dest="only_outputs", action="append", default=[], metavar="NAME",
                   help="request only these outputs (default: all)")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency-range", type=parse_range, default=None, metavar="START:END:STEP")
    load.add_argument("--request-rate-range", "--request-rate", dest="request_rate_range", type=parse_range,
                      default=None, metavar="START:END:STEP", help="open-loop Poisson arrivals, req/s")
    p.add_argument("-p", "--measurement-interval", type=int, default=2000, metavar="MS")
    p.add_argument("--warmup", type=float, default=1.0, metavar="S", help="seconds of load before measuring")
    p.add_argument("-s", "--stability-percentage", type=float, default=10.0)
    p.add_argument("-r", "--max-trials", type=int, default=10, help="max measurement windows per level")
    p.add_argument("--processes", type=int, default=max(1, min(4, os.cpu_count() or 1)),
                   help="client worker processes")
    p.add_argument("--priority", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=30.0, metavar="S")
    p.add_argument("-f", "--latency-report-file", default=None, metavar="CSV")
    p.add_argument("--json-file", default=None)
    p.add_argument("--label", default="", help="name stored in the JSON (e.g. the server under test)")
    p.add_argument("-q", "--quiet", action="store_true", help="no live progress on stderr")
    return p


# ----------------------------------------------------------------------------------------------- target

class Target:
    """Sync tritonclient for metadata and statistics (never on the request path)."""

    def __init__(self, url: str, protocol: str):
        self.protocol = protocol
        if protocol == "grpc":
            import tritonclient.grpc as module
        else:
            import tritonclient.http as module
        self.client = module.InferenceServerClient(url)

    def wait_ready(self, model: str, version: str, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if self.client.is_model_ready(model, version):
                    return
            except Exception:
                pass
            time.sleep(0.2)
        raise SystemExit(f"model '{model}' not ready at the target after {timeout_s:.0f} s")

    def metadata(self, model: str, version: str) -> dict[str, Any]:
        if self.protocol == "grpc":
            return self.client.get_model_metadata(model, version, as_json=True)
        return self.client.get_model_metadata(model, version)

    def max_batch_size(self, model: str, version: str) -> int | None:
        """The model config's max_batch_size, or None where the server has no model-configuration API."""
        try:
            if self.protocol == "grpc":
                config = self.client.get_model_config(model, version, as_json=True)["config"]
                return int(config.get("max_batch_size", config.get("maxBatchSize", 0)))
            return int(self.client.get_model_config(model, version).get("max_batch_size", 0))
        except Exception:
            return None

    def statistics(self, model: str, version: str) -> dict[str, Any] | None:
        """The statistics extension's answer, or None where the server has none (e.g. MLServer)."""
        try:
            if self.protocol == "grpc":
                return self.client.get_inference_statistics(model, version, as_json=True)
            return self.client.get_inference_statistics(model, version)
        except Exception:
            return None

    def close(self) -> None:
        self.client.close()


def input_specs(metadata: dict[str, Any], batch_size: int, shapes: dict[str, tuple[int, ...]],
                only: list[str], batching: bool = True) -> tuple[InputSpec, ...]:
    """Inputs to send: `--shape` wins; else a leading -1 of a batching model becomes the batch size; other -1: error.

    `batching` is False for a model whose config says max_batch_size 0 (its -1 dims are data dims).
    """
    specs = []
    for entry in metadata.get("inputs", []):
        name = entry["name"]
        if only and name not in only:
            continue
        shape = shapes.get(name)
        if shape is None:
            dims = [int(d) for d in entry.get("shape", [])]
            if batching and dims and dims[0] == -1:
                dims[0] = batch_size
            if any(d < 0 for d in dims):
                raise SystemExit(f"input '{name}' has dynamic dims {entry.get('shape')}: give --shape {name}:D1,D2")
            shape = tuple(dims)
        specs.append(InputSpec(name, entry["datatype"], shape))
    if not specs:
        raise SystemExit("no inputs to send (check --input names against the model metadata)")
    return tuple(specs)


# ----------------------------------------------------------------------------------------------- workers

@dataclass
class WorkerPool:
    """The client processes and their pipes."""

    processes: list[mp.Process]
    pipes: list[Connection]

    @classmethod
    def start(cls, configs: list[WorkerConfig]) -> WorkerPool:
        ctx = mp.get_context("spawn")  # a fresh interpreter: no inherited event loop or sockets
        pool = cls([], [])
        for config in configs:
            parent, child = ctx.Pipe()
            process = ctx.Process(target=worker_main, args=(config, child), daemon=True)
            process.start()
            pool.processes.append(process)
            pool.pipes.append(parent)
        pool.gather("ready")
        return pool

    def gather(self, expect: str, timeout_s: float = READY_TIMEOUT_S) -> list[Any]:
        answers = []
        for pipe in self.pipes:
            if not pipe.poll(timeout_s):
                raise RuntimeError(f"a client worker did not answer '{expect}' within {timeout_s:.0f} s")
            kind, payload = pipe.recv()
            if kind == "error":
                raise RuntimeError(f"client worker failed: {payload}")
            answers.append(payload)
        return answers

    def load(self, shares: list[dict[str, float]]) -> None:
        for pipe, share in zip(self.pipes, shares):
            pipe.send(("load", share))
        self.gather("loading")

    def collect(self) -> list[dict[str, Any]]:
        for pipe in self.pipes:
            pipe.send(("collect",))
        return self.gather("collected")

    def idle(self) -> None:
        for pipe in self.pipes:
            pipe.send(("idle",))
        self.gather("idle")

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(("exit",))
            except OSError:
                pass
        for process in self.processes:
            process.join(timeout=15)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)


def split_level(mode: str, level: float, workers: int) -> list[dict[str, float]]:
    """Share a concurrency (integers, as even as possible) or a rate (evenly) among the workers."""
    if mode == "concurrency":
        k = int(level)
        return [{"concurrency": k // workers + (1 if i < k % workers else 0)} for i in range(workers)]
    return [{"rate": level / workers} for _ in range(workers)]


# ----------------------------------------------------------------------------------------------- measurement

@dataclass
class Window:
    """One measurement window: finished-request records plus the client CPU and server statistics around it."""

    start_ns: int
    end_ns: int
    records: np.ndarray  # (n, 3): start_ns, end_ns, ok
    cpu_s: list[float]
    dropped: int
    stats_before: dict[str, Any] | None
    stats_after: dict[str, Any] | None

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    @property
    def ok(self) -> np.ndarray:
        return self.records[self.records[:, 2] == 1]

    @property
    def throughput(self) -> float:
        return len(self.ok) / self.seconds if self.seconds > 0 else 0.0


class Measurer:
    """Cuts the workers' record streams into windows at the parent's clock."""

    def __init__(self, pool: WorkerPool, stats: Callable[[], dict[str, Any] | None]):
        self.pool = pool
        self.stats = stats
        self.pending = np.empty((0, 3), dtype=np.int64)  # finished after the last cut: next window's
        self.cpu = [0.0] * len(pool.pipes)
        self.first_error = ""

    def _pull(self) -> tuple[np.ndarray, list[float], int]:
        answers = self.pool.collect()
        parts = [self.pending] + [np.frombuffer(a["records"], dtype=np.int64).reshape(-1, 3) for a in answers]
        cpu_now = [a["cpu_s"] for a in answers]
        used = [now - before for now, before in zip(cpu_now, self.cpu)]
        self.cpu = cpu_now
        self.first_error = self.first_error or next((a["error"] for a in answers if a["error"]), "")
        return np.concatenate(parts), used, sum(a["dropped"] for a in answers)

    def reset(self) -> int:
        """Drop everything so far (warm-up); returns the cut time."""
        self.pending = np.empty((0, 3), dtype=np.int64)
        self._pull()
        self.pending = np.empty((0, 3), dtype=np.int64)
        return time.monotonic_ns()

    def window(self, start_ns: int, seconds: float, stats_before: dict[str, Any] | None) -> Window:
        time.sleep(seconds)
        end_ns = time.monotonic_ns()
        stats_after = self.stats()
        records, cpu_used, dropped = self._pull()
        inside = records[:, 1] <= end_ns
        self.pending = records[~inside]
        return Window(start_ns, end_ns, records[inside], cpu_used, dropped, stats_before, stats_after)


def summarize(windows: list[Window], model: str, batch_size: int) -> dict[str, Any]:
    """One result row from the last (stable) windows taken together."""
    seconds = sum(w.seconds for w in windows)
    records = np.concatenate([w.records for w in windows])
    ok = records[records[:, 2] == 1]
    cpu = np.sum([w.cpu_s for w in windows], axis=0) / seconds
    split = server_split(windows[0].stats_before, windows[-1].stats_after, model)
    return {
        "requests_per_s": len(ok) / seconds,
        "throughput_infer_per_s": len(ok) * batch_size / seconds,
        "latency_us": latency_summary_us(ok[:, 1] - ok[:, 0]),
        "requests": int(len(ok)),
        "errors": int(len(records) - len(ok)),
        "dropped": int(sum(w.dropped for w in windows)),
        "measured_s": seconds,
        "server": split.as_dict() if split else None,
        "client": {"processes": len(cpu), "cpu_cores": float(cpu.sum()), "max_process_cpu": float(cpu.max()),
                   "client_bound": bool(cpu.max() > CLIENT_BUSY)},
    }


def measure_level(measurer: Measurer, mode: str, level: float, args: argparse.Namespace,
                  progress: Callable[[str], None]) -> dict[str, Any]:
    """Warm up, then windows until stable or `--max-trials`; the result merges the last 3 windows."""
    pool = measurer.pool
    pool.load(split_level(mode, level, len(pool.pipes)))
    try:
        time.sleep(args.warmup)
        start = measurer.reset()
        stats = measurer.stats()
        windows: list[Window] = []
        for trial in range(1, args.max_trials + 1):
            window = measurer.window(start, args.measurement_interval / 1000.0, stats)
            windows.append(window)
            start, stats = window.end_ns, window.stats_after
            p99 = latency_summary_us(window.ok[:, 1] - window.ok[:, 0]).get("p99", float("nan"))
            progress(f"  {mode} {level:g}: window {trial}: {window.throughput:9.1f} req/s  p99 {p99:9.0f} us  "
                     f"errors {len(window.records) - len(window.ok)}  client cpu {sum(window.cpu_s) / window.seconds:.2f}")
            if is_stable([w.throughput for w in windows], STABLE_WINDOWS, args.stability_percentage / 100.0):
                break
    finally:
        pool.idle()
    row = {mode: level if mode == "request_rate" else int(level), **summarize(windows[-STABLE_WINDOWS:],
                                                                             args.model_name, args.batch_size)}
    row["stable"] = is_stable([w.throughput for w in windows], STABLE_WINDOWS, args.stability_percentage / 100.0)
    row["windows"] = len(windows)
    row["first_error"], measurer.first_error = measurer.first_error, ""
    if row["first_error"]:
        progress(f"  first error: {row['first_error']}")
    return row


# ----------------------------------------------------------------------------------------------- export

CSV_COLUMNS = ["level", "requests_per_s", "throughput_infer_per_s", "p50_us", "p90_us", "p95_us", "p99_us", "avg_us",
               "errors", "server_queue_us", "server_compute_input_us", "server_compute_infer_us",
               "server_compute_output_us", "client_cpu_cores", "stable"]


def csv_rows(results: list[dict[str, Any]]) -> Iterator[list[Any]]:
    for r in results:
        lat, server = r["latency_us"], r["server"] or {}
        yield [r.get("concurrency", r.get("request_rate")), f"{r['requests_per_s']:.2f}",
               f"{r['throughput_infer_per_s']:.2f}", *(f"{lat.get(k, 0):.0f}" for k in ("p50", "p90", "p95", "p99", "avg")),
               r["errors"], *(f"{server.get(k, 0):.1f}" if server else "" for k in
                              ("queue_us", "compute_input_us", "compute_infer_us", "compute_output_us")),
               f"{r['client']['cpu_cores']:.2f}", r["stable"]]


def write_csv(path: str, results: list[dict[str, Any]]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        writer.writerows(csv_rows(results))


def print_table(results: list[dict[str, Any]], out=sys.stdout) -> None:
    print(f"{'level':>8} {'req/s':>10} {'p50 us':>9} {'p90 us':>9} {'p95 us':>9} {'p99 us':>9} {'queue us':>9} "
          f"{'infer us':>9} {'cli cpu':>7} {'err':>5}", file=out)
    for r in results:
        lat, server = r["latency_us"], r["server"] or {}
        level = r.get("concurrency", r.get("request_rate"))
        print(f"{level:>8g} {r['requests_per_s']:>10.1f} " + " ".join(f"{lat.get(k, 0):>9.0f}" for k in
              ("p50", "p90", "p95", "p99")) + f" {server.get('queue_us', float('nan')):>9.0f} "
              f"{server.get('compute_infer_us', float('nan')):>9.0f} {r['client']['cpu_cores']:>7.2f} {r['errors']:>5}",
              file=out)


# ----------------------------------------------------------------------------------------------- main

def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every level; returns the JSON document (also written to the files asked for)."""
    progress = (lambda _msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    mode, levels = ("request_rate", args.request_rate_range) if args.request_rate_range else \
        ("concurrency", args.concurrency_range or [1.0])
    binary = args.input_tensor_format == "binary"
    target = Target(args.url, args.protocol)
    try:
        target.wait_ready(args.model_name, args.model_version)
        metadata = target.metadata(args.model_name, args.model_version)
        batching = target.max_batch_size(args.model_name, args.model_version) != 0  # None: unknown, assume so
        inputs = input_specs(metadata, args.batch_size, dict(args.shape), args.only_inputs, batching)
        output_meta = [o for o in metadata.get("outputs", []) if not args.only_outputs or o["name"] in args.only_outputs]
        outputs = tuple(o["name"] for o in output_meta)
        sizes = shm.output_bytes(output_meta, args.batch_size, batching, args.output_shared_memory_size)
        configs = [WorkerConfig(args.url, args.protocol, args.model_name, args.model_version, inputs, outputs,
                                binary, args.priority, args.request_timeout, seed=i,
                                response_compression=args.response_compression, input_data=args.input_data,
                                shared_memory=args.shared_memory, output_bytes=tuple(sizes[n] for n in outputs))
                   for i in range(args.processes)]
        tensors = f"{args.shared_memory} shared memory" if args.shared_memory != "none" else \
            f"{args.input_tensor_format} tensors"
        progress(f"kiln perf: {args.model_name} at {args.protocol}://{args.url} "
                 f"({tensors}, {args.processes} client processes)")
        pool = WorkerPool.start(configs)
        try:
            measurer = Measurer(pool, lambda: target.statistics(args.model_name, args.model_version))
            results = []
            for level in levels:
                row = measure_level(measurer, mode, level, args, progress)
                if row["client"]["client_bound"]:
                    progress(f"  warning: a client process used {row['client']['max_process_cpu']:.0%} of a core: "
                             "the client may be limiting this level; raise --processes")
                results.append(row)
        finally:
            pool.close()
    finally:
        target.close()
    return {
        "tool": "kiln perf",
        "command": "python -m load_tests.perf " + " ".join(args.argv),
        "label": args.label,
        "model": args.model_name,
        "protocol": args.protocol,
        "tensor_format": args.input_tensor_format if args.protocol == "http" else "binary",
        "shared_memory": args.shared_memory,
        "input_data": args.input_data,
        "inputs": [{"name": s.name, "datatype": s.datatype, "shape": list(s.shape)} for s in inputs],
        "mode": mode,
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    if args.processes < 1 or args.max_trials < 1 or args.measurement_interval <= 0:
        raise SystemExit("--processes, --max-trials and --measurement-interval must be positive")
    document = run(args)
    print_table(document["results"])
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump(document, f, indent=2)
            f.write("\n")
    if args.latency_report_file:
        write_csv(args.latency_report_file, document["results"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
