"""One decode step of a decoder engine, in milliseconds, at batch sizes x past lengths (issue #33's inter-token latency).

    python bench/export_decoder.py --arch gpt2 --out /tmp/gpt2/1                   # or --arch llama --size 1b
    python bench/generate_step.py /tmp/gpt2/1 --fp16 --json $OUT/generate_step.json
    python bench/generate_step.py /tmp/llama/1 --fp16 --host-path                  # and the host-pool path beside it
    python bench/generate_step.py /tmp/tiny/1 --backend cpu --batches 1,2 --pasts 8 --iters 3   # a smoke run

Builds the model directory's model.onnx as a decoder engine (`build_decoder_engine`, CUDA by default) and a
`DecoderRunner`; prefills `max(batches)` sequences of `max(pasts)` random tokens, then for each past length (longest
first) and batch size times `DecoderRunner.decode` of the first `batch` sequences, each step fed after exactly
`past` cached tokens (the sequences are truncated back after every step, so every timed step has the same shapes:
the first runs of a shape, eager run and CUDA graph capture, are the untimed warm-up). A step's time is the wall
time of the call: planning on the host, the small inputs' upload, the KV gather kernel, the engine, the scatter
kernel and the copy of each row's last logits back, which the call waits for (what a generated token costs).
On CUDA the KV cache lives on the device (`DeviceKVPool`); `--host-path` also times the host pool (`KVBlockPool`:
the whole cache across PCIe twice a step) for comparison. Prints a table; `--json` writes the rows.
`--profile`: a few more decode steps at the largest batch and the shortest past with the decode context's profiler
(IProfiler: each layer timed with CUDA events, launched layer by layer), the layers' mean times summed per kind
(the plan's layer types: Concat, FusedMatMul, Attention...) and the slowest layers: where a step's time goes.
`--kernels` (needs torch, for CUPTI): the kernels of graph-replayed greedy steps at that shape, by name, with their
sum beside the step's wall time: what the kernels cost against the gaps between them (per-layer events add a launch
and a wait to every layer, which hides that split).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine_core.generate import DecoderRunner, build_decoder_engine  # noqa: E402
from engine_core.runtime import LayerTimes  # noqa: E402
from load_tests.stats import percentile  # noqa: E402


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def prefill(runner: DecoderRunner, pool: Any, seqs: list[int], tokens: int, chunk: int, seed: int) -> None:
    """``tokens`` random prompt tokens into each of ``seqs``, one sequence per run, ``chunk`` tokens at a time."""
    rng = np.random.default_rng(seed)
    for seq in seqs:
        prompt = rng.integers(0, runner.signature.vocab_size, tokens).tolist()
        for start in range(0, tokens, chunk):
            runner.prefill(pool, [seq], [prompt[start:start + chunk]])


def time_steps(runner: DecoderRunner, pool: Any, seqs: list[int], past: int, warmup: int, iters: int,
               argmax: bool = False) -> list[float]:
    """Milliseconds of ``iters`` decode steps of ``seqs`` after ``past`` cached tokens each (after ``warmup``);
    ``argmax``: steps that bring back each row's greedy token instead of its logits."""
    tokens = [int(t) for t in np.arange(len(seqs)) % runner.signature.vocab_size]
    times = []
    for i in range(warmup + iters):
        for seq in seqs:
            pool.truncate(seq, past)
        started = time.perf_counter()
        runner.decode(pool, seqs, tokens, argmax=argmax)
        if i >= warmup:
            times.append((time.perf_counter() - started) * 1e3)
    for seq in seqs:
        pool.truncate(seq, past)
    return times


def summary(path: str, batch: int, past: int, times: list[float]) -> dict[str, Any]:
    median = statistics.median(times)
    return {"path": path, "batch": batch, "past": past, "iters": len(times), "median_ms": median,
            "p90_ms": percentile(times, 90), "min_ms": min(times), "tokens_per_s": batch / (median / 1e3)}


