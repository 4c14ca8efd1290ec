"""The layout of one decoder run, planned on the host: padded shapes, the engine's small inputs, the KV copy tables.

A run feeds ``chunks[b]`` new tokens after each sequence's cached past. The engine takes dense tensors, so the pasts
are LEFT-padded to one length and the new tokens RIGHT-padded to one length (decoder.py says why that keeps pads
away from real tokens). ``plan_step`` computes those lengths and the arrays the engine reads besides the keys and
values: token ids, the attention mask, position ids.

Shape buckets (``max_batch`` given: the CUDA path): every distinct set of input shapes costs a CUDA engine a binding
and a CUDA graph capture the first time it runs, so a server should see few, and few enough to capture them all
before it serves (``bucket_shapes``, run by ``DecoderRunner.warm_up``). The batch is rounded up to a power of two (pad
rows: one dummy token whose mask covers only itself, never written back), a prefill chunk to a power of two of at
least ``MIN_CHUNK`` tokens (decode's single token stays 1), and the past to a multiple of ``PAST_STEP`` tokens, four
steps per doubling beyond ``8 * PAST_STEP`` (at most a quarter of padding: 8 decode pasts for a 512-token context,
24 for 8,192). The CPU path runs exact shapes, its past rounded up to whole blocks (its engine has nothing to
capture, and pads would only cost it time).

``gather_reference`` and ``scatter_reference`` are the device kernels' contract (cuda_kernels/kv_cache.cu) in numpy:
pool blocks -> the engine's past inputs, and the new rows of its present outputs -> pool blocks, every layer's keys
and values stacked in one array [layers, 2, batch, kv_heads, rows, head_dim]. The CPU tests check them against the
host pool (``KVBlockPool``) and run the bucketed layout through the CPU engine with them; the GPU tests check the
kernels against them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: the decoder's KV tensors (the Hugging Face / optimum export convention): inputs and outputs of layer i
PAST = "past_key_values.{}.{}"
PRESENT = "present.{}.{}"
KV_PARTS = ("key", "value")
#: the fewest new-token columns a bucketed prefill run has (its chunk is padded to a power of two from there)
MIN_CHUNK = 16
#: a bucketed past is a multiple of this many tokens (of a quarter of its power of two, when that is more)
PAST_STEP = 64


def bucket_batch(rows: int, max_batch: int) -> int:
    """The batch a run of ``rows`` sequences is padded to: the next power of two, at most ``max_batch`` (the
    engine's largest), never fewer than ``rows``."""
    return max(rows, min(1 << max(rows - 1, 0).bit_length(), max_batch))


def bucket_new(new: int, longest_past: int, max_context: int) -> int:
    """The new-token columns a run whose longest chunk is ``new`` is padded to: 1 stays 1 (decode), longer chunks
    go up to a power of two of at least MIN_CHUNK, keeping the longest past plus them within ``max_context``."""
    if new <= 1:
        return new
    rounded = max(MIN_CHUNK, 1 << (new - 1).bit_length())
    return max(new, min(rounded, max_context - longest_past))


def bucket_past(longest: int) -> int:
    """The past columns a run whose longest cached past is ``longest`` is padded to (before the context's cap): a
    multiple of PAST_STEP up to 8 * PAST_STEP, then of a quarter of the power of two it lies under."""
    step = max(PAST_STEP, 1 << max((longest - 1).bit_length() - 3, 0))
    return -(-longest // step) * step


def padded_past(longest: int, new: int, block_tokens: int, max_context: int, bucket: bool = False) -> int:
    """The past length to feed: the longest past rounded up to whole blocks (``bucket``: to ``bucket_past``),
    keeping past + new within the context (so a run never feeds the model more positions than it serves).
    ValueError when the longest past and ``new`` tokens do not fit."""
    if longest + new > max_context:
        raise ValueError(f"{longest} cached + {new} new tokens exceed the engine's context of {max_context}")
    rounded = bucket_past(longest) if bucket else -(-longest // block_tokens) * block_tokens
    return min(rounded, max_context - new)


def bucket_shapes(max_batch: int, max_context: int, max_prefill_tokens: int) -> list[tuple[int, int, int]]:
    """Every (batch, past, new) a bucketed run can have for decode, and for prefill without a cached past, largest
    first (an engine's activation memory and the stepper's buffers then grow once): what ``DecoderRunner.warm_up``
    captures before serving. Prefill's rows times its longest chunk stays within ``max_prefill_tokens`` before
    bucketing, so within four times it after (or MIN_CHUNK tokens a row)."""
    batches = sorted({bucket_batch(rows, max_batch) for rows in range(1, max_batch + 1)}, reverse=True)
    pasts = sorted({padded_past(p, 1, 1, max_context, bucket=True) for p in range(1, max_context)}, reverse=True)
    decode = [(b, p, 1) for b in batches for p in pasts]
    chunks = [n for n in (1 << k for k in range(MIN_CHUNK.bit_length() - 1, max_context.bit_length()))
              if n <= max_context] + ([max_context] if max_context & (max_context - 1) else [])
    prefill = [(b, 0, n) for b in batches for n in chunks if n == MIN_CHUNK or b * n <= 4 * max_prefill_tokens]
    return decode + sorted(prefill, key=lambda shape: (shape[0] * shape[2], shape[0]), reverse=True)


def ragged_layout(lengths: np.ndarray, counts: np.ndarray, past: int, new: int) -> tuple[np.ndarray, np.ndarray]:
    """The attention mask [batch, past + new] and position ids [batch, new] of one run: row ``b`` has ``lengths[b]``
    cached tokens right-aligned in the ``past`` columns and ``counts[b]`` new tokens left-aligned in the ``new``
    columns (pads after them). Positions count each row's real tokens from 0; a pad's goes on counting (it stays
    below ``past + new``, so within the model's positions, and nothing real attends to it)."""
    columns = np.arange(past + new)[None, :]
    mask = (columns >= past - lengths[:, None]) & (columns < past + counts[:, None])
    return mask, lengths[:, None] + np.arange(new)[None, :]


@dataclass(frozen=True)
class StepLayout:
    """One run's padded shapes and host inputs. Rows ``0 .. rows - 1`` are the sequences, in order; rows after
    them (bucketing) are pads: no past, one dummy token, nothing written back."""

    rows: int
    past: int  # P: the past columns fed (every row's cached tokens right-aligned in them)
    tokens: np.ndarray  # [batch, new] int64; row b's chunk left-aligned, zeros after it
    mask: np.ndarray  # [batch, past + new] bool
    positions: np.ndarray  # [batch, new] int64
    lengths: np.ndarray  # [batch] int64: cached tokens before the run (0 for pads)
    counts: np.ndarray  # [batch] int64: new tokens written back (0 for pads)

    @property
    def batch(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def new(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def last(self) -> np.ndarray:
        """Each sequence's last new token's column [rows]: where its next-token logits are."""
        return self.counts[:self.rows] - 1

    @property
    def logits_rows(self) -> np.ndarray:
        """The ``logits_rows`` input of an engine that has it (logits_rows.py) [batch] int64: each sequence's last
        new token as a flat index into the run's batch x new tokens; pad rows read row 0."""
        rows = np.zeros(self.batch, np.int64)
        rows[:self.rows] = np.arange(self.rows) * self.new + self.last
        return rows


def plan_step(lengths: Sequence[int], chunks: Sequence[Sequence[int]], *, block_tokens: int, max_context: int,
              max_batch: int | None = None) -> StepLayout:
    """The layout of one run feeding ``chunks[b]`` after ``lengths[b]`` cached tokens. ``max_batch`` (the engine's
    largest batch) turns shape buckets on; None runs the exact shapes. ValueError for an empty chunk, a batch
    larger than ``max_batch``, or a run past the context."""
    counts = np.array([len(c) for c in chunks], np.int64)
    if len(chunks) != len(lengths) or not len(chunks) or counts.min() < 1:
        raise ValueError(f"{len(lengths)} sequences need as many chunks of at least one token, not {counts.tolist()}")
    rows, longest, new = len(chunks), int(max(lengths)), int(counts.max())
    batch = rows
    if max_batch is not None:
        if rows > max_batch:
            raise ValueError(f"{rows} sequences in one run; the engine takes at most {max_batch}")
        batch = bucket_batch(rows, max_batch)
        new = bucket_new(new, longest, max_context)
    past = padded_past(longest, new, block_tokens, max_context, bucket=max_batch is not None)
    cached = np.zeros(batch, np.int64)
    cached[:rows] = lengths
    written = np.zeros(batch, np.int64)
    written[:rows] = counts
    fed = np.maximum(written, 1)  # a pad row feeds one dummy token: no query row may be masked whole
    tokens = np.zeros((batch, new), np.int64)
    for b, chunk in enumerate(chunks):
        tokens[b, :len(chunk)] = chunk
    mask, positions = ragged_layout(cached, fed, past, new)
    return StepLayout(rows, past, tokens, mask, positions, cached, written)


def pad_layout(batch: int, past: int, new: int) -> StepLayout:
    """A run of pad rows only, at a bucket's shape: it reads and writes no sequence's keys and values, and so runs
    the engine at that shape before any sequence needs it (``DecoderRunner.warm_up``)."""
    none = np.zeros(batch, np.int64)
    mask, positions = ragged_layout(none, np.ones(batch, np.int64), past, new)
    return StepLayout(0, past, np.zeros((batch, new), np.int64), mask, positions, none, none.copy())


def gather_reference(keys: np.ndarray, values: np.ndarray, tables: np.ndarray, lengths: np.ndarray,
                     past: int) -> np.ndarray:
    """What the gather kernel writes: from pool blocks ``keys`` / ``values`` [blocks, layers, heads, block_tokens,
    dim], each row ``b``'s ``lengths[b]`` tokens (its block table ``tables[b]``) right-aligned in ``past`` rows,
    zeros before them: [layers, 2 (keys, values), batch, heads, past, dim]."""
    blocks, layers, heads, block_tokens, dim = keys.shape
    out = np.zeros((layers, 2, len(lengths), heads, past, dim), keys.dtype)
    for b, length in enumerate(int(n) for n in lengths):
        j = np.arange(length)
        block, offset = tables[b, j // block_tokens], j % block_tokens
        for part, pool in enumerate((keys, values)):
            out[:, part, b, :, past - length:] = pool[block, :, :, offset].transpose(1, 2, 0, 3)
    return out


def scatter_reference(keys: np.ndarray, values: np.ndarray, present: np.ndarray, tables: np.ndarray,
                      lengths: np.ndarray, counts: np.ndarray, past: int) -> None:
    """What the scatter kernel does: row ``b``'s new tokens, columns ``past .. past + counts[b] - 1`` of ``present``
    [layers, 2, batch, heads, past + new, dim], into pool blocks ``keys`` / ``values`` (in place) as its tokens
    ``lengths[b] ..`` (its block table ``tables[b]``)."""
    block_tokens = keys.shape[3]
    for b, (length, count) in enumerate(zip(lengths.tolist(), counts.tolist())):
        token = np.arange(length, length + count)
        block, offset = tables[b, token // block_tokens], token % block_tokens
        for part, pool in enumerate((keys, values)):
            pool[block, :, :, offset] = present[:, part, b, :, past:past + count].transpose(2, 0, 1, 3)


def row_runs(rows: np.ndarray) -> list[tuple[int, int, int]]:
    """Ascending row indices as (first row, count, position in ``rows``) runs of consecutive rows: the copies
    that fetch them (decode's rows, one new column each, are one run)."""
    runs: list[tuple[int, int, int]] = []
    for position, row in enumerate(int(r) for r in rows):
        if runs and runs[-1][0] + runs[-1][1] == row:
            first, count, at = runs[-1]
            runs[-1] = (first, count + 1, at)
        else:
            runs.append((row, 1, position))
    return runs
