"""GPU serving benchmark: ResNet-50 and BERT behind `kiln serve`, per transport and batching, vs the raw engine.

    python load_tests/gpu_serving.py --out $OUT                   # GPU machine: the issue's points, ~5 minutes
    python load_tests/gpu_serving.py --out $OUT --models bert --transports grpc,http --concurrency 1,4,16,64,256
    python load_tests/gpu_serving.py --out /tmp/gs --smoke        # any machine: tiny models, under a minute
    python load_tests/gpu_serving.py --out $OUT --models bert --transports grpc --variants batched \
        --concurrency 128 --gpus 0 --gpus 0,1                         # one GPU against two, in one run

Models (seeded weights, tools/make_models.py), `--precision` (default fp16) through the config parameter
`kiln_precision`, max batch `--max-batch` (default 128):
  resnet50  ResNet-50, FP32 input [3, 224, 224] (602 KB a request), logits [1000]
  bert      BERT-base, seq 128, INT64 input_ids / attention_mask / token_type_ids (all zeros: valid ids and
            masks), one output `cls` = hidden_state[:, 0, :] ([768], 3 KB): small payloads, the server's own cost
Transports (`kiln perf`, tritonclient's asyncio clients, several processes): grpc (binary), http (binary
tensors), system (gRPC + system shared memory), cuda (gRPC + CUDA shared memory); shared-memory regions are
registered once per client process and reused, as perf_analyzer --shared-memory does. Variants: `batched`
(dynamic_batching) and `direct` (no batcher: each request runs alone), one model each, same ONNX bytes.
`--gpus LIST` (repeatable) writes `gpus: [LIST]` into the instance_group, one model per list (`<name>@0,1`):
each row then says its GPUs, and the ratios compare each list with the first.

One server process (`python -m server`, what `kiln serve` runs; `--frontend-processes` passed on when its
--help lists it) loads every model. Right after a model loads, a child process times the raw engine on the
very plan the server built (its plan-cache file, named in the server log): ExecutionContext with
set_tensor_address on device buffers the inputs already sit in, execute_async_v3 on a created stream, CUDA
events around N runs (CPU plans: wall time), at every batch bucket up to the max batch -- the sizes the
server's CUDA path pads its batches to. Each served row compares with the raw engine at the bucket the
server's average executed batch pads to: efficiency = served inferences/s / raw inferences/s. Ratios in the
same run: batched / direct and each transport / grpc. Output: `<out>/gpu_serving.json` (rewritten after every
sweep, so a run cut short keeps what it measured), `kiln perf`'s JSON per sweep, the server log.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script (python load_tests/gpu_serving.py): the repo's packages
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import onnx  # noqa: E402

from load_tests import harness, perf, process_cpu  # noqa: E402
from server.core.execution import batch_buckets, bucket_for  # noqa: E402  (the buckets the server runs)
from server.core.placement import parse_gpu_ids  # noqa: E402

READY_TIMEOUT_S = 420.0  # a first model build on the GPU (tactic timing) dominates this
VARIANTS = ("batched", "direct")
#: transport -> (kiln perf protocol, shared memory kind)
TRANSPORTS = {"grpc": ("grpc", "none"), "http": ("http", "none"), "system": ("grpc", "system"),
              "cuda": ("grpc", "cuda")}


# ----------------------------------------------------------------------------------------------- models

@dataclass(frozen=True)
class Tensor:
    name: str
    datatype: str  # KServe name: FP32, INT64
    dims: tuple[int, ...]  # per item (the batch dim is the server's)


@dataclass(frozen=True)
class ModelSpec:
    """One benchmarked model: its ONNX builder (make_models keyword arguments) and the tensors it serves."""

    name: str
    builder: str  # make_models function
    kwargs: tuple[tuple[str, Any], ...]
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    input_data: str  # kiln perf --input-data: random, or zero where values must be valid ids and masks


def _bert_spec(name: str, seq: int, hidden: int, **kwargs: Any) -> ModelSpec:
    ids = tuple(Tensor(n, "INT64", (seq,)) for n in ("input_ids", "attention_mask", "token_type_ids"))
    return ModelSpec(name, "bert", (("cls_only", True), ("hidden", hidden), *kwargs.items()), ids,
                     (Tensor("cls", "FP32", (hidden,)),), "zero")


#: --models name -> (full size, smoke size)
MODELS: dict[str, tuple[ModelSpec, ModelSpec]] = {
    "resnet50": (
        ModelSpec("resnet50", "resnet50", (("image_size", 224),), (Tensor("input", "FP32", (3, 224, 224)),),
                  (Tensor("logits", "FP32", (1000,)),), "random"),
        ModelSpec("resnet_tiny", "resnet50", (("image_size", 32), ("width", 8), ("blocks", (1, 1, 1, 1)),
                                              ("classes", 10)),
                  (Tensor("input", "FP32", (3, 32, 32)),), (Tensor("logits", "FP32", (10,)),), "random")),
    "bert": (
        _bert_spec("bert_cls", 128, 768),
        _bert_spec("bert_tiny", 16, 64, layers=2, heads=4, ffn=128, vocab=1000, max_positions=128)),
}


def build_onnx(spec: ModelSpec) -> onnx.ModelProto:
    """tools/make_models.py's builder with the spec's arguments (seeded: the same bytes every run)."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import make_models
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return getattr(make_models, spec.builder)(**dict(spec.kwargs))


