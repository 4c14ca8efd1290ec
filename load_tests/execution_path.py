"""The server's execution path alone, without protocols or the event loop: how long one batch of N requests
takes from their numpy inputs to their numpy outputs, on a model loaded exactly as the server loads it.

    python -m load_tests.execution_path --repository DIR --model bert_cls_batched --batches 1,8,32 [--busy 0,1]
        [--sources numpy,mapped,device --lanes 1,2]

Per batch size N (N jobs of one row each, gathered by the engine, padded to their bucket): the mean time of
`execution.execute_parts` (what a batcher worker runs), of `context.infer` on the same rows already stacked,
and, with `--busy 1`, the same while another thread runs Python (the event loop's share of the interpreter
lock, roughly): the difference is what lock contention costs the worker. Prints a table; `--json FILE`.

`--sources` (CUDA models) says where the jobs' rows live, as the server's transports put them: `numpy` (host arrays:
gRPC/HTTP bodies, gathered through the run's pinned mirror), `mapped` (page-locked host memory by device address:
system shared memory and frontend arenas, gathered by the copy kernel over PCIe), `device` (CUDA shared memory).
`mapped_each` is `mapped` with one registration per job (requests from many clients' regions); `--deliver mapped`
writes the outputs into page-locked host memory, as system shared-memory outputs are. `--lanes N` runs N threads on the one context at once, as the server's worker lanes do, and reports rows/s over
all of them: whether one lane's copies overlap another's run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402


def _load(repository: str, name: str):
    os.environ.setdefault("KILN_EXECUTOR", "thread")  # the contexts in this process: the engine path itself
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


def _placed(jobs: list[dict[str, np.ndarray]], source: str, keep: list) -> list[dict]:
    """The jobs' rows where `source` puts them (host arrays, page-locked host memory, device memory); `keep` holds
    the memory while the views are used."""
    if source == "numpy":
        return jobs
    from engine_core.cuda.driver import DeviceBuffer, copy_to_device
    from engine_core.cuda.view import DeviceView

    total = sum(a.nbytes for job in jobs for a in job.values())
    if source == "device":
        buffer = DeviceBuffer(total)
        keep.append(buffer)
        base = buffer.ptr
    elif source == "mapped":
        anchor, base = _mapped(total, keep)
    placed, offset = [], 0
    for job in jobs:
        if source == "mapped_each":  # one registration per job, as requests from many clients' regions
            anchor, base = _mapped(sum(a.nbytes for a in job.values()), keep)
            offset = 0
        views = {}
        for name, array in job.items():
            if source == "device":
                copy_to_device(base + offset, array)
            else:
                anchor[offset:offset + array.nbytes] = array.view(np.uint8).reshape(-1)
            views[name] = DeviceView(base + offset, array.shape, array.dtype)
            offset += array.nbytes
        placed.append(views)
    return placed


def _mapped(nbytes: int, keep: list) -> tuple[np.ndarray, int]:
    """Page-locked, device-mapped host memory of `nbytes`: its bytes and their device address."""
    import mmap

    from engine_core.cuda.host_memory import HostRegistration

    mapping = mmap.mmap(-1, nbytes)
    anchor = np.frombuffer(mapping, np.uint8)
    registration = HostRegistration(anchor.ctypes.data, nbytes)
    keep.extend([mapping, anchor, registration])
    return anchor, registration.device_address


def _destinations(model, batch: int, keep: list) -> list[dict]:
    """Each job's outputs delivered into page-locked host memory (as system shared-memory outputs are)."""
    from engine_core.cuda.view import DeviceView
    from server.core.types import numpy_dtype

    specs = [(name, numpy_dtype(spec.datatype), (1, *spec.model_dims)) for name, spec in model.outputs.items()]
    row = sum(int(np.prod(shape)) * dtype.itemsize for _, dtype, shape in specs)
    _, base = _mapped(row * batch, keep)
    places = []
    for index in range(batch):
        offset, views = base + index * row, {}
        for name, dtype, shape in specs:
            views[name] = DeviceView(offset, shape, dtype)
            offset += int(np.prod(shape)) * dtype.itemsize
        places.append(views)
    return places


def _lanes_rows_per_s(run, lanes: int, seconds: float, rows: int) -> float:
    """Rows a second over `lanes` threads each calling `run` for `seconds`."""
    run()
    counts = [0] * lanes

    def loop(index: int) -> None:
        started = time.perf_counter()
        while time.perf_counter() - started < seconds:
            run()
            counts[index] += 1

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(lanes)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts) * rows / (time.perf_counter() - started)


def run(args: argparse.Namespace) -> list[dict]:
    from server.core import execution

    if args.switch_interval_us:
        sys.setswitchinterval(args.switch_interval_us / 1e6)
    model = _load(args.repository, args.model)
    context = model.workers.initial[0]
    rows = []
    if args.sources:
        for batch in args.batches:
            jobs = [_job(model, i) for i in range(batch)]
            for source in args.sources:
                keep: list = []
                placed = _placed(jobs, source, keep)
                places = _destinations(model, batch, keep) if args.deliver == "mapped" else None
                for lanes in args.lanes:
                    rate = _lanes_rows_per_s(
                        lambda p=placed, d=places: execution.execute_parts(context, p, d, bucketed=True),
                        lanes, args.seconds, batch)
                    rows.append({"batch": batch, "source": source, "deliver": args.deliver, "lanes": lanes,
                                 "rows_per_s": rate, "ms_per_batch_per_lane": lanes * batch / rate * 1e3})
                    print(f"batch {batch:4d} {source:>11s} -> {args.deliver:6s} lanes {lanes}: {rate:9.0f} rows/s  "
                          f"{lanes * batch / rate * 1e3:7.3f} ms a batch per lane", flush=True)
        model.close()
        if args.json:
            Path(args.json).write_text(json.dumps({"model": args.model, "rows": rows}, indent=1))
        return rows
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
    parser.add_argument("--sources", type=lambda s: [x for x in s.split(",") if x], default=[],
                        help="numpy,mapped,device: where the jobs' rows live (CUDA models; see the docstring)")
    parser.add_argument("--deliver", choices=["host", "mapped"], default="host",
                        help="outputs back as host arrays, or written into page-locked host memory (with --sources)")
    parser.add_argument("--lanes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2],
                        help="threads running batches on the one context at once (with --sources)")
    parser.add_argument("--switch-interval-us", type=float, default=0.0, help="sys.setswitchinterval (0: default)")
    parser.add_argument("--json", default="")
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
