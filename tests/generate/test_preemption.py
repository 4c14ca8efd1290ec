"""KV blocks on demand and preemption by recompute: a sequence takes blocks as its tokens come, so a pool too small
for every request's max_tokens still runs them together; when it runs out, the newest running sequences are freed,
queued first and recomputed, and every sequence's tokens (greedy, or seeded and penalised) are those of a pool big
enough for all, each sent once. On the pool alone (``BlockAccounting.grow``), then through the Generator on the tiny
decoder's CPU engine, with the host pool and with the device pool (driver calls emulated); the GPU test runs the
preempting generator on a CUDA engine."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from engine_core.generate import DecoderRunner, Generator, SamplingParams, build_decoder_engine
from engine_core.generate.kv_cache import BlockAccounting, PromptBlocks
from tests.generate import emulated_cuda
from tests.generate.conftest import generative
from tests.generate.test_generator import PROMPTS, TIMEOUT, Events

B = 8  # tokens per block
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def references(tiny_decoder) -> list[list[int]]:
    return [generative.reference_greedy(tiny_decoder, p, 32) for p in PROMPTS]


def _generator(engine, **kwargs) -> Generator:
    return Generator(engine, **{"max_batch_size": 4, "max_context": 64, "eos_token_ids": (), "block_tokens": B}
                     | kwargs)


def _sampled(seed: int) -> SamplingParams:
    """Seeded sampling with penalties: the generator and the counts both carry across a preemption."""
    return SamplingParams(max_tokens=32, temperature=1.3, top_k=50, seed=seed, ignore_eos=True,
                          frequency_penalty=0.6, presence_penalty=0.3, repetition_penalty=1.2)


def _run_all(generator: Generator, prompts: list[list[int]], params: list[SamplingParams]) -> list[Events]:
    """Every prompt submitted before the loop admits any (its lock held meanwhile: on a busy machine the loop
    finished a short first sequence before the last was submitted), then every result."""
    results = [Events() for _ in prompts]
    with generator._lock:
        for prompt, each, events in zip(prompts, params, results):
            generator.submit(prompt, each, events)
    return [events.wait() for events in results]


def _assert_clean(generator: Generator) -> None:
    """Nothing running, waiting or held, and no reference count left over."""
    stats = generator.stats()
    assert (stats.running, stats.waiting, stats.kv_blocks_used) == (0, 0, 0)
    assert all(generator._pool.ref_count(b) == 0 for b in range(generator._pool.total_blocks))


def _assert_sent_once(events: Events, max_tokens: int) -> None:
    """Each token was sent once, in order, the last event ending the sequence by length."""
    assert [e.completion_tokens for e in events.events] == list(range(1, max_tokens + 1))
    assert events.last.finish_reason == "length" and not any(e.final for e in events.events[:-1])


def _record_prefills(monkeypatch) -> list[tuple[list, list[int]]]:
    """Log each prefill run: (sequence ids, chunk lengths)."""
    runs: list[tuple[list, list[int]]] = []
    prefill = DecoderRunner.prefill

    def logged(self, pool, seqs, chunks, **options):
        runs.append((list(seqs), [len(c) for c in chunks]))
        return prefill(self, pool, seqs, chunks, **options)

    monkeypatch.setattr(DecoderRunner, "prefill", logged)
    return runs


def _record_decode_batches(monkeypatch) -> list[int]:
    sizes: list[int] = []
    decode = DecoderRunner.decode

    def logged(self, pool, seqs, tokens, **options):
        sizes.append(len(seqs))
        return decode(self, pool, seqs, tokens, **options)

    monkeypatch.setattr(DecoderRunner, "decode", logged)
    return sizes


# -- the pool ---------------------------------------------------------------------------------------------------------
def test_grow_takes_clean_blocks_then_evicts_and_takes_nothing_when_short():
    pool = BlockAccounting(1, 1, 1, block_tokens=4, num_blocks=5, dtype=np.float32)
    prompt = list(range(9))  # two full blocks, registered as they fill
    pool.reserve("cached", 9, PromptBlocks.of(prompt, 4))
    pool._written("cached", 0, 9)
    pool.free("cached")  # 2 evictable blocks, 3 clean
    pool.reserve("a", 3)
    assert pool.grow("a", 4) and len(pool.blocks("a")) == 1  # room already: nothing taken
    assert pool.grow("a", 9) and len(pool.blocks("a")) == 3 and pool.cached_blocks == 2  # the clean ones first
    assert pool.grow("a", 13) and pool.cached_blocks == 1  # then the least recently used cached block: the
    assert len(pool.cached_prefix(PromptBlocks.of(prompt, 4))) == 1  # second (freed before the prefix it extends)
    assert not pool.grow("a", 24) and len(pool.blocks("a")) == 4 and pool.free_blocks == 1  # 2 short: none taken
    with pytest.raises(KeyError, match="holds no KV cache blocks"):
        pool.grow("unknown", 4)


# -- the generator ----------------------------------------------------------------------------------------------------
def test_a_pool_too_small_for_every_max_tokens_runs_the_sequences_together(tiny_decoder, tiny_engine, monkeypatch):
    # each stops on its 5th token, having written 5 to 11 tokens (5 blocks in all); reserving prompt + max_tokens
    # (6 or 7 blocks each) would run them one at a time in 6 blocks
    prompts = PROMPTS[:3] + [[7, 8, 9, 10]]
    references = [generative.reference_greedy(tiny_decoder, p, 5) for p in prompts]
    assert all(reference[4] not in reference[:4] for reference in references)
    batches = _record_decode_batches(monkeypatch)
    with _generator(tiny_engine, num_blocks=6) as generator:
        params = [SamplingParams(max_tokens=40, temperature=0, stop_token_ids=(r[4],)) for r in references]
        results = _run_all(generator, prompts, params)
        assert [events.tokens for events in results] == [reference[:4] for reference in references]
        assert max(batches) == 4
        assert generator.stats().preemptions_total == 0
        _assert_clean(generator)


def test_admission_keeps_the_watermark_free_while_sequences_run(tiny_decoder, tiny_engine, monkeypatch):
    """vLLM's watermark: while others run, a sequence is admitted only if its blocks leave WATERMARK of the pool
    free (here 90% of 6 blocks: 5, so the second 1-block prompt waits); alone, it is admitted whatever is left."""
    from engine_core.generate import generator as generator_module

    monkeypatch.setattr(generator_module, "WATERMARK", 0.9)
    prompts = [PROMPTS[0][:4], [7, 8, 9, 10]]
    references = [generative.reference_greedy(tiny_decoder, p, 8) for p in prompts]
    batches = _record_decode_batches(monkeypatch)
    with _generator(tiny_engine, num_blocks=6) as generator:
        # the first takes 1 block (alone: no watermark), leaving 5 free; the second's block would leave 4 < 5 spare,
        # so it runs once the first has finished
        results = _run_all(generator, prompts, [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)] * 2)
        assert [events.tokens for events in results] == references
        assert max(batches) == 1 and generator.stats().preemptions_total == 0
        _assert_clean(generator)
    monkeypatch.setattr(generator_module, "WATERMARK", 0.0)
    batches.clear()
    with _generator(tiny_engine, num_blocks=6) as generator:
        assert [events.tokens for events in _run_all(generator, prompts, [
            SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)] * 2)] == references
        assert max(batches) == 2  # without it, both run together


@pytest.mark.parametrize("budget", [512, 5], ids=["whole_prompts", "chunks_of_5"])
@pytest.mark.parametrize("caching", [True, False], ids=["prefix_cache", "no_prefix_cache"])
def test_preempted_sequences_are_recomputed_and_generate_the_same_tokens(tiny_engine, references, budget, caching):
    # the four write 34, 38, 32 and 56 tokens (21 blocks of 8); 10 blocks hold the longest with room to spare
    greedy, sampled = [GREEDY] * 4, [_sampled(seed) for seed in range(4)]
    with _generator(tiny_engine, enable_prefix_caching=caching) as generator:
        unconstrained = [events.tokens for events in _run_all(generator, PROMPTS, sampled)]
        assert generator.stats().preemptions_total == 0
    for params, expected in ((greedy, references), (sampled, unconstrained)):
        with _generator(tiny_engine, num_blocks=10, max_prefill_tokens=budget,
                        enable_prefix_caching=caching) as generator:
            results = _run_all(generator, PROMPTS, params)
            assert [events.tokens for events in results] == expected
            for events in results:
                _assert_sent_once(events, 32)
            stats = generator.stats()
            assert stats.preemptions_total > 0
            assert (stats.prompt_tokens_total, stats.completion_tokens_total) == (sum(map(len, PROMPTS)), 4 * 32)
            _assert_clean(generator)


def _watch_preemptions(generator: Generator, victim: Events, sent: list[int]):
    """An ``Events`` hook for the older sequence: at each new preemption, how many tokens ``victim`` had been sent
    (it is preempted at the start of an iteration and waits while the older one runs: nothing of it comes between)."""
    def watch(events: Events, event) -> None:
        if generator.stats().preemptions_total > len(sent):
            sent.append(len(victim.events))
    return watch


def test_a_recomputed_sequence_feeds_its_prompt_and_tokens_but_the_last_and_samples_nothing(tiny_engine, references,
                                                                                             monkeypatch):
    # 8 blocks: the first (25 + 31 tokens) needs 7 of them by its end, so the second (7 tokens) is preempted and
    # waits for it
    prefills, sent = _record_prefills(monkeypatch), []
    with _generator(tiny_engine, num_blocks=8, enable_prefix_caching=False) as generator:
        second = Events()
        first = Events(then=_watch_preemptions(generator, second, sent))
        generator.submit(PROMPTS[3], GREEDY, first)
        generator.submit(PROMPTS[1], GREEDY, second)
        assert first.wait().tokens == references[3] and second.wait().tokens == references[1]
        _assert_sent_once(second, 32)
        assert generator.stats().preemptions_total == len(sent) == 1
        _assert_clean(generator)
    fed = [chunks[seqs.index(1)] for seqs, chunks in prefills if 1 in seqs]
    assert fed == [7, 7 + sent[0] - 1]  # the prompt, then the prompt and the tokens sent but the last (decode's)


def test_cancelling_a_preempted_sequence_while_it_waits_frees_nothing_twice(tiny_engine, references):
    seen: dict[str, int] = {}
    handles, submitted = {}, threading.Event()

    def cancel_the_preempted(events: Events, event) -> None:
        stats = generator.stats()
        if stats.preemptions_total and "waiting" not in seen:
            assert submitted.wait(TIMEOUT)
            seen["waiting"], seen["sent"] = stats.waiting, len(second.events)
            handles["second"].cancel()

    with _generator(tiny_engine, num_blocks=8) as generator:
        first, second = Events(then=cancel_the_preempted), Events()
        handles["first"] = generator.submit(PROMPTS[3], GREEDY, first)
        handles["second"] = generator.submit(PROMPTS[1], GREEDY, second)
        submitted.set()
        assert first.wait().tokens == references[3]
        assert seen["waiting"] == 1  # cancelled while queued, its blocks freed already
        assert second.wait().last.finish_reason == "cancelled"
        assert second.tokens == references[1][:seen["sent"]]
        assert second.last.completion_tokens == seen["sent"]
        assert generator.stats().preemptions_total == 1
        _assert_clean(generator)
        assert generator._pool.free_blocks == generator._pool.total_blocks


def test_the_prefix_cache_serves_a_recomputed_sequence_and_later_requests(tiny_decoder, tiny_engine, monkeypatch):
    from tests.generate.test_prefix_cache import SYSTEM

    long, short = SYSTEM[:25], SYSTEM[:17] + [1]  # their first two blocks are the same: the first holds them
    expected = [generative.reference_greedy(tiny_decoder, prompt, 32) for prompt in (long, short)]
    prefills, sent = _record_prefills(monkeypatch), []
    with _generator(tiny_engine, num_blocks=8) as generator:
        second = Events()
        first = Events(then=_watch_preemptions(generator, second, sent))
        generator.submit(long, GREEDY, first)
        generator.submit(short, GREEDY, second)
        assert [first.wait().tokens, second.wait().tokens] == expected
        stats = generator.stats()
        assert stats.preemptions_total == len(sent) >= 1
        _assert_clean(generator)
        again = Events()
        generator.submit(short, GREEDY, again)
        assert again.wait().tokens == expected[1]
        assert generator.stats().prefix_cache_hits_total - stats.prefix_cache_hits_total == 16
    recomputed = [chunks[seqs.index(1)] for seqs, chunks in prefills if 1 in seqs][1:]
    assert len(recomputed) == len(sent)
    for fed, before in zip(recomputed, sent):
        assert fed <= len(short) + before - 1 - 16  # at least the two shared blocks came from the cache
    assert prefills[-1] == ([2], [2])  # the later request too


@pytest.mark.parametrize("budget", [512, 5], ids=["whole_prompts", "chunks_of_5"])
def test_the_device_pool_preempts_and_recomputes_on_the_emulated_device_path(tiny_engine, references, monkeypatch,
                                                                             budget):
    """The same accounting on a DeviceKVPool (driver calls emulated on the host: emulated_cuda.py): blocks taken on
    demand reach the gather and scatter kernels' block tables, and recomputed pasts are read back right."""
    from engine_core.generate.device_kv import DeviceKVPool
    from engine_core.runtime import CudaEngine

    emulated_cuda.HostBuffer.alive = 0
    emulated_cuda.emulate(monkeypatch)
    monkeypatch.setattr(CudaEngine, "backend", property(lambda self: "cuda"))
    with _generator(tiny_engine, num_blocks=10, max_prefill_tokens=budget) as generator:
        assert isinstance(generator._pool, DeviceKVPool)
        results = _run_all(generator, PROMPTS, [GREEDY] * 4)
        assert [events.tokens for events in results] == references
        assert generator.stats().preemptions_total > 0
        _assert_clean(generator)


@pytest.mark.gpu
def test_cuda_engine_preempts_and_generates_the_cpu_engines_tokens(tiny_decoder, references):
    """The device pool (the same accounting) grows, preempts and recomputes on a CUDA engine (fp32 without TF32): the
    tokens are the CPU reference's."""
    cuda = build_decoder_engine(tiny_decoder / "model.onnx", max_batch_size=4, max_context=64, backend="cuda",
                                tf32=False)
    for budget in (512, 5):
        with _generator(cuda, num_blocks=10, max_prefill_tokens=budget) as generator:
            results = _run_all(generator, PROMPTS, [GREEDY] * 4)
            assert [events.tokens for events in results] == references
            assert generator.stats().preemptions_total > 0
            _assert_clean(generator)
