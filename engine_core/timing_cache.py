"""Timing cache (ITimingCache): tactic timings keyed by layer signature, reused across builds.

Why: tactic selection times every candidate of every layer on the GPU; a rebuild of the same model,
or of another model with the same layer shapes, can reuse those timings instead of measuring again.
The serialized form is JSON with a header naming the GPU architecture and Kiln version it was
measured with; combining caches from another architecture is refused unless ``ignore_mismatch``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from engine_core.version import __version__

_FORMAT = "kiln-timing-cache/1"


class TimingCache:
    """Layer signature -> {tactic: milliseconds}; ``arch`` is set by the first build that records."""

    def __init__(self, arch: str | None = None, entries: Mapping[str, Mapping[str, float]] | None = None) -> None:
        self.arch = arch
        self.entries: dict[str, dict[str, float]] = {k: dict(v) for k, v in (entries or {}).items()}
        self.hits = 0
        self.misses = 0

    @staticmethod
    def deserialize(blob: bytes | bytearray | memoryview | None) -> TimingCache:
        """A cache from ``serialize()`` bytes; empty bytes give an empty cache. Raises ValueError."""
        if not blob:
            return TimingCache()
        try:
            data = json.loads(bytes(blob).decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"not a Kiln timing cache: {e}") from None
        if not isinstance(data, dict) or data.get("format") != _FORMAT or not isinstance(data.get("entries"), dict):
            raise ValueError(f"not a Kiln timing cache (expected format {_FORMAT})")
        return TimingCache(data.get("arch"), data["entries"])

    def serialize(self) -> bytes:
        return json.dumps({"format": _FORMAT, "kiln": __version__, "arch": self.arch, "entries": self.entries},
                          sort_keys=True).encode()

    def combine(self, other: TimingCache, ignore_mismatch: bool = False) -> bool:
        """Merge ``other`` in (its entries win); False when measured on another architecture."""
        if other.arch and self.arch and other.arch != self.arch and not ignore_mismatch:
            return False
        self.arch = self.arch or other.arch
        self.entries.update({k: dict(v) for k, v in other.entries.items()})
        return True

    def reset(self) -> bool:
        self.entries.clear()
        return True

    def query(self, key: str) -> dict[str, float] | None:
        found = self.entries.get(key)
        if found is None:
            self.misses += 1
        else:
            self.hits += 1
        return found

    def update(self, key: str, timings: Mapping[str, float]) -> None:
        self.entries[key] = dict(timings)

    def __len__(self) -> int:
        return len(self.entries)
