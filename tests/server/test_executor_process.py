"""Executions in executor processes (server/core/executor.py): the same answers as in the core, tensors in shared
memory by reference (read and written in place by the executor), request errors as the engine raised them, regions
forgotten once released, a killed executor started again while the model keeps serving, and responses sent by the
executor straight to the frontend processes (server/core/direct_replies.py).

On a machine without a GPU the executor runs CPU plans (KILN_EXECUTOR_CPU=1): the same process, sockets, region
maps and fault handling as for CUDA plans, which tests/server/test_system_shm_gpu.py runs on a GPU.
"""

from __future__ import annotations

import gc
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import shared_memory
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import engine_core as kiln
from engine_core.errors import ShapeError
from server.core.executor import ExecutorProcess, executor_environment, loop_io
from server.core.executor_wire import RegionView, RemoteError, env_number
from server.core.model_config import ModelConfig
from server.core.shared_memory import SharedMemory
from tests.cuda.models import build_engine

from .conftest import examples, run_server
from .test_tensor_arena import CONFIG, WIDTH, _wide_add

grpcclient = pytest.importorskip("tritonclient.grpc")

EXECUTOR_ENV = {"KILN_EXECUTOR": "process", "KILN_EXECUTOR_CPU": "1"}


@pytest.fixture(scope="module")
def described():
    """The wide_add plan for the CPU, as the core holds it in executor mode: described only."""
    engine = build_engine(_wide_add(), "cpu", {"A": ((1, WIDTH), (4, WIDTH), (8, WIDTH)),
                                               "B": ((1, 4), (4, 4), (8, 4))})
    return kiln.Runtime().describe(engine.serialize())


@pytest.fixture()
def executor(described):
    process = ExecutorProcess("model 'wide_add'", described, ModelConfig(name="wide_add").SerializeToString(), 1)
    yield process
    process.close()


def _rows(count: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"A": rng.standard_normal((count, WIDTH)).astype(np.float32),
            "B": rng.standard_normal((count, 4)).astype(np.float32)}


def test_tuning_variables_that_are_not_numbers_fall_back_to_their_default(monkeypatch, caplog) -> None:
    monkeypatch.setenv("KILN_TEST_SECONDS", "2.5")
    assert env_number("KILN_TEST_SECONDS", 10) == 2.5
    monkeypatch.setenv("KILN_TEST_SECONDS", "-1")
    assert env_number("KILN_TEST_SECONDS", 10, minimum=0.1) == 0.1
    monkeypatch.setenv("KILN_TEST_SECONDS", "10s")
    assert env_number("KILN_TEST_SECONDS", 10) == 10 and "KILN_TEST_SECONDS='10s' is not a number" in caplog.text
    monkeypatch.delenv("KILN_TEST_SECONDS")
    assert env_number("KILN_TEST_SECONDS", 7) == 7


def test_busy_wait_events_gives_the_executor_spinning_waits(described) -> None:
    """`optimization.cuda.busy_wait_events: true` (Triton's lower-latency waits): the model's executor processes
    run with KILN_BLOCKING_SYNC=0, so their CUDA events spin instead of sleeping; other models' do not."""
    config = ModelConfig(name="wide_add")
    config.optimization.cuda.busy_wait_events = True
    spinning = ExecutorProcess("model 'wide_add'", described, config.SerializeToString(), 1)
    try:
        environ = Path(f"/proc/{spinning._process.pid}/environ").read_bytes().split(b"\0")
        assert b"KILN_BLOCKING_SYNC=0" in environ
    finally:
        spinning.close()
    assert "KILN_BLOCKING_SYNC" not in executor_environment(ModelConfig(name="m").SerializeToString(), "1,0")


def test_a_described_engine_has_the_plan_s_description_but_no_contexts(described) -> None:
    assert described.backend_state is None and described.num_io_tensors == 3
    with pytest.raises(kiln.KilnError, match="only described"):
        described.create_execution_context()


