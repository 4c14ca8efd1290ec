"""Soak: mixed good and bad traffic for N minutes while the server's RSS is sampled; RSS must stay flat.

    python -m load_tests.soak --minutes 10                       # starts a server on the example repository
    python -m load_tests.soak --minutes 2 --json-file soak.json  # default file: bench/results/soak_<time>.json

Traffic (threads, `--concurrency` of them, each picking at random from the mix): add_sub JSON and binary over
HTTP (batch 1..8), simple_cnn images with classification, identity with several datatypes, gRPC ModelInfer on
add_sub and simple_cnn, and fuzzed bad requests (load_tests.fuzz, a third of the traffic). Every good answer is
checked against numpy; a request is *lost* when it gets neither an answer nor an error from the server (the rule
and its cases are in load_tests/fault_tally.py, which the fault driver shares).
RSS is the server's whole process tree (the server, its frontend processes, Python model stubs, build helpers),
from /proc (psutil is not needed), every `--sample-s`. Where `nvidia-smi` answers, the device memory the tree's
processes hold is sampled too (on a GPU machine the example repository's models without an instance kind build
for CUDA), and must stay flat in the same sense. "Flat" means: over the last 80% of the run (the first 20% is
warm-up: allocator arenas, caches, first-time imports) the least-squares slope is under `--max-slope-mb-per-min`
and the fitted line rises less than `--max-growth-mb` end to end.
Exit code 0 when flat, no request lost, no wrong answer, no unexpected 5xx and no worker restart.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from load_tests.fault_tally import lost_grpc, lost_http
from load_tests.fuzz import Generator, build_request, example_server, operations
from load_tests.harness import metric_sum
from load_tests.process_cpu import descendants

ADD_SUB_EXPECTED = list(range(1, 17))
#: the HTTP status a gRPC error the server sent stands for in the counts (others: 400, a refused request)
GRPC_AS_HTTP = {"INTERNAL": 500, "UNKNOWN": 500, "UNAVAILABLE": 503}


def rss_mb(pid: int) -> float:
    """Resident set size of `pid` in MiB, from /proc (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def tree_rss_mb(pid: int) -> float:
    """RSS of `pid`'s whole process tree in MiB (a process that exits meanwhile counts 0)."""
    total = 0.0
    for member in descendants(pid):
        try:
            total += rss_mb(member)
        except (OSError, RuntimeError):
            pass
    return total


def device_memory_mb(pid: int) -> float | None:
    """Device memory (MiB) that `pid`'s process tree holds on every GPU, as `nvidia-smi` reports it per process;
    None where nvidia-smi is missing or fails (no GPU)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    tree = set(descendants(pid))
    return float(sum(int(used) for owner, used in (line.split(",") for line in out.splitlines() if line.strip())
                     if int(owner) in tree))


@dataclass
class SoakReport:
    minutes: float = 0.0
    requests: int = 0
    good_ok: int = 0
    bad_sent: int = 0
    wrong_answers: int = 0
    server_errors: int = 0
    lost: int = 0
    worker_restarts: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    by_action: dict[str, int] = field(default_factory=dict)
    rss_samples_mb: list[float] = field(default_factory=list)
    rss_sample_minutes: list[float] = field(default_factory=list)
    rss_start_mb: float = 0.0  # first sample of the fit window
    rss_end_mb: float = 0.0  # last sample
    rss_max_mb: float = 0.0
    rss_growth_mb: float = 0.0  # the fitted line's rise over the fit window
    rss_slope_mb_per_min: float = 0.0
    #: device memory of the process tree (nvidia-smi), when there is a GPU; fitted like RSS
    device_samples_mb: list[float] = field(default_factory=list)
    device_sample_minutes: list[float] = field(default_factory=list)
    device_growth_mb: float = 0.0
    device_slope_mb_per_min: float = 0.0
    max_slope_mb_per_min: float = 0.0
    max_growth_mb: float = 0.0
    flat: bool = False
    passed: bool = False


class Traffic:
    """One worker's requests; each returns (kind, status, correct) where kind is 'good' or 'bad'."""

    def __init__(self, base_url: str, grpc_url: str | None, seed: int, schema: dict) -> None:
        self.http = httpx.Client(base_url=base_url, timeout=60)
        self.rng = random.Random(seed)
        self.gen = Generator(self.rng, schema.get("components", {}).get("schemas", {}))
        # Only inference routes are fuzzed here: the soak must not unload the models it measures.
        self.ops = [op for op in operations(schema) if op.path.endswith("/infer")]
        self.grpc = None
        if grpc_url:
            import grpc

            from server.protos import grpc_service_pb2_grpc
            self._channel = grpc.insecure_channel(grpc_url)
            self.grpc = grpc_service_pb2_grpc.GRPCInferenceServiceStub(self._channel)

    def add_sub_json(self) -> tuple[str, int, bool]:
        body = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))},
                           {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [1] * 16}]}
        response = self.http.post("/v2/models/add_sub/infer", json=body)
        ok = response.status_code == 200 and response.json()["outputs"][0]["data"] == ADD_SUB_EXPECTED
        return "good", response.status_code, ok

    def add_sub_binary(self) -> tuple[str, int, bool]:
        batch = self.rng.randint(1, 8)
        a = self.rng.randbytes(batch * 64)
        b = self.rng.randbytes(batch * 64)
        header = json.dumps({"inputs": [{"name": n, "shape": [batch, 16], "datatype": "INT32",
                                         "parameters": {"binary_data_size": batch * 64}} for n in ("INPUT0", "INPUT1")],
                             "parameters": {"binary_data_output": True}}).encode()
        response = self.http.post("/v2/models/add_sub/infer", content=header + a + b,
                                  headers={"Inference-Header-Content-Length": str(len(header))})
        if response.status_code != 200:
            return "good", response.status_code, False
        length = int(response.headers["Inference-Header-Content-Length"])
        got = np.frombuffer(response.content[length:length + batch * 64], np.int32)
        want = np.frombuffer(a, np.int32) + np.frombuffer(b, np.int32)
        return "good", 200, bool(np.array_equal(got, want))

    def cnn(self) -> tuple[str, int, bool]:
        batch = self.rng.randint(1, 4)
        body = {"inputs": [{"name": "INPUT", "shape": [batch, 3, 32, 32], "datatype": "FP32",
                            "data": [0.25] * (batch * 3 * 32 * 32)}],
                "outputs": [{"name": "PROBABILITIES", "parameters": {"classification": 3}}]}
        response = self.http.post("/v2/models/simple_cnn/infer", json=body)
        ok = response.status_code == 200 and len(response.json()["outputs"][0]["data"]) == batch * 3
        return "good", response.status_code, ok

    def _model_infer(self, request):
        """The ModelInfer response, or the (kind, status, correct) outcome of a refused request; a lost one
        (unavailable, cancelled, ...) raises NoAnswer."""
        import grpc

        try:
            return self.grpc.ModelInfer(request, timeout=60)
        except grpc.RpcError as e:
            if lost_grpc(e.code().name, e.details() or ""):
                raise NoAnswer(f"gRPC {e.code().name}") from None
            return "good", GRPC_AS_HTTP.get(e.code().name, 400), False

    def grpc_infer(self) -> tuple[str, int, bool]:
        if self.grpc is None:
            return self.add_sub_json()

        from server.protos import grpc_service_pb2 as pb
        request = pb.ModelInferRequest(model_name="add_sub")
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        for name in ("INPUT0", "INPUT1"):
            request.inputs.add(name=name, datatype="INT32").shape.extend([1, 16])
        request.raw_input_contents.extend([a.tobytes(), np.ones_like(a).tobytes()])
        response = self._model_infer(request)
        if isinstance(response, tuple):
            return response
        got = np.frombuffer(response.raw_output_contents[0], np.int32)
        return "good", 200, bool(np.array_equal(got, a.ravel() + 1))

    def grpc_cnn(self) -> tuple[str, int, bool]:
        if self.grpc is None:
            return self.cnn()

        from server.protos import grpc_service_pb2 as pb
        batch = self.rng.randint(1, 4)
        x = np.full((batch, 3, 32, 32), 0.25, np.float32)
        request = pb.ModelInferRequest(model_name="simple_cnn")
        request.inputs.add(name="INPUT", datatype="FP32").shape.extend(x.shape)
        request.raw_input_contents.append(x.tobytes())
        response = self._model_infer(request)
        if isinstance(response, tuple):
            return response
        ok = len(response.outputs) >= 1 and response.outputs[0].shape[0] == batch
        return "good", 200, bool(ok)

    def identity(self) -> tuple[str, int, bool]:
        """Every input of the identity model (it takes all of them), values chosen per datatype; each output must
        echo its input. Its config leaves max_batch_size to auto-completion (4): the one dim is the batch."""
        n = self.rng.randint(1, 4)
        values = {"BOOL": [i % 2 == 0 for i in range(n)], "UINT8": list(range(n)), "UINT16": list(range(n)),
                  "UINT32": list(range(n)), "UINT64": list(range(n)), "INT8": [-i for i in range(n)],
                  "INT16": [-i for i in range(n)], "INT32": [i * 1000 for i in range(n)],
                  "INT64": [i << 40 for i in range(n)], "FP16": [i / 2 for i in range(n)],
                  "FP32": [i / 4 for i in range(n)], "FP64": [i / 8 for i in range(n)],
                  "BF16": [float(i) for i in range(n)], "BYTES": [f"s{i}" for i in range(n)]}
        body = {"inputs": [{"name": f"IN_{t}", "shape": [n], "datatype": t, "data": v} for t, v in values.items()]}
        response = self.http.post("/v2/models/identity/infer", json=body)
        if response.status_code != 200:
            return "good", response.status_code, False
        got = {o["name"]: o["data"] for o in response.json()["outputs"]}
        return "good", 200, all(got.get(f"OUT_{t}") == v for t, v in values.items())

    def bad(self) -> tuple[str, int, bool]:
        method, path, body, headers = build_request(self.rng.choice(self.ops), self.gen)
        response = self.http.request(method, path, content=body or None, headers=headers)
        return "bad", response.status_code, response.status_code < 500 or response.status_code == 503

    def one(self) -> tuple[str, str, int, bool]:
        """One request of a random kind: (action name, 'good' or 'bad', status, correct)."""
        action = self.rng.choice([self.add_sub_json, self.add_sub_binary, self.cnn, self.identity, self.grpc_infer,
                                  self.grpc_cnn, self.bad, self.bad, self.bad])
        return (action.__name__, *action())


