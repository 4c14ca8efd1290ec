"""Overload: past `--max-inflight-requests` requests are refused at once (429 / RESOURCE_EXHAUSTED) while the
admitted ones all succeed and health stays answerable; a client that disconnects takes its queued work with it."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import numpy as np
import pytest

from server.core.limits import InflightLimiter, RequestLimits
from server.protos import grpc_service_pb2 as pb
from server.protos import grpc_service_pb2_grpc

from .conftest import MAX_INFLIGHT, SLOW_SIZE, assert_error, slow_body

SLOW = "/v2/models/slow/infer"
EXPECTED = None  # the slow model's answer, fetched once


def _expected(http: httpx.Client) -> float:
    global EXPECTED
    if EXPECTED is None:
        response = http.post(SLOW, json=slow_body())
        assert response.status_code == 200, response.text
        EXPECTED = response.json()["outputs"][0]["data"][0]
    return EXPECTED


def _executions(http: httpx.Client) -> int:
    stats = http.get("/v2/models/slow/stats").json()["model_stats"][0]
    return int(stats["execution_count"])


def test_http_overload_is_429_and_admitted_requests_succeed(guarded_server, http):
    expected = _expected(http)
    sent = 4 * MAX_INFLIGHT
    barrier = threading.Barrier(sent)

    def one(_: int) -> httpx.Response:
        with httpx.Client(base_url=guarded_server.base_url, timeout=60) as client:
            barrier.wait()
            return client.post(SLOW, json=slow_body())

    with ThreadPoolExecutor(sent) as pool:
        futures = [pool.submit(one, i) for i in range(sent)]
        time.sleep(0.3)
        assert http.get("/v2/health/ready").status_code == 200  # probes are never refused
        assert http.get("/v2/models/slow").status_code == 200
        responses = [f.result() for f in futures]
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}, codes
    assert MAX_INFLIGHT <= codes.count(200) < sent and codes.count(429) > 0, codes
    for response in responses:
        if response.status_code == 200:
            assert response.json()["outputs"][0]["data"][0] == expected
        else:
            assert_error(response, 429, f"limit of {MAX_INFLIGHT} requests in flight")
    assert http.post(SLOW, json=slow_body()).status_code == 200  # every slot came back


def test_grpc_overload_is_resource_exhausted(guarded_server, http):
    if not guarded_server.grpc_available:
        pytest.skip("gRPC frontend not importable")
    expected = _expected(http)
    request = pb.ModelInferRequest(model_name="slow")
    tensor = request.inputs.add(name="X", datatype="FP32")
    tensor.shape.extend([1, SLOW_SIZE])
    request.raw_input_contents.append(np.full((1, SLOW_SIZE), 0.5, np.float32).tobytes())
    sent = 4 * MAX_INFLIGHT
    with grpc.insecure_channel(guarded_server.grpc_url) as channel:
        stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(channel)
        futures = [stub.ModelInfer.future(request, timeout=60) for _ in range(sent)]
        outcomes = []
        for future in futures:
            try:
                outcomes.append(np.frombuffer(future.result().raw_output_contents[0], np.float32)[0])
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (e.code(), e.details())
                outcomes.append(None)
    admitted = [o for o in outcomes if o is not None]
    assert MAX_INFLIGHT <= len(admitted) < sent
    assert all(o == np.float32(expected) for o in admitted)


def test_disconnected_clients_take_their_queued_work_with_them(guarded_server, http):
    _expected(http)
    t0 = time.monotonic()
    assert http.post(SLOW, json=slow_body()).status_code == 200
    run_s = time.monotonic() - t0
    if run_s < 0.1:
        pytest.skip(f"the slow model runs in {run_s:.3f} s here: too fast to queue behind reliably")
    before = _executions(http)
    with httpx.Client(base_url=guarded_server.base_url, timeout=60) as client:
        blocker = threading.Thread(target=lambda: client.post(SLOW, json=slow_body()))
        blocker.start()
        time.sleep(run_s / 8)
        for _ in range(MAX_INFLIGHT - 1):  # they queue behind the blocker (one instance), then hang up
            with httpx.Client(base_url=guarded_server.base_url, timeout=run_s / 4) as impatient:
                try:
                    response = impatient.post(SLOW, json=slow_body())
                except httpx.TimeoutException:
                    continue
                pytest.fail(f"the queued request was answered at once: {response.status_code} {response.text}")
        blocker.join()
    time.sleep(1.0)
    assert _executions(http) - before == 1, "a request whose client went away still ran"
    # the slots of the quitters were given back: a full set of admitted requests runs again
    with ThreadPoolExecutor(MAX_INFLIGHT) as pool:
        codes = list(pool.map(lambda _: httpx.post(guarded_server.base_url + SLOW, json=slow_body(),
                                                   timeout=60).status_code, range(MAX_INFLIGHT)))
    assert codes == [200] * MAX_INFLIGHT


def test_limits_unit():
    limiter = InflightLimiter(2)
    with limiter.admit(), limiter.admit():
        with pytest.raises(Exception, match="limit of 2"):
            with limiter.admit():
                pass
        assert limiter.count == 2 and limiter.refused == 1
    assert limiter.count == 0
    unlimited = InflightLimiter(0)
    for _ in range(1000):
        unlimited.acquire()
    assert unlimited.count == 1000
    limits = RequestLimits(max_body_bytes=100, max_decompressed_bytes=1 << 30, max_compression_ratio=10,
                           ratio_floor_bytes=1000)
    assert limits.decompressed_limit(50) == 1000 and limits.decompressed_limit(1000) == 10_000
    with pytest.raises(Exception, match="exceeds the limit of 100"):
        limits.check_body_size(101)
    with pytest.raises(ValueError):
        RequestLimits(max_body_bytes=0)
