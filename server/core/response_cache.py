"""Triton's response cache: responses kept by a hash of their request, so a repeated request skips the model.

What Triton does (docs/user_guide/response_cache.md; core/src/cache_manager.cc, dynamic_batch_scheduler.cc,
infer_stats.cc; the `local` cache, triton-inference-server/local_cache) and Kiln does the same:
- `--cache-config local,size=<bytes>` makes one cache in host memory, shared by every model; a model uses it only
  with `response_cache { enable: true }` in its config. Without the flag such a model loads and runs uncached.
- The key hashes the model name, its version and every input (name and data, in name order): not the request id
  nor its parameters. Kiln adds each input's dtype and shape and the names of the outputs asked for, so requests
  that differ only there (which Triton would answer with another request's outputs) do not share an entry.
- Only requests whose tensors are all in host memory use the cache (Triton's "CPU memory" limitation): an input or
  output in CUDA shared memory bypasses it. Only successful responses are stored. The entry keeps the model's
  outputs; what a request asks for on top (classification, system shared memory) is applied to each answer.
- Full, the cache evicts its least recently used entries until the new one fits; an entry larger than the whole
  cache is not stored (a warning per model). Inserting a key already there stores nothing and counts no miss.
- Kiln forgets a model's entries when it is loaded again or unloaded (`forget`): a reloaded version 1 may run
  another model file. Triton's cache API has no removal, so Triton keeps answering from the old entries.

Statistics and metrics (server/core/statistics.py, server/metrics.py) are counted by the core; this module keeps
the cache-wide counters Triton's local cache reports (`nv_cache_*` gauges).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .tensors import serialize_bytes

log = logging.getLogger("kiln.server.cache")

CACHE_NAMES = ("local",)  # the cache implementations Kiln has (Triton also ships 'redis')


@dataclass(frozen=True)
class CacheConfig:
    """`--cache-config` as given: the cache's name and its byte size."""

    name: str
    size: int


def parse_cache_config(settings: Iterable[str]) -> CacheConfig | None:
    """Triton's `--cache-config <cache>,<key>=<value>` values (repeatable) as one config; None when none is given.
    ValueError with what is wrong and how to write it."""
    values: dict[str, dict[str, str]] = {}
    for text in settings:
        name, key, value = _setting(text)
        values.setdefault(name, {})[key] = value
    if not values:
        return None
    if len(values) > 1:  # Triton's text (core/src/server.cc)
        raise ValueError(f"--cache-config: found multiple cache configurations ({', '.join(values)}), but only a "
                         "single cache is currently supported")
    name, config = next(iter(values.items()))
    if name not in CACHE_NAMES:
        raise ValueError(f"--cache-config: unknown cache '{name}'; Kiln has only the 'local' cache (in host memory, "
                         "shared by all models): --cache-config local,size=<bytes>")
    unknown = sorted(set(config) - {"size"})
    if unknown:
        raise ValueError(f"--cache-config: the local cache has no setting {', '.join(map(repr, unknown))} (it has "
                         "one: size=<bytes>)")
    if "size" not in config:  # Triton's text (local_cache.cc LocalCache::Create)
        raise ValueError("--cache-config: Failed to initialize LocalCache: config didn't contain a valid 'size' "
                         "field (--cache-config local,size=<bytes>)")
    return CacheConfig(name, _size(config["size"]))


def _setting(text: str) -> tuple[str, str, str]:
    """(cache, key, value) of one `<cache>,<key>=<value>`; Triton's texts (command_line_parser.cc)."""
    name, comma, rest = text.partition(",")
    if not comma or not name:
        raise ValueError(f"No cache specified. --cache-config option format is <cache name>,<setting>=<value>. "
                         f"Got {text}")
    key, equals, value = rest.partition("=")
    if not equals or not key or not value:
        raise ValueError(f"--cache-config option format is '<cache name>,<setting>=<value>'. Got {text}")
    return name, key, value


def _size(text: str) -> int:
    """The local cache's size: a whole number of bytes above 0 (Triton's stoull; 0 cannot hold anything)."""
    try:
        size = int(text)
    except ValueError:
        raise ValueError(f"--cache-config: local cache size must be a number of bytes, got '{text}'") from None
    if size <= 0:
        raise ValueError(f"--cache-config: local cache size must be more than 0 bytes, got '{text}'")
    return size


