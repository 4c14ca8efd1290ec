"""The Generator on the tiny decoder (CPU engine): greedy tokens equal a full recompute without a KV cache while
sequences of different lengths are prefilled together or in chunks, decode together, join mid-way and leave;
cancellation and the end of a sequence free its KV blocks; a full cache queues sequences; seeds reproduce. The GPU
test compares CUDA engines with the CPU's."""

from __future__ import annotations

import itertools
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import engine_core as kiln
from engine_core.generate import (
    DecoderRunner,
    DecoderSignature,
    GenerationEvent,
    Generator,
    SamplingParams,
    Tokenizer,
    build_decoder_engine,
    render_chat,
)
from tests.engine import models
from tests.engine.util import build
from tests.generate.conftest import generative

PROMPTS = [[1, 2, 3], [50, 60, 70, 80, 90, 100, 110], [300], list(range(100, 125))]
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
TIMEOUT = 30


class Events:
    """Collects one sequence's events; ``wait`` blocks until the final one."""

    def __init__(self, log: list | None = None, name: str = "", then=None) -> None:
        self.events: list[GenerationEvent] = []
        self.done = threading.Event()
        self.log, self.name, self.then = log, name, then

    def __call__(self, event: GenerationEvent) -> None:
        self.events.append(event)
        if self.log is not None:
            self.log.append((self.name, event.final))
        if self.then is not None:
            self.then(self, event)
        if event.final:
            self.done.set()

    def wait(self) -> Events:
        assert self.done.wait(TIMEOUT), "no final event"
        return self

    @property
    def tokens(self) -> list[int]:
        return [e.token_id for e in self.events if e.token_id is not None]

    @property
    def last(self) -> GenerationEvent:
        return self.events[-1]


@pytest.fixture(scope="module")
def references(tiny_decoder: Path) -> list[list[int]]:
    return [generative.reference_greedy(tiny_decoder, p, 32) for p in PROMPTS]


def _generator(engine, **kwargs) -> Generator:
    options = {"max_batch_size": 4, "max_context": 64, "eos_token_ids": ()} | kwargs
    return Generator(engine, **options)


def _record_runs(monkeypatch) -> list[tuple]:
    """Log every engine run the generator makes: ("prefill", sequence ids, chunk lengths) or ("decode", ids)."""
    runs: list[tuple] = []
    prefill, decode = DecoderRunner.prefill, DecoderRunner.decode

    def logged_prefill(self, pool, seqs, chunks, **options):
        runs.append(("prefill", list(seqs), [len(c) for c in chunks]))
        return prefill(self, pool, seqs, chunks, **options)

    def logged_decode(self, pool, seqs, tokens, **options):
        runs.append(("decode", list(seqs)))
        return decode(self, pool, seqs, tokens, **options)

    monkeypatch.setattr(DecoderRunner, "prefill", logged_prefill)
    monkeypatch.setattr(DecoderRunner, "decode", logged_decode)
    return runs


def test_the_tiny_decoder_is_not_degenerate(references):
    for tokens in references:
        assert len(set(tokens)) > 12, tokens  # greedy wanders: no one token repeated forever


@pytest.mark.parametrize("budget", [512, 5], ids=["whole_prompts", "chunks_of_5"])
@pytest.mark.parametrize("position_ids", [True, False], ids=["position_ids", "positions_from_mask"])
def test_concurrent_greedy_equals_full_recompute(tmp_path, monkeypatch, position_ids, budget):
    directory = generative.write_tiny_decoder(tmp_path, seed=1, position_ids=position_ids)
    engine = build_decoder_engine(directory / "model.onnx", max_batch_size=4, max_context=64)
    assert DecoderSignature.from_engine(engine).has_position_ids is position_ids
    runs = _record_runs(monkeypatch)
    with _generator(engine, max_prefill_tokens=budget) as generator:
        results = [Events() for _ in PROMPTS]
        for prompt, events in zip(PROMPTS, results):
            generator.submit(prompt, GREEDY, events)
        for prompt, events in zip(PROMPTS, results):
            assert events.wait().tokens == generative.reference_greedy(directory, prompt, 32)
            assert events.last == GenerationEvent(events.tokens[-1], "length", len(prompt), 32)
            assert [e.completion_tokens for e in events.events] == list(range(1, 33))
            assert not any(e.final for e in events.events[:-1])
        # the sequences decoded together, their pasts of different lengths left-padded
        assert max(len(run[1]) for run in runs if run[0] == "decode") == 4
        stats = generator.stats()
    assert (stats.running, stats.waiting, stats.kv_blocks_used) == (0, 0, 0)
    assert stats.prompt_tokens_total == sum(map(len, PROMPTS)) and stats.completion_tokens_total == 4 * 32


