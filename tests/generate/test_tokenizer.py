"""Kiln's pure-Python tokenizer against Hugging Face `tokenizers` on the same tokenizer.json files.

Each family (GPT-2 byte-level, Llama 3 split regex + byte-level, Llama 2 normalizer + byte fallback, Mistral
Metaspace) is trained tiny in tokenizer_files.py; encode, decode and streaming decode must match the library on text
with Unicode, emoji, whitespace runs, numbers and special tokens.
"""

from __future__ import annotations

import json
import random
import unicodedata
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")

from tokenizers import AddedToken as HFAddedToken  # noqa: E402
from tokenizers import Regex, pre_tokenizers  # noqa: E402

from engine_core.generate.tokenizer import DecodeStream, Tokenizer, TokenizerError  # noqa: E402
from engine_core.generate.tokenizer_parts import pre_tokenizer_from_json  # noqa: E402
from tests.generate import tokenizer_files as files  # noqa: E402

TEXTS = [
    *files.CORPUS[:5], "", " ", "  ", "\n", "\n\n\n", " \t \n  x", "hello   world    ", "a\r\n\r\nb",
    "It'S THE 'LL 'Re", "1234567890 0.5 -42 1e10 ١٢٣ ⅷ ²³", "😀😀😀 👨‍👩‍👧‍👦 🇫🇷", "\u00e9 e\u0301 ñ ﬁ Å", "Ωmega ΣΣ ǅ",
    "<|endoftext|>hi<|im_start|>user\nyo<|im_end|>", "<s>[INST] hi [/INST] there</s>", "a<s>b </s> c",
    "tab\tsep\tvalues\t", "x" * 300, "mixed中文and English123abc", "\u200b\u2028\u3000 ideographic space",
    "\x1c\x1d\x1e\x1f separators", "¡Hola! ¿Qué tal?", "  leading and trailing  ", "\u0085next line",
    "$100 & 50% off #1 @user ~tilde `code`", "<|begin_of_text|>x<|eot_id|>", "don't DON'T Don'T ſ K",
]

FAMILIES = {
    "gpt2": files.gpt2,
    "gpt2_prefix_space": lambda: files.gpt2(add_prefix_space=True),
    "llama3": files.llama3,
    "qwen": lambda: files.llama3(files.QWEN_PATTERN),
    "llama2": files.llama2,
    "mistral": files.mistral,
    "metaspace_always_split": lambda: files.mistral("always", split=True, metaspace_decoder=True),
    "metaspace_first_split": lambda: files.mistral("first", split=True, metaspace_decoder=True),
    "unk_fused": lambda: files.unknown_chars(fuse_unk=True),
    "unk_each": lambda: files.unknown_chars(fuse_unk=False),
}
BYTE_LEVEL = ("gpt2", "gpt2_prefix_space", "llama3", "qwen")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request: pytest.FixtureRequest):
    """(name, Hugging Face tokenizer, Kiln tokenizer) for one family."""
    hf = FAMILIES[request.param]()
    return request.param, hf, Tokenizer.from_json(files.spec_of(hf))


def _random_text(rng: random.Random, pool: list[str]) -> str:
    return "".join(rng.choice(pool) for _ in range(rng.randrange(1, 24)))


@pytest.fixture(scope="module")
def unicode_pool() -> list[str]:
    """Assigned code points of the BMP and plane 1 (both libraries agree on those), plus ASCII and whitespace."""
    assigned = [chr(c) for c in range(0x20000) if unicodedata.category(chr(c)) not in ("Cn", "Cs", "Co")]
    return assigned + list(" \t\n\r'sStT0123456789/ ") * 200


def test_encode_matches_tokenizers(pair) -> None:
    _, hf, ours = pair
    for text in TEXTS:
        for add_special in (True, False):
            assert ours.encode(text, add_special) == hf.encode(text, add_special_tokens=add_special).ids, text


