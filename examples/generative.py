"""A tiny decoder-only language model in the Hugging Face / optimum export convention, for tests and examples.

    python examples/generative.py OUT_DIR      # OUT_DIR/model.onnx, tokenizer.json, tokenizer_config.json, ...

`write_tiny_decoder` writes a version directory that a `kiln_llm` model serves, with the files a real export has:
- model.onnx (opset 17) with a KV cache: inputs `input_ids`, `attention_mask`, `position_ids` (optional: without it
  the model counts positions from the mask, as GPT-2's export does), `past_key_values.{i}.key` / `.value`; outputs
  `logits`, `present.{i}.key` / `.value` (past and new keys concatenated). Causal and padding masks are applied in
  the graph, so a batch whose pasts are left-padded decodes as its sequences would one by one. The network is
  GPT-2's shape: token + position embeddings, pre-LayerNorm attention blocks with a tanh-GELU MLP, a final
  LayerNorm and an LM head; weights are seeded random, scaled so greedy decoding wanders instead of repeating one
  token;
- tokenizer.json: byte-level BPE over GPT-2's byte alphabet with a few merges, `<|endoftext|>` and ChatML's
  `<|im_start|>` / `<|im_end|>` as special tokens;
- tokenizer_config.json (bos/eos tokens, a ChatML chat template) and generation_config.json (eos ids).

`reference_greedy` recomputes each step from the whole sequence with onnxruntime and no KV cache: what a cached,
batched generator has to reproduce token for token.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
#: a large negative score for masked keys, finite in fp16 too (fp16 builds must not turn a row into NaN)
MASKED = -1.0e4

#: BPE merges over plain text (" " and "\n" become GPT-2's "Ġ" and "Ċ"); each pair's parts exist before it
MERGES = [
    (" ", "t"), ("h", "e"), (" t", "he"), ("i", "n"), (" ", "a"), ("e", "r"), ("o", "n"), (" ", "s"), ("r", "e"),
    ("a", "t"), ("e", "n"), (" ", "o"), ("i", "s"), (" ", "w"), ("o", "r"), ("e", "s"), (" ", "c"), ("l", "l"),
    ("a", "n"), (" ", "b"), ("i", "t"), (" ", "f"), ("o", "u"), (" ", "m"), ("in", "g"), ("n", "d"), (" a", "nd"),
    (" ", "h"), (" t", "o"), (" ", "i"), (" i", "s"), ("e", "d"), ("a", "r"), (" ", "p"), ("u", "s"), ("us", "er"),
    ("s", "t"), ("s", "y"), ("sy", "st"), ("e", "m"), ("syst", "em"), ("is", "t"), ("a", "s"), ("as", "s"),
    ("ass", "ist"), ("assist", "an"), ("assistan", "t"), ("\n", "\n"), ("l", "o"), (" w", "or"), ("ll", "o"),
]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# -- tokenizer files ---------------------------------------------------------------------------------------------

@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, in GPT-2's order (the order of its first 256 vocabulary ids)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_level(text: str) -> str:
    table = bytes_to_unicode()
    return "".join(table[b] for b in text.encode("utf-8"))


def tokenizer_vocab() -> dict[str, int]:
    """Token -> id: the 256 byte tokens, then one token per merge, then the special tokens."""
    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    for left, right in MERGES:
        token = _byte_level(left + right)
        assert _byte_level(left) in vocab and _byte_level(right) in vocab and token not in vocab, (left, right)
        vocab[token] = len(vocab)
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    return vocab


def tokenizer_json() -> dict:
    """tokenizer.json in the Hugging Face tokenizers format (GPT-2's pipeline: ByteLevel pre-tokenizer, BPE model,
    ByteLevel decoder)."""
    vocab = tokenizer_vocab()
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    added = [{"id": vocab[t], "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for t in SPECIAL_TOKENS]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": byte_level, "post_processor": dict(byte_level, trim_offsets=False), "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [f"{_byte_level(a)} {_byte_level(b)}" for a, b in MERGES]},
    }


def _write_tokenizer(directory: Path, max_positions: int) -> dict[str, int]:
    vocab = tokenizer_vocab()
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer_json(), ensure_ascii=False, indent=1))
    config = {"bos_token": ENDOFTEXT, "eos_token": IM_END, "pad_token": ENDOFTEXT, "unk_token": None,
              "add_bos_token": False, "model_max_length": max_positions, "chat_template": CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    generation = {"bos_token_id": vocab[ENDOFTEXT], "eos_token_id": [vocab[IM_END], vocab[ENDOFTEXT]],
                  "do_sample": False}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=1))
    return vocab


# -- the ONNX graph ----------------------------------------------------------------------------------------------

class _Graph:
    """Nodes and initializers of the graph being written, with fresh names and seeded weights."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._count = 0
        self._scalars: set[str] = set()

    def op(self, op_type: str, *inputs: str, output: str | None = None, **attrs) -> str:
        self._count += 1
        name = output or f"{op_type.lower()}_{self._count}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [name], name=f"n{self._count}_{op_type}", **attrs))
        return name

    def const(self, name: str, value: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def scalar(self, value: float, dtype: type = np.float32) -> str:
        """A 0-d constant, one initializer per value and dtype."""
        name = f"const_{np.dtype(dtype).name}_{value!r}"
        if name not in self._scalars:
            self._scalars.add(self.const(name, np.array(value, dtype)))
        return name

    def weight(self, name: str, shape: tuple[int, ...], scale: float, mean: float = 0.0) -> str:
        return self.const(name, (mean + self.rng.standard_normal(shape) * scale).astype(np.float32))

    def linear(self, x: str, name: str, n_in: int, n_out: int, gain: float = 1.0) -> str:
        w = self.weight(f"{name}.weight", (n_in, n_out), gain / math.sqrt(n_in))
        b = self.weight(f"{name}.bias", (n_out,), 0.02)
        return self.op("Add", self.op("MatMul", x, w), b)

    def layer_norm(self, x: str, name: str, width: int) -> str:
        gamma = self.weight(f"{name}.weight", (width,), 0.1, mean=1.0)
        beta = self.weight(f"{name}.bias", (width,), 0.05)
        return self.op("LayerNormalization", x, gamma, beta, axis=-1, epsilon=1e-5)


def _mask_bias(g: _Graph) -> tuple[str, str, str]:
    """The additive attention bias [B, 1, S, P + S] (0 where query s may see key t: t <= P + s and the mask is 1,
    MASKED elsewhere), and the past length P and total length T as 1-element tensors."""
    new = g.op("Shape", "input_ids", start=1, end=2)
    total = g.op("Shape", "attention_mask", start=1, end=2)
    past = g.op("Sub", total, new)
    zero, one = g.scalar(0, np.int64), g.scalar(1, np.int64)
    axis0, axis1 = g.const("axes_0", np.array([0], np.int64)), g.const("axes_1", np.array([1], np.int64))
    keys = g.op("Range", zero, g.op("Squeeze", total, axis0), one)
    queries = g.op("Add", g.op("Range", zero, g.op("Squeeze", new, axis0), one), past)
    causal = g.op("LessOrEqual", g.op("Unsqueeze", keys, axis0), g.op("Unsqueeze", queries, axis1))
    padding = g.op("Unsqueeze", g.op("Cast", "attention_mask", to=TensorProto.BOOL),
                   g.const("axes_12", np.array([1, 2], np.int64)))
    allowed = g.op("And", causal, padding)
    bias = g.op("Where", allowed, g.scalar(0.0), g.scalar(MASKED))
    return bias, past, total


def _positions(g: _Graph, has_position_ids: bool, past: str, total: str) -> str:
    """position_ids, or (a model without that input) each token's count of attended tokens before it, as GPT-2's
    export derives them: left padding then leaves real positions unchanged."""
    if has_position_ids:
        return "position_ids"
    counted = g.op("CumSum", "attention_mask", g.scalar(1, np.int64))
    before = g.op("Sub", counted, g.const("one_row", np.array([[1]], np.int64)))
    return g.op("Slice", before, past, total, g.const("slice_axes", np.array([1], np.int64)))


def _attention(g: _Graph, x: str, layer: int, heads: int, head_dim: int, bias: str) -> str:
    width = heads * head_dim
    split = g.const(f"l{layer}.split_heads", np.array([0, 0, heads, head_dim], np.int64))

    def heads_of(t: str) -> str:  # [B, S, H*D] -> [B, H, S, D]
        return g.op("Transpose", g.op("Reshape", t, split), perm=[0, 2, 1, 3])

    q = heads_of(g.linear(x, f"l{layer}.q", width, width, gain=1.5))
    k = heads_of(g.linear(x, f"l{layer}.k", width, width, gain=1.5))
    v = heads_of(g.linear(x, f"l{layer}.v", width, width))
    keys = g.op("Concat", f"past_key_values.{layer}.key", k, axis=2, output=f"present.{layer}.key")
    values = g.op("Concat", f"past_key_values.{layer}.value", v, axis=2, output=f"present.{layer}.value")
    scores = g.op("MatMul", q, g.op("Transpose", keys, perm=[0, 1, 3, 2]))
    scale = g.scalar(1.0 / math.sqrt(head_dim))
    probs = g.op("Softmax", g.op("Add", g.op("Mul", scores, scale), bias), axis=-1)
    merged = g.op("Reshape", g.op("Transpose", g.op("MatMul", probs, values), perm=[0, 2, 1, 3]),
                  g.const(f"l{layer}.merge_heads", np.array([0, 0, width], np.int64)))
    return g.linear(merged, f"l{layer}.o", width, width)


def _gelu_tanh(g: _Graph, x: str) -> str:
    """GPT-2's GELU: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))."""
    inner = g.op("Add", x, g.op("Mul", g.op("Mul", g.op("Mul", x, x), x), g.scalar(0.044715)))
    tanh = g.op("Tanh", g.op("Mul", inner, g.scalar(math.sqrt(2 / math.pi))))
    return g.op("Mul", g.op("Mul", x, g.op("Add", tanh, g.scalar(1.0))), g.scalar(0.5))


def _block(g: _Graph, h: str, layer: int, heads: int, head_dim: int, bias: str) -> str:
    width = heads * head_dim
    h = g.op("Add", h, _attention(g, g.layer_norm(h, f"l{layer}.ln1", width), layer, heads, head_dim, bias))
    up = g.linear(g.layer_norm(h, f"l{layer}.ln2", width), f"l{layer}.fc1", width, 4 * width)
    return g.op("Add", h, g.linear(_gelu_tanh(g, up), f"l{layer}.fc2", 4 * width, width))


def _io(layers: int, heads: int, head_dim: int, vocab: int, has_position_ids: bool):
    def value(name: str, elem: int, shape: list) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, elem, shape)

    inputs = [value("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
              value("attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"])]
    if has_position_ids:
        inputs.append(value("position_ids", TensorProto.INT64, ["batch_size", "sequence_length"]))
    outputs = [value("logits", TensorProto.FLOAT, ["batch_size", "sequence_length", vocab])]
    for i in range(layers):
        for part in ("key", "value"):
            inputs.append(value(f"past_key_values.{i}.{part}", TensorProto.FLOAT,
                                ["batch_size", heads, "past_sequence_length", head_dim]))
            outputs.append(value(f"present.{i}.{part}", TensorProto.FLOAT,
                                 ["batch_size", heads, "total_sequence_length", head_dim]))
    return inputs, outputs