def test_a_sequence_joining_mid_decode_still_matches(tiny_engine, references):
    with _generator(tiny_engine) as generator:
        late = Events()

        def join_after_five(events: Events, event: GenerationEvent) -> None:
            if event.completion_tokens == 5:
                generator.submit(PROMPTS[3], GREEDY, late)

        first = Events(then=join_after_five)
        generator.submit(PROMPTS[1], GREEDY, first)
        assert first.wait().tokens == references[1]
        assert late.wait().tokens == references[3]


def test_waiting_prompts_of_different_lengths_are_prefilled_in_one_run(tiny_engine, references, monkeypatch):
    runs = _record_runs(monkeypatch)
    blocked, release = threading.Event(), threading.Event()

    def hold_the_loop(events: Events, event: GenerationEvent) -> None:
        blocked.set()
        assert release.wait(TIMEOUT)

    with _generator(tiny_engine) as generator:
        generator.submit([5], SamplingParams(max_tokens=1), Events(then=hold_the_loop))
        assert blocked.wait(TIMEOUT)  # the loop is in the blocker's last event: the prompts below queue up
        results = [Events() for _ in PROMPTS]
        for prompt, events in zip(PROMPTS, results):
            generator.submit(prompt, GREEDY, events)
        release.set()
        for events, reference in zip(results, references):
            assert events.wait().tokens == reference
        assert generator.stats().kv_blocks_used == 0
    assert runs[:3] == [("prefill", [0], [1]), ("prefill", [1, 2, 3, 4], [3, 7, 1, 25]), ("decode", [1, 2, 3, 4])]


def test_a_long_prompt_is_prefilled_in_chunks_between_decode_steps(tiny_decoder, tiny_engine, references,
                                                                    monkeypatch):
    runs = _record_runs(monkeypatch)
    long_prompt = list(range(200, 240))  # 40 tokens: 5 chunks of 8
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    with _generator(tiny_engine, max_prefill_tokens=8) as generator:
        late = Events()

        def join_after_three(events: Events, event: GenerationEvent) -> None:
            if event.completion_tokens == 3:
                generator.submit(long_prompt, params, late)

        early = [Events(), Events(then=join_after_three)]  # the second: both decode when the long one joins
        generator.submit(PROMPTS[0], GREEDY, early[0])
        generator.submit(PROMPTS[2], GREEDY, early[1])
        assert early[0].wait().tokens == references[0]
        assert early[1].wait().tokens == references[2]
        assert late.wait().tokens == generative.reference_greedy(tiny_decoder, long_prompt, 20)
        assert late.events[0].completion_tokens == 1
        assert generator.stats().kv_blocks_used == 0
    prefills = [run for run in runs if run[0] == "prefill"]
    assert all(len(run[1]) * max(run[2]) <= 8 for run in prefills)  # the budget holds, pads included
    chunked = [i for i, run in enumerate(runs) if 2 in run[1] and run[0] == "prefill"]
    assert [runs[i][2] for i in chunked] == [[8]] * 5
    for before, after in itertools.pairwise(chunked):  # the running sequences got a token between two chunks
        assert [run for run in runs[before + 1:after] if run[0] == "decode"] == [("decode", [0, 1])]