def test_decode_matches_tokenizers(pair) -> None:
    _, hf, ours = pair
    for text in TEXTS:
        ids = hf.encode(text).ids
        for skip in (True, False):
            assert ours.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip), text


def test_decode_of_random_ids_matches_tokenizers(pair) -> None:
    """Any id sequence, invalid UTF-8 and unknown ids included, decodes as the library decodes it."""
    _, hf, ours = pair
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(ours.vocab_size + 2) for _ in range(rng.randrange(1, 12))]
        for skip in (True, False):
            assert ours.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip), ids


def test_random_unicode_encodes_as_tokenizers(pair, unicode_pool: list[str]) -> None:
    """The translated \\p{..} classes and the normalizers agree with the library over all of Unicode."""
    _, hf, ours = pair
    rng = random.Random(1)
    for _ in range(300):
        text = _random_text(rng, unicode_pool)
        assert ours.encode(text) == hf.encode(text).ids, [hex(ord(c)) for c in text]


def _stream(tokenizer: Tokenizer, ids: list[int], skip: bool = True) -> list[str]:
    stream = DecodeStream(tokenizer, skip)
    return [stream.push(i) for i in ids] + [stream.flush()]


def test_stream_joins_to_decode(pair) -> None:
    """Streaming the encoding of real text (whole texts, and texts run together) gives decode's text."""
    _, _, ours = pair
    rng = random.Random(2)
    encodings = [ours.encode(t) for t in TEXTS]
    runs = [sum(rng.sample(encodings, 3), []) for _ in range(30)]
    for ids in encodings + runs:
        for skip in (True, False):
            assert "".join(_stream(ours, ids, skip)) == ours.decode(ids, skip), ids


def test_stream_matches_tokenizers_decode_stream(pair) -> None:
    """Chunk by chunk what the library's own DecodeStream emits, on arbitrary ids of the byte-level families
    (byte-fallback families are compared on real text: there the library errors on some invalid byte runs)."""
    name, hf, ours = pair
    decode_stream = pytest.importorskip("tokenizers.decoders").__dict__.get("DecodeStream")
    if decode_stream is None:
        pytest.skip("tokenizers has no DecodeStream")
    rng = random.Random(3)
    if name in BYTE_LEVEL:
        sequences = [[rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 12))] for _ in range(200)]
    else:
        sequences = [ours.encode(t) for t in TEXTS]
    for ids in sequences:
        theirs = decode_stream(skip_special_tokens=True)
        assert _stream(ours, ids)[:-1] == [theirs.step(hf, i) or "" for i in ids], ids


def test_stream_holds_back_incomplete_characters() -> None:
    """An emoji split over byte tokens comes out whole, with the token that completes it."""
    for hf in (files.gpt2(), files.llama2()):
        ours = Tokenizer.from_json(files.spec_of(hf))
        ids = ours.encode("a🎉", add_special_tokens=False)
        pieces = _stream(ours, ids)
        assert len(ids) > 2 and "".join(pieces) == ours.decode(ids)
        assert "🎉" in pieces and "\ufffd" not in "".join(pieces)


def test_stream_flush_returns_bytes_that_never_complete() -> None:
    ours = Tokenizer.from_json(files.spec_of(files.gpt2()))
    first_byte = ours.token_id("ð")  # byte 0xF0 in the ByteLevel alphabet: the lead byte of a 4-byte character
    assert first_byte is not None
    stream = DecodeStream(ours)
    assert stream.push(ours.token_id("a")) == "a"
    assert stream.push(first_byte) == ""
    assert stream.flush() == "\ufffd"


def test_stream_keeps_metaspace_spaces() -> None:
    """The first token loses its '▁' (the prepended space), the later ones keep theirs."""
    for hf in (files.llama2(), files.mistral("always", split=True, metaspace_decoder=True)):
        ours = Tokenizer.from_json(files.spec_of(hf))
        ids = ours.encode("Hello world  again")
        pieces = _stream(ours, ids)
        assert "".join(pieces) == "Hello world  again"
        assert [p for p in pieces if p][0].startswith("H")


