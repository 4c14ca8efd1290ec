"""One load-generating client process: an asyncio loop of tritonclient requests, driven over a pipe.

The parent (load_tests/perf.py) sends commands; the worker answers each:
  ("load", {"concurrency": k} | {"rate": r})  start closed-loop (k in flight) or open-loop Poisson load
  ("collect",)                                 -> records finished since the last collect + process CPU seconds
  ("idle",)                                    stop sending, wait for in-flight requests (bounded), -> "idle"
  ("exit",)                                    leave
Records are (start_ns, end_ns, ok) on CLOCK_MONOTONIC, which every process on the host shares, so the
parent can cut windows across workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import astuple, dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from load_tests.shm import Regions, region_prefix

MAX_OUTSTANDING = 1024  # open-loop cap per worker: past it arrivals are counted as dropped, not queued forever
DRAIN_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class InputSpec:
    name: str
    datatype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs to build its client and its (reused) request."""

    url: str
    protocol: str  # "http" | "grpc"
    model: str
    version: str
    inputs: tuple[InputSpec, ...]
    outputs: tuple[str, ...]
    binary: bool
    priority: int = 0
    request_timeout_s: float = 30.0
    seed: int = 0
    response_compression: str = "none"  # HTTP: "none" (identity), "gzip" or "deflate"
    input_data: str = "random"  # "random" or "zero" (perf_analyzer's --input-data)
    shared_memory: str = "none"  # "system" | "cuda": tensors in regions registered once (load_tests/shm.py)
    output_bytes: tuple[int, ...] = ()  # shared memory: region size of each of `outputs`


def make_array(spec: InputSpec, rng: np.random.Generator, data: str = "random") -> np.ndarray:
    """Input data of the input's type and shape: random (BYTES: short ASCII strings) or all zeros."""
    from tritonclient.utils import triton_to_np_dtype

    if spec.datatype == "BYTES":
        return np.array([b"kiln"] * int(np.prod(spec.shape)), dtype=np.object_).reshape(spec.shape)
    dtype = np.dtype(triton_to_np_dtype(spec.datatype))
    if data == "zero":
        return np.zeros(spec.shape, dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, spec.shape).astype(np.bool_)
    if np.issubdtype(dtype, np.integer):
        return rng.integers(0, 100, spec.shape).astype(dtype)
    return rng.standard_normal(spec.shape).astype(dtype)


def http_headers(binary: bool, response_compression: str) -> dict[str, str]:
    """Headers of every HTTP request.

    Accept-Encoding is always explicit: aiohttp (under tritonclient's asyncio client) otherwise adds
    `gzip, deflate` by itself, and servers that honour it (Kiln, Triton) would compress every response
    although perf_analyzer asks for none unless told to. JSON bodies get a Content-Type: tritonclient's asyncio
    client sends none, and servers that parse by it (MLServer, KServe) need one.
    """
    headers = {"Accept-Encoding": "identity" if response_compression == "none" else response_compression}
    if not binary:
        headers["Content-Type"] = "application/json"
    return headers


@dataclass
class _Client:
    """A tritonclient asyncio client plus the request it sends over and over (built once: the client stays light)."""

    config: WorkerConfig
    client: Any = None
    inputs: list[Any] = field(default_factory=list)
    outputs: list[Any] | None = None
    headers: dict[str, str] | None = None
    regions: Regions | None = None  # shared memory: this worker's regions
    first_error: str = ""

    def build(self) -> None:
        """The client and the request it repeats; with shared memory, its regions (created and filled here)."""
        rng = np.random.default_rng(self.config.seed)
        if self.config.protocol == "grpc":
            import tritonclient.grpc.aio as module
            self.client = module.InferenceServerClient(self.config.url)
        else:
            import tritonclient.http.aio as module
            self.client = module.InferenceServerClient(self.config.url, conn_limit=MAX_OUTSTANDING)
        if self.config.shared_memory != "none":
            self.regions = Regions(self.config.shared_memory, region_prefix(self.config.seed))
        for spec in self.config.inputs:
            item = module.InferInput(spec.name, list(spec.shape), spec.datatype)
            array = make_array(spec, rng, self.config.input_data)
            if self.regions is not None:
                item.set_shared_memory(*astuple(self.regions.add_input(spec.name, array)))
            elif self.config.protocol == "grpc":
                item.set_data_from_numpy(array)
            else:
                item.set_data_from_numpy(array, binary_data=self.config.binary)
            self.inputs.append(item)
        if self.config.protocol == "http":
            self.headers = http_headers(self.config.binary, self.config.response_compression)
        if self.config.outputs:
            if self.config.protocol == "grpc":
                self.outputs = [module.InferRequestedOutput(n) for n in self.config.outputs]
            else:
                self.outputs = [module.InferRequestedOutput(n, binary_data=self.config.binary)
                                for n in self.config.outputs]
            if self.regions is not None:
                for output, size in zip(self.outputs, self.config.output_bytes, strict=True):
                    output.set_shared_memory(*astuple(self.regions.add_output(output.name(), size)))

    async def attach(self) -> None:
        """Register the shared-memory regions once, before the first request (no-op without them)."""
        if self.regions is not None:
            await self.regions.register(self.client)

    async def detach(self) -> None:
        """Unregister and free the regions; then close the client."""
        if self.regions is not None:
            await self.regions.unregister(self.client)
            self.regions.destroy()
        await self.client.close()

    async def infer_once(self) -> tuple[int, int, bool]:
        start = time.monotonic_ns()
        try:
            await asyncio.wait_for(
                self.client.infer(self.config.model, self.inputs, model_version=self.config.version,
                                  outputs=self.outputs, priority=self.config.priority, headers=self.headers),
                self.config.request_timeout_s)
            ok = True
        except Exception as e:  # any failure (HTTP error, timeout, reset) is an error record, never a crash
            ok = False
            if not self.first_error:
                self.first_error = f"{type(e).__name__}: {e}"[:300]
        return start, time.monotonic_ns(), ok


