"""What one hand-off between two processes or two threads costs on this machine: the floor under every hop of the
served path (client -> frontend -> core -> executor and back, docs/performance.md "process by process").

    python load_tests/wakeup_latency.py [--seconds 2] [--idle-s 1] [--out DIR]

Round trips of a small message between two processes over a Unix socket pair (what frontends, the core and
executors use), and between two threads through `queue.SimpleQueue` (a worker lane's hand-off), each with the
receiver sleeping in the kernel (as Kiln's do) and, for processes, spinning on a non-blocking socket (no wake-up).
One round trip is two hand-offs. With --idle-s, also round trips each after that long without traffic: what a
hand-off costs once the cores went idle (issue #30: a request after 1 s idle took 1.45x a back-to-back one).
Prints a table; writes wakeup_latency.json under --out when given.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

MESSAGE = b"x" * 64
IDLE_ROUND_TRIPS = 5


def _echo(sock: socket.socket, parents: socket.socket, spin: bool) -> None:
    """The other process: send back every message until the socket closes (the parent's end, inherited by the
    fork, closed here: else the parent closing it would never end this loop)."""
    parents.close()
    sock.setblocking(not spin)
    while True:
        try:
            data = sock.recv(4096)
        except BlockingIOError:
            continue
        if not data:
            return
        sock.sendall(data)


def _process_round_trips(seconds: float, spin: bool, idle_s: float = 0.0, count: int = 0) -> list[float]:
    """Round trips for `seconds`, or `count` of them each after `idle_s` without traffic."""
    ours, theirs = socket.socketpair()
    child = multiprocessing.get_context("fork").Process(target=_echo, args=(theirs, ours, spin), daemon=True)
    child.start()
    theirs.close()
    ours.setblocking(not spin)
    times: list[float] = []
    end = time.perf_counter() + seconds
    while (len(times) < count) if count else (time.perf_counter() < end):
        if idle_s:
            time.sleep(idle_s)
        started = time.perf_counter_ns()
        ours.sendall(MESSAGE)
        got = 0
        while got < len(MESSAGE):
            try:
                got += len(ours.recv(4096))
            except BlockingIOError:
                continue
        times.append((time.perf_counter_ns() - started) / 1e3)
    ours.close()
    child.join(5)
    return times


def _thread_round_trips(seconds: float) -> list[float]:
    there: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    back: queue.SimpleQueue[int] = queue.SimpleQueue()

    def echo() -> None:
        while (item := there.get()) is not None:
            back.put(item)

    worker = threading.Thread(target=echo, daemon=True)
    worker.start()
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        started = time.perf_counter_ns()
        there.put(1)
        back.get()
        times.append((time.perf_counter_ns() - started) / 1e3)
    there.put(None)
    worker.join(5)
    return times


def _summary(times: list[float]) -> dict[str, Any]:
    ordered = sorted(times)
    return {"round_trips": len(times), "mean_us": round(statistics.fmean(times), 1),
            "p50_us": round(ordered[len(ordered) // 2], 1), "p99_us": round(ordered[int(len(ordered) * 0.99)], 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=2.0, help="per case (default 2)")
    parser.add_argument("--out", type=Path, default=None, help="directory for wakeup_latency.json")
    parser.add_argument("--idle-s", type=float, default=0.0,
                        help="also 5 process round trips, each after this long without traffic (default: off)")
    args = parser.parse_args(argv)
    cases = {"processes, socket, receivers sleep": _summary(_process_round_trips(args.seconds, spin=False)),
             "processes, socket, receivers spin": _summary(_process_round_trips(args.seconds, spin=True)),
             "threads, SimpleQueue, receivers sleep": _summary(_thread_round_trips(args.seconds))}
    if args.idle_s:
        cases[f"processes, socket, after {args.idle_s:g} s idle"] = _summary(
            _process_round_trips(0.0, spin=False, idle_s=args.idle_s, count=IDLE_ROUND_TRIPS))
    print(f"{'round trip (2 hand-offs)':<40}{'count':>9}{'mean us':>10}{'p50 us':>9}{'p99 us':>9}")
    for name, row in cases.items():
        print(f"{name:<40}{row['round_trips']:>9}{row['mean_us']:>10}{row['p50_us']:>9}{row['p99_us']:>9}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "wakeup_latency.json").write_text(json.dumps(
            {"tool": "load_tests/wakeup_latency.py", "cpus": os.cpu_count(), "python": sys.version.split()[0],
             "cases": cases}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
