"""SIGTERM on a real `python -m server` with HTTP and gRPC requests in flight: all succeed, the process exits 0."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from load_tests import harness
from tests.deploy.models import slow_expected, write_slow_repository
from tests.support.ports import free_ports

ROOT = Path(__file__).resolve().parents[2]
TRIP_COUNT = 15000  # ~0.5 s of compute per request (0.1 s per 3000 trips on the CI machine); 4 on 2 instances queue up
REQUESTS = 3
DRAIN_DELAY_S = 1.0
DRAIN_TIMEOUT_S = 60.0

pytestmark = pytest.mark.slow


def _infer_body(x: float, n: int) -> dict:
    return {"inputs": [{"name": "X", "shape": [1], "datatype": "FP32", "data": [x]},
                       {"name": "N", "shape": [1], "datatype": "INT64", "data": [n]}]}


def test_sigterm_drains_in_flight_requests(tmp_path: Path):
    repo = write_slow_repository(tmp_path / "models")
    http_port, grpc_port, metrics_port = free_ports(3)
    url = f"http://127.0.0.1:{http_port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KILN_DRAIN_TIMEOUT_S": str(DRAIN_TIMEOUT_S),
           "KILN_DRAIN_DELAY_S": str(DRAIN_DELAY_S)}
    log_path = tmp_path / "server.log"
    process = harness.start(harness.kiln_command(repo, [http_port, grpc_port, metrics_port]), log_path, env=env)
    try:
        harness.wait_ready(process, harness.http_ready(f"{url}/v2/health/ready"), log_path)
        results: list[object] = [None] * REQUESTS

        def call(i: int) -> None:
            try:
                results[i] = httpx.post(f"{url}/v2/models/slow/infer", json=_infer_body(float(i + 1), TRIP_COUNT),
                                        timeout=DRAIN_TIMEOUT_S)
            except httpx.HTTPError as e:
                results[i] = e

        def call_grpc(i: int) -> None:
            import tritonclient.grpc as grpcclient

            inputs = [grpcclient.InferInput("X", [1], "FP32"), grpcclient.InferInput("N", [1], "INT64")]
            inputs[0].set_data_from_numpy(np.array([float(i + 1)], np.float32))
            inputs[1].set_data_from_numpy(np.array([TRIP_COUNT], np.int64))
            try:
                with grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}") as client:
                    results[i] = client.infer("slow", inputs, client_timeout=DRAIN_TIMEOUT_S).as_numpy("Y")
            except Exception as e:  # any failure is what the test reports
                results[i] = e

        threads = [threading.Thread(target=call, args=(i,)) for i in range(REQUESTS)]
        threads.append(threading.Thread(target=call_grpc, args=(REQUESTS,)))
        results.append(None)
        for t in threads:
            t.start()
        time.sleep(0.2)  # let every request reach the server
        assert all(r is None for r in results), f"requests finished before SIGTERM (raise TRIP_COUNT): {results}"
        process.send_signal(signal.SIGTERM)

        time.sleep(DRAIN_DELAY_S / 4)
        # draining: not ready any more (load balancers move away), yet still alive
        try:
            ready = httpx.get(f"{url}/v2/health/ready", timeout=5).status_code
            live = httpx.get(f"{url}/v2/health/live", timeout=5).status_code
        except httpx.HTTPError as e:
            raise AssertionError(f"server gone during the drain delay: {e!r}\n{log_path.read_text()}") from e
        assert (ready, live) == (503, 200), log_path.read_text()

        for t in threads:
            t.join(DRAIN_TIMEOUT_S)
        http_results, grpc_result = results[:REQUESTS], results[REQUESTS]
        failures = [r for r in http_results if not isinstance(r, httpx.Response) or r.status_code != 200]
        failures += [] if isinstance(grpc_result, np.ndarray) else [grpc_result]
        assert failures == [], f"{failures}\n{log_path.read_text()}"
        outputs = [r.json()["outputs"][0]["data"][0] for r in http_results] + [float(grpc_result.reshape(-1)[0])]
        for i, value in enumerate(outputs):  # 15000 tanh steps: implementations differ in the last bits
            np.testing.assert_allclose(value, slow_expected(float(i + 1), TRIP_COUNT), rtol=1e-3)
        assert process.wait(timeout=DRAIN_TIMEOUT_S) == 0, log_path.read_text()
        with pytest.raises(httpx.ConnectError):  # listeners are gone
            httpx.get(f"{url}/v2/health/live", timeout=1)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
