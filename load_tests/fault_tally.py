"""What a fault scenario's traffic came to (load_tests/gpu_faults.py): each request's record, the counts by outcome,
the recovery after each fault and the live probes' summary. Pure bookkeeping over records, apart from the driver
so that its rules (what counts as lost, when a model has recovered) are read and tested on their own.

Lost, here and in the soak (load_tests/soak.py): a request is *lost* when it got neither an answer nor an error from
the server. That is a broken or timed-out transport (HTTP: any httpx.TransportError, `lost_http`; gRPC:
DEADLINE_EXCEEDED, CANCELLED, or UNAVAILABLE / UNKNOWN / INTERNAL whose text is gRPC's own transport message,
`lost_grpc`) or a client that gave up waiting. Whatever status the server itself sent, 5xx and UNAVAILABLE
included, is an error: counted by its status, never as lost.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

#: gRPC failures that are no answer from the server (the call never reached it or never came back), and how gRPC's
#: own transport errors begin (a server's message may quote such words later on: "... [Errno 104] Connection reset")
LOST_GRPC = ("DEADLINE_EXCEEDED", "CANCELLED")
TRANSPORT_TEXT = ("failed to connect", "socket closed", "connection reset", "connection refused", "broken pipe",
                  "end of tcp stream", "recvmsg", "goaway", "stream removed", "keepalive")


@dataclass
class Record:
    protocol: str
    sent: float
    done: float
    outcome: str  # "ok", "wrong", "lost: ...", else "<status>: <text>"


def failure_key(status: str, text: str) -> str:
    """A failure's status and text, numbers and pids folded so that equal failures count together."""
    return f"{status}: {re.sub(r'[0-9]+', 'N', ' '.join(text.split()))[:160]}"


def lost_http(error: Exception) -> bool:
    """An httpx failure that is no answer: the transport broke or timed out (a status code is an answer)."""
    return isinstance(error, httpx.TransportError)


def lost_grpc(status: str, text: str) -> bool:
    """A gRPC failure that is no answer: past the deadline, cancelled, or the transport broke."""
    name = status.removeprefix("StatusCode.")
    return name in LOST_GRPC or (name in ("UNAVAILABLE", "UNKNOWN", "INTERNAL")
                                 and text.strip().lower().startswith(TRANSPORT_TEXT))


@dataclass
class ScenarioResult:
    scenario: str
    model: str = ""
    skipped: str | None = None
    sent: int = 0
    succeeded: int = 0
    wrong: int = 0
    failed: dict[str, int] = field(default_factory=dict)
    failed_by_status: dict[str, int] = field(default_factory=dict)
    lost: int = 0
    lost_by: dict[str, int] = field(default_factory=dict)
    recovery_s: float | None = None  # worst over the scenario's faults
    disrupted_s: float = 0.0  # from the fault to the end of the last failed request
    health: dict[str, Any] = field(default_factory=dict)
    detail: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    passed: bool = False


def tally(result: ScenarioResult, records: list[Record], faults: list[float], ends: list[float] | None = None) -> None:
    """Counts, recovery after each fault (its window ends at `ends`, else at the next fault) and how long failures
    went on."""
    outcomes = Counter(r.outcome for r in records)
    result.sent = len(records)
    result.succeeded, result.wrong = outcomes.pop("ok", 0), outcomes.pop("wrong", 0)
    result.lost_by = {k: v for k, v in outcomes.items() if k.startswith("lost")}
    result.lost = sum(result.lost_by.values())
    result.failed = dict(sorted((k, v) for k, v in outcomes.items() if not k.startswith("lost")))
    by_status: Counter[str] = Counter()
    for key, count in result.failed.items():
        by_status[key.split(":", 1)[0]] += count
    result.failed_by_status = dict(sorted(by_status.items()))
    closes = [*ends, *[float("inf")] * len(faults)] if ends else [*faults[1:], float("inf")]
    holds = [*(result.detail.get("fault_holds") or []), *[None] * len(faults)]
    recoveries = [recovery(records, fault, end, hold) for fault, end, hold in zip(faults, closes, holds)]
    result.recovery_s = None if not recoveries or None in recoveries else max(r for r in recoveries if r is not None)
    if len(faults) > 1:
        result.detail["recovery_each_s"] = recoveries
    failed = [r.done for r in records if r.outcome not in ("ok", "wrong")]
    result.disrupted_s = round(max(failed) - faults[0], 3) if failed and faults else 0.0


def recovery(records: list[Record], fault: float, end: float, hold: float | None = None) -> float | None:
    """Seconds from `fault` to the end of the first success sent after it, after every request that failed in the
    window [fault, end) was sent, and after `hold` (when the fault is known to have taken hold): when the model
    serves again, not a request that slipped through before the fault took hold. None when nothing succeeded."""
    failures = [r.sent for r in records if r.outcome not in ("ok", "wrong") and fault <= r.done < end]
    start = max([fault, *failures, *([hold] if hold is not None else [])])
    first = min((r.done for r in records if r.outcome == "ok" and start <= r.sent < end), default=None)
    return None if first is None else round(first - fault, 3)


def health_summary(probes: list[tuple[str, float, bool]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for name in sorted({p for p, _, _ in probes}):
        mine = [(s, ok) for p, s, ok in probes if p == name]
        summary[name] = {"probes": len(mine), "failed": sum(not ok for _, ok in mine),
                         "max_ms": round(max(s for s, _ in mine) * 1000, 1)}
    return summary
