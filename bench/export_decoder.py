"""Export a Hugging Face causal LM to the ONNX decoder contract Kiln's generative models serve.

    python bench/export_decoder.py --arch gpt2 --out /tmp/gpt2/1            # GPT-2 124M shape, seeded weights
    python bench/export_decoder.py --arch llama --size 1b --out /tmp/llama/1  # a Llama-3.2-1B-shaped model
    python bench/export_decoder.py --arch llama --size tiny --out /tmp/l/1 --check   # and compare with transformers

Why our own exporter: optimum is not on the GPU machine, and the contract is small. The wrapper takes
`input_ids`, `attention_mask`, `position_ids` and `past_key_values.{i}.key|value` [B, H, P, D], rebuilds the
transformers cache from them and returns `logits` and `present.{i}.key|value` [B, H, P + S, D]: the names and
layout of optimum's `--task text-generation-with-past` exports (engine_core/generate/decoder.py reads them).
Weights are seeded random (`torch.manual_seed`) unless `--pretrained DIR` names a local checkpoint; no download.
The version directory also gets a `generation_config.json` and, with `--tokenizer DIR`, that tokenizer's files;
without it a synthetic byte-level tokenizer.json of the model's vocabulary size (the GPU machine has no network):
the 256 byte tokens, the model's BOS/EOS as special tokens, and every other id a word " w<id>", so any id the
seeded model generates decodes to text (what `kiln serve` needs to stream it).

`--check` runs transformers (fp32, eager attention) greedy for `--check-tokens` tokens on a seeded prompt and
writes `reference.json` (prompt ids and the tokens) next to the model: the serving tests and the GPU benchmark
compare Kiln's greedy tokens with it token for token (issue #33's first line).
Needs torch and transformers (not Kiln dependencies: a separate venv here, the image's torch on the GPU machine).
"""

from __future__ import annotations

import argparse
import copy as copy_module
import inspect
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script in a venv without Kiln: harness.py is standard library only
    sys.path.insert(0, str(ROOT))

from load_tests.harness import load_example  # noqa: E402

SIZES = {  # (hidden, layers, heads, kv_heads, intermediate, vocab)
    ("gpt2", "124m"): (768, 12, 12, 12, 3072, 50257),
    ("gpt2", "tiny"): (64, 2, 4, 4, 256, 1000),
    ("llama", "1b"): (2048, 16, 32, 8, 8192, 128256),
    ("llama", "tiny"): (64, 2, 4, 2, 128, 1000),
}


#: weights' standard deviation per architecture. transformers' 0.02 leaves random models' logits nearly flat, so
#: greedy decoding repeats one token (GPT-2 124M: 3 distinct tokens in 32) and a token-for-token comparison would
#: prove little. 0.2 gives varied sequences but chaotic models: transformers itself in fp16 is off by ~5 in logits
#: up to 29-47 and picks another token at 4-5 of 32 steps, as an fp16 engine then does too. Measured with transformers
#: in fp16 on the CPU: GPT-2 at 0.1, 27 distinct tokens, logits within 0.11, no other argmax; the Llama-1B shape at
#: 0.05, 32 distinct, within 0.19, another argmax at two steps whose fp32 margins are 0.011 and 0.021 (at 0.1: within
#: 0.84, three steps). reference.json records the same figures from the machine that ran the export.
INIT_RANGE = {"gpt2": 0.1, "llama": 0.05}


def make_model(arch: str, size: str, pretrained: Path | None, seed: int) -> torch.nn.Module:
    """A causal LM in fp32 with eager attention (what the exporter traces cleanly)."""
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if pretrained is not None:
        return AutoModelForCausalLM.from_pretrained(pretrained, torch_dtype=torch.float32,
                                                    attn_implementation="eager").eval()
    torch.manual_seed(seed)
    hidden, layers, heads, kv_heads, intermediate, vocab = SIZES[(arch, size)]
    if arch == "gpt2":
        config = GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_inner=intermediate, vocab_size=vocab,
                            n_positions=1024, bos_token_id=vocab - 1, eos_token_id=vocab - 1,
                            initializer_range=INIT_RANGE[arch], attn_implementation="eager")
        return GPT2LMHeadModel(config).eval()
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=intermediate, vocab_size=vocab,
                         max_position_embeddings=4096, rope_theta=500000.0, tie_word_embeddings=True,
                         bos_token_id=min(128000, vocab - 2), eos_token_id=min(128001, vocab - 1),
                         initializer_range=INIT_RANGE[arch], attn_implementation="eager")
    return LlamaForCausalLM(config).eval()


