"""Generation loops as data-parallel replicas (`instance_group` count and gpus on a kiln_llm model): the router
(server/core/generation_replicas.py) with fake loops, placement with injected devices, and the tiny decoder with two
KIND_CPU loops, in process and on a real server: requests spread over both, greedy text as one loop's, statistics
and metrics summed. GPU placement on real GPUs is test_generative_gpu.py's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

import engine_core as kiln
from bench.generate_check import greedy
from engine_core.generate.generator import GenerationEvent, GeneratorStats
from engine_core.generate.sampling import SamplingParams
from server.core import executor_wire, generation_process, generative
from server.core.errors import ErrorKind, ServerError
from server.core.generation_replicas import Replicas, start_together, sum_stats
from server.core.generative_config import complete_generative_config, place_replicas
from server.core.model_config import parse_config_text
from server.core.placement import Devices
from server.repository import ModelSource

from .conftest import CONFIG, MAX_CONTEXT, MODEL, metric, run_server, wait_until_idle
from .conftest import generative as example

TWO_LOOPS = CONFIG.replace("{ kind: KIND_CPU }", "{ kind: KIND_CPU count: 2 }")
REPLICATED = "tiny_llm_x2"
PROMPTS = ["hello world", "the system is", "an assistant", "or the user", "is it", "we and you"]
STEPS = 12


# -- the router with fake loops ---------------------------------------------------------------------------------
class FakeLoop:
    """A generation loop that keeps each request's callback; the test ends requests with `finish`."""

    def __init__(self, blocks: int = 10, refuse: type[Exception] | None = None) -> None:
        self.callbacks: list = []
        self.closed = False
        self.refuse = refuse
        self.warmed_shapes, self.warm_up_seconds = 3, 1.5
        self._stats = GeneratorStats(running=1, waiting=2, kv_blocks_used=3, kv_blocks_total=blocks,
                                     prompt_tokens_total=5, completion_tokens_total=6, preemptions_total=1)

    def submit(self, prompt, params, on_event):
        if self.refuse is not None:
            raise self.refuse("refused")
        self.callbacks.append(on_event)
        return object()

    def stats(self) -> GeneratorStats:
        return self._stats

    def close(self) -> None:
        self.closed = True

    def finish(self, index: int) -> None:
        self.callbacks[index](GenerationEvent(7, "length", 1, 1))


def _submit(replicas: Replicas) -> None:
    replicas.submit([1, 2], SamplingParams(), lambda event: None)


def test_requests_go_to_the_replica_with_the_fewest_in_flight():
    loops = [FakeLoop(), FakeLoop()]
    replicas = Replicas(loops)
    for _ in range(3):
        _submit(replicas)
    assert replicas.in_flight == [2, 1] and replicas.submitted == [2, 1]
    loops[0].callbacks[0](GenerationEvent(5, None, 1, 1))  # a token, not the end: still in flight
    assert replicas.in_flight == [2, 1]
    loops[0].finish(0)
    loops[0].finish(1)
    assert replicas.in_flight == [0, 1]
    _submit(replicas)
    assert replicas.in_flight == [1, 1] and len(loops[0].callbacks) == 3
    _submit(replicas)  # a tie: the replica given fewer so far
    assert replicas.submitted == [3, 2]


def test_the_callback_sees_every_event_and_a_final_counts_out_once():
    loop = FakeLoop()
    replicas = Replicas([loop, FakeLoop()])
    seen: list[GenerationEvent] = []
    replicas.submit([1], SamplingParams(), seen.append)
    loop.finish(0)
    loop.finish(0)  # a second final event (it should not come) does not count the replica below zero
    assert [e.finish_reason for e in seen] == ["length", "length"] and replicas.in_flight == [0, 0]


def test_a_replica_that_refuses_hands_the_request_on_and_client_errors_are_raised():
    gone, alive = FakeLoop(refuse=RuntimeError), FakeLoop()
    replicas = Replicas([gone, alive])
    _submit(replicas)
    assert replicas.in_flight == [0, 1] and len(alive.callbacks) == 1
    with pytest.raises(RuntimeError):
        Replicas([FakeLoop(refuse=RuntimeError), FakeLoop(refuse=RuntimeError)]).submit([1], SamplingParams(),
                                                                                      lambda e: None)
    bad = Replicas([FakeLoop(refuse=ValueError), FakeLoop()])
    with pytest.raises(ValueError):
        _submit(bad)
    assert bad.in_flight == [0, 0]


