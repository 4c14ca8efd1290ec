"""`kiln serve --frontend-processes N`: HTTP and gRPC in N child processes, models and GPUs in this one.

Why: a request's protocol work (HTTP/gRPC parsing, JSON and binary decoding, response encoding) is most of its
CPU, and in one process it holds the interpreter lock that the execution workers need between CUDA calls. The
children parse in parallel on other cores and call the core through `server.core.remote` (one Unix socket each).
HTTP connections reach them through SO_REUSEPORT; gRPC connections are accepted here and handed to them in turn
(server/connection_handoff.py says why). The server process keeps the models, the batcher, the
metrics endpoint and model control, so statistics, metrics and repository state stay in one place.

Lifecycle: the server process reserves the ports (port 0 resolves here, once), starts the children and waits for
each to listen. A child that dies is restarted. On SIGTERM the children drain their in-flight requests (the core
still serves them) and exit; then the core stops. A child whose core connection is lost exits by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass

from server.connection_handoff import Handoff, channel_pair
from server.core.heap import freeze_long_lived, keep_large_buffers_in_heap
from server.core.limits import InflightLimiter
from server.core.remote import CoreService, RemoteCore
from server.core.settings import lowest_level
from server.lifecycle import Lifecycle, drain_settings
from server.listeners import reload_certificates, start_listeners, tcp_socket

log = logging.getLogger("kiln.server.frontends")

_SPAWN = multiprocessing.get_context("spawn")  # fork would copy the core's threads, CUDA context and locks
_START_TIMEOUT_S = 120.0
_RESTART_DELAY_S = 1.0


def default_count() -> int:
    """Frontend processes when the flag is "auto": one per two cores beyond the core's own, at most 8; none on
    small machines, where the extra processes would only compete with the core for the same cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return 0 if cores < 4 else min(8, (cores - 1) // 2)


def frontend_count(text: str) -> int:
    """The `--frontend-processes` value: "auto" or a count >= 0 (0: HTTP and gRPC in the server process)."""
    if text.strip().lower() == "auto":
        return default_count()
    try:
        count = int(text)
    except ValueError:
        count = -1
    if count < 0:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a number >= 0, got '{text}'")
    return count


@dataclass
class _Child:
    index: int
    process: multiprocessing.process.BaseProcess
    listening: object  # a multiprocessing Event the child sets once its listeners are up


class FrontendPool:
    """The frontend processes of one server and the core service they call."""

    def __init__(self, core, args: argparse.Namespace, count: int) -> None:
        self.count = count
        self._args = copy.copy(args)
        self._held: list[socket.socket] = []
        self._handoff: Handoff | None = None  # gRPC: accepted here, handed to the children in turn
        self._directory = tempfile.mkdtemp(prefix="kiln-core-")
        # --max-inflight-requests counts all frontends' inference requests together, in the core
        self._service = CoreService(core, os.path.join(self._directory, "core.sock"),
                                    InflightLimiter(args.max_inflight_requests))
        self._args.max_inflight_requests = 0
        self._children: dict[int, _Child] = {}
        self._stopping = False
        self._watch: asyncio.Task | None = None
        self.failed = asyncio.Event()  # set when the children cannot be (re)started: the server should stop

    async def start(self) -> None:
        """Serve the core, reserve the ports and start every child; raises OSError when one cannot listen."""
        await self._service.start()
        if self._args.allow_http:  # held (bound, not listening) so port 0 resolves once and no other program takes it
            held = tcp_socket(self._args.host, self._args.http_port, listen=False)
            self._held.append(held)
            self._args.http_port = held.getsockname()[1]
        if self._args.allow_grpc:
            try:
                listener = tcp_socket(self._args.grpc_address, self._args.grpc_port, reuse_port=False)
            except OSError as e:
                raise OSError(f"gRPC: cannot listen on {self._args.grpc_address}:{self._args.grpc_port}: {e}") from None
            self._handoff = Handoff(listener)
            self._args.grpc_port = self._handoff.listener.getsockname()[1]
            self._handoff.start()
        await asyncio.gather(*(self._start_child(i) for i in range(self.count)))
        self._watch = asyncio.create_task(self._watch_children())
        log.info("%d frontend processes serve HTTP %s and gRPC %s", self.count,
                 self._args.http_port if self._args.allow_http else "off",
                 self._args.grpc_port if self._args.allow_grpc else "off")

    @property
    def ports(self) -> tuple[int, int]:
        return self._args.http_port, self._args.grpc_port

    async def _start_child(self, index: int) -> None:
        listening = _SPAWN.Event()
        channel = None
        if self._handoff is not None:
            ours, channel = channel_pair()
            self._handoff.attach(index, ours)
        process = _SPAWN.Process(target=frontend_main, args=(self._args, self._service.path, listening, channel),
                                 name=f"kiln-frontend-{index}", daemon=True)
        process.start()
        if channel is not None:
            channel.close()  # the child has its own copy
        self._children[index] = _Child(index, process, listening)
        started = await asyncio.to_thread(_wait_listening, process, listening, _START_TIMEOUT_S)
        if not started:
            raise OSError(f"frontend process {index} did not start listening (exit code {process.exitcode}); "
                          f"see its log above")

    async def _watch_children(self) -> None:
        """Restart a child that died (its connections are lost; the others keep serving)."""
        while not self._stopping:
            await asyncio.sleep(0.5)
            for index, child in list(self._children.items()):
                if child.process.is_alive() or self._stopping:
                    continue
                log.error("frontend process %d exited (code %s); restarting it", index, child.process.exitcode)
                await asyncio.sleep(_RESTART_DELAY_S)
                try:
                    await self._start_child(index)
                except Exception as e:  # noqa: BLE001 - a server without its frontends must say so and stop
                    log.error("cannot restart frontend process %d (%s); stopping the server", index, e)
                    self.failed.set()
                    return

    def forward(self, signum: int) -> None:
        """Pass a signal on to every live child (SIGHUP: each re-reads its TLS certificates)."""
        for child in self._children.values():
            if child.process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.process.pid, signum)  # type: ignore[arg-type]

    async def stop(self, timeout_s: float) -> None:
        """Drain: every child stops taking requests, finishes what it has (within `timeout_s`) and exits."""
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
        if self._handoff is not None:
            self._handoff.close()  # no new gRPC connections while the children drain
        for child in self._children.values():
            if child.process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.process.pid, signal.SIGTERM)  # type: ignore[arg-type]
        for child in self._children.values():
            await asyncio.to_thread(child.process.join, timeout_s + 5)
            if child.process.is_alive():
                child.process.kill()
        await self._service.stop()
        for held in self._held:
            held.close()
        shutil.rmtree(self._directory, ignore_errors=True)  # the core's socket and the frontends' inboxes


