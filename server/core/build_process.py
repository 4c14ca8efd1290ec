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

The same machinery reads a model file's graph inputs and outputs for the server (`run_bounded`, used by
server/core/model_description.py), so the server process never parses an ONNX file itself. A child answers in
bytes only (a JSON header, then the payload): the parent unpickles nothing a child that parsed a hostile file sends.

Processes: CPU builds fork from a forkserver that imported the engine once (fast: tens of ms per build, not an
interpreter start). CUDA builds use `spawn`: a fresh interpreter, so no CUDA state is ever inherited.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
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
_PRELOAD = ["server.core.build_process", "server.core.model_description"]
#: CPU builds and model-file reads are background work: the forkserver (and so every child it forks) runs at this
#: niceness, so the serving process wins any contention for a core (a model rebuilt or refitted under load, the
#: forkserver's engine import still running when a model whose plan was cached is ready). CUDA builds (spawned) keep
#: the server's priority: their tactic timing must not stretch with CPU starvation.
BUILD_NICENESS = 10
#: The most a child's header (kind + message) may take; longer error texts are cut in the child.
_HEADER_MAX_BYTES = 1 << 20
_MESSAGE_MAX_CHARS = 64 << 10


class TaskFailed(kiln.BuildError):
    """The child's own error: the model's build error, or why its file cannot be read; not a limit it ran into."""


@dataclass(frozen=True)
class Task:
    """How messages name one kind of child work: "the build ran past its time limit", "the build process ..."."""

    what: str
    process: str


BUILD = Task("the build", "the build process")
READ = Task("reading the model file", "the process reading the model file")


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
    _lower_forkserver()


def _lower_forkserver() -> None:
    """The forkserver at BUILD_NICENESS (its children inherit it), once it runs."""
    from multiprocessing import forkserver

    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if pid:
        _lower_priority(pid)


def _lower_priority(pid: int) -> None:
    """Process `pid` at BUILD_NICENESS unless it is lower already; never an error (a niceness is a preference)."""
    try:
        if os.getpriority(os.PRIO_PROCESS, pid) < BUILD_NICENESS:
            os.setpriority(os.PRIO_PROCESS, pid, BUILD_NICENESS)
    except OSError:
        pass


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
    return run_bounded(parse_and_build, (str(model_path), config), f"kiln-build {label}", BUILD,
                       backend=config.backend, limits=limits, plugins=plugin_modules())


def run_bounded(target: Callable[..., bytes], args: tuple, name: str, task: Task, *, backend: str = "cpu",
                limits: BuildLimits | None = None, plugins: Sequence[str] = (),
                max_result_bytes: int | None = None) -> bytes:
    """`target(*args)` (a module-level function returning bytes) in a child process under `limits`: its bytes,
    TaskFailed with the message of the KilnError it raised, or BuildError naming the limit it ran into or how it
    ended. `backend` "cpu" forks from the forkserver (RLIMIT_AS bounds it), anything else spawns a fresh
    interpreter (resident-memory watchdog only). Blocking: call from a worker thread."""
    limits = limits or current_limits()
    context = _context(backend)
    receiver, sender = context.Pipe(duplex=False)
    # RLIMIT_AS breaks CUDA (the driver reserves address space far beyond what it uses): watchdog only.
    address_limit = limits.memory_bytes if backend == "cpu" else None
    cpu_limit = int(limits.timeout_s) + 30 if limits.timeout_s else None
    process = context.Process(target=_child_main, args=(sender, target, args, task.what, address_limit, cpu_limit,
                                                        list(plugins)),
                              name=name, daemon=True)
    with _active_lock:
        if _stopping:
            raise kiln.BuildError(f"the server is shutting down; {task.what} was not started")
        process.start()
        _active.add(process)
    if backend == "cpu":
        _lower_forkserver()  # started by this build if warm_up did not run
    sender.close()
    try:
        return _collect(process, receiver, limits, task, max_result_bytes)
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


