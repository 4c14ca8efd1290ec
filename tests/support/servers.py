"""A real `python -m server` subprocess for tests: started on free 127.0.0.1 ports, ready when yielded.

Start, readiness polling and stop come from load_tests/harness.py; this module adds what tests want on top:
the `ServerProcess` record (ports, URLs, repository, log), an httpx probe that also speaks HTTPS (TLS tests),
and `KILN_TEST_FRONTEND_PROCESSES`.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from load_tests import harness

ROOT = harness.ROOT
READY_TIMEOUT_S = 60
# KILN_TEST_FRONTEND_PROCESSES=N runs every test server with N frontend processes (the default, auto, gives none
# on CI's two cores): the suite then checks that both protocols behave the same across the process boundary.
FRONTENDS = (["--frontend-processes", os.environ["KILN_TEST_FRONTEND_PROCESSES"]]
             if os.environ.get("KILN_TEST_FRONTEND_PROCESSES") else [])


@dataclass
class ServerProcess:
    """A running server: its ports, URLs (host:port, as tritonclient takes them) and repository."""

    process: subprocess.Popen
    repository: Path
    log_path: Path
    http_port: int
    grpc_port: int
    metrics_port: int
    grpc_available: bool
    #: httpx options for the readiness probe (an HTTPS server: its CA as `verify`, a client `cert` for mutual TLS)
    http_client: dict = field(default_factory=dict)

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def base_url(self) -> str:
        return f"{'https' if self.http_client else 'http'}://{self.http_url}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def grpc_importable() -> bool:
    try:
        import server.frontends.grpc  # noqa: F401
    except ImportError:
        return False
    return True


def wait_ready(server: ServerProcess, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Until /v2/health/ready answers 200 (over HTTPS with ``server.http_client``); RuntimeError with the log
    if the process exits first or ``timeout_s`` passes."""

    def ready() -> bool:
        try:
            return httpx.get(f"{server.base_url}/v2/health/ready", timeout=1, **server.http_client).status_code == 200
        except httpx.HTTPError:
            return False

    harness.wait_ready(server.process, ready, server.log_path, timeout_s=timeout_s)


def start_server(repository: Path, log_path: Path, *flags: str, env: dict[str, str] | None = None,
                 grpc_available: bool = False) -> ServerProcess:
    """`python -m server` with ``flags``, ready when returned; the caller stops it (`stop_server`)."""
    ports = harness.free_ports(3)
    process = harness.start(harness.kiln_command(repository, ports, *flags), log_path, env=env)
    server = ServerProcess(process, repository, log_path, *ports, grpc_available=grpc_available)
    try:
        wait_ready(server)
    except BaseException:
        harness.stop(process)
        raise
    return server


def stop_server(server: ServerProcess, timeout_s: float = 10) -> None:
    harness.stop(server.process, timeout_s)


@contextlib.contextmanager
def run_server(repository: Path, log_path: Path, models: list[str] | None, extra_args: Sequence[str] = (),
               module: str = "server", env: dict[str, str] | None = None,
               http_client: dict | None = None, ready_timeout_s: float = READY_TIMEOUT_S) -> Iterator[ServerProcess]:
    """A real `python -m <module>` server on free 127.0.0.1 ports, ready when yielded; terminated (then killed
    if it hangs) on exit. ``models``: explicit mode with these loaded; None: every model in the repository.
    ``module``: e.g. a test module that registers plugins before starting the server; ``env``: added variables;
    ``http_client``: httpx options for probing an HTTPS server (verify=CA file, cert=(cert, key));
    ``ready_timeout_s``: longer for CUDA models on a fresh machine (the first build compiles kernels)."""
    flags = [*FRONTENDS, *extra_args]
    if models is not None:
        flags += ["--model-control-mode", "explicit"]
        for name in models:
            flags += ["--load-model", name]
    ports = harness.free_ports(3)
    process = harness.start(harness.kiln_command(repository, ports, *flags, module=module), log_path,
                            env=harness.python_path_env(env))
    grpc_off = any(a == "--allow-grpc" and b == "false" for a, b in zip(extra_args, list(extra_args)[1:]))
    server = ServerProcess(process, repository, log_path, *ports, grpc_available=grpc_importable() and not grpc_off,
                           http_client=http_client or {})
    try:
        wait_ready(server, ready_timeout_s)
        yield server
    except Exception:  # a failing test: its report shows the server's side (a GPU run brings back no log file)
        print(f"--- the server's log ({log_path}), last {LOG_TAIL_LINES} lines ---\n" + _log_tail(log_path))
        raise
    finally:
        harness.stop(process)


#: how much of the server's log a failing test prints
LOG_TAIL_LINES = 80


def _log_tail(log_path: Path) -> str:
    try:
        return "\n".join(log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])
    except OSError as e:
        return f"(unreadable: {e})"


def infer_add_sub_int32(url: str, rows: int, model: str = "add_sub") -> None:
    """One JSON request of `rows` INT32 rows to an add_sub-shaped model (INPUT0/INPUT1 [-1, 16]) at `url`
    (host:port); asserts it succeeds. The metrics tests count these."""
    data = list(range(16 * rows))
    body = {"inputs": [{"name": name, "shape": [rows, 16], "datatype": "INT32", "data": data}
                       for name in ("INPUT0", "INPUT1")]}
    assert httpx.post(f"http://{url}/v2/models/{model}/infer", json=body, timeout=30).status_code == 200
