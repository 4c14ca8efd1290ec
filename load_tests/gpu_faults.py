"""Faults on the serving path under load (#35): each injected into a real server while c=64 clients run, answers counted.

    python load_tests/gpu_faults.py                          # GPU when this machine has one, else CPU executors
    python load_tests/gpu_faults.py --out $OUT               # GPU machine: JSON and the server log under $OUT
    python load_tests/gpu_faults.py --short --scenarios kill # seconds a scenario (tests/reliability/test_gpu_faults.py)

The server is `kiln serve` (`python -m tests.reliability.fault_plugin`: `python -m server` with the fault plugin
registered) in explicit model-control mode, with two models that batch and so run in executor processes
(server/core/executor.py): `resnet` (tools/make_models.py's ResNet-50; on the GPU full size, KIND_GPU, fp16; on
the CPU a tiny one, KIND_CPU with KILN_EXECUTOR_CPU=1) and `faulty` (the fault plugin's model). Traffic is closed
loop: `--concurrency` clients (half HTTP with binary tensors through httpx, half gRPC through tritonclient's asyncio
client), one request of one row each at a time, every answer checked (resnet against its answers before any fault,
faulty against X + 1); a client waits 20 ms after an error, as a retrying client would. Health (HTTP live and ready,
gRPC live) is probed every 100 ms throughout.

Scenarios (each injects its fault after `--warm-s` of traffic):
  oversize  a model larger than the free device memory (this process holds device memory until `--oversize-gib` / 2
            is free; the model's weights are `--oversize-gib`) is loaded while resnet serves: the load must fail with
            a message naming the bytes needed and free, resnet must keep answering            (needs a GPU)
  cuda      one request makes a real CUDA_ERROR_ILLEGAL_ADDRESS (the fault plugin's ILLEGAL_ADDRESS value: a kernel that
            writes to an unmapped address; on the CPU its STICKY value raises the error's text), the batch fails
            (500 / INTERNAL) and the executor exits so that a fresh device context serves next
  kill      resnet's executor process gets SIGKILL: the batches it was running answer 503 / UNAVAILABLE, it is started
            again, the frontends keep answering health
  reload    resnet unloaded and loaded again (requests meanwhile answer 503 / UNAVAILABLE "not loaded")
  memory    `--cycles` of load, traffic, unload: the device-memory gauge (nv_gpu_memory_used_bytes, else nvidia-smi)
            read before the first load and after each unload must come back to its baseline  (needs a GPU)

Per scenario: requests sent, succeeded, wrong answers, failed by status and text, lost (neither an answer nor an
error by the request's deadline, `--deadline-s`: fault_tally.py's rule; must be 0), recovery (from the fault to the end of the first
successful request sent after it and after the last request that failed in its wake) and how long failures went on
(disrupted). Prints a table; writes JSON (default bench/results/faults_<cpu|gpu>_<time>.json, rewritten after each
scenario so a run cut short keeps what it measured) and, with --out or when a scenario failed, the server log
beside it. Exit code 0 when every scenario that ran passed (nothing lost, no wrong answer, recovery within
`--max-recovery-s`, live probes answered, and the scenario's own checks).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script (python load_tests/gpu_faults.py): the repo's packages
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

from load_tests import harness  # noqa: E402
from load_tests.fault_tally import (  # noqa: E402
    Record,
    ScenarioResult,
    failure_key,
    health_summary,
    lost_grpc,
    lost_http,
    tally,
)

SCENARIOS = ("oversize", "cuda", "kill", "reload", "memory")
NEEDS_GPU = {"oversize": "needs a GPU (device memory to fill)", "memory": "needs a GPU (no device-memory gauge on the CPU)"}
SERVER_MODULE = "tests.reliability.fault_plugin"
ERROR_BACKOFF_S = 0.02
HEALTH_EVERY_S = 0.1


# ------------------------------------------------------------------------------------------------- settings

@dataclass
class Settings:
    device: str  # "gpu" or "cpu"
    concurrency: int = 64
    warm_s: float = 3.0
    after_s: float = 5.0  # traffic kept going once recovered
    recover_timeout_s: float = 60.0
    deadline_s: float = 30.0
    cycles: int = 20
    oversize_gib: float = 2.0
    memory_tolerance_mb: float = 64.0
    max_recovery_s: float = 5.0
    frontend_processes: str = "2"
    budget_s: float = 0.0  # > 0: the memory cycles stop early so that the whole run ends within it
    started: float = field(default_factory=time.monotonic)

    @property
    def gpu(self) -> bool:
        return self.device == "gpu"


def short(settings: Settings) -> Settings:
    """Seconds a scenario: what the test runs."""
    settings.warm_s, settings.after_s, settings.deadline_s, settings.cycles = 1.0, 1.0, 15.0, 2
    settings.recover_timeout_s = 30.0
    return settings


def gpu_available() -> bool:
    from engine_core.backends.registry import available_backends

    return "cuda" in available_backends()


# ---------------------------------------------------------------------------------------------- models

@dataclass
class Target:
    """A served model's one input and one output, a pool of requests and how to check an answer."""

    name: str
    input: str
    output: str
    pool: list[np.ndarray]  # each [1, *dims] FP32
    expected: list[np.ndarray] | None = None  # None: filled in from the server's first answers
    rtol: float = 0.0

    def correct(self, index: int, output: np.ndarray) -> bool:
        if self.expected is None:
            return bool(np.all(np.isfinite(output)))
        want = self.expected[index]
        if output.shape != want.shape:
            return False
        scale = float(np.max(np.abs(want))) or 1.0
        return bool(np.max(np.abs(output - want)) <= self.rtol * scale)


