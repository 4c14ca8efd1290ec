"""GPU serving benchmark: ResNet-50 behind `kiln serve`, dynamic batching on/off, vs the raw engine.

    python load_tests/gpu_serving.py --out $OUT                   # GPU machine, ResNet-50 fp16, about 5 minutes
    python load_tests/gpu_serving.py --out /tmp/gs --smoke        # any machine, a tiny ResNet, under a minute

One server process serves the same ONNX model twice: `<model>_batched` (dynamic_batching) and `<model>_direct`
(no batcher: each request runs alone), both `max_batch_size: --max-batch`, precision through the config
parameter `kiln_precision` (server/core/model.py turns it into BuilderFlags). `kiln perf` sweeps the
concurrency over gRPC with binary tensors. Then, with the server gone, a child process loads the very plan
the server built (from the server's plan cache) and times `ExecutionContext.infer` alone at every batch size
the server can form: that is the raw engine throughput. Server efficiency = served inferences/s / raw
inferences/s at the batch size the server ran (dynamic batching: min(concurrency, max batch); direct: 1).
Everything goes to `<out>/gpu_serving.json`, `kiln perf`'s own JSON per variant and the server log.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script (python load_tests/gpu_serving.py): the repo's packages
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import onnx  # noqa: E402

from load_tests import perf  # noqa: E402

READY_TIMEOUT_S = 420.0  # a first ResNet-50 build on the GPU (tactic timing) dominates this
VARIANTS = ("batched", "direct")


@dataclass(frozen=True)
class Setup:
    """What one run measures; `smoke` picks a tiny model and short windows that fit a 2-core CPU machine."""

    model: str
    image: int
    classes: int
    max_batch: int
    precision: str
    concurrency: str
    interval_ms: int
    max_trials: int
    warmup_s: float
    processes: int
    raw_seconds: float
    instance_kind: str  # KIND_GPU on the device; KIND_AUTO for the smoke run (CPU here)
    queue_delay_us: int


def make_setup(args: argparse.Namespace) -> Setup:
    if args.smoke:
        return Setup("resnet_tiny", 32, 10, 4, args.precision, args.concurrency or "1:4:x2", 400, 3, 0.3, 2, 0.3,
                     "KIND_AUTO", args.queue_delay_us)
    return Setup("resnet50", 224, 1000, args.max_batch, args.precision, args.concurrency or "1:128:x2", 1500, 4,
                 1.0, args.processes, 1.0, "KIND_GPU", args.queue_delay_us)


def build_model(setup: Setup) -> onnx.ModelProto:
    """tools/make_models.py's ResNet-50 (seeded weights); the smoke model is the same code, 1 block per stage."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import make_models
    finally:
        sys.path.remove(str(ROOT / "tools"))
    if setup.model == "resnet50":
        return make_models.resnet50(image_size=setup.image)
    return make_models.resnet50(image_size=setup.image, width=8, blocks=(1, 1, 1, 1), classes=setup.classes)


def model_config(name: str, setup: Setup, batched: bool) -> str:
    """Triton-style config.pbtxt; precision goes in the `kiln_precision` parameter (the one the server reads)."""
    batching = (f"dynamic_batching {{ max_queue_delay_microseconds: {setup.queue_delay_us} }}\n" if batched else "")
    return (f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: {setup.max_batch}\n'
            f'input [ {{ name: "input" data_type: TYPE_FP32 dims: [ 3, {setup.image}, {setup.image} ] }} ]\n'
            f'output [ {{ name: "logits" data_type: TYPE_FP32 dims: [ {setup.classes} ] }} ]\n'
            f'instance_group [ {{ count: 1 kind: {setup.instance_kind} }} ]\n{batching}'
            f'parameters {{ key: "kiln_precision" value {{ string_value: "{setup.precision}" }} }}\n')


def write_repository(directory: Path, setup: Setup) -> dict[str, str]:
    """Both variants from the same ONNX bytes (so the second load is a plan-cache hit); returns variant -> name."""
    model = build_model(setup)
    names = {}
    for variant in VARIANTS:
        name = f"{setup.model}_{variant}"
        (directory / name / "1").mkdir(parents=True, exist_ok=True)
        onnx.save(model, directory / name / "1" / "model.onnx")
        (directory / name / "config.pbtxt").write_text(model_config(name, setup, variant == "batched"))
        names[variant] = name
    return names


# ----------------------------------------------------------------------------------------------- server

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(method: str, url: str, timeout: float = 5.0) -> int:
    request = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


@dataclass
class ServerHandle:
    http: str
    grpc: str
    log: Path