@pytest.mark.parametrize("behavior", ["removed", "isolated", "merged_with_previous", "merged_with_next",
                                      "contiguous"])
@pytest.mark.parametrize("invert", [False, True])
def test_split_behaviors_match_tokenizers(behavior: str, invert: bool) -> None:
    names = {"removed": "Removed", "isolated": "Isolated", "merged_with_previous": "MergedWithPrevious",
             "merged_with_next": "MergedWithNext", "contiguous": "Contiguous"}
    hf = pre_tokenizers.Split(Regex(r"\s+|\d"), behavior=behavior, invert=invert)
    ours = pre_tokenizer_from_json({"type": "Split", "pattern": {"Regex": r"\s+|\d"}, "behavior": names[behavior],
                                    "invert": invert})
    assert ours is not None
    for text in TEXTS:
        assert [p for p, _ in ours([(text, True)])] == [p for p, _ in hf.pre_tokenize_str(text)], text


def test_gpt4o_split_pattern_matches_tokenizers(unicode_pool: list[str]) -> None:
    """o200k's pattern (\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M} inside classes) splits as Oniguruma splits it."""
    hf = pre_tokenizers.Split(Regex(files.O200K_PATTERN), behavior="isolated")
    ours = pre_tokenizer_from_json({"type": "Split", "pattern": {"Regex": files.O200K_PATTERN},
                                    "behavior": "Isolated", "invert": False})
    assert ours is not None
    rng = random.Random(4)
    for text in TEXTS + [_random_text(rng, unicode_pool) for _ in range(300)]:
        assert [p for p, _ in ours([(text, True)])] == [p for p, _ in hf.pre_tokenize_str(text)], text


def test_added_token_options_match_tokenizers() -> None:
    """lstrip / rstrip / single_word and normalized (non-special) added tokens."""
    hf = files.gpt2()
    hf.add_tokens([HFAddedToken("<mask>", lstrip=True, special=True, normalized=False),
                   HFAddedToken("brown fox", normalized=True), HFAddedToken("[R]", rstrip=True, normalized=False),
                   HFAddedToken("cat", single_word=True)])
    ours = Tokenizer.from_json(files.spec_of(hf))
    for text in TEXTS + ["a <mask> b  <mask>c", "the brown fox brown foxes", "[R]   x [R]y", "cat concat cats cat."]:
        assert ours.encode(text) == hf.encode(text).ids, text
        ids = hf.encode(text).ids
        assert ours.decode(ids, False) == hf.decode(ids, skip_special_tokens=False), text


def test_bpe_affixes_encode_as_tokenizers() -> None:
    hf = files.affixes()
    ours = Tokenizer.from_json(files.spec_of(hf))
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text).ids, text


def test_special_tokens_and_ids() -> None:
    ours = Tokenizer.from_json(files.spec_of(files.llama3()),
                               {"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|eot_id|>"}})
    assert ours.bos_token_id == ours.token_id("<|begin_of_text|>") == 0
    assert ours.eos_token_ids == frozenset({ours.token_id("<|eot_id|>")})
    ids = ours.encode("<|start_header_id|>user<|end_header_id|>hi<|eot_id|>")
    assert ids[:2] == [0, ours.token_id("<|start_header_id|>")] and ids[-1] == ours.token_id("<|eot_id|>")
    assert ours.decode(ids) == "userhi"
    assert ours.decode(ids, skip_special_tokens=False) == "<|begin_of_text|><|start_header_id|>user<|end_header_id|>hi<|eot_id|>"
    assert ours.vocab_size == len(files.spec_of(files.llama3())["model"]["vocab"])


