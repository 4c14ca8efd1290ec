"""The steps of a tokenizer.json pipeline around the model: normalizers, pre-tokenizers, decoders, post-processors.

Each ``*_from_json`` turns one object of tokenizer.json into a plain callable and raises `TokenizerError` naming the
field (``pre_tokenizer.pretokenizers[1].type``) for anything it does not support. Semantics follow the Rust library:

- a normalizer maps the text between added tokens (`Normalizer`);
- a pre-tokenizer maps pieces to pieces; a piece is its text and whether it starts the input (Metaspace's
  ``prepend_scheme: first`` asks), and empty pieces are dropped after every split, as the library does;
- a decoder maps the tokens' strings to strings, which are then joined (`Decoder`);
- the post-processor of a single sequence is the ids it puts before and after it (`Template`).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from engine_core.generate.onig_regex import compile_onig
from engine_core.generate.tokenizer_error import TokenizerError

Piece = tuple[str, bool]  # (text, starts the input)
Normalizer = Callable[[str], str]
PreTokenizer = Callable[[list[Piece]], list[Piece]]
Decoder = Callable[[list[str]], list[str]]

#: GPT-2's split, which ByteLevel(use_regex=true) applies.
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the ByteLevel alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_TO_CHAR = _bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}
_LATIN1_TO_BYTE_CHARS = str.maketrans({chr(b): c for b, c in BYTE_TO_CHAR.items()})


def _kind(spec: Any, path: str) -> str:
    if not isinstance(spec, dict) or not isinstance(spec.get("type"), str):
        raise TokenizerError(f"{path}: expected an object with a 'type'")
    return spec["type"]


def _unsupported(spec: dict[str, Any], path: str) -> TokenizerError:
    return TokenizerError(f"{path}.type: {spec['type']!r} is not supported")


def _pattern(spec: Any, path: str) -> re.Pattern[str]:
    """A Split/Replace ``pattern``: {"String": literal} or {"Regex": oniguruma}."""
    if isinstance(spec, dict) and isinstance(spec.get("String"), str):
        return re.compile(re.escape(spec["String"]))
    if isinstance(spec, dict) and isinstance(spec.get("Regex"), str):
        return compile_onig(spec["Regex"])
    raise TokenizerError(f"{path}: expected {{'String': ...}} or {{'Regex': ...}}")


# ---- normalizers ---------------------------------------------------------------------------------------------------


def _replace(pattern: re.Pattern[str], content: str) -> Callable[[str], str]:
    return lambda text: pattern.sub(lambda _: content, text)


def _chain(steps: Sequence[Callable[[Any], Any]]) -> Callable[[Any], Any]:
    def run(value: Any) -> Any:
        for step in steps:
            value = step(value)
        return value

    return run


_UNICODE_FORMS: dict[str, Normalizer] = {
    "NFC": lambda text: unicodedata.normalize("NFC", text), "NFD": lambda text: unicodedata.normalize("NFD", text),
    "NFKC": lambda text: unicodedata.normalize("NFKC", text), "NFKD": lambda text: unicodedata.normalize("NFKD", text),
}


def _strip_normalizer(left: bool, right: bool) -> Normalizer:
    def strip(text: str) -> str:
        text = text.lstrip() if left else text
        return text.rstrip() if right else text

    return strip


def normalizer_from_json(spec: Any, path: str = "normalizer") -> Normalizer | None:
    """tokenizer.json's ``normalizer`` (None: the text stays as it is)."""
    if spec is None:
        return None
    kind = _kind(spec, path)
    if kind == "Sequence":
        steps = [normalizer_from_json(s, f"{path}.normalizers[{i}]") for i, s in enumerate(spec["normalizers"])]
        return _chain([s for s in steps if s is not None])
    if kind == "Prepend":
        prefix = spec["prepend"]
        return lambda text: prefix + text if text else text
    if kind == "Replace":
        return _replace(_pattern(spec.get("pattern"), f"{path}.pattern"), spec["content"])
    if kind in _UNICODE_FORMS:
        return _UNICODE_FORMS[kind]
    if kind == "Lowercase":  # per character, as the library does (no final-sigma rule)
        return lambda text: "".join(c.lower() for c in text)
    if kind == "Strip":
        return _strip_normalizer(bool(spec.get("strip_left", True)), bool(spec.get("strip_right", True)))
    raise _unsupported(spec, path)


# ---- pre-tokenizers ------------------------------------------------------------------------------------------------


def _find(pattern: re.Pattern[str], text: str) -> list[tuple[int, int, bool]]:
    """The text cut into (start, end, is_match) spans covering all of it."""
    spans, prev = [], 0
    for m in pattern.finditer(text):
        if m.start() != prev:
            spans.append((prev, m.start(), False))
        spans.append((m.start(), m.end(), True))
        prev = m.end()
    if prev != len(text):
        spans.append((prev, len(text), False))
    return spans


