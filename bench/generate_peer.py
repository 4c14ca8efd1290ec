"""The peer for generative serving: transformers + torch.compile generating a static batch, on the same model.

    python bench/generate_peer.py --arch gpt2 --batch 1,64 --device cuda --json $OUT/peer.json
    python bench/generate_peer.py --arch gpt2 --size tiny --device cpu --compile none --batch 1,4   # a smoke run

Issue #33 compares Kiln's output tokens/s at 64 concurrent streams with "the transformers + torch.compile peer".
This is that peer as transformers documents it for speed: a static KV cache (`cache_implementation="static"`) and
the decode steps compiled (`torch.compile(mode="reduce-overhead")`, CUDA graphs; `_compile_decoding`), greedy, one batch of B
prompts of `--prompt-tokens` random ids generating exactly `--max-tokens` each (EOS ignored: `min_new_tokens`).
The model is bench/export_decoder.py's (same architecture, same seeded weights) in fp16 on the GPU.

Per batch size: the time to the first token (a generate of one new token: the prefill) and the time for all
tokens; output tokens/s = B * max_tokens / total time; inter-token latency = (total - first) / (max_tokens - 1).
Compilation happens in untimed warm-up runs (two, so CUDA graphs are recorded). Prints a table; `--json` writes it.
Kiln's side is load_tests/generate_bench.py against `kiln serve` on the exported model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from export_decoder import make_model  # noqa: E402


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.no_grad()
def _generate(model: Any, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, cache_implementation="static", pad_token_id=0)


def measure(model: Any, batch: int, prompt_tokens: int, max_tokens: int, device: str, repeats: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_tokens), generator=generator).to(device)
    for new in (1, max_tokens, 1, max_tokens):  # untimed: compilation and graph capture for both lengths
        _generate(model, ids, new)
    firsts, totals = [], []
    for _ in range(repeats):
        _sync(device)
        started = time.perf_counter()
        _generate(model, ids, 1)
        _sync(device)
        firsts.append(time.perf_counter() - started)
        started = time.perf_counter()
        out = _generate(model, ids, max_tokens)
        _sync(device)
        totals.append(time.perf_counter() - started)
        assert out.shape[1] == prompt_tokens + max_tokens, out.shape
    first, total = statistics.median(firsts), statistics.median(totals)
    return {"batch": batch, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "ttft_ms": first * 1e3,
            "total_ms": total * 1e3, "itl_ms": (total - first) / max(1, max_tokens - 1) * 1e3,
            "output_tokens_per_s": batch * max_tokens / total}


def _compile_decoding(model: Any, mode: str) -> None:
    """Let transformers compile the decode steps as it does for a static cache on a GPU (`generate` then calls
    `get_compiled_call(compile_config)` for every step after the eager prefill), with ``mode``; "none" turns that
    off. Why not `torch.compile(model.forward)` as older guides say: transformers 5 compiles the forward itself, and
    a compiled prefill allocates the static cache inside a CUDA graph's memory pool, which the next replay then
    overwrites (torch refuses it: "accessing tensor output of CUDAGraphs that has been overwritten")."""
    from transformers import CompileConfig

    if mode == "none":
        model.generation_config.disable_compile = True
    else:
        model.generation_config.compile_config = CompileConfig(mode=mode, fullgraph=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2")
    p.add_argument("--size", default="124m")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", default="1,64", help="comma-separated batch sizes")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default="fp16")
    p.add_argument("--compile", default="reduce-overhead", help="torch.compile mode, or none")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    model = make_model(args.arch, args.size, None, args.seed).to(args.device, dtype)
    _compile_decoding(model, args.compile)
    rows = [measure(model, int(b), args.prompt_tokens, args.max_tokens, args.device, args.repeats)
            for b in args.batch.split(",")]
    print(f"peer: transformers {__import__('transformers').__version__}, torch {torch.__version__}, "
          f"compile {args.compile}, {args.dtype}, {args.device}")
    print(f"{'batch':>6} {'tok/s':>10} {'TTFT ms':>9} {'ITL ms':>8} {'total ms':>9}")
    for row in rows:
        print(f"{row['batch']:>6} {row['output_tokens_per_s']:>10.1f} {row['ttft_ms']:>9.2f} {row['itl_ms']:>8.2f} "
              f"{row['total_ms']:>9.1f}")
    if args.json is not None:
        args.json.write_text(json.dumps({"arch": args.arch, "size": args.size, "dtype": args.dtype,
                                         "compile": args.compile, "device": args.device, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
