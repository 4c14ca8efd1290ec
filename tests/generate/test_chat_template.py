"""Chat templates rendered with transformers' Jinja set-up: ChatML and Llama 3 prompts, the helpers, the errors."""

from __future__ import annotations

import sys
from datetime import datetime

import pytest

from engine_core.generate.chat_template import ChatTemplateError, render_chat

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
          " + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

#: Llama 3's template as Meta ships it.
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
          "{% endif %}")

#: Mistral's check that roles alternate, written over several lines as template authors do.
ALTERNATING = """{{ bos_token }}
{% for message in messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'user' %}
        {{ '[INST] ' + message['content'] + ' [/INST]' }}
    {% else %}
        {{ message['content'] + eos_token }}
    {% endif %}
{% endfor %}
"""

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there "}]


def test_chatml_prompt() -> None:
    assert render_chat(CHATML, MESSAGES) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there <|im_end|>\n<|im_start|>assistant\n")
    assert render_chat(CHATML, MESSAGES, add_generation_prompt=False).endswith("Hi there <|im_end|>\n")


def test_llama3_prompt() -> None:
    assert render_chat(LLAMA3, MESSAGES, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>") == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_trim_and_lstrip_blocks_drop_the_template_layout() -> None:
    """Lines holding only {% %} tags vanish; lines with {{ }} keep their indentation and newline (as in HF)."""
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert render_chat(ALTERNATING, chat, bos_token="<s>", eos_token="</s>") == (
        "<s>\n        [INST] a [/INST]\n        b</s>\n        [INST] c [/INST]\n")


def test_raise_exception_is_a_chat_template_error() -> None:
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render_chat(ALTERNATING, [{"role": "assistant", "content": "x"}], bos_token="<s>", eos_token="</s>")


def test_unset_special_tokens_render_empty() -> None:
    """As in transformers: a token the tokenizer lacks is undefined, not the string 'None'."""
    assert render_chat("{{ bos_token }}|{{ eos_token }}|", []) == "||"


def test_tojson_keeps_unicode_and_markup() -> None:
    rendered = render_chat("{{ messages[0] | tojson }} {{ messages[0] | tojson(indent=2) | length > 0 }}",
                           [{"role": "user", "content": "café <b> & ü"}])
    assert rendered == '{"role": "user", "content": "café <b> & ü"} True'


def test_strftime_now() -> None:
    assert render_chat("{{ strftime_now('%Y') }}", []) == str(datetime.now().year)


def test_tools_are_none_unless_given() -> None:
    template = "{% if tools is not none %}{{ tools | length }} tools{% else %}no tools{% endif %}"
    assert render_chat(template, []) == "no tools"
    assert render_chat(template, [], tools=[{"type": "function"}]) == "1 tools"


def test_loop_controls() -> None:
    template = "{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}{{ m['content'] }}" \
               "{% endfor %}"
    assert render_chat(template, MESSAGES) == "Hi there "


def test_the_sandbox_refuses_mutation() -> None:
    with pytest.raises(ChatTemplateError, match="render"):
        render_chat("{{ messages.append(1) }}", [])


def test_syntax_errors_are_chat_template_errors() -> None:
    with pytest.raises(ChatTemplateError, match="compile"):
        render_chat("{% for m in messages %}{{ m }", [])


def test_missing_jinja2_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "jinja2", None)
    with pytest.raises(ChatTemplateError, match=r"pip install kiln\[llm\]"):
        render_chat(CHATML, MESSAGES)
