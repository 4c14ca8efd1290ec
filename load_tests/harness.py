"""Starting a server process and waiting until it is ready, reading its /metrics, and loading the example scripts:
the one copy that load tests, benchmarks and the test suite (tests/support/servers.py, tests/support/examples.py)
share.

Standard library only (no httpx), so it also runs where only numpy/onnx are installed (the GPU device).

    ports = free_ports(3)
    command = kiln_command(repository, ports, "--model-control-mode", "explicit", "--load-model", "*")
    with serving(command, log_path, http_ready(f"http://127.0.0.1:{ports[0]}/v2/health/ready"),
                 env=python_path_env()) as process:
        ...
"""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]

#: One sample line of the Prometheus text format: name, optional {labels} (quoted values may hold braces), value.
_SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>(?:[^"}]|"(?:[^"\\]|\\.)*")*)\})?'
                     r'[ \t]+(?P<value>\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(count: int) -> list[int]:
    """`count` different free ports: each probe socket stays bound until all are picked (one at a time, the kernel
    handed the same just-released port out twice: a server got `--grpc-port P --metrics-port P` and failed to start)."""
    with ExitStack() as stack:
        ports = []
        for _ in range(count):
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
        return ports


def python_path_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment plus ``extra``, with the repository root first on PYTHONPATH (``python -m server``
    then finds this checkout's packages from any working directory)."""
    return {**os.environ, **(extra or {}),
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def kiln_command(repository: Path | str, ports: Sequence[int], *flags: str, module: str = "server") -> list[str]:
    """``python -m <module>`` on ``repository``, listening on 127.0.0.1 at ``ports`` (HTTP, gRPC, metrics)."""
    http_port, grpc_port, metrics_port = ports
    return [sys.executable, "-m", module, "--model-repository", str(repository), "--host", "127.0.0.1",
            "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port),
            *flags]


def http_status(url: str, method: str = "GET", timeout: float = 5.0) -> int:
    """The HTTP status ``url`` answers (an error status too); 0 when nothing answers."""
    request = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def http_ready(url: str) -> Callable[[], bool]:
    """A readiness probe: ``url`` answers 200 (e.g. /v2/health/ready or /v2/models/<name>/ready)."""
    return lambda: http_status(url, timeout=1.0) == 200


def start(command: Sequence[str], log_path: Path, *, cwd: Path | str = ROOT,
          env: dict[str, str] | None = None) -> subprocess.Popen:
    """``command`` in the background, its stdout and stderr both written to ``log_path``."""
    with open(log_path, "wb") as log:
        return subprocess.Popen(list(command), cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_ready(process: subprocess.Popen, is_ready: Callable[[], bool], log_path: Path, *, timeout_s: float = 60,
               interval_s: float = 0.1, name: str = "server", show_log: bool = True) -> None:
    """Poll ``is_ready`` until it says yes. RuntimeError if the process exits first or ``timeout_s`` passes;
    the message holds the log (``show_log``) or its path."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}{_log_note(log_path, show_log)}")
        if is_ready():
            return
        time.sleep(interval_s)
    raise RuntimeError(f"{name} not ready after {timeout_s:.0f} s{_log_note(log_path, show_log)}")


def _log_note(log_path: Path, show_log: bool) -> str:
    if not show_log:
        return f"; log: {log_path}"
    try:
        return ":\n" + log_path.read_text(errors="replace")
    except OSError:
        return f"; log: {log_path} (unreadable)"


def stop(process: subprocess.Popen, timeout_s: float = 10) -> None:
    """SIGTERM, then SIGKILL if the process has not exited after ``timeout_s``."""
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextmanager
def serving(command: Sequence[str], log_path: Path, is_ready: Callable[[], bool], *, cwd: Path | str = ROOT,
            env: dict[str, str] | None = None, timeout_s: float = 60, interval_s: float = 0.1,
            stop_timeout_s: float = 10, name: str = "server", show_log: bool = True) -> Iterator[subprocess.Popen]:
    """Start ``command``, yield its process once ``is_ready``, stop it on exit (also when it never got ready)."""
    process = start(command, log_path, cwd=cwd, env=env)
    try:
        wait_ready(process, is_ready, log_path, timeout_s=timeout_s, interval_s=interval_s, name=name,
                   show_log=show_log)
        yield process
    finally:
        stop(process, stop_timeout_s)


def metric_sum(url: str, name: str, labels: dict[str, str] | None = None, timeout: float = 10.0) -> float | None:
    """Sum of the samples of metric ``name`` on the Prometheus page at ``url`` (``.../metrics``) whose labels include
    ``labels``; None when none matches (not exported, or not for those labels), so a caller can tell 0 from absent."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            text = response.read().decode(errors="replace")
    except urllib.error.HTTPError:
        return None
    return samples_sum(text, name, labels)


def samples_sum(text: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    """metric_sum over a page already read."""
    wanted = (labels or {}).items()
    values = [float(m["value"]) for m in map(_SAMPLE.match, text.splitlines())
              if m and m["name"] == name and wanted <= dict(_LABEL.findall(m["labels"] or "")).items()]
    return sum(values) if values else None


def load_example(filename: str) -> ModuleType:
    """examples/<filename> imported as a module named after it: the examples are scripts, not a package."""
    return load_file(ROOT / "examples" / filename)


def load_file(path: Path, register_as: str | None = None) -> ModuleType:
    """The Python file at ``path`` imported as a module named after its stem, not entered in sys.modules unless
    ``register_as`` names it there (a file that defines dataclasses needs that: they look their module up)."""
    spec = importlib.util.spec_from_file_location(register_as or path.stem, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    if register_as is not None:
        sys.modules[register_as] = module
    spec.loader.exec_module(module)
    return module