CHAT_TEMPLATE = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|endoftext|>assistant: {% endif %}")


def synthetic_tokenizer(vocab_size: int, bos: int, eos: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tokenizer.json, tokenizer_config.json) for a seeded model without a tokenizer of its own (see above)."""
    generative = load_example("generative.py")
    vocab = {ch: i for i, ch in enumerate(generative.bytes_to_unicode().values())}
    special = {bos: "<|begin_of_text|>" if bos != eos else "<|endoftext|>", eos: "<|endoftext|>"}
    for i in range(len(vocab), vocab_size):
        vocab[special.get(i) or generative._byte_level(f" w{i}")] = i
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, t in sorted(special.items())]
    tokenizer = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
                 "pre_tokenizer": byte_level, "post_processor": dict(byte_level, trim_offsets=False),
                 "decoder": byte_level,
                 "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                           "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                           "ignore_merges": False, "vocab": vocab, "merges": []}}
    config = {"bos_token": special[bos], "eos_token": special[eos], "add_bos_token": False,
              "chat_template": CHAT_TEMPLATE}
    return tokenizer, config


class WithPast(torch.nn.Module):
    """The contract's flat tensors in, the model with a cache built from them, flat tensors out."""

    def __init__(self, model: torch.nn.Module, layers: int) -> None:
        super().__init__()
        self.model = model
        self.layers = layers

    def forward(self, input_ids, attention_mask, position_ids, *past):  # noqa: ANN001, ANN201 - traced
        from transformers import DynamicCache

        cache = DynamicCache(ddp_cache_data=[(past[2 * i], past[2 * i + 1]) for i in range(self.layers)],
                             config=self.model.config)
        # transformers 5 names the argument and the output `cache` (`past_key_values` before)
        name = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, **{name: cache})
        presents = []
        for layer in getattr(out, name).layers:
            presents += [layer.keys, layer.values]
        return (out.logits, *presents)


def kv_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of `model`'s cache."""
    c = model.config
    layers = getattr(c, "num_hidden_layers", None) or c.n_layer
    heads = getattr(c, "num_attention_heads", None) or c.n_head
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    hidden = getattr(c, "hidden_size", None) or c.n_embd
    return layers, kv_heads, getattr(c, "head_dim", None) or hidden // heads