def resnet_onnx(gpu: bool) -> tuple[onnx.ModelProto, int, int]:
    """ResNet-50 (full size on the GPU, a tiny one on the CPU); (model, image size, classes)."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import make_models
    finally:
        sys.path.remove(str(ROOT / "tools"))
    if gpu:
        return make_models.resnet50(image_size=224), 224, 1000
    return make_models.resnet50(image_size=32, width=8, blocks=(1, 1, 1, 1), classes=10), 32, 10


def _config(name: str, max_batch: int, inputs: str, outputs: str, gpu: bool, precision: bool = False) -> str:
    kind = "KIND_GPU" if gpu else "KIND_CPU"
    text = (f'name: "{name}"\nmax_batch_size: {max_batch}\ninput [ {inputs} ]\noutput [ {outputs} ]\n'
            f"instance_group [ {{ count: 1 kind: {kind} }} ]\ndynamic_batching {{ max_queue_delay_microseconds: 500 }}\n")
    if gpu and precision:
        text += 'parameters { key: "kiln_precision" value { string_value: "fp16" } }\n'
    return text


def write_repository(repo: Path, gpu: bool) -> dict[str, Target]:
    """resnet and faulty under `repo`; their targets."""
    from tests.reliability import fault_plugin

    model, size, classes = resnet_onnx(gpu)
    _save(repo, "resnet", model, _config(
        "resnet", 32 if gpu else 8, f'{{ name: "input" data_type: TYPE_FP32 dims: [ 3, {size}, {size} ] }}',
        f'{{ name: "logits" data_type: TYPE_FP32 dims: [ {classes} ] }}', gpu, precision=True))
    _save(repo, "faulty", fault_plugin.model(), _config(
        "faulty", 8, '{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] }', '{ name: "Y" data_type: TYPE_FP32 dims: [ 4 ] }',
        gpu))
    rng = np.random.default_rng(35)
    images = [rng.standard_normal((1, 3, size, size)).astype(np.float32) for _ in range(8)]
    values = [rng.uniform(0.0, 1.0, (1, 4)).astype(np.float32) for _ in range(8)]  # never MAGIC, STALL or STICKY
    return {"resnet": Target("resnet", "input", "logits", images, rtol=0.05 if gpu else 1e-4),
            "faulty": Target("faulty", "X", "Y", values, [v + 1 for v in values])}


def _save(repo: Path, name: str, model: onnx.ModelProto, config: str) -> None:
    (repo / name / "1").mkdir(parents=True, exist_ok=True)
    onnx.save(model, repo / name / "1" / "model.onnx")
    (repo / name / "config.pbtxt").write_text(config)


def write_oversize(repo: Path, weight_bytes: int) -> int:
    """`oversize`: a Gather from a table of `weight_bytes` (kept in an external file, sparse on disk); its bytes."""
    width = 1024
    rows = max(weight_bytes // (4 * width), 1)
    table = TensorProto(name="table", data_type=TensorProto.FLOAT, dims=[rows, width],
                        data_location=TensorProto.EXTERNAL)
    for key, value in (("location", "table.bin"), ("offset", "0"), ("length", str(rows * width * 4))):
        table.external_data.add(key=key, value=value)
    graph = helper.make_graph([helper.make_node("Gather", ["table", "ids"], ["rows"])], "oversize",
                              [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n", 1])],
                              [helper.make_tensor_value_info("rows", TensorProto.FLOAT, ["n", 1, width])], [table])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    version = repo / "oversize" / "1"
    version.mkdir(parents=True, exist_ok=True)
    with open(version / "table.bin", "wb") as f:
        f.truncate(rows * width * 4)  # zeros without writing them
    onnx.save(model, version / "model.onnx")
    (repo / "oversize" / "config.pbtxt").write_text(_config(
        "oversize", 8, '{ name: "ids" data_type: TYPE_INT64 dims: [ 1 ] }',
        f'{{ name: "rows" data_type: TYPE_FP32 dims: [ 1, {width} ] }}', True))
    return rows * width * 4


# ---------------------------------------------------------------------------------------------- server

class FaultServer:
    """The server under test: its URLs, repository calls, executor processes and metrics."""

    def __init__(self, workdir: Path, settings: Settings) -> None:
        self.workdir, self.settings = workdir, settings
        self.repo = workdir / "models"
        self.log_path = workdir / "server.log"
        self.targets = write_repository(self.repo, settings.gpu)
        ports = harness.free_ports(3)
        self.http_url = f"http://127.0.0.1:{ports[0]}"
        self.grpc_url = f"127.0.0.1:{ports[1]}"
        self.metrics_url = f"http://127.0.0.1:{ports[2]}/metrics"
        self.command = harness.kiln_command(
            self.repo, ports, "--model-control-mode", "explicit", "--load-model", "resnet", "--load-model", "faulty",
            "--frontend-processes", settings.frontend_processes, "--metrics-interval-ms", "200",
            module=SERVER_MODULE)
        self.env = harness.python_path_env({"KILN_EXECUTOR": "process", **({} if settings.gpu else {"KILN_EXECUTOR_CPU": "1"})})
        self.process: subprocess.Popen | None = None

    @contextmanager
    def running(self) -> Iterator[FaultServer]:
        ready = harness.http_ready(self.http_url + "/v2/health/ready")
        with harness.serving(self.command, self.log_path, ready, env=self.env, timeout_s=600 if self.settings.gpu else 120,
                             show_log=False, stop_timeout_s=30) as process:
            self.process = process
            yield self

    def repository(self, name: str, action: str) -> tuple[int, str, float]:
        """POST /v2/repository/models/<name>/<load|unload>: (status, error text, seconds); it returns when done."""
        started = time.monotonic()
        response = httpx.post(f"{self.http_url}/v2/repository/models/{name}/{action}", timeout=900)
        text = "" if response.status_code == 200 else _error_text(response)
        return response.status_code, text, round(time.monotonic() - started, 3)

    def executor_pid(self, model: str) -> int | None:
        """The pid of `model`'s newest executor process, as the server logged it."""
        pattern = re.compile(rf"model '{re.escape(model)}' version \d+(?: on GPU \d+)?: executor process (\d+) ready")
        found = pattern.findall(self.log_path.read_text(errors="replace"))
        return int(found[-1]) if found else None

    def metric(self, family: str, model: str | None = None) -> float | None:
        """Sum of a family's samples (for `model` only when given); None when it is not exported."""
        return harness.metric_sum(self.metrics_url, family, None if model is None else {"model": model})

    def device_memory(self) -> tuple[float | None, str]:
        """Device memory in use (bytes, every GPU) and where the figure came from."""
        gauge = self.metric("nv_gpu_memory_used_bytes")
        if gauge is not None:
            return gauge, "nv_gpu_memory_used_bytes"
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=20, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            return None, "none"
        return float(sum(int(v) for v in out.split())) * 2**20, "nvidia-smi memory.used"


