"""An executor process: one model version's execution contexts, out of the core's interpreter lock.

    python -m server.core.executor_main CONTROL_FD

Started by `executor.ExecutorProcess`. The control socket brings the plan and the model's config, answers once
every batch bucket is bound and captured (with the runs a context takes at once), then brings one socket per core
worker lane (instances x runs) and later the regions to forget. Each lane socket is one
core worker lane: it sends a batch (parts, their inputs as host arrays or `RegionRef`s, output destinations, the
profile, the bucket to pad to) and waits for the outputs. Lanes `i` share context `i // runs`, as the core's lanes
shared one context per instance when they ran in its process (`ExecutionContext.concurrent_runs`).

Why a process: in the core, the worker threads that gather, launch and deliver a batch shared one interpreter lock
with the event loop that parses, checks and answers every request; on an H100 a ResNet-50 batch took 3-5x its raw
time there while the GPU idled (docs/performance.md). Here a lane's Python runs beside the other lanes only.

Faults: an execution that raises anything but a request error gets its context replaced before the reply (the
core's `Workers` policy, applied where the context lives); a process that dies is restarted by the core.

Devices: the process runs on one GPU, its CUDA ordinal 0 (the core lists that GPU first in CUDA_VISIBLE_DEVICES and
the others after it: server/core/placement.py), so the engine's default device is the one it was placed on.
"""

from __future__ import annotations

import importlib
import logging
import mmap
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from server.core.direct_replies import Inboxes, deliver  # noqa: E402
from server.core.executor_wire import (  # noqa: E402
    Channel,
    ExecutorGone,
    RegionMap,
    RegionRef,
    child_start,
    env_number,
    error_reply,
)
from server.core.scheduler import REQUEST_ERRORS  # noqa: E402

log = logging.getLogger("kiln.executor")

#: how long a lane waits for a region another lane's message is about to map (they race on separate sockets)
MAP_WAIT_S = 30.0
#: how often a lane logs what its executions took (calls, rows, run time): where a batch's time goes, beside the
#: core's statistics (which also count the hop to this process); KILN_EXECUTOR_STATS_S sets another period
#: (benchmarks with short windows)
STATS_EVERY_S = env_number("KILN_EXECUTOR_STATS_S", 10, 0.1)
#: CUDA errors that leave the process's context unusable ("sticky"): every later call fails too, so a fresh
#: execution context cannot help; the executor answers the batch, then exits, and the core starts a new one
STICKY_CUDA_ERRORS = ("CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_ILLEGAL_INSTRUCTION", "CUDA_ERROR_MISALIGNED_ADDRESS",
                      "CUDA_ERROR_INVALID_ADDRESS_SPACE", "CUDA_ERROR_INVALID_PC", "CUDA_ERROR_LAUNCH_FAILED",
                      "CUDA_ERROR_HARDWARE_STACK_ERROR", "CUDA_ERROR_ECC_UNCORRECTABLE", "CUDA_ERROR_ASSERT")
#: exit status after a sticky CUDA error (the core's log names it)
STICKY_EXIT = 70
#: the CUDA ordinal the engine runs on: the executor's GPU comes first in its CUDA_VISIBLE_DEVICES
ENGINE_DEVICE = 0