def test_bos_comes_from_the_template_without_a_config() -> None:
    ours = Tokenizer.from_json(files.spec_of(files.llama2()))
    assert ours.bos_token == "<s>" and ours.bos_token_id == 1 and ours.eos_token_ids == frozenset()
    assert ours.encode("hi")[0] == 1 and ours.encode("hi", add_special_tokens=False)[0] != 1


def test_add_bos_token_in_the_config_overrides_the_template() -> None:
    spec = files.spec_of(files.llama2())
    assert Tokenizer.from_json(spec, {"add_bos_token": False}).encode("hi")[0] != 1
    no_template = dict(spec, post_processor=None)
    assert Tokenizer.from_json(no_template).encode("hi")[0] != 1
    with_bos = Tokenizer.from_json(no_template, {"bos_token": "<s>", "add_bos_token": True, "eos_token": "</s>",
                                                 "add_eos_token": True})
    assert with_bos.encode("hi")[0] == 1 and with_bos.encode("hi")[-1] == 2


def test_from_directory_reads_the_config_and_chat_template(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text(files.gpt2().to_str(), encoding="utf-8")
    config = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
              "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = Tokenizer.from_directory(tmp_path)
    assert ours.chat_template == "D" and ours.bos_token == "<|endoftext|>" and ours.eos_token == "<|im_end|>"
    assert ours.eos_token_ids == frozenset({2}) and ours.encode("<|im_end|>") == [2]
    (tmp_path / "chat_template.jinja").write_text("J")
    assert Tokenizer.from_directory(tmp_path).chat_template == "J"


def test_from_directory_without_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_directory(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="JSON"):
        Tokenizer.from_directory(tmp_path)


@pytest.mark.parametrize("field, value, message", [
    ("model", {"type": "Unigram", "vocab": []}, "model.type: 'Unigram'"),
    ("model", {"type": "BPE", "dropout": 0.1, "vocab": {}, "merges": []}, "model.dropout"),
    ("model", {"type": "BPE", "vocab": {"a": 0}, "merges": ["a b"]}, r"model.merges\[0\]"),
    ("pre_tokenizer", {"type": "Whitespace"}, "pre_tokenizer.type: 'Whitespace'"),
    ("pre_tokenizer", {"type": "Sequence", "pretokenizers": [{"type": "ByteLevel"}, {"type": "Digits"}]},
     r"pre_tokenizer.pretokenizers\[1\].type: 'Digits'"),
    ("pre_tokenizer", {"type": "Split", "pattern": {"Regex": "[[:alpha:]]"}, "behavior": "Isolated"}, "POSIX"),
    ("pre_tokenizer", {"type": "Split", "pattern": {"Regex": r"\p{Greek}"}, "behavior": "Isolated"}, "Greek"),
    ("pre_tokenizer", {"type": "Split", "pattern": {"String": " "}, "behavior": "Sideways"}, "Sideways"),
    ("normalizer", {"type": "BertNormalizer"}, "normalizer.type: 'BertNormalizer'"),
    ("decoder", {"type": "WordPiece"}, "decoder.type: 'WordPiece'"),
    ("post_processor", {"type": "RobertaProcessing"}, "post_processor.type: 'RobertaProcessing'"),
    ("decoder", {"type": "Sequence"}, "malformed: KeyError"),
])
def test_unsupported_fields_are_named(field: str, value: dict, message: str) -> None:
    spec = dict(files.spec_of(files.gpt2()), **{field: value})
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_json(spec)


def test_the_example_decoders_tokenizer_matches_tokenizers() -> None:
    """examples/generative.py's tokenizer.json (what the tiny decoder serves) reads the same in both."""
    from tokenizers import Tokenizer as HFTokenizer

    from tests.generate.conftest import generative

    spec = generative.tokenizer_json()
    hf, ours = HFTokenizer.from_str(json.dumps(spec)), Tokenizer.from_json(spec)
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text).ids, text
        ids = hf.encode(text).ids
        assert ours.decode(ids) == hf.decode(ids), text
