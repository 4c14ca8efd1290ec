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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from server.core.errors import invalid, not_found

CONFIG_FILENAME = "config.pbtxt"

log = logging.getLogger("kiln.server")


@dataclass(frozen=True)
class ModelSource:
    """Where one model's files are: its directory, its config text (None if absent) and its version dirs."""

    name: str
    directory: Path
    config_text: str | None
    versions: dict[int, Path]

    def model_file(self, version: int, filename: str) -> Path:
        return self.versions[version] / filename


class ModelRepository:
    """One or more repository directories, searched in order; a model name must be unique across them."""

    def __init__(self, paths: list[str | Path]) -> None:
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
            raise not_found(f"model '{name}' is not in the model repository")
        if len(found) > 1:
            raise invalid(f"model '{name}' is in more than one repository: {[str(p) for p in found]}")
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
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
        return read_source(name, directory)

    def close(self) -> None:
        shutil.rmtree(self._staging, ignore_errors=True)

    def fingerprints(self) -> dict[str, str]:
        """Per model name, a digest of its files' paths, sizes and modification times: changes when any
        file is added, removed, rewritten or touched. Models in more than one repository get the joined digest."""
        prints: dict[str, list[str]] = {}
        for path in self.paths:
            for directory in sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".")):
                prints.setdefault(directory.name, []).append(directory_fingerprint(directory))
        return {name: "+".join(parts) for name, parts in prints.items()}


def directory_fingerprint(directory: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(directory.rglob("*")):
        try:
            stat = path.stat()
        except FileNotFoundError:  # removed while we looked: the next poll sees the result
            continue
        if path.is_file():
            digest.update(f"{path.relative_to(directory)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


class RepositoryPoller:
    """Poll mode: every `interval_s`, compare the repository with the last scan and load models that were
    added or changed, unload models that were removed. A failed load leaves the loaded versions serving (the
    load path guarantees that); it is retried when the model's files change again."""

    def __init__(self, repository: ModelRepository, interval_s: float,
                 load: Callable[[str], Awaitable[None]], unload: Callable[[str], Awaitable[None]]) -> None:
        if interval_s <= 0:
            raise ValueError(f"--repository-poll-secs must be positive, got {interval_s}")
        self.repository = repository
        self.interval_s = interval_s
        self._load = load
        self._unload = unload
        self._known: dict[str, str] = {}

    def baseline(self) -> None:
        """Remember the repository as it is now (before the startup loads begin)."""
        self._known = self.repository.fingerprints()

    async def poll_once(self) -> tuple[list[str], list[str]]:
        """One scan: returns (models loaded or reloaded, models unloaded)."""
        current = await asyncio.to_thread(self.repository.fingerprints)
        previous, self._known = self._known, current
        changed = sorted(name for name, digest in current.items() if previous.get(name) != digest)
        removed = sorted(set(previous) - set(current))
        for name in changed:
            log.info("poll: model '%s' %s in the repository; loading", name,
                     "changed" if name in previous else "appeared")
        for name in removed:
            log.info("poll: model '%s' was removed from the repository; unloading", name)
        await asyncio.gather(*(self._load(name) for name in changed), *(self._unload(name) for name in removed))
        return changed, removed

    async def run(self) -> None:
        """Poll until cancelled; a scan that fails (a directory vanishing mid-scan) is logged and retried."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.poll_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the poller must outlive any one bad scan
                log.exception("repository poll failed; retrying in %s s", self.interval_s)


def read_source(name: str, directory: Path) -> ModelSource:
    """Read a model directory: its config.pbtxt (if any) and its numeric version subdirectories."""
    config_path = directory / CONFIG_FILENAME
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
            raise invalid(f"version policy asks for versions {missing}, which are not in the repository "
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
        raise invalid(f"invalid model name '{name}'")


def _safe_relative(relative: str) -> PurePosixPath:
    """A relative path that stays inside the model directory; anything else is refused."""
    path = PurePosixPath(relative)
    if not relative or path.is_absolute() or ".." in path.parts or "\\" in relative:
        raise invalid(f"uploaded file path '{relative}' must be relative to the model directory, without '..'")
    return path
