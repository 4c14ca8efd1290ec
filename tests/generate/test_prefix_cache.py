"""Prefix caching: full prompt blocks named by chained hashes, shared by reference count, registered as prefill fills
them, kept evictable (least recently used first) once no sequence holds them, never written while shared or cached.
On the pool alone (BlockAccounting, the part both pools share), then through the Generator on the tiny decoder's
CPU engine: greedy tokens equal examples/generative.py's full recompute whether prompts sharing a prefix run
together, one after another (the second prefills fewer tokens), with a prompt of whole blocks, with the prefix
evicted and recomputed, or with the sharing sequence cancelled. The GPU test runs it on a CUDA engine."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from engine_core.generate import DecoderRunner, Generator, SamplingParams, build_decoder_engine
from engine_core.generate.kv_cache import BlockAccounting, KVCacheFull, PromptBlocks
from tests.generate.conftest import generative
from tests.generate.test_generator import TIMEOUT, Events

B = 4  # tokens per block in the pool tests


def _accounting(num_blocks: int = 8) -> BlockAccounting:
    return BlockAccounting(1, 1, 1, block_tokens=B, num_blocks=num_blocks, dtype=np.float32)


def _admit(pool: BlockAccounting, seq: str, prompt: list[int], extra: int = 2) -> int:
    """Reserve ``seq`` as the generator does and 'prefill' the rest of its prompt; the tokens it shared."""
    shared = pool.reserve(seq, len(prompt) + extra, PromptBlocks.of(prompt, B))
    pool._written(seq, shared, len(prompt) - shared)
    return shared


def _refs(pool: BlockAccounting) -> list[int]:
    return [pool.ref_count(b) for b in range(pool.total_blocks)]


def test_block_hashes_chain_over_the_whole_prefix():
    a = PromptBlocks.of([1, 2, 3, 4, 5, 6, 7, 8, 9], B)
    b = PromptBlocks.of([9, 9, 9, 9, 5, 6, 7, 8], B)
    assert len(a.hashes) == 2 and a.shareable == 2  # token 9 is computed whatever the cache holds
    assert a.hashes[1] != b.hashes[1]  # the same tokens after another parent: another block
    assert PromptBlocks.of([1, 2, 3, 4, 5, 6, 7, 8], B) == PromptBlocks(a.hashes, 1)  # whole blocks: the last recomputed
    assert PromptBlocks.of([1, 2, 3], B) == PromptBlocks((), 0)


def test_a_second_prompt_shares_the_cached_blocks_and_writes_only_its_own():
    pool = _accounting()
    prompt = list(range(10))  # blocks [0..3], [4..7] full, [8, 9] partial
    assert _admit(pool, "a", prompt) == 0
    a_blocks = pool.blocks("a")
    assert pool.reserve("b", 12, PromptBlocks.of(prompt[:9] + [99], B)) == 8  # both full blocks shared
    assert pool.length("b") == 8 and pool.blocks("b")[:2] == a_blocks[:2] and pool.blocks("b")[2] != a_blocks[2]
    assert _refs(pool)[a_blocks[0]] == _refs(pool)[a_blocks[1]] == 2 and pool.used_blocks == 4
    with pytest.raises(ValueError, match="shared or cached: never written"):
        pool._written("b", 7, 1)  # a row of a shared block
    pool._written("b", 8, 2)
    pool.free("a")  # the sharer leaves: b keeps the blocks, the cache keeps their names
    assert _refs(pool)[a_blocks[0]] == 1 and pool.used_blocks == 3
    with pytest.raises(ValueError, match="never written"):
        pool._written("b", 4, 1)  # held alone now, but cached: still never written
    pool.free("b")
    assert pool.used_blocks == 0 and pool.cached_blocks == 2 and pool.free_blocks == 8
    assert min(_refs(pool)) == 0 and max(_refs(pool)) == 0
    assert pool.reserve("c", 12, PromptBlocks.of(prompt, B)) == 8  # the cache outlives every holder


def test_evictable_blocks_count_as_free_and_go_least_recently_used_first():
    pool = _accounting(num_blocks=6)
    first, second = list(range(9)), list(range(50, 59))  # two full blocks each
    _admit(pool, "a", first, extra=0)
    _admit(pool, "b", second, extra=0)
    pool.free("a")
    pool.free("b")
    assert (pool.used_blocks, pool.cached_blocks, pool.free_blocks) == (0, 4, 6)
    assert pool.fits(24) and not pool.fits(25)
    assert pool.reserve("c", 16) == 0  # 2 clean blocks and a's 2 cached ones (the older): a's prefix is gone
    assert pool.cached_prefix(PromptBlocks.of(first, B)) == []
    assert len(pool.cached_prefix(PromptBlocks.of(second, B))) == 2
    # sharing b's 2 evictable blocks takes them from the free ones: 1 new block + 2 revived > 2 free
    assert not pool.fits(9, PromptBlocks.of(second, B)) and pool.fits(8)
    with pytest.raises(KVCacheFull, match="3 more KV cache blocks wanted, 2 of 6 free"):
        pool.reserve("e", 9, PromptBlocks.of(second, B))
    assert "e" not in pool and pool.cached_blocks == 2
    pool.free("c")
    assert pool.reserve("e", 9, PromptBlocks.of(second, B)) == 8
    assert (pool.used_blocks, pool.cached_blocks, pool.free_blocks) == (3, 0, 3)


def test_a_duplicate_block_stays_unnamed_and_truncation_uncaches_what_it_rewrites():
    pool = _accounting()
    prompt = list(range(9))
    _admit(pool, "a", prompt)
    _admit(pool, "b", prompt)  # a's blocks are known by now: b shares them
    assert pool.blocks("b")[:2] == pool.blocks("a")[:2]
    twin = _accounting()
    twin.reserve("a", 11, PromptBlocks.of(prompt, B))
    twin.reserve("b", 11, PromptBlocks.of(prompt, B))  # both admitted before either prefilled: nothing to share
    twin._written("a", 0, 9)
    twin._written("b", 0, 9)  # b's blocks have a's names: they stay out of the cache
    twin.free("b")
    assert twin.cached_blocks == 0 and twin.used_blocks == 3
    with pytest.raises(ValueError, match="another sequence shares its blocks"):
        pool.truncate("b", 2)
    pool.free("b")
    pool.truncate("a", 6)  # block 1 will be written again: it leaves the cache
    assert len(pool.cached_prefix(PromptBlocks.of(prompt, B))) == 1
    pool._written("a", 6, 3)
    pool.free("a")
    assert pool.cached_blocks == 1 and pool.used_blocks == 0


# -- the Generator on the tiny decoder ------------------------------------------------------------------------------
SYSTEM = list(range(100, 140))  # a 40-token "system prompt": 5 blocks of 8
SHORT = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_decoder: Path):
    """reference_greedy of a prompt (8 tokens unless told), memoized for the module."""
    known: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def tokens(prompt: list[int], steps: int = 8) -> list[int]:
        key = (tuple(prompt), steps)
        if key not in known:
            known[key] = generative.reference_greedy(tiny_decoder, prompt, steps)
        return known[key]

    return tokens


def _prefilled(monkeypatch) -> list[int]:
    """Prompt tokens every prefill run feeds (its chunks' total), run by run."""
    fed: list[int] = []
    prefill = DecoderRunner.prefill

    def counted(self, pool, seqs, chunks, **options):
        fed.append(sum(len(c) for c in chunks))
        return prefill(self, pool, seqs, chunks, **options)

    monkeypatch.setattr(DecoderRunner, "prefill", counted)
    return fed


def _generator(engine, **kwargs) -> Generator:
    return Generator(engine, **{"max_batch_size": 4, "max_context": 64, "eos_token_ids": (), "block_tokens": 8}
                     | kwargs)


def _run(generator: Generator, prompt: list[int], params: SamplingParams = SHORT) -> list[int]:
    events = Events()
    generator.submit(prompt, params, events)
    return events.wait().tokens


def _assert_cached_only(generator: Generator, cached: int) -> None:
    """Nothing held, no reference count below zero, ``cached`` evictable blocks left."""
    stats = generator.stats()
    assert (stats.running, stats.kv_blocks_used, stats.kv_blocks_cached) == (0, 0, cached)
    assert all(generator._pool.ref_count(b) == 0 for b in range(generator._pool.total_blocks))


def test_one_after_another_the_second_prompt_prefills_only_what_is_new(tiny_engine, reference, monkeypatch):
    fed = _prefilled(monkeypatch)
    first, second = SYSTEM + [1, 2, 3], SYSTEM + [7, 8]
    with _generator(tiny_engine) as generator:
        assert _run(generator, first) == reference(first)
        assert fed == [43] and generator.stats().prefix_cache_hits_total == 0
        assert _run(generator, second) == reference(second)
        assert fed == [43, 2]  # the 5 system blocks came from the cache
        stats = generator.stats()
        assert (stats.prefix_cache_queries_total, stats.prefix_cache_hits_total) == (43 + 42, 40)
        _assert_cached_only(generator, cached=5)  # the shared 5 blocks (the partly filled ones are no one's prefix)


def test_prompts_sharing_a_prefix_submitted_together_match_the_reference(tiny_engine, reference):
    prompts = [SYSTEM + [1], SYSTEM + [2, 3, 4], SYSTEM[:20] + [5], SYSTEM]
    with _generator(tiny_engine, max_prefill_tokens=24) as generator:  # in chunks, beside each other
        results = [Events() for _ in prompts]
        for prompt, events in zip(prompts, results):
            generator.submit(prompt, SHORT, events)
        assert [events.wait().tokens for events in results] == [reference(p) for p in prompts]
        _assert_cached_only(generator, cached=5)
        again = [Events() for _ in prompts]  # now every one of them finds its prefix cached
        for prompt, events in zip(prompts, again):
            generator.submit(prompt, SHORT, events)
        assert [events.wait().tokens for events in again] == [reference(p) for p in prompts]
        assert generator.stats().prefix_cache_hits_total >= 40 + 40 + 16 + 32


def test_a_prompt_of_whole_blocks_recomputes_its_last_block(tiny_engine, reference, monkeypatch):
    fed = _prefilled(monkeypatch)
    prompt = SYSTEM[:32]  # exactly 4 blocks
    with _generator(tiny_engine) as generator:
        assert _run(generator, prompt) == reference(prompt)
        assert _run(generator, prompt) == reference(prompt)
        assert fed == [32, 8] and generator.stats().prefix_cache_hits_total == 24
        _assert_cached_only(generator, cached=4)


def test_an_evicted_prefix_is_recomputed(tiny_engine, reference, monkeypatch):
    fed = _prefilled(monkeypatch)
    other = list(range(200, 248))  # 48 tokens + 8: the whole pool of 7 blocks
    with _generator(tiny_engine, num_blocks=7) as generator:
        assert _run(generator, SYSTEM + [1]) == reference(SYSTEM + [1])
        _assert_cached_only(generator, cached=5)
        assert _run(generator, other) == reference(other)  # takes the 2 clean blocks, then evicts the cached 5
        assert _run(generator, SYSTEM + [2]) == reference(SYSTEM + [2])
        assert fed == [41, 48, 41] and generator.stats().prefix_cache_hits_total == 0
        _assert_cached_only(generator, cached=6)  # its 5, and other's 6th: 41 + 7 tokens took 6 blocks, not 7


def test_cancelling_the_sequence_whose_blocks_are_shared_leaves_the_other_correct(tiny_engine, reference):
    long = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    with _generator(tiny_engine) as generator:
        handles, started, submitted = {}, threading.Event(), threading.Event()

        def cancel_the_first(events: Events, event) -> None:
            if event.completion_tokens == 3:  # the second shares the first's blocks by now
                assert submitted.wait(TIMEOUT)
                handles["first"].cancel()

        def share_then_go(events: Events, event) -> None:
            if event.completion_tokens == 1:
                started.set()

        first, second = Events(then=share_then_go), Events(then=cancel_the_first)
        handles["first"] = generator.submit(SYSTEM + [1], SamplingParams(max_tokens=23, temperature=0,
                                                                        ignore_eos=True), first)
        assert started.wait(TIMEOUT)
        generator.submit(SYSTEM + [9, 9], long, second)
        submitted.set()
        assert second.wait().tokens == reference(SYSTEM + [9, 9], 20)
        assert first.wait().last.finish_reason == "cancelled"
        assert generator.stats().prefix_cache_hits_total == 40
        _assert_cached_only(generator, cached=5)


def test_prefix_caching_off_shares_nothing(tiny_engine, reference, monkeypatch):
    fed = _prefilled(monkeypatch)
    with _generator(tiny_engine, enable_prefix_caching=False) as generator:
        for _ in range(2):
            assert _run(generator, SYSTEM + [1]) == reference(SYSTEM + [1])
        stats = generator.stats()
    assert fed == [41, 41] and (stats.prefix_cache_queries_total, stats.prefix_cache_hits_total) == (0, 0)
    assert stats.kv_blocks_cached == 0


def test_the_device_path_reads_shared_blocks_and_never_writes_them(tiny_engine, reference, monkeypatch):
    """On the device path (driver calls emulated, emulated_cuda.py) the gather reads the shared blocks through the
    block tables and the scatter leaves them as the first prefill wrote them."""
    from engine_core.generate.device_kv import DeviceKVPool
    from engine_core.runtime import CudaEngine
    from tests.generate import emulated_cuda

    emulated_cuda.emulate(monkeypatch)
    monkeypatch.setattr(CudaEngine, "backend", property(lambda self: "cuda"))
    first, second = SYSTEM + [1, 2, 3], SYSTEM + [7, 8]
    with _generator(tiny_engine) as generator:
        pool = generator._pool
        assert isinstance(pool, DeviceKVPool)
        assert _run(generator, first) == reference(first)
        cached = sorted(b for b in range(pool.total_blocks) if b in pool._hash_of)
        before = [part[cached] for part in pool.read_blocks()]
        assert _run(generator, second) == reference(second)
        assert generator.stats().prefix_cache_hits_total == 40
        for was, now in zip(before, pool.read_blocks()):
            np.testing.assert_array_equal(now[cached], was)
        _assert_cached_only(generator, cached=5)


@pytest.mark.gpu
def test_cuda_engine_with_a_cached_prefix_generates_the_cpu_engines_tokens(tiny_decoder, tiny_engine):
    """A CUDA engine (fp32, no TF32, the device KV cache) sharing cached blocks: the gather reads them through the
    block tables, the scatter writes only the sequences' own blocks."""
    cuda = build_decoder_engine(tiny_decoder / "model.onnx", max_batch_size=4, max_context=64, backend="cuda",
                                tf32=False)
    prompts = [SYSTEM + [1, 2, 3], SYSTEM + [7, 8], SYSTEM[:32], SYSTEM[:32]]
    results = {}
    for name, engine in (("cpu", tiny_engine), ("cuda", cuda)):
        with _generator(engine) as generator:
            results[name] = [_run(generator, prompt) for prompt in prompts]
            together = [Events() for _ in prompts]
            for prompt, events in zip(prompts, together):
                generator.submit(prompt, SHORT, events)
            results[name] += [events.wait().tokens for events in together]
            assert generator.stats().prefix_cache_hits_total >= 40 + 24
            _assert_cached_only(generator, cached=5)
    assert results["cuda"] == results["cpu"]