def test_cancelling_between_chunks_frees_the_blocks(tiny_engine, monkeypatch):
    handles, submitted, fed = {}, threading.Event(), []
    prefill = DecoderRunner.prefill

    def cancel_after_the_first_chunk(self, pool, seqs, chunks, **options):
        logits = prefill(self, pool, seqs, chunks, **options)
        fed.append([len(c) for c in chunks])
        assert submitted.wait(TIMEOUT)
        handles["long"].cancel()
        return logits

    monkeypatch.setattr(DecoderRunner, "prefill", cancel_after_the_first_chunk)
    with _generator(tiny_engine, max_prefill_tokens=8) as generator:
        events = Events()
        handles["long"] = generator.submit(list(range(200, 240)), SamplingParams(max_tokens=10), events)
        submitted.set()
        assert events.wait().events == [GenerationEvent(None, "cancelled", 40, 0)]
        stats = generator.stats()
    assert (stats.running, stats.kv_blocks_used) == (0, 0)
    assert fed == [[8]]


def test_cancel_frees_the_blocks(tiny_engine):
    with _generator(tiny_engine) as generator:
        handles, submitted = {}, threading.Event()

        def cancel_after_three(events: Events, event: GenerationEvent) -> None:
            if event.completion_tokens == 3:
                assert submitted.wait(TIMEOUT)
                handles["running"].cancel()

        running = Events(then=cancel_after_three)
        handles["running"] = generator.submit(PROMPTS[0], SamplingParams(max_tokens=50, temperature=0), running)
        submitted.set()
        assert running.wait().last == GenerationEvent(None, "cancelled", 3, 3)
        assert len(running.events) == 4
        handles["running"].cancel()  # again, after the end: nothing happens
        stats = generator.stats()
        assert (stats.running, stats.kv_blocks_used) == (0, 0)


def test_a_full_cache_queues_sequences_until_blocks_free(tiny_engine, references):
    # 2 blocks of 16 tokens: a prompt of 25 tokens takes both at admission, the next waits for it to end
    order: list[tuple[str, bool]] = []
    params = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
    with _generator(tiny_engine, block_tokens=16, num_blocks=2) as generator:
        seen, submitted = {}, threading.Event()

        def watch(events: Events, event: GenerationEvent) -> None:
            if event.completion_tokens == 1:
                assert submitted.wait(TIMEOUT)
                seen["stats"] = generator.stats()

        first, second = Events(order, "first", then=watch), Events(order, "second")
        generator.submit(PROMPTS[3], params, first)
        generator.submit(PROMPTS[1], params, second)
        submitted.set()
        assert first.wait().tokens == references[3][:7]
        assert second.wait().tokens == references[1][:7]
        assert order.index(("first", True)) < order.index(("second", False))
        assert (seen["stats"].running, seen["stats"].waiting, seen["stats"].kv_blocks_used) == (1, 1, 2)
        assert generator.stats().kv_blocks_used == 0


def test_cancelling_a_waiting_sequence_ends_it_without_tokens(tiny_engine):
    with _generator(tiny_engine, block_tokens=16, num_blocks=2) as generator:
        handles, submitted = {}, threading.Event()

        def cancel_the_waiting_one(events: Events, event: GenerationEvent) -> None:
            if event.completion_tokens == 2:
                assert submitted.wait(TIMEOUT)
                handles["waiting"].cancel()

        first, waiting = Events(then=cancel_the_waiting_one), Events()  # the first's 25 tokens take both blocks
        generator.submit(PROMPTS[3], SamplingParams(max_tokens=7, temperature=0), first)
        handles["waiting"] = generator.submit(PROMPTS[1], SamplingParams(max_tokens=20, temperature=0), waiting)
        submitted.set()
        assert waiting.wait().events == [GenerationEvent(None, "cancelled", len(PROMPTS[1]), 0)]
        first.wait()
        assert generator.stats().prompt_tokens_total == len(PROMPTS[3])  # the cancelled one never ran


def test_requests_that_can_never_run_are_refused(tiny_engine):
    with _generator(tiny_engine, block_tokens=8, num_blocks=3) as generator:
        def submit(prompt, max_tokens=4):
            generator.submit(prompt, SamplingParams(max_tokens=max_tokens), lambda event: None)

        with pytest.raises(ValueError, match="the prompt is empty"):
            submit([])
        with pytest.raises(ValueError, match=r"prompt token id 310 is outside the vocabulary \(0..309\)"):
            submit([1, 310])
        with pytest.raises(ValueError, match="prompt token id -1 is outside"):
            submit([-1])
        with pytest.raises(ValueError, match="60 tokens \\+ max_tokens 5 exceed the model's context of 64 tokens"):
            submit([1] * 60, max_tokens=5)
        with pytest.raises(ValueError, match="need 4 KV cache blocks; the cache has 3"):
            submit([1] * 20, max_tokens=10)
        submit([1] * 20, max_tokens=4)  # 24 tokens: 3 blocks, fits
    with pytest.raises(RuntimeError, match="closed"):
        generator.submit([1], SamplingParams(), lambda event: None)