def prefilled_pool(runner: DecoderRunner, batch: int, past: int, args: argparse.Namespace) -> tuple[Any, list[int]]:
    """A device pool of ``batch`` sequences, each prefilled with ``past`` random tokens and room for one more."""
    pool = runner.new_pool(block_tokens=args.block_tokens, num_blocks=batch * -(-(past + 1) // args.block_tokens))
    seqs = list(range(batch))
    for seq in seqs:
        pool.reserve(seq, past + 1)
    prefill(runner, pool, seqs, past, args.prefill_chunk, args.seed)
    return pool, seqs


def profile_steps(runner: DecoderRunner, batch: int, past: int, args: argparse.Namespace) -> dict[str, Any]:
    """Per-layer decode times at (``batch``, ``past``): every layer's mean ms, summed per kind, the slowest layers."""
    pool, seqs = prefilled_pool(runner, batch, past, args)
    time_steps(runner, pool, seqs, past, 2, 0)  # the decode context bound at this shape
    recorder = LayerTimes()
    context = runner._stepper.decode_context if runner._stepper is not None else runner.context
    context.profiler = recorder
    steps = time_steps(runner, pool, seqs, past, 0, 5)
    context.profiler = None
    pool.close()
    means = {name: statistics.mean(values) for name, values in recorder.times.items()}
    types = {layer["name"]: layer["type"] for layer in runner.engine.plan.layers}
    kinds: dict[str, float] = {}
    for name, ms in means.items():  # (reformat layers the builder added have no node: named for what they are)
        kind = types.get(name, "Reformat" if name.startswith("reformat") else name)
        kinds[kind] = kinds.get(kind, 0.0) + ms
    return {"batch": batch, "past": past, "profiled_step_ms": statistics.median(steps),
            "layers_ms": sum(means.values()), "kinds_ms": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
            "slowest": sorted(means.items(), key=lambda kv: -kv[1])[:20]}


def kernel_steps(runner: DecoderRunner, batch: int, past: int, args: argparse.Namespace) -> dict[str, Any]:
    """CUPTI's kernels of ``args.iters`` greedy decode steps at (``batch``, ``past``), as replayed (bench.engine)."""
    import torch

    from bench.engine import kernel_profile

    pool, seqs = prefilled_pool(runner, batch, past, args)
    step_ms = statistics.median(time_steps(runner, pool, seqs, past, 3, args.iters, argmax=True))
    kernels = kernel_profile(lambda: time_steps(runner, pool, seqs, past, 0, 1, argmax=True),
                             torch.cuda.current_stream(), runs=args.iters, top=40)
    pool.close()
    return {"batch": batch, "past": past, "step_ms": step_ms, "kernels_ms": sum(k["ms"] for k in kernels),
            "launches": sum(k["launches"] for k in kernels), "kernels": kernels}


def measure(runner: DecoderRunner, path: str, batches: list[int], pasts: list[int], args: argparse.Namespace,
            iters: int) -> list[dict[str, Any]]:
    """Every (batch, past) of one path (``device``: the runner's default pool, logits back; ``argmax``: the same,
    each row's greedy token back; ``host``: a host pool)."""
    most, longest = max(batches), max(pasts)
    blocks = most * -(-(longest + 1) // args.block_tokens)
    pool = runner.new_pool(block_tokens=args.block_tokens, num_blocks=blocks, on_device=path != "host")
    seqs = list(range(most))
    for seq in seqs:
        pool.reserve(seq, longest + 1)
    prefill(runner, pool, seqs, longest, args.prefill_chunk, args.seed)
    rows = []
    for past in sorted(pasts, reverse=True):  # truncation only shortens: longest pasts first
        for batch in batches:
            times = time_steps(runner, pool, seqs[:batch], past, args.warmup, iters, argmax=path == "argmax")
            rows.append(summary(path, batch, past, times))
    pool.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path, help="a version directory with model.onnx (bench/export_decoder.py)")
    p.add_argument("--backend", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--fp16", action="store_true", help="BuilderFlag.FP16")
    p.add_argument("--batches", type=_ints, default=[1, 8, 64])
    p.add_argument("--pasts", type=_ints, default=[128, 512])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per shape (eager run, graph capture)")
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--host-path", action="store_true", help="also time the host KV pool (CUDA engines)")
    p.add_argument("--argmax", action="store_true",
                   help="also time greedy steps that bring back token ids, not logits (what the generator runs)")
    p.add_argument("--host-iters", type=int, default=5)
    p.add_argument("--profile", action="store_true",
                   help="per-layer times of a decode step at the largest batch and shortest past (IProfiler)")
    p.add_argument("--kernels", action="store_true",
                   help="CUPTI kernel times of greedy steps at the largest batch and shortest past (needs torch)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the rows here")
    args = p.parse_args(argv)
    longest = max(args.pasts)
    max_context = longest + args.block_tokens  # room for the step after the longest past
    started = time.perf_counter()
    engine = build_decoder_engine(args.model / "model.onnx", max_batch_size=max(args.batches), max_context=max_context,
                                  backend=args.backend, fp16=args.fp16)
    build_s = time.perf_counter() - started
    runner = DecoderRunner(engine)
    device = "cpu"
    if args.backend == "cuda":
        from engine_core.cuda.driver import device_name

        device = device_name()
    paths = [("device" if runner.on_device else "host", args.iters)]
    if args.argmax and runner.on_device:
        paths.append(("argmax", args.iters))
    if args.host_path and runner.on_device:
        paths.append(("host", args.host_iters))
    rows = [row for path, iters in paths for row in measure(runner, path, args.batches, args.pasts, args, iters)]
    profile = profile_steps(runner, max(args.batches), min(args.pasts), args) if args.profile else None
    kernels = kernel_steps(runner, max(args.batches), min(args.pasts), args) if args.kernels else None
    runner.close()
    rows.sort(key=lambda r: (r["path"], r["batch"], r["past"]))
    print(f"{args.model} on {device} ({args.backend}{' fp16' if args.fp16 else ''}, built in {build_s:.0f} s): "
          f"one decode step")
    print(f"{'path':>6} {'batch':>5} {'past':>5} {'median ms':>9} {'p90 ms':>7} {'min ms':>7} {'tokens/s':>9}")
    for r in rows:
        print(f"{r['path']:>6} {r['batch']:>5} {r['past']:>5} {r['median_ms']:>9.2f} {r['p90_ms']:>7.2f} "
              f"{r['min_ms']:>7.2f} {r['tokens_per_s']:>9.0f}")
    if profile is not None:
        print(f"profile at batch {profile['batch']}, past {profile['past']}: layers {profile['layers_ms']:.2f} ms of "
              f"a {profile['profiled_step_ms']:.2f} ms step (launched layer by layer)")
        for kind, ms in profile["kinds_ms"].items():
            print(f"kind {kind:<28} {ms:8.3f} ms")
        for name, ms in profile["slowest"][:8]:
            print(f"slowest {name:<60} {ms:8.3f} ms")
    if kernels is not None:
        print(f"kernels at batch {kernels['batch']}, past {kernels['past']}: {kernels['launches']} launches, "
              f"{kernels['kernels_ms']:.3f} ms of kernels in a {kernels['step_ms']:.3f} ms greedy step (top 40 names)")
        for k in kernels["kernels"][:25]:
            print(f"{k['ms']:8.4f} ms {k['launches']:4d}x  {k['kernel'][:100]}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"model": str(args.model), "backend": args.backend, "fp16": args.fp16,
                                         "device": device, "build_s": build_s, "block_tokens": args.block_tokens,
                                         "command": " ".join(["python bench/generate_step.py", *(argv or sys.argv[1:])]),
                                         "rows": rows, "profile": profile, "kernels": kernels},
                                        indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
