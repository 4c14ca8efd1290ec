"""Model executions in an executor process of their own, out of the core's interpreter lock.

A CUDA model version that batches runs its executions in one child process per GPU it is placed on
(`executor_main.py`, `placement.py`) that holds the engine, its execution contexts and their CUDA graphs; the core
keeps checks, batching, statistics and responses. The core's schedulers and `Workers` are unchanged (one batcher
feeds the lanes of every GPU): each worker lane's "context" is a `RemoteContext` whose
`infer_batch` sends the batch over the lane's socket and waits for the outputs with the interpreter lock released.
Inputs and outputs in registered shared memory (client regions, frontend tensor arenas) cross as references; the
executor maps each region once, page-locked, and gathers and delivers on the device.

Why (docs/performance.md, session 23): with the lanes in the core, a ResNet-50 batch took 3-5x its raw time while
the GPU idled: every driver call, gather and output split of a lane waited for the interpreter lock the event loop
held. Learned from vLLM's engine-core process and Triton's backends in C++ beside its frontends.

`KILN_EXECUTOR=thread` keeps executions in the core's worker threads (the earlier path, for comparison);
`KILN_EXECUTOR_CPU=1` runs CPU models that batch in executors too (tests: the same path without a GPU).

Faults: an execution error comes back as the engine raised it (a request error) or as `RemoteError` (a fault: the
executor replaced the context already); a process that exits is started again by the next call of any lane, and
the calls that were waiting on it fail with UNAVAILABLE naming the exit (503: retry; the other requests go on). Each
GPU's process restarts alone: the other GPUs keep serving. A restarted process, and a reload of a version this server
served before, serves as soon as its plan is loaded and binds the batch buckets in the background (`warm_buckets`
False; a batch whose bucket is not bound yet binds it): binding every bucket first made every queued request wait for
all of them (ResNet-50 fp16 on an H200: 7-18 s for 10 buckets, mostly cuDNN graph builds), where one bucket's binding
is ~0.5-1 s. A first load still binds every bucket before the model is ready (#30's first request).
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from . import hop_stats
from .direct_replies import DELIVERED
from .errors import ServerError, unavailable
from .executor_wire import (
    Channel,
    ExecutorGone,
    RegionView,
    RemoteError,
    child_launch,
    env_number,
    raise_reply,
    to_wire,
)
from .model_config import ModelConfig
from .placement import child_visible_devices

log = logging.getLogger("kiln.server.executor")

#: live executors: a released region is forgotten in each of them (`region_released`)
_LIVE: weakref.WeakSet[ExecutorProcess] = weakref.WeakSet()
#: the frontends' arenas registered now (weakly: the registry owns them), mapped by every executor at its start
_ARENAS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
#: the labels (model, version, GPU) an executor served in this server process: loading one again is a reload
_SERVED: set[str] = set()
#: the frontends' inboxes registered now (id -> socket path), where executors send responses themselves
#: (server/core/direct_replies.py); every executor connects to each, those started later at their start
_INBOXES: dict[int, str] = {}


def mode() -> str:
    """"process" (default): executions of CUDA models that batch run in executor processes; "thread": in the core."""
    value = os.environ.get("KILN_EXECUTOR", "process").strip().lower()
    return value if value in ("process", "thread") else "process"


def start_timeout_s() -> float:
    """How long an executor may take to load its plan and bind every bucket (KILN_EXECUTOR_START_TIMEOUT_S, default
    900: a cold kernel cache compiles for about a minute, and large models capture many buckets)."""
    return env_number("KILN_EXECUTOR_START_TIMEOUT_S", 900, 0.001)


def loop_io() -> bool:
    """KILN_EXECUTOR_IO=loop: the core sends batches to executors and reads their replies on its event loop (no worker
    thread, `RemoteContext.infer_batch_async`); "thread" (the default): a worker thread per lane, as before. Why try
    it: each batch's hand-offs loop -> thread -> loop cost 0.2-0.5 ms and the lane threads' Python waits for the
    interpreter lock the loop holds (docs/performance.md "process by process")."""
    return os.environ.get("KILN_EXECUTOR_IO", "thread").strip().lower() == "loop"


def _cpu_too() -> bool:
    return os.environ.get("KILN_EXECUTOR_CPU", "") not in ("", "0")


def why_in_core(backend: str, max_batch_size: int, sequence: bool) -> str:
    """Why a model version's executions stay in the server process ("" when they run in executor processes): an
    executor runs models that batch (the engine gathers their jobs) and are no sequence models (whose state the
    core's batcher keeps), on CUDA (or the CPU with KILN_EXECUTOR_CPU). The reason also says why such a model
    cannot be placed on GPUs other than 0 (server/core/placement.py)."""
    if backend != "cuda" and not (backend == "cpu" and _cpu_too()):
        return f"the {backend} backend runs in the server process"
    if mode() != "process":
        return "KILN_EXECUTOR=thread (--gpu-executor thread) runs executions in the server process"
    if max_batch_size <= 0:
        return "a model with max_batch_size 0 runs in the server process (executor processes run models that batch)"
    if sequence:
        return "a sequence model runs in the server process (its batcher keeps the sequences' states there)"
    return ""


def runs_remote(backend: str, max_batch_size: int, sequence: bool) -> bool:
    """Whether a model version runs in executor processes (`why_in_core` says why not)."""
    return not why_in_core(backend, max_batch_size, sequence)


def remote_regions(cuda_available: bool) -> bool:
    """Whether shared-memory regions are handed to executors by reference (and not page-locked in the core)."""
    return mode() == "process" and (cuda_available or _cpu_too())


def region_released(region_id: int) -> None:
    """A region's last core-side reference is gone (no queued job names it): executors that mapped it unmap it.
    Safe from a finalizer: it only queues."""
    _ARENAS.pop(region_id, None)
    for executor in list(_LIVE):
        executor.forget(region_id)


def arena_registered(region: Any) -> None:
    """A frontend's tensor arena was registered: every executor maps (and on a GPU page-locks) it now, and every
    executor started later maps it at its start. Else the first batch with a request from that frontend paid for
    mapping and pinning the whole arena (tens of MB) in each executor: #30's first request after ready. Client
    regions stay mapped on first use: a large one pinned in every executor, used or not, would cost more."""
    _ARENAS[region.region_id] = region
    for executor in list(_LIVE):
        executor.premap([region])


def inbox_registered(inbox: int, path: str) -> None:
    """A frontend process listens for responses at `path`: every executor connects to it (direct_replies.py)."""
    _INBOXES[inbox] = path
    for executor in list(_LIVE):
        executor.tell(("inbox", inbox, path))


def inbox_released(inbox: int) -> None:
    """That frontend is gone: executors close their connections to its inbox."""
    if _INBOXES.pop(inbox, None) is not None:
        for executor in list(_LIVE):
            executor.tell(("uninbox", inbox))


class ExecutorProcess:
    """One model version's executor process on one device, its control socket and one socket per worker lane.

    `device`: the visible CUDA ordinal its instances run on (None: no GPU of its own, as a CPU plan's). The child's
    CUDA_VISIBLE_DEVICES lists that device first (`placement.child_visible_devices`), so the engine's ordinal 0
    there is it, and the other devices follow (a client's CUDA shared memory on another GPU opens by peer access).
    """

    def __init__(self, label: str, engine: Any, config_bytes: bytes, instances: int, device: int | None = None,
                 device_count: int = 0) -> None:
        self.label = label
        self.engine = engine  # described only (Runtime.describe): the executor holds the loaded one
        self._config = config_bytes
        self.instances = max(instances, 1)
        self.device = device
        self._device_count = device_count
        self.restarts = 0
        self._lock = threading.Lock()
        self._generation = 0
        self._closed = False
        self._mapped: set[int] = set()
        self._forgotten: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._process: subprocess.Popen | None = None
        self._control: Channel | None = None
        self._lanes: list[Channel] = []
        self._start(quick=label in _SERVED)
        _SERVED.add(label)
        self.lanes = [RemoteContext(self, index) for index in range(len(self._lanes))]
        _LIVE.add(self)
        threading.Thread(target=self._forget_loop, daemon=True, name=f"kiln-executor-forget-{label}").start()

    # -- process ------------------------------------------------------------------------------------------
    def _start(self, quick: bool = False) -> None:
        """Start the process, hand it the plan, wait until it is warm, then give it the lane sockets. `quick` (a
        restart, or a reload of a version this server served): ready once the plan is loaded, the batch buckets
        bound in the background (or by the first batch that needs one)."""
        visible = (None if self.device is None else
                   child_visible_devices(self.device, self._device_count, os.environ))
        process, control = child_launch("server.core.executor_main", executor_environment(self._config, visible))
        try:
            info = self._request_within(control, {
                "plan": self.engine.serialize(), "config": self._config, "instances": self.instances,
                "modules": plugin_modules(self.engine.plan.build_info), "warm_buckets": not quick},
                "was not ready", "; its log above says how far it got")
            pairs = [socket.socketpair() for _ in range(self.instances * int(info["runs"]))]
            control.send(("lanes",), [end.fileno() for _, end in pairs])
        except ExecutorGone:
            code = process.wait()
            control.close()
            raise RemoteError(f"{self.label}: the executor process exited with code {code} while loading the "
                              f"plan (its log above says why)") from None
        except BaseException:
            process.kill()  # half started: nothing of it is worth waiting for
            process.wait()
            control.close()
            raise
        for _, end in pairs:
            end.close()
        self._process, self._control = process, control
        self._lanes = [Channel(ours, alternating=True) for ours, _ in pairs]
        self._mapped = set()
        for inbox, path in list(_INBOXES.items()):
            self._tell_locked(("inbox", inbox, path))
        if self._send_maps(list(_ARENAS.values())):
            self._mapped_before_ready(control)
        log.info("%s: executor process %d ready with %d lane(s)%s", self.label, process.pid, len(self._lanes),
                 "" if visible is None else f" on GPU {self.device} (CUDA_VISIBLE_DEVICES={visible})")

    def _channel(self, lane: int) -> tuple[Channel, int]:
        """The lane's socket now, starting the process again first when it has exited."""
        with self._lock:
            if self._closed:
                raise RemoteError(f"{self.label}: the model version was unloaded")
            if self._process is not None and self._process.poll() is not None:
                self._restart_locked()
            return self._lanes[lane], self._generation

    def _died(self, generation: int) -> str:
        """A lane saw the process go: restart it once (the first lane to notice does), say how it ended."""
        with self._lock:
            code = self._process.wait() if self._process is not None else None
            if generation == self._generation and not self._closed:
                self._restart_locked()
        return f"exit code {code}"

    def _restart_locked(self) -> None:
        old = self._process
        code = old.wait() if old is not None else None
        log.error("%s: the executor process exited (code %s); starting a new one", self.label, code)
        self._close_channels()
        self._generation += 1
        self.restarts += 1
        self._start(quick=True)

    def _close_channels(self) -> None:
        for channel in [*self._lanes, *([self._control] if self._control else [])]:
            channel.close()

    # -- calls --------------------------------------------------------------------------------------------
    def call(self, lane: int, message: dict[str, Any], regions: Sequence[Any]) -> Any:
        """Send `message` on `lane` (with the maps of `regions` this process has not mapped yet) and return the
        reply's value; raises the executor's error, or UNAVAILABLE when the process went away meanwhile. A message
        the socket refused was never delivered (the process was exiting, not yet reapable: its threads still
        ending): it goes once more, to the process started in its place."""
        for attempt in (1, 2):
            channel, generation = self._channel(lane)
            maps, fds = self._maps_for(regions)
            try:
                channel.send({**message, "maps": maps} if maps else message, fds)
            except (ExecutorGone, OSError) as e:
                how = self._died(generation)
                if attempt == 1:
                    continue
                raise self._gone(how, e) from None
            try:
                reply, _ = channel.recv()
            except (ExecutorGone, OSError) as e:
                raise self._gone(self._died(generation), e) from None
            return raise_reply(reply)
        raise AssertionError("unreachable")

    async def call_async(self, lane: int, message: dict[str, Any], regions: Sequence[Any]) -> Any:
        """`call` from the event loop: the message sent from the loop's thread (a few KB: the socket takes it at
        once), the reply read when the lane's socket is readable. A process found gone, before or during the call,
        is started again in a worker thread (it takes seconds), as `call` would on its thread."""
        process = self._process
        if process is None or process.poll() is not None:
            return await asyncio.to_thread(self.call, lane, message, regions)
        channel, generation = self._channel(lane)
        maps, fds = self._maps_for(regions)
        try:
            channel.send({**message, "maps": maps} if maps else message, fds)
        except (ExecutorGone, OSError):  # never delivered: `call` restarts the process and sends it again
            await asyncio.to_thread(self._died, generation)
            return await asyncio.to_thread(self.call, lane, message, regions)
        try:
            reply, _ = await _reply_of(channel)
        except (ExecutorGone, OSError) as e:
            raise self._gone(await asyncio.to_thread(self._died, generation), e) from None
        return raise_reply(reply)

    def _maps_for(self, regions: Sequence[Any]) -> tuple[list[Any], list[int]]:
        """The maps (and descriptors) of `regions` the process has not mapped yet, marked as mapped."""
        if not regions:
            return [], []
        with self._lock:
            return self._unmapped(regions)

    def _unmapped(self, regions: Sequence[Any]) -> tuple[list[Any], list[int]]:
        """(Holding the lock.) `_maps_for`'s answer."""
        maps: list[Any] = []
        fds: list[int] = []
        for region in regions:
            if region.region_id not in self._mapped:
                self._mapped.add(region.region_id)
                spec, fd = region.executor_map(len(fds))
                maps.append(spec)
                if fd is not None:
                    fds.append(fd)
        return maps, fds

    def _gone(self, how: str, error: BaseException) -> ServerError:
        return unavailable(f"{self.label}: the executor process ended during the execution ({how}: {error}); it "
                           f"was started again, retry the request")

    def premap(self, regions: Sequence[Any]) -> None:
        """Map `regions` in the process now, over its control socket, not with the first batch that reads them."""
        with self._lock:
            if not self._closed:
                self._send_maps(regions)

    def _send_maps(self, regions: Sequence[Any]) -> bool:
        """(Holding the lock, or before any lane runs.) The maps of `regions` not mapped yet, on the control socket;
        a lane that reads one meanwhile waits for it there (`executor_main.Regions`). Whether any were sent."""
        if self._control is None:
            return False
        maps, fds = self._unmapped(regions)
        return bool(maps) and self._tell_locked(("map", maps), fds)  # a process gone maps them at its next start

    def tell(self, message: tuple) -> None:
        """A control message that needs no answer (an inbox to connect to or to close)."""
        with self._lock:
            if not self._closed:
                self._tell_locked(message)

    def _tell_locked(self, message: tuple, fds: list[int] | tuple[int, ...] = ()) -> bool:
        """(Holding the lock, or before any lane runs.) `message` on the control socket; whether it went (a process
        that is gone is told what it needs at its next start)."""
        if self._control is None:
            return False
        try:
            self._control.send(message, fds)
        except (ExecutorGone, OSError):
            return False
        return True

    def _mapped_before_ready(self, control: Channel) -> None:
        """Wait until the process has mapped (and page-locked) the frontends' arenas sent at its start. Why: pinning
        a server's arenas takes tens of ms (8 frontends x 64 MB), and a first request that arrived meanwhile waited
        for them: ResNet-50's first request after ready took 24 ms of compute against 1.5 ms steady (2 x H200)."""
        try:
            self._request_within(control, ("sync",), "did not map the frontends' tensor arenas")
        except (ExecutorGone, OSError):  # gone meanwhile: the next call starts it again, and maps them then
            pass

    def _request_within(self, control: Channel, message: Any, what: str, hint: str = "") -> Any:
        """`message` on the control socket and the reply's value (its error raised), within the start timeout: a
        hung process fails the load (RemoteError saying it `what`) instead of leaving it loading forever."""
        control.send(message)
        timeout_s = start_timeout_s()
        control.sock.settimeout(timeout_s)
        try:
            reply, _ = control.recv()
        except TimeoutError:
            raise RemoteError(f"{self.label}: the executor process {what} within {timeout_s:g} s "
                              f"(KILN_EXECUTOR_START_TIMEOUT_S){hint}") from None
        finally:
            control.sock.settimeout(None)
        return raise_reply(reply)

    def forget(self, region_id: int) -> None:
        self._forgotten.put(region_id)

    def _forget_loop(self) -> None:
        """Tell the process which regions to unmap, as the core releases them (a finalizer cannot send itself)."""
        while True:
            region_id = self._forgotten.get()
            if region_id is None:
                return
            with self._lock:
                if region_id not in self._mapped or self._control is None:
                    continue
                self._mapped.discard(region_id)
                self._tell_locked(("forget", [region_id]))  # a process gone took its mappings with it

    def close(self) -> None:
        """Stop the process (the scheduler calls this once its last execution returned); returns at once."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            process, control = self._process, self._control
            if control is not None:
                try:
                    control.send(("close",))
                except (ExecutorGone, OSError):
                    pass
            self._close_channels()
        self._forgotten.put(None)
        _LIVE.discard(self)
        if process is not None:  # reaped off the caller's thread: the event loop retires schedulers, and a CUDA
            threading.Thread(target=stop_process, args=(process,), daemon=True,  # context's teardown takes a while
                             name=f"kiln-executor-stop-{process.pid}").start()


def _reply_of(channel: Channel) -> asyncio.Future:
    """The next message on `channel`, read by the event loop once the socket is readable (the executor writes a reply
    in one go, so the read does not wait for more than the rest of a large one)."""
    loop = asyncio.get_running_loop()
    reply = loop.create_future()
    fd = channel.sock.fileno()

    def readable() -> None:
        loop.remove_reader(fd)
        try:
            channel.sock.setblocking(True)  # the loop made it non-blocking to poll it; the rest of a large reply waits
            message = channel.recv()
        except BaseException as e:  # noqa: BLE001 - the caller restarts the process and says so
            if not reply.done():
                reply.set_exception(e)
            return
        if not reply.done():  # read even when nobody waits any more: the next call must not find this reply
            reply.set_result(message)

    loop.add_reader(fd, readable)
    return reply


def executor_environment(config_bytes: bytes, visible: str | None) -> dict[str, str]:
    """What an executor's environment adds to the server's: the devices it sees (its own first), and spinning waits
    for its runs where the model's config asks for them (`optimization.cuda.busy_wait_events`: less latency from a
    run's end to its thread, a core kept busy meanwhile)."""
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    if ModelConfig.FromString(config_bytes).optimization.cuda.busy_wait_events:
        env["KILN_BLOCKING_SYNC"] = "0"  # engine_core/backends/cuda/runner_binding.blocking_waits
    return env


def plugin_modules(build_info: Mapping[str, Any]) -> list[str]:
    """The modules that registered the plugins a plan uses, for the executor to import before loading it (a
    server loads plugins by importing them, `python -m MODULE` included: that one is named by its spec)."""
    from engine_core.plugins import BUILD_INFO_KEY, get_plugin_registry

    registry, modules = get_plugin_registry(), []
    for need in build_info.get(BUILD_INFO_KEY, []):
        plugin = registry.get_plugin(need["name"], domain=need["domain"])
        if plugin is None:
            continue
        module = plugin.cpu.__module__
        if module == "__main__":
            spec = getattr(sys.modules["__main__"], "__spec__", None)
            module = spec.name if spec is not None else ""
        if module and module not in modules:
            modules.append(module)
    return modules


def stop_process(process: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """Wait for ``process`` to exit; kill it after ``timeout_s``."""
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class RemoteContext:
    """A worker lane's execution context in an executor process: what `execution.py` and `Workers` call."""

    concurrent_runs = 1  # one lane each: the executor's contexts run `runs` lanes at once
    #: after a fault the executor has replaced the context (or the process) already: `Workers` counts a restart
    replaces_itself = True

    def __init__(self, executor: ExecutorProcess, lane: int) -> None:
        self.executor = executor
        self.lane = lane
        self.engine = executor.engine
        self._profile = 0

    @property
    def active_optimization_profile(self) -> int:
        return self._profile

    def set_optimization_profile_async(self, profile_index: int, stream_handle: int = 0) -> bool:
        """Sent with each execution (the executor's context switches when it differs)."""
        self._profile = int(profile_index)
        return True

    def infer_batch(self, parts: Sequence[Mapping[str, Any]], pad_to: int | None = None,
                    destinations: Sequence[Mapping[str, Any]] | None = None,
                    routes: Sequence[Any] | None = None) -> list[Any]:
        """The batch sent whole where it can be (`whole_batch`: one array or one region table per tensor), else
        part by part; each part's outputs (rows of the whole ones, as views) come back, or `DELIVERED` for a part
        whose response the executor sent its frontend itself (`routes`: server/core/direct_replies.py)."""
        whole = whole_batch(parts, destinations)
        if whole is not None:
            message, rows, named = self._rows_message(whole, pad_to, routes)
            sent_ns = time.monotonic_ns() if hop_stats.ON else 0
            reply = self.executor.call(self.lane, message, named)
            if sent_ns:
                hop_stats.stats("core").add("executor round trip", sent_ns, len(parts))
            return _parts_of(reply, rows, routes)
        regions = _regions_of(parts, destinations)
        by_part: dict[str, Any] = {
            "kind": "batch", "profile": self._profile, "pad_to": pad_to,
            "parts": [{name: to_wire(value) for name, value in part.items()} for part in parts],
            "destinations": None if destinations is None else
            [{name: to_wire(view) for name, view in d.items()} for d in destinations]}
        result: list[dict[str, Any]] = self.executor.call(self.lane, by_part, regions)
        return result

    async def infer_batch_async(self, parts: Sequence[Mapping[str, Any]], pad_to: int | None = None,
                                destinations: Sequence[Mapping[str, Any]] | None = None,
                                routes: Sequence[Any] | None = None) -> list[Any]:
        """`infer_batch` from the event loop (`loop_io`): a batch sent whole crosses on the loop itself; one sent
        part by part (mixed kinds, rare) goes through a worker thread."""
        whole = whole_batch(parts, destinations)
        if whole is None:
            return await asyncio.to_thread(self.infer_batch, parts, pad_to, destinations, routes)
        message, rows, named = self._rows_message(whole, pad_to, routes)
        sent_ns = time.monotonic_ns() if hop_stats.ON else 0
        reply = await self.executor.call_async(self.lane, message, named)
        if sent_ns:
            hop_stats.stats("core").add("executor round trip", sent_ns, len(parts))
        return _parts_of(reply, rows, routes)

    def _rows_message(self, whole: tuple, pad_to: int | None, routes: Sequence[Any] | None
                      ) -> tuple[dict[str, Any], np.ndarray, list[Any]]:
        """A batch sent whole as the executor's "rows" message, its rows per part and the regions it names."""
        inputs, targets, rows, named = whole
        message = {"kind": "rows", "profile": self._profile, "pad_to": pad_to, "inputs": inputs,
                   "destinations": targets}
        if routes is not None:
            message["routes"], message["rows"] = list(routes), rows.tolist()
        return message, rows, named

    def infer(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        regions = _regions_of([feeds], None)
        message = {"kind": "infer", "profile": self._profile,
                   "feeds": {name: to_wire(value) for name, value in feeds.items()}}
        result: dict[str, Any] = self.executor.call(self.lane, message, regions)
        return result


def whole_batch(parts: Sequence[Mapping[str, Any]], destinations: Sequence[Mapping[str, Any]] | None
                ) -> tuple[dict[str, Any], dict[str, tuple] | None, np.ndarray, list[Any]] | None:
    """A batch as the executor runs it whole (`ExecutionContext.infer_rows`): per input, the parts' host arrays
    concatenated (the one copy a socket needs anyway) or their region references as one table ("regions", ids,
    offsets, rows, row shape, dtype); per output with destinations in every part, the same table. Returns (inputs,
    destinations or None, rows per part, the regions named) or None when the batch mixes kinds (then it goes part
    by part). Why: the executor then spends a few numpy operations on a batch, not Python work per request."""
    inputs: dict[str, Any] = {}
    regions: dict[int, Any] = {}
    counts: np.ndarray | None = None
    for name in parts[0]:
        values = [part[name] for part in parts]
        spec, rows = _whole_tensor(values, regions)
        if spec is None or (counts is not None and not np.array_equal(counts, rows)):
            return None
        inputs[name], counts = spec, rows
    if counts is None:
        return None
    targets = None
    if destinations is not None and any(destinations):
        names = set(destinations[0])
        if any(set(d) != names for d in destinations):
            return None
        targets = {}
        for name in names:
            spec, rows = _whole_tensor([d[name] for d in destinations], regions)
            if not isinstance(spec, tuple) or not np.array_equal(rows, counts):
                return None
            targets[name] = spec
    return inputs, targets, counts, list(regions.values())


def _whole_tensor(values: list[Any], regions: dict[int, Any]) -> tuple[Any, np.ndarray]:
    """One tensor of every part: its region table or concatenated array (None when the parts cannot be one),
    and the rows of each part."""
    first = values[0]
    rows = np.fromiter((v.shape[0] if len(v.shape) else -1 for v in values), np.int64, len(values))
    if np.any(rows < 0) or any(v.shape[1:] != first.shape[1:] or v.dtype != first.dtype for v in values):
        return None, rows
    if all(isinstance(v, RegionView) for v in values):
        for v in values:
            regions.setdefault(v.region, v.owner)
        ids = np.fromiter((v.region for v in values), np.int64, len(values))
        offsets = np.fromiter((v.offset for v in values), np.int64, len(values))
        return ("regions", ids, offsets, rows, tuple(first.shape[1:]), first.dtype.str), rows
    if all(isinstance(v, np.ndarray) and v.dtype != object for v in values):
        return (first if len(values) == 1 else np.concatenate(values)), rows
    return None, rows


def _parts_of(reply: Any, rows: np.ndarray, routes: Sequence[Any] | None) -> list[Any]:
    """Each part's outputs from the executor's reply to a "rows" message: its rows of the whole outputs, or
    `DELIVERED` for a part whose response the executor sent its frontend (`routes`)."""
    if routes is None:
        return _split(reply, rows)
    outputs, delivered = reply
    split: list[Any] = _split(outputs, rows) if outputs is not None else [DELIVERED] * len(rows)
    for index in delivered:
        split[index] = DELIVERED
    return split


def _split(outputs: Mapping[str, Any], rows: np.ndarray) -> list[dict[str, Any]]:
    """Each part's rows of every whole output (views), an output without the batch's rows whole to each."""
    total = int(rows.sum())
    ends = np.cumsum(rows)
    parts: list[dict[str, Any]] = [{} for _ in rows]
    for name, value in outputs.items():
        batched = isinstance(value, np.ndarray) and value.ndim > 0 and value.shape[0] == total
        start = 0
        for part, end in zip(parts, ends):
            part[name] = value[start:int(end)] if batched else value
            start = int(end)
    return parts


def _regions_of(parts: Sequence[Mapping[str, Any]], destinations: Sequence[Mapping[str, Any]] | None) -> list[Any]:
    """The distinct core-side regions the views of a batch live in."""
    found: dict[int, Any] = {}
    for mapping in [*parts, *(destinations or ())]:
        for value in mapping.values():
            if isinstance(value, RegionView):
                found.setdefault(value.region, value.owner)
    return list(found.values())
