"""The execution plans cuDNN graphs built, remembered on disk: (engine id, knobs) by graph signature and plan index.

Why: binding a batch bucket builds every convolution's cuDNN graph at that shape, and asking cuDNN's heuristics for a
graph's ranked plan list was the largest part of it (ResNet-50 fp16 on an H200: 3.0 of 7.2 s for its 10 buckets,
the plan builds 1.6 s; `python -m bench.bind_time`). The answer is the same for the same graph, GPU and cuDNN
version, so a graph whose plan is remembered is built from that one plan (`pygraph.create_execution_plan`) without
the query: a restarted executor or a reloaded model binds faster (#35's recovery), and so does every later process.

The file is `$KILN_CACHE_DIR/cudnn_plans.json` (default ~/.cache/kiln), one section per cuDNN version and GPU.
Entries are only hints: one that does not build again is kept as "ask the heuristics" (`refuse`), so later
bindings neither try it again nor remember it anew (ResNet-50's stem on cuDNN 9.19: a knob of its plan does not
convert back). Writers merge with
what is on disk and replace the file atomically, so processes binding at once lose at most each other's latest
entries (they are found again next time).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("kiln.cudnn")

#: at most one write of the file this often while entries arrive (`flush` writes the rest)
WRITE_EVERY_S = 2.0
#: the engine id of an entry that says "ask the heuristics": its remembered plan did not build again
ASK_HEURISTICS = -1


def cache_file() -> Path:
    return Path(os.environ.get("KILN_CACHE_DIR", Path.home() / ".cache" / "kiln")) / "cudnn_plans.json"


def enabled() -> bool:
    """KILN_CUDNN_PLAN_CACHE=0 turns the cache off (every graph asks the heuristics)."""
    return os.environ.get("KILN_CUDNN_PLAN_CACHE", "1") not in ("0", "")


class PlanChoices:
    """One process's view of the file: the section of this cuDNN version and GPU, plus what it added since."""

    def __init__(self, path: Path, section: str) -> None:
        self.path, self.section = path, section
        self._lock = threading.Lock()
        #: signature -> heuristics rank asked for -> entry; the file keys them "signature#rank"
        self._entries: dict[str, dict[int, list]] = {}
        stored = self._read().get(section, {})
        for key, entry in (stored.items() if isinstance(stored, dict) else ()):
            signature, _, index = key.rpartition("#")
            if signature and index.isdigit():
                self._entries.setdefault(signature, {})[int(index)] = entry
        self._added: dict[str, list] = {}  # what this process learned, keyed as in the file
        self._written = time.monotonic()

    def get(self, signature: str, index: int) -> tuple[int, dict[int, int], int] | None:
        """(engine id, knobs as {knob type value: knob value}, its heuristics rank) of the plan built for
        ``signature`` when rank ``index`` was asked for (the rank built may be another: ``index`` did not build)."""
        with self._lock:
            entry = self._entries.get(signature, {}).get(index)
        try:
            engine_id, knobs, ranked = entry  # type: ignore[misc]
            choice = int(engine_id), {int(k): int(v) for k, v in knobs.items()}, int(ranked)
        except (TypeError, ValueError, AttributeError):  # None, or written by another format
            return None
        return None if choice[0] == ASK_HEURISTICS else choice

    def known(self, signature: str) -> bool:
        """Whether some plan of ``signature`` was built here before (so the graph has a buildable plan)."""
        with self._lock:
            return bool(self._entries.get(signature))

    def put(self, signature: str, index: int, engine_id: int, knobs: dict[int, int], ranked: int) -> None:
        """Remember the plan built for ``signature`` at rank ``index`` (not over a refusal: that one stays asked)."""
        entry = [int(engine_id), {str(int(k)): int(v) for k, v in knobs.items()}, int(ranked)]
        with self._lock:
            stored = self._entries.get(signature, {}).get(index)
            if isinstance(stored, list) and stored[:1] == [ASK_HEURISTICS]:
                return
            self._entries.setdefault(signature, {})[index] = self._added[f"{signature}#{index}"] = entry
            due = time.monotonic() - self._written >= WRITE_EVERY_S
        if due:
            self.flush()

    def refuse(self, signature: str, index: int) -> None:
        """An entry that did not build again (a knob that does not convert back, another cuDNN build under the same
        version string, a driver change): from now on this graph asks the heuristics, here and in later processes."""
        entry = [ASK_HEURISTICS, {}, -1]
        with self._lock:
            self._entries.setdefault(signature, {})[index] = self._added[f"{signature}#{index}"] = entry

    def flush(self) -> None:
        """Merge what this process added into the file (atomic replace); errors are logged, never raised."""
        with self._lock:
            added, self._added = self._added, {}
            self._written = time.monotonic()
        if not added:
            return
        try:
            document = self._read()
            document.setdefault(self.section, {}).update(added)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temporary = self.path.with_name(f"{self.path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            temporary.write_text(json.dumps(document, sort_keys=True))
            os.replace(temporary, self.path)
        except OSError as e:
            log.warning("could not write cuDNN plan choices to %s: %s", self.path, e)

    def _read(self) -> dict[str, Any]:
        try:
            document = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return document if isinstance(document, dict) else {}


_CHOICES: PlanChoices | None = None
_CHOICES_LOCK = threading.Lock()


def choices(cudnn: Any) -> PlanChoices | None:
    """The process's `PlanChoices` for this cuDNN and GPU (None when turned off)."""
    global _CHOICES
    if not enabled():
        return None
    with _CHOICES_LOCK:
        if _CHOICES is None:
            from engine_core.cuda.driver import compute_capability, device_name

            major, minor = compute_capability()
            _CHOICES = PlanChoices(cache_file(), f"cudnn {cudnn.backend_version()} | {device_name()} | sm_{major}{minor}")
        return _CHOICES


def flush() -> None:
    """Write what this process learned (after a binding: an executor may exit without running exit hooks)."""
    if _CHOICES is not None:
        _CHOICES.flush()