def test_stats_sum_the_replicas_and_close_closes_all():
    loops = [FakeLoop(blocks=10), FakeLoop(blocks=20)]
    replicas = Replicas(loops)
    stats = replicas.stats()
    assert stats.kv_blocks_total == 30 and stats.running == 2 and stats.preemptions_total == 2
    assert dataclasses.asdict(sum_stats([loops[0].stats()])) == dataclasses.asdict(loops[0].stats())
    assert (replicas.warmed_shapes, replicas.warm_up_seconds) == (6, 1.5)
    replicas.close()
    assert all(loop.closed for loop in loops)


def test_start_together_closes_the_started_ones_when_one_fails():
    started = [FakeLoop(), FakeLoop()]
    barrier = threading.Barrier(3, timeout=10)  # all three start at once

    def ok(index: int):
        barrier.wait()
        return started[index]

    def failing():
        barrier.wait()
        raise ValueError("replica 1: not a decoder")

    with pytest.raises(ValueError, match="not a decoder"):
        start_together([lambda: ok(0), failing, lambda: ok(1)])
    assert all(loop.closed for loop in started)
    one = FakeLoop()
    assert start_together([lambda: one]) is one  # one replica: the generator itself, no router


# -- placement --------------------------------------------------------------------------------------------------
def _complete(text: str):
    return complete_generative_config(parse_config_text('backend: "kiln_llm"\n' + text, "m"), "m", 8)


def _gpus(count: int) -> Devices:
    return Devices(count, lambda ordinal: "sm_90")


def test_replicas_are_placed_as_triton_places_instances():
    config = _complete("instance_group [ { count: 2 kind: KIND_GPU gpus: [ 0, 1 ] } ]")
    assert place_replicas(config, "cuda", lambda: _gpus(2)) == [0, 1, 0, 1]  # GPUs alternate
    every = _complete("instance_group [ { count: 1 kind: KIND_GPU }, { count: 2 kind: KIND_GPU gpus: [ 2 ] } ]")
    assert place_replicas(every, "cuda", lambda: _gpus(3)) == [0, 1, 2, 2, 2]
    assert [list(g.gpus) for g in every.instance_group] == [[0, 1, 2], [2]]  # the completed config lists them
    assert [g.name for g in every.instance_group] == ["m_0", "m_1"]
    cpu = _complete("instance_group [ { count: 3 kind: KIND_CPU } ]")
    assert place_replicas(cpu, "cpu", lambda: _gpus(0)) == [None, None, None]


@pytest.mark.parametrize(("text", "backend", "words"), [
    ("instance_group [ { kind: KIND_GPU gpus: [ 0, 2 ] } ]", "cuda", ["GPU 2", "sees 2 CUDA device(s)"]),
    ("instance_group [ { gpus: [ 0, 1 ] } ]", "cpu", ["gpus [0, 1]", "cpu backend"]),
])
def test_placement_refuses_naming_the_gpu(text, backend, words):
    with pytest.raises(ServerError) as caught:
        place_replicas(_complete(text), backend, lambda: _gpus(2))
    assert caught.value.kind is ErrorKind.INVALID_ARGUMENT and all(w in caught.value.message for w in words)


def test_a_gpu_replica_runs_in_a_process_that_sees_its_gpu_first(monkeypatch: pytest.MonkeyPatch):
    made: list[dict] = []
    monkeypatch.setattr(generative, "RemoteGenerator", lambda path, **kwargs: made.append(kwargs) or "remote")
    monkeypatch.setattr(generative, "Generator", lambda engine, **kwargs: "in core")
    monkeypatch.setattr(generative, "build_decoder_engine", lambda path, **kwargs: "engine")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    monkeypatch.setenv("KILN_GENERATION_PROCESS", "0")
    build = {"backend": "cuda"}
    assert generative._start_replica(Path("m.onnx"), build, {}, "l", 2, 3) == "remote"  # not GPU 0: a process
    assert made[-1]["env"] == {"CUDA_VISIBLE_DEVICES": "6,4,5"}
    assert generative._start_replica(Path("m.onnx"), build, {}, "l", 0, 3) == "in core"  # as KILN_GENERATION_PROCESS
    monkeypatch.delenv("KILN_GENERATION_PROCESS")
    assert generative._start_replica(Path("m.onnx"), build, {}, "l", 0, 3) == "remote"
    assert made[-1]["env"] == {"CUDA_VISIBLE_DEVICES": "4,5,6"}
    assert generative._start_replica(Path("m.onnx"), {"backend": "cpu"}, {}, "l", None, 0) == "in core"