def _collect(process: multiprocessing.process.BaseProcess, receiver: Connection, limits: BuildLimits, task: Task,
             max_result_bytes: int | None) -> bytes:
    """Wait for the child's answer, enforcing the time and resident-memory limits."""
    deadline = time.monotonic() + limits.timeout_s if limits.timeout_s else None
    while True:
        ready = wait([receiver, process.sentinel], timeout=_WATCH_INTERVAL_S)
        if receiver in ready:
            try:
                return _receive(receiver, limits, task, max_result_bytes)
            except EOFError:  # the child ended without a word: its exit status says how
                break
        elif ready:  # exited; read whatever it sent before it went
            if receiver.poll(0):
                continue
            break
        if deadline is not None and time.monotonic() > deadline:
            process.kill()
            raise kiln.BuildError(f"{task.what} ran past its time limit of {limits.timeout_s:g} s "
                                  f"(--build-timeout-secs) and was stopped")
        rss = _resident_bytes(process.pid)
        if limits.memory_bytes is not None and rss is not None and rss > limits.memory_bytes:
            process.kill()
            raise kiln.BuildError(f"{task.what} used {format_size(rss)} of memory, over its limit of "
                                  f"{format_size(limits.memory_bytes)} (--build-memory-limit), and was stopped")
    process.join(timeout=5)
    raise kiln.BuildError(_exit_reason(process.exitcode, limits, task))


def _receive(receiver: Connection, limits: BuildLimits, task: Task, max_result_bytes: int | None) -> bytes:
    """The child's answer: a JSON header [kind, message], and for "ok" the payload. Bytes and JSON only."""
    try:
        kind, message = json.loads(receiver.recv_bytes(_HEADER_MAX_BYTES))
        kind, message = str(kind), str(message)
    except (ValueError, TypeError, OSError) as e:  # OSError: longer than the header may be
        raise kiln.BuildError(f"{task.process} sent an unreadable answer ({e})") from None
    if kind == "ok":
        try:
            return receiver.recv_bytes(max_result_bytes)
        except OSError as e:  # "bad message length": more than max_result_bytes
            raise kiln.BuildError(f"{task.process} sent back more than {format_size(max_result_bytes or 0)} "
                                  f"({e})") from None
    if kind == "memory":
        limit = format_size(limits.memory_bytes) if limits.memory_bytes else "this machine's memory"
        raise kiln.BuildError(f"{task.what} ran out of memory: it needs more than its limit of {limit} "
                              f"(--build-memory-limit){': ' + message if message else ''}")
    raise TaskFailed(message)


def _exit_reason(code: int | None, limits: BuildLimits, task: Task) -> str:
    if _stopping:
        return f"{task.what} was stopped: the server is shutting down"
    if code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        hint = ""
        if name in ("SIGKILL", "SIGABRT", "SIGSEGV") and limits.memory_bytes:
            hint = (f" (a child process that reaches its memory limit of {format_size(limits.memory_bytes)} "
                    f"ends this way; --build-memory-limit)")
        elif name == "SIGXCPU":
            hint = " (it used more CPU time than its limit)"
        return f"{task.process} was killed by {name}{hint}"
    return f"{task.process} exited with status {code} without a result"


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


def _child_main(sender: Connection, target: Callable[..., bytes], args: tuple, what: str,
                address_limit: int | None, cpu_limit: int | None, plugins: Sequence[str] = ()) -> None:
    """Entry of a child: set its limits, run `target`, send ("ok", size) + bytes or (kind, message)."""
    import importlib

    for module in plugins:
        importlib.import_module(module)
    if address_limit is not None:
        _lower_limit(resource.RLIMIT_AS, address_limit, address_limit)
    if cpu_limit is not None:
        _lower_limit(resource.RLIMIT_CPU, cpu_limit, cpu_limit + 5)
    try:
        result = target(*args)
    except MemoryError as e:
        _send(sender, "memory", str(e))
    except kiln.KilnError as e:
        _send(sender, "error", str(e))
    except RecursionError:
        _send(sender, "error", "the model nests too deeply to import (recursion limit reached)")
    except Exception as e:  # noqa: BLE001 - whatever a hostile model provokes becomes the load's reason
        log.exception("%s of %s failed unexpectedly", what, args[:1])
        _send(sender, "error", f"{what} failed: {type(e).__name__}: {e}")
    else:
        if _send(sender, "ok", len(result)):
            try:
                sender.send_bytes(result)
            except OSError:  # parent gone
                pass
    sender.close()


def _lower_limit(kind: int, soft: int, hard: int) -> None:
    """Set a resource limit, never above the hard limit the server itself runs under (raising it is refused)."""
    _, current = resource.getrlimit(kind)
    if current != resource.RLIM_INFINITY:
        soft, hard = min(soft, current), min(hard, current)
    resource.setrlimit(kind, (soft, hard))


def _send(sender: Connection, kind: str, message: object) -> bool:
    """The header, as JSON bytes; False when it could not be sent."""
    text = message[:_MESSAGE_MAX_CHARS] if isinstance(message, str) else message
    try:
        sender.send_bytes(json.dumps([kind, text]).encode())
    except (OSError, MemoryError):  # parent gone, or no memory left even for the message: the exit code speaks
        return False
    return True