@contextmanager
def kiln_server(repo: Path, plans: Path, log: Path, first_model: str) -> Iterator[ServerHandle]:
    """`python -m server` (what `kiln serve` runs) in explicit mode with one model loaded; stopped afterwards."""
    ports = [_free_port() for _ in range(3)]
    command = [sys.executable, "-m", "server", "--model-repository", str(repo), "--host", "127.0.0.1",
               "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]),
               "--plan-cache-dir", str(plans), "--model-control-mode", "explicit", "--load-model", first_model]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    handle = ServerHandle(f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}", log)
    try:
        _wait(process, f"http://{handle.http}/v2/models/{first_model}/ready", log)
        yield handle
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait(process: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}; log: {log}")
        if _http("GET", url, 1.0) == 200:
            return
        time.sleep(0.3)
    raise RuntimeError(f"not ready after {READY_TIMEOUT_S:.0f} s ({url}); log: {log}")


def load_model(server: ServerHandle, name: str) -> float:
    """Load `name` through the repository API (explicit mode); returns the seconds it took."""
    started = time.monotonic()
    status = _http("POST", f"http://{server.http}/v2/repository/models/{name}/load", READY_TIMEOUT_S)
    if status != 200:
        raise RuntimeError(f"loading '{name}' answered HTTP {status}; log: {server.log}")
    return time.monotonic() - started


def sweep(server: ServerHandle, name: str, setup: Setup, out: Path) -> dict[str, Any]:
    """`kiln perf` over gRPC (binary tensors) at every concurrency level; its JSON document."""
    path = out / f"perf_{name}.json"
    perf.main(["-m", name, "-i", "grpc", "-u", server.grpc, "--concurrency-range", setup.concurrency,
               "-p", str(setup.interval_ms), "-r", str(setup.max_trials), "--warmup", str(setup.warmup_s),
               "--processes", str(setup.processes), "--label", name, "--json-file", str(path), "-q"])
    return json.loads(path.read_text())


# ----------------------------------------------------------------------------------------------- raw engine

def raw_batch_sizes(levels: list[int], max_batch: int) -> list[int]:
    """Batch sizes the server can have run: 1 (direct) and min(concurrency, max batch) for each level."""
    return sorted({1, *(min(level, max_batch) for level in levels)})


def _time_batches(plan_path: str, shape: tuple[int, ...], batches: list[int], seconds: float) -> list[dict]:
    """In a child process: time `ExecutionContext.infer` on the server's own plan, batch by batch."""
    import engine_core as kiln

    engine = kiln.Runtime().deserialize_cuda_engine(Path(plan_path).read_bytes())
    if engine is None:
        raise RuntimeError(f"could not load the plan {plan_path}")
    context = engine.create_execution_context()
    name = engine.get_tensor_name(0)
    rng = np.random.default_rng(0)
    rows = []
    for batch in batches:
        x = rng.standard_normal((batch, *shape), dtype=np.float32)
        for _ in range(3):  # warm-up: first-run allocations, graph capture, clocks
            context.infer({name: x})
        iterations, started = 0, time.perf_counter()
        while iterations < 5 or time.perf_counter() - started < seconds:
            context.infer({name: x})
            iterations += 1
        elapsed = time.perf_counter() - started
        rows.append({"batch": batch, "iterations": iterations, "latency_ms": 1e3 * elapsed / iterations,
                     "infer_per_s": batch * iterations / elapsed})
    return rows


def _raw_child(queue: mp.Queue, *args: Any) -> None:
    try:
        queue.put(("ok", _time_batches(*args)))
    except BaseException as e:  # noqa: BLE001 - the parent reports it; never a hung queue
        queue.put(("error", f"{type(e).__name__}: {e}"))


def measure_raw(plans: Path, setup: Setup, batches: list[int]) -> tuple[list[dict], str]:
    """Raw throughput of the plan the server built (the newest in its cache), in a fresh process so the GPU is
    the engine's alone; returns the rows and the plan file used."""
    candidates = sorted(plans.rglob("*.plan"), key=lambda p: p.stat().st_mtime)
    if not candidates:
        raise RuntimeError(f"the server left no plan in {plans}")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_raw_child, args=(queue, str(candidates[-1]), (3, setup.image, setup.image), batches,
                                                 setup.raw_seconds))
    child.start()
    try:
        kind, payload = queue.get(timeout=READY_TIMEOUT_S)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.terminate()
    if kind != "ok":
        raise RuntimeError(f"raw engine measurement failed: {payload}")
    return payload, str(candidates[-1])


# ----------------------------------------------------------------------------------------------- report

def efficiency_rows(served: dict[str, dict], raw: list[dict], max_batch: int) -> list[dict]:
    """Served / raw inferences per second, level by level, against the raw figure at the batch the server ran."""
    raw_by_batch = {r["batch"]: r["infer_per_s"] for r in raw}
    rows = []
    for variant, document in served.items():
        for result in document["results"]:
            level = int(result["concurrency"])
            batch = min(level, max_batch) if variant == "batched" else 1
            served_rate = result["throughput_infer_per_s"]
            raw_rate = raw_by_batch.get(batch)
            server = result["server"] or {}
            rows.append({"variant": variant, "concurrency": level, "raw_batch": batch,
                         "server_avg_batch": server.get("avg_batch"),
                         "served_infer_per_s": served_rate, "raw_infer_per_s": raw_rate,
                         "efficiency": served_rate / raw_rate if raw_rate else None,
                         "p50_ms": result["latency_us"].get("p50", 0) / 1e3,
                         "p99_ms": result["latency_us"].get("p99", 0) / 1e3,
                         "server_queue_us": server.get("queue_us"),
                         "server_infer_us": server.get("compute_infer_us"),
                         "errors": result["errors"]})
    return rows