class NoAnswer(Exception):
    """The request got no answer (a lost request)."""


def soak(base_url: str, pid: int, minutes: float, concurrency: int, grpc_url: str | None = None,
         sample_s: float = 5.0, seed: int = 0, max_slope: float = 2.0, max_growth: float = 32.0,
         metrics_url: str | None = None) -> SoakReport:
    report = SoakReport(minutes=minutes, max_slope_mb_per_min=max_slope, max_growth_mb=max_growth)
    schema = httpx.get(base_url + "/openapi.json", timeout=30).json()
    statuses: Counter[str] = Counter()
    actions: Counter[str] = Counter()
    lock = threading.Lock()
    stop = threading.Event()

    def worker(index: int) -> None:
        traffic = Traffic(base_url, grpc_url, seed * 1000 + index, schema)
        while not stop.is_set():
            try:
                action, kind, status, ok = traffic.one()
            except (httpx.HTTPError, NoAnswer) as e:
                lost = isinstance(e, NoAnswer) or lost_http(e)
                with lock:
                    report.requests += 1
                    report.lost += lost
                    report.wrong_answers += not lost  # answered, but unreadable (decoding, redirects)
                    statuses[f"{type(e).__name__}: {e}"[:80]] += 1
                continue
            with lock:
                report.requests += 1
                actions[action] += 1
                statuses[str(status)] += 1
                if kind == "bad":
                    report.bad_sent += 1
                elif ok:
                    report.good_ok += 1
                else:
                    report.wrong_answers += 1
                if status >= 500 and status != 503:
                    report.server_errors += 1

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    started = time.monotonic()
    minute_shown = 0
    while time.monotonic() - started < minutes * 60:
        time.sleep(sample_s)
        report.rss_sample_minutes.append(round((time.monotonic() - started) / 60, 3))
        report.rss_samples_mb.append(round(tree_rss_mb(pid), 1))
        device = device_memory_mb(pid)
        if device is not None:
            report.device_samples_mb.append(device)
            report.device_sample_minutes.append(report.rss_sample_minutes[-1])
        if int(report.rss_sample_minutes[-1]) > minute_shown:  # a line a minute: a run cut short still says something
            minute_shown = int(report.rss_sample_minutes[-1])
            print(f"minute {minute_shown}: {report.requests} requests, {report.lost} lost, {report.server_errors} "
                  f"server errors, RSS {report.rss_samples_mb[-1]} MiB, device {device} MiB", flush=True)
    stop.set()
    for thread in threads:
        thread.join(timeout=60)
    report.statuses = dict(sorted(statuses.items()))
    report.by_action = dict(sorted(actions.items()))
    if metrics_url:
        report.worker_restarts = worker_restarts(metrics_url)
    judge(report)
    return report