class Regions:
    """The regions this executor mapped, by registration id: numpy views for CPU plans, device-mapped page-locked
    host memory (or an IPC allocation) for CUDA plans."""

    def __init__(self, on_device: bool) -> None:
        self.on_device = on_device
        self._regions: dict[int, Any] = {}
        self._changed = threading.Condition()

    def map(self, spec: RegionMap, fds: list[int]) -> None:
        with self._changed:
            if spec.region in self._regions:
                return
        if spec.kind == "cuda":
            from engine_core.cuda.ipc import open_ipc_handle

            # opened on the engine's device (ordinal 0 here: `placement.child_visible_devices`), not the client's
            # `device_id` (the core's numbering): an allocation on another GPU maps by peer access
            region: Any = _IpcRegion(open_ipc_handle(spec.ipc_handle, ENGINE_DEVICE))
        else:
            fd = fds[spec.fd_index]
            mapping = mmap.mmap(fd, spec.offset + spec.nbytes)
            region = _SystemMapping(mapping, spec.offset, self.on_device)
        with self._changed:
            self._regions[spec.region] = region
            self._changed.notify_all()

    def forget(self, region_id: int) -> None:
        """Unmap when no batch holds a view any more (page-locked mappings unpin once their views are gone)."""
        with self._changed:
            region = self._regions.pop(region_id, None)
        if region is not None:
            region.close()

    def view(self, ref: RegionRef) -> Any:
        return self._region(ref.region).view(ref.offset, ref.shape, np.dtype(ref.dtype))

    def _region(self, region_id: int) -> Any:
        with self._changed:
            region = self._regions.get(region_id)
            if region is None:  # another lane's message maps it; it was sent first but may be read later
                self._changed.wait_for(lambda: region_id in self._regions, MAP_WAIT_S)
                region = self._regions.get(region_id)
        if region is None:
            raise ValueError(f"shared memory region {region_id} is not mapped in the executor")
        return region

    def rows(self, spec: tuple, keep: list) -> Any:
        """A batch's rows of one tensor named by region (`RemoteContext`'s "regions" spec): `DeviceRows` for CUDA
        plans, the rows stacked into one host array for CPU plans. `keep` holds the regions until the run is done."""
        from engine_core.cuda.view import DeviceRows

        _, ids, offsets, rows, row_shape, dtype = spec
        dtype = np.dtype(dtype)
        unique, inverse = np.unique(ids, return_inverse=True)
        regions = [self._region(int(region_id)) for region_id in unique]
        keep.extend(regions)
        row_bytes = int(np.prod(row_shape, dtype=np.int64)) * dtype.itemsize
        ends = offsets + rows * row_bytes
        sizes = np.array([region.nbytes for region in regions], np.int64)[inverse]
        if np.any(offsets < 0) or np.any(ends > sizes):
            raise ValueError("a part's rows lie outside its shared memory region")
        if self.on_device:
            bases = np.array([region.device_address for region in regions], np.uint64)[inverse]
            return DeviceRows(bases + offsets.astype(np.uint64), rows, tuple(row_shape), dtype)
        views = [region.view(int(offset), (int(count), *row_shape), dtype)
                 for region, offset, count in zip((regions[i] for i in inverse), offsets, rows)]
        return np.concatenate(views) if views else np.empty((0, *row_shape), dtype)

    def write_rows(self, spec: tuple, whole: np.ndarray, keep: list) -> None:
        """CPU plans: each part's rows of an output written into its region (CUDA plans deliver on the device)."""
        _, ids, offsets, rows, row_shape, dtype = spec
        start = 0
        for region_id, offset, count in zip(ids, offsets, rows):
            region = self._region(int(region_id))
            keep.append(region)
            np.copyto(region.view(int(offset), (int(count), *row_shape), np.dtype(dtype)), whole[start:start + count])
            start += int(count)