def test_the_generation_process_gets_the_replicas_environment(monkeypatch: pytest.MonkeyPatch):
    seen: dict = {}

    def popen(*args, env, **kwargs):
        seen.update(env)
        raise OSError("not started in this test")

    monkeypatch.setattr(executor_wire.subprocess, "Popen", popen)  # child_launch starts every child process
    with pytest.raises(OSError):
        generation_process.RemoteGenerator(Path("m.onnx"), build={}, generator={}, label="l",
                                           env={"CUDA_VISIBLE_DEVICES": "1,0"})
    assert seen["CUDA_VISIBLE_DEVICES"] == "1,0" and "PYTHONPATH" in seen


# -- the tiny decoder with two loops ----------------------------------------------------------------------------
def _load(repository: Path, config_text: str) -> dict:
    source = ModelSource(MODEL, repository / MODEL, None, {1: repository / MODEL / "1"})
    return asyncio.run(generative.load_versions(source, parse_config_text(config_text, MODEL), 8))


def test_two_cpu_loops_share_the_requests_and_give_one_loops_tokens(llm_repository: Path, tokenizer):
    version = _load(llm_repository, TWO_LOOPS)[1]
    try:
        replicas = version.generator
        assert isinstance(replicas, Replicas) and len(replicas.replicas) == 2
        prompts = [tokenizer.encode(p) for p in PROMPTS]
        expected = [example.reference_greedy(llm_repository / MODEL / "1", ids, STEPS) for ids in prompts]
        with ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(lambda ids: greedy(replicas, ids, STEPS, 60), prompts)) == expected
        each = [loop.stats() for loop in replicas.replicas]
        assert all(s.completion_tokens_total > 0 for s in each), each  # both replicas generated
        assert sum(replicas.submitted) == len(prompts) and replicas.in_flight == [0, 0]
        total = replicas.stats()
        assert total.completion_tokens_total == len(prompts) * STEPS
        assert total.kv_blocks_total == 2 * each[0].kv_blocks_total
    finally:
        version.close()


def test_one_loop_is_the_generator_itself(llm_repository: Path):
    version = _load(llm_repository, CONFIG)[1]
    try:
        assert not isinstance(version.generator, Replicas)
    finally:
        version.close()


@pytest.mark.skipif("cuda" in kiln.available_backends(), reason="a machine without GPUs refuses them")
@pytest.mark.parametrize(("group", "words"), [
    ("{ kind: KIND_GPU gpus: [ 0, 1 ] count: 2 }", ["KIND_GPU needs a GPU"]),
    ("{ gpus: [ 0, 1 ] count: 2 }", ["gpus [0, 1]", "cpu backend"]),
])
def test_gpus_on_a_machine_without_gpus_fail_the_load_saying_why(llm_repository: Path, group: str, words):
    with pytest.raises(ServerError) as caught:
        _load(llm_repository, CONFIG.replace("{ kind: KIND_CPU }", group))
    assert caught.value.kind is ErrorKind.INVALID_ARGUMENT and all(w in caught.value.message for w in words)


# -- a real server ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def replicated_server(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("replicas")
    repository = base / "models"
    example.write_tiny_decoder(repository / REPLICATED / "1", max_positions=MAX_CONTEXT)
    (repository / REPLICATED / "config.pbtxt").write_text(TWO_LOOPS)
    with run_server(repository, base / "server.log", [REPLICATED]) as server:
        yield server


def test_a_server_serves_two_loops_with_summed_metrics(replicated_server, tokenizer):
    server = replicated_server
    config = httpx.get(f"{server.base_url}/v2/models/{REPLICATED}/config", timeout=10).json()
    assert [(g["kind"], g["count"]) for g in config["instance_group"]] == [("KIND_CPU", 2)]
    directory = server.repository / REPLICATED / "1"
    expected = [tokenizer.decode(example.reference_greedy(directory, tokenizer.encode(p), STEPS)) for p in PROMPTS]

    def generate(prompt: str) -> str:
        body = {"text_input": prompt, "exclude_input_in_output": True,
                "parameters": {"max_tokens": STEPS, "temperature": 0, "ignore_eos": True}}
        answer = httpx.post(f"{server.base_url}/v2/models/{REPLICATED}/generate", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        return answer.json()["text_output"]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        assert list(pool.map(generate, PROMPTS)) == expected
    wait_until_idle(server, model=REPLICATED)
    assert metric(server, "kiln_kv_cache_blocks_total", model=REPLICATED) == 2 * 4 * MAX_CONTEXT // 8
    assert metric(server, "kiln_generation_tokens_total", kind="completion", model=REPLICATED) == len(PROMPTS) * STEPS
    assert "2 replicas: CPU, CPU" in server.log_path.read_text()
