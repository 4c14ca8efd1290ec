"""The BPE model of tokenizer.json: one pre-tokenized word -> token ids, as Hugging Face tokenizers computes them.

Merging follows the Rust library step for step (a heap of (rank, position) over a linked list of symbols), so ties
and repeated pairs resolve the same way and a long word costs O(n log n), not O(n^2). Words are cached (LRU):
text repeats words, and chat prompts repeat whole templates.
"""

from __future__ import annotations

import heapq
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from engine_core.generate.tokenizer_error import TokenizerError

#: The merge table: (left id, right id) -> (rank, merged id).
MergeMap = dict[tuple[int, int], tuple[int, int]]
_CACHE_WORDS = 10_000
_CACHE_MAX_CHARS = 256  # longer words are rare and would crowd the cache out


class _WordCache:
    """A thread-safe LRU map word -> ids (the server encodes from several threads)."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._items: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, word: str) -> tuple[int, ...] | None:
        with self._lock:
            ids = self._items.get(word)
            if ids is not None:
                self._items.move_to_end(word)
            return ids

    def put(self, word: str, ids: tuple[int, ...]) -> None:
        with self._lock:
            self._items[word] = ids
            if len(self._items) > self._capacity:
                self._items.popitem(last=False)


def _parse_merges(merges: Any, vocab: Mapping[str, int], prefix_len: int) -> MergeMap:
    if not isinstance(merges, list):
        raise TokenizerError("model.merges: expected a list")
    table: MergeMap = {}
    for rank, merge in enumerate(merges):
        parts = merge.split(" ") if isinstance(merge, str) else merge
        if not isinstance(parts, list) or len(parts) != 2:
            raise TokenizerError(f"model.merges[{rank}]: expected 'a b' or [a, b], got {merge!r}")
        a, b = parts
        merged = a + b[prefix_len:]
        for token in (a, b, merged):
            if token not in vocab:
                raise TokenizerError(f"model.merges[{rank}]: {token!r} is not in model.vocab")
        table[(vocab[a], vocab[b])] = (rank, vocab[merged])
    return table


class BPE:
    """Byte-pair encoding with Hugging Face's options (unk/fuse_unk, byte_fallback, ignore_merges, affixes)."""

    def __init__(self, vocab: Mapping[str, int], merges: MergeMap, *, unk_token: str | None = None,
                 fuse_unk: bool = False, byte_fallback: bool = False, ignore_merges: bool = False,
                 continuing_subword_prefix: str = "", end_of_word_suffix: str = "") -> None:
        self.vocab = dict(vocab)
        self.id_to_token = {i: t for t, i in self.vocab.items()}
        self._merges = merges
        self._unk_id = self.vocab.get(unk_token) if unk_token is not None else None
        self._fuse_unk = fuse_unk
        self._byte_fallback = byte_fallback
        self._ignore_merges = ignore_merges
        self._prefix = continuing_subword_prefix
        self._suffix = end_of_word_suffix
        self._bytes = {b: self.vocab.get(f"<0x{b:02X}>") for b in range(256)} if byte_fallback else {}
        self._cache = _WordCache(_CACHE_WORDS)

    @classmethod
    def from_json(cls, model: Mapping[str, Any]) -> BPE:
        """tokenizer.json's ``model`` object (type BPE)."""
        kind = model.get("type", "BPE")
        if kind != "BPE":
            raise TokenizerError(f"model.type: {kind!r} is not supported (BPE only)")
        if model.get("dropout") not in (None, 0, 0.0):
            raise TokenizerError("model.dropout: BPE dropout is not supported at inference")
        vocab = model.get("vocab")
        if not isinstance(vocab, dict):
            raise TokenizerError("model.vocab: expected an object token -> id")
        prefix = model.get("continuing_subword_prefix") or ""
        return cls(vocab, _parse_merges(model.get("merges", []), vocab, len(prefix)),
                   unk_token=model.get("unk_token"), fuse_unk=bool(model.get("fuse_unk", False)),
                   byte_fallback=bool(model.get("byte_fallback", False)),
                   ignore_merges=bool(model.get("ignore_merges", False)),
                   continuing_subword_prefix=prefix, end_of_word_suffix=model.get("end_of_word_suffix") or "")

    def tokenize(self, word: str) -> tuple[int, ...]:
        """The ids of one pre-tokenized word."""
        if not word:
            return ()
        if self._ignore_merges and word in self.vocab:
            return (self.vocab[word],)
        ids = self._cache.get(word)
        if ids is None:
            ids = tuple(self._merge_all(self._symbols(word)))
            if len(word) <= _CACHE_MAX_CHARS:
                self._cache.put(word, ids)
        return ids

    def _symbols(self, word: str) -> list[int]:
        """The word's characters as ids before merging (with byte fallback, unknown and fused unknown)."""
        symbols: list[int] = []
        pending_unk = False
        last = len(word) - 1
        for i, char in enumerate(word):
            piece = (self._prefix if i else "") + char + (self._suffix if i == last else "")
            token = self.vocab.get(piece)
            if token is not None:
                symbols.append(token)
                pending_unk = False
                continue
            fallback = [self._bytes.get(b) for b in piece.encode()] if self._byte_fallback else [None]
            if all(t is not None for t in fallback):
                symbols.extend(t for t in fallback if t is not None)
                pending_unk = False
            elif self._unk_id is not None and not (pending_unk and self._fuse_unk):
                symbols.append(self._unk_id)
                pending_unk = True
        return symbols

    def _merge_all(self, symbols: list[int]) -> list[int]:
        """Apply merges lowest rank first, leftmost first among equal ranks (the Rust library's order)."""
        merges = self._merges
        n = len(symbols)
        nxt = list(range(1, n + 1))
        prev = list(range(-1, n - 1))
        alive = [True] * n
        heap = [(merges[pair][0], i, merges[pair][1]) for i, pair in enumerate(zip(symbols, symbols[1:]))
                if pair in merges]
        heapq.heapify(heap)
        while heap:
            rank, pos, new = heapq.heappop(heap)
            right = nxt[pos]
            if not alive[pos] or right >= n:
                continue
            found = merges.get((symbols[pos], symbols[right]))
            if found is None or found[1] != new:
                continue  # a stale entry: one side has merged since
            symbols[pos] = new
            alive[right] = False
            nxt[pos] = nxt[right]
            if nxt[pos] < n:
                prev[nxt[pos]] = pos
            if prev[pos] >= 0:
                left = merges.get((symbols[prev[pos]], new))
                if left is not None:
                    heapq.heappush(heap, (left[0], prev[pos], left[1]))
            if nxt[pos] < n:
                after = merges.get((new, symbols[nxt[pos]]))
                if after is not None:
                    heapq.heappush(heap, (after[0], pos, after[1]))
        return [s for s, keep in zip(symbols, alive) if keep]
