"""The first request after a model is ready against the hundredth: what a cold start costs a live client.

    python load_tests/warmup_latency.py --out $OUT                 # GPU: BERT-base CLS fp16, dynamic batching
    python load_tests/warmup_latency.py --models resnet50,bert --out $OUT
    python load_tests/warmup_latency.py --smoke --out /tmp/wl      # any machine: tiny models on the CPU, seconds
    python load_tests/warmup_latency.py --trace --out $OUT         # also the server's and the execution's share
    python load_tests/warmup_latency.py --idle-s 1 --out $OUT      # and requests after 1 s idle, for comparison

Issue #30 asks that the first live request after ready be as fast as the hundredth (within 20%) on a GPU: every
batch bucket's binding and CUDA graph is made while the model loads (server/core/warmup.py), so no live request
pays for lowering, cuDNN plan building or graph capture. This starts `kiln serve` (explicit mode, the model
loaded, a fresh plan cache), waits for ready, asks once whether the model is ready (which also opens the connection), then
sends `--requests` single-row requests one after another over HTTP with tritonclient and writes each one's
latency. The figure is the first request's latency over the median
of requests 90-110 (the hundredth alone is one noisy sample; it is reported too). Models, configs and ONNX
files are load_tests/gpu_serving.py's. `--trace` runs the server with trace timestamps and reports the same figures
for each request's time in the server and in its execution (what is left is the client, its connection and the
frontend's parsing). Output: a table and `warmup_latency.json` in `--out`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from load_tests import gpu_serving  # noqa: E402

#: the issue's bound: the first request within this factor of the hundredth
BOUND = 1.2
#: requests sent after an idle pause each (`--idle-s`): what a request costs after the machine idled, whatever the
#: server warmed (GPU clocks and host CPUs slow down when idle; a warm-up cannot remove that)
IDLE_SAMPLES = 5


def _inputs(spec: gpu_serving.ModelSpec, seed: int) -> dict[str, np.ndarray]:
    """One row of every input: zeros where values must be valid ids and masks, else seeded noise."""
    rng = np.random.default_rng(seed)
    dtypes = {"FP32": np.float32, "INT64": np.int64}
    return {t.name: (np.zeros((1, *t.dims), dtypes[t.datatype]) if spec.input_data == "zero"
                     else rng.standard_normal((1, *t.dims)).astype(dtypes[t.datatype])) for t in spec.inputs}


def time_requests(url: str, name: str, spec: gpu_serving.ModelSpec, count: int, idle_s: float = 0.0) -> list[float]:
    """Milliseconds of `count` requests sent one after another (the first right after ready), then of
    `IDLE_SAMPLES` more, each after `idle_s` without requests (none when 0)."""
    import tritonclient.http as http

    client = http.InferenceServerClient(url)
    if not client.is_model_ready(name):  # as a client would ask; it also opens the connection the requests reuse
        raise RuntimeError(f"model '{name}' is not ready")
    latencies = []
    for index in range(count + (IDLE_SAMPLES if idle_s else 0)):
        if index >= count:
            time.sleep(idle_s)
        inputs = []
        for tensor_name, array in _inputs(spec, index).items():
            tensor = http.InferInput(tensor_name, list(array.shape), next(t.datatype for t in spec.inputs
                                                                          if t.name == tensor_name))
            tensor.set_data_from_numpy(array, binary_data=True)
            inputs.append(tensor)
        outputs = [http.InferRequestedOutput(t.name, binary_data=True) for t in spec.outputs]
        started = time.perf_counter()
        client.infer(name, inputs, outputs=outputs)
        latencies.append((time.perf_counter() - started) * 1e3)
    client.close()
    return latencies


def measure(model: str, args: argparse.Namespace, work: Path) -> dict:
    setup = gpu_serving.make_setup(gpu_serving.build_parser().parse_args(
        ["--models", model, "--variants", "batched", "--precision", args.precision, "--out", str(work)]
        + (["--smoke"] if args.smoke else [])))
    spec = gpu_serving.spec_of(setup, model)
    repo = work / "repository"
    source = gpu_serving.onnx_file(spec, args.cache_dir or work)
    name = gpu_serving.write_model(repo, spec, source, setup)["batched"]
    trace = work / "trace.jsonl"
    trace.unlink(missing_ok=True)
    extra = (["--trace-config", f"triton,file={trace}", "--trace-config", "level=TIMESTAMPS",
              "--trace-config", "rate=1"] if args.trace else [])
    started = time.monotonic()
    with gpu_serving.kiln_server(repo, work / "plans", work / f"server_{model}.log", name, extra) as server:
        ready_s = time.monotonic() - started
        latencies = time_requests(server.http, name, spec, args.requests, args.idle_s)
    row = {"model": spec.name, "served": name, "precision": args.precision, "ready_s": round(ready_s, 1),
           "traced": args.trace, "idle_s": args.idle_s, **_first_and_steady("", latencies, args.requests),
           "within_bound": latencies[0] <= BOUND * _steady(latencies[:args.requests])}
    if args.trace:  # the same split for the server's own time and the execution's, from its trace timestamps
        spans = server_spans(trace)
        for key in ("server", "compute"):
            row.update(_first_and_steady(f"{key}_", spans[key], args.requests))
    return row


def _steady(latencies: list[float]) -> float:
    """The median of requests 90-110 (all but the first when fewer were sent)."""
    return statistics.median(latencies[89:110] if len(latencies) >= 110 else latencies[1:])


def _first_and_steady(prefix: str, latencies: list[float], count: int) -> dict:
    """The figures of the first `count` requests (then the ones after idle pauses, if any: their median)."""
    timed, idle = latencies[:count], latencies[count:]
    steady = _steady(timed)
    return {f"{prefix}first_ms": round(timed[0], 3), f"{prefix}second_ms": round(timed[1], 3),
            f"{prefix}hundredth_ms": round(timed[99], 3) if len(timed) >= 100 else None,
            f"{prefix}median_90_110_ms": round(steady, 3), f"{prefix}first_over_steady": round(timed[0] / steady, 3),
            f"{prefix}after_idle_ms": round(statistics.median(idle), 3) if idle else None,
            f"{prefix}latencies_ms": [round(v, 3) for v in timed],
            f"{prefix}after_idle_latencies_ms": [round(v, 3) for v in idle]}


def server_spans(trace: Path) -> dict[str, list[float]]:
    """Milliseconds of each traced request in request order: in the server (REQUEST_START to REQUEST_END) and in
    its execution (COMPUTE_START to COMPUTE_END)."""
    spans: dict[str, list[float]] = {"server": [], "compute": []}
    for line in trace.read_text().splitlines():
        record = json.loads(line)
        if "timestamps" not in record:
            continue
        ns = {t["name"]: t["ns"] for t in record["timestamps"]}
        spans["server"].append((ns["REQUEST_END"] - ns["REQUEST_START"]) / 1e6)
        spans["compute"].append((ns["COMPUTE_END"] - ns["COMPUTE_START"]) / 1e6)
    return spans


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python load_tests/warmup_latency.py", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bert", help="comma list of resnet50, bert (default bert)")
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--precision", default="fp16", choices=["fp32", "tf32", "fp16", "bf16"])
    parser.add_argument("--cache-dir", type=Path, default=None, help="where the generated ONNX files are kept")
    parser.add_argument("--out", type=Path, default=None, help="directory for warmup_latency.json (default: a temp dir)")
    parser.add_argument("--smoke", action="store_true", help="tiny models on any machine")
    parser.add_argument("--idle-s", type=float, default=0.0,
                        help=f"then {IDLE_SAMPLES} requests, each after this many seconds idle (the idle cost, "
                             "against which the first request's is read)")
    parser.add_argument("--trace", action="store_true",
                        help="also split each request's time in the server and in its execution (trace timestamps)")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="kiln-warmup-"))
    out.mkdir(parents=True, exist_ok=True)
    rows = [measure(model, args, out / model) for model in args.models.split(",")]
    print(f"{'model':<20}{'ready s':>9}{'first ms':>10}{'2nd ms':>9}{'100th ms':>10}{'med 90-110':>12}{'ratio':>8}"
          f"{'idle ms':>9}")
    for r in rows:
        for prefix in ("", "server_", "compute_")[:3 if r["traced"] else 1]:
            print(f"{r['model'] + (' ' + prefix[:-1] if prefix else ''):<20}{r['ready_s']:>9.1f}"
                  f"{r[prefix + 'first_ms']:>10.2f}{r[prefix + 'second_ms']:>9.2f}"
                  f"{r[prefix + 'hundredth_ms'] or float('nan'):>10.2f}{r[prefix + 'median_90_110_ms']:>12.2f}"
                  f"{r[prefix + 'first_over_steady']:>8.2f}{r[prefix + 'after_idle_ms'] or float('nan'):>9.2f}")
    document = {"tool": "load_tests/warmup_latency.py", "command": " ".join(sys.argv), "bound": BOUND,
                "device": gpu_serving._device(), "rows": rows}
    (out / "warmup_latency.json").write_text(json.dumps(document, indent=1))
    print(f"wrote {out / 'warmup_latency.json'}")
    return 0 if all(r["within_bound"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