def model_config(name: str, spec: ModelSpec, setup: Setup, batched: bool, gpus: str = "") -> str:
    """Triton-style config.pbtxt; precision goes in the `kiln_precision` parameter (the one the server reads);
    `gpus` ("0,1"): the instance group's GPUs (count instances on each)."""
    def tensors(items: tuple[Tensor, ...]) -> str:
        return ", ".join(f'{{ name: "{t.name}" data_type: TYPE_{t.datatype} dims: [ {", ".join(map(str, t.dims))} ] }}'
                         for t in items)
    preferred = "".join(f" preferred_batch_size: {size}" for size in setup.preferred)
    batching = (f"dynamic_batching {{ max_queue_delay_microseconds: {setup.queue_delay_us}{preferred} }}\n"
                if batched else "")
    placed = f" gpus: [ {gpus} ]" if gpus else ""
    return (f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: {setup.max_batch}\n'
            f"input [ {tensors(spec.inputs)} ]\noutput [ {tensors(spec.outputs)} ]\n"
            f"instance_group [ {{ count: {setup.instances} kind: {setup.instance_kind}{placed} }} ]\n{batching}"
            f'parameters {{ key: "kiln_precision" value {{ string_value: "{setup.precision}" }} }}\n')


def onnx_file(spec: ModelSpec, cache: Path) -> Path:
    """The model's ONNX file, built once per cache directory (BERT-base takes seconds to generate and save)."""
    path = cache / "gpu_serving_models" / f"{spec.name}.onnx"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        onnx.save(build_onnx(spec), partial)
        partial.replace(path)
    return path


def placed(variant: str, gpus: str) -> str:
    """The key of one served model of a spec: its variant, and its GPUs when --gpus places it ("batched@0,1")."""
    return f"{variant}@{gpus}" if gpus else variant


def write_model(repo: Path, spec: ModelSpec, source: Path, setup: Setup) -> dict[str, str]:
    """Each variant of `spec` (on each --gpus list) in `repo`, from the same ONNX bytes (later loads are plan-cache
    hits); returns `placed(variant, gpus)` -> served name. Hard links where possible (a symlink would resolve
    outside the model)."""
    names = {}
    for gpus in setup.gpus or ("",):
        for variant in setup.variants:
            name = f"{spec.name}_{variant}" + (f"_g{gpus.replace(',', '-')}" if gpus else "")
            target = repo / name / "1" / "model.onnx"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.unlink(missing_ok=True)
            try:
                os.link(source, target)
            except OSError:
                shutil.copyfile(source, target)
            (repo / name / "config.pbtxt").write_text(model_config(name, spec, setup, variant == "batched", gpus))
            names[placed(variant, gpus)] = name
    return names


# ----------------------------------------------------------------------------------------------- setup

@dataclass(frozen=True)
class Setup:
    """What one run measures; `smoke` picks tiny models and short windows that fit a 2-core CPU machine."""

    models: tuple[str, ...]
    transports: tuple[str, ...]
    variants: tuple[str, ...]
    concurrency: tuple[int, ...]
    max_batch: int
    precision: str
    window_s: float
    profile_s: float  # process CPU (and py-spy) of the server during each sweep's first level; 0: off
    profile_idle: bool  # py-spy samples waiting threads too (wall time: where a lane's execution goes)
    profile_rate: int  # py-spy samples per second
    max_trials: int
    warmup_s: float
    processes: int
    raw_seconds: float
    instance_kind: str  # KIND_GPU on the device; KIND_AUTO for the smoke run (CPU here)
    queue_delay_us: int
    instances: int  # execution contexts (instance_group count) of each model, on each of its GPUs
    frontend_processes: int | None
    smoke: bool
    gpus: tuple[str, ...] = ()  # --gpus: the instance group's GPUs, one served model per list ("0", "0,1")
    preferred: tuple[int, ...] = ()  # --preferred-batch-sizes: the batcher's preferred sizes (none: Triton's default)