def worker_restarts(metrics_url: str) -> int:
    """Sum of kiln_worker_restarts_total over every model (a restart in a soak is a fault to explain)."""
    return int(metric_sum(metrics_url, "kiln_worker_restarts_total") or 0)


def judge(report: SoakReport, fit_share: float = 0.8) -> None:
    """Flat memory: least-squares line over the samples of the last `fit_share` of the run; its slope (MiB/min)
    and its rise over that window must stay under the report's limits, for host RSS and (when sampled) device
    memory alike. Sets `flat` and `passed`."""
    times, samples = report.rss_sample_minutes, report.rss_samples_mb
    fitted = _fit(times, samples, report.minutes * (1 - fit_share))
    if fitted is not None:
        (report.rss_start_mb, report.rss_end_mb), report.rss_max_mb = fitted[2], float(max(samples))
        report.rss_slope_mb_per_min, report.rss_growth_mb = fitted[0], fitted[1]
        report.flat = report.rss_slope_mb_per_min < report.max_slope_mb_per_min and \
            report.rss_growth_mb < report.max_growth_mb
    if report.device_samples_mb:
        device = _fit(report.device_sample_minutes, report.device_samples_mb, report.minutes * (1 - fit_share))
        if device is None:
            report.flat = False  # sampled but too few samples to judge
        else:
            report.device_slope_mb_per_min, report.device_growth_mb = device[0], device[1]
            report.flat = report.flat and device[0] < report.max_slope_mb_per_min and \
                device[1] < report.max_growth_mb
    report.passed = (report.flat and report.lost == 0 and report.server_errors == 0 and report.wrong_answers == 0
                     and report.worker_restarts == 0)