def _error_text(response: httpx.Response) -> str:
    try:
        return str(response.json().get("error", response.text))
    except (ValueError, AttributeError):
        return response.text


# ---------------------------------------------------------------------------------------------- load

class Load:
    """Closed-loop clients (HTTP and gRPC) on one model and a health prober, in a thread of their own."""

    def __init__(self, server: FaultServer, target: Target, settings: Settings) -> None:
        self.server, self.target, self.settings = server, target, settings
        self.records: list[Record] = []
        self.health: list[tuple[str, float, bool]] = []  # (probe, seconds, answered)
        self._open: dict[int, tuple[str, float]] = {}  # client -> (protocol, sent) of the request it waits on
        self._stop = threading.Event()
        self._started = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True, name="fault-load")

    def __enter__(self) -> Load:
        self._thread.start()
        self._started.wait(60)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(self.settings.deadline_s + 30)
        for protocol, sent in list(self._open.values()):  # still waiting when the clients were given up on
            self.records.append(Record(protocol, sent, time.monotonic(), "lost: no answer when the run ended"))

    def recovered_after(self, fault_at: float, timeout_s: float) -> bool:
        """Wait until a request sent after `fault_at` succeeded (False after `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(r.outcome == "ok" and r.sent >= fault_at for r in list(self.records)):
                return True
            time.sleep(0.05)
        return False

    async def _main(self) -> None:
        import tritonclient.grpc.aio as grpcaio

        count = self.settings.concurrency
        limits = httpx.Limits(max_connections=count + 4, max_keepalive_connections=count + 4)
        async with httpx.AsyncClient(base_url=self.server.http_url, timeout=self.settings.deadline_s,
                                     limits=limits) as http:
            grpcs = [grpcaio.InferenceServerClient(self.server.grpc_url) for _ in range(count - count // 2 + 1)]
            workers = [self._client(i, http if i % 2 == 0 else grpcs[i // 2]) for i in range(count)]
            self._started.set()
            try:
                await asyncio.gather(*workers, self._probe(http, grpcs[-1]))
            finally:
                for client in grpcs:
                    await client.close()

    async def _client(self, index: int, client: Any) -> None:
        protocol = "http" if isinstance(client, httpx.AsyncClient) else "grpc"
        one = self._http if protocol == "http" else self._grpc
        turn = index
        while not self._stop.is_set():
            item = turn % len(self.target.pool)
            turn += 1
            sent = time.monotonic()
            self._open[index] = (protocol, sent)
            try:
                outcome = await asyncio.wait_for(one(client, item), self.settings.deadline_s + 5)
            except TimeoutError:
                outcome = "lost: no answer by the deadline"
            self.records.append(Record(protocol, sent, time.monotonic(), outcome))
            del self._open[index]
            if outcome not in ("ok", "wrong"):
                await asyncio.sleep(ERROR_BACKOFF_S)

    async def _http(self, client: httpx.AsyncClient, item: int) -> str:
        x = self.target.pool[item]
        header = json.dumps({"inputs": [{"name": self.target.input, "shape": list(x.shape), "datatype": "FP32",
                                         "parameters": {"binary_data_size": x.nbytes}}],
                             "outputs": [{"name": self.target.output, "parameters": {"binary_data": True}}]}).encode()
        try:
            response = await client.post(f"/v2/models/{self.target.name}/infer", content=header + x.tobytes(),
                                         headers={"Inference-Header-Content-Length": str(len(header))})
        except httpx.HTTPError as e:
            if not lost_http(e):
                raise
            return "lost: HTTP timeout" if isinstance(e, httpx.TimeoutException) else f"lost: HTTP {type(e).__name__}"
        if response.status_code != 200:
            return failure_key(str(response.status_code), _error_text(response))
        length = int(response.headers["Inference-Header-Content-Length"])
        output = json.loads(response.content[:length])["outputs"][0]
        values = np.frombuffer(response.content[length:], np.float32).reshape(output["shape"])
        return "ok" if self.target.correct(item, values) else "wrong"

    async def _grpc(self, client: Any, item: int) -> str:
        import tritonclient.grpc.aio as grpcaio
        from tritonclient.utils import InferenceServerException

        x = self.target.pool[item]
        tensor = grpcaio.InferInput(self.target.input, list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        try:
            result = await client.infer(self.target.name, [tensor], client_timeout=self.settings.deadline_s)
        except InferenceServerException as e:
            status, text = str(e.status()), str(e.message())
            if lost_grpc(status, text):
                return f"lost: gRPC {status.removeprefix('StatusCode.')}"
            return failure_key("gRPC " + status.removeprefix("StatusCode."), text)
        return "ok" if self.target.correct(item, result.as_numpy(self.target.output)) else "wrong"

    async def _probe(self, http: httpx.AsyncClient, grpc: Any) -> None:
        """HTTP live and ready, gRPC live, every HEALTH_EVERY_S."""
        while not self._stop.is_set():
            for probe in ("http live", "http ready", "grpc live"):
                started = time.monotonic()
                try:
                    if probe == "grpc live":
                        answered = bool(await grpc.is_server_live(client_timeout=5))
                    else:
                        path = "/v2/health/live" if probe == "http live" else "/v2/health/ready"
                        answered = (await http.get(path, timeout=5)).status_code == 200
                except Exception:  # noqa: BLE001 - any failure of a probe is what is counted
                    answered = False
                self.health.append((probe, time.monotonic() - started, answered))
            await asyncio.sleep(HEALTH_EVERY_S)


# ---------------------------------------------------------------------------------------------- results

def judge(result: ScenarioResult, settings: Settings) -> None:
    """The issue's bar: nothing lost, no wrong answer, recovered within `max_recovery_s`, live probes answered."""
    problems = result.problems
    if result.lost:
        problems.append(f"{result.lost} requests lost")
    if result.wrong:
        problems.append(f"{result.wrong} wrong answers")
    if result.recovery_s is None:
        problems.append("no success after the fault")
    elif result.recovery_s > settings.max_recovery_s:
        problems.append(f"recovery {result.recovery_s:.2f} s > {settings.max_recovery_s:g} s")
    for probe in ("http live", "grpc live"):
        if result.health.get(probe, {}).get("failed"):
            problems.append(f"{probe}: {result.health[probe]['failed']} probes unanswered")
    result.passed = not problems


