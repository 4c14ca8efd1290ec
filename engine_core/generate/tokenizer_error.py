"""The one error of the tokenizer modules, in a module of its own so that each of them can raise it."""

from __future__ import annotations


class TokenizerError(ValueError):
    """An unsupported or invalid tokenizer.json / tokenizer_config.json; the message names the field."""
