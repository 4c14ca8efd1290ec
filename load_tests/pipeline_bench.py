"""A CPU pipeline on Triton and on Kiln: one model repository that both load unmodified, the same client.

    python -m load_tests.pipeline_bench                       # 3 alternating rounds, c=16 and c=64 over gRPC
    python -m load_tests.pipeline_bench --servers kiln --quick   # a check that the setup works (not a result)
    python -m load_tests.pipeline_bench repo /tmp/pipeline    # just write the repository

The repository (`write_repository`) is an ensemble, `pipeline`, of three Python-backend models, each with the
dynamic batcher (max batch 8, no delay) and one CPU instance:

    preprocess   IMAGE UINT8 [3, 16, 16]  -> PIXELS FP32 [768]   (x / 255 - mean) / std
    classifier   PIXELS FP32 [768]        -> LOGITS FP32 [10]    tanh(PIXELS @ W1) @ W2, fixed seeded weights
    postprocess  LOGITS FP32 [10]         -> PROBABILITIES FP32 [10], CLASS INT32 [1]   softmax, argmax

Triton is the real Triton Inference Server 2.51 (C++ core, ensemble scheduler, Python backend) from the
nvidia-pytriton wheel, started by ../shared/tools/triton-peer/serve.sh on this repository; Kiln is `python -m
server` on it. Each round starts one server, runs `load_tests.perf` (the project's perf_analyzer-like driver) at
each concurrency over gRPC, stops it, then the other (never both at once), so drift on the machine hits both
alike. Results: a table on stdout and bench/results/pipeline_cpu_<timestamp>.json (every round's rows, and per
level the median req/s and p99 of each server with Kiln's req/s over Triton's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from load_tests import harness, peers, perf

RESULTS = harness.ROOT / "bench" / "results"
SERVERS = ("kiln", "triton")
LEVELS = "16,64"
MAX_BATCH = 8
CLASSES = 10
HIDDEN = 64
IMAGE_SHAPE = (3, 16, 16)
PIXELS = int(np.prod(IMAGE_SHAPE))
MEAN, STD = 0.5, 0.25
SEED = 31
#: per level: 1 s warm-up, then 1 s windows until 3 agree within 10 % or 4 windows (perf's stability rule)
PERF_ARGS = ("-p", "1000", "--warmup", "1", "-r", "4", "--processes", "2")
QUICK_ARGS = ("-p", "300", "--warmup", "0.2", "-r", "3", "--processes", "1")

_CONFIG = '''name: "{name}"
backend: "python"
max_batch_size: {max_batch}
input [ {inputs} ]
output [ {outputs} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
dynamic_batching {{ }}
'''

_PREPROCESS = '''import numpy as np
import triton_python_backend_utils as pb_utils

MEAN, STD = {mean}, {std}


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            image = pb_utils.get_input_tensor_by_name(request, "IMAGE").as_numpy()
            pixels = (image.reshape(image.shape[0], -1).astype(np.float32) / np.float32(255.0) - MEAN) / STD
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("PIXELS", pixels.astype(np.float32))]))
        return responses
'''

_CLASSIFIER = '''import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        rng = np.random.default_rng({seed})
        self.w1 = (rng.standard_normal(({pixels}, {hidden})) / np.sqrt({pixels})).astype(np.float32)
        self.w2 = (rng.standard_normal(({hidden}, {classes})) / np.sqrt({hidden})).astype(np.float32)

    def execute(self, requests):
        responses = []
        for request in requests:
            pixels = pb_utils.get_input_tensor_by_name(request, "PIXELS").as_numpy()
            logits = np.tanh(pixels @ self.w1) @ self.w2
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("LOGITS", logits.astype(np.float32))]))
        return responses
'''

_POSTPROCESS = '''import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            logits = pb_utils.get_input_tensor_by_name(request, "LOGITS").as_numpy()
            shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
            probabilities = (shifted / shifted.sum(axis=-1, keepdims=True)).astype(np.float32)
            top = np.argmax(probabilities, axis=-1).astype(np.int32).reshape(-1, 1)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("PROBABILITIES", probabilities), pb_utils.Tensor("CLASS", top)]))
        return responses
'''


def _tensor(name: str, data_type: str, dims: tuple[int, ...] | list[int]) -> str:
    return f'{{ name: "{name}" data_type: {data_type} dims: [ {", ".join(map(str, dims))} ] }}'


def _step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    maps = [f'input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items()]
    maps += [f'output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items()]
    return f'{{ model_name: "{model}" model_version: -1 {" ".join(maps)} }}'


def write_repository(directory: Path) -> Path:
    """The pipeline's four models under `directory` (created), in Triton's layout; returns `directory`."""
    image = _tensor("IMAGE", "TYPE_UINT8", IMAGE_SHAPE)
    pixels = _tensor("PIXELS", "TYPE_FP32", [PIXELS])
    logits = _tensor("LOGITS", "TYPE_FP32", [CLASSES])
    probabilities, top = _tensor("PROBABILITIES", "TYPE_FP32", [CLASSES]), _tensor("CLASS", "TYPE_INT32", [1])
    models = {
        "preprocess": (image, pixels, _PREPROCESS.format(mean=MEAN, std=STD)),
        "classifier": (pixels, logits, _CLASSIFIER.format(seed=SEED, pixels=PIXELS, hidden=HIDDEN, classes=CLASSES)),
        "postprocess": (logits, f"{probabilities}, {top}", _POSTPROCESS),
    }
    for name, (inputs, outputs, source) in models.items():
        (directory / name / "1").mkdir(parents=True, exist_ok=True)
        (directory / name / "config.pbtxt").write_text(
            _CONFIG.format(name=name, max_batch=MAX_BATCH, inputs=inputs, outputs=outputs))
        (directory / name / "1" / "model.py").write_text(source)
    steps = [_step("preprocess", {"IMAGE": "IMAGE"}, {"PIXELS": "pixels"}),
             _step("classifier", {"PIXELS": "pixels"}, {"LOGITS": "logits"}),
             _step("postprocess", {"LOGITS": "logits"}, {"PROBABILITIES": "PROBABILITIES", "CLASS": "CLASS"})]
    (directory / "pipeline" / "1").mkdir(parents=True, exist_ok=True)
    (directory / "pipeline" / "config.pbtxt").write_text(
        f'name: "pipeline"\nplatform: "ensemble"\nmax_batch_size: {MAX_BATCH}\ninput [ {image} ]\n'
        f"output [ {probabilities}, {top} ]\nensemble_scheduling {{ step [\n  " + ",\n  ".join(steps) + "\n] }\n")
    return directory


def reference(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What the pipeline answers for a batch of UINT8 images [n, 3, 16, 16]: (PROBABILITIES, CLASS)."""
    rng = np.random.default_rng(SEED)
    w1 = (rng.standard_normal((PIXELS, HIDDEN)) / np.sqrt(PIXELS)).astype(np.float32)
    w2 = (rng.standard_normal((HIDDEN, CLASSES)) / np.sqrt(HIDDEN)).astype(np.float32)
    pixels = (images.reshape(images.shape[0], -1).astype(np.float32) / np.float32(255.0) - MEAN) / STD
    logits = (np.tanh(pixels.astype(np.float32) @ w1) @ w2).astype(np.float32)
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probabilities = (shifted / shifted.sum(axis=-1, keepdims=True)).astype(np.float32)
    return probabilities, np.argmax(probabilities, axis=-1).astype(np.int32).reshape(-1, 1)