@contextmanager
def loaded(server: FaultServer, settings: Settings, result: ScenarioResult) -> Iterator[Load]:
    """Traffic on the result's model; counts into `result` when done (faults: `result.detail['faults']`)."""
    with Load(server, server.targets[result.model], settings) as load:
        time.sleep(settings.warm_s)
        yield load
    tally(result, load.records, result.detail.get("faults", []), result.detail.get("fault_ends"))
    result.health = health_summary(load.health)


def fault_now(result: ScenarioResult) -> float:
    """Mark a fault's time."""
    now = time.monotonic()
    result.detail.setdefault("faults", []).append(now)
    return now


def settle(load: Load, fault_at: float, settings: Settings) -> None:
    """Traffic goes on until the model served again after the fault, then `after_s` more."""
    load.recovered_after(fault_at, settings.recover_timeout_s)
    time.sleep(settings.after_s)


# ---------------------------------------------------------------------------------------------- scenarios

def scenario_cuda(server: FaultServer, settings: Settings) -> ScenarioResult:
    """A sticky CUDA error in one execution of `faulty`: on a GPU the plugin's kernel that writes to an unmapped
    address (a real CUDA_ERROR_ILLEGAL_ADDRESS), on the CPU the error's text raised (STICKY)."""
    from tests.reliability import fault_plugin

    value = fault_plugin.ILLEGAL_ADDRESS if settings.gpu else fault_plugin.STICKY
    result = ScenarioResult("cuda", "faulty")
    before = server.executor_pid("faulty")
    restarts = server.metric("kiln_worker_restarts_total", "faulty") or 0.0
    with loaded(server, settings, result) as load:
        fault_at = fault_now(result)
        tensor = np.full((1, 4), value, np.float32)
        header = json.dumps({"inputs": [{"name": "X", "shape": [1, 4], "datatype": "FP32",
                                         "parameters": {"binary_data_size": tensor.nbytes}}]}).encode()
        response = httpx.post(f"{server.http_url}/v2/models/faulty/infer", content=header + tensor.tobytes(),
                              headers={"Inference-Header-Content-Length": str(len(header))}, timeout=settings.deadline_s)
        answered = time.monotonic()  # the executor exits once it answered this: what follows waits for a new one
        result.detail["fault_holds"] = [answered]
        result.detail["injected"] = {"value": value, "status": response.status_code,
                                     "text": _error_text(response)[:300] if response.status_code != 200 else ""}
        load.records.append(Record("http", fault_at, answered, "ok" if response.status_code == 200 else
                                   failure_key(str(response.status_code), result.detail["injected"]["text"])))
        settle(load, fault_at, settings)
    after = server.executor_pid("faulty")
    result.detail.update(executor_before=before, executor_after=after,
                         restarts_counted=(server.metric("kiln_worker_restarts_total", "faulty") or 0.0) - restarts)
    judge(result, settings)
    if response.status_code != 500 or "CUDA_ERROR" not in result.detail["injected"]["text"]:
        result.problems.append(f"the faulting request answered {response.status_code}, not 500 naming the CUDA error")
    if after == before:
        result.problems.append("the executor was not replaced")
    result.passed = not result.problems
    return result