def test_a_batch_of_parts_runs_in_the_executor_and_request_errors_come_back_as_raised(executor) -> None:
    lane = executor.lanes[0]
    parts = [_rows(1, 1), _rows(3, 2)]
    outputs = lane.infer_batch(parts)
    for part, out in zip(parts, outputs):
        np.testing.assert_array_equal(out["SUM"], part["A"] + part["B"][:, :1])
    with pytest.raises(ShapeError):  # the engine's refusal, as the core's Workers tell it from a fault
        lane.infer_batch([{"A": np.zeros((1, 3), np.float32), "B": np.zeros((1, 4), np.float32)}])
    with pytest.raises(TypeError):
        lane.infer_batch([{"A": np.zeros((1, WIDTH), np.float64), "B": np.zeros((1, 4), np.float32)}])
    np.testing.assert_array_equal(lane.infer_batch(parts[:1])[0]["SUM"], outputs[0]["SUM"])  # still serving


def test_region_tensors_are_read_and_written_in_place_and_forgotten_once_released(executor) -> None:
    rows = _rows(2, 3)
    block = shared_memory.SharedMemory(create=True, size=rows["A"].nbytes * 2)
    try:
        regions = SharedMemory(remote=True)
        regions.register("io", "/" + block.name, 0, block.size)
        np.ndarray(rows["A"].shape, np.float32, block.buf)[:] = rows["A"]
        view = regions.device_view("io", 0, rows["A"].nbytes, rows["A"].shape, np.dtype(np.float32))
        target = regions.device_view("io", rows["A"].nbytes, rows["A"].nbytes, rows["A"].shape, np.dtype(np.float32))
        assert isinstance(view, RegionView) and isinstance(target, RegionView)
        outputs = executor.lanes[0].infer_batch([{"A": view, "B": rows["B"]}], destinations=[{"SUM": target}])
        assert outputs == [{}]  # delivered into the region, left out of the reply
        written = np.ndarray(rows["A"].shape, np.float32, block.buf, offset=rows["A"].nbytes).copy()
        np.testing.assert_array_equal(written, rows["A"] + rows["B"][:, :1])
        region_id = view.region
        assert region_id in executor._mapped
        regions.unregister("io")
        del view, target
        gc.collect()
        deadline = time.monotonic() + 5
        while region_id in executor._mapped and time.monotonic() < deadline:
            time.sleep(0.01)
        assert region_id not in executor._mapped  # the executor was told to unmap it
    finally:
        block.close()
        block.unlink()


def test_frontend_arenas_are_mapped_ahead_in_running_and_new_executors(executor, described, monkeypatch) -> None:
    """A frontend's arena is mapped by every executor when it is registered, and by an executor started later at its
    start, so no batch carries its map (on a GPU: pins tens of MB on a live request); client regions stay lazy."""
    from server.core import executor as executor_module
    from server.core.tensor_arena import ARENA_PREFIX

    sent: list[dict] = []
    original = executor_module.ExecutorProcess.call

    def recording(self, lane, message, regions):
        result = original(self, lane, message, regions)
        sent.append(message)
        return result

    monkeypatch.setattr(executor_module.ExecutorProcess, "call", recording)
    rows = _rows(2, 7)
    block = shared_memory.SharedMemory(create=True, size=rows["A"].nbytes)
    regions = SharedMemory(remote=True)
    later = None
    try:
        regions.register_arena(ARENA_PREFIX + "test", "/" + block.name, block.size)
        np.ndarray(rows["A"].shape, np.float32, block.buf)[:] = rows["A"]
        view = regions.device_view(ARENA_PREFIX + "test", 0, rows["A"].nbytes, rows["A"].shape, np.dtype(np.float32))
        assert isinstance(view, RegionView) and view.region in executor._mapped  # before any batch read it
        later = ExecutorProcess("model 'wide_add'", described, ModelConfig(name="wide_add").SerializeToString(), 1)
        assert view.region in later._mapped
        assert f"/dev/shm/{block.name}" in Path(f"/proc/{later._process.pid}/maps").read_text()  # before ready
        for process in (executor, later):
            out = process.lanes[0].infer_batch([{"A": view, "B": rows["B"]}])
            np.testing.assert_array_equal(out[0]["SUM"], rows["A"] + rows["B"][:, :1])
        assert len(sent) == 2 and not any("maps" in message for message in sent)
        del view
    finally:
        if later is not None:
            later.close()
        regions.unregister_arena(ARENA_PREFIX + "test")
        gc.collect()
        block.close()
        block.unlink()


