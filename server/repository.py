"""The model repository on disk (Triton layout): `<repo>/<model>/config.pbtxt` + `<repo>/<model>/<version>/model.onnx`.

This module only finds files; what a config means and how a model is built lives in `server/core`.
Uploaded models (a load request with `file:` contents) are written to a private staging directory with the
same layout, so they load through the same path as models on disk.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

CONFIG_FILENAME = "config.pbtxt"


def _errors():
    """server.core.errors, imported on use: server.core imports this module, so importing it at the top would
    make `import server.repository` fail unless server.core happened to be imported first."""
    from server.core import errors

    return errors

log = logging.getLogger("kiln.server")


@dataclass(frozen=True)
class ModelSource:
    """Where one model's files are: its directory, its config text (None if absent) and its version dirs."""

    name: str
    directory: Path
    config_text: str | None
    versions: dict[int, Path]

    def model_file(self, version: int, filename: str, field: str = "default_model_filename") -> Path:
        """``filename`` (what the config's ``field`` names) in the version directory. The name must stay inside it
        as written (relative, no '..'): a config sent with a load request cannot point the server at other files.
        Symbolic links the repository's owner made are followed, as Triton does (a version directory linked to
        a model store elsewhere)."""
        return self.versions[version] / _safe_relative(
            filename, f"model '{self.name}' version {version}: {field} '{filename}'")


class ModelRepository:
    """One or more repository directories, searched in order; a model name must be unique across them."""

    def __init__(self, paths: Sequence[str | Path]) -> None:
        self.paths = [Path(p).resolve() for p in paths]
        for path in self.paths:
            if not path.is_dir():
                raise FileNotFoundError(f"model repository '{path}' is not a directory")
        self._staging = Path(tempfile.mkdtemp(prefix="kiln-uploads-"))

    def names(self) -> list[str]:
        """Model names: every non-hidden subdirectory of every repository path."""
        names: set[str] = set()
        for path in self.paths:
            names.update(p.name for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
        return sorted(names)

    def _directory(self, name: str) -> Path:
        found = [path / name for path in self.paths if (path / name).is_dir()]
        if not found:
            raise _errors().not_found(f"model '{name}' is not in the model repository")
        if len(found) > 1:
            raise _errors().invalid(f"model '{name}' is in more than one repository: {[str(p) for p in found]}")
        return found[0]

    def source(self, name: str) -> ModelSource:
        """The files of model `name`; NOT_FOUND if no repository has it."""
        _check_name(name)
        return read_source(name, self._directory(name))

    def stage_upload(self, name: str, files: dict[str, bytes]) -> ModelSource:
        """Write uploaded files (paths relative to the model directory, e.g. "1/model.onnx") and read them back.

        The upload replaces the model's files entirely, as in Triton: nothing from the repository is mixed in.
        """
        _check_name(name)
        directory = self._staging / name
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        for relative, content in files.items():
            target = directory / _safe_relative(relative)
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(content)
            except OSError as e:  # a name the file system refuses (too long, reserved): the client's upload
                raise _errors().invalid(f"uploaded file '{relative}' cannot be written: "
                                        f"{e.strerror or type(e).__name__}") from None
        return read_source(name, directory)

    def close(self) -> None:
        shutil.rmtree(self._staging, ignore_errors=True)

    def fingerprints(self) -> dict[str, str]:
        """Per model name, a digest of its files' paths, sizes and modification times: changes when any
        file is added, removed, rewritten or touched. Models in more than one repository get the joined digest."""
        return {name: digest for name, (digest, _) in self.scan().items()}

    def scan(self) -> dict[str, tuple[str, float]]:
        """Per model name: its fingerprint and the newest modification time (seconds) among its files."""
        prints: dict[str, list[tuple[str, float]]] = {}
        for path in self.paths:
            for directory in sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".")):
                prints.setdefault(directory.name, []).append(_directory_scan(directory))
        return {name: ("+".join(d for d, _ in parts), max(m for _, m in parts)) for name, parts in prints.items()}


def directory_fingerprint(directory: Path) -> str:
    return _directory_scan(directory)[0]


