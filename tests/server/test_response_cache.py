"""Triton's response cache (server/core/response_cache.py): a real server started with `--cache-config=local,size=`
serves models whose config enables the cache; the stock tritonclient (HTTP and gRPC) sends a request twice and the
second is answered from the cache (statistics and metrics say so, the model did not run, the answer is the same),
other inputs or outputs miss, a full cache evicts its least recently used entries, a model without `enable` is
never cached, and what the cache leaves alone bypasses it. In-process: the LRU and its byte accounting, the key,
the flags, Triton's rules for concurrent misses and device memory, and a model loaded without a server cache."""

from __future__ import annotations

import argparse
import asyncio
import logging
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient
import tritonclient.utils.shared_memory as shm
from onnx import TensorProto
from prometheus_client.parser import text_string_to_metric_families

from server.cli import add_serve_arguments, cache_config
from server.core import CoreOptions, InferInput, InferRequest, ServerCore
from server.core.config_fields import ConfigFieldCheck
from server.core.errors import ServerError
from server.core.latency import MetricsConfig
from server.core.limits import InflightLimiter
from server.core.model_config import parse_config_text
from server.core.remote import CoreService, RemoteCore
from server.core.response_cache import (
    CacheConfig,
    InsertResult,
    ResponseCache,
    entry_size,
    parse_cache_config,
    request_key,
)
from server.metrics import InferenceMetricsCollector
from server.metrics_flags import MetricsOptions

from .conftest import ROOT, examples, require_grpc, run_server

pytestmark = pytest.mark.timeout(180)

CACHE_BYTES = 1024  # eight add_sub responses of one row: 2 outputs x 16 INT32
ROW_BYTES = 2 * 16 * 4
CACHED_CONFIG = examples.ADD_SUB_CONFIG.replace('name: "add_sub"', 'name: "cached"') + (
    "dynamic_batching { max_queue_delay_microseconds: 2000 }\nresponse_cache { enable: true }\n")
CACHED_CNN_CONFIG = (examples.CNN_CONFIG.replace('name: "simple_cnn"', 'name: "cached_cnn"')
                     + "response_cache { enable: true }\n")
ENSEMBLE_CONFIG = """name: "cached_ensemble"
platform: "ensemble"
max_batch_size: 8
input [ { name: "A" data_type: TYPE_INT32 dims: [ 16 ] }, { name: "B" data_type: TYPE_INT32 dims: [ 16 ] } ]
output [ { name: "S" data_type: TYPE_INT32 dims: [ 16 ] }, { name: "D" data_type: TYPE_INT32 dims: [ 16 ] } ]
ensemble_scheduling { step [ { model_name: "add_sub" model_version: -1
  input_map { key: "INPUT0" value: "A" } input_map { key: "INPUT1" value: "B" }
  output_map { key: "OUTPUT0" value: "S" } output_map { key: "OUTPUT1" value: "D" } } ] }
response_cache { enable: true }
"""
MODELS = ["add_sub", "cached", "cached_cnn", "cached_ensemble"]


def write_repository(root: Path) -> Path:
    """The example repository plus add_sub and simple_cnn with the cache enabled, and a cached ensemble."""
    repository = examples.make_repository(root)
    examples.write_model(repository, "cached", examples.add_sub_model(TensorProto.INT32), CACHED_CONFIG)
    examples.write_model(repository, "cached_cnn", examples.cnn_model(), CACHED_CNN_CONFIG,
                         {"labels.txt": "\n".join(examples.CNN_LABELS) + "\n"})
    (repository / "cached_ensemble" / "1").mkdir(parents=True)
    (repository / "cached_ensemble" / "config.pbtxt").write_text(ENSEMBLE_CONFIG)
    return repository


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("response_cache")
    repository = write_repository(base / "models")
    with run_server(repository, base / "server.log", MODELS,
                    [f"--cache-config=local,size={CACHE_BYTES}", "--allow-client-shm", "true"]) as running:
        yield running


@pytest.fixture
def client(server):
    with httpclient.InferenceServerClient(server.http_url, concurrency=16) as c:
        yield c


def _pair(seed: int, rows: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.integers(-1000, 1000, (rows, 16), dtype=np.int32),
            rng.integers(-1000, 1000, (rows, 16), dtype=np.int32))