def test_a_killed_executor_fails_only_the_call_it_was_running_and_is_started_again(executor) -> None:
    lane = executor.lanes[0]
    old = executor._process
    assert old is not None
    os.kill(old.pid, signal.SIGKILL)
    old.wait()
    parts = [_rows(2, 4)]
    outputs = lane.infer_batch(parts)  # the exit is noticed before sending: a new process runs it
    np.testing.assert_array_equal(outputs[0]["SUM"], parts[0]["A"] + parts[0]["B"][:, :1])
    assert executor.restarts == 1 and executor._process is not old


@pytest.fixture()
def loads(monkeypatch) -> list[dict]:
    """The load messages the core sends executor processes from now on (plan, config, warm_buckets...)."""
    from server.core import executor_wire

    sent: list[dict] = []

    class Recording(executor_wire.Channel):
        def send(self, message, fds=()):
            if isinstance(message, dict) and "plan" in message:
                sent.append(message)
            return super().send(message, fds)

    monkeypatch.setattr(executor_wire, "Channel", Recording)  # child_launch makes the control channel
    return sent


def test_a_restarted_executor_serves_before_binding_its_buckets(executor, loads) -> None:
    """A first start binds every batch bucket before ready; a restart (requests waiting) binds them in the background
    or on first use."""
    old = executor._process
    assert old is not None
    os.kill(old.pid, signal.SIGKILL)
    old.wait()
    parts = [_rows(1, 5)]
    np.testing.assert_array_equal(executor.lanes[0].infer_batch(parts)[0]["SUM"], parts[0]["A"] + parts[0]["B"][:, :1])
    assert [load["warm_buckets"] for load in loads] == [False]


def test_a_reloaded_version_serves_before_binding_its_buckets(described, loads) -> None:
    """Loading a version this server served before (unload, then load) is a reload: it serves once its plan is
    loaded, as a restart does; another version's first load binds first."""
    config = ModelConfig(name="wide_add").SerializeToString()
    for label in ("model 'wide_add' version 7", "model 'wide_add' version 7", "model 'wide_add' version 8"):
        process = ExecutorProcess(label, described, config, 1)
        try:
            parts = [_rows(1, 6)]
            np.testing.assert_array_equal(process.lanes[0].infer_batch(parts)[0]["SUM"],
                                          parts[0]["A"] + parts[0]["B"][:, :1])
        finally:
            process.close()
    assert [load["warm_buckets"] for load in loads] == [True, False, True]


def _executor_pids(root: int) -> list[int]:
    """Executor processes among `root`'s descendants."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if b"server.core.executor_main" in command and parent == root:
            found.append(int(entry.name))
    return found


def exited(pid: int) -> bool:
    """Whether process `pid` has exited: gone, or a zombie with no thread left (its parent can reap it). Not "no
    longer among the executors": while a process exits, its command line reads empty first, and its main thread is
    a zombie while its other threads still end; a request sent then may meet a socket the process has not closed
    yet (503: retry) rather than the restart the core starts once it can reap the process."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        threads = len(list(Path(f"/proc/{pid}/task").iterdir()))
    except (OSError, IndexError):
        return True
    return state in ("Z", "X") and threads <= 1


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("executor")
    examples.write_model(base / "models", "wide_add", _wide_add(), CONFIG)
    return base