def _directory_scan(directory: Path) -> tuple[str, float]:
    digest = hashlib.sha256()
    newest = 0.0
    for path in sorted(directory.rglob("*")):
        try:
            stat = path.stat()
        except FileNotFoundError:  # removed while we looked: the next poll sees the result
            continue
        if path.is_file():
            digest.update(f"{path.relative_to(directory)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
            newest = max(newest, stat.st_mtime)
    return digest.hexdigest(), newest


#: A model whose files changed less than this long ago is still being copied: it loads on the next scan.
QUIET_S = 0.25
_watch_enabled = True


#: `--model-config-name`: a model's configs/<name>.pbtxt is read in place of its config.pbtxt ("" = none)
_config_name = ""


def configure_config_name(name: str) -> None:
    """`--model-config-name NAME` (Triton's custom model configurations); ValueError for a name with a space or
    a path separator."""
    global _config_name
    if any(c.isspace() or c in "/\\" for c in name) or name in (".", ".."):
        raise ValueError(f"--model-config-name '{name}': a name without spaces or path separators, e.g. h100")
    _config_name = name


def configure_watch(enabled: bool) -> None:
    """`--repository-watch`: follow poll-mode repositories by file-system events (watchfiles) when installed."""
    global _watch_enabled
    _watch_enabled = enabled


def _awatch():
    """watchfiles' `awatch`, or None when the package is not installed (then poll mode polls)."""
    try:
        from watchfiles import awatch
    except ImportError:
        return None
    return awatch


class RepositoryPoller:
    """Poll mode: compare the repository with the last scan and load models that were added or changed,
    unload models that were removed. Scans run on file-system events (watchfiles, when installed: a model
    copied in loads within a second) and every `interval_s` regardless (events can be missed, e.g. on network
    file systems); without watchfiles, only every `interval_s`. A model whose files are still changing
    (newest file under QUIET_S old) waits for the next scan, so a copy in progress is not loaded half-written.
    A failed load leaves the loaded versions serving (the load path guarantees that); it is retried when the
    model's files change again."""

    def __init__(self, repository: ModelRepository, interval_s: float,
                 load: Callable[[str], Awaitable[None]], unload: Callable[[str], Awaitable[None]]) -> None:
        if interval_s <= 0:
            raise ValueError(f"--repository-poll-secs must be positive, got {interval_s}")
        self.repository = repository
        self.interval_s = interval_s
        self._load = load
        self._unload = unload
        self._known: dict[str, str] = {}
        self.pending: list[str] = []  # models seen changing in the last scan, still being written

    def baseline(self) -> None:
        """Remember the repository as it is now (before the startup loads begin)."""
        self._known = self.repository.fingerprints()

    async def poll_once(self) -> tuple[list[str], list[str]]:
        """One scan: returns (models loaded or reloaded, models unloaded)."""
        scanned = await asyncio.to_thread(self.repository.scan)
        settling = time.time() - QUIET_S
        previous = self._known
        current = {name: digest for name, (digest, _) in scanned.items()}
        changed = sorted(name for name, digest in current.items() if previous.get(name) != digest)
        self.pending = [name for name in changed if scanned[name][1] > settling]
        for name in self.pending:  # still being written: keep the old fingerprint so the next scan retries
            if name in previous:
                current[name] = previous[name]
            else:
                del current[name]
        changed = [name for name in changed if name not in self.pending]
        self._known = current
        removed = sorted(set(previous) - set(current) - set(self.pending))
        for name in changed:
            log.info("poll: model '%s' %s in the repository; loading", name,
                     "changed" if name in previous else "appeared")
        for name in removed:
            log.info("poll: model '%s' was removed from the repository; unloading", name)
        await asyncio.gather(*(self._load(name) for name in changed), *(self._unload(name) for name in removed))
        return changed, removed

    async def run(self) -> None:
        """Follow the repository until cancelled (watch or poll, see the class)."""
        awatch = _awatch() if _watch_enabled else None
        if awatch is None:
            log.info("poll mode: scanning the repository every %s s%s", self.interval_s,
                     "" if not _watch_enabled else " (install watchfiles to follow it by file-system events)")
            await self._poll_forever()
        else:
            await self._watch_forever(awatch)

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(QUIET_S if self.pending else self.interval_s)
            await self._scan()

    async def _watch_forever(self, awatch) -> None:
        log.info("poll mode: watching %s for changes (and scanning every %s s)",
                 ", ".join(str(p) for p in self.repository.paths), self.interval_s)
        async for _ in awatch(*self.repository.paths, watch_filter=None, debounce=400, step=50,
                              rust_timeout=int(self.interval_s * 1000), yield_on_timeout=True):
            await self._scan()
            while self.pending:  # a copy in progress: look again once it has been quiet for a moment
                await asyncio.sleep(QUIET_S)
                await self._scan()

    async def _scan(self) -> None:
        """One poll_once; a scan that fails (a directory vanishing mid-scan) is logged, the next one retries."""
        try:
            await self.poll_once()
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the poller must outlive any one bad scan
            log.exception("repository scan failed; retrying at the next change or in %s s", self.interval_s)


def read_source(name: str, directory: Path) -> ModelSource:
    """Read a model directory: its config.pbtxt (if any; configs/<name>.pbtxt in its place where
    `--model-config-name` names one the model has) and its numeric version subdirectories."""
    custom = directory / "configs" / f"{_config_name}.pbtxt"
    config_path = custom if _config_name and custom.is_file() else directory / CONFIG_FILENAME
    config_text = config_path.read_text() if config_path.is_file() else None
    versions = {int(p.name): p for p in directory.iterdir() if p.is_dir() and p.name.isdigit() and int(p.name) > 0}
    return ModelSource(name, directory, config_text, versions)


def select_versions(policy, available: list[int]) -> list[int]:
    """Versions to serve under a `ModelVersionPolicy`: latest N (default 1), all, or specific ones."""
    available = sorted(available)
    which = policy.WhichOneof("policy_choice")
    if which == "all":
        return available
    if which == "specific":
        wanted = sorted(set(policy.specific.versions))
        missing = [v for v in wanted if v not in available]
        if missing:
            raise _errors().invalid(f"version policy asks for versions {missing}, which are not in the repository "
                          f"(available: {available})")
        return wanted
    count = policy.latest.num_versions if which == "latest" else 1
    return available[-max(count, 1):]


def check_upload(name: str, files: dict[str, bytes]) -> None:
    """Refuse an upload with a bad model name or a path that leaves the model directory, before anything loads."""
    _check_name(name)
    for relative in files:
        _safe_relative(relative)


def _check_name(name: str) -> None:
    if not name or name in {".", ".."} or "/" in name or "\\" in name:
        raise _errors().invalid(f"invalid model name '{name}'")


def _safe_relative(relative: str, what: str = "") -> PurePosixPath:
    """A relative path that stays inside its directory as written; anything else is refused (``what`` names it)."""
    path = PurePosixPath(relative)
    if not relative or path.is_absolute() or ".." in path.parts or "\\" in relative:
        raise _errors().invalid(f"{what or f'uploaded file path {relative!r}'} must be relative to its directory, "
                                f"without '..'")
    return path
