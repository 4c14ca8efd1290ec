"""The server's execution path alone, without protocols or the event loop: how long one batch of N requests
takes from their numpy inputs to their numpy outputs, on a model loaded exactly as the server loads it.

    python -m load_tests.execution_path --repository DIR --model bert_cls_batched --batches 1,8,32 [--busy 0,1]

Per batch size N (N jobs of one row each, gathered by the engine, padded to their bucket): the mean time of
`execution.execute_parts` (what a batcher worker runs), of `context.infer` on the same rows already stacked,
and, with `--busy 1`, the same while another thread runs Python (the event loop's share of the interpreter
lock, roughly): the difference is what lock contention costs the worker. Prints a table; `--json FILE`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402


def _load(repository: str, name: str):
    from server.core.model import load_model_version
    from server.core.model_config import ModelConfig, parse_config_text
    from server.repository import read_source

    source = read_source(name, Path(repository) / name)
    config = parse_config_text(source.config_text, name) if source.config_text else ModelConfig()
    return load_model_version(source, max(source.versions), config, 4)


def _job(model, seed: int) -> dict[str, np.ndarray]:
    """One request's engine-ready inputs: zeros for integer inputs (valid ids and masks), noise for floats."""
    from server.core.types import numpy_dtype

    rng = np.random.default_rng(seed)
    inputs = {}
    for name, spec in model.inputs.items():
        dtype = numpy_dtype(spec.datatype)
        shape = (1, *spec.model_dims)
        inputs[name] = (rng.standard_normal(shape) if dtype.kind == "f" else np.zeros(shape)).astype(dtype)
    return inputs


def _mean_ms(run, seconds: float) -> float:
    run()
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        run()
        count += 1
    return (time.perf_counter() - started) / count * 1e3


class _Busy:
    """A thread that keeps running Python, as a busy event loop does."""

    def __init__(self) -> None:
        self.stop = False
        self.thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        total = 0
        while not self.stop:
            total += sum(range(200))

    def __enter__(self) -> _Busy:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop = True
        self.thread.join()


def run(args: argparse.Namespace) -> list[dict]:
    from server.core import execution

    if args.switch_interval_us:
        sys.setswitchinterval(args.switch_interval_us / 1e6)
    model = _load(args.repository, args.model)
    context = model.workers.initial[0]
    rows = []
    for batch in args.batches:
        jobs = [_job(model, i) for i in range(batch)]
        stacked = {name: np.concatenate([j[name] for j in jobs]) for name in jobs[0]}
        bucket = execution.bucket_for(batch, execution.highest_batch(model.engine, list(stacked)))
        padded = {name: np.concatenate([a, np.zeros((bucket - batch, *a.shape[1:]), a.dtype)])
                  for name, a in stacked.items()}
        for busy in args.busy:
            with _Busy() if busy else contextlib.nullcontext():
                parts_ms = _mean_ms(lambda j=jobs: execution.execute_parts(context, j, bucketed=True), args.seconds)
                infer_ms = _mean_ms(lambda p=padded: context.infer(p), args.seconds)
            rows.append({"batch": batch, "bucket": bucket, "busy_thread": bool(busy), "execute_parts_ms": parts_ms,
                         "infer_ms": infer_ms})
            print(f"batch {batch:4d} (bucket {bucket:4d}) busy={busy}: execute_parts {parts_ms:7.3f} ms   "
                  f"infer (stacked) {infer_ms:7.3f} ms", flush=True)
    model.close()
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "switch_interval_s": sys.getswitchinterval(),
                                               "rows": rows}, indent=1))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m load_tests.execution_path", description=__doc__.split("\n")[0])
    parser.add_argument("--repository", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--busy", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1])
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--switch-interval-us", type=float, default=0.0, help="sys.setswitchinterval (0: default)")
    parser.add_argument("--json", default="")
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
