"""Several generation loops of one generative model version (data-parallel replicas) behind the one-generator
interface `GenerativeVersion` uses: `submit`, `stats`, `close`, `warmed_shapes`, `warm_up_seconds`.

Why: `instance_group { count: N kind: KIND_GPU gpus: [0, 1] }` places N loops on each listed GPU, as Triton places
instances; each loop has its own engine and KV cache, so a version serves up to replicas x max_batch_size sequences
at once. A request goes to the replica with the fewest requests in flight (counted here: one more at `submit`, one
less at the request's final event), so a replica that holds long sequences gets fewer new ones; ties go to the one
that was given fewer requests so far (sequential requests alternate). `stats` sums the replicas' `GeneratorStats`,
so /metrics shows the version's totals. A version with one replica uses its generator itself (no `Replicas`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from engine_core.generate.generator import GenerationEvent, GeneratorStats
from engine_core.generate.sampling import SamplingParams

from .placement import start_all

log = logging.getLogger("kiln.server.generation")


class LoopLike(Protocol):
    """What `Replicas` needs of one replica: `Generator`'s or `RemoteGenerator`'s interface."""

    warmed_shapes: int
    warm_up_seconds: float

    def submit(self, prompt: Sequence[int], params: SamplingParams,
               on_event: Callable[[GenerationEvent], None]) -> Any: ...

    def stats(self) -> GeneratorStats: ...

    def close(self) -> None: ...


Loop = TypeVar("Loop", bound=LoopLike)


class Replicas:
    """Generation loops of one version, each request routed to the one with the fewest in flight (module
    docstring)."""

    def __init__(self, replicas: Sequence[LoopLike]) -> None:
        if not replicas:
            raise ValueError("Replicas needs at least one generator")
        self.replicas = tuple(replicas)
        self._lock = threading.Lock()
        self._in_flight = [0] * len(self.replicas)
        self._submitted = [0] * len(self.replicas)
        # the replicas started together: the shapes all of them captured, in the time the slowest took
        self.warmed_shapes = sum(r.warmed_shapes for r in self.replicas)
        self.warm_up_seconds = max(r.warm_up_seconds for r in self.replicas)

    @property
    def in_flight(self) -> list[int]:
        """Requests submitted to each replica whose final event has not come yet."""
        with self._lock:
            return list(self._in_flight)

    @property
    def submitted(self) -> list[int]:
        """Requests each replica accepted since the load."""
        with self._lock:
            return list(self._submitted)

    def submit(self, prompt: Sequence[int], params: SamplingParams,
               on_event: Callable[[GenerationEvent], None]) -> Any:
        """Submit to the replica with the fewest requests in flight. ValueError (the client's to fix) as the replica
        raises it; a replica that refuses with RuntimeError (closed, its process gone) hands the request to the next
        one, and the last one's RuntimeError is raised when none takes it."""
        tried: set[int] = set()
        while True:
            index = self._pick(tried)
            tracked = _Tracked(self, index, on_event)
            try:
                handle = self.replicas[index].submit(prompt, params, tracked)
            except RuntimeError:
                tracked.end()
                tried.add(index)
                if len(tried) == len(self.replicas):
                    raise
                continue
            except BaseException:
                tracked.end()
                raise
            with self._lock:
                self._submitted[index] += 1
            return handle

    def _pick(self, tried: set[int]) -> int:
        """The untried replica with the fewest in flight (then the fewest given so far), counted in flight now."""
        with self._lock:
            index = min((i for i in range(len(self.replicas)) if i not in tried),
                        key=lambda i: (self._in_flight[i], self._submitted[i], i))
            self._in_flight[index] += 1
        return index

    def _ended(self, index: int) -> None:
        with self._lock:
            self._in_flight[index] -= 1

    def stats(self) -> GeneratorStats:
        """Every field summed over the replicas."""
        return sum_stats([replica.stats() for replica in self.replicas])

    def close(self) -> None:
        """Close every replica, together (a generation process may take a while to exit)."""
        close_all(self.replicas)


class _Tracked:
    """A request's event callback that counts it out of its replica's in-flight requests once: at its final event
    (or when its submit failed)."""

    def __init__(self, replicas: Replicas, index: int, on_event: Callable[[GenerationEvent], None]) -> None:
        self._replicas, self._index, self._on_event = replicas, index, on_event
        self._ended = False
        self._lock = threading.Lock()

    def __call__(self, event: GenerationEvent) -> None:
        if event.final:
            self.end()
        self._on_event(event)

    def end(self) -> None:
        with self._lock:
            if self._ended:
                return
            self._ended = True
        self._replicas._ended(self._index)


def sum_stats(stats: Sequence[GeneratorStats]) -> GeneratorStats:
    """The field-by-field sum of several loops' statistics."""
    return GeneratorStats(**{field.name: sum(getattr(s, field.name) for s in stats)
                             for field in dataclasses.fields(GeneratorStats)})


def close_all(generators: Sequence[LoopLike]) -> None:
    """Close every generator in a thread of its own; one that fails to close is logged, the others still close."""
    def close(generator: LoopLike) -> None:
        try:
            generator.close()
        except Exception:  # noqa: BLE001 - the other replicas must still close
            log.exception("closing a generation loop failed")

    if len(generators) <= 1:
        for generator in generators:
            close(generator)
        return
    with ThreadPoolExecutor(len(generators), thread_name_prefix="kiln-generation-close") as pool:
        list(pool.map(close, generators))


def start_together(starts: Sequence[Callable[[], Loop]]) -> Loop | Replicas:
    """Start every replica at once (`placement.start_all`: builds and warm-ups overlap) and return the one generator,
    or `Replicas` over several. When one fails, the others (once started) are closed and its exception (the first
    replica's, in order, among those that failed) is raised."""
    started = start_all(starts, close_all, "kiln-generation-start")
    return started[0] if len(started) == 1 else Replicas(started)