@pytest.mark.parametrize("io", ["thread", "loop"])
def test_a_server_runs_batches_in_an_executor_process_and_survives_its_death(repository: Path, io: str) -> None:
    """On a machine with a GPU the model (KIND_AUTO) is a CUDA one: the same test runs a CUDA executor. `io`: the
    core's side of each batch in a worker thread, or on its event loop (KILN_EXECUTOR_IO, executor.loop_io)."""
    with run_server(repository / "models", repository / "server.log", ["wide_add"],
                    ["--frontend-processes", "2", "--allow-client-shm", "true"],
                    env={**EXECUTOR_ENV, "KILN_EXECUTOR_IO": io}) as server:
        pids = _executor_pids(server.process.pid)
        assert len(pids) == 1, "one executor process for the one model version"
        grpc = grpcclient.InferenceServerClient(server.grpc_url)
        rng = np.random.default_rng(5)
        cases = [(rng.standard_normal((1 + i % 3, WIDTH)).astype(np.float32),
                  np.full((1 + i % 3, 4), float(i), np.float32)) for i in range(96)]

        def one(case: tuple[np.ndarray, np.ndarray]) -> bool:
            a, b = case
            inputs = [grpcclient.InferInput("A", list(a.shape), "FP32"), grpcclient.InferInput("B", list(b.shape), "FP32")]
            inputs[0].set_data_from_numpy(a)
            inputs[1].set_data_from_numpy(b)
            try:
                result = grpc.infer("wide_add", inputs, client_timeout=30)
            except InferenceServerException as e:
                assert "executor process ended" in str(e), str(e)  # only the batches the kill interrupted fail,
                assert e.status() == "StatusCode.UNAVAILABLE", e.status()  # as UNAVAILABLE: retry (#35)
                return False
            np.testing.assert_array_equal(result.as_numpy("SUM"), a + b[:, :1])
            return True

        with ThreadPoolExecutor(8) as pool:
            assert all(pool.map(one, cases[:32]))  # through frontend arenas, in the executor
            futures = [pool.submit(one, case) for case in cases[32:]]
            os.kill(pids[0], signal.SIGKILL)
            answered = [f.result(timeout=60) for f in futures]
        assert sum(answered) >= len(answered) - 8, "at most the batches in flight failed"
        assert all(pool_ok for pool_ok in [one(case) for case in cases[:4]])  # serving again
        assert len(_executor_pids(server.process.pid)) == 1  # started again

        http = httpclient.InferenceServerClient(server.http_url)  # system shared memory: in place, both ways
        a, b = cases[1]
        block = shared_memory.SharedMemory(create=True, size=2 * a.nbytes)
        try:
            np.ndarray(a.shape, np.float32, block.buf)[:] = a
            http.register_system_shared_memory("io", "/" + block.name, block.size)
            inputs = [httpclient.InferInput("A", list(a.shape), "FP32"), httpclient.InferInput("B", list(b.shape), "FP32")]
            inputs[0].set_shared_memory("io", a.nbytes)
            inputs[1].set_data_from_numpy(b)
            output = httpclient.InferRequestedOutput("SUM")
            output.set_shared_memory("io", a.nbytes, offset=a.nbytes)
            http.infer("wide_add", inputs, outputs=[output])
            np.testing.assert_array_equal(np.ndarray(a.shape, np.float32, block.buf, offset=a.nbytes), a + b[:, :1])
            http.unregister_system_shared_memory("io")
        finally:
            block.close()
            block.unlink()