def decoder_model(*, vocab: int, seed: int = 0, layers: int = 2, heads: int = 2, head_dim: int = 16,
                  max_positions: int = 256, has_position_ids: bool = True) -> onnx.ModelProto:
    """The decoder graph (see the module docstring) with seeded weights."""
    g = _Graph(seed)
    width = heads * head_dim
    bias, past, total = _mask_bias(g)
    tokens = g.op("Gather", g.weight("wte", (vocab, width), 1.0), "input_ids")
    places = g.op("Gather", g.weight("wpe", (max_positions, width), 1.0), _positions(g, has_position_ids, past,
                                                                                      total))
    h = g.op("Add", tokens, places)
    for layer in range(layers):
        h = _block(g, h, layer, heads, head_dim, bias)
    final = g.layer_norm(h, "ln_f", width)
    g.op("MatMul", final, g.weight("lm_head", (width, vocab), 3.0 / math.sqrt(width)), output="logits")
    inputs, outputs = _io(layers, heads, head_dim, vocab, has_position_ids)
    graph = helper.make_graph(g.nodes, "tiny_decoder", inputs, outputs, initializer=g.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="kiln-examples")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def write_tiny_decoder(directory: Path, *, seed: int = 0, layers: int = 2, heads: int = 2, head_dim: int = 16,
                       max_positions: int = 256, position_ids: bool = True) -> Path:
    """Write the tiny decoder's version directory (model.onnx, tokenizer.json, tokenizer_config.json,
    generation_config.json) into ``directory`` (created); returns it. ``position_ids=False`` leaves that input out
    (the model then counts positions from attention_mask). Contexts up to ``max_positions`` tokens."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = _write_tokenizer(directory, max_positions)
    model = decoder_model(vocab=len(vocab), seed=seed, layers=layers, heads=heads, head_dim=head_dim,
                          max_positions=max_positions, has_position_ids=position_ids)
    onnx.save(model, str(directory / "model.onnx"))
    return directory


# -- the reference ---------------------------------------------------------------------------------------------

def reference_greedy(directory: Path, prompt_ids: Sequence[int], steps: int) -> list[int]:
    """``steps`` greedy tokens after ``prompt_ids``, each step recomputed from the whole sequence by onnxruntime
    with an empty past (no KV cache, no padding): the reference a generator must match."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(Path(directory) / "model.onnx"), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    pasts = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32)
             for i in session.get_inputs() if i.name.startswith("past_key_values.")}
    tokens = [int(t) for t in prompt_ids]
    out: list[int] = []
    for _ in range(steps):
        n = len(tokens)
        feeds = {"input_ids": np.array([tokens], np.int64), "attention_mask": np.ones((1, n), np.int64), **pasts}
        if "position_ids" in names:
            feeds["position_ids"] = np.arange(n, dtype=np.int64)[None]
        logits = session.run(["logits"], feeds)[0]
        token = int(np.argmax(logits[0, -1]))
        out.append(token)
        tokens.append(token)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)
    print(write_tiny_decoder(args.directory, seed=args.seed, layers=args.layers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
