"""Soak: mixed good and bad traffic for N minutes while the server's RSS is sampled; RSS must stay flat.

    python -m load_tests.soak --minutes 10                       # starts a server on the example repository
    python -m load_tests.soak --minutes 2 --json-file soak.json

Traffic (threads, `--concurrency` of them, round-robin over the mix): add_sub JSON and binary over HTTP,
simple_cnn images, identity with every datatype, gRPC ModelInfer, and fuzzed bad requests (load_tests.fuzz).
Every good answer is checked against numpy; a request is *lost* when it gets no HTTP answer at all.
RSS comes from /proc/<pid>/status (psutil is not needed). "Flat" means: after the first `--warmup-s`,
the median of the last quarter of samples exceeds the median of the first quarter by less than
`--max-growth-mb` (default 32 MiB), and the least-squares slope is under `--max-slope-mb-per-min`.
Exit code 0 when flat, no request lost and no unexpected 5xx.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from load_tests.fuzz import Generator, build_request, example_server, operations

ADD_SUB_EXPECTED = list(range(1, 17))


def rss_mb(pid: int) -> float:
    """Resident set size of `pid` in MiB, from /proc (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


@dataclass
class SoakReport:
    minutes: float = 0.0
    requests: int = 0
    good_ok: int = 0
    bad_sent: int = 0
    wrong_answers: int = 0
    server_errors: int = 0
    lost: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    rss_samples_mb: list[float] = field(default_factory=list)
    rss_start_mb: float = 0.0
    rss_end_mb: float = 0.0
    rss_growth_mb: float = 0.0
    rss_slope_mb_per_min: float = 0.0
    flat: bool = False


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

    def grpc_infer(self) -> tuple[str, int, bool]:
        if self.grpc is None:
            return self.add_sub_json()
        import grpc

        from server.protos import grpc_service_pb2 as pb
        request = pb.ModelInferRequest(model_name="add_sub")
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        for name in ("INPUT0", "INPUT1"):
            request.inputs.add(name=name, datatype="INT32").shape.extend([1, 16])
        request.raw_input_contents.extend([a.tobytes(), np.ones_like(a).tobytes()])
        try:
            response = self.grpc.ModelInfer(request, timeout=60)
        except grpc.RpcError as e:
            return "good", 500 if e.code() == grpc.StatusCode.INTERNAL else 400, False
        got = np.frombuffer(response.raw_output_contents[0], np.int32)
        return "good", 200, bool(np.array_equal(got, a.ravel() + 1))

    def bad(self) -> tuple[str, int, bool]:
        method, path, body, headers = build_request(self.rng.choice(self.ops), self.gen)
        response = self.http.request(method, path, content=body or None, headers=headers)
        return "bad", response.status_code, response.status_code < 500 or response.status_code == 503

    def one(self) -> tuple[str, int, bool]:
        action = self.rng.choice([self.add_sub_json, self.add_sub_binary, self.cnn, self.grpc_infer, self.bad,
                                  self.bad])
        return action()


def soak(base_url: str, pid: int, minutes: float, concurrency: int, grpc_url: str | None = None,
         sample_s: float = 5.0, warmup_s: float = 20.0, seed: int = 0) -> SoakReport:
    report = SoakReport(minutes=minutes)
    schema = httpx.get(base_url + "/openapi.json", timeout=30).json()
    statuses: Counter[str] = Counter()
    lock = threading.Lock()
    stop = threading.Event()

    def worker(index: int) -> None:
        traffic = Traffic(base_url, grpc_url, seed * 1000 + index, schema)
        while not stop.is_set():
            try:
                kind, status, ok = traffic.one()
            except httpx.HTTPError as e:
                with lock:
                    report.requests += 1
                    report.lost += 1
                    statuses[type(e).__name__] += 1
                continue
            with lock:
                report.requests += 1
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
    times: list[float] = []
    while time.monotonic() - started < minutes * 60:
        time.sleep(sample_s)
        if time.monotonic() - started >= warmup_s:
            times.append((time.monotonic() - started) / 60)
            report.rss_samples_mb.append(round(rss_mb(pid), 1))
    stop.set()
    for thread in threads:
        thread.join(timeout=60)
    report.statuses = dict(sorted(statuses.items()))
    _judge(report, times)
    return report


def _judge(report: SoakReport, times: list[float], max_growth_mb: float = 32.0, max_slope: float = 8.0) -> None:
    samples = report.rss_samples_mb
    if len(samples) < 4:
        return
    quarter = max(len(samples) // 4, 1)
    report.rss_start_mb = statistics.median(samples[:quarter])
    report.rss_end_mb = statistics.median(samples[-quarter:])
    report.rss_growth_mb = round(report.rss_end_mb - report.rss_start_mb, 1)
    report.rss_slope_mb_per_min = round(float(np.polyfit(times, samples, 1)[0]), 2)
    report.flat = report.rss_growth_mb < max_growth_mb and report.rss_slope_mb_per_min < max_slope


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--warmup-s", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-file", help="also write the report here")
    args = parser.parse_args(argv)
    with example_server() as (url, pid):
        grpc_url = None
        try:
            import server.frontends.grpc  # noqa: F401

            grpc_url = _grpc_url(pid)
        except ImportError:
            pass
        report = soak(url, pid, args.minutes, args.concurrency, grpc_url, args.sample_s, args.warmup_s, args.seed)
    text = json.dumps(asdict(report), indent=2)
    print(text)
    if args.json_file:
        Path(args.json_file).write_text(text + "\n")
    return 0 if report.flat and report.lost == 0 and report.server_errors == 0 and report.wrong_answers == 0 else 1


def _grpc_url(pid: int) -> str | None:
    """The gRPC port of the server we started: read from its command line."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    for flag, value in zip(argv, argv[1:]):
        if flag == b"--grpc-port":
            return f"127.0.0.1:{value.decode()}"
    return None


if __name__ == "__main__":
    sys.exit(main())