@pytest.mark.parametrize("budget", [512, 3], ids=["whole_prompts", "chunks_of_3"])
def test_seeded_sampling_reproduces_whatever_runs_beside_it(tiny_engine, budget):
    params = SamplingParams(max_tokens=24, temperature=1.5, top_k=40, seed=11, ignore_eos=True)
    with _generator(tiny_engine) as alone_generator:
        alone = Events()
        alone_generator.submit(PROMPTS[2], params, alone)
        alone.wait()
    with _generator(tiny_engine, max_prefill_tokens=budget) as generator:
        crowd = [Events() for _ in range(4)]
        generator.submit(PROMPTS[0], GREEDY, crowd[0])
        generator.submit(PROMPTS[2], params, crowd[1])
        generator.submit(PROMPTS[3], SamplingParams(max_tokens=10, temperature=1.0, seed=3), crowd[2])
        generator.submit(PROMPTS[2], SamplingParams(max_tokens=24, temperature=1.5, top_k=40, seed=12,
                                                    ignore_eos=True), crowd[3])
        for events in crowd:
            events.wait()
    assert crowd[1].tokens == alone.tokens
    assert crowd[3].tokens != alone.tokens


def test_eos_and_stop_tokens_end_a_sequence(tiny_engine, references):
    reference = references[1]
    index = next(i for i in range(3, 32) if reference[i] not in reference[:i])  # a token's first appearance
    stop = reference[index]
    with _generator(tiny_engine, eos_token_ids=[stop]) as generator:
        by_eos, ignoring, by_stop = Events(), Events(), Events()
        generator.submit(PROMPTS[1], SamplingParams(max_tokens=32, temperature=0), by_eos)
        generator.submit(PROMPTS[1], GREEDY, ignoring)
        generator.submit(PROMPTS[1], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True,
                                                    stop_token_ids=(stop,)), by_stop)
        for events in (by_eos, by_stop):
            assert events.wait().tokens == reference[:index]  # the stop token is counted, not sent
            assert events.last == GenerationEvent(None, "stop", len(PROMPTS[1]), index + 1)
        assert ignoring.wait().tokens == reference


def test_close_cancels_what_is_left(tiny_engine):
    generator = _generator(tiny_engine, max_batch_size=1)
    started = threading.Event()

    def slowly(events: Events, event: GenerationEvent) -> None:
        started.set()
        time.sleep(0.01)  # 60 tokens take far longer than the close below

    running = Events(then=slowly)
    waiting = Events()
    generator.submit(PROMPTS[0], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True), running)
    generator.submit(PROMPTS[1], SamplingParams(max_tokens=10), waiting)
    assert started.wait(TIMEOUT)
    generator.close()
    assert running.wait().last.finish_reason == "cancelled" and running.last.token_id is None
    assert waiting.wait().events == [GenerationEvent(None, "cancelled", len(PROMPTS[1]), 0)]
    generator.close()  # idempotent


def test_a_failing_event_handler_ends_only_its_sequence(tiny_engine, references):
    def broken(event: GenerationEvent) -> None:
        raise RuntimeError("client went away")

    with _generator(tiny_engine) as generator:
        healthy = Events()
        generator.submit(PROMPTS[0], GREEDY, broken)
        generator.submit(PROMPTS[2], GREEDY, healthy)
        assert healthy.wait().tokens == references[2]
        assert generator.stats().kv_blocks_used == 0


