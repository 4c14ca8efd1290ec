"""A real server subprocess for the server tests (HTTP and gRPC frontends alike).

The session fixture `kiln_server` writes the example repository (examples/make_example_repository.py) plus
a few test-only models into a temporary directory, starts `python -m server` on free 127.0.0.1 ports in
explicit model-control mode with the example models loaded and client shared memory allowed
(`--allow-client-shm true`; off by default, as in Triton), and waits until /v2/health/ready says yes.
If the gRPC frontend cannot be imported, the server runs without it (`grpc_available` tells).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
STARTUP_MODELS = ["add_sub", "add_sub_fp32", "simple_cnn", "identity"]
READY_TIMEOUT_S = 60
# KILN_TEST_FRONTEND_PROCESSES=N runs every test server with N frontend processes (the default, auto, gives none
# on CI's two cores): the suite then checks that both protocols behave the same across the process boundary.
FRONTENDS = (["--frontend-processes", os.environ["KILN_TEST_FRONTEND_PROCESSES"]]
             if os.environ.get("KILN_TEST_FRONTEND_PROCESSES") else [])


def _install_pkg_resources_shim() -> None:
    """tritonclient 2.41's shared_memory module imports `pkg_resources`, which setuptools >= 81 no longer ships.

    It only calls `resource_filename(package, name)`; this stand-in answers that from the package's directory.
    """
    try:
        import pkg_resources  # noqa: F401
    except ImportError:
        shim = types.ModuleType("pkg_resources")

        def resource_filename(package: str, name: str) -> str:
            spec = importlib.util.find_spec(package)
            return str(Path(spec.origin).parent / name)

        shim.resource_filename = resource_filename  # type: ignore[attr-defined]
        sys.modules["pkg_resources"] = shim


_install_pkg_resources_shim()


def _load_examples():
    spec = importlib.util.spec_from_file_location("make_example_repository",
                                                  ROOT / "examples" / "make_example_repository.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


examples = _load_examples()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _grpc_importable() -> bool:
    try:
        import server.frontends.grpc  # noqa: F401
    except ImportError:
        return False
    return True


def _wait_ready(server: ServerProcess) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited with {server.process.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.base_url}/v2/health/ready", timeout=1, **server.http_client).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"server not ready after {READY_TIMEOUT_S} s:\n{server.log()}")


@contextlib.contextmanager
def run_server(repository: Path, log_path: Path, models: list[str] | None, extra_args: list[str] = (),
               module: str = "server", env: dict[str, str] | None = None, http_client: dict | None = None):
    """A real `python -m <module>` server on free 127.0.0.1 ports, ready when yielded; terminated (then killed
    if it hangs) on exit. ``models``: explicit mode with these loaded; None: every model in the repository.
    ``module``: e.g. a test module that registers plugins before starting the server; ``env``: added variables;
    ``http_client``: httpx options for probing an HTTPS server (verify=CA file, cert=(cert, key))."""
    ports = [free_port() for _ in range(3)]
    command = [sys.executable, "-m", module, "--model-repository", str(repository), "--host", "127.0.0.1",
               "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]),
               *FRONTENDS, *extra_args]
    if models is not None:
        command += ["--model-control-mode", "explicit"]
        for name in models:
            command += ["--load-model", name]
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(command, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    grpc_off = any(a == "--allow-grpc" and b == "false" for a, b in zip(extra_args, list(extra_args)[1:]))
    server = ServerProcess(process, repository, log_path, *ports, grpc_available=_grpc_importable() and not grpc_off,
                           http_client=http_client or {})
    try:
        _wait_ready(server)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def require_grpc(server: ServerProcess) -> ServerProcess:
    """``server`` once its gRPC port accepts calls; skips the test when the gRPC frontend is not importable."""
    if not server.grpc_available:
        pytest.skip("gRPC frontend not importable")
    import grpc

    with grpc.insecure_channel(server.grpc_url) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
    return server


@pytest.fixture(scope="session")
def kiln_server(tmp_path_factory: pytest.TempPathFactory):
    """Start the server once per test session; yields a `ServerProcess`."""
    base = tmp_path_factory.mktemp("kiln_server")
    repository = examples.make_repository(base / "models")
    with run_server(repository, base / "server.log", STARTUP_MODELS, ["--allow-client-shm", "true"]) as server:
        yield server
