"""Hugging Face tokenizer.json in pure Python: encode, decode and streaming decode for generative models.

A served model ships its tokenizer as tokenizer.json; reading it here keeps the Rust `tokenizers` package out of the
server's dependencies (tests cross-check against it). Encoding runs the library's pipeline: added tokens are cut out
first (those with ``normalized: false`` from the raw text, the others after normalization, leftmost-longest), the
rest is normalized, pre-tokenized and given to the BPE model, and the post-processor adds BOS/EOS. Decoding maps ids
to token strings (dropping special added tokens on request) and runs the decoder chain.

Supported: BPE with the ByteLevel pre-tokenizer/decoder (GPT-2, Llama 3, Qwen: Split regex + ByteLevel) and BPE with
Metaspace or the SentencePiece-style normalizer plus byte fallback (Llama 2, Mistral). tokenizer_config.json supplies
``bos_token``, ``eos_token``, ``chat_template`` and ``add_bos_token`` / ``add_eos_token``, which, when present, decide
whether BOS / EOS are added whatever the post-processor says (as transformers' Llama tokenizer does). Decoded text is
what `tokenizers` returns; transformers' optional ``clean_up_tokenization_spaces`` is not applied.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine_core.generate.bpe import BPE
from engine_core.generate.tokenizer_error import TokenizerError
from engine_core.generate.tokenizer_parts import (
    Decoder,
    Normalizer,
    Piece,
    PreTokenizer,
    Template,
    decoder_from_json,
    normalizer_from_json,
    post_processor_from_json,
    pre_tokenizer_from_json,
)

__all__ = ["AddedToken", "DecodeStream", "Tokenizer", "TokenizerError"]


@dataclass(frozen=True)
class AddedToken:
    """One entry of tokenizer.json's ``added_tokens``."""

    id: int
    content: str
    special: bool = False
    normalized: bool = True
    lstrip: bool = False
    rstrip: bool = False
    single_word: bool = False

    @classmethod
    def from_json(cls, spec: Any, path: str) -> AddedToken:
        if not isinstance(spec, dict) or not isinstance(spec.get("id"), int) or not spec.get("content"):
            raise TokenizerError(f"{path}: expected an object with an int 'id' and a 'content'")
        return cls(spec["id"], spec["content"], bool(spec.get("special", False)),
                   bool(spec.get("normalized", not spec.get("special", False))), bool(spec.get("lstrip", False)),
                   bool(spec.get("rstrip", False)), bool(spec.get("single_word", False)))


def _is_word_char(c: str) -> bool:
    return c.isalnum() or c == "_"


class _AddedTokenSplitter:
    """Cuts added tokens out of a text, leftmost-longest, with their lstrip / rstrip / single_word options."""

    def __init__(self, tokens: Mapping[str, AddedToken]) -> None:
        self._tokens = dict(tokens)
        alternatives = sorted(self._tokens, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, alternatives))) if alternatives else None

    def _accepts(self, token: AddedToken, text: str, start: int, stop: int) -> bool:
        if not token.single_word:
            return True
        return (start == 0 or not _is_word_char(text[start - 1])) and (
            stop == len(text) or not _is_word_char(text[stop]))

    def split(self, text: str, first: bool) -> list[tuple[str, AddedToken | None, bool]]:
        """(text, None, starts the input) for the text between tokens, (content, token, False) for a token."""
        if self._pattern is None:
            return [(text, None, first)] if text else []
        out: list[tuple[str, AddedToken | None, bool]] = []
        done = 0
        for match in self._pattern.finditer(text):
            start, stop = match.span()
            token = self._tokens[match.group()]
            if start < done or not self._accepts(token, text, start, stop):
                continue
            if token.lstrip:
                start = max(len(text[:start].rstrip()), done)
            if token.rstrip:
                stop = len(text) - len(text[stop:].lstrip())
            if start > done:
                out.append((text[done:start], None, first and done == 0))
            out.append((text[start:stop], token, False))
            done = stop
        if done < len(text):
            out.append((text[done:], None, first and done == 0))
        return out


