"""The host side of the CUDA decode path, on the CPU: shape buckets, the planned layout of a run with pad rows, the
KV kernels' numpy contract against the host pool, the block accounting both pools share, and the buffers' growth."""

from __future__ import annotations

import numpy as np
import pytest

from engine_core.generate import KVBlockPool
from engine_core.generate.device_kv import DeviceKVPool, kv_word, slice_bytes
from engine_core.generate.device_step import Growing, pack
from engine_core.generate.kv_cache import BlockAccounting
from engine_core.generate.kv_layout import (
    bucket_batch,
    bucket_new,
    bucket_shapes,
    gather_reference,
    plan_step,
    row_runs,
    scatter_reference,
)

LAYERS, HEADS, DIM = 2, 3, 4


@pytest.mark.parametrize(("rows", "most", "batch"), [(1, 64, 1), (2, 64, 2), (3, 64, 4), (5, 64, 8), (33, 64, 64),
                                                     (64, 64, 64), (5, 6, 6), (3, 3, 3)])
def test_the_batch_goes_up_to_a_power_of_two_within_the_engine(rows, most, batch):
    assert bucket_batch(rows, most) == batch


@pytest.mark.parametrize(("new", "past", "columns"), [(1, 0, 1), (1, 60, 1), (2, 0, 16), (16, 0, 16), (17, 0, 32),
                                                      (33, 0, 64), (40, 10, 54), (10, 50, 14), (14, 50, 14),
                                                      (64, 0, 64)])
def test_prefill_chunks_go_up_to_a_power_of_two_within_the_context(new, past, columns):
    assert bucket_new(new, past, max_context=64) == columns


def test_a_bucketed_layout_pads_rows_and_columns_without_changing_the_real_ones():
    lengths, chunks = [10, 3, 0], [[1], [2, 3], [4, 5, 6, 7, 8]]
    exact = plan_step(lengths, chunks, block_tokens=8, max_context=64)
    padded = plan_step(lengths, chunks, block_tokens=8, max_context=64, max_batch=4)
    assert (exact.batch, exact.new, exact.past) == (3, 5, 16)
    assert (padded.batch, padded.new, padded.past, padded.rows) == (4, 16, 48, 3)  # past: 64, capped at 64 - 16
    past, extra = padded.past, padded.past - exact.past  # more pad columns before every row's past
    np.testing.assert_array_equal(padded.mask[:3, extra:past + 5], exact.mask)
    assert not padded.mask[:3, past + 5:].any() and not padded.mask[:3, :extra].any()
    np.testing.assert_array_equal(padded.tokens[:3, :5], exact.tokens)
    np.testing.assert_array_equal(padded.positions[:3, :5], exact.positions)
    np.testing.assert_array_equal(padded.last, exact.last)
    assert padded.last.tolist() == [0, 1, 4]
    # the pad row: no past, one dummy token that sees only itself, nothing to write back
    assert padded.lengths[3] == padded.counts[3] == 0 and padded.mask[3].sum() == 1 and padded.mask[3, past]
    assert padded.counts.tolist() == [1, 2, 5, 0] and padded.lengths.tolist() == [10, 3, 0, 0]
    for b in range(4):  # no query row is masked whole (a NaN there would poison the real rows)
        for j in range(padded.new):
            assert padded.mask[b, :past + j + 1].any()
    assert padded.positions.max() < past + padded.new <= 64


def test_decode_keeps_one_column_and_the_past_in_few_buckets():
    def past(lengths: list[int]) -> int:
        layout = plan_step(lengths, [[1]] * len(lengths), block_tokens=8, max_context=1024, max_batch=64)
        assert layout.new == 1
        return layout.past

    assert past([17, 5]) == 64 and past([64]) == 64 and past([65, 3]) == 128 and past([500]) == 512
    assert past([513]) == 640 and past([900]) == 1024 - 1  # a quarter of the power of two, never past the context
    exact = plan_step([17, 5], [[1], [2]], block_tokens=8, max_context=1024)
    assert exact.past == 24  # the CPU path: whole blocks


