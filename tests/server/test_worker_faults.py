"""Worker faults: an execution that raises fails only its own requests, its context is replaced, serving goes on.

The schedulers are first driven alone (exact control over which execution fails and with what: an exception,
a CUDA error, a BaseException, a context that cannot be recreated); then a real server runs a model whose
plugin op raises on the magic value 13 (tests/reliability/fault_plugin.py), over HTTP and gRPC, and its
metrics must count the restarts.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as http
from tritonclient.utils import InferenceServerException

from engine_core.cuda.driver import CudaError
from engine_core.errors import ShapeError
from load_tests.harness import metric_sum
from server.core.batcher import BatchingSettings, DynamicBatcher
from server.core.errors import ErrorKind, ServerError
from server.core.scheduler import DirectScheduler, Job
from server.protos import model_config_pb2
from tests.reliability import fault_plugin
from tests.server.conftest import ServerProcess, examples, run_server

TIMEOUT_S = 10  # a hang shows up as a timeout, not as a stuck test run


class Context:
    """A stand-in execution context: numbered, so a test can see which one ran and that it was replaced."""

    made = 0

    def __init__(self) -> None:
        Context.made += 1
        self.number = Context.made


class FlakyExecutor:
    """X + 1 on any context; raises `error` for inputs holding 13 (the context's fault)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.contexts: list[int] = []

    def __call__(self, context: Context, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.contexts.append(context.number)
        if np.any(inputs["X"] == 13):
            raise self.error
        return {"Y": inputs["X"] + 1}


def _job(value: float) -> Job:
    return Job({"X": np.full((1, 2), value, np.float32)}, 1)


def _batcher(executor: FlakyExecutor, create=Context, max_batch_size: int = 4) -> DynamicBatcher:
    settings = BatchingSettings.from_config(model_config_pb2.ModelDynamicBatching(), max_batch_size, "m")
    return DynamicBatcher([Context()], executor, "test", settings, create_context=create)


async def _submit(scheduler, value: float):
    return await asyncio.wait_for(scheduler.submit(_job(value)), TIMEOUT_S)


@pytest.mark.parametrize("kind", ["direct", "batched"])
@pytest.mark.parametrize("error", [RuntimeError("kernel exploded"), CudaError("CUDA_ERROR_ILLEGAL_ADDRESS"),
                                   SystemExit(3)], ids=["exception", "cuda", "base-exception"])
def test_a_fault_fails_its_request_and_the_context_is_replaced(kind: str, error: BaseException):
    async def scenario():
        executor = FlakyExecutor(error)
        scheduler = (DirectScheduler([Context()], executor, "test", create_context=Context) if kind == "direct"
                     else _batcher(executor))
        before = await _submit(scheduler, 1)
        with pytest.raises(ServerError) as fault:
            await _submit(scheduler, 13)
        after = [await _submit(scheduler, v) for v in (2, 3)]
        scheduler.close()
        return scheduler.workers, executor.contexts, before, fault.value, after

    workers, contexts, before, fault, after = asyncio.run(scenario())
    assert fault.kind == ErrorKind.INTERNAL
    assert "execution failed" in fault.message and type(error).__name__ in fault.message
    assert "replaced" in fault.message
    np.testing.assert_array_equal(before.outputs["Y"], [[2, 2]])
    assert [r.outputs["Y"][0, 0] for r in after] == [3, 4]
    assert contexts[0] == contexts[1] and contexts[2] == contexts[3] and contexts[2] != contexts[1]
    assert (workers.faults, workers.restarts, workers.alive) == (1, 1, 1)


def test_a_request_the_engine_refuses_is_no_fault():
    async def scenario():
        executor = FlakyExecutor(ShapeError("input 'X' shape [1, 2] is outside optimization profile 0"))
        scheduler = DirectScheduler([Context()], executor, "test", create_context=Context)
        with pytest.raises(ShapeError):
            await _submit(scheduler, 13)
        scheduler.close()
        return scheduler.workers

    workers = asyncio.run(scenario())
    assert (workers.faults, workers.restarts) == (0, 0)


def test_only_the_faulted_batch_fails_and_queued_requests_run_on():
    async def scenario():
        executor = FlakyExecutor(RuntimeError("boom"))
        batcher = _batcher(executor, max_batch_size=1)  # one request per execution: batch-mates would share the fault
        results = await asyncio.gather(*[_submit(batcher, v) for v in (13, 5, 6, 7)], return_exceptions=True)
        batcher.close()
        return results

    poisoned, *rest = asyncio.run(scenario())
    assert isinstance(poisoned, ServerError) and poisoned.kind == ErrorKind.INTERNAL
    # The others queued behind the poisoned one run on the replacement context.
    assert [r.outputs["Y"][0, 0] for r in rest] == [6, 7, 8]


def test_when_no_context_can_be_recreated_requests_are_refused_not_hung():
    def broken() -> Context:
        raise RuntimeError("out of device memory")

    async def scenario():
        executor = FlakyExecutor(RuntimeError("boom"))
        batcher = _batcher(executor, create=broken, max_batch_size=1)
        results = await asyncio.gather(*[_submit(batcher, v) for v in (13, 5, 6)], return_exceptions=True)
        with pytest.raises(ServerError) as refused:
            await _submit(batcher, 1)
        direct = DirectScheduler([Context()], executor, "test", create_context=broken)
        direct_results = await asyncio.gather(*[_submit(direct, v) for v in (13, 5)], return_exceptions=True)
        batcher.close()
        direct.close()
        return batcher.workers, results, refused.value, direct_results

    workers, results, refused, direct_results = asyncio.run(scenario())
    assert workers.alive == 0 and workers.restarts == 0 and workers.faults == 1
    assert results[0].kind == ErrorKind.INTERNAL
    assert all(isinstance(r, ServerError) and r.kind == ErrorKind.UNAVAILABLE for r in results[1:])
    assert refused.kind == ErrorKind.UNAVAILABLE and "none could be recreated" in refused.message
    assert [r.kind for r in direct_results] == [ErrorKind.INTERNAL, ErrorKind.UNAVAILABLE]


def test_a_pool_that_lost_one_context_serves_on_with_the_others():
    """A fault whose context cannot be recreated shrinks the batcher's pool by one; the other context serves the
    following batches (the lost one must not come back as an empty slot)."""
    def broken() -> Context:
        raise RuntimeError("out of device memory")

    async def scenario():
        executor = FlakyExecutor(RuntimeError("boom"))
        settings = BatchingSettings.from_config(model_config_pb2.ModelDynamicBatching(), 1, "m")
        batcher = DynamicBatcher([Context(), Context()], executor, "test", settings, create_context=broken)
        faulted = await asyncio.gather(_submit(batcher, 13), return_exceptions=True)
        results = [await _submit(batcher, v) for v in (5, 6, 7)]
        batcher.close()
        return batcher.workers, faulted[0], results

    workers, faulted, results = asyncio.run(scenario())
    assert isinstance(faulted, ServerError) and faulted.kind == ErrorKind.INTERNAL
    assert workers.alive == 1 and workers.faults == 1
    assert [float(r.outputs["Y"][0, 0]) for r in results] == [6.0, 7.0, 8.0]


class StallingExecutor:
    """X + 1; an input holding 42 blocks its worker thread until ``release`` is set (a stuck execution)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def __call__(self, context: Context, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if np.any(inputs["X"] == 42):
            self.release.wait(TIMEOUT_S)
        return {"Y": inputs["X"] + 1}


def _stalling(kind: str, contexts: int, executor: StallingExecutor):
    if kind == "direct":
        scheduler = DirectScheduler([Context() for _ in range(contexts)], executor, "test", create_context=Context)
    else:
        settings = BatchingSettings.from_config(model_config_pb2.ModelDynamicBatching(), 1, "m")
        scheduler = DynamicBatcher([Context() for _ in range(contexts)], executor, "test", settings,
                                   create_context=Context)
    scheduler.workers.timeout_s = 0.2
    return scheduler


@pytest.mark.parametrize("kind", ["direct", "batched"])
def test_an_execution_past_the_timeout_fails_its_request_and_the_other_worker_serves(kind: str):
    async def scenario():
        executor = StallingExecutor()
        scheduler = _stalling(kind, 2, executor)
        started = time.perf_counter()
        with pytest.raises(ServerError) as stuck:
            await _submit(scheduler, 42)
        waited = time.perf_counter() - started
        during = [await _submit(scheduler, v) for v in (1, 2, 3)]  # on the one worker left
        hung = scheduler.workers.hung
        executor.release.set()
        await asyncio.sleep(0.1)
        after = await asyncio.gather(*[_submit(scheduler, v) for v in (4, 5, 6, 7)])
        scheduler.close()
        return stuck.value, waited, during, hung, after, scheduler.workers

    stuck, waited, during, hung, after, workers = asyncio.run(scenario())
    assert stuck.kind == ErrorKind.UNAVAILABLE and "longer than 200 ms" in stuck.message
    assert "kiln_execution_timeout_ms" in stuck.message and waited < 2
    assert [r.outputs["Y"][0, 0] for r in during] == [2, 3, 4] and hung == 1
    assert [r.outputs["Y"][0, 0] for r in after] == [5, 6, 7, 8]
    assert (workers.hung, workers.hangs, workers.alive, workers.faults) == (0, 1, 2, 0)


@pytest.mark.parametrize("kind", ["direct", "batched"])
def test_with_every_worker_stuck_requests_are_refused_until_one_returns(kind: str):
    async def scenario():
        executor = StallingExecutor()
        scheduler = _stalling(kind, 1, executor)
        stuck, queued = await asyncio.gather(_submit(scheduler, 42), _submit(scheduler, 1), return_exceptions=True)
        with pytest.raises(ServerError) as refused:
            await _submit(scheduler, 2)
        executor.release.set()
        await asyncio.sleep(0.1)
        later = await _submit(scheduler, 3)
        scheduler.close()
        return stuck, queued, refused.value, later

    stuck, queued, refused, later = asyncio.run(scenario())
    assert isinstance(stuck, ServerError) and "longer than 200 ms" in stuck.message
    # the request queued behind the stuck one hears at once that no worker is left (it does not wait 10 s)
    assert isinstance(queued, ServerError) and queued.kind == ErrorKind.UNAVAILABLE
    assert refused.kind == ErrorKind.UNAVAILABLE and "every worker is still running" in refused.message
    assert later.outputs["Y"][0, 0] == 4


# -- a real server ----------------------------------------------------------------------------------------------
def _config(name: str, extra: str, count: int) -> str:
    return (f'name: "{name}"\nmax_batch_size: 8\ninput [{{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] }}]\n'
            f'output [{{ name: "Y" data_type: TYPE_FP32 dims: [ 4 ] }}]\n'
            f'instance_group [{{ count: {count} kind: KIND_CPU }}]\n{extra}\n')


FAULT_MODELS = {"faulty_batched": ("dynamic_batching { max_queue_delay_microseconds: 2000 }", 2),
                "faulty_direct": ("", 1)}
_TIMEOUT = 'parameters { key: "kiln_execution_timeout_ms" value { string_value: "500" } }'
STALL_MODELS = {"stalling_direct": (_TIMEOUT, 2),
                "stalling_batched": (_TIMEOUT + "\ndynamic_batching { max_queue_delay_microseconds: 100 }", 2)}


@pytest.fixture(scope="module")
def fault_server(tmp_path_factory: pytest.TempPathFactory):
    """`python -m server` with the fault plugin registered, on a repository of the two fault models."""
    base = tmp_path_factory.mktemp("faults")
    for name, (extra, count) in {**FAULT_MODELS, **STALL_MODELS}.items():
        examples.write_model(base / "models", name, fault_plugin.model(), _config(name, extra, count))
    args = ["--plan-cache-dir", str(base / "plans"), "--drain-delay", "0"]
    with run_server(base / "models", base / "server.log", None, args, module="tests.reliability.fault_plugin") as server:
        yield server


def _infer(url: str, model: str, x: np.ndarray) -> np.ndarray:
    tensor = http.InferInput("X", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return http.InferenceServerClient(url).infer(model, [tensor]).as_numpy("Y")


def _metric(server: ServerProcess, name: str, model: str) -> float:
    value = metric_sum(server.metrics_url, name, {"model": model, "version": "1"})
    assert value is not None, f"{name} for {model} not in /metrics"
    return value


def _outcome(url: str, model: str, x: np.ndarray):
    try:
        return _infer(url, model, x)
    except InferenceServerException as e:
        return e


@pytest.mark.parametrize("model", list(FAULT_MODELS))
def test_server_keeps_serving_after_worker_faults(fault_server: ServerProcess, model: str):
    url = fault_server.http_url
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    np.testing.assert_array_equal(_infer(url, model, x), x + 1)
    with pytest.raises(InferenceServerException) as fault:
        _infer(url, model, np.full((1, 4), 13, np.float32))
    assert fault.value.status() == "500"
    assert "magic value 13" in fault.value.message() and "replaced" in fault.value.message()

    # Concurrent load with poison mixed in: every request gets an answer (no hang); the good ones are right,
    # or fail with the fault of the batch they shared with a poisoned one.
    requests = [np.full((1 + i % 3, 4), 13.0 if i % 7 == 3 else 100.0 + i, np.float32) for i in range(28)]
    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(lambda r: _outcome(url, model, r), requests))
    faults = 0
    for request, outcome in zip(requests, outcomes):
        if isinstance(outcome, InferenceServerException):
            assert outcome.status() == "500" and "magic value 13" in outcome.message()
            faults += 1
        else:
            assert not np.any(request == 13)
            np.testing.assert_array_equal(outcome, request + 1)
    assert faults >= 4  # the four poisoned requests, at least
    if model == "faulty_direct":
        assert faults == 4  # no batching: nobody shares a poisoned execution

    for i in range(6):  # and afterwards every worker serves correctly again
        np.testing.assert_array_equal(_infer(url, model, x + i), x + i + 1)
    stats = http.InferenceServerClient(url).get_inference_statistics(model)["model_stats"][0]
    assert stats["inference_stats"]["fail"]["count"] == faults + 1
    restarts = _metric(fault_server, "kiln_worker_restarts_total", model)
    # one restart per faulted execution: the first fault plus one per poisoned execution; the batcher may put
    # several poisoned requests into one execution, so only the direct model has exactly one per request
    if model == "faulty_direct":
        assert restarts == 5
    else:
        assert 2 <= restarts <= faults + 1
    assert _metric(fault_server, "kiln_workers", model) == FAULT_MODELS[model][1]


def test_grpc_client_sees_internal_and_the_log_has_the_traceback(fault_server: ServerProcess):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(fault_server.grpc_url)
    tensor = grpcclient.InferInput("X", [1, 4], "FP32")
    tensor.set_data_from_numpy(np.full((1, 4), 13, np.float32))
    with pytest.raises(InferenceServerException) as fault:
        client.infer("faulty_direct", [tensor])
    assert fault.value.status() == "StatusCode.INTERNAL" and "magic value 13" in fault.value.message()
    tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
    np.testing.assert_array_equal(client.infer("faulty_direct", [tensor]).as_numpy("Y"), np.full((1, 4), 2))
    log = Path(fault_server.log_path).read_text(errors="replace")
    assert "worker fault, replacing its execution context" in log and "RuntimeError: magic value 13" in log


@pytest.mark.parametrize("model", list(STALL_MODELS))
def test_a_stuck_execution_answers_503_within_the_timeout_and_serving_goes_on(fault_server: ServerProcess,
                                                                               model: str):
    """kiln_execution_timeout_ms 500: the request whose execution blocks (3 s) gets 503 after ~0.5 s naming the
    parameter; the other worker keeps answering meanwhile; once the stuck call returns, both workers serve and
    /metrics counts the timeout."""
    url = fault_server.http_url
    started = time.perf_counter()
    with pytest.raises(InferenceServerException) as stuck:
        _infer(url, model, np.full((1, 4), fault_plugin.STALL, np.float32))
    assert time.perf_counter() - started < fault_plugin.STALL_S
    assert stuck.value.status() == "503" and "kiln_execution_timeout_ms" in stuck.value.message()
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    np.testing.assert_array_equal(_infer(url, model, x), x + 1)  # the other worker
    assert _metric(fault_server, "kiln_workers", model) == 1
    assert _metric(fault_server, "kiln_execution_timeouts_total", model) == 1
    deadline = time.perf_counter() + fault_plugin.STALL_S + TIMEOUT_S
    while _metric(fault_server, "kiln_workers", model) != 2:  # the stuck call returns: back in service
        assert time.perf_counter() < deadline
        time.sleep(0.2)
    with ThreadPoolExecutor(4) as pool:
        outcomes = list(pool.map(lambda i: _infer(url, model, x + i), range(8)))
    for i, y in enumerate(outcomes):
        np.testing.assert_array_equal(y, x + i + 1)



@pytest.mark.parametrize("text, seconds", [("", None), ("500", 0.5), (" 2500.5 ", 2.5005), ("0", "error"),
                                           ("-3", "error"), ("soon", "error"), ("inf", "error"), ("nan", "error")])
def test_execution_timeout_parameter_is_checked(text: str, seconds):
    from server.core.model import execution_timeout_s
    from server.core.model_config import parse_config_text

    parameter = f'parameters {{ key: "kiln_execution_timeout_ms" value {{ string_value: "{text}" }} }}' if text else ""
    config = parse_config_text(_config("m", parameter, 1), "m")
    if seconds == "error":
        with pytest.raises(ServerError, match="kiln_execution_timeout_ms must be a positive number of milliseconds"):
            execution_timeout_s(config)
    else:
        assert execution_timeout_s(config) == seconds


def test_the_server_default_applies_where_the_config_sets_no_timeout():
    """`--execution-timeout-ms` (or KILN_EXECUTION_TIMEOUT_MS) fills in kiln_execution_timeout_ms for configs
    without it; a model's own value wins; bad values are refused by the flag parser."""
    import argparse

    from server.cli import add_serve_arguments
    from server.core.model import execution_timeout_s, with_default_execution_timeout
    from server.core.model_config import parse_config_text

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert parser.parse_args(["--model-repository", "r", "--execution-timeout-ms", "1500"]).execution_timeout_ms == 1500
    assert parser.parse_args(["--model-repository", "r"]).execution_timeout_ms == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-repository", "r", "--execution-timeout-ms", "-1"])
    plain = parse_config_text(_config("m", "", 1), "m")
    with_default_execution_timeout(plain, 1500)
    assert execution_timeout_s(plain) == 1.5
    own = parse_config_text(_config("m", _TIMEOUT, 1), "m")
    with_default_execution_timeout(own, 1500)
    assert execution_timeout_s(own) == 0.5
    untouched = parse_config_text(_config("m", "", 1), "m")
    with_default_execution_timeout(untouched, None)
    assert execution_timeout_s(untouched) is None
