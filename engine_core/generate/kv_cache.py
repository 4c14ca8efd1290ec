"""The paged KV cache: fixed-size blocks of keys and values, handed to sequences as they need them.

A decoder's past grows by one token per step and sequences come and go at different times; one contiguous buffer
per sequence sized for the longest context would waste most of the memory and fragment it. The pool instead holds
``num_blocks`` blocks of ``block_tokens`` tokens (every layer's keys and values for those tokens) and gives each
sequence a block table, as vLLM's PagedAttention does. The engine itself takes a dense past, so ``gather`` copies
a batch's pasts out of the blocks, left-padded to one length, and ``write`` puts the rows the engine returns back.

``BlockAccounting`` is the part that does not care where the blocks live (free list, block tables, lengths,
reference counts, the prefix cache); ``KVBlockPool`` keeps them in host memory, ``device_kv.DeviceKVPool`` in device
memory for CUDA engines. A sequence takes blocks as its tokens come: ``reserve`` for its prompt when it is admitted,
``grow`` before a step that passes its last block; when ``grow`` finds none free the generator preempts a sequence
(generator.py) rather than fail one.

Prefix caching (vLLM's automatic prefix caching): chat requests repeat a system prompt and a conversation's earlier
turns, whose keys and values are the same for every request that starts with them. A full block of a prompt is
named by a hash chained over its tokens and its parent block's hash (``PromptBlocks``), so two blocks match only
when the whole prefix up to their end does. A sequence reserved with its ``PromptBlocks`` shares the cached blocks
its prompt starts with (a reference count each) instead of taking new ones and recomputing them, and registers its
own prompt blocks under their hashes as they fill. A block no sequence holds any more keeps its rows while its hash
is known: evictable, reused least recently used first once no clean block is left. Shared and registered blocks
are never written (``_check_rows`` refuses it, for the host write and the device scatter alike): a sequence writes
only into blocks it holds alone, and the partly filled last block of its prompt is always its own.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np


class KVCacheFull(Exception):
    """Not enough free blocks for a reservation (nothing was reserved)."""


@dataclass(frozen=True)
class PromptBlocks:
    """A prompt's full blocks as the prefix cache names them: ``hashes[i]``, the SHA-256 of block ``i - 1``'s hash
    and block ``i``'s token ids (a cryptographic hash, so that no client can craft a prompt whose blocks pass for
    another's), and how many leading blocks a sequence may take from the cache: those before its prompt's last
    token, which is always computed (its logits give the first new token)."""

    hashes: tuple[bytes, ...]
    shareable: int

    @classmethod
    def of(cls, prompt: Sequence[int], block_tokens: int) -> PromptBlocks:
        data = np.asarray(prompt, "<i8").tobytes()
        width, parent, hashes = block_tokens * 8, b"", []
        for i in range(len(prompt) // block_tokens):
            parent = hashlib.sha256(parent + data[i * width:(i + 1) * width]).digest()
            hashes.append(parent)
        return cls(tuple(hashes), max(len(prompt) - 1, 0) // block_tokens)


@dataclass
class _Table:
    blocks: list[int] = field(default_factory=list)
    length: int = 0  # tokens written (rows 0 .. length - 1 hold keys and values)
    hashes: tuple[bytes, ...] = ()  # its prompt's full blocks' (PromptBlocks): registered as they fill
    hashed: int = 0  # leading blocks already shared or registered (or found registered by another: duplicates)


class BlockAccounting:
    """The block accounting and geometry of a paged KV cache, without its storage: ``num_blocks`` blocks, each
    [layers, kv_heads, block_tokens, head_dim] keys and as many values of ``dtype``, and per sequence (any hashable
    id) the blocks it holds and the tokens written, each block's reference count and the prefix cache (the module
    docstring). Subclasses store the blocks. Not thread-safe: one generator loop owns it (``used_blocks`` and
    ``cached_blocks`` may be read from other threads)."""

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
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack of clean blocks: the lowest is handed out first
        self._tables: dict[Hashable, _Table] = {}
        self._refs = [0] * num_blocks  # how many sequences hold each block
        self._cached: dict[bytes, int] = {}  # the prefix cache: hash -> the block holding it (held or evictable)
        self._hash_of: dict[int, bytes] = {}  # its inverse
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered blocks no one holds, oldest first

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        """The keys (or values) of one block: [layers, kv_heads, block_tokens, head_dim]."""
        return self.layers, self.kv_heads, self.block_tokens, self.head_dim

    def close(self) -> None:
        """Free the storage outside Python's memory (a device pool's); nothing to do for host numpy blocks."""

    @property
    def used_blocks(self) -> int:
        """Blocks some sequence holds."""
        return self.total_blocks - len(self._free) - len(self._evictable)

    @property
    def free_blocks(self) -> int:
        """Blocks a reservation may take: the clean ones and the evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def cached_blocks(self) -> int:
        """Evictable blocks: held by no sequence, keeping the rows of a prefix the cache knows."""
        return len(self._evictable)

    def ref_count(self, block: int) -> int:
        """How many sequences hold ``block``."""
        return self._refs[block]

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

    def cached_prefix(self, prompt: PromptBlocks) -> list[int]:
        """The cached blocks ``prompt`` may share: those of its first ``shareable`` hashes, up to the first miss."""
        blocks = []
        for digest in prompt.hashes[:prompt.shareable]:
            block = self._cached.get(digest)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def fits(self, tokens: int, prompt: PromptBlocks | None = None, spare: int = 0) -> bool:
        """Whether a new sequence of ``tokens`` tokens could be reserved now (with ``prompt``'s cached prefix),
        leaving at least ``spare`` blocks free."""
        shared = self.cached_prefix(prompt) if prompt else []
        return self._new_blocks(tokens, shared) + self._revived(shared) + spare <= self.free_blocks

    def reserve(self, seq: Hashable, tokens: int, prompt: PromptBlocks | None = None) -> int:
        """Make room for ``tokens`` tokens of ``seq`` in all (a new ``seq`` starts empty). A new ``seq`` with its
        ``prompt``'s blocks shares the cached blocks its prompt starts with and registers its other prompt blocks as
        they fill; returns the tokens it shares (written already: the next write starts there). KVCacheFull, and
        nothing reserved, when the free blocks are too few."""
        table = self._tables.get(seq)
        shared = self.cached_prefix(prompt) if prompt and table is None else []
        table = table or _Table(length=len(shared) * self.block_tokens)
        new = self._new_blocks(tokens, shared, len(table.blocks))
        needed = new + self._revived(shared)
        if needed > self.free_blocks:
            raise KVCacheFull(f"{needed} more KV cache blocks wanted, {self.free_blocks} of {self.total_blocks} free")
        for block in shared:
            self._hold(block)
        if prompt and not table.blocks:
            table.hashes, table.hashed = prompt.hashes, len(shared)
        table.blocks += shared
        table.blocks += [self._take() for _ in range(new)]
        self._tables[seq] = table
        return len(shared) * self.block_tokens

    def grow(self, seq: Hashable, tokens: int) -> bool:
        """Make room for ``tokens`` tokens in all of a sequence that holds blocks already, taking the blocks it lacks
        (clean ones first, then evicting cached prefixes least recently used first, as ``reserve`` does); False, and
        nothing taken, when the free blocks are too few. Why not ``reserve``: a running sequence's blocks are taken
        as its tokens come (the generator's blocks on demand), and running out is the caller's cue to preempt a
        sequence, not an error."""
        table = self._table(seq)
        new = self._new_blocks(tokens, [], len(table.blocks))
        if new > self.free_blocks:
            return False
        table.blocks += [self._take() for _ in range(new)]
        return True

    def free(self, seq: Hashable) -> int:
        """Let go of ``seq``'s blocks (an unknown ``seq``: nothing); how many it held. A block no one else holds is
        free again: evictable while the cache knows its prefix, clean otherwise."""
        table = self._tables.pop(seq, None)
        if table is None:
            return 0
        for block in reversed(table.blocks):  # its last blocks first: they go before the prefixes they extend
            self._refs[block] -= 1
            if self._refs[block] < 0:
                raise AssertionError(f"KV cache block {block} released more often than held")
            if self._refs[block]:
                continue
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free.append(block)
        return len(table.blocks)

    def truncate(self, seq: Hashable, tokens: int) -> None:
        """Forget what ``seq`` wrote after its first ``tokens`` tokens (its blocks stay reserved): the next write
        starts there. Why: a benchmark steps the same past over and over; a rejected draft token rolls back. The
        blocks it may write again leave the prefix cache for good (what it writes there need not be its prompt);
        ValueError when another sequence shares one of them."""
        table = self._table(seq)
        if not 0 <= tokens <= table.length:
            raise ValueError(f"cannot truncate a sequence of {table.length} tokens to {tokens}")
        first = tokens // self.block_tokens
        if any(self._refs[block] > 1 for block in table.blocks[first:]):
            raise ValueError(f"cannot truncate a sequence to {tokens} tokens: another sequence shares its blocks "
                             f"after that")
        for block in table.blocks[first:]:
            self._forget(block)
        table.length, table.hashes, table.hashed = tokens, table.hashes[:first], min(table.hashed, first)

    def block_tables(self, seqs: Sequence[Hashable], rows: int | None = None) -> np.ndarray:
        """The block tables of ``seqs`` as one int32 array [rows, widest table] (``rows`` >= len(seqs), default
        len(seqs); rows past ``seqs`` and entries past a shorter table are 0): what the device kernels index."""
        tables = [self._table(seq).blocks for seq in seqs]
        out = np.zeros((len(seqs) if rows is None else rows, max([len(t) for t in tables] + [1])), np.int32)
        for row, blocks in enumerate(tables):
            out[row, :len(blocks)] = blocks
        return out

    def _check_rows(self, seq: Hashable, start: int, n: int) -> _Table:
        """``seq``'s table, once rows ``start .. start + n - 1`` are reserved, leave no gap after those written and
        lie in blocks ``seq`` alone holds and the cache does not name; ValueError otherwise."""
        table = self._table(seq)
        if start > table.length or start + n > len(table.blocks) * self.block_tokens:
            raise ValueError(f"rows {start}..{start + n - 1} of a sequence with {table.length} written and "
                             f"{len(table.blocks) * self.block_tokens} reserved")
        if n > 0:
            for block in table.blocks[start // self.block_tokens:(start + n - 1) // self.block_tokens + 1]:
                if self._refs[block] != 1 or block in self._hash_of:
                    raise ValueError(f"rows {start}..{start + n - 1} of sequence {seq!r} fall in KV cache block "
                                     f"{block}, which is shared or cached: never written")
        return table

    def _written(self, seq: Hashable, start: int, n: int) -> None:
        """Record that rows ``start .. start + n - 1`` of ``seq`` hold keys and values now, and register the prompt
        blocks that became full (a hash the cache knows already keeps its block: this one stays unnamed)."""
        table = self._check_rows(seq, start, n)
        table.length = max(table.length, start + n)
        while table.hashed < min(len(table.hashes), table.length // self.block_tokens):
            digest, block = table.hashes[table.hashed], table.blocks[table.hashed]
            if digest not in self._cached:
                self._cached[digest], self._hash_of[block] = block, digest
            table.hashed += 1

    def _new_blocks(self, tokens: int, shared: list[int], held: int = 0) -> int:
        """Blocks a reservation of ``tokens`` takes besides those ``held`` already and those ``shared``."""
        return max(self.blocks_for(tokens) - held - len(shared), 0)

    def _revived(self, shared: list[int]) -> int:
        """Free blocks that sharing ``shared`` takes: the evictable ones (held again, they are not free any more)."""
        return sum(block in self._evictable for block in shared)

    def _hold(self, block: int) -> None:
        self._refs[block] += 1
        self._evictable.pop(block, None)

    def _take(self) -> int:
        """A block for a sequence alone: a clean one, else the least recently used evictable one (its prefix
        leaves the cache)."""
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            self._forget(block)
        self._refs[block] = 1
        return block

    def _forget(self, block: int) -> None:
        """Take ``block`` out of the prefix cache (if it is in it)."""
        digest = self._hash_of.pop(block, None)
        if digest is not None:
            del self._cached[digest]

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
