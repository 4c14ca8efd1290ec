"""Builds in worker processes: parse + build of one model version runs in a child process with bounded memory
and time, so a slow or hostile model can neither stall serving (the GIL stays free) nor take the server down.

The child gets the model file's path and the builder config, parses and builds, and sends back the plan bytes
or the build error's message. Limits:

* memory: `RLIMIT_AS` in the child (CPU builds; an allocation past it raises MemoryError there), and for every
  build a watchdog in the parent that kills a child whose resident memory passes the limit (CUDA builds, where
  the driver reserves far more address space than it uses, so RLIMIT_AS cannot be set);
* time: the parent kills the child after `timeout_s` (and `RLIMIT_CPU` stops a child that outlives its parent).

The reason a build failed (its BuildError, the limit it hit, the signal that ended it) becomes the model's
UNAVAILABLE reason. Nothing here touches the plan cache: the parent stores a plan only once it has all of it.

Processes: CPU builds fork from a forkserver that imported the engine once (fast: tens of ms per build, not an
interpreter start). CUDA builds use `spawn`: a fresh interpreter, so no CUDA state is ever inherited.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path

import engine_core as kiln

log = logging.getLogger("kiln.server")

GIB = 1 << 30
#: Default time limit of one build (seconds); CUDA builds time tactics, so leave them room.
DEFAULT_TIMEOUT_S = 600.0
#: How often the parent checks the child's memory and the clock.
_WATCH_INTERVAL_S = 0.1
#: Modules the forkserver imports once, so forked builds start without importing numpy/onnx/the engine.
_PRELOAD = ["server.core.build_process"]


@dataclass(frozen=True)
class BuildLimits:
    """Bounds of one build; `None` means unbounded."""

    memory_bytes: int | None
    timeout_s: float | None = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.memory_bytes is not None and self.memory_bytes <= 0:
            raise ValueError(f"build memory limit must be positive, got {self.memory_bytes}")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"build timeout must be positive, got {self.timeout_s}")


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_memory_limit() -> int:
    """Half of this machine's memory (at least 2 GiB): a build may use a lot, but never all of it."""
    return max(physical_memory_bytes() // 2, 2 * GIB)


def parse_size(text: str) -> int | None:
    """`--build-memory-limit` values: bytes, or with a K/M/G/T suffix (powers of 1024); "0"/"none" = no limit."""
    value = text.strip().lower().removesuffix("b").removesuffix("i")
    if value in ("0", "none", "unlimited", ""):
        return None
    scale = 1
    if value and value[-1] in "kmgt":
        scale = 1 << (10 * ("kmgt".index(value[-1]) + 1))
        value = value[:-1]
    try:
        size = int(float(value) * scale)
    except ValueError:
        raise ValueError(f"memory size must look like 8G, 512M or 1073741824, got '{text}'") from None
    if size <= 0:
        raise ValueError(f"memory size must be positive, got '{text}'")
    return size


def format_size(size: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift:
            return f"{size / (1 << shift):.3g} {unit}"
    return f"{size} bytes"


_limits: BuildLimits | None = None
_active: set[multiprocessing.process.BaseProcess] = set()
_active_lock = threading.Lock()
_stopping = False


def configure(limits: BuildLimits) -> BuildLimits:
    """Set the limits server builds run under (`--build-memory-limit`, `--build-timeout-secs`, ...)."""
    global _limits, _stopping
    _limits, _stopping = limits, False
    return limits


def current_limits() -> BuildLimits:
    """The configured limits; the defaults (half the memory, 600 s) until `configure`."""
    return _limits if _limits is not None else configure(BuildLimits(default_memory_limit()))


def warm_up() -> None:
    """Start the forkserver now (one interpreter start + engine import), not at the first model's build."""
    from multiprocessing import forkserver

    _context("cpu")
    forkserver.ensure_running()


def stop_all() -> None:
    """Kill every running build (server shutdown): their waiting loads fail at once instead of finishing."""
    global _stopping
    _stopping = True
    with _active_lock:
        processes = list(_active)
    for process in processes:
        if process.is_alive():
            process.kill()


# -- parent side ----------------------------------------------------------------------------------------------
def build_plan(model_path: str | Path, config: kiln.BuilderConfig, label: str,
               limits: BuildLimits | None = None) -> bytes:
    """Parse `model_path` and build it with `config`; plan bytes, or BuildError naming the reason
    (the model's own error, or the memory/time limit it ran into). Blocking: call from a worker thread."""
    limits = limits or current_limits()
    context = _context(config.backend)
    receiver, sender = context.Pipe(duplex=False)
    # RLIMIT_AS breaks CUDA (the driver reserves address space far beyond what it uses): watchdog only.
    address_limit = limits.memory_bytes if config.backend == "cpu" else None
    cpu_limit = int(limits.timeout_s) + 30 if limits.timeout_s else None
    process = context.Process(target=_child_main, args=(sender, str(model_path), config, address_limit, cpu_limit,
                                                        plugin_modules()),
                              name=f"kiln-build {label}", daemon=True)
    with _active_lock:
        if _stopping:
            raise kiln.BuildError("the server is shutting down; build not started")
        process.start()
        _active.add(process)
    sender.close()
    try:
        return _collect(process, receiver, limits)
    finally:
        if process.is_alive():
            process.kill()
        process.join(timeout=5)
        with _active_lock:
            _active.discard(process)
        receiver.close()


def _context(backend: str):
    if backend != "cpu":
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def _collect(process: multiprocessing.process.BaseProcess, receiver: Connection, limits: BuildLimits) -> bytes:
    """Wait for the child's answer, enforcing the time and resident-memory limits."""
    deadline = time.monotonic() + limits.timeout_s if limits.timeout_s else None
    while True:
        ready = wait([receiver, process.sentinel], timeout=_WATCH_INTERVAL_S)
        if receiver in ready:
            try:
                return _receive(receiver, limits)
            except EOFError:  # the child ended without a word: its exit status says how
                break
        elif ready:  # exited; read whatever it sent before it went
            if receiver.poll(0):
                continue
            break
        if deadline is not None and time.monotonic() > deadline:
            process.kill()
            raise kiln.BuildError(f"the build ran past its time limit of {limits.timeout_s:g} s "
                                  f"(--build-timeout-secs) and was stopped")
        rss = _resident_bytes(process.pid)
        if limits.memory_bytes is not None and rss is not None and rss > limits.memory_bytes:
            process.kill()
            raise kiln.BuildError(f"the build used {format_size(rss)} of memory, over its limit of "
                                  f"{format_size(limits.memory_bytes)} (--build-memory-limit), and was stopped")
    process.join(timeout=5)
    raise kiln.BuildError(_exit_reason(process.exitcode, limits))


def _receive(receiver: Connection, limits: BuildLimits) -> bytes:
    kind, message = receiver.recv()
    if kind == "ok":
        return receiver.recv_bytes()
    if kind == "memory":
        limit = format_size(limits.memory_bytes) if limits.memory_bytes else "this machine's memory"
        raise kiln.BuildError(f"the build ran out of memory: it needs more than its limit of {limit} "
                              f"(--build-memory-limit){': ' + message if message else ''}")
    raise kiln.BuildError(message)


def _exit_reason(code: int | None, limits: BuildLimits) -> str:
    if _stopping:
        return "the build was stopped: the server is shutting down"
    if code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        hint = ""
        if name in ("SIGKILL", "SIGABRT", "SIGSEGV") and limits.memory_bytes:
            hint = (f" (a build that reaches its memory limit of {format_size(limits.memory_bytes)} "
                    f"ends this way; --build-memory-limit)")
        elif name == "SIGXCPU":
            hint = " (it used more CPU time than its limit)"
        return f"the build process was killed by {name}{hint}"
    return f"the build process exited with status {code} without a result"


def _resident_bytes(pid: int | None) -> int | None:
    """The process's resident set size (Linux /proc), or None where that cannot be read."""
    try:
        with open(f"/proc/{pid}/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


# -- child side -----------------------------------------------------------------------------------------------
def parse_and_build(model_path: str, config: kiln.BuilderConfig) -> bytes:
    """Import the ONNX file and build it: what the child runs."""
    builder = kiln.Builder()
    network = builder.create_network()
    parser = kiln.OnnxParser(network)
    if not parser.parse_from_file(model_path):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise kiln.BuildError(f"ONNX import failed: {errors}")
    return kiln.build_plan(network, config)  # refuses tensors over this machine's memory at the smallest shapes


def plugin_modules() -> list[str]:
    """The modules defining the plugins registered in this process: a build child imports them, so models
    using plugins build there too (the child does not share this process's registry)."""
    from engine_core.plugins import get_plugin_registry

    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)  # `python -m pkg.plugin_server`
    names = set()
    for plugin in get_plugin_registry()._plugins.values():
        name = getattr(plugin.cpu, "__module__", "")
        names.add(main_spec.name if name == "__main__" and main_spec is not None else name)
    return sorted(n for n in names if n and n != "__main__")


def _child_main(sender: Connection, model_path: str, config: kiln.BuilderConfig, address_limit: int | None,
                cpu_limit: int | None, plugins: Sequence[str] = ()) -> None:
    """Entry of the build process: set its limits, build, send ("ok", size) + bytes or (kind, message)."""
    import importlib

    for module in plugins:
        importlib.import_module(module)
    if address_limit is not None:
        resource.setrlimit(resource.RLIMIT_AS, (address_limit, address_limit))
    if cpu_limit is not None:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_limit, cpu_limit + 5))
    try:
        plan = parse_and_build(model_path, config)
    except MemoryError as e:
        _send(sender, ("memory", str(e)))
    except kiln.KilnError as e:
        _send(sender, ("error", str(e)))
    except RecursionError:
        _send(sender, ("error", "the model nests too deeply to import (recursion limit reached)"))
    except Exception as e:  # noqa: BLE001 - whatever a hostile model provokes becomes the load's reason
        log.exception("build of %s failed unexpectedly", model_path)
        _send(sender, ("error", f"the build failed: {type(e).__name__}: {e}"))
    else:
        _send(sender, ("ok", len(plan)))
        sender.send_bytes(plan)
    sender.close()


def _send(sender: Connection, message: tuple[str, object]) -> None:
    try:
        sender.send(message)
    except (OSError, MemoryError):  # parent gone, or no memory left even for the message: the exit code speaks
        pass
