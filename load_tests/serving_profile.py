"""Where a serving process spends its time under load: py-spy over every thread of the server (and one frontend
process), while `kiln perf` drives one model at one concurrency.

    python -m load_tests.serving_profile --repository DIR --model bert_cls_batched --concurrency 64 \\
        --shape input_ids:128 ... --out $OUT/profile [--frontend-processes 4] [--seconds 8] [--server-arg=...]

The repository is any Kiln/Triton model repository (load_tests/gpu_serving.py leaves one under
<out>/work/repository). py-spy samples at 250 Hz with `--gil` off and idle frames left out, so a thread's
samples are time it was running or waiting for the interpreter lock. Output: the folded stacks per process
(`<out>/<process>.txt`, flame-graph input) and a table of the frames with the most samples, by thread
group (event loop, execution workers, other), in `<out>/profile.json`; `kiln perf`'s JSON beside them.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from load_tests import harness  # noqa: E402
from load_tests.gpu_serving import kiln_server  # noqa: E402


def summarize(folded: Path, top: int = 25) -> dict:
    """Samples per thread group and the frames with the most samples (self and inclusive) in a py-spy raw file."""
    groups: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in _lines(folded):
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        samples = int(count)
        total += samples
        frames = stack.split(";")  # frames[0] names the thread (--threads)
        group = ("execution workers" if "_worker" in stack or "ThreadPoolExecutor" in stack
                 else "event loop" if "run_event_loop" in stack or "Runner.run" in stack else "other")
        groups[group] += samples
        own[frames[-1]] += samples
        for frame in set(frames[1:]):
            inclusive[frame] += samples
    share = (lambda n: round(100.0 * n / total, 1)) if total else (lambda n: 0.0)
    return {"samples": total, "groups": {k: share(v) for k, v in groups.most_common()},
            "self": [(f, share(n)) for f, n in own.most_common(top)],
            "inclusive": [(f, share(n)) for f, n in inclusive.most_common(top)]}


def summarize_tree(folded: Path, top: int = 12) -> str:
    """A py-spy raw file of a process tree (`--subprocesses`) as text: per kind of process (core, frontend,
    executor, generation) and thread, its samples and the frames with the most samples, own and inclusive.

    A child's stacks start with its ancestors' `process ...` frames: the last one names the process sampled; the
    thread frame follows them. A ".gz" file is read compressed."""
    kinds: dict[str, tuple[collections.Counter[str], collections.Counter[str]]] = {}
    totals: collections.Counter[str] = collections.Counter()
    for line in _lines(folded):
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")  # a process frame's command line may hold ";" too: the thread frame ends them
        at = next((i for i, f in enumerate(frames) if f.startswith("thread (")), 0)
        process = ";".join(frames[:at]).rpartition("process ")[2]
        body = frames[at:]
        thread = re.sub(r"^thread \(\d+\): ", "", body[0]) if body and body[0].startswith("thread (") else "?"
        kind = ("executor" if "executor_main" in process else "generation" if "generation_main" in process
                else "frontend" if "spawn_main" in process or "multiprocessing" in process else "core")
        key = f"{kind}, {thread}"
        own, inclusive = kinds.setdefault(key, (collections.Counter(), collections.Counter()))
        samples = int(count)
        totals[key] += samples
        body = [f for f in body if not f.startswith("thread ")]
        if body:
            own[body[-1]] += samples
        for frame in set(body):
            inclusive[frame] += samples
    lines = []
    for key, samples in totals.most_common():
        own, inclusive = kinds[key]
        lines.append(f"== {key}: {samples} samples")
        lines += [f"  {100 * n / samples:5.1f}% self  {frame}" for frame, n in own.most_common(top)]
        lines += [f"  {100 * n / samples:5.1f}% incl  {frame}" for frame, n in inclusive.most_common(top)]
    return "\n".join(lines)


def _lines(path: Path) -> list[str]:
    """A py-spy raw file's lines (gzip-compressed when its name ends in .gz)."""
    if path.suffix == ".gz":
        return gzip.decompress(path.read_bytes()).decode().splitlines()
    return path.read_text().splitlines()


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def run(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    extra = ["--frontend-processes", str(args.frontend_processes), *args.server_arg]
    with kiln_server(Path(args.repository), None, out / "server.log", args.model, extra) as server:
        time.sleep(2.0)  # frontends listening
        perf = [sys.executable, "-m", "load_tests.perf", "-m", args.model, "-u", server.grpc, "-i", "grpc",
                "--concurrency-range", f"{args.concurrency}:{args.concurrency}:1", "-p", "1000", "-r",
                str(int(args.seconds) + 6), "--warmup", "1", "--input-data", args.input_data, "-q",
                "--json-file", str(out / "perf.json"), *sum((["--shape", s] for s in args.shape), [])]
        load = subprocess.Popen(perf, cwd=ROOT, env=harness.python_path_env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        time.sleep(3.0)
        targets = {"core": server.pid}
        frontends = [c for c in _children(server.pid)
                     if "spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes().decode(errors="replace")]
        if frontends:
            targets["frontend"] = frontends[0]
        spies = {name: subprocess.Popen([spy, "record", "-p", str(pid), "-r", "250", "-d", str(int(args.seconds)),
                                         "-f", "raw", "-o", str(out / f"{name}.txt"), "--threads", "--nonblocking"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                 for name, pid in targets.items()}
        report = {}
        for name, spy_process in spies.items():
            _, err = spy_process.communicate(timeout=args.seconds + 60)
            folded = out / f"{name}.txt"
            report[name] = summarize(folded) if folded.exists() else {"error": err.decode(errors="replace")[-500:]}
        load.wait(timeout=120)
    (out / "profile.json").write_text(json.dumps(report, indent=1))
    for name, summary in report.items():
        print(f"== {name}: {summary.get('samples')} samples, groups {summary.get('groups')}")
        for frame, share in summary.get("self", [])[:15]:
            print(f"   {share:5.1f}% self  {frame}")
        for frame, share in summary.get("inclusive", [])[:20]:
            print(f"   {share:5.1f}% incl  {frame}")
    return report


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--summarize"]:  # a raw file from gpu_serving.py --profile-s
        print(summarize_tree(Path(sys.argv[2])))
        return 0
    parser = argparse.ArgumentParser(prog="python -m load_tests.serving_profile", description=__doc__.split("\n")[0])
    parser.add_argument("--repository", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seconds", type=int, default=8)
    parser.add_argument("--frontend-processes", type=int, default=0)
    parser.add_argument("--input-data", default="random", choices=["random", "zero"])
    parser.add_argument("--shape", action="append", default=[], help="NAME:D1,D2 (kiln perf --shape)")
    parser.add_argument("--server-arg", action="append", default=[], help="an extra server flag (repeatable)")
    parser.add_argument("--out", required=True)
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