def _inputs(a: np.ndarray, b: np.ndarray, names: tuple[str, str] = ("INPUT0", "INPUT1"), module=httpclient):
    tensors = [module.InferInput(names[0], list(a.shape), "INT32"), module.InferInput(names[1], list(b.shape), "INT32")]
    tensors[0].set_data_from_numpy(a)
    tensors[1].set_data_from_numpy(b)
    return tensors


def _stats(client: httpclient.InferenceServerClient, model: str) -> dict:
    return client.get_inference_statistics(model)["model_stats"][0]


def _counts(stats: dict) -> dict[str, int]:
    inference = stats["inference_stats"]
    return {"hit": inference["cache_hit"]["count"], "miss": inference["cache_miss"]["count"],
            "success": inference["success"]["count"], "inferences": stats["inference_count"],
            "executions": stats["execution_count"], "compute": inference["compute_infer"]["count"]}


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in before}


def _metrics(server) -> dict[tuple[str, str], float]:
    """(family name, model label or "") -> value, from a scrape (the parser adds _total to counter samples)."""
    text = httpx.get(server.metrics_url).text
    return {(family.name, s.labels.get("model", "")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


# -- a real server ------------------------------------------------------------------------------------------
def test_the_same_request_twice_is_a_hit_with_the_same_answer_and_no_execution(server, client):
    a, b = _pair(1)
    first = client.infer("cached", _inputs(a, b), request_id="first")
    before, metrics_before = _counts(_stats(client, "cached")), _metrics(server)
    second = client.infer("cached", _inputs(a, b), request_id="second")
    change = _delta(before, _counts(_stats(client, "cached")))
    metrics = _metrics(server)

    for name, expected in (("OUTPUT0", a + b), ("OUTPUT1", a - b)):
        np.testing.assert_array_equal(first.as_numpy(name), expected)
        np.testing.assert_array_equal(second.as_numpy(name), expected)
    assert second.get_response()["id"] == "second"  # the id is not part of the key; each answer has its own
    assert change == {"hit": 1, "miss": 0, "success": 1, "inferences": 0, "executions": 0, "compute": 0}
    stats = _stats(client, "cached")["inference_stats"]
    assert stats["cache_hit"]["ns"] > 0 and stats["cache_miss"]["ns"] > 0  # lookup (+ insertion on the miss)
    hits = ("nv_cache_num_hits_per_model", "cached")
    assert metrics[hits] - metrics_before[hits] == 1 and metrics[hits] == stats["cache_hit"]["count"]
    assert metrics[("nv_cache_num_misses_per_model", "cached")] == stats["cache_miss"]["count"]
    assert metrics[("nv_cache_hit_duration_per_model", "cached")] == stats["cache_hit"]["ns"] // 1000
    assert metrics[("nv_inference_exec_count", "cached")] == metrics_before[("nv_inference_exec_count", "cached")]
    assert metrics[("nv_inference_request_success", "cached")] - metrics_before[
        ("nv_inference_request_success", "cached")] == 1
    assert metrics[("nv_cache_num_hits", "")] >= 1 and metrics[("nv_cache_num_entries", "")] >= 1
    assert 0 < metrics[("nv_cache_util", "")] <= 1


def test_other_inputs_or_other_outputs_miss(server, client):
    a, b = _pair(2)
    client.infer("cached", _inputs(a, b))
    before = _counts(_stats(client, "cached"))
    other = client.infer("cached", _inputs(a, b + 1))  # other data
    only_sum = client.infer("cached", _inputs(a, b), outputs=[httpclient.InferRequestedOutput("OUTPUT0")])
    only_sum_again = client.infer("cached", _inputs(a, b), outputs=[httpclient.InferRequestedOutput("OUTPUT0")])
    assert _delta(before, _counts(_stats(client, "cached")))["hit"] == 1  # only the repeated OUTPUT0 request
    assert _delta(before, _counts(_stats(client, "cached")))["miss"] == 2
    np.testing.assert_array_equal(other.as_numpy("OUTPUT1"), a - b - 1)
    for result in (only_sum, only_sum_again):  # a hit answers with what this request asked for, nothing more
        assert [o["name"] for o in result.get_response()["outputs"]] == ["OUTPUT0"]
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)


def test_a_full_cache_evicts_the_least_recently_used_entries(server, client):
    a, b = _pair(3)
    client.infer("cached", _inputs(a, b))  # the oldest entry once the others go in
    evictions = _metrics(server)[("nv_cache_num_evictions", "")]
    for i in range(CACHE_BYTES // ROW_BYTES):  # as many one-row responses as the cache holds
        client.infer("cached", _inputs(a, b + 100 + i))
    metrics = _metrics(server)
    assert metrics[("nv_cache_num_evictions", "")] > evictions
    assert metrics[("nv_cache_num_entries", "")] == CACHE_BYTES // ROW_BYTES and metrics[("nv_cache_util", "")] == 1
    before = _counts(_stats(client, "cached"))
    np.testing.assert_array_equal(client.infer("cached", _inputs(a, b)).as_numpy("OUTPUT0"), a + b)
    assert _delta(before, _counts(_stats(client, "cached")))["miss"] == 1  # evicted: it ran again
    client.infer("cached", _inputs(a, b + 100 + CACHE_BYTES // ROW_BYTES - 1))  # the newest one stayed
    assert _delta(before, _counts(_stats(client, "cached")))["hit"] == 1


def test_a_model_without_enable_is_never_cached(server, client):
    a, b = _pair(4)
    before = _counts(_stats(client, "add_sub"))
    for _ in range(2):
        np.testing.assert_array_equal(client.infer("add_sub", _inputs(a, b)).as_numpy("OUTPUT0"), a + b)
    change = _delta(before, _counts(_stats(client, "add_sub")))
    assert change["hit"] == change["miss"] == 0 and change["inferences"] == 2
    metrics = _metrics(server)
    assert ("nv_cache_num_hits_per_model", "add_sub") not in metrics
    assert ("nv_cache_num_hits_per_model", "cached") in metrics


def test_grpc_hit_shows_in_its_statistics(server):
    require_grpc(server)
    a, b = _pair(5)
    with grpcclient.InferenceServerClient(server.grpc_url) as grpc:
        first = grpc.infer("cached", _inputs(a, b, module=grpcclient))
        before = grpc.get_inference_statistics("cached").model_stats[0]
        second = grpc.infer("cached", _inputs(a, b, module=grpcclient))
        after = grpc.get_inference_statistics("cached").model_stats[0]
    np.testing.assert_array_equal(second.as_numpy("OUTPUT1"), a - b)
    np.testing.assert_array_equal(second.as_numpy("OUTPUT0"), first.as_numpy("OUTPUT0"))
    assert after.inference_stats.cache_hit.count == before.inference_stats.cache_hit.count + 1
    assert after.inference_stats.cache_miss.count == before.inference_stats.cache_miss.count
    assert after.execution_count == before.execution_count and after.inference_count == before.inference_count


def test_concurrent_requests_each_hit_or_run_with_their_own_rows(server, client):
    """Alike requests arriving together (a frontend process may send them to the core as one group) are still
    looked up one by one: repeats all hit without an execution, new ones each get their own rows."""
    a, b = _pair(6)
    client.infer("cached", _inputs(a, b))
    before = _counts(_stats(client, "cached"))

    async def together(pairs: list[tuple[np.ndarray, np.ndarray]]) -> list:
        async with aiohttpclient.InferenceServerClient(server.http_url) as aio:
            return await asyncio.gather(*(aio.infer("cached", _inputs(x, y, module=aiohttpclient)) for x, y in pairs))

    for result in asyncio.run(together([(a, b)] * 12)):
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    change = _delta(before, _counts(_stats(client, "cached")))
    assert change["hit"] == 12 and change["executions"] == 0

    fresh = [(a, b + 1000 + i) for i in range(6)]
    for (x, y), result in zip(fresh, asyncio.run(together(fresh))):
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x + y)
    assert _delta(before, _counts(_stats(client, "cached")))["miss"] == 6


def test_a_hit_is_classified_as_its_own_request_asks(server, client):
    image = np.random.default_rng(7).standard_normal((1, 3, 32, 32)).astype(np.float32)
    tensor = httpclient.InferInput("INPUT", [1, 3, 32, 32], "FP32")
    tensor.set_data_from_numpy(image)
    probabilities = client.infer("cached_cnn", [tensor]).as_numpy("PROBABILITIES")
    before = _counts(_stats(client, "cached_cnn"))
    top = client.infer("cached_cnn", [tensor], outputs=[httpclient.InferRequestedOutput("PROBABILITIES",
                                                                                         class_count=3)])
    assert _delta(before, _counts(_stats(client, "cached_cnn")))["hit"] == 1
    expected = np.argsort(-probabilities[0], kind="stable")[:3]
    entries = [e.decode().split(":") for e in top.as_numpy("PROBABILITIES")[0]]
    assert [int(index) for _, index, _ in entries] == list(expected)
    assert [label for _, _, label in entries] == [examples.CNN_LABELS[i] for i in expected]


def test_a_hit_writes_system_shared_memory_outputs(server, client):
    """Triton caches host memory, system shared memory included: a hit's outputs land in the request's region."""
    a, b = _pair(8)
    size = a.nbytes
    key = f"/kiln_cache_{id(client)}"
    handle = shm.create_shared_memory_region("kiln_cache_out", key, 2 * size)
    try:
        client.register_system_shared_memory("kiln_cache_out", key, 2 * size)
        outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
                   httpclient.InferRequestedOutput("OUTPUT1", binary_data=True)]
        outputs[0].set_shared_memory("kiln_cache_out", size)
        outputs[1].set_shared_memory("kiln_cache_out", size, offset=size)
        client.infer("cached", _inputs(a, b), outputs=outputs)
        shm.set_shared_memory_region(handle, [np.zeros((2, 16), np.int32)])
        before = _counts(_stats(client, "cached"))
        client.infer("cached", _inputs(a, b), outputs=outputs)
        assert _delta(before, _counts(_stats(client, "cached")))["hit"] == 1
        np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.int32, [1, 16]), a + b)
        np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.int32, [1, 16], offset=size), a - b)
    finally:
        client.unregister_system_shared_memory("kiln_cache_out")
        shm.destroy_shared_memory_region(handle)


