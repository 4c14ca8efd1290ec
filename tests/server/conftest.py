"""A real server subprocess for the server tests (HTTP and gRPC frontends alike).

The session fixture `kiln_server` writes the example repository (examples/make_example_repository.py) plus
a few test-only models into a temporary directory, starts `python -m server` on free 127.0.0.1 ports in
explicit model-control mode with the example models loaded and client shared memory allowed
(`--allow-client-shm true`; off by default, as in Triton), and waits until /v2/health/ready says yes
(`run_server`, tests/support/servers.py).
If the gRPC frontend cannot be imported, the server runs without it (`grpc_available` tells).
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest

# the server harness: tests/support (on load_tests/harness.py); tests here import run_server/ServerProcess from either
from tests.support.examples import load_example
from tests.support.servers import ROOT, ServerProcess, run_server  # noqa: F401 - ROOT: tests import it from here

STARTUP_MODELS = ["add_sub", "add_sub_fp32", "simple_cnn", "identity"]


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


examples = load_example("make_example_repository.py")


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