def scenario_kill(server: FaultServer, settings: Settings) -> ScenarioResult:
    """SIGKILL of resnet's executor process under load."""
    result = ScenarioResult("kill", "resnet")
    with loaded(server, settings, result) as load:
        pid = server.executor_pid("resnet")
        if pid is None:
            raise RuntimeError(f"no executor process for resnet in {server.log_path}")
        fault_at = fault_now(result)
        os.kill(pid, signal.SIGKILL)
        settle(load, fault_at, settings)
    result.detail.update(killed=pid, executor_after=server.executor_pid("resnet"))
    judge(result, settings)
    if result.detail["executor_after"] in (None, pid):
        result.problems.append("no new executor process")
    result.passed = not result.problems
    return result


def reload_cycle(server: FaultServer, load: Load, result: ScenarioResult, settings: Settings) -> dict[str, Any]:
    """Unload and load resnet under traffic; the calls' statuses and times."""
    fault_at = fault_now(result)
    unload = server.repository("resnet", "unload")
    load_call = server.repository("resnet", "load")
    settle(load, fault_at, settings)
    return {"unload": unload, "load": load_call}


def scenario_reload(server: FaultServer, settings: Settings) -> ScenarioResult:
    """Unload and reload resnet under c=64 traffic."""
    result = ScenarioResult("reload", "resnet")
    with loaded(server, settings, result) as load:
        calls = reload_cycle(server, load, result, settings)
    result.detail.update(calls)
    judge(result, settings)
    for action, (status, text, _) in calls.items():
        if status != 200:
            result.problems.append(f"{action} answered {status}: {text[:120]}")
    result.passed = not result.problems
    return result


