"""The paged KV cache in device memory, for decoder engines on the CUDA backend.

The host pool (``KVBlockPool``) costs a CUDA engine the whole cache across PCIe twice per token: every step copies
each sequence's past to the device and the engine's present outputs back. ``DeviceKVPool`` keeps the same blocks
(the same ``BlockAccounting``) in device memory instead, and moves rows between them and the engine's own past /
present buffers with two kernels (cuda_kernels/kv_cache.cu), one launch each way per step whatever the layers,
sequences and blocks: ``gather`` fills the past inputs of every layer from the blocks (left-padded, zeros before a
sequence's first token) and ``scatter`` stores the new rows of the present outputs. Only the block tables (a few KB)
cross PCIe. ``device_step.DeviceStepper`` runs the engine around them.

Device memory comes from ``engine_core.cuda.driver`` (this package never calls the driver bindings itself); the
kernels compile with NVRTC on first use (cached on disk, like every Kiln kernel).
"""

from __future__ import annotations

import ctypes
from collections.abc import Hashable, Sequence
from functools import cache
from typing import Any

import numpy as np

from engine_core.cuda.driver import (
    DeviceBuffer,
    Module,
    Stream,
    compute_capability,
    copy_to_host,
    launch_held,
    memset_d8_async,
    primary_context,
)
from engine_core.errors import KilnError
from engine_core.generate.kv_cache import BlockAccounting
from engine_core.generate.kv_layout import StepLayout, gather_reference

#: cuda_kernels/kv_cache.cu (a kernel family of this package's, not of engine plans)
KV_KERNEL_FILE = "kv_cache"
#: the word widths the kernels come in (bytes), widest first
WORD_BYTES = (16, 8, 4, 2, 1)
#: device tensors the engine binds start on this many bytes (what its kernels may assume of an I/O address)
ALIGNMENT = 256
#: threads per block of the kernels (one block per layer, part, sequence and head)
THREADS = 128


def kv_word(row_bytes: int) -> int:
    """The widest word (bytes) dividing a row of one head (head_dim elements): what a thread of the kernels
    moves at once."""
    return next(w for w in WORD_BYTES if row_bytes % w == 0)


