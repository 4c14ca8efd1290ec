"""tokenizer.json's regular expressions (Oniguruma syntax, as Hugging Face tokenizers compile them) for Python's `re`.

`re` has no Unicode property classes (``\\p{L}``, ``\\p{N}``, ...), and its ``\\s`` and ``\\w`` differ from
Oniguruma's (``\\s`` also matches U+001C..U+001F; ``\\w`` misses combining marks). The translation spells those
classes out as code point ranges taken from `unicodedata`, inside or outside a bracket class, negated or not, so the
GPT-2, Llama 3, Qwen and GPT-4o split patterns match what the Rust library matches. Oniguruma's Ruby syntax makes
``^`` and ``$`` line anchors, hence `re.MULTILINE`. The classes follow this Python's Unicode database, so characters
newer than it may class differently than in the Rust library. Constructs `re` cannot express (nested classes, ``&&``, POSIX
brackets) raise `TokenizerError`.
"""

from __future__ import annotations

import functools
import re
import unicodedata

from engine_core.generate.tokenizer_error import TokenizerError

_MAX_CODE_POINT = 0x10FFFF
Ranges = tuple[tuple[int, int], ...]

#: Unicode's White_Space property, which Oniguruma's \s matches.
_WHITE_SPACE: Ranges = ((0x09, 0x0D), (0x20, 0x20), (0x85, 0x85), (0xA0, 0xA0), (0x1680, 0x1680),
                        (0x2000, 0x200A), (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000))

#: Long property names tokenizer files may use, to their general categories.
_LONG_NAMES = {
    "letter": "L", "cased_letter": "LC", "uppercase_letter": "Lu", "lowercase_letter": "Ll",
    "titlecase_letter": "Lt", "modifier_letter": "Lm", "other_letter": "Lo", "mark": "M", "nonspacing_mark": "Mn",
    "spacing_mark": "Mc", "enclosing_mark": "Me", "number": "N", "decimal_number": "Nd", "letter_number": "Nl",
    "other_number": "No", "punctuation": "P", "symbol": "S", "separator": "Z", "other": "C", "control": "Cc",
    "format": "Cf", "space_separator": "Zs",
}


@functools.cache
def _general_categories() -> dict[str, Ranges]:
    """Two-letter general category -> its code point ranges (one pass over all code points, once a process)."""
    found: dict[str, list[tuple[int, int]]] = {}
    category = unicodedata.category
    start, current = 0, category(chr(0))
    for cp in range(1, _MAX_CODE_POINT + 1):
        c = category(chr(cp))
        if c != current:
            found.setdefault(current, []).append((start, cp - 1))
            start, current = cp, c
    found.setdefault(current, []).append((start, _MAX_CODE_POINT))
    return {name: tuple(ranges) for name, ranges in found.items()}


def _union(*parts: Ranges) -> Ranges:
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(r for part in parts for r in part):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return tuple(merged)


def _complement(ranges: Ranges) -> Ranges:
    out, nxt = [], 0
    for lo, hi in ranges:
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= _MAX_CODE_POINT:
        out.append((nxt, _MAX_CODE_POINT))
    return tuple(out)


@functools.cache
def property_ranges(name: str) -> Ranges:
    """The code points of Unicode property `name` (a general category: ``L``, ``Lu``, ``Letter``, ``LC``, ...)."""
    key = _LONG_NAMES.get(name.lower().replace(" ", "_"), name)
    categories = _general_categories()
    if key in ("LC", "L&"):
        return _union(*(categories.get(c, ()) for c in ("Lu", "Ll", "Lt")))
    if len(key) == 1 and key.isupper():
        parts = [ranges for cat, ranges in categories.items() if cat[0] == key]
        if parts:
            return _union(*parts)
    if len(key) == 2 and key[0].isupper() and key[1].islower() and key in categories:
        return categories[key]
    raise TokenizerError(f"regex property \\p{{{name}}} is not supported (general categories only)")


#: Other_Alphabetic symbols (circled and squared letters), which Oniguruma's \w counts as letters.
_ALPHABETIC_SYMBOLS: Ranges = ((0x24B6, 0x24E9), (0x1F130, 0x1F149), (0x1F150, 0x1F169), (0x1F170, 0x1F189))


def _word_ranges() -> Ranges:
    """Oniguruma's \\w: alphabetic, marks, decimal numbers, connector punctuation, the joiners."""
    return _union(property_ranges("L"), property_ranges("M"), property_ranges("Nd"), property_ranges("Nl"),
                  property_ranges("Pc"), _ALPHABETIC_SYMBOLS, ((0x200C, 0x200D),))