def settled_memory(server: FaultServer, target: float, settings: Settings) -> tuple[float | None, float]:
    """Device memory once it is within tolerance of `target` (or after 15 s): (bytes, seconds waited)."""
    started = time.monotonic()
    tolerance = settings.memory_tolerance_mb * 2**20
    used, _ = server.device_memory()
    while used is not None and used > target + tolerance and time.monotonic() - started < 15:
        time.sleep(0.25)
        used, _ = server.device_memory()
    return used, round(time.monotonic() - started, 2)


def steady_memory(server: FaultServer, timeout_s: float = 20.0) -> tuple[float | None, str]:
    """Device memory once three readings 0.5 s apart agree within 1 MiB (an unloaded executor's process ends, and
    its device context goes, after the unload call returned)."""
    readings: list[float] = []
    deadline = time.monotonic() + timeout_s
    while True:
        used, source = server.device_memory()
        if used is None:
            return None, source
        readings.append(used)
        if len(readings) >= 3 and max(readings[-3:]) - min(readings[-3:]) <= 2**20 or time.monotonic() > deadline:
            return used, source
        time.sleep(0.5)


def scenario_memory(server: FaultServer, settings: Settings) -> ScenarioResult:
    """`cycles` of unload and load of resnet under traffic; device memory after each unload vs before the first load.
    Each load is a fault whose window ends at the next unload: recovery is the load's time to serving again."""
    result = ScenarioResult("memory", "resnet")
    status, text, _ = server.repository("resnet", "unload")
    baseline, source = steady_memory(server)
    after: list[float | None] = []
    loaded_memory: list[float | None] = []
    waits: list[float] = []
    with loaded(server, settings, result) as load:
        for cycle in range(settings.cycles + 1):  # the first load only starts the cycles
            if cycle:
                result.detail.setdefault("fault_ends", []).append(time.monotonic())
                server.repository("resnet", "unload")
                used, waited = settled_memory(server, baseline or 0.0, settings)
                after.append(used)
                waits.append(waited)
            if cycle == settings.cycles or over_budget(settings):
                break
            fault_at = fault_now(result)
            server.repository("resnet", "load")
            load.recovered_after(fault_at, settings.recover_timeout_s)
            time.sleep(settings.after_s)
            loaded_memory.append(server.device_memory()[0])
        server.repository("resnet", "load")  # loaded again for what runs next
    result.detail.update(source=source, baseline_mib=_mib(baseline), loaded_mib=[_mib(v) for v in loaded_memory],
                         after_unload_mib=[_mib(v) for v in after], settle_s=waits, cycles=len(after),
                         growth_mib=None if baseline is None or not after or after[-1] is None
                         else _mib(after[-1] - baseline))
    judge(result, settings)
    if len(after) < settings.cycles:
        result.problems.append(f"stopped after {len(after)} of {settings.cycles} cycles (--budget-s)")
    if status != 200:
        result.problems.append(f"first unload answered {status}: {text[:120]}")
    growth = result.detail["growth_mib"]
    if baseline is None:
        result.problems.append("no device-memory reading")
    elif growth is None or growth > settings.memory_tolerance_mb:
        result.problems.append(f"device memory {growth} MiB over its baseline after the last unload")
    result.passed = not result.problems
    return result