def _fit(times: list[float], samples: list[float], after: float
         ) -> tuple[float, float, tuple[float, float]] | None:
    """(slope MiB/min, the fitted line's rise, (first, last sample)) over the samples from minute `after` on; None
    with fewer than 4 of them."""
    window = [(t, s) for t, s in zip(times, samples) if t >= after]
    if len(window) < 4:
        return None
    t, s = np.array(window).T
    slope, _ = np.polyfit(t, s, 1)
    return round(float(slope), 3), round(float(slope * (t[-1] - t[0])), 1), (float(s[0]), float(s[-1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-slope-mb-per-min", type=float, default=2.0)
    parser.add_argument("--max-growth-mb", type=float, default=32.0)
    parser.add_argument("--json-file", help="default: bench/results/soak_<time>.json")
    args = parser.parse_args(argv)
    starting = time.monotonic()
    with example_server() as (url, pid):
        print(f"server ready after {time.monotonic() - starting:.1f} s", flush=True)
        grpc_url = None
        try:
            import server.frontends.grpc  # noqa: F401

            grpc_url = _flag_url(pid, b"--grpc-port", "{}")
        except ImportError:
            pass
        report = soak(url, pid, args.minutes, args.concurrency, grpc_url, args.sample_s, args.seed,
                      args.max_slope_mb_per_min, args.max_growth_mb, _flag_url(pid, b"--metrics-port", "http://{}/metrics"))
    summary = {k: v for k, v in asdict(report).items()
               if k not in ("rss_samples_mb", "rss_sample_minutes", "device_samples_mb", "device_sample_minutes")}
    print(json.dumps(summary, indent=2))
    path = Path(args.json_file or Path(__file__).resolve().parents[1] / "bench" / "results"
                / f"soak_{time.strftime('%Y%m%dT%H%M%S')}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    command = "python -m load_tests.soak " + " ".join(sys.argv[1:] if argv is None else argv)
    path.write_text(json.dumps({"command": command.strip(), **asdict(report)}, indent=2) + "\n")
    print(f"wrote {path}")
    return 0 if report.passed else 1


def _flag_url(pid: int, flag: bytes, template: str) -> str | None:
    """The URL of a port of the server we started (`--grpc-port`, `--metrics-port`): read from its command line."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    for name, value in zip(argv, argv[1:]):
        if name == flag:
            return template.format(f"127.0.0.1:{value.decode()}")
    return None


if __name__ == "__main__":
    sys.exit(main())
