"""Unit tests of server/lifecycle.py: settings, the in-flight tracker, the ASGI middleware and the drain sequence."""

from __future__ import annotations

import argparse
import asyncio

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from server.lifecycle import (
    ENV_DRAIN_DELAY,
    ENV_DRAIN_TIMEOUT,
    FORCED_EXIT_CODE,
    DrainSettings,
    InflightTracker,
    Lifecycle,
    add_drain_arguments,
    drain_settings,
)


def test_settings_from_env_and_flags():
    assert DrainSettings.from_env({}) == DrainSettings(30.0, 0.0)
    env = {ENV_DRAIN_TIMEOUT: "45", ENV_DRAIN_DELAY: "5"}
    assert DrainSettings.from_env(env) == DrainSettings(45.0, 5.0)
    parser = argparse.ArgumentParser()
    add_drain_arguments(parser, env)
    assert drain_settings(parser.parse_args([])) == DrainSettings(45.0, 5.0)
    assert drain_settings(parser.parse_args(["--drain-timeout", "2", "--drain-delay", "9"])) == DrainSettings(2.0, 2.0)


@pytest.mark.parametrize("env", [{ENV_DRAIN_TIMEOUT: "soon"}, {ENV_DRAIN_DELAY: "-1"}])
def test_settings_reject_bad_values(env):
    with pytest.raises(ValueError):
        DrainSettings.from_env(env)


def test_tracker_counts_and_waits():
    async def scenario():
        tracker = InflightTracker()
        assert await tracker.wait_idle(0)
        with tracker.track(), tracker.track():
            assert tracker.count == 2
            assert not await tracker.wait_idle(0.01)
        assert tracker.count == 0

        async def hold(seconds):
            with tracker.track():
                await asyncio.sleep(seconds)

        task = asyncio.create_task(hold(0.05))
        await asyncio.sleep(0)
        assert tracker.count == 1
        assert await tracker.wait_idle(5)
        await task

    asyncio.run(scenario())


def _app(release: asyncio.Event) -> Starlette:
    async def ready(request):
        return PlainTextResponse("")

    async def slow(request):
        await release.wait()
        return PlainTextResponse("done")

    return Starlette(routes=[Route("/v2/health/ready", ready), Route("/slow", slow)])


def test_middleware_readiness_connection_close_and_drain():
    async def scenario():
        release = asyncio.Event()
        lifecycle = Lifecycle(DrainSettings(timeout_s=5))
        transport = httpx.ASGITransport(app=lifecycle.wrap_asgi(_app(release)))
        async with httpx.AsyncClient(transport=transport, base_url="http://kiln") as client:
            assert (await client.get("/v2/health/ready")).status_code == 200
            pending = asyncio.create_task(client.get("/slow"))
            for _ in range(100):
                if lifecycle.tracker.count == 1:
                    break
                await asyncio.sleep(0.01)
            assert lifecycle.tracker.count == 1

            stopped = []
            lifecycle.on_signal(lambda: stopped.append(True), exit_now=pytest.fail)
            assert stopped == [True] and lifecycle.draining
            ready = await client.get("/v2/health/ready")
            assert ready.status_code == 503 and ready.headers["connection"] == "close"

            drain = asyncio.create_task(lifecycle.shutdown([], []))
            await asyncio.sleep(0.05)
            assert not drain.done()  # still waiting for /slow
            release.set()
            response = await pending
            assert response.status_code == 200 and response.text == "done"
            assert response.headers["connection"] == "close"
            assert await drain is True

    asyncio.run(scenario())


class _FakeUvicorn:
    should_exit = False


class _FakeGrpc:
    def __init__(self):
        self.grace = None

    async def stop(self, grace):
        self.grace = grace


def test_shutdown_stops_listeners_and_times_out():
    async def scenario():
        lifecycle = Lifecycle(DrainSettings(timeout_s=0.2, delay_s=0.05))
        server, grpc_server = _FakeUvicorn(), _FakeGrpc()
        with lifecycle.tracker.track():  # a request that never finishes
            loop = asyncio.get_running_loop()
            started = loop.time()
            drained = await lifecycle.shutdown([server], [], grpc_server)
            elapsed = loop.time() - started
        assert drained is False
        assert server.should_exit
        assert 0 < grpc_server.grace <= 0.15 + 1e-3  # what the delay left of the budget
        assert 0.2 <= elapsed < 2.0

    asyncio.run(scenario())


def test_second_signal_exits_at_once():
    lifecycle = Lifecycle()
    stops, exits = [], []
    lifecycle.on_signal(lambda: stops.append(1), exit_now=exits.append)
    lifecycle.on_signal(lambda: stops.append(1), exit_now=exits.append)
    assert stops == [1] and exits == [FORCED_EXIT_CODE]
