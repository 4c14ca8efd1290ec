"""The core process's own cost per request: what caps `kiln serve --frontend-processes N` on a GPU.

    python -m load_tests.core_path [--clients 4] [--concurrency 64] [--seconds 5] [--shared-memory system]
                                   [--profile DIR] [--out FILE]

A `ServerCore` on the CPU backend serves a dynamically batched FP32 add/sub model (max batch 64) through
`CoreService`, as in `kiln serve`; client processes call it through `RemoteCore` exactly as frontend processes do,
with `concurrency` requests in flight in all. No HTTP or gRPC: this isolates the core process (frame decode,
`ServerCore.infer`, batcher, reply encode), whose event-loop thread is the ceiling of GPU serving
(docs/performance.md). Prints and writes req/s, the core process's CPU microseconds per request (user + system,
from /proc). `--profile DIR` runs py-spy over the core meanwhile (folded stacks).
`--shared-memory system`: every request's inputs and outputs are in one system shared-memory region per client
process (as `kiln perf --shared-memory system` does), so the client's alike requests of a loop turn reach the core
as one group by reference (`INFER_PARTS`, server/core/part_groups.py): the core's cost per member of such groups.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from onnx import TensorProto

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODEL = "add_sub_batched"
from examples.make_example_repository import add_sub_model, write_model  # noqa: E402

_CONFIG = """name: "add_sub_batched"
max_batch_size: 64
input [
  { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] },
  { name: "INPUT1" data_type: TYPE_FP32 dims: [ 16 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] },
  { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 16 ] }
]
dynamic_batching { }
instance_group [ { kind: KIND_CPU count: 1 } ]
"""
_SPAWN = multiprocessing.get_context("spawn")


def make_repository(directory: Path) -> Path:
    """A repository with the example FP32 add/sub model under a batching config."""
    write_model(directory, MODEL, add_sub_model(TensorProto.FLOAT), _CONFIG)
    return directory


def _core_main(repository: str, socket_path: str, ready, stop) -> None:
    from server.cli import run_event_loop

    async def serve() -> None:
        from server.core import CoreOptions, ServerCore
        from server.core.remote import CoreService

        core = ServerCore(CoreOptions([repository], model_control_mode="explicit", startup_models=[MODEL],
                                      allow_client_shm=True))
        await core.start()
        await core.wait_for_startup()
        if not await core.model_ready(MODEL):
            raise SystemExit(f"{MODEL} did not load")
        service = CoreService(core, socket_path)
        await service.start()
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.1)
        await service.stop()
        await core.stop()

    run_event_loop(serve())


def _client_main(socket_path: str, concurrency: int, seconds: float, results, shared_memory: str = "") -> None:
    from server.cli import run_event_loop

    async def drive() -> None:
        from multiprocessing import shared_memory as shm

        from server.core.remote import RemoteCore
        from server.core.types import InferInput, InferRequest, RequestedOutput

        core = RemoteCore(socket_path)
        await core.connect()
        a = np.arange(16, dtype=np.float32).reshape(1, 16)
        latencies: list[float] = []
        end = time.perf_counter() + seconds
        region = None
        if shared_memory == "system":  # inputs at 0 and 64, outputs at 128 and 192 of one region per client
            region = shm.SharedMemory(create=True, size=256)
            region.buf[:128] = np.concatenate([a, a]).tobytes()
            await core.register_system_shared_memory(region.name, "/" + region.name, 0, 256)

        def in_region(offset: int) -> dict:
            return {"shared_memory_region": region.name, "shared_memory_offset": offset,  # type: ignore[union-attr]
                    "shared_memory_byte_size": 64}

        def request() -> InferRequest:
            if region is None:
                return InferRequest(MODEL, [InferInput("INPUT0", "FP32", (1, 16), a),
                                            InferInput("INPUT1", "FP32", (1, 16), a)])
            return InferRequest(MODEL, [InferInput("INPUT0", "FP32", (1, 16), None, in_region(0)),
                                        InferInput("INPUT1", "FP32", (1, 16), None, in_region(64))],
                                outputs=[RequestedOutput("OUTPUT0", in_region(128)),
                                         RequestedOutput("OUTPUT1", in_region(192))])

        async def one_caller() -> None:
            while (started := time.perf_counter()) < end:
                response = await core.infer(request())
                assert response.outputs[0].shape == (1, 16)
                latencies.append(time.perf_counter() - started)

        await asyncio.gather(*(one_caller() for _ in range(concurrency)))
        results.put(latencies)
        if region is not None:
            await core.unregister_system_shared_memory(region.name)
            region.close()
            region.unlink()
        await core.close()

    run_event_loop(drive())


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="kiln-core-path-") as work:
        repository = make_repository(Path(work) / "repository")
        socket_path = os.path.join(work, "core.sock")
        ready, stop = _SPAWN.Event(), _SPAWN.Event()
        core = _SPAWN.Process(target=_core_main, args=(str(repository), socket_path, ready, stop))  # builds in children
        core.start()
        if not ready.wait(120):
            raise SystemExit("the core did not start")
        # warm-up: one short round so batch buckets and code paths are hot
        _drive(socket_path, args.clients, args.concurrency, 1.0, args.shared_memory)
        profiler = _profile(core.pid, args) if args.profile else None
        cpu0, t0 = _cpu_seconds(core.pid), time.perf_counter()
        latencies = np.array(_drive(socket_path, args.clients, args.concurrency, args.seconds, args.shared_memory))
        cpu, wall = _cpu_seconds(core.pid) - cpu0, time.perf_counter() - t0
        done = len(latencies)
        if profiler is not None:
            profiler.wait(30)
        stop.set()
        core.join(30)
    return {"clients": args.clients, "concurrency": args.concurrency, "shared_memory": args.shared_memory or "none",
            "seconds": round(wall, 2),
            "requests": done, "req_per_s": round(done / wall, 1),
            "core_cpu_us_per_request": round(1e6 * cpu / max(done, 1), 1),
            "core_cpu_share": round(cpu / wall, 2),
            "p50_us": round(float(np.percentile(latencies, 50)) * 1e6), "p99_us": round(float(np.percentile(latencies, 99)) * 1e6)}


def _drive(socket_path: str, clients: int, concurrency: int, seconds: float, shared_memory: str = "") -> list[float]:
    """Every request's latency (s), all client processes together."""
    results = _SPAWN.Queue()
    per_client = [concurrency // clients + (1 if i < concurrency % clients else 0) for i in range(clients)]
    workers = [_SPAWN.Process(target=_client_main, args=(socket_path, n, seconds, results, shared_memory))
               for n in per_client]
    for worker in workers:
        worker.start()
    latencies = [t for _ in workers for t in results.get(timeout=seconds + 120)]
    for worker in workers:
        worker.join(30)
    return latencies


def _profile(pid: int, args: argparse.Namespace) -> subprocess.Popen | None:
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    out = Path(args.profile)
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([py_spy, "record", "--pid", str(pid), "--rate", "250", "--format", "raw", "--threads",
                             "--duration", str(int(args.seconds)), "--output", str(out / "core.txt")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=4, help="client processes (frontends)")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight, all clients together")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--shared-memory", choices=["system"], default="",
                        help="inputs and outputs in a system shared-memory region per client (groups by reference)")
    parser.add_argument("--profile", help="a folder for py-spy's folded stacks of the core process")
    parser.add_argument("--out", help="write the result here as JSON")
    args = parser.parse_args(argv)
    result = run(args)
    print(f"{'clients':>8} {'conc':>5} {'req/s':>9} {'core us/req':>12} {'core CPU':>9} {'p50 us':>8} {'p99 us':>8}")
    print(f"{result['clients']:>8} {result['concurrency']:>5} {result['req_per_s']:>9,.0f} "
          f"{result['core_cpu_us_per_request']:>12} {result['core_cpu_share']:>9} {result['p50_us']:>8} "
          f"{result['p99_us']:>8}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