def print_report(document: dict[str, Any], out=sys.stdout) -> None:
    print(f"\nraw engine ({document['setup']['model']}, {document['setup']['precision']}):", file=out)
    for r in document["raw"]:
        print(f"  batch {r['batch']:>4}: {r['infer_per_s']:>10.1f} infer/s  {r['latency_ms']:>8.2f} ms", file=out)
    print(f"\n{'variant':>8} {'conc':>5} {'batch':>6} {'served/s':>10} {'raw b/s':>10} {'effic.':>7} {'p50 ms':>8} "
          f"{'p99 ms':>8} {'queue us':>9} {'err':>4}", file=out)
    for r in document["efficiency"]:
        effic = f"{r['efficiency']:.0%}" if r["efficiency"] is not None else "n/a"
        queue = f"{r['server_queue_us']:.0f}" if r["server_queue_us"] is not None else "n/a"
        batch = f"{r['server_avg_batch']:.1f}" if r["server_avg_batch"] is not None else "n/a"
        print(f"{r['variant']:>8} {r['concurrency']:>5} {batch:>6} {r['served_infer_per_s']:>10.1f} "
              f"{r['raw_infer_per_s'] or 0:>10.1f} {effic:>7} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} {queue:>9} "
              f"{r['errors']:>4}", file=out)
    print("batch: the server's average executed batch (inference_count / execution_count); raw b/s: the raw "
          "engine at batch min(concurrency, max batch) (direct: 1); effic. = served / raw", file=out)


def _device() -> dict[str, Any]:
    import engine_core as kiln

    info: dict[str, Any] = {"backends": kiln.available_backends()}
    try:
        query = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20)
        info["gpus"] = [line.strip() for line in query.stdout.splitlines() if line.strip()]
    except (OSError, subprocess.TimeoutExpired):
        info["gpus"] = []
    return info


def run(args: argparse.Namespace) -> dict[str, Any]:
    setup = make_setup(args)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    work = out / "work"
    # one plan cache per setup, so the raw run finds the plan this server used (reruns still hit the cache)
    repo, plans = work / "repository", work / f"plans_{setup.model}_{setup.precision}_b{setup.max_batch}"
    names = write_repository(repo, setup)
    started = time.monotonic()
    served: dict[str, dict] = {}
    load_s: dict[str, float] = {}
    with kiln_server(repo, plans, out / "server.log", names["batched"]) as server:
        load_s["batched"] = time.monotonic() - started  # process start + first build (or plan-cache hit)
        served["batched"] = sweep(server, names["batched"], setup, out)
        load_s["direct"] = load_model(server, names["direct"])
        served["direct"] = sweep(server, names["direct"], setup, out)
    levels = [int(level) for level in perf.parse_range(setup.concurrency)]
    raw, plan_file = measure_raw(plans, setup, raw_batch_sizes(levels, setup.max_batch))
    document = {
        "tool": "load_tests/gpu_serving.py",
        "command": "python load_tests/gpu_serving.py " + " ".join(args.argv),
        "setup": asdict(setup),
        "models": names,
        "plan_file": plan_file,
        "load_s": load_s,
        "device": _device(),
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "raw": raw,
        "efficiency": efficiency_rows(served, raw, setup.max_batch),
        "served": served,
        "elapsed_s": time.monotonic() - started,
    }
    (out / "gpu_serving.json").write_text(json.dumps(document, indent=2) + "\n")
    return document


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python load_tests/gpu_serving.py", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="directory for gpu_serving.json, perf JSON, server log")
    p.add_argument("--precision", choices=["fp32", "tf32", "fp16", "bf16"], default="fp16",
                   help="the model config's kiln_precision (default fp16)")
    p.add_argument("--max-batch", type=int, default=128, help="max_batch_size of both variants (default 128)")
    p.add_argument("--concurrency", default=None, metavar="START:END:STEP",
                   help="kiln perf levels (default 1:128:x2; smoke 1:4:x2)")
    p.add_argument("--processes", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)),
                   help="kiln perf client processes (default: half the CPUs, at most 8)")
    p.add_argument("--queue-delay-us", type=int, default=500, help="dynamic batcher max_queue_delay_microseconds")
    p.add_argument("--smoke", action="store_true", help="tiny ResNet, short windows: a check that runs anywhere")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    if args.max_batch < 1 or args.processes < 1:
        raise SystemExit("--max-batch and --processes must be positive")
    document = run(args)
    print_report(document)
    print(f"\nwrote {args.out / 'gpu_serving.json'} in {document['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
