"""Built plans kept on disk, so a restart (or a reload of an unchanged model) loads instead of rebuilding.

An entry's key is a sha256 over everything that decides the plan's bytes: the model's files (the ONNX file and
any external-data files beside it), the build configuration (backend, flags, optimization level, profiles),
the target (backend and GPU architecture) and the Kiln and plan-format versions. Entries are written to a
temporary file, fsync'ed and renamed into place, so a reader never sees half a plan: a server killed while
writing leaves only a temporary file (removed by a later start once it is an hour old), never an entry. A
corrupt or stale entry fails the plan's own checks (PlanFormatError), is removed, and the model is rebuilt and
stored again. Builds run in child processes (server/core/build_process.py) that never touch the cache: the
server stores a plan only once the child has handed all of it over.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import engine_core as kiln
from engine_core.builder import build_environment
from engine_core.version import PLAN_FORMAT_VERSION

log = logging.getLogger("kiln.server")

PLAN_SUFFIX = ".plan"
TEMPORARY_SUFFIX = ".tmp"
#: Temporary files older than this are leftovers of a killed writer (a write takes seconds at most).
STALE_TEMPORARY_S = 3600.0


def default_directory() -> Path:
    """`$KILN_CACHE_DIR/plans`, else `~/.cache/kiln/plans`."""
    base = os.environ.get("KILN_CACHE_DIR")
    return (Path(base) if base else Path.home() / ".cache" / "kiln") / "plans"


def target_arch(backend: str) -> str:
    """What the plan's code is compiled for: "cpu", or the GPU's "sm_XY" for the cuda backend."""
    if backend != "cuda":
        return backend
    from engine_core.cuda.driver import compute_capability

    major, minor = compute_capability()
    return f"sm_{major}{minor}"


def files_digest(directory: Path) -> str:
    """sha256 over a model version directory's files (relative path + content), in path order."""
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(directory)).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def build_description(config: kiln.BuilderConfig) -> dict[str, Any]:
    """The parts of a builder config that change the plan: backend, flags, level, profiles (min/opt/max), and the
    build switches set in the environment (``KILN_INT8_GEMM=0`` and the like: a restart with another setting
    must not load a plan built under the old one)."""
    profiles = [{name: [list(s) for s in triple] for name, triple in sorted(profile.shapes.items())}
                for profile in config.profiles]
    shape_inputs = [{name: [list(s) for s in triple] for name, triple in sorted(profile.shape_values.items())}
                    for profile in config.profiles]
    description = {"backend": config.backend, "flags": plan_flags(config), "level": config.builder_optimization_level,
                   "profiles": profiles, "shape_inputs": shape_inputs}
    environment = build_environment(config)
    return description | ({"environment": environment} if environment else {})  # unset: the keys of before


def plan_flags(config: kiln.BuilderConfig) -> int:
    """The config's flags as far as they change the plan. TF32 changes nothing on the CPU backend (numpy computes
    fp32 exactly), so it is left out there: CPU plans cached before TF32 became the default keep their keys;
    on CUDA it changes every fp32 GEMM and convolution, so it stays in."""
    flags = int(config.flags)
    if config.backend == "cpu":
        flags &= ~(1 << int(kiln.BuilderFlag.TF32))
    return flags


