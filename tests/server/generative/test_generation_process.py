"""The generation loop in a process of its own (server/core/generation_process.py) on the tiny decoder's CPU engine:
the same tokens and refusals as the in-process Generator, cancellation, statistics, a load that fails with the
process's message, and a process that dies: its sequences end with an error and the version refuses new ones."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from engine_core.generate import build_decoder_engine
from engine_core.generate.generator import GenerationEvent, Generator
from engine_core.generate.sampling import SamplingParams
from server.core.generation_process import RemoteGenerator, use_process

from .conftest import generative

CONTEXT = 64
GENERATOR = {"max_batch_size": 4, "max_context": CONTEXT, "eos_token_ids": (), "block_tokens": 8}
BUILD = {"max_batch_size": 4, "max_context": CONTEXT, "backend": "cpu"}
PROMPTS = [[5, 6, 7], [40, 41], [100, 3, 9, 12, 15]]


class Collected:
    """One sequence's events, and when its last one came."""

    def __init__(self) -> None:
        self.events: list[GenerationEvent] = []
        self.done = threading.Event()

    def __call__(self, event: GenerationEvent) -> None:
        self.events.append(event)
        if event.final:
            self.done.set()

    @property
    def tokens(self) -> list[int]:
        return [e.token_id for e in self.events if e.token_id is not None]


@pytest.fixture(scope="module")
def decoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generative.write_tiny_decoder(tmp_path_factory.mktemp("process_decoder"), max_positions=CONTEXT) \
        / "model.onnx"


@pytest.fixture
def remote(decoder: Path):
    generator = RemoteGenerator(decoder, build=BUILD, generator=GENERATOR, label="model 'tiny' version 1")
    yield generator
    generator.close()


def _run(generator, prompts: list[list[int]], max_tokens: int = 12) -> list[Collected]:
    runs = [Collected() for _ in prompts]
    for prompt, run in zip(prompts, runs):
        generator.submit(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), run)
    for run in runs:
        assert run.done.wait(60)
    return runs


def test_the_process_generates_the_in_process_generators_tokens(decoder, remote):
    with Generator(build_decoder_engine(decoder, **BUILD), **GENERATOR) as local:
        want = [run.tokens for run in _run(local, PROMPTS)]
    got = _run(remote, PROMPTS)
    assert [run.tokens for run in got] == want and all(len(t) == 12 for t in want)
    assert [run.events[-1].finish_reason for run in got] == ["length"] * 3
    assert remote.vocab_size > 200 and remote.warmed_shapes == 0  # a CPU engine captures nothing
    stats = remote.stats()
    assert stats.running == stats.waiting == stats.kv_blocks_used == 0 and stats.completion_tokens_total == 36


def test_refusals_and_cancellation_come_from_the_process(remote):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        remote.submit([10 ** 6], SamplingParams(max_tokens=2), Collected())
    with pytest.raises(ValueError, match="exceed the model's context of 64 tokens"):
        remote.submit([1, 2, 3], SamplingParams(max_tokens=CONTEXT), Collected())
    run = Collected()
    handle = remote.submit([1, 2, 3], SamplingParams(max_tokens=CONTEXT - 8, temperature=0.0), run)
    handle.cancel()
    handle.cancel()
    assert run.done.wait(60) and run.events[-1].finish_reason in ("cancelled", "length")
    assert handle.cancelled and remote.stats().kv_blocks_used == 0


def test_a_model_that_is_no_decoder_fails_its_load_with_the_processes_message(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    onnx.save(helper.make_model(graph), str(tmp_path / "model.onnx"))
    with pytest.raises(ValueError, match=r"input 'x' \(shape \[1\]\) is not one a decoder with a KV cache has"):
        RemoteGenerator(tmp_path / "model.onnx", build=BUILD, generator=GENERATOR, label="model 'x' version 1")


def test_a_process_that_dies_ends_its_sequences_and_refuses_new_ones(remote):
    run = Collected()
    remote.submit([1, 2, 3], SamplingParams(max_tokens=CONTEXT - 8, temperature=0.0), run)
    os.kill(remote._process.pid, signal.SIGKILL)
    assert run.done.wait(30)
    assert run.events[-1].finish_reason in ("error", "length")
    with pytest.raises(RuntimeError, match="the generation process exited"):
        remote.submit([1, 2], SamplingParams(max_tokens=2), Collected())
    remote.close()
    with pytest.raises(RuntimeError, match="closed"):
        remote.submit([1, 2], SamplingParams(max_tokens=2), Collected())


def test_cuda_models_get_a_process_and_the_switch_overrides_it(monkeypatch):
    monkeypatch.delenv("KILN_GENERATION_PROCESS", raising=False)
    assert use_process("cuda") and not use_process("cpu")
    monkeypatch.setenv("KILN_GENERATION_PROCESS", "0")
    assert not use_process("cuda")
    monkeypatch.setenv("KILN_GENERATION_PROCESS", "1")
    assert use_process("cpu")