def _spell(ranges: Ranges) -> str:
    """Ranges as the inside of a bracket class, every code point escaped."""

    def one(cp: int) -> str:
        return f"\\u{cp:04x}" if cp <= 0xFFFF else f"\\U{cp:08x}"

    return "".join(one(lo) if lo == hi else f"{one(lo)}-{one(hi)}" for lo, hi in ranges)


def _escape_class(letter: str, argument: str) -> Ranges | None:
    """The ranges of class escape \\<letter> (with `argument` for \\p / \\P), or None when it is no class escape."""
    if letter in "pP":
        ranges = property_ranges(argument)
    elif letter in "sS":
        ranges = _WHITE_SPACE
    elif letter in "wW":
        ranges = _word_ranges()
    else:
        return None
    return _complement(ranges) if letter.isupper() else ranges


def _property_argument(pattern: str, i: int) -> tuple[str, int]:
    """The name after \\p at `i` (``{Name}`` or one letter) and the index after it."""
    if i < len(pattern) and pattern[i] == "{":
        end = pattern.find("}", i)
        if end < 0:
            raise TokenizerError(f"regex {pattern!r}: unterminated \\p{{")
        name = pattern[i + 1:end]
        negated = name.startswith("^")
        return ("^" if negated else "") + name.lstrip("^"), end + 1
    if i < len(pattern):
        return pattern[i], i + 1
    raise TokenizerError(f"regex {pattern!r}: \\p without a property")


def _translate_escape(pattern: str, i: int, in_class: bool) -> tuple[str, int]:
    """Translate the escape starting at pattern[i] == '\\'; returns the text and the index after it."""
    if i + 1 >= len(pattern):
        raise TokenizerError(f"regex {pattern!r}: trailing backslash")
    letter, after = pattern[i + 1], i + 2
    argument = ""
    if letter in "pP":
        argument, after = _property_argument(pattern, after)
        if argument.startswith("^"):
            letter, argument = ("P" if letter == "p" else "p"), argument[1:]
    ranges = _escape_class(letter, argument)
    if ranges is not None:
        return (_spell(ranges) if in_class else f"[{_spell(ranges)}]"), after
    if letter == "x" and after < len(pattern) and pattern[after] == "{":
        end = pattern.find("}", after)
        cp = int(pattern[after + 1:end], 16)
        return (f"\\u{cp:04x}" if cp <= 0xFFFF else f"\\U{cp:08x}"), end + 1
    if not in_class and letter == "z":
        return "\\Z", after
    if not in_class and letter == "Z":
        return "(?=\\n?\\Z)", after
    return pattern[i:after], after


def _translate_class(pattern: str, i: int) -> tuple[str, int]:
    """Translate the bracket class starting at pattern[i] == '['; returns the text and the index after it."""
    out, j = ["["], i + 1
    if j < len(pattern) and pattern[j] == "^":
        out.append("^")
        j += 1
    if j < len(pattern) and pattern[j] == "]":  # a leading ']' is a literal
        out.append("\\]")
        j += 1
    while j < len(pattern):
        c = pattern[j]
        if c == "]":
            return "".join(out) + "]", j + 1
        if c == "\\":
            text, j = _translate_escape(pattern, j, in_class=True)
            out.append(text)
            continue
        if c == "[" or pattern.startswith("&&", j):
            raise TokenizerError(f"regex {pattern!r}: nested classes, POSIX brackets and '&&' are not supported")
        out.append(c)
        j += 1
    raise TokenizerError(f"regex {pattern!r}: unterminated '['")


def translate(pattern: str) -> str:
    """An Oniguruma pattern as `re` source with the same matches (for the constructs tokenizer files use)."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            text, i = _translate_escape(pattern, i, in_class=False)
        elif c == "[":
            text, i = _translate_class(pattern, i)
        elif pattern.startswith("(?<", i) and i + 3 < len(pattern) and pattern[i + 3] not in "=!":
            text, i = "(?P<", i + 3  # a named group
        else:
            text, i = c, i + 1
        out.append(text)
    return "".join(out)


@functools.lru_cache(maxsize=64)
def compile_onig(pattern: str) -> re.Pattern[str]:
    """`translate(pattern)` compiled; TokenizerError naming the pattern when `re` refuses it."""
    try:
        return re.compile(translate(pattern), re.MULTILINE)
    except re.error as exc:
        raise TokenizerError(f"regex {pattern!r} is not supported: {exc}") from exc
