"""Where a kernel's instructions and stall samples go, from ncu's SASS source page (CSV).

    ncu -k regex:KERNEL -c 1 --section WarpStateStats --section SourceCounters --page source --print-source sass \\
        --csv python3 -m bench.qgemm --rows 8192 --cases 1 --profile-runs > src.csv
    python -m bench.ncu_source src.csv [--per N] [--top 25]

Prints (1) executed warp instructions per opcode (``--per``: divided by N, e.g. the output elements / 32 a kernel
computes, to read them as instructions per element and warp), with the stall samples on them; (2) the runs of
consecutive executed instructions (the kernel's loops and phases: a K loop, an epilogue, a barrier wait) with their
share of the samples and their stall reasons; (3) the instructions with the most samples. Why: session 13 found
with it that BERT's FFN1 epilogue was 25 instructions an element and its K loop 65 a k-slice and warp (descriptor
moves), which the summary sections (issue slots, warp states) cannot tell apart.
"""

from __future__ import annotations

import argparse
import csv
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Instr:
    address: int
    source: str
    executed: int
    samples: int
    #: stall reason (ncu's ``stall_*`` columns, issued and not) -> samples
    stalls: dict[str, int] = field(default_factory=dict)

    @property
    def opcode(self) -> str:
        """The opcode without predicate and modifiers: ``@!P1 BRA 0x..`` -> ``BRA``, ``FMNMX.FTZ`` -> ``FMNMX``."""
        return re.sub(r"^@!?U?P\w+\s+", "", self.source.strip()).split(" ")[0].split(".")[0]


def _int(text: str) -> int:
    return int(text.replace(",", "") or 0)


def parse(path: Path) -> list[Instr]:
    """The SASS rows of the first kernel in an ``ncu --page source --print-source sass --csv`` output."""
    rows = list(csv.reader(path.read_text().splitlines()))
    start = next((i for i, row in enumerate(rows) if row and row[0] in ("Address", "# Address")), None)
    if start is None:
        raise ValueError(f"{path}: no SASS source table (ncu --page source --print-source sass --csv)")
    header = rows[start]
    col = {name: i for i, name in enumerate(header)}
    stall_cols = [(i, name[len("stall_"):]) for i, name in enumerate(header)
                  if name.startswith("stall_") and "Not Issued" not in name]
    out = []
    for row in rows[start + 1:]:
        if len(row) != len(header):
            if out:
                break  # the next kernel's table
            continue
        out.append(Instr(int(row[col[header[0]]], 16), row[col["Source"]].strip(),
                         _int(row[col["Instructions Executed"]]), _int(row[col["Warp Stall Sampling (All Samples)"]]),
                         {name: _int(row[i]) for i, name in stall_cols if _int(row[i])}))
    return out


def segments(instrs: list[Instr]) -> list[list[Instr]]:
    """Runs of consecutive instructions that executed or were sampled (code that never ran separates them)."""
    runs: list[list[Instr]] = []
    current: list[Instr] = []
    for ins in instrs:
        if ins.executed or ins.samples:
            current.append(ins)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def summary(instrs: list[Instr], per: float = 1.0, top: int = 25, min_share: float = 0.01) -> str:
    """The three tables of the module docstring as text."""
    executed, sampled = Counter(), Counter()
    for ins in instrs:
        executed[ins.opcode] += ins.executed
        sampled[ins.opcode] += ins.samples
    total_executed, total_samples = sum(executed.values()), max(1, sum(sampled.values()))
    lines = [f"{total_executed:,} warp instructions executed ({total_executed / per:,.2f} per unit), "
             f"{total_samples:,} stall samples", f"{'opcode':<12} {'executed':>12} {'per unit':>9} {'samples':>8}"]
    lines += [f"{op:<12} {n:>12,} {n / per:>9.2f} {sampled[op]:>8}" for op, n in executed.most_common(30)]
    lines += ["", f"{'segment':<13} {'lines':>5} {'executed':>12} {'samples':>8} {'share':>6}  top stalls"]
    for run in segments(instrs):
        samples = sum(i.samples for i in run)
        if samples < min_share * total_samples:
            continue
        stalls = Counter()
        for ins in run:
            stalls.update(ins.stalls)
        reasons = ", ".join(f"{name} {100 * n / max(1, sum(stalls.values())):.0f}%" for name, n in stalls.most_common(4))
        lines.append(f"{run[0].address & 0xFFFFF:05x}-{run[-1].address & 0xFFFFF:05x} {len(run):>5} "
                     f"{sum(i.executed for i in run):>12,} {samples:>8} {100 * samples / total_samples:>5.1f}%  {reasons}")
    lines += ["", f"{'address':<7} {'executed':>10} {'samples':>7}  instruction (top stall)"]
    for ins in sorted(instrs, key=lambda i: -i.samples)[:top]:
        reason = max(ins.stalls, key=ins.stalls.get) if ins.stalls else ""
        lines.append(f"{ins.address & 0xFFFFF:05x} {ins.executed:>10,} {ins.samples:>7}  {ins.source[:70]} ({reason})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", type=Path)
    parser.add_argument("--per", type=float, default=1.0, help="divide executed counts by this (e.g. outputs / 32)")
    parser.add_argument("--top", type=int, default=25, help="instructions listed by samples")
    args = parser.parse_args(argv)
    print(summary(parse(args.csv), args.per, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