def test_an_ensemble_hit_skips_its_steps(server, client):
    a, b = _pair(9)
    first = client.infer("cached_ensemble", _inputs(a, b, names=("A", "B")))
    steps = _counts(_stats(client, "add_sub"))
    before = _counts(_stats(client, "cached_ensemble"))
    second = client.infer("cached_ensemble", _inputs(a, b, names=("A", "B")))
    assert _delta(before, _counts(_stats(client, "cached_ensemble")))["hit"] == 1
    assert _delta(steps, _counts(_stats(client, "add_sub")))["success"] == 0  # add_sub was not asked
    for name, expected in (("S", a + b), ("D", a - b)):
        np.testing.assert_array_equal(first.as_numpy(name), expected)
        np.testing.assert_array_equal(second.as_numpy(name), expected)


def test_an_unknown_cache_or_a_bad_setting_stops_the_server_with_the_reason(tmp_path: Path):
    for flags, reason in ((["--cache-config", "redis,host=localhost"], "unknown cache 'redis'"),
                          (["--cache-config=local,size=lots"], "must be a number of bytes")):
        done = subprocess.run([sys.executable, "-m", "server", "--model-repository", str(tmp_path), *flags],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and reason in done.stderr + done.stdout


# -- in-process ---------------------------------------------------------------------------------------------
def _request(a: np.ndarray, b: np.ndarray, model: str = "cached") -> InferRequest:
    return InferRequest(model, [InferInput("INPUT0", "INT32", a.shape, a), InferInput("INPUT1", "INT32", b.shape, b)])


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_repository(tmp_path_factory.mktemp("response_cache_core") / "models")


def _with_core(repository: Path, scenario, cache: CacheConfig | None = CacheConfig("local", CACHE_BYTES)):
    async def go():
        core = ServerCore(CoreOptions([str(repository)], model_control_mode="explicit", allow_client_shm=True,
                                      response_cache=cache))
        await core.start()
        try:
            await core.load_model("cached")
            return await scenario(core)
        finally:
            await core.stop()

    return asyncio.run(go())


def _core_counts(core: ServerCore) -> dict[str, int]:
    return _counts(core._version("cached").statistics.as_dict())


def test_identical_misses_in_flight_together_store_once_and_count_one_miss(repository: Path):
    """Triton's rule: the second insertion of a key finds it there (ALREADY_EXISTS) and counts no miss."""
    a, b = _pair(10)

    async def scenario(core: ServerCore):
        responses = await asyncio.gather(core.infer(_request(a, b)), core.infer(_request(a, b)))
        return responses, _core_counts(core), core.response_cache.counters()

    responses, counts, counters = _with_core(repository, scenario)
    assert all(np.array_equal(r.outputs[0].data, a + b) for r in responses)
    assert counts["miss"] == 1 and counts["hit"] == 0 and counts["success"] == 2
    assert counters.entries == 1 and counters.lookups == 2 and counters.misses == 2


def test_a_frontends_group_is_looked_up_member_by_member(repository: Path, tmp_path: Path):
    """Alike requests of one loop turn reach the core as one group (server/core/grouping.py); for a cached model
    each member is looked up and answered on its own: repeats hit, the new one runs, every id and row is its own."""
    a, b = _pair(13)
    requests = [_request(a, b), _request(a, b), _request(a, b + 1), _request(a, b)]
    for i, request in enumerate(requests):
        request.id = f"r{i}"

    async def scenario(core: ServerCore):
        service = CoreService(core, str(tmp_path / "core.sock"), InflightLimiter(0))
        await service.start()
        remote = RemoteCore(service.path)
        await remote.connect()
        try:
            await remote.infer(_request(a, b))
            before = _core_counts(core)
            responses = await asyncio.gather(*(remote.infer(r) for r in requests))
            return responses, _delta(before, _core_counts(core))
        finally:
            await remote.close()
            await service.stop()

    responses, change = _with_core(repository, scenario)
    for response, request in zip(responses, requests):
        x, y = (t.data for t in request.inputs)
        assert response.id == request.id
        np.testing.assert_array_equal(response.outputs[0].data, x + y)
    assert change["hit"] == 3 and change["miss"] == 1 and change["executions"] == 1


def test_loading_a_model_again_or_unloading_it_forgets_its_entries(repository: Path):
    """A reload may bring another model file under the same version: its answers are not taken from the cache."""
    a, b = _pair(14)

    async def scenario(core: ServerCore):
        await core.infer(_request(a, b))
        await core.infer(_request(a, b))  # a hit
        stored = core.response_cache.counters().entries
        await core.load_model("cached")
        reloaded = core.response_cache.counters().entries
        await core.infer(_request(a, b))  # the new version runs it
        counts = _core_counts(core)
        await core.unload_model("cached")
        return stored, reloaded, counts, core.response_cache.counters().entries

    stored, reloaded, counts, unloaded = _with_core(repository, scenario)
    assert (stored, reloaded, unloaded) == (1, 0, 0)
    assert counts["miss"] == 1 and counts["hit"] == 0 and counts["executions"] == 1


def test_a_step_of_a_sequence_bypasses_the_cache(repository: Path):
    """Its answer may depend on the sequence's state (an ensemble with a stateful step), not only on its inputs."""
    a, b = _pair(15)

    async def scenario(core: ServerCore):
        for parameters in ({"sequence_id": 7, "sequence_start": True}, {"sequence_id": 7}, {"sequence_id": "s"}):
            request = _request(a, b)
            request.parameters = dict(parameters)
            await core.infer(request)
        return _core_counts(core), core.response_cache.counters()

    counts, counters = _with_core(repository, scenario)
    assert counts["hit"] == counts["miss"] == 0 and counts["executions"] == 3 and counters.lookups == 0


def test_tensors_in_device_memory_bypass_the_cache(repository: Path, tmp_path: Path):
    """An input or output in a CUDA shared-memory region is neither looked up nor stored (Triton hashes and stores
    host memory only). No GPU here: a system region stands in, reported as CUDA by `is_cuda`."""
    a, b = _pair(11)
    handle = shm.create_shared_memory_region("kiln_device", f"/kiln_device_{id(tmp_path)}", a.nbytes)
    shm.set_shared_memory_region(handle, [a])

    async def scenario(core: ServerCore):
        await core.register_system_shared_memory("kiln_device", f"/kiln_device_{id(tmp_path)}", 0, a.nbytes)
        core.system_shm.is_cuda = lambda name: name == "kiln_device"
        request = lambda: InferRequest("cached", [  # noqa: E731
            InferInput("INPUT0", "INT32", a.shape, None, {"shared_memory_region": "kiln_device",
                                                          "shared_memory_byte_size": a.nbytes}),
            InferInput("INPUT1", "INT32", b.shape, b)])
        answers = [await core.infer(request()) for _ in range(2)]
        return answers, _core_counts(core), core.response_cache.counters()

    try:
        answers, counts, counters = _with_core(repository, scenario)
    finally:
        shm.destroy_shared_memory_region(handle)
    assert all(np.array_equal(r.outputs[0].data, a + b) for r in answers)
    assert counts["hit"] == counts["miss"] == 0 and counts["executions"] == 2
    assert counters.lookups == 0 and counters.entries == 0


def test_without_a_server_cache_an_enabled_model_loads_runs_uncached_and_says_so(repository: Path):
    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("kiln.server")
    logger.addHandler(handler)
    a, b = _pair(12)

    async def scenario(core: ServerCore):
        for _ in range(2):
            await core.infer(_request(a, b))
        return _core_counts(core)

    try:
        counts = _with_core(repository, scenario, cache=None)
    finally:
        logger.removeHandler(handler)
    assert counts["hit"] == counts["miss"] == 0 and counts["executions"] == 2
    assert any("model 'cached' enables response_cache, but the server has no cache" in m and "--cache-config" in m
               for m in records)


@pytest.mark.parametrize("counter_latencies", [True, False])
def test_per_model_cache_counters_follow_counter_latencies_and_the_gauges_stay(repository: Path,
                                                                               counter_latencies: bool):
    """Triton creates the per-model cache counters with its latency counters (--metrics-config
    counter_latencies=false leaves both out); the local cache's gauges are its own."""
    a, b = _pair(16)
    options = MetricsOptions(MetricsConfig(counter_latencies=counter_latencies), allow_gpu=False, allow_cpu=False)

    async def scenario(core: ServerCore):
        for _ in range(2):
            await core.infer(_request(a, b))
        return {family.name: family for family in InferenceMetricsCollector(core, options).collect()}

    families = _with_core(repository, scenario)
    assert ("nv_cache_num_hits_per_model" in families) is counter_latencies
    if counter_latencies:
        assert [(s.labels["model"], s.value) for s in families["nv_cache_num_hits_per_model"].samples] == [
            ("cached", 1.0)]
    assert families["nv_cache_num_entries"].samples[0].value == 1
    assert families["nv_cache_num_lookups"].samples[0].value == 2


def test_lru_keeps_recently_used_entries_within_its_byte_size():
    cache = ResponseCache(300)
    outputs = {name: {"OUT": np.full(25, i, np.int32)} for i, name in enumerate((b"a", b"b", b"c"))}  # 100 bytes
    for key, value in outputs.items():
        assert cache.insert(key, value) == InsertResult.STORED
    assert cache.counters().used == 300 and cache.counters().entries == 3
    cache._entries.move_to_end(b"a")  # as a hit would: "b" is now the least recently used
    assert cache.insert(b"d", {"OUT": np.zeros(50, np.int32)}) == InsertResult.STORED  # 200 bytes: b and c go
    assert set(cache._entries) == {b"a", b"d"} and cache.counters().used == 300 and cache.counters().evictions == 2
    assert cache.insert(b"a", outputs[b"a"]) == InsertResult.EXISTS
    assert cache.insert(b"e", {"OUT": np.zeros(76, np.int32)}) == InsertResult.TOO_LARGE  # 304 > 300
    assert cache.counters().entries == 2


def test_forget_drops_one_models_entries_and_their_bytes():
    cache = ResponseCache(1000)
    for key, model in ((b"1", "m"), (b"2", "n"), (b"3", "m")):
        cache.insert(key, {"y": np.zeros(10, np.float32)}, model)
    assert cache.forget("m") == 2
    assert set(cache._entries) == {b"2"} and cache.counters().used == 40 and cache.counters().evictions == 0


def test_lookup_counts_and_refreshes_and_stored_outputs_are_read_only_copies():
    cache = ResponseCache(10_000)
    batch = np.arange(32, dtype=np.float32).reshape(2, 16)
    inputs = {"x": np.ones((1, 4), np.float32)}
    first = cache.lookup("m", 1, inputs, ["y"])
    assert first is not None and first.outputs is None
    cache.insert(first.key, {"y": batch[1:]})  # a row of a batch's output
    batch[1] = -1  # the batch's buffer changes later: the cache kept its own copy
    hit = cache.lookup("m", 1, inputs, ["y"])
    assert hit is not None and hit.key == first.key
    np.testing.assert_array_equal(hit.outputs["y"], np.arange(16, 32, dtype=np.float32).reshape(1, 16))
    assert not hit.outputs["y"].flags.writeable and hit.outputs["y"].base is None
    counters = cache.counters()
    assert (counters.lookups, counters.hits, counters.misses, counters.used) == (2, 1, 1, 64)


def test_the_key_covers_model_version_inputs_and_requested_outputs_but_not_their_order():
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    key = request_key("m", 1, {"x": a, "z": a}, ["p", "q"])
    assert key == request_key("m", 1, {"z": a.copy(), "x": a}, ["q", "p"])
    assert key == request_key("m", 1, {"x": np.asfortranarray(a), "z": a}, ["p", "q"])  # layout is not data
    others = [request_key("n", 1, {"x": a, "z": a}, ["p", "q"]), request_key("m", 2, {"x": a, "z": a}, ["p", "q"]),
              request_key("m", 1, {"x": a + 1, "z": a}, ["p", "q"]),
              request_key("m", 1, {"x": a.reshape(3, 2), "z": a}, ["p", "q"]),
              request_key("m", 1, {"x": a.astype(np.uint32), "z": a}, ["p", "q"]),
              request_key("m", 1, {"y": a, "z": a}, ["p", "q"]), request_key("m", 1, {"x": a, "z": a}, ["p"])]
    assert len({key, *others}) == 1 + len(others)
    words = np.array([b"ab", b"c"], dtype=object)
    assert request_key("m", 1, {"s": words}, []) != request_key("m", 1, {"s": np.array([b"a", b"bc"], object)}, [])
    assert request_key("m", 1, {"x": object()}, []) is None  # not a host array (a device view): not cacheable


def test_entry_size_counts_output_bytes_as_the_wire_carries_them():
    assert entry_size({"a": np.zeros((2, 16), np.int32), "b": np.zeros(3, np.float16)}) == 128 + 6
    assert entry_size({"s": np.array([b"abc", b""], dtype=object)}) == 4 + 3 + 4


@pytest.mark.parametrize("flags, expected", [
    ([], None),
    (["--cache-config", "local,size=1048576"], CacheConfig("local", 1048576)),
    (["--cache-config=local,size=4096"], CacheConfig("local", 4096)),
    (["--response-cache-byte-size", "2048"], CacheConfig("local", 2048)),
    (["--response-cache-byte-size", "0"], None),
])
def test_cache_flags_as_triton_spells_them(flags: list[str], expected: CacheConfig | None):
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert cache_config(parser.parse_args(["--model-repository", "m", *flags])) == expected


@pytest.mark.parametrize("settings, message", [
    (["redis,host=localhost"], "unknown cache 'redis'; Kiln has only the 'local' cache"),
    (["local,size=1", "redis,port=6379"], "only a single cache is currently supported"),
    (["local,capacity=10"], "the local cache has no setting 'capacity'"),
    (["local,size="], "--cache-config option format is '<cache name>,<setting>=<value>'. Got local,size="),
    (["size=100"], "No cache specified. --cache-config option format is <cache name>,<setting>=<value>"),
    (["local,size=0"], "must be more than 0 bytes"),
    (["local,size=1M"], "must be a number of bytes"),
])
def test_bad_cache_configs_are_refused_with_what_to_write(settings: list[str], message: str):
    with pytest.raises(ValueError) as failure:
        parse_cache_config(settings)
    assert message in str(failure.value)


def test_both_cache_flags_together_are_refused():
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--model-repository", "m", "--response-cache-byte-size", "10",
                              "--cache-config", "local,size=10"])
    with pytest.raises(ValueError, match="Incompatible flags --response-cache-byte-size and --cache-config"):
        cache_config(args)


@pytest.mark.parametrize("other", ["sequence_batching { }", "model_transaction_policy { decoupled: true }"])
def test_the_cache_with_a_sequence_or_decoupled_model_is_refused_even_leniently(other: str):
    config = parse_config_text(f"response_cache {{ enable: true }}\n{other}", "m")
    with pytest.raises(ServerError) as failure:
        ConfigFieldCheck(lenient=True).check(config, "m")
    assert "config field 'response_cache.enable' (True) is refused: Response Cache does not currently support" in (
        failure.value.message)