def test_engine_failures_end_sequences_with_an_error(tiny_engine, monkeypatch):
    def fail(*args, **kwargs):
        raise kiln.ExecutionError("device lost")

    monkeypatch.setattr(DecoderRunner, "step", fail)
    with _generator(tiny_engine) as generator:
        events = Events()
        generator.submit(PROMPTS[0], GREEDY, events)
        last = events.wait().last
        assert (last.finish_reason, str(last.error), last.token_id) == ("error", "device lost", None)
        assert generator.stats().kv_blocks_used == 0


def test_models_without_a_kv_cache_are_refused(tiny_engine, tmp_path):
    plain = tmp_path / "mlp.onnx"
    plain.write_bytes(models.mlp().SerializeToString())
    with pytest.raises(ValueError, match="input 'x' .* is not one a decoder with a KV cache has"):
        build_decoder_engine(plain, max_batch_size=2, max_context=8)
    engine = kiln.Runtime().deserialize_cuda_engine(build(models.mlp(), {"x": ((1, 16), (2, 16), (4, 16))}))
    with pytest.raises(ValueError, match="no input 'input_ids'"):
        DecoderSignature.from_engine(engine)
    with pytest.raises(ValueError, match="within the engine's profile: 4 sequences, 64 tokens"):
        Generator(tiny_engine, max_batch_size=8, max_context=64, eos_token_ids=())
    with pytest.raises(ValueError, match="max_prefill_tokens must be at least 1, not 0"):
        Generator(tiny_engine, max_batch_size=4, max_context=64, eos_token_ids=(), max_prefill_tokens=0)


def test_the_tiny_decoders_tokenizer_files_agree(tiny_decoder):
    """Hugging Face tokenizers and Kiln's Tokenizer read the example's tokenizer.json alike; its special tokens,
    eos ids and ChatML template are where a real chat model has them."""
    from tokenizers import Tokenizer as HFTokenizer

    vocab = generative.tokenizer_vocab()
    reference = HFTokenizer.from_file(str(tiny_decoder / "tokenizer.json"))
    tokenizer = Tokenizer.from_directory(tiny_decoder)
    text = "<|im_start|>user\nhello world, the system is café<|im_end|>\n"
    assert tokenizer.encode(text) == reference.encode(text).ids
    assert tokenizer.decode(reference.encode(text).ids, skip_special_tokens=False) == text
    assert tokenizer.vocab_size == reference.get_vocab_size() == len(vocab)
    assert tokenizer.eos_token_ids == {vocab["<|im_end|>"]} and tokenizer.bos_token_id == vocab["<|endoftext|>"]
    generation = json.loads((tiny_decoder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [vocab["<|im_end|>"], vocab["<|endoftext|>"]]
    chat = render_chat(tokenizer.chat_template, [{"role": "user", "content": "hi"}])
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_the_signature_describes_the_cache(tiny_engine):
    assert DecoderSignature.from_engine(tiny_engine) == DecoderSignature(
        layers=2, kv_heads=2, head_dim=16, vocab_size=len(generative.tokenizer_vocab()), has_position_ids=True,
        kv_dtype=np.dtype(np.float32), has_logits_rows=True)  # the head runs for the rows read (logits_rows.py)


@pytest.mark.gpu
@pytest.mark.parametrize("budget", [512, 5], ids=["whole_prompts", "chunks_of_5"])
@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16"])
def test_cuda_engine_generates_the_cpu_engines_tokens(tiny_decoder, tiny_engine, fp16, budget):
    """The tiny decoder built for CUDA (fp32 without TF32, or fp16) generates the CPU engine's greedy tokens while
    four sequences are prefilled together (padded runs) or in chunks and decode together."""
    cuda = build_decoder_engine(tiny_decoder / "model.onnx", max_batch_size=4, max_context=64, backend="cuda",
                                fp16=fp16, tf32=False)
    results = {}
    for name, engine in (("cpu", tiny_engine), ("cuda", cuda)):
        with _generator(engine, max_prefill_tokens=budget) as generator:
            runs = [Events() for _ in PROMPTS]
            for prompt, events in zip(PROMPTS, runs):
                generator.submit(prompt, GREEDY, events)
            results[name] = [events.wait().tokens for events in runs]
            assert generator.stats().kv_blocks_used == 0
    steps = 16 if fp16 else 32  # fp16 logits may swap a near tie late in a sequence
    assert [t[:steps] for t in results["cuda"]] == [t[:steps] for t in results["cpu"]]


# -- penalties and log-probabilities --------------------------------------------------------------------------------
def reference_penalized_greedy(directory: Path, prompt: list[int], params: SamplingParams
                                ) -> tuple[list[int], list[np.ndarray]]:
    """reference_greedy's loop (onnxruntime, the whole sequence each step, no KV cache) choosing the argmax of the
    penalised logits (test_sampling's numpy reference): the tokens and each step's raw logits."""
    import onnxruntime as ort

    from tests.generate.test_sampling import reference_penalized

    session = ort.InferenceSession(str(directory / "model.onnx"), providers=["CPUExecutionProvider"])
    pasts = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32)
             for i in session.get_inputs() if i.name.startswith("past_key_values.")}
    tokens, rows = [], []
    for _ in range(params.max_tokens):
        ids = [*prompt, *tokens]
        feeds = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, len(ids)), np.int64),
                 "position_ids": np.arange(len(ids), dtype=np.int64)[None], **pasts}
        row = session.run(["logits"], feeds)[0][0, -1]
        rows.append(row)
        tokens.append(int(np.argmax(reference_penalized(row, prompt, tokens, params))))
    return tokens, rows