def _merge_matches(spans: list[tuple[int, int, bool]], into_previous: bool) -> list[tuple[int, int]]:
    """MergedWithPrevious (a match joins the piece before it) or MergedWithNext (read backwards)."""
    ordered = spans if into_previous else spans[::-1]
    out: list[list[int]] = []
    previous_match = False
    for start, end, is_match in ordered:
        if is_match and not previous_match and out:
            if into_previous:
                out[-1][1] = end
            else:
                out[-1][0] = start
        else:
            out.append([start, end])
        previous_match = is_match
    return [(s, e) for s, e in (out if into_previous else out[::-1])]


def _contiguous(spans: list[tuple[int, int, bool]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    previous_match = False
    for start, end, is_match in spans:
        if is_match == previous_match and out:
            out[-1][1] = end
        else:
            out.append([start, end])
        previous_match = is_match
    return [(s, e) for s, e in out]


def split_text(text: str, pattern: re.Pattern[str], behavior: str, invert: bool = False) -> list[tuple[int, int]]:
    """Hugging Face's ``NormalizedString::split``: the (start, end) of each piece, empty ones included."""
    spans = [(s, e, m != invert) for s, e, m in _find(pattern, text)]
    if behavior == "Isolated":
        return [(s, e) for s, e, _ in spans]
    if behavior == "Removed":
        return [(s, e) for s, e, m in spans if not m]
    if behavior in ("MergedWithPrevious", "MergedWithNext"):
        return _merge_matches(spans, behavior == "MergedWithPrevious")
    if behavior == "Contiguous":
        return _contiguous(spans)
    raise TokenizerError(f"split behavior {behavior!r} is not supported")


def _split_pieces(pieces: list[Piece], pattern: re.Pattern[str], behavior: str, invert: bool = False) -> list[Piece]:
    out: list[Piece] = []
    for text, first in pieces:
        out.extend((text[s:e], first and s == 0) for s, e in split_text(text, pattern, behavior, invert) if e > s)
    return out


def byte_level_chars(text: str) -> str:
    """The ByteLevel alphabet's spelling of `text`'s UTF-8 bytes."""
    return text.encode().decode("latin-1").translate(_LATIN1_TO_BYTE_CHARS)


def _byte_level(spec: dict[str, Any]) -> PreTokenizer:
    add_prefix_space = bool(spec.get("add_prefix_space", True))
    split = compile_onig(GPT2_PATTERN) if spec.get("use_regex", True) else None

    def run(pieces: list[Piece]) -> list[Piece]:
        if add_prefix_space:
            pieces = [(text if text.startswith(" ") else " " + text, first) for text, first in pieces]
        if split is not None:
            pieces = _split_pieces(pieces, split, "Isolated")
        return [(byte_level_chars(text), first) for text, first in pieces if text]

    return run


def _metaspace_scheme(spec: dict[str, Any]) -> str:
    if "prepend_scheme" in spec:
        return str(spec["prepend_scheme"])
    return "always" if spec.get("add_prefix_space", True) else "never"


def _metaspace(spec: dict[str, Any], path: str) -> PreTokenizer:
    replacement = spec.get("replacement", "▁")
    scheme, split = _metaspace_scheme(spec), bool(spec.get("split", True))
    if scheme not in ("always", "first", "never"):
        raise TokenizerError(f"{path}.prepend_scheme: {scheme!r} is not supported")
    on_replacement = re.compile(re.escape(replacement))

    def run(pieces: list[Piece]) -> list[Piece]:
        out: list[Piece] = []
        for text, first in pieces:
            text = text.replace(" ", replacement)
            if not text.startswith(replacement) and (scheme == "always" or (scheme == "first" and first)):
                text = replacement + text
            out.append((text, first))
        return _split_pieces(out, on_replacement, "MergedWithNext") if split else [p for p in out if p[0]]

    return run


def pre_tokenizer_from_json(spec: Any, path: str = "pre_tokenizer") -> PreTokenizer | None:
    """tokenizer.json's ``pre_tokenizer`` (None: each piece is one word)."""
    if spec is None:
        return None
    kind = _kind(spec, path)
    if kind == "Sequence":
        steps = [pre_tokenizer_from_json(s, f"{path}.pretokenizers[{i}]") for i, s in enumerate(spec["pretokenizers"])]
        return _chain([s for s in steps if s is not None])
    if kind == "ByteLevel":
        return _byte_level(spec)
    if kind == "Split":
        pattern = _pattern(spec.get("pattern"), f"{path}.pattern")
        behavior, invert = spec.get("behavior", "Isolated"), bool(spec.get("invert", False))
        split_text("", pattern, behavior)  # refuses an unknown behavior now, not at the first encode
        return lambda pieces: _split_pieces(pieces, pattern, behavior, invert)
    if kind == "Metaspace":
        return _metaspace(spec, path)
    raise _unsupported(spec, path)


# ---- decoders ------------------------------------------------------------------------------------------------------


def _byte_level_decode(tokens: list[str]) -> list[str]:
    """Tokens back to bytes, then UTF-8 with U+FFFD for what is invalid; a token outside the alphabet (an added token
    such as ``<|im_start|>`` spelled with a space) contributes its own UTF-8, as in the Rust library."""
    data = bytearray()
    for token in tokens:
        try:
            data.extend(bytes([CHAR_TO_BYTE[c] for c in token]))
        except KeyError:
            data.extend(token.encode())
    return [data.decode("utf-8", "replace")]


def _byte_fallback_token(token: str) -> int | None:
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return int(token[3:5], 16)
        except ValueError:
            return None
    return None


def _byte_fallback_decode(tokens: list[str]) -> list[str]:
    """<0xNN> runs back to text; a run that is not valid UTF-8 gives one U+FFFD per byte, as the library does."""
    out: list[str] = []
    run = bytearray()

    def flush() -> None:
        if run:
            try:
                out.append(run.decode("utf-8"))
            except UnicodeDecodeError:
                out.extend("\ufffd" for _ in run)
            run.clear()

    for token in tokens:
        byte = _byte_fallback_token(token)
        if byte is None:
            flush()
            out.append(token)
        else:
            run.append(byte)
    flush()
    return out


def _strip_decoder(content: str, start: int, stop: int) -> Decoder:
    def strip(token: str) -> str:
        lo = 0
        while lo < min(start, len(token)) and token[lo] == content:
            lo += 1
        hi = len(token)
        while len(token) - hi < stop and hi > lo and token[hi - 1] == content:
            hi -= 1
        return token[lo:hi]

    return lambda tokens: [strip(t) for t in tokens]


def _metaspace_decoder(spec: dict[str, Any]) -> Decoder:
    replacement, drop_first = spec.get("replacement", "▁"), _metaspace_scheme(spec) != "never"

    def run(tokens: list[str]) -> list[str]:
        out = [t.replace(replacement, " ") for t in tokens]
        if out and drop_first:
            out[0] = tokens[0].replace(replacement, "")
        return out

    return run


def decoder_from_json(spec: Any, path: str = "decoder") -> Decoder | None:
    """tokenizer.json's ``decoder`` (None: the tokens are joined with spaces, as the library does)."""
    if spec is None:
        return None
    kind = _kind(spec, path)
    if kind == "Sequence":
        steps = [decoder_from_json(s, f"{path}.decoders[{i}]") for i, s in enumerate(spec["decoders"])]
        return _chain([s for s in steps if s is not None])
    if kind == "ByteLevel":
        return _byte_level_decode
    if kind == "Metaspace":
        return _metaspace_decoder(spec)
    if kind == "Replace":
        replace = _replace(_pattern(spec.get("pattern"), f"{path}.pattern"), spec["content"])
        return lambda tokens: [replace(t) for t in tokens]
    if kind == "ByteFallback":
        return _byte_fallback_decode
    if kind == "Fuse":
        return lambda tokens: ["".join(tokens)]
    if kind == "Strip":
        return _strip_decoder(spec["content"], int(spec.get("start", 0)), int(spec.get("stop", 0)))
    raise _unsupported(spec, path)


# ---- post-processors -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Template:
    """What the post-processor adds around one sequence: ids (and their tokens) before and after it."""

    before: tuple[int, ...] = ()
    after: tuple[int, ...] = ()
    before_tokens: tuple[str, ...] = ()
    after_tokens: tuple[str, ...] = ()

    def then(self, outer: Template) -> Template:
        return Template(outer.before + self.before, self.after + outer.after,
                        outer.before_tokens + self.before_tokens, self.after_tokens + outer.after_tokens)


def _template_processing(spec: dict[str, Any], path: str) -> Template:
    specials = spec.get("special_tokens") or {}
    before: list[int] = []
    after: list[int] = []
    before_tokens: list[str] = []
    after_tokens: list[str] = []
    seen_sequence = False
    for i, item in enumerate(spec.get("single") or []):
        if "Sequence" in item:
            if item["Sequence"].get("id") != "A" or seen_sequence:
                raise TokenizerError(f"{path}.single[{i}]: only one sequence 'A' is supported")
            seen_sequence = True
        elif "SpecialToken" in item:
            name = item["SpecialToken"]["id"]
            if name not in specials:
                raise TokenizerError(f"{path}.single[{i}]: special token {name!r} is not in special_tokens")
            (after if seen_sequence else before).extend(int(x) for x in specials[name]["ids"])
            (after_tokens if seen_sequence else before_tokens).extend(specials[name]["tokens"])
        else:
            raise TokenizerError(f"{path}.single[{i}]: expected Sequence or SpecialToken")
    if not seen_sequence:
        raise TokenizerError(f"{path}.single: no sequence 'A'")
    return Template(tuple(before), tuple(after), tuple(before_tokens), tuple(after_tokens))


def post_processor_from_json(spec: Any, path: str = "post_processor") -> Template:
    """tokenizer.json's ``post_processor`` for single sequences (ByteLevel's offset trimming adds nothing)."""
    if spec is None:
        return Template()
    kind = _kind(spec, path)
    if kind == "ByteLevel":
        return Template()
    if kind == "TemplateProcessing":
        return _template_processing(spec, path)
    if kind == "Sequence":
        template = Template()
        for i, step in enumerate(spec["processors"]):
            template = template.then(post_processor_from_json(step, f"{path}.processors[{i}]"))
        return template
    raise _unsupported(spec, path)
