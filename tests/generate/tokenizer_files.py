"""Small tokenizer.json files of each supported family, trained in a few milliseconds with Hugging Face `tokenizers`.

Each builder returns the `tokenizers.Tokenizer`, the reference Kiln's tokenizer is checked against; its
``to_str()`` is the tokenizer.json. Vocabularies are tiny, so most words split into many tokens and multi-byte
characters into byte tokens: the cases where merging and streaming can go wrong.
"""

from __future__ import annotations

import json

from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as HFTokenizer

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "It's a test: don't, won't, they'll, we've, I'm, she'd.  Numbers 12345 and 3.14159, 2024-01-01.",
    "Ünïcödé — naïve café résumé; 日本語のテキスト、中文文本。한국어 텍스트 😀🎉👍🏽 emoji!",
    "def f(x):\n    return x * 2\n\n\tindented\ttabs\r\nwindows lines",
    "Привет мир, Γειά σου Κόσμε, مرحبا بالعالم, שלום עולם, नमस्ते दुनिया",
] * 20

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
O200K_PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
                 r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _train(tok: HFTokenizer, vocab: int, special: list[str], byte_alphabet: bool = False, **options) -> None:
    alphabet = pre_tokenizers.ByteLevel.alphabet() if byte_alphabet else []
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=special, initial_alphabet=alphabet, **options)
    tok.train_from_iterator(CORPUS, trainer)


def _with_byte_tokens(tok: HFTokenizer) -> HFTokenizer:
    """The model's vocabulary extended with SentencePiece's <0x00>..<0xFF> byte tokens (byte fallback)."""
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    first = max(vocab.values()) + 1
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", first + b)
    return HFTokenizer.from_str(json.dumps(spec))


def gpt2(add_prefix_space: bool = False) -> HFTokenizer:
    """GPT-2: ByteLevel pre-tokenizer (its regex) and decoder, ChatML special tokens."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    _train(tok, 600, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], byte_alphabet=True)
    return tok


def llama3(pattern: str = LLAMA3_PATTERN) -> HFTokenizer:
    """Llama 3 / Qwen: Split(regex) + ByteLevel(use_regex=false), ignore_merges, BOS from TemplateProcessing."""
    tok = HFTokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    _train(tok, 600, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                      "<|eot_id|>"], byte_alphabet=True)
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[("<|begin_of_text|>", 0)])
    return tok


def _sentencepiece_decoder() -> decoders.Sequence:
    return decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                              decoders.Strip(" ", 1, 0)])


def llama2() -> HFTokenizer:
    """Llama 2: Prepend('▁') + Replace(' ', '▁') normalizer, no pre-tokenizer, byte fallback, BOS."""
    tok = HFTokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = _sentencepiece_decoder()
    _train(tok, 400, ["<unk>", "<s>", "</s>"], limit_alphabet=60)
    tok = _with_byte_tokens(tok)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def mistral(scheme: str = "first", split: bool = False, metaspace_decoder: bool = False) -> HFTokenizer:
    """Mistral: Metaspace pre-tokenizer (prepend_scheme, split), byte fallback, [INST] special tokens, BOS."""
    tok = HFTokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=split)
    tok.decoder = (decoders.Sequence([decoders.Metaspace(replacement="▁", prepend_scheme=scheme),
                                      decoders.ByteFallback(), decoders.Fuse()])
                   if metaspace_decoder else _sentencepiece_decoder())
    _train(tok, 400, ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], limit_alphabet=60)
    tok = _with_byte_tokens(tok)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def unknown_chars(fuse_unk: bool) -> HFTokenizer:
    """No byte fallback: characters outside a 40-letter alphabet become <unk> (fused or one each)."""
    tok = HFTokenizer(models.BPE(unk_token="<unk>", fuse_unk=fuse_unk))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    _train(tok, 200, ["<unk>"], limit_alphabet=40)
    return tok


def affixes() -> HFTokenizer:
    """A BPE model with continuing_subword_prefix '##' and end_of_word_suffix '</w>' (checked on encode only)."""
    tok = HFTokenizer(models.BPE(unk_token="<unk>", continuing_subword_prefix="##", end_of_word_suffix="</w>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    _train(tok, 300, ["<unk>"], continuing_subword_prefix="##", end_of_word_suffix="</w>")
    return tok


def spec_of(tok: HFTokenizer) -> dict:
    """The tokenizer.json object."""
    return json.loads(tok.to_str())