def export(model: torch.nn.Module, path: Path, opset: int = 18) -> None:
    layers, kv_heads, head_dim = kv_shape(model)
    batch, new, past_len = 2, 3, 4  # not 0 or 1: the exporter would specialise those sizes
    ids = torch.randint(0, model.config.vocab_size, (batch, new))
    mask = torch.ones(batch, past_len + new, dtype=torch.int64)
    positions = torch.arange(past_len, past_len + new).expand(batch, new).contiguous()
    past = [torch.randn(batch, kv_heads, past_len, head_dim) for _ in range(2 * layers)]
    past_names = [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    present_names = [f"present.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "total"},
            "position_ids": {0: "batch", 1: "sequence"}, "logits": {0: "batch", 1: "sequence"}}
    axes.update({n: {0: "batch", 2: "past"} for n in past_names})
    axes.update({n: {0: "batch", 2: "total"} for n in present_names})
    torch.onnx.export(WithPast(model, layers), (ids, mask, positions, *past), str(path), dynamo=False,
                      input_names=["input_ids", "attention_mask", "position_ids", *past_names],
                      output_names=["logits", *present_names], dynamic_axes=axes, opset_version=opset)


@torch.no_grad()
def reference_greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """transformers' own greedy tokens (fp32, no sampling): what Kiln must reproduce."""
    ids = torch.tensor([prompt])
    # (no min_new_tokens: in transformers 5.24 it changed GPT-2's greedy tokens even where EOS was not the argmax;
    # a sequence that ends at EOS is the reference as it is, and Kiln stops there too)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                         pad_token_id=0)
    return [int(t) for t in out[0, len(prompt):]]


@torch.no_grad()
def fp16_conditioning(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> dict[str, Any]:
    """How well the model's greedy tokens survive fp16 in transformers itself (on CUDA when there is a GPU): the
    prompt and the reference tokens in one forward pass in fp32 and in fp16, the largest logit difference at the
    reference's steps and the steps whose fp16 argmax is another token; and transformers' own greedy tokens in fp16
    (``tokens``: the reference of an fp16 run, issue #33's "H100, fp16, same run"). What an fp16 engine can be asked
    for."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ids = torch.tensor([prompt + tokens], device=device)
    steps = slice(len(prompt) - 1, len(prompt) - 1 + len(tokens))
    copy = copy_module.deepcopy(model).to(device)  # the exported weights stay fp32 as the reference used them
    exact = copy(ids).logits[0, steps].float()
    half = copy.to(torch.float16)(ids).logits[0, steps].float()
    prompt_ids = torch.tensor([prompt], device=device)
    generated = copy.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), max_new_tokens=len(tokens),
                              do_sample=False, pad_token_id=0)
    del copy
    picked = half.argmax(-1).tolist()
    return {"device": device, "max_logit_error": float((half - exact).abs().max()),
            "logit_scale": float(exact.abs().max()),
            "differing_steps": [i for i, (a, b) in enumerate(zip(picked, tokens)) if a != b],
            "tokens": [int(t) for t in generated[0, len(prompt):]]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2")
    p.add_argument("--size", default="124m", help="124m or tiny (gpt2); 1b or tiny (llama)")
    p.add_argument("--pretrained", type=Path, help="a local checkpoint directory instead of seeded weights")
    p.add_argument("--tokenizer", type=Path, help="copy tokenizer.json / tokenizer_config.json from here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="the version directory to write (…/<model>/1)")
    p.add_argument("--check", action="store_true", help="write reference.json with transformers' greedy tokens")
    p.add_argument("--check-tokens", type=int, default=32)
    args = p.parse_args()
    model = make_model(args.arch, args.size, args.pretrained, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    reference = None
    if args.check:  # before the export: tracing GPT-2 left its module in a state whose generate() differs
        generator = torch.Generator().manual_seed(args.seed + 1)
        prompt = torch.randint(0, model.config.vocab_size, (12,), generator=generator).tolist()
        tokens = reference_greedy(model, prompt, args.check_tokens)
        reference = {"prompt": prompt, "tokens": tokens, "init_range": None if args.pretrained else INIT_RANGE[args.arch],
                     "transformers_fp16": fp16_conditioning(model, prompt, tokens)}
    export(model, args.out / "model.onnx")
    eos = model.config.eos_token_id
    (args.out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    if args.tokenizer is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (args.tokenizer / name).is_file():
                shutil.copy(args.tokenizer / name, args.out / name)
    else:
        bos = model.config.bos_token_id if model.config.bos_token_id is not None else eos
        tokenizer, tokenizer_config = synthetic_tokenizer(model.config.vocab_size, bos, eos)
        (args.out / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
        (args.out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if reference is not None:
        (args.out / "reference.json").write_text(json.dumps(reference))
        half = reference["transformers_fp16"]
        print(f"reference: prompt {reference['prompt']} -> {reference['tokens']}; transformers in fp16 on "
              f"{half['device']}: logits off by up to {half['max_logit_error']:.3f} (of {half['logit_scale']:.1f}), "
              f"another argmax at steps {half['differing_steps']}")
    print(f"wrote {args.out / 'model.onnx'}")


if __name__ == "__main__":
    main()