def _wait_listening(process, listening, timeout_s: float) -> bool:
    """Until the child listens (True) or exits first or the timeout passes (False)."""
    waited = 0.0
    while waited < timeout_s:
        if listening.wait(0.2):
            return True
        if not process.is_alive():
            return False
        waited += 0.2
    return False


def frontend_log_level(args: argparse.Namespace) -> int:
    """A frontend's logging level: warnings and errors, info too with --log-verbose; --log-info/--log-warning/
    --log-error false turn their level off, as in the server process (core/settings.LogSettings)."""
    return lowest_level(bool(args.log_verbose) and args.log_info is not False, args.log_warning is not False,
                        args.log_error is not False)


def frontend_main(args: argparse.Namespace, core_path: str, listening, channel: socket.socket | None = None) -> None:
    """A frontend process: connect to the core, listen on the shared HTTP port and take the gRPC connections handed
    over `channel`, serve until SIGTERM or the core goes."""
    logging.basicConfig(level=frontend_log_level(args),
                        format="%(asctime)s %(levelname)s %(name)s[frontend]: %(message)s")
    keep_large_buffers_in_heap()  # a request's tensors and frames are reused from the heap, not mapped each time
    from server.cli import run_event_loop

    sys.exit(run_event_loop(serve_frontend(args, core_path, listening, channel)))


async def serve_frontend(args: argparse.Namespace, core_path: str, listening,
                         channel: socket.socket | None = None) -> int:
    core = RemoteCore(core_path)
    await core.connect()
    await core.open_arena(args.frontend_arena_mb)
    await core.open_inbox()
    lifecycle = Lifecycle(drain_settings(args))
    stop = asyncio.Event()

    def begin_shutdown() -> None:
        core.begin_drain()
        stop.set()

    lifecycle.install_signal_handlers(asyncio.get_running_loop(), begin_shutdown)
    core.on_lost = begin_shutdown
    limiter = InflightLimiter(args.max_inflight_requests)
    try:
        listeners = await start_listeners(core, args, lifecycle, limiter, reuse_port=True, grpc_handoff=channel)
    except OSError as e:
        log.error("cannot listen: %s", e)
        return 1
    with contextlib.suppress(NotImplementedError, RuntimeError):
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload_certificates, listeners)
    listening.set()
    freeze_long_lived()
    waiter = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([waiter, *listeners.tasks], return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    core.begin_drain()
    await lifecycle.shutdown(listeners.servers, listeners.tasks, listeners.grpc_server)
    await core.close()
    return 0 if waiter in done else 1