def request_key(model: str, version: int, inputs: Mapping[str, Any], outputs: Iterable[str]) -> bytes | None:
    """The cache key of a request: 16 bytes of BLAKE2b over the model, its version, each input (name, dtype, shape,
    data; in name order) and the requested output names (in name order). None when an input is not a host array
    (a device view of CUDA shared memory): such a request is not cached, as in Triton."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr((model, int(version), sorted(outputs))).encode())
    for name in sorted(inputs):
        array = inputs[name]
        if not isinstance(array, np.ndarray):
            return None
        digest.update(repr((name, str(array.dtype), tuple(array.shape))).encode())
        digest.update(serialize_bytes(array) if array.dtype == object  # type: ignore[arg-type]  # ndarray is a
                      else np.ascontiguousarray(array).reshape(-1).view(np.uint8))  # buffer; numpy's stubs say so on 3.12+
    return digest.digest()


def entry_size(outputs: Mapping[str, np.ndarray]) -> int:
    """Bytes an entry counts against the cache's size: its outputs' data as the wire carries it (BYTES elements
    with their 4-byte lengths)."""
    return sum(len(serialize_bytes(a)) if a.dtype == object else a.nbytes for a in outputs.values())


@dataclass
class Lookup:
    """One request's look in the cache: its key, what was found (None: a miss), and how long hashing and the
    lookup took (Triton's queue time and cache_hit / first half of cache_miss durations)."""

    key: bytes
    outputs: dict[str, np.ndarray] | None
    hash_ns: int
    lookup_ns: int


@dataclass(frozen=True)
class CacheCounters:
    """The cache-wide numbers Triton's local cache publishes (nv_cache_* gauges)."""

    size: int
    used: int
    entries: int
    lookups: int
    hits: int
    misses: int
    evictions: int
    lookup_us: int
    insertion_us: int


class InsertResult:
    STORED = "stored"
    EXISTS = "exists"  # another request stored the key first: Triton counts no miss for this one
    TOO_LARGE = "too large"


class ResponseCache:
    """An LRU cache of response outputs bounded by bytes, shared by every model (Triton's `local` cache).
    Thread-safe, though the core calls it from its event loop only; the metrics scrape reads `counters()`."""

    def __init__(self, size: int) -> None:
        self.size = size
        #: key -> (outputs, bytes, model), oldest use first
        self._entries: OrderedDict[bytes, tuple[dict[str, np.ndarray], int, str]] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()
        self._lookups = self._hits = self._evictions = 0
        self._lookup_ns = self._insertion_ns = 0
        self._warned: set[str] = set()  # models told that a response of theirs is larger than the cache

    def lookup(self, model: str, version: int, inputs: Mapping[str, Any], outputs: Iterable[str]) -> Lookup | None:
        """Hash the request and look it up (None: not cacheable). A hit makes its entry the most recently used."""
        t0 = time.perf_counter_ns()
        key = request_key(model, version, inputs, outputs)
        if key is None:
            return None
        t1 = time.perf_counter_ns()
        with self._lock:
            entry = self._entries.get(key)
            self._lookups += 1
            if entry is not None:
                self._hits += 1
                self._entries.move_to_end(key)
            t2 = time.perf_counter_ns()
            self._lookup_ns += t2 - t1
        return Lookup(key, None if entry is None else entry[0], t1 - t0, t2 - t1)

    def insert(self, key: bytes, outputs: Mapping[str, np.ndarray], model: str = "") -> str:
        """Store copies of `outputs` (read-only, so no answer can change them) under `key` as an entry of `model`,
        evicting the least recently used entries until they fit. Returns an `InsertResult`."""
        t0 = time.perf_counter_ns()
        try:
            with self._lock:
                if key in self._entries:
                    return InsertResult.EXISTS
            stored = {name: _frozen_copy(array) for name, array in outputs.items()}
            nbytes = entry_size(stored)
            if nbytes > self.size:
                self._warn_too_large(model, nbytes)
                return InsertResult.TOO_LARGE
            with self._lock:
                if key in self._entries:
                    return InsertResult.EXISTS
                while self._used + nbytes > self.size:
                    _, (_, freed, _) = self._entries.popitem(last=False)
                    self._used -= freed
                    self._evictions += 1
                self._entries[key] = (stored, nbytes, model)
                self._used += nbytes
            return InsertResult.STORED
        finally:
            with self._lock:
                self._insertion_ns += time.perf_counter_ns() - t0

    def forget(self, model: str) -> int:
        """Drop every entry of `model` (loaded again or unloaded: its answers may differ now); returns how many."""
        with self._lock:
            keys = [key for key, (_, _, owner) in self._entries.items() if owner == model]
            for key in keys:
                self._used -= self._entries.pop(key)[1]
            return len(keys)

    def counters(self) -> CacheCounters:
        with self._lock:
            return CacheCounters(self.size, self._used, len(self._entries), self._lookups, self._hits,
                                 self._lookups - self._hits, self._evictions, self._lookup_ns // 1000,
                                 self._insertion_ns // 1000)

    def _warn_too_large(self, model: str, nbytes: int) -> None:
        if model in self._warned:
            return
        self._warned.add(model)
        log.warning("a response of model '%s' (%d bytes) is larger than the whole response cache (%d bytes): it is "
                    "not cached (a larger --cache-config local,size=<bytes> would hold it)", model, nbytes, self.size)


def make_cache(config: CacheConfig | None) -> ResponseCache | None:
    """The server's cache for `--cache-config` (None: no cache)."""
    if config is None:
        return None
    log.info("Response Cache is created with size %d (--cache-config %s,size=%d)", config.size, config.name,
             config.size)
    return ResponseCache(config.size)


def store_outputs(cache: ResponseCache, model: Any, cached: Lookup, arrays: Mapping[str, Any],
                  names: list[str]) -> None:
    """After a miss, `model`'s outputs go into the cache; the miss is counted with the time of the lookup and the
    insertion, unless another request stored the same key first (Triton's ALREADY_EXISTS). Outputs that are not
    host arrays (left in device memory) are not stored."""
    if any(not isinstance(arrays.get(name), np.ndarray) for name in names):
        return
    started = time.perf_counter_ns()
    if cache.insert(cached.key, {name: arrays[name] for name in names}, model.name) != InsertResult.EXISTS:
        model.statistics.record_cache_miss(cached.lookup_ns + time.perf_counter_ns() - started)


def _frozen_copy(array: np.ndarray) -> np.ndarray:
    """A C-contiguous copy that owns its data (not a view keeping a batch's whole output alive), read-only."""
    copy = np.array(array, copy=True, order="C")
    copy.flags.writeable = False
    return copy
