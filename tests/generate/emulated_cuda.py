"""The device decode path (device_kv.py, device_step.py) on the CPU: the driver calls it makes, replaced by host ones.

A CPU engine runs by host address (``execute_async_v3`` on the CPU backend reads its inputs from, and writes its
outputs to, the addresses set), so with "device memory" made of host memory, copies made of ``memmove`` and the KV
kernels made of their numpy contract (``kv_layout.gather_reference`` / ``scatter_reference``, on the kernels' own
arguments; the argmax kernel of device_argmax.py as numpy's argmax of the rows it names), a ``DecoderRunner`` takes the device path end to end without a GPU: shape buckets, pad rows, packed
inputs, addresses, block tables, logits rows. What it cannot check is the CUDA code itself: the GPU tests do.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from engine_core.backends.cpu import host_array
from engine_core.generate import device_argmax, device_kv, device_step
from engine_core.generate.kv_layout import gather_reference, scatter_reference


class HostBuffer:
    """Stands for a DeviceBuffer: ``nbytes`` of host memory at ``ptr``; counts what is alive."""

    alive = 0

    def __init__(self, nbytes: int) -> None:
        self.nbytes = int(nbytes)
        self._memory = np.full(max(self.nbytes, 1), 0xFF, np.uint8)  # garbage, as cuMemAlloc's
        self.ptr = self._memory.ctypes.data
        HostBuffer.alive += self.nbytes

    def __del__(self) -> None:
        HostBuffer.alive -= self.nbytes


class HostStream:
    handle = 0

    def synchronize(self) -> None:
        pass


class NoRegistration:
    def __init__(self, address: int, nbytes: int, on_release: Any = None) -> None:
        self._on_release = on_release


def _bytes(address: int, nbytes: int) -> np.ndarray:
    return host_array(address, np.dtype(np.uint8), (nbytes,))


def _copy(dst: int, src: int, nbytes: int, stream: int, to_device: bool) -> None:
    ctypes.memmove(dst, src, nbytes)


def _memset(dst: int, value: int, nbytes: int, stream: int) -> None:
    ctypes.memset(dst, value, nbytes)


@dataclass
class Launches:
    """Every emulated kernel launch: (kernel name, grid, threads)."""

    calls: list[tuple[str, Any, int]] = field(default_factory=list)

    def __call__(self, function: str, grid: Any, block: int, args: list, stream: int) -> None:
        self.calls.append((function, grid, block))
        if function == "rows_argmax_f32":
            _rows_argmax(grid, *(a.value for a in args))
            return
        kind, word = function.split("_")[1], int(function.split("_w")[1])
        values = [a.value for a in args]
        if kind == "gather":
            _gather(word, grid, *values)
        else:
            _scatter(word, grid, *values)


def _tables(address: int, batch: int, max_blocks: int) -> np.ndarray:
    return host_array(address, np.dtype(np.int32), (batch, max_blocks))


def _pool(keys: int, values: int, tables: np.ndarray, layers: int, heads: int, block_tokens: int,
          row_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    shape = (int(tables.max()) + 1, layers, heads, block_tokens, row_bytes)
    return (host_array(keys, np.dtype(np.uint8), shape), host_array(values, np.dtype(np.uint8), shape))


def _gather(word: int, grid: int, past: int, keys: int, values: int, tables: int, lengths: int, layers: int,
            batch: int, heads: int, past_len: int, row: int, block_tokens: int, max_blocks: int,
            slice_words: int) -> None:
    assert grid == layers * 2 * batch * heads
    table = _tables(tables, batch, max_blocks)
    counts = host_array(lengths, np.dtype(np.int32), (batch,))
    pools = _pool(keys, values, table, layers, heads, block_tokens, row * word)
    dense = gather_reference(*pools, table, counts, past_len)
    for slot in range(2 * layers):
        out = host_array(past + slot * slice_words * word, np.dtype(np.uint8), (batch, heads, past_len, row * word))
        out[...] = dense[slot // 2, slot % 2]


def _scatter(word: int, grid: int, keys: int, values: int, present: int, tables: int, lengths: int, counts: int,
             layers: int, batch: int, heads: int, past_len: int, new_len: int, row: int, block_tokens: int,
             max_blocks: int, slice_words: int) -> None:
    assert grid == layers * 2 * batch * heads
    table = _tables(tables, batch, max_blocks)
    starts = host_array(lengths, np.dtype(np.int32), (batch,))
    news = host_array(counts, np.dtype(np.int32), (batch,))
    pools = _pool(keys, values, table, layers, heads, block_tokens, row * word)
    shape = (batch, heads, past_len + new_len, row * word)
    dense = np.stack([np.stack([host_array(present + (2 * i + p) * slice_words * word, np.dtype(np.uint8), shape)
                                for p in range(2)]) for i in range(layers)])
    scatter_reference(*pools, dense, table, starts, news, past_len)


def _rows_argmax(grid: int, logits: int, offsets: int, vocab: int, out: int) -> None:
    starts = host_array(offsets, np.dtype(np.int64), (grid,))
    ids = host_array(out, np.dtype(np.int32), (grid,))
    for r, start in enumerate(starts.tolist()):
        ids[r] = np.argmax(host_array(logits + 4 * start, np.dtype(np.float32), (vocab,)))


def emulate(monkeypatch: pytest.MonkeyPatch) -> Launches:
    """Swap the device modules' driver calls for host ones (for one test); returns the launch log."""
    launches = Launches()
    for module in (device_kv, device_step):
        monkeypatch.setattr(module, "DeviceBuffer", HostBuffer)
        monkeypatch.setattr(module, "Stream", HostStream)
        monkeypatch.setattr(module, "primary_context", lambda ordinal=0: None)
    monkeypatch.setattr(device_kv, "memset_d8_async", _memset)
    monkeypatch.setattr(device_kv, "launch_held", launches)
    monkeypatch.setattr(device_kv, "_kernel", lambda kind, word: f"kv_{kind}_w{word}")
    monkeypatch.setattr(device_argmax, "launch_held", launches)
    monkeypatch.setattr(device_argmax, "_kernel", lambda name: name)
    monkeypatch.setattr(device_kv, "copy_to_host",
                        lambda ptr, dtype, shape: host_array(ptr, np.dtype(dtype), tuple(shape)).copy())
    monkeypatch.setattr(device_step, "copy_pinned_async", _copy)
    monkeypatch.setattr(device_step, "HostRegistration", NoRegistration)
    return launches