class _IpcRegion:
    """A client's CUDA allocation opened here (its IPC handle)."""

    def __init__(self, mapping: Any) -> None:
        self.mapping = mapping
        self.nbytes = int(mapping.nbytes)
        self.device_address = int(mapping.ptr)

    def view(self, offset: int, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        return self.mapping.view(offset, shape, dtype)

    def close(self) -> None:
        self.mapping.close()


class _SystemMapping:
    """A system region's mapping here: page-locked and device-mapped for CUDA plans, plain numpy for CPU ones."""

    def __init__(self, mapping: mmap.mmap, offset: int, on_device: bool) -> None:
        self.mapping, self.offset = mapping, offset
        self.nbytes = len(mapping) - offset
        self.pinned = None
        if on_device:
            import ctypes

            from engine_core.cuda.host_memory import HostRegistration

            anchor = ctypes.c_char.from_buffer(mapping)
            address = ctypes.addressof(anchor)
            del anchor
            self.pinned = HostRegistration(address, len(mapping), on_release=self._unmap)
        self._bytes = None if on_device else np.frombuffer(mapping, np.uint8)

    @property
    def device_address(self) -> int:
        assert self.pinned is not None, "a CPU executor maps regions without the device"
        return int(self.pinned.device_address) + self.offset

    def view(self, offset: int, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        start = self.offset + offset
        if self.pinned is not None:
            return self.pinned.view(start, shape, dtype)
        count = int(np.prod(shape)) * dtype.itemsize
        assert self._bytes is not None
        return self._bytes[start:start + count].view(dtype).reshape(shape)

    def _unmap(self) -> None:
        try:
            self.mapping.close()
        except BufferError:  # a numpy view is still alive: the mapping goes with it
            pass

    def close(self) -> None:
        if self.pinned is not None:
            self.pinned.close()
            self.pinned = None
        else:
            self._bytes = None
            self._unmap()


class _LaneStats:
    """A lane's executions since its last log line: count, rows, the time from message in to reply ready (maps,
    inputs, the run, outputs) and to reply sent, and how busy the lane was: a lane near 100% is the served path's
    ceiling (docs/performance.md, "Two GPUs")."""

    def __init__(self, lane: int) -> None:
        self.lane = lane
        self.calls = self.rows = self.run_ns = self.reply_ns = 0
        self.since = time.monotonic()
        self.first = True

    def add(self, message: Mapping[str, Any], run_ns: int, reply_ns: int) -> None:
        if self.first:  # a first request after ready that is slower than the rest shows here or not (#30)
            self.first = False
            log.info("lane %d: first execution %.3f ms from message in to reply ready", self.lane, run_ns / 1e6)
        self.calls += 1
        self.run_ns += run_ns
        self.reply_ns += reply_ns
        for part in message.get("parts", ()):
            first = next(iter(part.values()), None)
            self.rows += int(first.shape[0]) if first is not None and len(first.shape) else 1
        for spec in list(message.get("inputs", {}).values())[:1]:  # a batch sent whole
            self.rows += int(spec.shape[0]) if isinstance(spec, np.ndarray) else int(spec[3].sum())
        now = time.monotonic()
        if now - self.since >= STATS_EVERY_S:
            elapsed = now - self.since
            log.info("lane %d: %d executions in %.0f s (busy %.0f%%), %.1f rows and %.3f ms each from message in to "
                     "reply ready, %.3f ms to send it", self.lane, self.calls, elapsed,
                     100 * (self.run_ns + self.reply_ns) / 1e9 / elapsed, self.rows / self.calls,
                     self.run_ns / self.calls / 1e6, self.reply_ns / self.calls / 1e6)
            self.calls = self.rows = self.run_ns = self.reply_ns = 0
            self.since = now


class Executor:
    """The engine, its contexts and the lanes that run batches on them."""

    def __init__(self, plan: bytes, config_bytes: bytes, instances: int, warm_buckets: bool = True) -> None:
        import engine_core as kiln
        from server.core import warmup
        from server.core.model_config import ModelConfig

        self.engine = kiln.Runtime().load(plan)
        self.config = ModelConfig.FromString(config_bytes)
        self.contexts = [self.engine.create_execution_context() for _ in range(max(instances, 1))]
        self.runs = getattr(self.contexts[0], "concurrent_runs", 1)
        self.regions = Regions(self.engine.backend == "cuda")
        self.inboxes = Inboxes()  # the frontends' inboxes: routed parts' responses go there (direct_replies.py)
        self._lock = threading.Lock()
        if warm_buckets:  # honours kiln_warmup_buckets
            warmup.warm_up_buckets(self.config, self.contexts, self.engine)
        else:  # a restart or reload: serve first (executor.py); `bind_in_background` binds the buckets
            log.info("model '%s': serving before its batch buckets are bound (a restart or reload); they are bound "
                     "in the background, or on first use", self.config.name)

    def bind_in_background(self) -> None:
        """Every batch bucket bound and captured while the lanes serve (a batch at a bucket not yet bound binds it
        itself, as a lane always may): after a restart or reload the buckets are ready within seconds, and no
        request waits for all of them (ResNet-50 fp16 on an H200: 7-18 s for its 10 buckets)."""
        from server.core import warmup

        if self.engine.num_optimization_profiles > 1:  # binding switches a context's profile: lanes bind instead
            return

        def bind() -> None:
            try:
                warmup.warm_up_buckets(self.config, self.contexts, self.engine)
            except Exception:  # noqa: BLE001 - the lanes bind on first use instead, and report what fails
                log.exception("model '%s': binding batch buckets in the background failed", self.config.name)

        threading.Thread(target=bind, daemon=True, name="kiln-executor-bind").start()

    def context(self, lane: int) -> Any:
        return self.contexts[(lane // self.runs) % len(self.contexts)]

    def serve_lane(self, lane: int, channel: Channel) -> None:
        """Run the lane's batches until the core closes its socket."""
        stats = _LaneStats(lane)
        while True:
            try:
                message, fds = channel.recv()
            except (ExecutorGone, OSError):
                return
            started = time.perf_counter_ns()
            try:
                for spec in message.get("maps", ()):
                    self.regions.map(spec, fds)
            finally:
                for fd in fds:
                    os.close(fd)
            sticky = False
            try:
                reply: tuple = ("ok", self._run(lane, message))
            except BaseException as error:  # noqa: BLE001 - every failure goes back to the waiting requests
                reply = error_reply(error)
                sticky = any(code in str(error) for code in STICKY_CUDA_ERRORS)
                if not isinstance(error, REQUEST_ERRORS) and not sticky:
                    self._replace(lane, error)
            ready = time.perf_counter_ns()
            try:
                channel.send(reply)
            except (ExecutorGone, OSError):
                return
            stats.add(message, ready - started, time.perf_counter_ns() - ready)
            if sticky:
                log.error("lane %d: %s; the device context is unusable, exiting so that a new executor starts",
                          lane, reply[2])
                os._exit(STICKY_EXIT)

    def _run(self, lane: int, message: Mapping[str, Any]) -> Any:
        context = self.context(lane)
        profile = message.get("profile", 0)
        if profile != context.active_optimization_profile:
            context.set_optimization_profile_async(profile)
        kind = message["kind"]
        if kind == "batch":
            parts = [{name: self._value(v) for name, v in part.items()} for part in message["parts"]]
            destinations = message.get("destinations")
            if destinations is None:
                return context.infer_batch(parts, pad_to=message.get("pad_to"))
            targets = [{name: self._value(v) for name, v in d.items()} for d in destinations]
            if self.engine.backend == "cuda":
                return context.infer_batch(parts, pad_to=message.get("pad_to"), destinations=targets)
            outputs = context.infer_batch(parts, pad_to=message.get("pad_to"))
            for part_outputs, target in zip(outputs, targets):  # CPU plans: written here, on the host
                for name, view in target.items():
                    np.copyto(view, part_outputs.pop(name))
            return outputs
        if kind == "rows":
            outputs = self._run_rows(context, message)
            routes = message.get("routes")
            if routes is None:
                return outputs
            delivered = deliver(self.inboxes, routes, message["rows"], outputs)
            return (None if len(delivered) == len(routes) else outputs), delivered
        if kind == "infer":
            return context.infer({name: self._value(v) for name, v in message["feeds"].items()})
        raise ValueError(f"unknown executor request '{kind}'")

    def _run_rows(self, context: Any, message: Mapping[str, Any]) -> dict[str, Any]:
        """A batch sent whole: each input one host array, or its parts' rows by region (`Regions.rows`); outputs
        whole, those with destinations delivered into the parts' regions."""
        keep: list = []  # the regions the run reads and writes, mapped until it is done
        inputs = {name: spec if isinstance(spec, np.ndarray) else self.regions.rows(spec, keep)
                  for name, spec in message["inputs"].items()}
        destinations = message.get("destinations") or {}
        if self.engine.backend == "cuda":
            targets = {name: self.regions.rows(spec, keep) for name, spec in destinations.items()}
            return context.infer_rows(inputs, message.get("pad_to"), targets)  # type: ignore[no-any-return]
        outputs = context.infer_rows(inputs, message.get("pad_to"))
        for name, spec in destinations.items():
            self.regions.write_rows(spec, outputs.pop(name), keep)
        return outputs  # type: ignore[no-any-return]

    def _value(self, value: Any) -> Any:
        return self.regions.view(value) if isinstance(value, RegionRef) else value

    def _replace(self, lane: int, error: BaseException) -> None:
        """The lane's context after a fault: a fresh one (its lanes share it, as in the core)."""
        log.error("lane %d: execution fault, replacing its execution context", lane, exc_info=error)
        index = (lane // self.runs) % len(self.contexts)
        with self._lock:
            try:
                self.contexts[index] = self.engine.create_execution_context()
            except Exception:  # noqa: BLE001 - the lane keeps the old context; the next run says what is wrong
                log.exception("lane %d: could not create a replacement execution context", lane)

    def serve_control(self, channel: Channel) -> None:
        """Map the regions the core sends ahead (frontends' arenas) and forget those it released, connect to the
        frontends' inboxes and close those gone, until the core closes the socket (then exit)."""
        while True:
            try:
                message, fds = channel.recv()
            except (ExecutorGone, OSError):
                return
            try:
                if message[0] == "map":  # frontends' arenas, mapped (pinned) before a batch reads them
                    for spec in message[1]:
                        self.regions.map(spec, fds)
                elif message[0] == "forget":
                    for region_id in message[1]:
                        self.regions.forget(region_id)
                elif message[0] == "inbox":  # a frontend's inbox: routed responses go there
                    self.inboxes.connect(message[1], message[2])
                elif message[0] == "uninbox":
                    self.inboxes.forget(message[1])
                elif message[0] == "sync":  # the maps sent before it are done (the core waits for them at start)
                    channel.send(("ok", None))
                elif message[0] == "close":
                    return
            except Exception:  # noqa: BLE001 - a batch that reads the region maps it then, and says what is wrong
                log.exception("could not map a region ahead of its first batch")
            finally:
                for fd in fds:
                    os.close(fd)


def main(argv: list[str] | None = None) -> int:
    started = child_start(argv, "kiln-executor")
    if started is None:
        return 1
    control, load = started
    warm_buckets = load.get("warm_buckets", True)
    try:
        for module in load.get("modules", ()):  # the plugins the plan uses register themselves on import
            importlib.import_module(module)
        executor = Executor(load["plan"], load["config"], load["instances"], warm_buckets)
    except BaseException as error:  # noqa: BLE001 - the core fails the model's load with this message
        control.send(error_reply(error))
        return 1
    control.send(("ok", {"runs": executor.runs, "pid": os.getpid()}))
    try:
        _, fds = control.recv()  # ("lanes",) with one socket per core worker lane
    except ExecutorGone:
        return 1
    for index, fd in enumerate(fds):
        lane = Channel(socket.socket(fileno=fd), alternating=True)
        threading.Thread(target=executor.serve_lane, args=(index, lane), daemon=True,
                         name=f"kiln-executor-lane-{index}").start()
    if not warm_buckets:
        executor.bind_in_background()
    executor.serve_control(control)
    return 0


if __name__ == "__main__":
    os._exit(main())