def _names(text: str, allowed: Any, what: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        raise SystemExit(f"--{what}: unknown {unknown or text!r}; choose from {', '.join(allowed)}")
    return names


def _gpu_lists(values: list[str] | None) -> tuple[str, ...]:
    """Each `--gpus` value checked as the server checks its own flag (distinct ids >= 0), once each."""
    lists = []
    for value in values or []:
        try:
            lists.append(",".join(map(str, parse_gpu_ids(value))))
        except ValueError as e:
            raise SystemExit(str(e)) from None
    return tuple(dict.fromkeys(lists))


def make_setup(args: argparse.Namespace) -> Setup:
    smoke = args.smoke
    default = ("resnet50,bert", "grpc,system", "1,4") if smoke else ("resnet50,bert", "grpc,http,system,cuda", "1,64")
    levels = tuple(int(v) for v in perf.parse_range(args.concurrency or default[2]))
    return Setup(
        models=_names(args.models or default[0], MODELS, "models"),
        transports=_names(args.transports or default[1], TRANSPORTS, "transports"),
        variants=_names(args.variants, VARIANTS, "variants"),
        concurrency=levels,
        max_batch=args.max_batch or (4 if smoke else 128),
        precision=args.precision,
        window_s=args.window_s or (0.3 if smoke else 1.0),
        profile_s=args.profile_s,
        profile_idle=args.profile_idle,
        profile_rate=args.profile_rate,
        max_trials=args.max_trials or (3 if smoke else 4),
        warmup_s=0.2 if smoke else args.warmup_s,
        processes=args.processes or (1 if smoke else max(1, min(8, (os.cpu_count() or 2) // 2))),
        raw_seconds=0.2 if smoke else args.raw_seconds,
        instance_kind="KIND_AUTO" if smoke else "KIND_GPU",
        queue_delay_us=args.queue_delay_us,
        instances=args.instances,
        frontend_processes=args.frontend_processes,
        smoke=smoke,
        gpus=_gpu_lists(args.gpus),
        preferred=_preferred(args.preferred_batch_sizes, args.max_batch or (4 if smoke else 128)),
    )


def _preferred(text: str | None, max_batch: int) -> tuple[int, ...]:
    """`--preferred-batch-sizes`: a comma list, or "buckets" for the batch buckets CUDA models run at (a batch of
    17 then runs as 16 and leaves one for the next, instead of padding to 24)."""
    if not text:
        return ()
    if text == "buckets":
        return tuple(batch_buckets(max_batch))
    try:
        sizes = tuple(sorted({int(v) for v in text.split(",") if v.strip()}))
    except ValueError:
        raise SystemExit(f"--preferred-batch-sizes: a comma list of sizes or 'buckets', got {text!r}") from None
    if not sizes or not all(1 <= size <= max_batch for size in sizes):
        raise SystemExit(f"--preferred-batch-sizes: sizes must be in 1..{max_batch}, got {text!r}")
    return sizes


def spec_of(setup: Setup, model: str) -> ModelSpec:
    return MODELS[model][1 if setup.smoke else 0]


# ----------------------------------------------------------------------------------------------- server

def server_flags() -> str:
    """The server's --help text: which optional flags this checkout's server has (asked at run time)."""
    answer = subprocess.run([sys.executable, "-m", "server", "--help"], capture_output=True, text=True, cwd=ROOT,
                            env=harness.python_path_env(), timeout=120)
    return answer.stdout


def frontend_arguments(requested: int | None, help_text: str) -> tuple[list[str], str]:
    """`--frontend-processes N` when asked for and the server lists the flag; else nothing, and why."""
    if requested is None:
        return [], "not requested"
    if "--frontend-processes" not in help_text:
        return [], "requested, but this server has no --frontend-processes flag: not passed"
    return ["--frontend-processes", str(requested)], f"passed: --frontend-processes {requested}"


@dataclass
class ServerHandle:
    http: str
    grpc: str
    log: Path
    pid: int


@contextmanager
def kiln_server(repo: Path, plans: Path | None, log: Path, first_model: str,
                extra: list[str]) -> Iterator[ServerHandle]:
    """`python -m server` (what `kiln serve` runs) in explicit mode with one model loaded; stopped afterwards.
    `plans`: the plan cache directory (None: the server's default)."""
    ports = harness.free_ports(3)
    command = harness.kiln_command(repo, ports, *(["--plan-cache-dir", str(plans)] if plans is not None else []),
                                   "--model-control-mode", "explicit", "--load-model", first_model,
                                   "--allow-client-shm", "true", *extra)  # the shared-memory transports register regions
    http = f"127.0.0.1:{ports[0]}"
    with harness.serving(command, log, harness.http_ready(f"http://{http}/v2/models/{first_model}/ready"),
                         env=harness.python_path_env(), timeout_s=READY_TIMEOUT_S, interval_s=0.3, stop_timeout_s=30,
                         show_log=False) as process:
        yield ServerHandle(http, f"127.0.0.1:{ports[1]}", log, process.pid)


def load_model(server: ServerHandle, name: str) -> float:
    """Load `name` through the repository API (explicit mode); returns the seconds it took."""
    started = time.monotonic()
    status = harness.http_status(f"http://{server.http}/v2/repository/models/{name}/load", "POST", READY_TIMEOUT_S)
    if status != 200:
        raise RuntimeError(f"loading '{name}' answered HTTP {status}; log: {server.log}")
    return time.monotonic() - started


_PLAN_LINE = re.compile(r"model '([^']+)' version \d+: plan .*?\((/[^()]+\.plan)\)")


def plan_files(log_text: str) -> dict[str, str]:
    """Served model -> the plan-cache file the server built or loaded it from (its log says which)."""
    return {m.group(1): m.group(2) for m in _PLAN_LINE.finditer(log_text)}


def sweep(server: ServerHandle, name: str, spec: ModelSpec, transport: str, setup: Setup, out: Path) -> dict:
    """`kiln perf` at every concurrency level over one transport; its JSON document."""
    protocol, shared = TRANSPORTS[transport]
    path = out / f"perf_{name}_{transport}.json"
    url = server.grpc if protocol == "grpc" else server.http
    profiler = None
    if setup.profile_s:  # during the first level's windows, after its warm-up
        profiler = threading.Thread(target=profile_server, args=(server.pid, setup.warmup_s + 0.5, setup.profile_s,
                                                                 out / f"profile_{name}_{transport}",
                                                                 setup.profile_idle, setup.profile_rate), daemon=True)
        profiler.start()
    perf.main(["-m", name, "-i", protocol, "-u", url, "--shared-memory", shared, "--input-data", spec.input_data,
               "--concurrency-range", ",".join(map(str, setup.concurrency)), "-p", str(int(setup.window_s * 1000)),
               "-r", str(setup.max_trials), "--warmup", str(setup.warmup_s), "--processes", str(setup.processes),
               "--label", f"{name} {transport}", "--json-file", str(path), "-q"])
    if profiler is not None:
        profiler.join()
    return json.loads(path.read_text())


def profile_server(pid: int, delay_s: float, seconds: float, stem: Path, idle: bool = False, rate: int = 100) -> None:
    """CPU per process and thread of the server's tree (`process_cpu`) over `seconds`, and py-spy's raw stacks of
    the server process and its children (frontends, executors) meanwhile when py-spy is installed: STEM.txt /
    STEM.json / STEM.pyspy.txt. `idle`: waiting threads are sampled too."""
    time.sleep(delay_s)
    spy = None
    if shutil.which("py-spy"):
        spy = subprocess.Popen(["py-spy", "record", "-p", str(pid), "-d", str(max(1, round(seconds))), "-r", str(rate),
                                "--nonblocking", "--threads", "--subprocesses", *(["--idle"] if idle else []),
                                "-f", "raw", "-o", f"{stem}.pyspy.txt"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    host_before = _host_ticks()
    rows = process_cpu.measure(pid, seconds)
    busy, total = (after - before for after, before in zip(_host_ticks(), host_before))
    host = f"host: {busy / max(total, 1) * 100:.0f}% of {os.cpu_count()} cores busy (clients included)"
    stem.with_suffix(".json").write_text(json.dumps({"processes": rows, "host_busy": busy / max(total, 1)}, indent=1))
    stem.with_suffix(".txt").write_text(process_cpu.table(rows) + "\n" + host + "\n")
    print(f"server CPU during {stem.name}:\n{process_cpu.table(rows)}\n{host}", flush=True)
    if spy is not None:
        spy.wait(timeout=seconds + 30)


def _host_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of every core so far, from /proc/stat: whether the host itself is saturated."""
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


# ----------------------------------------------------------------------------------------------- raw engine

def bucket(batch: float, max_batch: int) -> int:
    """The batch the server's CUDA path runs for an average executed batch of `batch` items (its bucket)."""
    return bucket_for(max(1, round(batch)), max_batch)


class _HostClock:
    """CPU plans: execute_async_v3 runs synchronously; wall time over the runs."""

    stream = 0

    def elapsed_s(self, run: Callable[[int], None], iterations: int) -> float:
        started = time.perf_counter()
        for _ in range(iterations):
            run(self.stream)
        return time.perf_counter() - started


class _CudaClock:
    """A created stream and two CUDA events around the runs: device time, host enqueue gaps included."""

    def __init__(self) -> None:
        from engine_core.cuda.driver import EventTimer, Stream

        self._stream = Stream(non_blocking=True)
        self.stream = self._stream.handle
        self._timer = EventTimer(self.stream)

    def elapsed_s(self, run: Callable[[int], None], iterations: int) -> float:
        self._timer.start()
        for _ in range(iterations):
            run(self.stream)
        return self._timer.stop() / 1e3


class _Buffers:
    """I/O memory at the largest batch, filled once: device buffers for CUDA plans, host arrays for CPU ones.
    A smaller batch binds the same addresses (batch-major layout: its rows are a prefix)."""

    def __init__(self, engine: Any, context: Any, spec: ModelSpec, max_batch: int) -> None:
        import engine_core as kiln
        from load_tests.worker import InputSpec, make_array

        self.cuda = engine.backend == "cuda"
        self._keep: list[Any] = []
        self.addresses: dict[str, int] = {}
        rng = np.random.default_rng(0)
        for t in spec.inputs:
            array = make_array(InputSpec(t.name, t.datatype, (max_batch, *t.dims)), rng, spec.input_data)
            self.addresses[t.name] = self._place(array)
            context.set_input_shape(t.name, array.shape)
        for t in spec.outputs:
            shape = context.get_tensor_shape(t.name)
            dtype = np.dtype(kiln.nptype(engine.get_tensor_dtype(t.name)))
            self.addresses[t.name] = self._place(np.zeros(shape, dtype))

    def _place(self, array: np.ndarray) -> int:
        if not self.cuda:
            self._keep.append(array)
            return int(array.ctypes.data)
        from engine_core.cuda.driver import DeviceBuffer

        buffer = DeviceBuffer.from_array(array)
        self._keep.append(buffer)
        return buffer.ptr


def _time_batches(plan_path: str, spec: ModelSpec, batches: list[int], seconds: float) -> list[dict]:
    """In a child process: the server's own plan, device-resident I/O, execute_async_v3, batch by batch."""
    import engine_core as kiln

    engine = kiln.Runtime().deserialize_cuda_engine(Path(plan_path).read_bytes())
    if engine is None:
        raise RuntimeError(f"could not load the plan {plan_path}")
    context = engine.create_execution_context()
    buffers = _Buffers(engine, context, spec, max(batches))
    clock = _CudaClock() if buffers.cuda else _HostClock()

    def run(stream: int) -> None:
        if not context.execute_async_v3(stream):
            raise RuntimeError("execute_async_v3 failed (see the engine log)")

    rows = []
    for batch in batches:
        for t in spec.inputs:
            context.set_input_shape(t.name, (batch, *t.dims))
        for name, address in buffers.addresses.items():
            context.set_tensor_address(name, address)
        clock.elapsed_s(run, 3)  # warm-up: binding, graph capture, clocks
        estimate = clock.elapsed_s(run, 5) / 5
        iterations = int(min(100_000, max(5, seconds / max(estimate, 1e-6))))
        elapsed = clock.elapsed_s(run, iterations)
        rows.append({"batch": batch, "iterations": iterations, "latency_ms": 1e3 * elapsed / iterations,
                     "infer_per_s": batch * iterations / elapsed})
    return rows


def _raw_child(queue: mp.Queue, *args: Any) -> None:
    try:
        queue.put(("ok", _time_batches(*args)))
    except BaseException as e:  # noqa: BLE001 - the parent reports it; never a hung queue
        queue.put(("error", f"{type(e).__name__}: {e}"))


def measure_raw(plan_file: str, spec: ModelSpec, batches: list[int], seconds: float) -> list[dict]:
    """Raw throughput of the server's plan in a fresh process (its own CUDA context; the server is idle)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_raw_child, args=(queue, plan_file, spec, batches, seconds))
    child.start()
    try:
        kind, payload = queue.get(timeout=READY_TIMEOUT_S)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.terminate()
    if kind != "ok":
        raise RuntimeError(f"raw engine measurement of {plan_file} failed: {payload}")
    return payload


# ----------------------------------------------------------------------------------------------- report

def served_rows(model: str, transport: str, variant: str, document: dict, raw: list[dict], max_batch: int,
                gpus: str | None = None) -> list[dict]:
    """One row per concurrency level: served figures, the server's average batch, the raw engine at its bucket
    (`gpus`: the --gpus list the model was placed on, None without --gpus)."""
    raw_by_batch = {r["batch"]: r["infer_per_s"] for r in raw}
    rows = []
    for result in document["results"]:
        level = int(result["concurrency"])
        server = result["server"] or {}
        avg_batch = server.get("avg_batch")
        executed = bucket(avg_batch if avg_batch else (min(level, max_batch) if variant == "batched" else 1), max_batch)
        served_rate, raw_rate = result["throughput_infer_per_s"], raw_by_batch.get(executed)
        rows.append({"model": model, "transport": transport, "variant": variant, "concurrency": level,
                     "infer_per_s": served_rate, "p50_ms": result["latency_us"].get("p50", 0) / 1e3,
                     "p99_ms": result["latency_us"].get("p99", 0) / 1e3, "server_avg_batch": avg_batch,
                     "raw_batch": executed, "raw_infer_per_s": raw_rate,
                     "efficiency": served_rate / raw_rate if raw_rate else None,
                     "server_queue_us": server.get("queue_us"), "server_infer_us": server.get("compute_infer_us"),
                     "errors": result["errors"], "client_bound": result["client"]["client_bound"],
                     "stable": result["stable"], "gpus": gpus})
    return rows


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def peer_ratios(rows: list[dict]) -> list[dict]:
    """Same-run comparisons: batched / direct (same model, transport, level, GPUs), transport / grpc (same model,
    variant, level, GPUs) and, with several --gpus lists, each list / the first (same model, transport, variant,
    level), for req/s and p99."""
    index = {(r["model"], r["transport"], r["variant"], r["concurrency"], r.get("gpus")): r for r in rows}
    first_gpus = rows[0].get("gpus") if rows else None
    ratios = []
    for (model, transport, variant, level, gpus), row in index.items():
        peers = []
        if variant == "batched":
            peers.append(("batched / direct", transport, index.get((model, transport, "direct", level, gpus))))
        if transport != "grpc":
            peers.append((f"{transport} / grpc", variant, index.get((model, "grpc", variant, level, gpus))))
        if gpus != first_gpus:
            peers.append((f"gpus {gpus} / {first_gpus}", f"{transport} {variant}",
                          index.get((model, transport, variant, level, first_gpus))))
        for what, of, other in peers:
            if other is not None:
                ratios.append({"model": model, "comparison": what, "transport": of, "concurrency": level,
                               "infer_per_s": _ratio(row["infer_per_s"], other["infer_per_s"]),
                               "p99": _ratio(row["p99_ms"], other["p99_ms"]),
                               **({"gpus": gpus} if gpus is not None else {})})
    return ratios


def _f(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def print_report(document: dict[str, Any], out=sys.stdout) -> None:
    setup = document["setup"]
    for model, raw in document["raw"].items():
        print(f"\nraw engine {model} ({setup['precision']}, device-resident I/O, execute_async_v3):", file=out)
        for r in raw:
            print(f"  batch {r['batch']:>4}: {r['infer_per_s']:>10.1f} infer/s  {r['latency_ms']:>8.3f} ms", file=out)
    print(f"\n{'model':<12} {'transport':<9} {'variant':<8} {'conc':>5} {'infer/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'avg b':>6} {'raw b':>5} {'raw/s':>9} {'effic.':>7} {'err':>4}", file=out)
    for r in document["rows"]:
        effic = "n/a" if r["efficiency"] is None else f"{r['efficiency']:.0%}"
        print(f"{r['model']:<12} {r['transport']:<9} {r['variant']:<8} {r['concurrency']:>5} {r['infer_per_s']:>9.1f} "
              f"{r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} {_f(r['server_avg_batch'], '.1f'):>6} {r['raw_batch']:>5} "
              f"{_f(r['raw_infer_per_s'], '.1f'):>9} {effic:>7} {r['errors']:>4}"
              + (f"  gpus {r['gpus']}" if r.get("gpus") else "") + ("  client-bound" if r["client_bound"] else ""),
              file=out)
    print("avg b: the server's average executed batch (inference_count / execution_count); raw b: the "
          "bucket it pads to; raw/s: the raw engine there; effic. = infer/s / raw/s", file=out)
    if document["ratios"]:
        print(f"\n{'model':<12} {'comparison':<18} {'of':<9} {'conc':>5} {'req/s x':>8} {'p99 x':>7}", file=out)
        for r in document["ratios"]:
            print(f"{r['model']:<12} {r['comparison']:<18} {r['transport']:<9} {r['concurrency']:>5} "
                  f"{_f(r['infer_per_s'], '.2f'):>8} {_f(r['p99'], '.2f'):>7}", file=out)


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


# ----------------------------------------------------------------------------------------------- run

@dataclass
class Run:
    """What the run has measured so far; `document()` is gpu_serving.json at any point."""

    args: argparse.Namespace
    setup: Setup
    started: float
    models: dict[str, dict[str, str]]
    skipped: list[str]
    frontend: str
    load_s: dict[str, float]
    plans: dict[str, str]
    raw: dict[str, list[dict]]
    rows: list[dict]
    device: dict[str, Any]
    started_utc: str

    def document(self) -> dict[str, Any]:
        return {
            "tool": "load_tests/gpu_serving.py",
            "command": "python load_tests/gpu_serving.py " + " ".join(self.args.argv),
            "setup": asdict(self.setup),
            "models": self.models,
            "skipped": self.skipped,
            "frontend_processes": self.frontend,
            "plan_files": self.plans,
            "load_s": self.load_s,
            "device": self.device,
            "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
            "started_utc": self.started_utc,
            "raw": self.raw,
            "rows": self.rows,
            "ratios": peer_ratios(self.rows),
            "elapsed_s": self.elapsed_s,
        }

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def save(self) -> dict[str, Any]:
        document = self.document()
        (self.args.out / "gpu_serving.json").write_text(json.dumps(document, indent=2) + "\n")
        return document


def usable_transports(setup: Setup) -> tuple[list[str], list[str]]:
    """The transports this machine can run, and notes on those it cannot (CUDA shared memory needs a GPU)."""
    import engine_core as kiln

    if "cuda" in setup.transports and "cuda" not in kiln.available_backends():
        return [t for t in setup.transports if t != "cuda"], ["transport cuda: no CUDA device here"]
    return list(setup.transports), []


def measure_model(run: Run, server: ServerHandle, model: str, transports: list[str]) -> None:
    """Load both variants, time the raw engine on their plan (server idle), then sweep every transport."""
    setup, spec = run.setup, spec_of(run.setup, model)
    names = run.models[model]
    for name in names.values():
        if name not in run.load_s:
            run.load_s[name] = load_model(server, name)
    plans = plan_files(server.log.read_text(errors="replace"))
    first = next(iter(names.values()))
    plan = plans.get(first)
    if plan is None:
        raise RuntimeError(f"the server log names no plan file for {first}: {server.log}")
    run.plans[model] = plan
    run.raw[spec.name] = measure_raw(plan, spec, batch_buckets(setup.max_batch), setup.raw_seconds)
    run.save()
    for transport in transports:
        for key, name in names.items():
            variant, _, gpus = key.partition("@")
            document = sweep(server, name, spec, transport, setup, run.args.out)
            run.rows += served_rows(spec.name, transport, variant, document, run.raw[spec.name], setup.max_batch,
                                    gpus or None)
            run.save()


def run(args: argparse.Namespace) -> dict[str, Any]:
    setup = make_setup(args)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    cache = args.cache_dir or (Path(os.environ["KILN_CACHE_DIR"]) if os.environ.get("KILN_CACHE_DIR") else out / "work")
    repo = out / "work" / "repository"
    transports, skipped = usable_transports(setup)
    started, started_utc = time.monotonic(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    names = {model: write_model(repo, spec_of(setup, model), onnx_file(spec_of(setup, model), cache), setup)
             for model in setup.models}
    extra, frontend = frontend_arguments(setup.frontend_processes, server_flags())
    state = Run(args, setup, started, names, skipped, frontend, {}, {}, {}, [], _device(), started_utc)
    first = next(iter(names[setup.models[0]].values()))
    with kiln_server(repo, cache / "plans", out / "server.log", first, extra) as server:
        state.load_s[first] = time.monotonic() - started  # model generation, process start, first build or cache hit
        for model in setup.models:
            measure_model(state, server, model, transports)
    return state.save()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python load_tests/gpu_serving.py", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=os.environ.get("OUT"), required=not os.environ.get("OUT"),
                   help="directory for gpu_serving.json, perf JSON, server log (default $OUT)")
    p.add_argument("--models", default=None, help=f"comma list of {', '.join(MODELS)} (default: both)")
    p.add_argument("--transports", default=None,
                   help=f"comma list of {', '.join(TRANSPORTS)} (default: all; smoke grpc,system)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma list of batched, direct (default both)")
    p.add_argument("--concurrency", default=None, metavar="LEVELS",
                   help="levels, e.g. 1,4,16,64,256 or 1:256:x4 (default 1,64; smoke 1,4)")
    p.add_argument("--window-s", type=float, default=None,
                   help="kiln perf measurement window (default 1.0; smoke 0.3)")
    p.add_argument("--max-trials", type=int, default=None, help="windows per level at most (default 4; smoke 3)")
    p.add_argument("--warmup-s", type=float, default=1.0, help="load before each level's windows (default 1)")
    p.add_argument("--raw-seconds", type=float, default=0.5, help="raw engine timing per batch size (default 0.5)")
    p.add_argument("--precision", choices=["fp32", "tf32", "fp16", "bf16"], default="fp16",
                   help="the model config's kiln_precision (default fp16)")
    p.add_argument("--max-batch", type=int, default=None, help="max_batch_size of every model (default 128; smoke 4)")
    p.add_argument("--processes", type=int, default=None,
                   help="kiln perf client processes (default: half the CPUs, at most 8; smoke 1)")
    p.add_argument("--queue-delay-us", type=int, default=500, help="dynamic batcher max_queue_delay_microseconds")
    p.add_argument("--preferred-batch-sizes", default=None, metavar="LIST|buckets",
                   help="dynamic_batching preferred_batch_size values, or 'buckets' (the CUDA batch buckets)")
    p.add_argument("--instances", type=int, default=1,
                   help="instance_group count of every model (default 1), on each of its GPUs")
    p.add_argument("--gpus", action="append", default=None, metavar="LIST",
                   help="gpus: [LIST] in every model's instance_group, e.g. 0,1; repeat it (--gpus 0 --gpus 0,1) to "
                        "serve one model per list and compare them in the same run (default: no gpus, every GPU)")
    p.add_argument("--frontend-processes", type=int, default=None, metavar="N",
                   help="passed to the server when its --help lists --frontend-processes")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="plans (DIR/plans, the server's plan cache) and generated ONNX files, reused between "
                        "runs (default $KILN_CACHE_DIR, else <out>/work)")
    p.add_argument("--profile-s", type=float, default=0.0,
                   help="during each sweep's first level: CPU per process and thread of the server and its frontends "
                        "for this long, and py-spy of the server process when installed (profile_*.txt in --out)")
    p.add_argument("--profile-idle", action="store_true",
                   help="py-spy samples waiting threads too (with --profile-s): wall time, not CPU")
    p.add_argument("--profile-rate", type=int, default=100,
                   help="py-spy samples per second (with --profile-s; default 100: too few to rank frames of a "
                        "process at ~15 processes, use 250-500)")
    p.add_argument("--smoke", action="store_true", help="tiny models, short windows: a check that runs anywhere")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    args.out = Path(args.out)
    if any(v is not None and v < 1 for v in (args.max_batch, args.processes)) or (args.frontend_processes or 0) < 0:
        raise SystemExit("--max-batch and --processes must be positive, --frontend-processes >= 0 (0: in-process)")
    document = run(args)
    print_report(document)
    for note in document["skipped"]:
        print(f"skipped: {note}")
    print(f"\nwrote {args.out / 'gpu_serving.json'} in {document['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
