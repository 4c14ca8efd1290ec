"""Where a server's CPU goes, per process and thread, from /proc: what saturates under load (the core's event
loop, a GPU worker, one frontend process of several) before any profiler is pointed at it.

    python -m load_tests.process_cpu PID [--seconds 5]       # PID and its descendants (a server and its frontends)

`load_tests/gpu_serving.py --profile-s S` takes this snapshot during each sweep's first level and records py-spy
of the server process beside it when py-spy is installed (docs/performance.md).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field


@dataclass
class ProcessCpu:
    pid: int
    command: str
    ticks: int  #: user + system clock ticks so far
    threads: dict[int, tuple[str, int]] = field(default_factory=dict)  #: tid -> (name, ticks)


def _stat_fields(path: str) -> tuple[str, list[str]]:
    """The command name and the fields after it of a /proc stat file (names may hold spaces and parentheses)."""
    text = open(path).read()
    return text[text.index("(") + 1:text.rindex(")")], text.rsplit(")", 1)[1].split()


def descendants(root: int) -> list[int]:
    """`root` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                children.setdefault(int(_stat_fields(f"/proc/{entry}/stat")[1][1]), []).append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def snapshot(root: int) -> dict[int, ProcessCpu]:
    """CPU ticks so far of `root`'s process tree, per process and thread."""
    taken = {}
    for pid in descendants(root):
        try:
            fields = _stat_fields(f"/proc/{pid}/stat")[1]
            command = open(f"/proc/{pid}/cmdline").read().replace("\0", " ").strip()
            threads = {}
            for tid in os.listdir(f"/proc/{pid}/task"):
                name, tfields = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
                threads[int(tid)] = (name, int(tfields[11]) + int(tfields[12]))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        taken[pid] = ProcessCpu(pid, command, int(fields[11]) + int(fields[12]), threads)
    return taken


def usage(before: dict[int, ProcessCpu], after: dict[int, ProcessCpu], seconds: float) -> list[dict]:
    """Per process alive in both: its CPU % (100 = one core) and its busiest threads', busiest first."""
    hertz = os.sysconf("SC_CLK_TCK")
    rows = []
    for pid, end in after.items():
        start = before.get(pid)
        if start is None:
            continue
        threads = sorted(((name, (ticks - start.threads.get(tid, (name, ticks))[1]) / hertz / seconds * 100)
                          for tid, (name, ticks) in end.threads.items()), key=lambda t: -t[1])
        rows.append({"pid": pid, "command": end.command[:160],
                     "cpu_percent": round((end.ticks - start.ticks) / hertz / seconds * 100, 1),
                     "threads": [{"name": n, "cpu_percent": round(p, 1)} for n, p in threads[:6] if p >= 1]})
    return sorted(rows, key=lambda r: -r["cpu_percent"])


def measure(root: int, seconds: float) -> list[dict]:
    before = snapshot(root)
    time.sleep(seconds)
    return usage(before, snapshot(root), seconds)


def table(rows: list[dict]) -> str:
    lines = []
    for row in rows:
        if row["cpu_percent"] < 1:
            continue
        threads = ", ".join(f"{t['name']} {t['cpu_percent']:.0f}%" for t in row["threads"])
        lines.append(f"{row['pid']:>8} {row['cpu_percent']:6.1f}%  {row['command'][:90]}\n{'':>17}{threads}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pid", type=int)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    print(table(measure(args.pid, args.seconds)))


if __name__ == "__main__":
    main()