def test_a_server_s_executor_answers_its_frontends_and_the_core_counts_every_request(repository: Path) -> None:
    """Direct replies (server/core/direct_replies.py): every request gets its own rows and id from the executor, a
    request the core must post-process (classification) still goes through the core, and the statistics count
    every request."""
    env = {**EXECUTOR_ENV, "KILN_HOP_STATS_S": "0.2"}
    log_path = repository / "server.log"
    with run_server(repository / "models", log_path, ["wide_add"], ["--frontend-processes", "2"], env=env) as server:
        grpc = grpcclient.InferenceServerClient(server.grpc_url)
        http = httpclient.InferenceServerClient(server.http_url)
        rng = np.random.default_rng(3)
        cases = [(rng.standard_normal((1 + i % 3, WIDTH)).astype(np.float32),
                  np.full((1 + i % 3, 4), float(i), np.float32)) for i in range(48)]

        def one(index: int, module=grpcclient, client=grpc) -> None:
            a, b = cases[index % len(cases)]
            inputs = [module.InferInput("A", list(a.shape), "FP32"), module.InferInput("B", list(b.shape), "FP32")]
            inputs[0].set_data_from_numpy(a)
            inputs[1].set_data_from_numpy(b)
            if index % 8 == 5:  # classification: the core post-processes it, beside routed requests
                top = client.infer("wide_add", inputs, outputs=[module.InferRequestedOutput("SUM", class_count=1)])
                best = (a + b[:, :1]).argmax(axis=1)
                assert [int(entry.decode().split(":")[1]) for entry in top.as_numpy("SUM").reshape(-1)] == list(best)
                return
            result = client.infer("wide_add", inputs, request_id=f"r{index}")
            response = result.get_response()
            assert (response["id"] if module is httpclient else response.id) == f"r{index}"
            np.testing.assert_array_equal(result.as_numpy("SUM"), a + b[:, :1])

        sent = 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until the core logs the span of a request its executor answered
            with ThreadPoolExecutor(12) as pool:  # concurrent requests: groups and batches of several jobs
                list(pool.map(one, range(sent, sent + len(cases))))
            for index in range(sent, sent + 6):  # HTTP too (one client, one request at a time)
                one(index, httpclient, http)
            sent += len(cases) + 6
            if re.search(r"call in -> executor replied [0-9.]+ ms x \d+", log_path.read_text(errors="replace")):
                break
        else:
            pytest.fail("no request was answered by the executor directly (no 'call in -> executor replied' span)")
        rows = sum(len(cases[i % len(cases)][0]) for i in range(sent))
        while time.monotonic() < deadline:  # the core counts a delivered request once its executor's reply is in
            stats = http.get_inference_statistics("wide_add")["model_stats"][0]
            if stats["inference_count"] == rows:
                break
            time.sleep(0.05)
        assert (stats["inference_count"], stats["inference_stats"]["success"]["count"]) == (rows, sent)


@pytest.fixture(scope="module")
def faulty_repository(tmp_path_factory) -> Path:
    from tests.reliability import fault_plugin

    base = tmp_path_factory.mktemp("executor_faults")
    config = ('name: "faulty"\nmax_batch_size: 8\ninput [{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] }]\n'
              'output [{ name: "Y" data_type: TYPE_FP32 dims: [ 4 ] }]\ndynamic_batching { }\n')
    examples.write_model(base / "models", "faulty", fault_plugin.model(), config)
    return base


def test_hop_stats_time_each_process_s_part_of_a_served_request(repository: Path) -> None:
    """KILN_HOP_STATS_S (server/core/hop_stats.py): frontends, the core and the executor each log their spans of the
    requests they served, as means per request, gRPC and HTTP alike."""
    env = {**EXECUTOR_ENV, "KILN_HOP_STATS_S": "0.2", "KILN_EXECUTOR_STATS_S": "0.2"}
    log_path = repository / "server_hops.log"
    with run_server(repository / "models", log_path, ["wide_add"], ["--frontend-processes", "2"], env=env) as server:
        grpc = grpcclient.InferenceServerClient(server.grpc_url)
        http = httpclient.InferenceServerClient(server.http_url)
        a, b = np.ones((2, WIDTH), np.float32), np.ones((2, 4), np.float32)
        expected = {"gRPC request in -> response out", "HTTP request in -> response out", "core round trip",
                    "call in -> executor replied", "executor round trip"}
        if not loop_io():  # a worker thread hands each batch back to the event loop
            expected.add("lane result -> event loop")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for module, client in ((grpcclient, grpc), (httpclient, http)):
                inputs = [module.InferInput("A", list(a.shape), "FP32"), module.InferInput("B", list(b.shape), "FP32")]
                inputs[0].set_data_from_numpy(a)
                inputs[1].set_data_from_numpy(b)
                np.testing.assert_array_equal(client.infer("wide_add", inputs).as_numpy("SUM"), a + b[:, :1])
            text = log_path.read_text(errors="replace")
            spans = {name for name in expected if re.search(re.escape(name) + r" [0-9.]+ ms x \d+", text)}
            if spans == expected and "ms each from message in to reply ready" in text:
                return
            time.sleep(0.05)
        pytest.fail(f"hop spans logged: {sorted(spans)}")


