"""Kiln's greedy tokens against transformers' on the same export, token for token (issue #33's first line).

    python bench/export_decoder.py --arch gpt2 --out /tmp/gpt2/1 --check        # model.onnx + reference.json
    python bench/generate_check.py /tmp/gpt2/1 --backend cuda --fp16            # Kiln's Generator, the same prompt
    python bench/generate_check.py /tmp/gpt2/1 /tmp/llama/1 --backend cpu --json $OUT/generate_check.json

For each version directory: builds the decoder engine (`engine_core.generate.build_decoder_engine`), runs the
reference prompt through a `Generator` greedily (no EOS stop: the reference ran to its length unless it met EOS,
and then it is shorter) and prints how many leading tokens equal the reference's. Exit status 1 when any model
differs within the compared tokens.

`--teacher-forced` tells a wrong engine from a near-tie: it feeds the reference's own tokens, step by step, through
the tested engine and through the CPU backend in strict fp32 (which matches transformers), and prints for each step
where the tested engine's argmax differs from the reference token the fp32 logits' margin between the two tokens
beside the largest logit error the tested engine makes over all steps. Random weights leave many steps with margins
of a few hundredths; an fp16 engine whose logits are off by more than that picks the other token there.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from engine_core.generate import GenerationEvent, Generator, SamplingParams, build_decoder_engine  # noqa: E402
from engine_core.generate.decoder import DecoderRunner  # noqa: E402


def greedy(generator: Generator, prompt: list[int], steps: int, timeout_s: float = 600) -> list[int]:
    """`steps` greedy tokens of `prompt` (fewer if the generator stops)."""
    tokens: list[int] = []
    done = threading.Event()

    def on_event(event: GenerationEvent) -> None:
        if event.token_id is not None:
            tokens.append(event.token_id)
        if event.final:
            done.set()

    generator.submit(prompt, SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True), on_event)
    if not done.wait(timeout_s):
        raise TimeoutError(f"no final token after {timeout_s:.0f} s")
    return tokens


def forced_logits(engine: Any, prompt: list[int], tokens: list[int], max_context: int) -> np.ndarray:
    """The engine's next-token logits [len(tokens), vocab] with the prompt prefilled and then ``tokens`` fed one
    by one (each step's input is the reference's token, whatever the engine would have picked)."""
    runner = DecoderRunner(engine)
    pool = runner.new_pool(block_tokens=16, num_blocks=-(-max_context // 16))
    try:
        rows = [runner.prefill(pool, ["s"], [prompt])[0]]
        rows += [runner.decode(pool, ["s"], [t])[0] for t in tokens[:-1]]
        return np.stack(rows)
    finally:
        pool.close()
        runner.close()


def near_ties(tested: np.ndarray, exact: np.ndarray, expected: list[int]) -> dict[str, Any]:
    """Where the tested engine's argmax differs from the reference token: the exact (fp32) logits' margin between
    the two tokens, beside the tested engine's largest logit error over every step."""
    error = float(np.abs(tested - exact).max())
    picked = tested.argmax(axis=1)
    steps = [{"step": i, "reference": t, "picked": int(picked[i]),
              "fp32_margin": float(exact[i, t] - exact[i, picked[i]])}
             for i, t in enumerate(expected) if picked[i] != t]
    return {"max_logit_error": error, "logit_scale": float(np.abs(exact).max()), "differing_steps": steps,
            "only_near_ties": all(s["fp32_margin"] <= 2 * error for s in steps)}


def equal_prefix(tokens: list[int], reference: list[int]) -> int:
    """How many leading tokens of ``tokens`` equal ``reference``'s."""
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))


def check(directory: Path, backend: str, fp16: bool, tf32: bool, max_context: int, teacher_forced: bool
          ) -> dict[str, Any]:
    reference = json.loads((directory / "reference.json").read_text())
    started = time.perf_counter()
    engine = build_decoder_engine(directory / "model.onnx", max_batch_size=1, max_context=max_context,
                                  backend=backend, fp16=fp16, tf32=tf32)
    build_s = time.perf_counter() - started
    with Generator(engine, max_batch_size=1, max_context=max_context, eos_token_ids=()) as generator:
        started = time.perf_counter()
        tokens = greedy(generator, reference["prompt"], len(reference["tokens"]))
        generate_s = time.perf_counter() - started
    expected = reference["tokens"]
    same = equal_prefix(tokens, expected)
    half_tokens = (reference.get("transformers_fp16") or {}).get("tokens")
    row = {"model": str(directory), "backend": backend, "fp16": fp16, "tf32": tf32, "build_s": build_s,
           "generate_s": generate_s, "tokens": tokens, "reference": expected, "equal_prefix": same,
           "equal": tokens == expected, "transformers_fp16": reference.get("transformers_fp16"),
           "equal_prefix_to_transformers_fp16": None if half_tokens is None else equal_prefix(tokens, half_tokens)}
    if teacher_forced:
        exact = build_decoder_engine(directory / "model.onnx", max_batch_size=1, max_context=max_context,
                                     backend="cpu", tf32=False)
        row["teacher_forced"] = near_ties(forced_logits(engine, reference["prompt"], expected, max_context),
                                          forced_logits(exact, reference["prompt"], expected, max_context), expected)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("directories", type=Path, nargs="+", help="version directories with model.onnx + reference.json")
    p.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--no-tf32", dest="tf32", action="store_false", help="strict fp32 math on CUDA")
    p.add_argument("--teacher-forced", action="store_true",
                   help="also feed the reference tokens and report where the engine's argmax differs (see above)")
    p.add_argument("--max-context", type=int, default=128)
    p.add_argument("--json", type=Path, help="write the rows here")
    args = p.parse_args()
    rows = [check(d, args.backend, args.fp16, args.tf32, args.max_context, args.teacher_forced)
            for d in args.directories]
    print(f"{'model':<40} {'backend':>8} {'build s':>8} {'gen s':>7} {'equal':>12}")
    for row in rows:
        print(f"{row['model'][-40:]:<40} {row['backend'] + (' fp16' if row['fp16'] else ''):>8} "
              f"{row['build_s']:>8.1f} {row['generate_s']:>7.2f} {row['equal_prefix']:>5} of {len(row['reference']):<4}")
        forced = row.get("teacher_forced")
        if forced is not None:
            print(f"  teacher-forced: largest logit error {forced['max_logit_error']:.4f} (logits up to "
                  f"{forced['logit_scale']:.1f}); argmax differs at {len(forced['differing_steps'])} of "
                  f"{len(row['reference'])} steps, fp32 margins there: "
                  + ", ".join(f"{s['fp32_margin']:.4f}" for s in forced["differing_steps"][:8]))
        peer = row.get("transformers_fp16")
        if peer is not None:
            print(f"  transformers in fp16 ({peer['device']}, at export): logits off by up to "
                  f"{peer['max_logit_error']:.4f}; another argmax at {len(peer['differing_steps'])} steps")
            if row["equal_prefix_to_transformers_fp16"] is not None:
                print(f"  equal to transformers' own fp16 greedy tokens: {row['equal_prefix_to_transformers_fp16']} "
                      f"of {len(peer['tokens'])}")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0 if all(row["equal"] for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