# ----------------------------------------------------------------------------------------------- servers

def triton_server(repo: Path, logs: Path) -> peers.Server:
    """serve.sh on `repo` (its fourth argument); the version from the wheel's metadata, as load_tests.peers reads it."""
    server = peers.triton_server(repo, logs)
    server.command = [*server.command, str(repo)]
    return server


FACTORIES = {"kiln": peers.kiln_server_on, "triton": triton_server}


def available(name: str) -> str:
    """Why `name` cannot run here ("" when it can)."""
    return peers.available(name)


# ----------------------------------------------------------------------------------------------- running

def run_perf(server: peers.Server, out: Path, levels: str, quick: bool) -> dict[str, Any]:
    """`load_tests.perf` on the ensemble over gRPC at `levels`; its JSON document."""
    argv = ["-m", "pipeline", "-i", "grpc", "-u", f"127.0.0.1:{server.grpc_port}", "--concurrency-range", levels,
            *(QUICK_ARGS if quick else PERF_ARGS), "--label", server.name, "--json-file", str(out), "-q"]
    args = perf.build_parser().parse_args(argv)
    args.argv = argv
    document = perf.run(args)
    out.write_text(json.dumps(document, indent=2) + "\n")
    return document


def bench(servers: list[str], rounds: int, levels: str, out_dir: Path, quick: bool = False,
          work: Path | None = None) -> dict[str, Any]:
    """`rounds` rounds, each server in turn per round; the document written to out_dir/pipeline_cpu_<ts>.json."""
    work = work or Path(tempfile.mkdtemp(prefix="kiln-pipeline-"))
    repo = write_repository(work / "repository")
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    runnable = []
    for name in servers:
        why = available(name)
        if why:
            print(f"skipping {name}: {why}", file=sys.stderr)
        else:
            runnable.append(name)
    rows: list[dict[str, Any]] = []
    versions: dict[str, str] = {}
    for turn in range(1, rounds + 1):
        for name in runnable:
            with FACTORIES[name](repo, logs).running() as server:
                print(f"== round {turn}: {name}", file=sys.stderr, flush=True)
                document = run_perf(server, work / f"perf_{name}_{turn}.json", levels, quick)
                versions[name] = server.version
            for result in document["results"]:
                rows.append({"server": name, "round": turn, "concurrency": result["concurrency"],
                             "requests_per_s": result["requests_per_s"], "latency_us": result["latency_us"],
                             "errors": result["errors"], "stable": result["stable"],
                             "client_cpu_cores": result["client"]["cpu_cores"], "server_split": result["server"]})
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    document = {
        "benchmark": "pipeline_cpu",
        "command": "python -m load_tests.pipeline_bench " + " ".join(sys.argv[1:]),
        "pipeline": "ensemble: preprocess (Python) -> classifier (Python, numpy) -> postprocess (Python); "
                    f"UINT8 {list(IMAGE_SHAPE)} in, FP32 [{CLASSES}] + INT32 [1] out; max batch {MAX_BATCH}, "
                    "dynamic batching, 1 CPU instance per model",
        "protocol": "grpc", "rounds": rounds, "levels": levels, "quick": quick,
        "perf_args": list(QUICK_ARGS if quick else PERF_ARGS),
        "servers": versions,
        "host": {"cpus": os.cpu_count()},
        "started_utc": stamp,
        "rows": rows,
        "summary": summarize(rows),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"pipeline_cpu_{stamp}.json"
    path.write_text(json.dumps(document, indent=2) + "\n")
    document["path"] = str(path)
    return document


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per concurrency: each server's median req/s and p99 over the rounds, and Kiln's req/s over Triton's."""
    summary = []
    for level in sorted({r["concurrency"] for r in rows}):
        entry: dict[str, Any] = {"concurrency": level}
        for name in SERVERS:
            mine = [r for r in rows if r["server"] == name and r["concurrency"] == level]
            if mine:
                entry[name] = {"requests_per_s": statistics.median(r["requests_per_s"] for r in mine),
                               "p99_us": statistics.median(r["latency_us"].get("p99", 0.0) for r in mine),
                               "errors": sum(r["errors"] for r in mine)}
        if "kiln" in entry and "triton" in entry and entry["triton"]["requests_per_s"]:
            entry["kiln_over_triton"] = entry["kiln"]["requests_per_s"] / entry["triton"]["requests_per_s"]
        summary.append(entry)
    return summary


def print_table(document: dict[str, Any], out=sys.stdout) -> None:
    print(f"{'server':<8} {'round':>5} {'conc':>5} {'req/s':>9} {'p50 us':>9} {'p99 us':>9} {'err':>4}", file=out)
    for r in document["rows"]:
        lat = r["latency_us"]
        print(f"{r['server']:<8} {r['round']:>5} {r['concurrency']:>5} {r['requests_per_s']:>9.1f} "
              f"{lat.get('p50', 0):>9.0f} {lat.get('p99', 0):>9.0f} {r['errors']:>4}", file=out)
    print(file=out)
    for entry in document["summary"]:
        parts = [f"c={entry['concurrency']}:"]
        for name in SERVERS:
            if name in entry:
                parts.append(f"{name} {entry[name]['requests_per_s']:.1f} req/s (p99 {entry[name]['p99_us']:.0f} us)")
        if "kiln_over_triton" in entry:
            parts.append(f"Kiln/Triton {entry['kiln_over_triton']:.2f}x")
        print("  ".join(parts), file=out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m load_tests.pipeline_bench", description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs="?", choices=["bench", "repo"], default="bench")
    parser.add_argument("directory", nargs="?", type=Path, default=None, help="repo: where to write it")
    parser.add_argument("--servers", nargs="+", default=list(SERVERS), choices=list(SERVERS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", default=LEVELS, help="perf's --concurrency-range (default 16,64)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--work", type=Path, default=None, help="repository and logs (default: a temporary dir)")
    parser.add_argument("--quick", action="store_true", help="0.3 s windows: checks the setup, not a result")
    args = parser.parse_args(argv)
    if args.command == "repo":
        if args.directory is None:
            parser.error("repo needs a directory")
        print(write_repository(args.directory))
        return 0
    document = bench(args.servers, args.rounds, args.concurrency, args.out, args.quick, args.work)
    print_table(document)
    print(document["path"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
