"""Kiln's greedy tokens against transformers' on the same export, token for token (issue #33's first line).

    python bench/export_decoder.py --arch gpt2 --out /tmp/gpt2/1 --check        # model.onnx + reference.json
    python bench/generate_check.py /tmp/gpt2/1 --backend cuda --fp16            # Kiln's Generator, the same prompt
    python bench/generate_check.py /tmp/gpt2/1 /tmp/llama/1 --backend cpu --json $OUT/generate_check.json

For each version directory: builds the decoder engine (`engine_core.generate.build_decoder_engine`), runs the
reference prompt through a `Generator` greedily (no EOS stop: the reference ran to its length unless it met EOS,
and then it is shorter) and prints how many leading tokens equal the reference's. Exit status 1 when any model
differs within the compared tokens.
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

from engine_core.generate import GenerationEvent, Generator, SamplingParams, build_decoder_engine  # noqa: E402


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


def check(directory: Path, backend: str, fp16: bool, max_context: int) -> dict[str, Any]:
    reference = json.loads((directory / "reference.json").read_text())
    started = time.perf_counter()
    engine = build_decoder_engine(directory / "model.onnx", max_batch_size=1, max_context=max_context,
                                  backend=backend, fp16=fp16)
    build_s = time.perf_counter() - started
    with Generator(engine, max_batch_size=1, max_context=max_context, eos_token_ids=()) as generator:
        started = time.perf_counter()
        tokens = greedy(generator, reference["prompt"], len(reference["tokens"]))
        generate_s = time.perf_counter() - started
    expected = reference["tokens"]
    same = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), min(len(tokens), len(expected)))
    return {"model": str(directory), "backend": backend, "fp16": fp16, "build_s": build_s, "generate_s": generate_s,
            "tokens": tokens, "reference": expected, "equal_prefix": same, "equal": tokens == expected}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("directories", type=Path, nargs="+", help="version directories with model.onnx + reference.json")
    p.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--max-context", type=int, default=128)
    p.add_argument("--json", type=Path, help="write the rows here")
    args = p.parse_args()
    rows = [check(d, args.backend, args.fp16, args.max_context) for d in args.directories]
    print(f"{'model':<40} {'backend':>8} {'build s':>8} {'gen s':>7} {'equal':>12}")
    for row in rows:
        print(f"{row['model'][-40:]:<40} {row['backend'] + (' fp16' if row['fp16'] else ''):>8} "
              f"{row['build_s']:>8.1f} {row['generate_s']:>7.2f} {row['equal_prefix']:>5} of {len(row['reference']):<4}")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0 if all(row["equal"] for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