def over_budget(settings: Settings) -> bool:
    """Whether the run must wrap up to end within `--budget-s` (a minute kept for what follows)."""
    return bool(settings.budget_s) and time.monotonic() - settings.started > settings.budget_s - 60


def _mib(value: float | None) -> float | None:
    return None if value is None else round(value / 2**20, 1)


class Ballast:
    """Device memory this process holds so that only `leave` bytes stay free (cuMemAlloc in 256 MiB pieces)."""

    def __init__(self, leave: int) -> None:
        self.leave = leave
        self.buffers: list[Any] = []
        self.free_before = self.free_after = 0

    def __enter__(self) -> Ballast:
        from engine_core.cuda.driver import DeviceBuffer, memory_info

        piece = 256 * 2**20
        self.free_before, _ = memory_info()
        free = self.free_before
        while free - piece >= self.leave:
            try:
                self.buffers.append(DeviceBuffer(piece))
            except Exception:  # noqa: BLE001 - the device is as full as it gets
                break
            free, _ = memory_info()
        self.free_after = free
        return self

    def __exit__(self, *exc: object) -> None:
        self.buffers.clear()


def names_bytes(message: str) -> dict[str, bool]:
    """Whether a load failure's message names the bytes the model needs and the bytes free."""
    lower = message.lower()
    return {"needed": bool(re.search(r"(need|requir)\w*[^.;]*\d", lower)),
            "free": bool(re.search(r"\d[^.;]*\bfree\b|\bfree\b[^.;]*\d", lower))}


