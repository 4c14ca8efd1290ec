"""One request to a generative model read from its inputs (the vLLM backend's), and its text as tokens come.

Inputs (server/core/generative_config.py): the prompt is `text_input`, or `messages` (a JSON array of chat
messages, rendered with the model's chat template: how OpenAI chat requests reach the model); `sampling_parameters`
is a JSON object of `SamplingParams` fields plus `stop` (a string or a list of strings); request parameters named
like those fields count too (the JSON wins); `stream` (default false), `exclude_input_in_output` (default false;
a stream never repeats the prompt) and `return_logprobs` (default false: the `logprobs` output, of the tokens that
`sampling_parameters.logprobs` asks log-probabilities for), as in Triton's vLLM backend. Every bad value is
INVALID_ARGUMENT naming it.

Stop strings act on text, as vLLM's do: the text is cut where one starts (the stop string is not sent) and the
sequence ends with finish reason "stop". While the text ends with the beginning of a stop string, that tail is held
back, so a stream never sends text that a stop string later takes back.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine_core.generate.chat_template import ChatTemplateError, render_chat
from engine_core.generate.sampling import SamplingParams
from engine_core.generate.tokenizer import DecodeStream, Tokenizer

from .errors import invalid

#: request parameters read as sampling fields (anything else among a request's parameters is not ours: tracing,
#: priorities, Triton's own flags)
SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams)) | {"stop"}
MAX_STOP_STRINGS = 16


@dataclass(frozen=True)
class GenerationRequest:
    """What a request asks for, checked: the prompt (as given, and as tokens), sampling and output options."""

    prompt_text: str
    prompt_ids: list[int]
    params: SamplingParams
    stops: tuple[str, ...]
    stream: bool
    exclude_input: bool
    return_logprobs: bool = False


def read_request(tokenizer: Tokenizer, inputs: Mapping[str, np.ndarray], parameters: Mapping[str, Any],
                 label: str) -> GenerationRequest:
    """The request to model `label` from its checked inputs and parameters."""
    if ("text_input" in inputs) == ("messages" in inputs):
        raise invalid(f"{label}: a request carries its prompt in exactly one of the inputs text_input and messages")
    if "text_input" in inputs:
        text = _text(inputs["text_input"], "text_input")
        ids = tokenizer.encode(text, add_special_tokens=True)
    else:
        text = _rendered_chat(tokenizer, _text(inputs["messages"], "messages"), label)
        ids = tokenizer.encode(text, add_special_tokens=False)  # the template writes the special tokens itself
    values = {k: v for k, v in parameters.items() if k in SAMPLING_FIELDS}
    if "sampling_parameters" in inputs:
        values.update(_json_object(_text(inputs["sampling_parameters"], "sampling_parameters")))
    stops = _stops(values.pop("stop", None))
    try:
        params = SamplingParams.from_mapping(values)
    except ValueError as e:
        raise invalid(f"{label}: sampling_parameters: {e}") from None
    return GenerationRequest(text, ids, params, stops, _flag(inputs, "stream"),
                             _flag(inputs, "exclude_input_in_output"), _flag(inputs, "return_logprobs"))


def _text(array: np.ndarray, name: str) -> str:
    value = np.asarray(array, dtype=object).reshape(-1)[0]
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except (TypeError, UnicodeDecodeError):
        raise invalid(f"input '{name}' must be UTF-8 text") from None


def _flag(inputs: Mapping[str, np.ndarray], name: str) -> bool:
    return bool(np.asarray(inputs[name]).reshape(-1)[0]) if name in inputs else False


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError as e:
        raise invalid(f"input 'sampling_parameters' is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise invalid("input 'sampling_parameters' must be a JSON object, e.g. {\"temperature\": 0.7}")
    return value


def stop_strings(value: Any, limit: int, error: Callable[[str], Exception]) -> list[str]:
    """`stop` (a string or a list of strings, none empty, at most `limit`) as a list; [] for None. Shared by the
    model's input and the OpenAI routes, which differ only in the limit and in how a refusal is raised (`error`,
    given the message)."""
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > limit:
        raise error(f"'stop' must be a non-empty string or a list of at most {limit} of them")
    return stops


def _stops(value: Any) -> tuple[str, ...]:
    return tuple(stop_strings(value, MAX_STOP_STRINGS,
                              lambda message: invalid(f"sampling parameter {message}, got {value!r}")))


def _rendered_chat(tokenizer: Tokenizer, text: str, label: str) -> str:
    """The chat messages (JSON) as the model's prompt, through its chat template (tokenizer_config.json)."""
    if tokenizer.chat_template is None:
        raise invalid(f"{label} has no chat template (tokenizer_config.json's chat_template): send text_input instead "
                      "of messages")
    try:
        messages = json.loads(text)
    except ValueError as e:
        raise invalid(f"input 'messages' is not JSON: {e}") from None
    try:
        return render_chat(tokenizer.chat_template, chat_messages(messages, invalid), add_generation_prompt=True,
                           bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
    except ChatTemplateError as e:
        raise invalid(f"{label}: chat template: {e}") from None


def chat_messages(value: Any, error: Callable[[str], Exception]) -> list[dict[str, Any]]:
    """Chat messages checked, each with its content as text (OpenAI's list of text parts joined). Shared by the
    model's `messages` input and the OpenAI chat route, which differ only in how a refusal is raised (`error`,
    given the message)."""
    if not isinstance(value, list) or not value:
        raise error("'messages' must be a non-empty array of {\"role\": ..., \"content\": ...} objects")
    return [_message(message, index, error) for index, message in enumerate(value)]


def _message(message: Any, index: int, error: Callable[[str], Exception]) -> dict[str, Any]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise error(f"messages[{index}] must be an object with a string 'role'")
    content = message.get("content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if content is not None and not isinstance(content, str):
        raise error(f"messages[{index}].content must be a string or a list of text parts "
                    "({\"type\": \"text\", \"text\": ...}): images, audio and tool calls are not supported")
    return {**message, "content": content or ""}


class CompletionText:
    """The generated text as tokens come: detokenized incrementally, cut at the first stop string, and handed out
    in pieces (`take`) that never include a tail a stop string may still claim."""

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...]) -> None:
        self._decoder = DecodeStream(tokenizer, skip_special_tokens=True)
        self._stops = stops
        self._longest = max((len(s) for s in stops), default=0)
        self.text = ""
        self.stopped = False  # a stop string was found: the text ends before it
        self._sent = 0

    def push(self, token_id: int) -> None:
        if not self.stopped:
            self._grow(self._decoder.push(token_id))

    def finish(self) -> None:
        """The sequence ended: the bytes the detokenizer still holds (an unfinished character) join the text."""
        if not self.stopped:
            self._grow(self._decoder.flush())

    def _grow(self, piece: str) -> None:
        # a stop string not found before this piece must end inside it: search only from where such a one could begin
        # (the whole text again per token would be quadratic in the completion's length)
        start = max(self._sent, len(self.text) - self._longest + 1)
        self.text += piece
        if not self._stops or not piece:
            return
        found = [i for i in (self.text.find(s, start) for s in self._stops) if i >= 0]
        if found:
            self.text = self.text[:min(found)]
            self.stopped = True

    def take(self, final: bool = False) -> str:
        """The text not handed out yet; all of it once `final` or stopped, else without a held-back tail."""
        end = len(self.text) if final or self.stopped else max(self._sent, len(self.text) - self._held())
        piece, self._sent = self.text[self._sent:end], end
        return piece

    def _held(self) -> int:
        """The length of the longest end of the text that begins a stop string."""
        for size in range(min(self._longest - 1, len(self.text)), 0, -1):
            tail = self.text[-size:]
            if any(stop.startswith(tail) for stop in self._stops):
                return size
        return 0