class Worker:
    """Runs load on command and keeps finished-request records until the parent collects them."""

    def __init__(self, config: WorkerConfig, conn: Connection):
        self.client = _Client(config)
        self.conn = conn
        self.records: list[tuple[int, int, bool]] = []
        self.dropped = 0
        self.running = False
        self.tasks: set[asyncio.Task] = set()
        self.commands: asyncio.Queue = asyncio.Queue()

    async def _closed_loop(self) -> None:
        while self.running:
            self.records.append(await self.client.infer_once())

    async def _one(self) -> None:
        self.records.append(await self.client.infer_once())

    async def _open_loop(self, rate: float) -> None:
        """Poisson arrivals at `rate` req/s: exponential gaps on an absolute schedule, so send delays don't add up."""
        rng = random.Random(self.client.config.seed)
        next_at = time.monotonic()
        in_flight: set[asyncio.Task] = set()
        while self.running:
            next_at += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            if len(in_flight) >= MAX_OUTSTANDING:
                self.dropped += 1
                continue
            task = asyncio.create_task(self._one())
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
        if in_flight:
            await asyncio.wait(in_flight, timeout=DRAIN_TIMEOUT_S)

    def _start(self, spec: dict[str, float]) -> None:
        self.running = True
        if "rate" in spec:
            coros = [self._open_loop(float(spec["rate"]))] if spec["rate"] > 0 else []
        else:
            coros = [self._closed_loop() for _ in range(int(spec["concurrency"]))]
        self.tasks = {asyncio.create_task(c) for c in coros}

    async def _stop(self) -> None:
        self.running = False
        if self.tasks:
            _, pending = await asyncio.wait(self.tasks, timeout=DRAIN_TIMEOUT_S)
            for task in pending:
                task.cancel()
        self.tasks = set()

    def _collect(self) -> dict[str, Any]:
        records, self.records = self.records, []
        dropped, self.dropped = self.dropped, 0
        array = np.array(records, dtype=np.int64).reshape(-1, 3)
        error, self.client.first_error = self.client.first_error, ""
        return {"records": array.tobytes(), "cpu_s": time.process_time(), "dropped": dropped, "error": error}

    async def serve(self) -> None:
        self.client.build()
        try:
            await self.client.attach()
        except BaseException:
            if self.client.regions is not None:
                self.client.regions.destroy()
            raise
        loop = asyncio.get_running_loop()
        loop.add_reader(self.conn.fileno(), lambda: self.commands.put_nowait(self.conn.recv()))
        self.conn.send(("ready", None))
        while True:
            command, *args = await self.commands.get()
            if command == "load":
                self._start(args[0])
                self.conn.send(("loading", None))
            elif command == "collect":
                self.conn.send(("collected", self._collect()))
            elif command == "idle":
                await self._stop()
                self._collect()  # drop what finished while stopping: it belongs to no window
                self.conn.send(("idle", None))
            else:
                await self._stop()
                with contextlib.suppress(Exception):
                    await self.client.detach()
                self.conn.send(("bye", None))
                return


def worker_main(config: WorkerConfig, conn: Connection) -> None:
    """Process entry point (multiprocessing target)."""
    try:
        asyncio.run(Worker(config, conn).serve())
    except Exception as e:  # report instead of dying silently: the parent waits on this pipe
        with contextlib.suppress(Exception):
            conn.send(("error", f"{type(e).__name__}: {e}"))
