"""Seeded fuzzing of the HTTP API from its own OpenAPI schema: every answer must be < 500 and the server must live.

    python -m load_tests.fuzz --requests 10000 --seed 0            # starts a server on the example repository
    python -m load_tests.fuzz --url http://127.0.0.1:8000 --requests 2000 --header admin-key=s3cret

For each request it picks an operation of `/openapi.json`, fills path parameters from a pool (real model names
and versions, hostile strings), and builds a body from the operation's schema, then damages it with one of a
set of mutations (wrong types, missing fields, deep nesting, huge numbers, NaN, random bytes, lying
binary-header lengths, bogus compression). schemathesis does the same with more strategies; this needs no
extra dependency and is reproducible from `--seed`. Prints a JSON report: requests, status histogram, 5xx,
transport errors (a crash or a hang shows up there) and whether the server still answers.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from load_tests import harness

ROOT = Path(__file__).resolve().parents[1]
MODELS = ["add_sub", "add_sub_fp32", "simple_cnn", "identity"]
HOSTILE = ["", "..", "%2e%2e", "nope", "a" * 300, "é", "0", "-1", "1e9", "99999999999999999999", "%00", "stats",
           "config", "infer", "ready"]
# Settings that name files on the server: fuzzing them would write files wherever the generator points.
FILE_SETTINGS = {"log_file", "trace_file"}
DATATYPES = ["BOOL", "UINT8", "INT32", "INT64", "FP16", "FP32", "FP64", "BF16", "BYTES", "INT3", ""]


@dataclass
class FuzzReport:
    requests: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    server_errors: int = 0
    transport_errors: int = 0
    examples_5xx: list[str] = field(default_factory=list)
    alive_after: bool = False
    seconds: float = 0.0


# -- values from a JSON schema ----------------------------------------------------------------------------------
class Generator:
    """Random JSON values for a schema (with its components for $ref), and mutations of them."""

    def __init__(self, rng: random.Random, components: dict[str, Any]) -> None:
        self.rng = rng
        self.components = components

    def _resolve(self, schema: dict[str, Any]) -> dict[str, Any]:
        while "$ref" in schema:
            schema = self.components.get(schema["$ref"].rsplit("/", 1)[-1], {})
        return schema

    def value(self, schema: dict[str, Any] | None, depth: int = 0) -> Any:
        schema = self._resolve(schema or {})
        rng = self.rng
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return self.value(rng.choice(schema[key]), depth)
        kind = schema.get("type")
        if isinstance(kind, list):
            kind = rng.choice(kind)
        if "enum" in schema:
            return rng.choice(schema["enum"])
        if kind == "object" or "properties" in schema:
            props = schema.get("properties", {})
            required = set(schema.get("required", []))
            result = {k: self.value(v, depth + 1) for k, v in props.items()
                      if k in required or rng.random() < 0.6}
            extra = schema.get("additionalProperties")
            if isinstance(extra, dict) and rng.random() < 0.5:
                result[self.text()] = self.value(extra, depth + 1)
            return result
        if kind == "array":
            return [self.value(schema.get("items"), depth + 1) for _ in range(rng.randint(0, 3 if depth < 3 else 0))]
        if kind == "integer":
            return rng.choice([0, 1, 16, -1, rng.randint(-10, 10**6)])
        if kind == "number":
            return rng.choice([0.0, 1.5, -2.25, rng.uniform(-1e6, 1e6)])
        if kind == "boolean":
            return rng.random() < 0.5
        if kind == "string":
            return self.text()
        return self.any(depth)

    def text(self) -> str:
        return self.rng.choice(["", "x", "INPUT0", "OUTPUT0", "true", "1", "TYPE_FP32", *DATATYPES, *HOSTILE,
                                "".join(chr(self.rng.randint(1, 0x2FF)) for _ in range(self.rng.randint(1, 12)))])

    def any(self, depth: int = 0) -> Any:
        choices = [None, True, 0, -7, 3.5, self.text(), 2**70]
        if depth < 3:
            choices += [[self.any(depth + 1) for _ in range(self.rng.randint(0, 3))],
                        {self.text(): self.any(depth + 1) for _ in range(self.rng.randint(0, 3))}]
        return self.rng.choice(choices)

    def tensor(self) -> dict[str, Any]:
        """An inference input, plausible or not: the schema leaves `data` open, so it gets its own generator."""
        rng = self.rng
        shape = rng.choice([[1, 16], [16], [2, 16], [-1], [0], [10**12], [1, 3, 32, 32], [self.any()]])
        datatype = rng.choice(DATATYPES)
        tensor: dict[str, Any] = {"name": rng.choice(["INPUT0", "INPUT1", "INPUT", "IN_FP32", "IN_BYTES", "X"]),
                                  "shape": shape, "datatype": datatype}
        roll = rng.random()
        if roll < 0.5:
            count = 16 if rng.random() < 0.7 else rng.randint(0, 40)
            tensor["data"] = [rng.choice([1, 2.5, "s", True, None, [1]]) if rng.random() < 0.05 else rng.randint(0, 9)
                              for _ in range(count)]
        elif roll < 0.8:
            tensor["parameters"] = {"binary_data_size": rng.choice([0, 4, 64, -1, 10**9, "x"])}
        else:
            tensor["data"] = self.any()
        return tensor

    def mutate(self, body: Any) -> Any:
        rng = self.rng
        choice = rng.randrange(8)
        if choice == 0 and isinstance(body, dict) and body:
            body = dict(body)
            del body[rng.choice(list(body))]
        elif choice == 1 and isinstance(body, dict) and body:
            body = dict(body)
            body[rng.choice(list(body))] = self.any()
        elif choice == 2:
            body = {"wrapped": body, "deep": json.loads("[" * 200 + "]" * 200)}
        elif choice == 3 and isinstance(body, dict):
            body = {**body, "id": rng.choice([None, 5, "x" * 1000, [1]])}
        return body


# -- requests ---------------------------------------------------------------------------------------------------
@dataclass
class Operation:
    method: str
    path: str
    body_schema: dict[str, Any] | None


def operations(schema: dict[str, Any]) -> list[Operation]:
    ops = []
    for path, methods in schema.get("paths", {}).items():
        for method, spec in methods.items():
            content = (spec.get("requestBody") or {}).get("content", {})
            body = content.get("application/json", {}).get("schema") if content else None
            ops.append(Operation(method.upper(), path, body))
    return ops


def _fill_path(path: str, rng: random.Random) -> str:
    def pick(name: str) -> str:
        if name == "model_name":
            return rng.choice(MODELS) if rng.random() < 0.8 else rng.choice(HOSTILE)
        if name == "model_version":
            return rng.choice(["1", "1", "2", "0", "-1", "x", "99999999999999999999"])
        return rng.choice(["r", "region", *HOSTILE])

    out = path
    while "{" in out:
        start, end = out.index("{"), out.index("}")
        value = httpx.URL(path="/" + pick(out[start + 1:end])).raw_path.decode()[1:] or "x"
        out = out[:start] + value + out[end + 1:]
    return out


def build_request(op: Operation, gen: Generator) -> tuple[str, str, bytes, dict[str, str]]:
    rng = gen.rng
    path = _fill_path(op.path, rng)
    headers: dict[str, str] = {}
    if op.method == "GET":
        return op.method, path, b"", headers
    if path.endswith("/infer"):
        body: Any = {"inputs": [gen.tensor() for _ in range(rng.randint(0, 3))]}
        if rng.random() < 0.3:
            body["outputs"] = [{"name": gen.text(), "parameters": gen.any()}]
        if rng.random() < 0.3:
            body["parameters"] = {"binary_data_output": rng.random() < 0.5}
    else:
        body = gen.value(op.body_schema) if op.body_schema else gen.any()
    if isinstance(body, dict):
        body = {k: v for k, v in body.items() if k not in FILE_SETTINGS}
    if rng.random() < 0.5:
        body = gen.mutate(body)
    raw = json.dumps(body).encode()
    roll = rng.random()
    if roll < 0.1:  # binary section with a header length that may lie
        tail = rng.randbytes(rng.choice([0, 4, 64, 128, 200]))
        headers["Inference-Header-Content-Length"] = str(rng.choice([len(raw), len(raw) + 3, -1, 0, len(raw) * 9]))
        raw += tail
    elif roll < 0.15:
        raw = rng.randbytes(rng.randint(0, 300))
    elif roll < 0.2:
        raw = raw.replace(b"1", b"NaN", 1)
    elif roll < 0.25:
        headers["Content-Encoding"] = rng.choice(["gzip", "deflate", "br", "gzip"])
        raw = gzip.compress(raw) if rng.random() < 0.7 else raw
    return op.method, path, raw, headers


def run_fuzz(base_url: str, requests: int, seed: int = 0, headers: dict[str, str] | None = None,
             timeout_s: float = 30.0) -> FuzzReport:
    """Send `requests` fuzzed requests to a running server and report what came back."""
    rng = random.Random(seed)
    report = FuzzReport()
    started = time.monotonic()
    with httpx.Client(base_url=base_url, timeout=timeout_s, headers=headers or {}) as client:
        schema = client.get("/openapi.json").json()
        gen = Generator(rng, schema.get("components", {}).get("schemas", {}))
        ops = operations(schema)
        statuses: Counter[str] = Counter()
        for _ in range(requests):
            method, path, body, extra = build_request(rng.choice(ops), gen)
            try:
                response = client.request(method, path, content=body or None, headers=extra)
            except httpx.HTTPError as e:
                report.transport_errors += 1
                statuses[type(e).__name__] += 1
                continue
            finally:
                report.requests += 1
            statuses[str(response.status_code)] += 1
            if response.status_code >= 500 and response.status_code != 503:
                report.server_errors += 1
                if len(report.examples_5xx) < 10:
                    report.examples_5xx.append(f"{method} {path} {body[:200]!r} -> {response.status_code} "
                                               f"{response.text[:200]}")
        report.statuses = dict(sorted(statuses.items()))
        with contextlib.suppress(httpx.HTTPError):
            report.alive_after = client.get("/v2/health/live").status_code == 200
    report.seconds = round(time.monotonic() - started, 2)
    return report


# -- a server to fuzz -------------------------------------------------------------------------------------------
@contextlib.contextmanager
def example_server(extra_args: list[str] | None = None, log_path: Path | None = None) -> Iterator[tuple[str, int]]:
    """`python -m server` on a fresh example repository (explicit mode, all models); yields (base URL, pid)."""
    with tempfile.TemporaryDirectory(prefix="kiln-fuzz-") as tmp:
        subprocess.run([sys.executable, str(ROOT / "examples" / "make_example_repository.py"), f"{tmp}/models"],
                       check=True, cwd=ROOT, capture_output=True)
        ports = harness.free_ports(3)
        command = harness.kiln_command(f"{tmp}/models", ports, "--model-control-mode", "explicit", "--load-model",
                                       "*", *(extra_args or []))
        log_path = log_path or Path(tmp) / "server.log"
        url = f"http://127.0.0.1:{ports[0]}"
        with harness.serving(command, log_path, harness.http_ready(url + "/v2/health/ready"), cwd=tmp,
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout_s=120, interval_s=0.2,
                             stop_timeout_s=15) as process:
            yield url, process.pid


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="fuzz this server instead of starting one")
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--header", action="append", default=[], metavar="KEY=VALUE",
                        help="sent with every request (e.g. a restricted-API key)")
    args = parser.parse_args(argv)
    headers = dict(h.split("=", 1) for h in args.header)
    if args.url:
        report = run_fuzz(args.url, args.requests, args.seed, headers)
    else:
        with tempfile.NamedTemporaryFile(suffix=".log") as log, example_server(log_path=Path(log.name)) as (url, _):
            report = run_fuzz(url, args.requests, args.seed, headers)
            time.sleep(0.5)
            text = Path(log.name).read_text(errors="replace")
            report_dict = asdict(report) | {"tracebacks_in_log": text.count("Traceback")}
            print(json.dumps(report_dict, indent=2))
            return 0 if report.server_errors == 0 and report.alive_after and not report.transport_errors else 1
    print(json.dumps(asdict(report), indent=2))
    return 0 if report.server_errors == 0 and report.alive_after and not report.transport_errors else 1


if __name__ == "__main__":
    sys.exit(main())