def test_an_error_that_poisons_the_device_context_restarts_the_executor(faulty_repository: Path) -> None:
    """A sticky CUDA error (here raised by the fault plugin's STICKY value) fails its batch, then the executor exits
    rather than serve on a broken context; the next request runs on a new executor, and the restart is counted."""
    from tests.reliability import fault_plugin

    with run_server(faulty_repository / "models", faulty_repository / "server.log", ["faulty"], env=EXECUTOR_ENV,
                    module="tests.reliability.fault_plugin") as server:
        client = httpclient.InferenceServerClient(server.http_url)
        before = _executor_pids(server.process.pid)
        assert before, "no executor process among the server's children"

        def infer(value: float) -> np.ndarray:
            x = np.full((1, 4), value, np.float32)
            tensor = httpclient.InferInput("X", [1, 4], "FP32")
            tensor.set_data_from_numpy(x)
            return client.infer("faulty", [tensor]).as_numpy("Y")

        np.testing.assert_array_equal(infer(1.0), np.full((1, 4), 2.0, np.float32))
        with pytest.raises(InferenceServerException, match="CUDA_ERROR_ILLEGAL_ADDRESS"):
            infer(fault_plugin.STICKY)
        deadline = time.monotonic() + 10
        while not all(exited(pid) for pid in before) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(exited(pid) for pid in before), "the executor did not exit"
        np.testing.assert_array_equal(infer(2.0), np.full((1, 4), 3.0, np.float32))  # on a new executor
        metrics = httpx.get(server.metrics_url, timeout=10).text
        assert re.search(r'^kiln_worker_restarts_total{model="faulty",version="1"} 1(\.0)?$', metrics, re.M), [
            line for line in metrics.splitlines() if "restart" in line]


def test_requests_running_when_the_executor_is_killed_get_503_and_the_next_ones_succeed(faulty_repository: Path) -> None:
    """#35: an executor killed (SIGKILL) while it runs a batch: that batch's requests hear UNAVAILABLE (503, retry)
    instead of hanging, health still answers, and the next request runs on a new executor."""
    from tests.reliability import fault_plugin

    with run_server(faulty_repository / "models", faulty_repository / "server_kill.log", ["faulty"],
                    env=EXECUTOR_ENV, module="tests.reliability.fault_plugin") as server:
        client = httpclient.InferenceServerClient(server.http_url, network_timeout=30)

        def infer(value: float) -> np.ndarray:
            tensor = httpclient.InferInput("X", [1, 4], "FP32")
            tensor.set_data_from_numpy(np.full((1, 4), value, np.float32))
            return httpclient.InferenceServerClient(server.http_url).infer("faulty", [tensor]).as_numpy("Y")

        (pid,) = _executor_pids(server.process.pid)
        with ThreadPoolExecutor(1) as pool:
            stalled = pool.submit(infer, fault_plugin.STALL)  # the executor sleeps in it for STALL_S
            time.sleep(0.5)
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(InferenceServerException, match="executor process ended") as info:
                stalled.result(timeout=30)
        assert info.value.status() == "503"
        assert client.is_server_live() and client.is_model_ready("faulty")
        np.testing.assert_array_equal(infer(1.0), np.full((1, 4), 2.0, np.float32))
        assert _executor_pids(server.process.pid) not in ([], [pid])


def test_an_executor_that_does_not_get_ready_in_time_fails_the_load(described, monkeypatch) -> None:
    """A start that hangs (here: a timeout shorter than any start) fails with a message, and no process is left."""
    monkeypatch.setenv("KILN_EXECUTOR_START_TIMEOUT_S", "0.001")
    before = set(_executor_pids(os.getpid()))
    with pytest.raises(RemoteError, match="not ready within 0.001 s"):
        ExecutorProcess("model 'slow'", described, ModelConfig(name="slow").SerializeToString(), 1)
    assert set(_executor_pids(os.getpid())) == before