def _config_token(config: Mapping[str, Any], key: str) -> str | None:
    """A token of tokenizer_config.json: a string or an AddedToken object with its ``content``."""
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise TokenizerError(f"tokenizer_config.{key}: expected a string or an object with 'content'")
    return value


def _config_chat_template(config: Mapping[str, Any]) -> str | None:
    """``chat_template``: one string, or a list of named templates (the one named 'default', else the first)."""
    value = config.get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default", next(iter(named.values()), None))
    if value is not None and not isinstance(value, str):
        raise TokenizerError("tokenizer_config.chat_template: expected a string or a list of {name, template}")
    return value


def _toggle(ids: tuple[int, ...], token: int | None, wanted: Any, at_start: bool) -> tuple[int, ...]:
    """Add or drop `token` at one end of a template's ids as add_bos_token / add_eos_token ask (None: leave)."""
    if wanted is None or token is None:
        return ids
    present = bool(ids) and (ids[0] if at_start else ids[-1]) == token
    if wanted and not present:
        return (token, *ids) if at_start else (*ids, token)
    if not wanted and present:
        return ids[1:] if at_start else ids[:-1]
    return ids


class Tokenizer:
    """Encode and decode text as the model's tokenizer.json does (see the module docstring for what is read)."""

    def __init__(self, model: BPE, *, added_tokens: Sequence[AddedToken] = (), normalizer: Normalizer | None = None,
                 pre_tokenizer: PreTokenizer | None = None, decoder: Decoder | None = None,
                 template: Template = Template(), config: Mapping[str, Any] | None = None) -> None:
        config = dict(config or {})
        self._model = model
        self._normalizer = normalizer
        self._pre_tokenizer = pre_tokenizer
        self._decoder = decoder
        self._added = {t.id: t for t in added_tokens}
        self._added_ids = {t.content: t.id for t in added_tokens}
        # decode spells a normalized added token as normalized, so that the decoder undoes the normalizer
        self._added_strings = {t.id: normalizer(t.content) if normalizer and t.normalized else t.content
                               for t in added_tokens}
        self._special_strings = {t.content for t in added_tokens if t.special}
        self._raw_splitter = _AddedTokenSplitter({t.content: t for t in added_tokens if not t.normalized})
        self._normalized_splitter = _AddedTokenSplitter(
            {(normalizer(t.content) if normalizer else t.content): t for t in added_tokens if t.normalized})
        self.vocab_size = 1 + max([*model.vocab.values(), *self._added, -1])
        self.bos_token = _config_token(config, "bos_token") or next(iter(template.before_tokens), None)
        self.eos_token = _config_token(config, "eos_token")
        self.bos_token_id = self.token_id(self.bos_token) if self.bos_token is not None else None
        eos_id = self.token_id(self.eos_token) if self.eos_token is not None else None
        self.eos_token_ids: frozenset[int] = frozenset() if eos_id is None else frozenset({eos_id})
        self.chat_template = _config_chat_template(config)
        self._template = replace(template, before=_toggle(template.before, self.bos_token_id,
                                                          config.get("add_bos_token"), at_start=True),
                                 after=_toggle(template.after, eos_id, config.get("add_eos_token"), at_start=False))

    @classmethod
    def from_json(cls, tokenizer_json: Mapping[str, Any], config: Mapping[str, Any] | None = None) -> Tokenizer:
        """A tokenizer from tokenizer.json's parsed object (and tokenizer_config.json's)."""
        if not isinstance(tokenizer_json, Mapping) or not isinstance(tokenizer_json.get("model"), dict):
            raise TokenizerError("tokenizer.json: expected an object with a 'model'")
        try:
            added = [AddedToken.from_json(t, f"added_tokens[{i}]")
                     for i, t in enumerate(tokenizer_json.get("added_tokens") or [])]
            return cls(BPE.from_json(tokenizer_json["model"]), added_tokens=added,
                       normalizer=normalizer_from_json(tokenizer_json.get("normalizer")),
                       pre_tokenizer=pre_tokenizer_from_json(tokenizer_json.get("pre_tokenizer")),
                       decoder=decoder_from_json(tokenizer_json.get("decoder")),
                       template=post_processor_from_json(tokenizer_json.get("post_processor")), config=config)
        except TokenizerError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a field missing or of the wrong type
            raise TokenizerError(f"tokenizer.json is malformed: {type(exc).__name__}: {exc}") from exc

    @classmethod
    def from_directory(cls, directory: Path) -> Tokenizer:
        """tokenizer.json, with tokenizer_config.json and chat_template.jinja when the directory has them."""
        directory = Path(directory)
        tokenizer_json = _read_json(directory / "tokenizer.json")
        config_path = directory / "tokenizer_config.json"
        config = _read_json(config_path) if config_path.is_file() else {}
        template_path = directory / "chat_template.jinja"
        if template_path.is_file():
            config["chat_template"] = template_path.read_text(encoding="utf-8")
        return cls.from_json(tokenizer_json, config)

    def token_id(self, token: str) -> int | None:
        """The id of one token's string (an added token's content or a vocabulary entry)."""
        added = self._added_ids.get(token)
        return added if added is not None else self._model.vocab.get(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text`; `add_special_tokens` adds what the post-processor adds (BOS for Llama)."""
        ids: list[int] = []
        for segment, token, first in self._raw_splitter.split(text, True):
            if token is not None:
                ids.append(token.id)
                continue
            normalized = self._normalizer(segment) if self._normalizer else segment
            for piece, inner, piece_first in self._normalized_splitter.split(normalized, first):
                if inner is not None:
                    ids.append(inner.id)
                else:
                    ids.extend(self._encode_piece((piece, piece_first)))
        if add_special_tokens:
            return [*self._template.before, *ids, *self._template.after]
        return ids

    def _encode_piece(self, piece: Piece) -> list[int]:
        words = self._pre_tokenizer([piece]) if self._pre_tokenizer else [piece]
        return [i for word, _ in words for i in self._model.tokenize(word)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`; unknown ids are skipped, special added tokens too when `skip_special_tokens`."""
        tokens: list[str] = []
        for i in ids:
            token = self._added_strings.get(i)
            if token is None:
                token = self._model.id_to_token.get(i)
            if token is not None and not (skip_special_tokens and token in self._special_strings):
                tokens.append(token)
        if self._decoder is None:
            return " ".join(tokens)
        return "".join(self._decoder(tokens))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise TokenizerError(f"{path}: missing") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path}: not readable JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return value


class DecodeStream:
    """Incremental detokenization: `push` returns the text each new token completes, so that the pushes' texts
    joined equal `decode` of all the ids.

    The Rust library's algorithm: decode a short window of recent ids and emit what it adds to the window's previous
    text, once that no longer ends in U+FFFD (a UTF-8 character split over tokens, or byte-fallback bytes still
    coming). The window keeps the tokens of the last emission as context, so a first-token rule (Metaspace dropping
    the leading space, Strip) applies to the same token in both decodes. `flush` returns what is still held back.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = ""
        self._prefix_index = 0

    def push(self, token_id: int) -> str:
        """The new complete text after `token_id` ("" while it is incomplete)."""
        self._ids.append(int(token_id))
        text = self._tokenizer.decode(self._ids, self._skip)
        if len(text) <= len(self._prefix) or text.endswith("\ufffd"):
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """What the ids so far add but `push` held back (U+FFFD for bytes that never completed a character)."""
        text = self._tokenizer.decode(self._ids, self._skip)
        return self._advance(text) if len(text) > len(self._prefix) else ""

    def _advance(self, text: str) -> str:
        new_text = text[len(self._prefix):] if text.startswith(self._prefix) else text[_common(text, self._prefix):]
        next_index = len(self._ids) - self._prefix_index
        self._ids = self._ids[self._prefix_index:]
        self._prefix = self._tokenizer.decode(self._ids, self._skip)
        self._prefix_index = next_index
        return new_text


def _common(a: str, b: str) -> int:
    """The length of the common prefix (a window's text that no longer extends the last one: emit from there)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