def scenario_oversize(server: FaultServer, settings: Settings) -> ScenarioResult:
    """Load a model larger than the free device memory while resnet serves."""
    result = ScenarioResult("oversize", "resnet")
    weight_bytes = write_oversize(server.repo, int(settings.oversize_gib * 2**30))
    with Ballast(weight_bytes // 2) as ballast, loaded(server, settings, result) as load:
        fault_at = fault_now(result)
        status, text, seconds = server.repository("oversize", "load")
        settle(load, fault_at, settings)
    server.repository("oversize", "unload")
    shutil.rmtree(server.repo / "oversize", ignore_errors=True)
    named = names_bytes(text)
    result.detail.update(model_bytes=weight_bytes, free_before_ballast=ballast.free_before,
                         free_at_load=ballast.free_after, load_status=status, load_s=seconds, load_message=text[:600],
                         message_names=named)
    judge(result, settings)
    if status == 200:
        result.problems.append("the oversize model loaded")
    elif not all(named.values()):
        result.problems.append(f"the load's message does not name the bytes {' and '.join(k for k, v in named.items() if not v)}")
    result.passed = not result.problems
    return result


RUNNERS: dict[str, Callable[[FaultServer, Settings], ScenarioResult]] = {
    "oversize": scenario_oversize, "cuda": scenario_cuda, "kill": scenario_kill, "reload": scenario_reload,
    "memory": scenario_memory}


# ---------------------------------------------------------------------------------------------- driver

def warm_references(server: FaultServer) -> None:
    """resnet's answers before any fault: what every later answer must match (batching may pad, not change them)."""
    target = server.targets["resnet"]
    client = httpx.Client(base_url=server.http_url, timeout=120)
    expected = []
    for x in target.pool:
        body = {"inputs": [{"name": target.input, "shape": list(x.shape), "datatype": "FP32",
                            "data": x.ravel().tolist()}], "outputs": [{"name": target.output}]}
        response = client.post(f"/v2/models/{target.name}/infer", json=body)
        response.raise_for_status()
        output = response.json()["outputs"][0]
        expected.append(np.array(output["data"], np.float32).reshape(output["shape"]))
    target.expected = expected


def run(settings: Settings, scenarios: list[str], workdir: Path, write: Callable[[dict[str, Any]], None]) -> dict:
    report: dict[str, Any] = {"device": settings.device, "host": platform.node(), "scenarios": [],
                              "settings": {k: v for k, v in asdict(settings).items() if k != "started"}}
    with FaultServer(workdir, settings).running() as server:
        warm_references(server)
        report["executor_pids"] = {m: server.executor_pid(m) for m in ("resnet", "faulty")}
        for name in scenarios:
            if name in NEEDS_GPU and not settings.gpu:
                result = ScenarioResult(name, skipped=NEEDS_GPU[name])
            else:
                print(f"== {name}", flush=True)
                result = RUNNERS[name](server, settings)
            result.detail.pop("faults", None)
            result.detail.pop("fault_ends", None)
            result.detail.pop("fault_holds", None)
            report["scenarios"].append(asdict(result))
            write(report)
            print(row(result), flush=True)
    return report


def row(result: ScenarioResult) -> str:
    if result.skipped:
        return f"{result.scenario:9} skipped: {result.skipped}"
    failed = ", ".join(f"{k} x{v}" for k, v in result.failed.items()) or "-"
    statuses = ", ".join(f"{k} x{v}" for k, v in result.failed_by_status.items()) or "none"
    recovery = "-" if result.recovery_s is None else f"{result.recovery_s:.2f}"
    verdict = "pass" if result.passed else "FAIL: " + "; ".join(result.problems)
    health = ", ".join(f"{k} {v['failed']}/{v['probes']} unanswered (max {v['max_ms']:.0f} ms)"
                       for k, v in result.health.items())
    return (f"{result.scenario:9} {result.model:7} sent {result.sent:6} ok {result.succeeded:6} wrong {result.wrong} "
            f"lost {result.lost} recovery {recovery} s disrupted {result.disrupted_s:.2f} s failed {statuses}  {verdict}\n"
            f"{'':9} failed: {failed}\n{'':9} health: {health}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {', '.join(SCENARIOS)}")
    parser.add_argument("--short", action="store_true", help="seconds a scenario, 2 memory cycles (tests)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--cycles", type=int, help="memory: load/unload cycles (default 20, --short 2)")
    parser.add_argument("--warm-s", type=float, help="traffic before each fault (default 3, --short 1)")
    parser.add_argument("--after-s", type=float, help="traffic once recovered (default 5, --short 1)")
    parser.add_argument("--recover-timeout-s", type=float, help="how long to wait for a success after a fault (60)")
    parser.add_argument("--oversize-gib", type=float, default=2.0)
    parser.add_argument("--max-recovery-s", type=float, default=5.0)
    parser.add_argument("--frontend-processes", default="2")
    parser.add_argument("--budget-s", type=float, default=0.0, help="end the memory cycles early to finish within it")
    parser.add_argument("--out", help="folder for the JSON and the server log (default: bench/results, the log only "
                                      "when a scenario failed)")
    parser.add_argument("--json-file", help="default: <out>/faults_<cpu|gpu>_<time>.json")
    args = parser.parse_args(argv)
    device = ("gpu" if gpu_available() else "cpu") if args.device == "auto" else args.device
    settings = Settings(device, concurrency=args.concurrency, oversize_gib=args.oversize_gib,
                        max_recovery_s=args.max_recovery_s, frontend_processes=args.frontend_processes,
                        budget_s=args.budget_s)
    if args.short:
        short(settings)
    for name in ("cycles", "warm_s", "after_s", "recover_timeout_s"):
        if getattr(args, name) is not None:
            setattr(settings, name, getattr(args, name))
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}")
    out = Path(args.out) if args.out else ROOT / "bench" / "results"
    path = Path(args.json_file) if args.json_file else out / f"faults_{device}_{time.strftime('%Y%m%dT%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    command = "python load_tests/gpu_faults.py " + " ".join(sys.argv[1:] if argv is None else argv)

    def write(report: dict[str, Any]) -> None:
        path.write_text(json.dumps({"command": command.strip(), **report}, indent=2) + "\n")

    passed = False
    with tempfile.TemporaryDirectory(prefix="kiln_faults_") as temp:
        try:
            report = run(settings, scenarios, Path(temp), write)
            passed = all(s["passed"] for s in report["scenarios"] if not s["skipped"])
        finally:
            log = Path(temp) / "server.log"
            if log.exists() and (args.out or not passed):  # a failed run keeps its log beside its JSON
                shutil.copy(log, path.with_suffix(".log"))
    print(f"wrote {path}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