def slice_bytes(batch: int, heads: int, rows: int, head_dim: int, itemsize: int) -> int:
    """Bytes of one layer's keys (or values) [batch, heads, rows, head_dim], rounded up to ALIGNMENT: the stride of
    the (layer, part) slices in the engine-side buffers, so every slice's address is aligned."""
    raw = batch * heads * rows * head_dim * itemsize
    return -(-raw // ALIGNMENT) * ALIGNMENT


@cache
def _module(arch: str) -> Module:
    from engine_core.cuda.nvrtc import compile_kernel_file

    return Module(compile_kernel_file(KV_KERNEL_FILE, arch))


@cache
def _kernel(kind: str, word: int) -> Any:
    """The ``kv_{kind}_w{word}`` function for this GPU (its module compiled and loaded once per process)."""
    major, minor = compute_capability()
    return _module(f"sm_{major}{minor}").function(f"kv_{kind}_w{word}")


class DeviceKVPool(BlockAccounting):
    """``BlockAccounting``'s blocks in one device allocation: keys [num_blocks, layers, kv_heads, block_tokens,
    head_dim] then values of the same shape, zeroed at first. ``close`` frees it (so does losing the object)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, *, block_tokens: int, num_blocks: int,
                 dtype: np.dtype) -> None:
        super().__init__(layers, kv_heads, head_dim, block_tokens=block_tokens, num_blocks=num_blocks, dtype=dtype)
        self.nbytes = self.total_blocks * self.bytes_per_block
        self._storage: DeviceBuffer | None = DeviceBuffer(self.nbytes)
        stream = Stream()
        memset_d8_async(self._storage.ptr, 0, self.nbytes, stream.handle)
        stream.synchronize()
        self.row_bytes = head_dim * self.dtype.itemsize
        self.word = kv_word(self.row_bytes)

    @property
    def closed(self) -> bool:
        return self._storage is None

    @property
    def keys_ptr(self) -> int:
        return self._buffer().ptr

    @property
    def values_ptr(self) -> int:
        return self._buffer().ptr + self.nbytes // 2

    def close(self) -> None:
        """Free the device memory now (idempotent); the pool is unusable afterwards. The caller has finished
        every run reading or writing it (its stream synchronized)."""
        self._storage = None

    def _buffer(self) -> DeviceBuffer:
        if self._storage is None:
            raise KilnError("the device KV cache is closed")
        return self._storage

    # -- a step's part (device_step.DeviceStepper) ---------------------------------------------------------------
    def tables_for(self, seqs: Sequence[Hashable], layout: StepLayout) -> np.ndarray:
        """The block tables the kernels read for a run of ``seqs`` laid out as ``layout`` [layout.batch, widest]
        (pad rows 0, never read), once every row the run reads or writes is reserved (ValueError otherwise: a
        kernel must never touch another sequence's block)."""
        for seq, length, count in zip(seqs, layout.lengths.tolist(), layout.counts.tolist()):
            table = self._check_rows(seq, length, count)
            if table.length != length:
                raise ValueError(f"sequence {seq!r} has {table.length} tokens cached, the run says {length}")
        return self.block_tables(seqs, layout.batch)

    def commit(self, seqs: Sequence[Hashable], layout: StepLayout) -> None:
        """Record the rows a run's scatter stored (after it ran)."""
        for seq, length, count in zip(seqs, layout.lengths.tolist(), layout.counts.tolist()):
            self._written(seq, length, count)

    def gather_into(self, past: int, slice_stride: int, tables: int, lengths: int, *, batch: int, past_len: int,
                    max_blocks: int, stream: int) -> None:
        """Enqueue the gather kernel on ``stream``: every layer's keys and values of ``batch`` rows (device int32
        ``tables`` [batch, max_blocks] and ``lengths`` [batch]) into the engine's past tensors, slice ``layer * 2 +
        part`` at ``past + (layer * 2 + part) * slice_stride`` bytes, each [batch, kv_heads, past_len, head_dim]."""
        if past_len == 0:
            return
        words = self.row_bytes // self.word
        launch_held(_kernel("gather", self.word), self.layers * 2 * batch * self.kv_heads, THREADS,
                    [ctypes.c_uint64(past), ctypes.c_uint64(self.keys_ptr), ctypes.c_uint64(self.values_ptr),
                     ctypes.c_uint64(tables), ctypes.c_uint64(lengths), ctypes.c_int(self.layers),
                     ctypes.c_int(batch), ctypes.c_int(self.kv_heads), ctypes.c_int(past_len), ctypes.c_int(words),
                     ctypes.c_int(self.block_tokens), ctypes.c_int(max_blocks),
                     ctypes.c_longlong(slice_stride // self.word)], stream)

    def scatter_from(self, present: int, slice_stride: int, tables: int, lengths: int, counts: int, *, batch: int,
                     past_len: int, new_len: int, max_blocks: int, stream: int) -> None:
        """Enqueue the scatter kernel on ``stream``: row ``b``'s ``counts[b]`` new tokens (columns ``past_len ..``
        of the present tensors [batch, kv_heads, past_len + new_len, head_dim], laid out as ``gather_into``'s) into
        its blocks as its tokens ``lengths[b] ..``."""
        words = self.row_bytes // self.word
        threads = min(THREADS, -(-new_len * words // 32) * 32)
        launch_held(_kernel("scatter", self.word), self.layers * 2 * batch * self.kv_heads, threads,
                    [ctypes.c_uint64(self.keys_ptr), ctypes.c_uint64(self.values_ptr), ctypes.c_uint64(present),
                     ctypes.c_uint64(tables), ctypes.c_uint64(lengths), ctypes.c_uint64(counts),
                     ctypes.c_int(self.layers), ctypes.c_int(batch), ctypes.c_int(self.kv_heads),
                     ctypes.c_int(past_len), ctypes.c_int(new_len), ctypes.c_int(words),
                     ctypes.c_int(self.block_tokens), ctypes.c_int(max_blocks),
                     ctypes.c_longlong(slice_stride // self.word)], stream)

    # -- reading it back (tests, debugging) ------------------------------------------------------------------------
    def read_blocks(self) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of every block's keys and values [num_blocks, layers, kv_heads, block_tokens, head_dim]
        (synchronous: after the runs that wrote them)."""
        primary_context()
        shape = (self.total_blocks, *self.block_shape)
        keys = copy_to_host(self.keys_ptr, self.dtype, shape)
        return keys, copy_to_host(self.values_ptr, self.dtype, shape)

    def gather(self, seqs: Sequence[Hashable], past: int) -> tuple[np.ndarray, np.ndarray]:
        """``KVBlockPool.gather`` of the device blocks, on the host: [layers, len(seqs), kv_heads, past, head_dim]
        keys and values, left-padded."""
        lengths = np.array([self.length(seq) for seq in seqs], np.int64)
        if len(lengths) and lengths.max() > past:
            raise ValueError(f"gather to {past} rows, a sequence has {int(lengths.max())}")
        dense = gather_reference(*self.read_blocks(), self.block_tables(seqs), lengths, past)
        return dense[:, 0], dense[:, 1]