def test_the_buckets_to_warm_are_every_decode_shape_and_every_prefill_without_a_past():
    shapes = bucket_shapes(64, 512, 512)
    decode = [(b, p) for b, p, n in shapes if n == 1]
    assert decode[0] == (64, 511) and len(decode) == 7 * 8  # batches 1..64, pasts 64..448 and the capped 511
    assert {p for _, p in decode} == {64, 128, 192, 256, 320, 384, 448, 511}
    prefill = [(b, n) for b, p, n in shapes if n > 1]
    assert all(p == 0 for _, p, n in shapes if n > 1) and prefill[0][0] * prefill[0][1] == 2048
    sizes = [b * n for b, n in prefill]
    assert sizes == sorted(sizes, reverse=True) and (64, 16) in prefill and (1, 512) in prefill
    assert (8, 512) not in prefill  # 4096 slots: more than a 512-token budget can pad up to
    rng = np.random.default_rng(0)
    for _ in range(200):  # whatever plan_prefill feeds from an empty past lands on a warmed shape
        rows = int(rng.integers(1, 65))
        chunks = [[1] * int(rng.integers(1, max(2, 512 // rows))) for _ in range(rows)]
        layout = plan_step([0] * rows, chunks, block_tokens=16, max_context=512, max_batch=64)
        assert (layout.batch, layout.past, layout.new) in shapes


def test_runs_the_engine_cannot_take_are_refused():
    with pytest.raises(ValueError, match="5 sequences in one run; the engine takes at most 4"):
        plan_step([0] * 5, [[1]] * 5, block_tokens=8, max_context=64, max_batch=4)
    with pytest.raises(ValueError, match="60 cached \\+ 5 new tokens exceed the engine's context of 64"):
        plan_step([60, 0], [[1], [1, 2, 3, 4, 5]], block_tokens=8, max_context=64, max_batch=4)
    with pytest.raises(ValueError, match="need as many chunks of at least one token"):
        plan_step([0, 0], [[1], []], block_tokens=8, max_context=64)


def _host_pool(rng: np.random.Generator, lengths: dict[str, int], block_tokens: int = 4) -> KVBlockPool:
    pool = KVBlockPool(LAYERS, HEADS, DIM, block_tokens=block_tokens, num_blocks=12, dtype=np.float32)
    pool.reserve("other", 3)  # interleaves the sequences' blocks
    for seq, length in lengths.items():
        pool.reserve(seq, length + 5)
        shape = (LAYERS, HEADS, length, DIM)
        pool.write(seq, 0, rng.standard_normal(shape).astype(np.float32),
                   rng.standard_normal(shape).astype(np.float32))
    return pool


def test_the_gather_kernels_contract_is_the_host_pools_gather():
    rng = np.random.default_rng(0)
    pool = _host_pool(rng, {"a": 6, "b": 0, "c": 9})
    seqs = ["c", "a", "b"]
    lengths = np.array([pool.length(s) for s in seqs] + [0])  # and a pad row
    dense = gather_reference(pool.keys, pool.values, pool.block_tables(seqs, 4), lengths, 12)
    keys, values = pool.gather(seqs, 12)
    assert dense.shape == (LAYERS, 2, 4, HEADS, 12, DIM)
    np.testing.assert_array_equal(dense[:, 0, :3], keys)
    np.testing.assert_array_equal(dense[:, 1, :3], values)
    assert not dense[:, :, 3].any()


def test_the_scatter_kernels_contract_is_the_host_pools_write():
    written, reference = (_host_pool(np.random.default_rng(1), {"a": 6, "c": 3}) for _ in range(2))
    seqs, counts, past = ["a", "c"], np.array([1, 4, 0]), 8  # a decodes one token, c takes a chunk of 4, a pad row
    present = np.random.default_rng(2).standard_normal((LAYERS, 2, 3, HEADS, past + 4, DIM)).astype(np.float32)
    lengths = np.array([6, 3, 0])
    scatter_reference(written.keys, written.values, present, written.block_tables(seqs, 3), lengths, counts, past)
    for b, seq in enumerate(seqs):
        rows = present[:, :, b, :, past:past + counts[b]]
        reference.write(seq, int(lengths[b]), rows[:, 0], rows[:, 1])
    np.testing.assert_array_equal(written.keys, reference.keys)
    np.testing.assert_array_equal(written.values, reference.values)


def test_both_pools_share_one_block_accounting():
    assert issubclass(KVBlockPool, BlockAccounting) and issubclass(DeviceKVPool, BlockAccounting)
    accounting = BlockAccounting(LAYERS, HEADS, DIM, block_tokens=4, num_blocks=6, dtype=np.float16)
    assert accounting.bytes_per_block == 2 * LAYERS * HEADS * 4 * DIM * 2
    accounting.reserve("a", 5)
    accounting.reserve("b", 1)
    accounting.reserve("a", 9)
    assert accounting.blocks("a") == [0, 1, 3] and accounting.blocks("b") == [2]
    tables = accounting.block_tables(["b", "a"], rows=3)
    assert tables.dtype == np.int32 and tables.tolist() == [[2, 0, 0], [0, 1, 3], [0, 0, 0]]
    accounting._written("a", 0, 7)
    accounting.truncate("a", 4)
    assert accounting.length("a") == 4
    with pytest.raises(ValueError, match="cannot truncate a sequence of 4 tokens to 5"):
        accounting.truncate("a", 5)
    assert accounting.free("a") == 3 and accounting.free_blocks == 5
    with pytest.raises(ValueError, match="BlockAccounting: head_dim must be at least 1"):
        BlockAccounting(1, 1, 0, block_tokens=4, num_blocks=1, dtype=np.float32)


def test_logits_rows_are_fetched_in_runs_of_consecutive_rows():
    assert row_runs(np.array([0, 1, 2, 3])) == [(0, 4, 0)]  # decode: one copy
    assert row_runs(np.array([4, 20, 21, 47])) == [(4, 1, 0), (20, 2, 1), (47, 1, 3)]
    assert row_runs(np.array([], np.int64)) == []


def test_small_inputs_pack_into_one_aligned_buffer():
    offsets, total = pack({"a": np.zeros(3, np.int64), "b": np.zeros((2, 200), np.int32), "c": np.zeros(0)})
    assert offsets == {"a": 0, "b": 256, "c": 256 + 1792} and total == 2048


def test_kernel_words_and_slices():
    assert [kv_word(n) for n in (128, 64, 24, 6, 3)] == [16, 16, 8, 2, 1]
    assert slice_bytes(1, 2, 57, 16, 4) == 7424  # 7296 rounded up to 256-byte slices
    assert slice_bytes(2, 8, 0, 64, 2) == 0


def test_buffers_grow_rarely_and_keep_their_address_while_runs_fit():
    made: list[int] = []

    def make(nbytes: int) -> list[int]:
        made.append(nbytes)
        return [nbytes]

    growing = Growing(make, limit=3000)
    first = growing.ensure(100)
    assert made == [256] and growing.ensure(256) is first and growing.ensure(10) is first
    growing.ensure(300)
    growing.ensure(1000)
    growing.ensure(2000)
    assert made == [256, 512, 1024, 2048]  # doubling
    growing.ensure(2100)
    assert made[-1] == 3000  # the limit caps the doubling
    growing.ensure(5000)
    assert made[-1] == 5000  # a larger run still gets what it needs
    growing.release()
    assert growing.buffer is None and growing.capacity == 0
