"""Chat templates (tokenizer_config.json's ``chat_template``) rendered as transformers renders them.

The same Jinja set-up as transformers' ``apply_chat_template``: a sandboxed, immutable environment (a template is
model-supplied code) with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter
that keeps non-ASCII text as it is, and the globals ``raise_exception(message)`` and ``strftime_now(format)``. The
variables are ``messages``, ``add_generation_prompt``, ``bos_token`` and ``eos_token`` (undefined when not given) and
``tools`` (None unless given).
jinja2 is imported on first use: only servers that render chats need it (``pip install kiln[llm]``).
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

__all__ = ["ChatTemplateError", "render_chat"]


class ChatTemplateError(ValueError):
    """A template that does not compile or render, a ``raise_exception`` in it, or jinja2 missing."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' ``tojson``: json.dumps without Jinja's HTML escaping, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _jinja() -> Any:
    """The jinja2 module (imported at each call, which is a dict look-up once loaded, so a test can hide it)."""
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError as exc:
        raise ChatTemplateError("chat templates need jinja2: pip install kiln[llm]") from exc
    return jinja2


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> Any:
    """The compiled template (cached: a server renders the same few templates for every request)."""
    jinja2 = _jinja()
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


def render_chat(template: str, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                bos_token: str | None = None, eos_token: str | None = None,
                tools: list[dict[str, Any]] | None = None) -> str:
    """The prompt text for `messages` (each a dict with ``role`` and ``content``) under `template`."""
    jinja2 = _jinja()
    compiled = _compile(template)
    # as in transformers, an unset special token is undefined (renders as ""), not None (renders as "None")
    tokens = {name: value for name, value in (("bos_token", bos_token), ("eos_token", eos_token)) if value is not None}
    try:
        return str(compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                   **tokens))
    except ChatTemplateError:
        raise
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        raise ChatTemplateError(f"chat template does not render: {exc}") from exc
