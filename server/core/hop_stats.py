"""Where a served request's time goes between processes: the mean time of each hop each process sees, logged.

Why (#29): at BERT gRPC c=64 a request takes ~8 ms of which ~2 ms is its batch's execution; the rest is spread over
the chain client -> frontend -> core -> executor -> core -> frontend -> client, each hop an event-loop turn or a
thread hand-off in another process, and no single process is saturated (docs/performance.md). The server's statistics
see only the core's queue and compute; these spans, timed where each process starts and ends its part, split the
rest by subtraction (every figure is a mean per request over the same steady load):

  frontend   gRPC|HTTP request in -> response out   its whole part (parse, the core round trip, encode, write)
  frontend   core round trip                       call sent to the core -> its reply read back
  core       call in -> reply out                  the core's whole part of a call
  core       lane result -> event loop             a batch's outputs back from its worker thread to the loop
  core       executor round trip                   a batch sent to the executor process -> its outputs back

with the executor's own lane log (message in -> reply ready, `executor_main._LaneStats`) and the client's latency.

Off unless KILN_HOP_STATS_S names a period in seconds (every process of the server reads it: frontends, the core,
executors); each process then logs one line per period at INFO ("hops (core): ..."). Off, each hop costs one
attribute read: the clock is not read.
"""

from __future__ import annotations

import logging
import threading
import time

from .executor_wire import env_number

log = logging.getLogger("kiln.server.hops")

#: seconds between a process's log lines; 0 (unset): the spans are not timed at all
PERIOD_S = env_number("KILN_HOP_STATS_S", 0.0, 0.0)
ON = PERIOD_S > 0
if ON:  # asked for by name: logged also where INFO is off (frontend processes log warnings unless --log-verbose)
    log.setLevel(logging.INFO)


class HopStats:
    """One process's hop durations since its last log line: per hop, the total and how many requests it covers
    (a group's span counts once per member, so every mean is per request)."""

    def __init__(self, where: str) -> None:
        self.where = where
        self._totals: dict[str, list[int]] = {}  # hop -> [ns x requests, requests]
        self._since = time.monotonic()
        self._lock = threading.Lock()  # worker threads add beside the event loop

    def add(self, hop: str, started_ns: int, requests: int = 1) -> None:
        """A span of `hop` from `started_ns` (time.monotonic_ns()) to now, covering `requests` requests."""
        ns = time.monotonic_ns() - started_ns
        with self._lock:
            total = self._totals.get(hop)
            if total is None:
                total = self._totals[hop] = [0, 0]
            total[0] += ns * requests
            total[1] += requests
            now = time.monotonic()
            if now - self._since < PERIOD_S:
                return
            totals, self._totals, since, self._since = self._totals, {}, self._since, now
        log.info("hops (%s) over %.1f s: %s", self.where, now - since,
                 "; ".join(f"{hop} {ns / count / 1e6:.3f} ms x {count}" for hop, (ns, count) in totals.items()))


_STATS: dict[str, HopStats] = {}


def stats(where: str) -> HopStats:
    """The process's `HopStats` for `where` ("frontend", "core"), made on first use."""
    found = _STATS.get(where)
    if found is None:
        found = _STATS.setdefault(where, HopStats(where))
    return found
