"""Graceful shutdown: on SIGTERM stop taking new work, finish what was accepted (up to a drain timeout), exit 0.

Kubernetes sends SIGTERM, removes the pod from its Service endpoints at about the same time (not before), and
sends SIGKILL `terminationGracePeriodSeconds` later. So on the first SIGTERM/SIGINT the server:

1. reports not-ready (`/v2/health/ready` -> 503) and answers with `Connection: close`, so load balancers and
   keep-alive clients move to other replicas, while it keeps serving for `delay_s` (endpoint propagation);
2. closes its listeners (uvicorn: no new connections; gRPC: no new RPCs) and lets in-flight requests finish,
   for at most `timeout_s` in all;
3. returns, so the process exits 0 once the in-flight count is 0 (or the timeout cut the rest off).

A second signal during the drain exits at once (exit code 1), as an impatient Ctrl-C expects.

Hook (server/cli.py): `lc = Lifecycle(drain_settings(args))`, `lc.wrap_asgi(app)` for the HTTP app,
`timeout_graceful_shutdown=lc.settings.timeout_s` for uvicorn, `lc.install_signal_handlers(loop, stop.set)`,
and `await lc.shutdown(servers, tasks, grpc_server)` before `core.stop()`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger("kiln.server.lifecycle")

ENV_DRAIN_TIMEOUT = "KILN_DRAIN_TIMEOUT_S"
ENV_DRAIN_DELAY = "KILN_DRAIN_DELAY_S"
DEFAULT_DRAIN_TIMEOUT_S = 30.0
DEFAULT_DRAIN_DELAY_S = 0.0
READY_PATHS = frozenset({"/v2/health/ready"})
FORCED_EXIT_CODE = 1

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class _Stoppable(Protocol):
    should_exit: bool


class _GrpcServer(Protocol):
    def stop(self, grace: float | None) -> Awaitable[None]: ...


def _seconds(text: str, name: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}: expected a number of seconds, got '{text}'") from None
    if value < 0:
        raise ValueError(f"{name}: must be >= 0, got {value}")
    return value


@dataclass(frozen=True)
class DrainSettings:
    """How long to keep serving after SIGTERM (`delay_s`) and the whole drain budget (`timeout_s`)."""

    timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    delay_s: float = DEFAULT_DRAIN_DELAY_S

    def __post_init__(self) -> None:
        if self.timeout_s < 0 or self.delay_s < 0:
            raise ValueError("drain timeout and delay must be >= 0")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> DrainSettings:
        """Read KILN_DRAIN_TIMEOUT_S / KILN_DRAIN_DELAY_S (the container and Helm chart set these)."""
        timeout = environ.get(ENV_DRAIN_TIMEOUT)
        delay = environ.get(ENV_DRAIN_DELAY)
        return cls(timeout_s=_seconds(timeout, ENV_DRAIN_TIMEOUT) if timeout else DEFAULT_DRAIN_TIMEOUT_S,
                   delay_s=_seconds(delay, ENV_DRAIN_DELAY) if delay else DEFAULT_DRAIN_DELAY_S)


def add_drain_arguments(parser: argparse.ArgumentParser, environ: Mapping[str, str] = os.environ) -> None:
    """`--drain-timeout` / `--drain-delay`; their defaults come from the environment, so flags win over env."""
    defaults = DrainSettings.from_env(environ)
    parser.add_argument("--drain-timeout", "--exit-timeout-secs", type=float, default=defaults.timeout_s,
                        metavar="SECONDS", help="on SIGTERM, wait this long at most for in-flight requests (Triton's "
                                                f"--exit-timeout-secs; env {ENV_DRAIN_TIMEOUT})")
    parser.add_argument("--drain-delay", type=float, default=defaults.delay_s, metavar="SECONDS",
                        help="on SIGTERM, keep serving (not ready) this long before closing listeners, so "
                             f"load balancers stop routing here first (env {ENV_DRAIN_DELAY})")


def drain_settings(args: argparse.Namespace) -> DrainSettings:
    return DrainSettings(timeout_s=args.drain_timeout, delay_s=min(args.drain_delay, args.drain_timeout))


class InflightTracker:
    """Counts requests being served; `wait_idle` resolves once the count is back to 0."""

    def __init__(self) -> None:
        self._count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def count(self) -> int:
        return self._count

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        self.enter()
        try:
            yield
        finally:
            self.leave()

    def enter(self) -> None:
        """One more request in flight (`leave` once it is answered or abandoned)."""
        self._count += 1
        self._idle.clear()

    def leave(self) -> None:
        self._count -= 1
        if self._count == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float | None) -> bool:
        """True when idle within `timeout` seconds (None: wait as long as it takes)."""
        if self._idle.is_set():
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True


def _with_connection_close(message: Message) -> Message:
    headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
    return {**message, "headers": [*headers, (b"connection", b"close")]}


class DrainMiddleware:
    """ASGI middleware: counts in-flight HTTP requests; while draining, readiness is 503 and connections close."""

    def __init__(self, app: ASGIApp, lifecycle: Lifecycle) -> None:
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.lifecycle.draining and scope.get("path") in READY_PATHS:
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-length", b"0"), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": b""})
            return

        async def send_closing(message: Message) -> None:
            if message["type"] == "http.response.start" and self.lifecycle.draining:
                message = _with_connection_close(message)
            await send(message)

        with self.lifecycle.tracker.track():
            await self.app(scope, receive, send_closing)


class Lifecycle:
    """Drain state of one server process: the in-flight tracker, the draining flag and the shutdown sequence."""

    def __init__(self, settings: DrainSettings | None = None) -> None:
        self.settings = settings or DrainSettings()
        self.tracker = InflightTracker()
        self.draining = False
        self._signals = 0

    def wrap_asgi(self, app: ASGIApp) -> ASGIApp:
        return DrainMiddleware(app, self)

    def on_signal(self, stop: Callable[[], None], exit_now: Callable[[int], None] = os._exit) -> None:
        """First signal: start draining and call `stop`; a second one exits at once."""
        self._signals += 1
        if self._signals > 1:
            log.warning("second shutdown signal: exiting without waiting for %d in-flight request(s)",
                        self.tracker.count)
            exit_now(FORCED_EXIT_CODE)
            return
        self.draining = True
        log.info("shutdown signal: draining %d in-flight request(s), at most %.1f s",
                 self.tracker.count, self.settings.timeout_s)
        stop()

    def install_signal_handlers(self, loop: asyncio.AbstractEventLoop, stop: Callable[[], None],
                                signals: Sequence[signal.Signals] = (signal.SIGINT, signal.SIGTERM)) -> None:
        for sig in signals:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.on_signal, stop)

    async def shutdown(self, servers: Sequence[_Stoppable], tasks: Sequence[asyncio.Task],
                       grpc_server: _GrpcServer | None = None) -> bool:
        """Drain and stop the listeners; True when every in-flight request finished within the timeout.

        `servers` are uvicorn servers (their `timeout_graceful_shutdown` should equal `settings.timeout_s`: uvicorn
        cancels what is still running after it), `tasks` the tasks running their `serve()`.
        """
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.timeout_s
        if self.settings.delay_s > 0:
            await asyncio.sleep(self.settings.delay_s)
        for server in servers:
            server.should_exit = True
        waits: list[Awaitable[Any]] = list(tasks)
        if grpc_server is not None:
            waits.append(grpc_server.stop(max(deadline - loop.time(), 0.0)))
        if waits:
            await asyncio.wait([asyncio.ensure_future(w) for w in waits], timeout=max(deadline - loop.time(), 0.0))
        drained = await self.tracker.wait_idle(max(deadline - loop.time(), 0.0))
        if drained:
            log.info("drained: no request in flight")
        else:
            log.warning("drain timeout (%.1f s): %d request(s) still in flight", self.settings.timeout_s,
                        self.tracker.count)
        return drained