def cache_key(model_digest: str, description: dict[str, Any], arch: str, model_file: str = "model.onnx") -> str:
    """`model_digest` covers the whole version directory, so the file that is built (`default_model_filename`)
    is part of the key too: two ONNX files in one directory never share a plan."""
    parts = {"model": model_digest, "file": model_file, "build": description, "arch": arch,
             "kiln": kiln.__version__, "plan_format": PLAN_FORMAT_VERSION}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def write_atomically(target: Path, data: bytes, prefix: str) -> None:
    """`data` at `target` without a reader ever seeing half a file: a temporary file in the same directory (named
    `.<prefix>-...TEMPORARY_SUFFIX`, which PlanCache removes when stale), synced, then renamed into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{prefix}-", suffix=TEMPORARY_SUFFIX, dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


@dataclass
class CachedBuild:
    """A loaded engine and how it was obtained: "cache hit", "built", or "rebuilt (...)" with the reason;
    `build_s`: seconds the build took (0.0 for a cache hit)."""

    engine: kiln.CudaEngine
    origin: str
    build_s: float = 0.0


class PlanCache:
    """A directory of plan files named by key. `directory=None` disables caching (always build)."""

    def __init__(self, directory: str | Path | None) -> None:
        self.directory = Path(directory).expanduser() if directory else None
        #: loads answered from the cache / built (with the cache disabled every load is a miss), by model name;
        #: read by /metrics as kiln_plan_cache_hits_total / kiln_plan_cache_misses_total
        self.hits: Counter[str] = Counter()
        self.misses: Counter[str] = Counter()
        self._lock = threading.Lock()
        self.remove_stale_temporaries()

    def remove_stale_temporaries(self, older_than_s: float = STALE_TEMPORARY_S) -> int:
        """Delete temporary files a killed writer left behind (never read as entries, but they take space).
        Only old ones: another server sharing the directory may be writing a fresh one right now."""
        if self.directory is None or not self.directory.is_dir():
            return 0
        removed, cutoff = 0, time.time() - older_than_s
        for path in self.directory.glob(f"*/.*{TEMPORARY_SUFFIX}"):
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink()
                    removed += 1
            except OSError:  # gone already, or not ours to delete: harmless either way
                continue
        if removed:
            log.info("plan cache: removed %d temporary file(s) left by interrupted writes", removed)
        return removed

    def path(self, key: str) -> Path:
        assert self.directory is not None
        return self.directory / key[:2] / f"{key}{PLAN_SUFFIX}"

    def read(self, key: str) -> bytes | None:
        if self.directory is None:
            return None
        try:
            return self.path(key).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:  # unreadable entry (permissions, a directory in its place): build instead
            log.warning("plan cache entry %s cannot be read (%s); building", self.path(key), e)
            return None

    def write(self, key: str, plan: bytes) -> None:
        """Atomically store `plan` (`write_atomically`)."""
        if self.directory is not None:
            write_atomically(self.path(key), plan, key[:16])

    def remove(self, key: str) -> None:
        if self.directory is not None:
            self.path(key).unlink(missing_ok=True)

    def lookups(self) -> tuple[dict[str, int], dict[str, int]]:
        """(hits, misses) by model name, copies."""
        with self._lock:
            return dict(self.hits), dict(self.misses)

    def _count(self, counter: Counter[str], model: str | None) -> None:
        if model is not None:
            with self._lock:
                counter[model] += 1

    def load_or_build(self, key: str, build: Callable[[], bytes], label: str,
                      model: str | None = None, describe: bool = False) -> CachedBuild:
        """The engine for `key`: from the cache when a valid entry exists, else built (and stored). `model`
        names the model a hit or miss is counted for (none: not counted). `describe`: the engine's description
        only (`Runtime.describe`), for a plan another process runs."""
        runtime = kiln.Runtime()
        load = runtime.describe if describe else runtime.load
        origin = "built"
        data = self.read(key)
        if data is not None:
            try:
                engine = load(data)
                log.info("%s: plan cache hit (%s), no rebuild", label, self.path(key))
                self._count(self.hits, model)
                return CachedBuild(engine, "cache hit")
            except kiln.PlanFormatError as e:
                log.warning("%s: plan cache entry %s is unusable (%s); rebuilding", label, self.path(key), e)
                self.remove(key)
                origin = f"rebuilt (cache entry unusable: {e})"
        self._count(self.misses, model)
        started = time.perf_counter()
        plan = build()
        build_s = time.perf_counter() - started
        engine = load(plan)
        try:
            self.write(key, plan)
        except OSError as e:  # a full or read-only cache must not stop the model from loading
            log.warning("%s: cannot write plan cache entry %s: %s", label, self.path(key), e)
        else:
            if self.directory is not None:
                log.info("%s: plan %s, stored in the plan cache (%s)", label, origin, self.path(key))
        return CachedBuild(engine, origin, build_s)


_default: PlanCache | None = None


def configure(directory: str | Path | None) -> PlanCache:
    """Set the server's plan cache (`--plan-cache-dir`; "" disables it). None means the default directory."""
    global _default
    _default = PlanCache(default_directory() if directory is None else (directory or None))
    return _default


def server_lookups() -> tuple[dict[str, int], dict[str, int]]:
    """The server's plan cache (hits, misses) by model; empty before any model was built through it."""
    return _default.lookups() if _default is not None else ({}, {})


def server_cache() -> PlanCache:
    """The plan cache models are built through; the default directory until `configure` says otherwise."""
    return _default if _default is not None else configure(None)
