"""Poll mode follows the repository by file-system events (watchfiles), falls back to polling without them,
and never loads a model whose files are still being copied."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

import numpy as np
import tritonclient.http as http

from server import repository as repo_module
from server.repository import QUIET_S, ModelRepository, RepositoryPoller
from tests.server.conftest import examples
from tests.server.test_repository_modes import CONFIG, infer, scale_model, start_server, stop_server, wait_for


def _copy_in(tmp_path: Path, repository: Path, name: str, factor: float) -> None:
    """Write the model elsewhere, then copy it into the repository as a user would (`cp -r`)."""
    staging = tmp_path / "incoming"
    examples.write_model(staging, name, scale_model(factor), CONFIG)
    shutil.copytree(staging / name, repository / name)


def _serve_poll_mode(tmp_path: Path, *flags: str):
    repository = tmp_path / "models"
    examples.write_model(repository, "first", scale_model(1.0), CONFIG)
    server = start_server(repository, tmp_path / "server.log", "--model-control-mode", "poll",
                          "--plan-cache-dir", str(tmp_path / "plans"), *flags)
    return repository, server


def test_a_model_copied_in_loads_on_the_file_event_not_the_poll_interval(tmp_path: Path):
    if repo_module._awatch() is None:
        import pytest

        pytest.skip("watchfiles is not installed: poll mode polls (see the fallback test)")
    # a one-hour poll interval: only a file-system event can make the model appear during this test
    repository, server = _serve_poll_mode(tmp_path, "--repository-poll-secs", "3600")
    client = http.InferenceServerClient(server.http_url)
    try:
        assert "watching" in server.log()
        _copy_in(tmp_path, repository, "copied", 4.0)
        wait_for(lambda: client.is_model_ready("copied"), timeout_s=15, what="the copied model (watch)")
        x = np.arange(4, dtype=np.float32)[None]
        np.testing.assert_array_equal(infer(server.http_url, "copied", x)[0], x * 4)
        shutil.rmtree(repository / "copied")
        wait_for(lambda: not client.is_model_ready("copied"), timeout_s=15, what="the removed model to unload")
    finally:
        stop_server(server)


def test_without_watching_poll_mode_polls(tmp_path: Path):
    repository, server = _serve_poll_mode(tmp_path, "--repository-watch", "false", "--repository-poll-secs", "0.3")
    client = http.InferenceServerClient(server.http_url)
    try:
        assert "scanning the repository every 0.3 s" in server.log()
        _copy_in(tmp_path, repository, "copied", 6.0)
        wait_for(lambda: client.is_model_ready("copied"), timeout_s=15, what="the copied model (poll)")
        x = np.ones((2, 4), np.float32)
        np.testing.assert_array_equal(infer(server.http_url, "copied", x)[0], x * 6)
    finally:
        stop_server(server)


def test_a_model_still_being_written_waits_for_the_next_scan(tmp_path: Path):
    """Files modified within QUIET_S are a copy in progress: no load yet; a scan after it settles loads it."""
    root = tmp_path / "models"
    root.mkdir()
    repository = ModelRepository([root])
    loaded: list[str] = []

    async def load(name: str) -> None:
        loaded.append(name)

    async def unload(name: str) -> None:
        raise AssertionError(f"nothing was removed, yet '{name}' was unloaded")

    poller = RepositoryPoller(repository, 60.0, load, unload)
    poller.baseline()
    examples.write_model(root, "arriving", scale_model(2.0), CONFIG)
    changed, removed = asyncio.run(poller.poll_once())
    assert (changed, removed, poller.pending) == ([], [], ["arriving"])
    time.sleep(QUIET_S + 0.05)
    changed, removed = asyncio.run(poller.poll_once())
    assert (changed, removed, poller.pending, loaded) == (["arriving"], [], [], ["arriving"])
    old = time.time() - 10  # files that settled long ago and did not change: nothing to do
    for path in (root / "arriving").rglob("*"):
        os.utime(path, (old, old))
    asyncio.run(poller.poll_once())  # the touch is a change: one reload
    assert asyncio.run(poller.poll_once()) == ([], []) and loaded == ["arriving", "arriving"]
    repository.close()
