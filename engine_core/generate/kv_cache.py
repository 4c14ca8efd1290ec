"""The paged KV cache: fixed-size blocks of keys and values, handed to sequences as they need them.

A decoder's past grows by one token per step and sequences come and go at different times; one contiguous buffer
per sequence sized for the longest context would waste most of the memory and fragment it. The pool instead holds
``num_blocks`` blocks of ``block_tokens`` tokens (every layer's keys and values for those tokens) and gives each
sequence a block table, as vLLM's PagedAttention does. The engine itself takes a dense past, so ``gather`` copies
a batch's pasts out of the blocks, left-padded to one length, and ``write`` puts the rows the engine returns back.

``BlockAccounting`` is the part that does not care where the blocks live (free list, block tables, lengths);
``KVBlockPool`` keeps them in host memory, ``device_kv.DeviceKVPool`` in device memory for CUDA engines.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np


class KVCacheFull(Exception):
    """Not enough free blocks for a reservation (nothing was reserved)."""


@dataclass
class _Table:
    blocks: list[int] = field(default_factory=list)
    length: int = 0  # tokens written (rows 0 .. length - 1 hold keys and values)


class BlockAccounting:
    """The block accounting and geometry of a paged KV cache, without its storage: ``num_blocks`` blocks, each
    [layers, kv_heads, block_tokens, head_dim] keys and as many values of ``dtype``, and per sequence (any hashable
    id) the blocks it holds and the tokens written. Subclasses store the blocks. Not thread-safe: one generator
    loop owns it (``used_blocks`` may be read from other threads)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, *, block_tokens: int, num_blocks: int,
                 dtype: np.dtype) -> None:
        for name, value in (("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim),
                            ("block_tokens", block_tokens), ("num_blocks", num_blocks)):
            if value < 1:
                raise ValueError(f"{type(self).__name__}: {name} must be at least 1, not {value}")
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.block_tokens = block_tokens
        self.total_blocks = num_blocks
        self.dtype = np.dtype(dtype)
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: the lowest block is handed out first
        self._tables: dict[Hashable, _Table] = {}

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        """The keys (or values) of one block: [layers, kv_heads, block_tokens, head_dim]."""
        return self.layers, self.kv_heads, self.block_tokens, self.head_dim

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - len(self._free)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def bytes_per_block(self) -> int:
        return 2 * int(np.prod(self.block_shape)) * self.dtype.itemsize

    def blocks_for(self, tokens: int) -> int:
        """How many blocks hold ``tokens`` tokens."""
        return -(-max(tokens, 0) // self.block_tokens)

    def __contains__(self, seq: Hashable) -> bool:
        return seq in self._tables

    def length(self, seq: Hashable) -> int:
        """Tokens written for ``seq``."""
        return self._table(seq).length

    def capacity(self, seq: Hashable) -> int:
        """Tokens ``seq``'s reserved blocks hold."""
        return len(self._table(seq).blocks) * self.block_tokens

    def blocks(self, seq: Hashable) -> list[int]:
        """The blocks ``seq`` holds, in token order (block ``i`` holds its tokens ``i * block_tokens`` on)."""
        return list(self._table(seq).blocks)

    def reserve(self, seq: Hashable, tokens: int) -> None:
        """Make room for ``tokens`` tokens of ``seq`` in all (a new ``seq`` starts empty). KVCacheFull, and nothing
        reserved, when the free blocks are too few."""
        table = self._tables.get(seq) or _Table()
        needed = self.blocks_for(tokens) - len(table.blocks)
        if needed > len(self._free):
            raise KVCacheFull(f"{needed} more KV cache blocks wanted, {len(self._free)} of {self.total_blocks} free")
        table.blocks += [self._free.pop() for _ in range(max(needed, 0))]
        self._tables[seq] = table

    def free(self, seq: Hashable) -> int:
        """Return ``seq``'s blocks to the pool (an unknown ``seq``: nothing); how many were freed."""
        table = self._tables.pop(seq, None)
        if table is None:
            return 0
        self._free += reversed(table.blocks)
        return len(table.blocks)

    def truncate(self, seq: Hashable, tokens: int) -> None:
        """Forget what ``seq`` wrote after its first ``tokens`` tokens (its blocks stay reserved): the next write
        starts there. Why: a benchmark steps the same past over and over; a rejected draft token rolls back."""
        table = self._table(seq)
        if not 0 <= tokens <= table.length:
            raise ValueError(f"cannot truncate a sequence of {table.length} tokens to {tokens}")
        table.length = tokens

    def block_tables(self, seqs: Sequence[Hashable], rows: int | None = None) -> np.ndarray:
        """The block tables of ``seqs`` as one int32 array [rows, widest table] (``rows`` >= len(seqs), default
        len(seqs); rows past ``seqs`` and entries past a shorter table are 0): what the device kernels index."""
        tables = [self._table(seq).blocks for seq in seqs]
        out = np.zeros((len(seqs) if rows is None else rows, max([len(t) for t in tables] + [1])), np.int32)
        for row, blocks in enumerate(tables):
            out[row, :len(blocks)] = blocks
        return out

    def _check_rows(self, seq: Hashable, start: int, n: int) -> _Table:
        """``seq``'s table, once rows ``start .. start + n - 1`` are reserved and leave no gap after those
        written; ValueError otherwise."""
        table = self._table(seq)
        if start > table.length or start + n > len(table.blocks) * self.block_tokens:
            raise ValueError(f"rows {start}..{start + n - 1} of a sequence with {table.length} written and "
                             f"{len(table.blocks) * self.block_tokens} reserved")
        return table

    def _written(self, seq: Hashable, start: int, n: int) -> None:
        """Record that rows ``start .. start + n - 1`` of ``seq`` hold keys and values now."""
        table = self._check_rows(seq, start, n)
        table.length = max(table.length, start + n)

    def _table(self, seq: Hashable) -> _Table:
        try:
            return self._tables[seq]
        except KeyError:
            raise KeyError(f"sequence {seq!r} holds no KV cache blocks") from None


class KVBlockPool(BlockAccounting):
    """The blocks in host memory: block ``b`` holds ``keys[b]`` and ``values[b]``, each [layers, kv_heads,
    block_tokens, head_dim]."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, *, block_tokens: int, num_blocks: int,
                 dtype: np.dtype) -> None:
        super().__init__(layers, kv_heads, head_dim, block_tokens=block_tokens, num_blocks=num_blocks, dtype=dtype)
        shape = (num_blocks, *self.block_shape)
        self.keys = np.zeros(shape, self.dtype)
        self.values = np.zeros(shape, self.dtype)

    def write(self, seq: Hashable, start: int, keys: np.ndarray, values: np.ndarray) -> None:
        """Store rows ``start .. start + n - 1`` of ``seq``: ``keys`` and ``values`` are [layers, kv_heads, n,
        head_dim]. The rows must be reserved and leave no gap after those written before."""
        n = keys.shape[2]
        if keys.shape != values.shape or keys.shape != (self.layers, self.kv_heads, n, self.head_dim):
            raise ValueError(f"KV rows of shape {keys.shape} / {values.shape}, the pool holds "
                             f"[{self.layers}, {self.kv_heads}, n, {self.head_dim}]")
        table = self._check_rows(seq, start, n)
        row = start
        while row < start + n:
            block, offset = table.blocks[row // self.block_tokens], row % self.block_tokens
            count = min(self.block_tokens - offset, start + n - row)
            source = slice(row - start, row - start + count)
            self.keys[block, :, :, offset:offset + count] = keys[:, :, source]
            self.values[block, :, :, offset:offset + count] = values[:, :, source]
            row += count
        self._written(seq, start, n)

    def gather(self, seqs: Sequence[Hashable], past: int) -> tuple[np.ndarray, np.ndarray]:
        """The pasts of ``seqs`` as dense arrays [layers, len(seqs), kv_heads, past, head_dim] (keys, values),
        each sequence's rows right-aligned (LEFT padding with zeros): row ``past - length + j`` holds its token
        ``j``. ``past`` must be at least every sequence's length."""
        shape = (self.layers, len(seqs), self.kv_heads, past, self.head_dim)
        keys, values = np.zeros(shape, self.dtype), np.zeros(shape, self.dtype)
        for b, seq in enumerate(seqs):
            table = self._table(seq)
            if table.length > past:
                raise ValueError(f"gather to {past} rows, a sequence has {table.length}")
            if table.length == 0:
                continue
            used = table.blocks[:self.blocks_for(table.length)]
            for source, target in ((self.keys, keys), (self.values, values)):
                rows = source[used].transpose(1, 2, 0, 3, 4).reshape(self.layers, self.kv_heads, -1, self.head_dim)
                target[:, b, :, past - table.length:] = rows[:, :, :table.length]
        return keys, values