def test_penalised_greedy_sequences_and_their_logprobs_match_the_reference(tiny_decoder, tiny_engine, references):
    from tests.generate.test_sampling import log_softmax

    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, repetition_penalty=1.5,
                            frequency_penalty=0.5, presence_penalty=0.3, logprobs=3)
    with _generator(tiny_engine) as generator:
        plain, penalised = [Events() for _ in PROMPTS[:2]], [Events() for _ in PROMPTS[:2]]
        for prompt, events, other in zip(PROMPTS, penalised, plain):  # batched with unpenalised sequences
            generator.submit(prompt, params, events)
            generator.submit(prompt, GREEDY, other)
        for prompt, events, other, reference in zip(PROMPTS, penalised, plain, references):
            tokens, rows = reference_penalized_greedy(tiny_decoder, prompt, params)
            assert events.wait().tokens == tokens != reference[:20]
            assert other.wait().tokens == reference and all(e.logprobs is None for e in other.events)
            for event, token, row in zip(events.events, tokens, rows):
                assert event.logprobs is not None
                expected = log_softmax(row)
                assert event.logprobs.logprob == pytest.approx(expected[token], abs=1e-4)
                assert [t for t, _ in event.logprobs.top] == np.argsort(-expected, kind="stable")[:3].tolist()
                assert event.logprobs.rank == 1 + int(np.count_nonzero(expected > expected[token] + 1e-6))
            assert events.last.finish_reason == "length" and events.last.logprobs is not None


@pytest.mark.gpu
def test_cuda_engine_penalised_tokens_and_logprobs_match_the_cpu_engines(tiny_decoder, tiny_engine):
    """Penalties and log-probabilities are host work on the step's logits: a CUDA engine (fp32, no TF32) gives the
    CPU engine's penalised greedy tokens and, within float tolerance, its log-probabilities."""
    cuda = build_decoder_engine(tiny_decoder / "model.onnx", max_batch_size=4, max_context=64, backend="cuda",
                                tf32=False)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, repetition_penalty=1.3,
                            presence_penalty=0.5, logprobs=4)
    results = {}
    for name, engine in (("cpu", tiny_engine), ("cuda", cuda)):
        with _generator(engine) as generator:
            runs = [Events() for _ in PROMPTS]
            for prompt, events in zip(PROMPTS, runs):
                generator.submit(prompt, params, events)
            results[name] = [events.wait().events for events in runs]
    for cpu_events, cuda_events in zip(results["cpu"], results["cuda"]):
        assert [e.token_id for e in cuda_events] == [e.token_id for e in cpu_events]
        for cpu_event, cuda_event in zip(cpu_events, cuda_events):
            assert cpu_event.logprobs is not None and cuda_event.logprobs is not None
            assert cuda_event.logprobs.logprob == pytest.approx(cpu_event.logprobs.logprob, abs=1e-3)
            assert [t for t, _ in cuda_event.logprobs.top] == [t for t, _ in cpu_event.logprobs.top]
