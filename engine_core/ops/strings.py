"""String ops (StringConcat, StringNormalizer, StringSplit, RegexFullMatch)."""

from __future__ import annotations
