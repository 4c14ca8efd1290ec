"""KVBlockPool: reservation by whole blocks, rows written across block boundaries, left-padded gathers."""

from __future__ import annotations

import numpy as np
import pytest

from engine_core.generate import KVBlockPool, KVCacheFull

LAYERS, HEADS, DIM = 2, 3, 4


def _pool(num_blocks: int = 6, block_tokens: int = 4) -> KVBlockPool:
    return KVBlockPool(LAYERS, HEADS, DIM, block_tokens=block_tokens, num_blocks=num_blocks, dtype=np.float32)


def _rows(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    shape = (LAYERS, HEADS, n, DIM)
    return rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)


def test_blocks_are_reserved_whole_and_freed():
    pool = _pool()
    assert (pool.total_blocks, pool.used_blocks, pool.free_blocks) == (6, 0, 6)
    assert [pool.blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    pool.reserve("a", 5)
    assert pool.used_blocks == 2 and pool.capacity("a") == 8 and pool.length("a") == 0
    pool.reserve("a", 8)  # within what it holds: nothing more
    assert pool.used_blocks == 2
    pool.reserve("a", 9)
    assert pool.used_blocks == 3
    assert pool.free("a") == 3 and pool.used_blocks == 0
    assert pool.free("a") == 0 and "a" not in pool
    assert pool.bytes_per_block == 2 * LAYERS * HEADS * 4 * DIM * 4


def test_a_reservation_that_does_not_fit_takes_nothing():
    pool = _pool(num_blocks=3)
    pool.reserve("a", 8)
    with pytest.raises(KVCacheFull, match="2 more KV cache blocks wanted, 1 of 3 free"):
        pool.reserve("b", 5)
    assert "b" not in pool and pool.used_blocks == 2
    with pytest.raises(KVCacheFull):
        pool.reserve("a", 16)
    assert pool.capacity("a") == 8


def test_rows_written_across_blocks_gather_left_padded():
    rng = np.random.default_rng(0)
    pool = _pool()
    k_a, v_a = _rows(rng, 6)
    k_b, v_b = _rows(rng, 3)
    pool.reserve("a", 7)
    pool.write("a", 0, k_a[:, :, :5], v_a[:, :, :5])  # 5 rows: one block and a bit
    pool.write("a", 5, k_a[:, :, 5:], v_a[:, :, 5:])  # one more, after them
    pool.reserve("b", 3)
    pool.write("b", 0, k_b, v_b)
    assert (pool.length("a"), pool.length("b")) == (6, 3)
    keys, values = pool.gather(["b", "a"], 8)
    assert keys.shape == values.shape == (LAYERS, 2, HEADS, 8, DIM)
    np.testing.assert_array_equal(keys[:, 0, :, 5:], k_b)
    np.testing.assert_array_equal(values[:, 0, :, 5:], v_b)
    np.testing.assert_array_equal(keys[:, 1, :, 2:], k_a)
    np.testing.assert_array_equal(values[:, 1, :, 2:], v_a)
    assert not keys[:, 0, :, :5].any() and not keys[:, 1, :, :2].any()  # the padding is zeros
    unpadded, _ = pool.gather(["a"], 6)
    np.testing.assert_array_equal(unpadded[:, 0], k_a)


def test_freed_blocks_serve_the_next_sequence_without_stale_rows():
    rng = np.random.default_rng(1)
    pool = _pool(num_blocks=2)
    pool.reserve("a", 8)
    pool.write("a", 0, *_rows(rng, 8))
    pool.free("a")
    pool.reserve("b", 8)
    k, v = _rows(rng, 2)
    pool.write("b", 0, k, v)
    keys, _ = pool.gather(["b"], 2)
    np.testing.assert_array_equal(keys[:, 0], k)
    pool.reserve("c", 0)  # a sequence with no rows yet: an empty past
    assert pool.gather(["c"], 0)[0].shape == (LAYERS, 1, HEADS, 0, DIM)


def test_bad_writes_and_gathers_are_refused():
    rng = np.random.default_rng(2)
    pool = _pool()
    pool.reserve("a", 4)
    with pytest.raises(ValueError, match="rows 2..2 of a sequence with 0 written"):
        pool.write("a", 2, *_rows(rng, 1))  # a gap
    with pytest.raises(ValueError, match="4 reserved"):
        pool.write("a", 0, *_rows(rng, 5))
    with pytest.raises(ValueError, match="pool holds"):
        pool.write("a", 0, np.zeros((LAYERS, HEADS, 1, DIM + 1), np.float32),
                   np.zeros((LAYERS, HEADS, 1, DIM + 1), np.float32))
    pool.write("a", 0, *_rows(rng, 3))
    with pytest.raises(ValueError, match="gather to 2 rows, a sequence has 3"):
        pool.gather(["a"], 2)
    with pytest.raises(KeyError, match="holds no KV cache blocks"):
        pool.length("nope")
    with pytest.raises(ValueError, match="num_blocks must be at least 1"):
        KVBlockPool(1, 1, 1, block_tokens=4, num_blocks=0, dtype=np.float32)
