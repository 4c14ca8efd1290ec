"""OpenAI-compatible routes for generative models (`backend: "kiln_llm"`, server/core/generative.py): GET /v1/models,
POST /v1/completions and POST /v1/chat/completions, as OpenAI's API answers them, so the stock `openai` client works.

A request becomes one stream of the core's (`submit_stream`, as generate_stream's): the prompt as `text_input`, or
a chat's messages as the `messages` input (the core renders the model's chat template), the sampling fields as
`sampling_parameters` JSON, `exclude_input_in_output` true, and `stream` as the client asks. With `stream` the
answer is server-sent events, one `data: {chunk}` per piece of text, then the finish reason, the usage when
`stream_options.include_usage` asks for it, and `data: [DONE]`; otherwise one JSON object with the usage. Leaving
a stream early (the client disconnects) withdraws the request, which frees its KV-cache blocks.

Log-probabilities (completions' `logprobs: N`, chat's `logprobs: true` with `top_logprobs: N`) ask the model for its
`logprobs` output (`return_logprobs`, the vLLM backend's JSON per token) and are reshaped as OpenAI's: completions'
`{tokens, token_logprobs, top_logprobs, text_offset}`, chat's `{content: [{token, logprob, bytes, top_logprobs}]}`,
each chunk of a stream with its own tokens'. `n` choices (up to MAX_CHOICES) are `n` requests to the core, merged
into one answer: each choice's chunks carry its `index`, the usage counts the prompt once and every choice's tokens,
and with a `seed` choice `i` samples with `seed + i` (so choices differ and a request replays). Only what Kiln does is
accepted: no `echo` (prompt log-probabilities), tools or other fields (a field it does not take is 400, named); OpenAI's `presence_penalty` and
`frequency_penalty` and vLLM's `repetition_penalty`, `top_k` and `ignore_eos` are taken. Errors have OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`: 400 for a bad request, 404 for a model that is not a loaded
generative model.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from server.core import InferInput, InferRequest, InferResponse
from server.core.decoupled import StreamPart, merged_stream_parts
from server.core.errors import ErrorKind, ServerError
from server.core.generative_config import GENERATIVE_BACKEND
from server.core.generative_request import chat_messages, stop_strings

from ..deps import CoreDep
from ..errors import http_status

router = APIRouter(tags=["openai"])
MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_LOGPROBS = 20  # OpenAI's limit on top_logprobs (and vLLM's default max_logprobs; OpenAI's completions stop at 5)
MAX_PENALTY = 2.0  # OpenAI's bound on presence_penalty and frequency_penalty
MAX_CHOICES = 128  # OpenAI's bound on n

#: fields every request may carry, with the checks of their values (None: any value is taken as null)
_COMMON = ("model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "seed", "stop", "user",
           "top_k", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs")
_CHAT = frozenset({*_COMMON, "messages", "max_completion_tokens", "top_logprobs"})
_COMPLETION = frozenset({*_COMMON, "prompt"})
#: fields taken only with the value that changes nothing (OpenAI clients may send them so)
_NEUTRAL: dict[str, tuple[Any, ...]] = {"echo": (False,), "best_of": (1,), "logit_bias": ({},), "suffix": ("",),
                                        "store": (False,), "parallel_tool_calls": (False, True)}


class OpenAIError(Exception):
    """A request OpenAI's API would refuse: its status, message and the field it is about."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def _error_body(status: int, message: str, param: str | None, code: str | None) -> dict[str, Any]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 429:
        kind = "rate_limit_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _error_response(error: Exception) -> JSONResponse:
    if isinstance(error, OpenAIError):
        return JSONResponse(_error_body(error.status, error.message, error.param, error.code), error.status)
    if isinstance(error, ServerError):
        status = http_status(error)
        return JSONResponse(_error_body(status, error.message, None, None), status)
    return JSONResponse(_error_body(500, "internal error", None, None), 500)


# -- the request --------------------------------------------------------------------------------------------------
@dataclass
class Call:
    """A checked OpenAI request: what the core is asked, and how the answer is shaped."""

    chat: bool
    model: str
    prompt: str | list[dict[str, Any]]
    sampling: dict[str, Any]
    stream: bool = False
    include_usage: bool = False
    n: int = 1
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.id

    @property
    def logprobs(self) -> int | None:
        """How many most likely tokens each token's log-probabilities list (None: no log-probabilities)."""
        return self.sampling.get("logprobs")

    def infer_request(self, choice: int = 0) -> InferRequest:
        """The core's request for choice `choice` (its own id and, with a seed, seed + choice)."""
        prompt = json.dumps(self.prompt) if self.chat else self.prompt
        sampling = dict(self.sampling)
        if choice and "seed" in sampling:
            sampling["seed"] += choice
        inputs = [_bytes_input("messages" if self.chat else "text_input", str(prompt)),
                  _bytes_input("sampling_parameters", json.dumps(sampling)),
                  InferInput("stream", "BOOL", (1,), np.array([self.stream])),
                  InferInput("exclude_input_in_output", "BOOL", (1,), np.array([True]))]
        if self.logprobs is not None:
            inputs.append(InferInput("return_logprobs", "BOOL", (1,), np.array([True])))
        return InferRequest(self.model, inputs, id=self.id if self.n == 1 else f"{self.id}-{choice}")


def _bytes_input(name: str, text: str) -> InferInput:
    return InferInput(name, "BYTES", (1,), np.array([text.encode()], dtype=object))


def parse_call(body: Any, chat: bool) -> Call:
    """The request body checked as OpenAI checks it; OpenAIError (400) naming the field otherwise."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    allowed = _CHAT if chat else _COMPLETION
    refused = sorted(k for k, v in body.items()
                     if k not in allowed and v is not None and not (k in _NEUTRAL and v in _NEUTRAL[k]))
    if refused:
        raise OpenAIError(400, f"Kiln does not support the field{'s' if len(refused) > 1 else ''} "
                          f"{', '.join(refused)} (supported: {', '.join(sorted(allowed))})", refused[0],
                          "unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIError(400, "'model' is required: the name of a loaded generative model", "model")
    prompt = _messages(body.get("messages")) if chat else _prompt(body.get("prompt"))
    stream = _typed(body, "stream", bool) or False
    options = _typed(body, "stream_options", dict)
    if options is not None and not stream:
        raise OpenAIError(400, "'stream_options' is only allowed when 'stream' is true", "stream_options")
    include_usage = (options or {}).get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise OpenAIError(400, "'stream_options.include_usage' must be true or false", "stream_options")
    n = _typed(body, "n", int)
    if n is not None and not 1 <= n <= MAX_CHOICES:
        raise OpenAIError(400, f"'n' must be between 1 and {MAX_CHOICES}, got {n}", "n", "invalid_value")
    return Call(chat, model, prompt, _sampling(body, chat), stream, include_usage, n or 1)


def _typed(body: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = body.get(name)
    if value is not None and (not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise OpenAIError(400, f"'{name}' must be of type {names.replace('dict', 'object').replace('str', 'string')}",
                          name)
    return value


def _number(body: dict[str, Any], name: str, low: float, high: float, low_open: bool = False) -> float | None:
    value = _typed(body, name, (int, float))
    if value is not None and not (low < value <= high if low_open else low <= value <= high):
        raise OpenAIError(400, f"'{name}' must be in {'(' if low_open else '['}{low:g}, {high:g}], got {value}", name,
                          "invalid_value")
    return value


def _sampling(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The request's sampling fields as the model's `sampling_parameters`."""
    limit = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _typed(body, limit, int)
    if max_tokens is not None and max_tokens < 1:
        raise OpenAIError(400, f"'{limit}' must be at least 1, got {max_tokens}", limit, "invalid_value")
    sampling = {"max_tokens": max_tokens, "temperature": _number(body, "temperature", 0, 2),
                "top_p": _number(body, "top_p", 0, 1, low_open=True), "seed": _typed(body, "seed", int),
                "top_k": _typed(body, "top_k", int), "ignore_eos": _typed(body, "ignore_eos", bool),
                "stop": _stop(body.get("stop")),
                "presence_penalty": _number(body, "presence_penalty", -MAX_PENALTY, MAX_PENALTY),
                "frequency_penalty": _number(body, "frequency_penalty", -MAX_PENALTY, MAX_PENALTY),
                "repetition_penalty": _number(body, "repetition_penalty", 0, math.inf, low_open=True),
                "logprobs": _chat_logprobs(body) if chat else _completion_logprobs(body)}
    return {k: v for k, v in sampling.items() if v is not None}


def _completion_logprobs(body: dict[str, Any]) -> int | None:
    """Completions' `logprobs`: how many most likely tokens to list per token (false or null: none)."""
    if body.get("logprobs") is False:
        return None
    value = _typed(body, "logprobs", int)
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise OpenAIError(400, f"'logprobs' must be in [0, {MAX_LOGPROBS}], got {value}", "logprobs", "invalid_value")
    return value


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat's `logprobs` (true: the chosen tokens' log-probabilities) and `top_logprobs` (how many alternatives)."""
    wanted = _typed(body, "logprobs", bool)
    top = _typed(body, "top_logprobs", int)
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise OpenAIError(400, f"'top_logprobs' must be in [0, {MAX_LOGPROBS}], got {top}", "top_logprobs",
                          "invalid_value")
    if top and not wanted:
        raise OpenAIError(400, "'top_logprobs' needs 'logprobs' set to true", "top_logprobs", "invalid_value")
    return (top or 0) if wanted else None


def _stop(value: Any) -> list[str] | None:
    return stop_strings(value, MAX_STOP, lambda message: OpenAIError(400, message, "stop")) or None


def _prompt(value: Any) -> str:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str):
        raise OpenAIError(400, "'prompt' must be a string (or a list of one string; token ids and several prompts "
                          "are not supported)", "prompt")
    return value


def _messages(value: Any) -> list[dict[str, Any]]:
    """The chat's messages, checked as the model's `messages` input is (and sent to it as they came)."""
    chat_messages(value, lambda message: OpenAIError(400, message, "messages"))
    return value


# -- the answer ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ListedToken:
    """One generated token's log-probabilities as the model's `logprobs` output gives them: its text, its
    log-probability and the most likely tokens' (text, log-probability), most likely first."""

    token: str
    logprob: float
    top: list[tuple[str, float]]


@dataclass
class Piece:
    """What one response of the model says."""

    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[dict[str, dict[str, Any]]] = field(default_factory=list)  # the vLLM backend's, one per token


def read_piece(response: InferResponse) -> Piece:
    values = {o.name: o.data.reshape(-1)[0] for o in response.outputs if o.data is not None and o.data.size}
    text, reason = values.get("text_output", b""), values.get("finish_reason", b"")
    logprobs = json.loads(values["logprobs"]) if "logprobs" in values else None
    return Piece(text.decode("utf-8", "replace") if isinstance(text, bytes) else str(text),
                 (reason.decode() if isinstance(reason, bytes) else str(reason)) or None,
                 int(values.get("num_input_tokens", 0)), int(values.get("num_output_tokens", 0)), logprobs or [])


def _token_logprobs(entries: list[dict[str, dict[str, Any]]], top_n: int) -> list[ListedToken]:
    """The model's entries (token id -> {logprob, rank, decoded_token}, the chosen token first) as OpenAI lists
    them: the chosen token and the `top_n` most likely."""
    tokens = []
    for entry in entries:
        listed = list(entry.values())
        ranked = sorted((e for e in listed if e["rank"] <= top_n), key=lambda e: e["rank"])
        tokens.append(ListedToken(listed[0]["decoded_token"], listed[0]["logprob"],
                                    [(e["decoded_token"], e["logprob"]) for e in ranked]))
    return tokens


class LogprobsShape:
    """Log-probabilities shaped as OpenAI's answers carry them; completions' `text_offset` runs on over the chunks
    of a stream."""

    def __init__(self, call: Call) -> None:
        self.call = call
        self.offset = 0

    def __call__(self, pieces: list[Piece]) -> dict[str, Any] | None:
        """The `logprobs` of a choice made of `pieces` (None when the request asked for none)."""
        if self.call.logprobs is None:
            return None
        tokens = _token_logprobs([e for piece in pieces for e in piece.logprobs], self.call.logprobs)
        if self.call.chat:
            return {"content": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode()),
                                 "top_logprobs": [{"token": text, "logprob": value, "bytes": list(text.encode())}
                                                  for text, value in t.top]} for t in tokens]}
        offsets = []
        for t in tokens:
            offsets.append(self.offset)
            self.offset += len(t.token)
        return {"tokens": [t.token for t in tokens], "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [_top_by_text(t) for t in tokens], "text_offset": offsets}


def _top_by_text(token: ListedToken) -> dict[str, float]:
    """Completions' `top_logprobs` of one token: text -> log-probability of the most likely tokens and the chosen one
    (OpenAI's: up to logprobs + 1). Tokens of the same text (U+FFFD for pieces of a character) keep the likeliest."""
    top: dict[str, float] = {}
    for text, value in [*token.top, (token.token, token.logprob)]:
        top.setdefault(text, value)
    return top


def _usage(lasts: list[Piece]) -> dict[str, int]:
    """The usage of choices whose last pieces are `lasts`: the prompt once, every choice's completion tokens."""
    prompt, completion = lasts[0].prompt_tokens, sum(piece.completion_tokens for piece in lasts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _whole(call: Call, choices: list[list[Piece]]) -> dict[str, Any]:
    """The non-streamed answer: one choice per list of pieces, in index order."""
    listed = []
    for index, pieces in enumerate(choices):
        text, last, logprobs = "".join(p.text for p in pieces), pieces[-1], LogprobsShape(call)(pieces)
        if call.chat:
            listed.append({"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                           "finish_reason": last.finish_reason})
        else:
            listed.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": last.finish_reason})
    return {"id": call.response_id, "object": "chat.completion" if call.chat else "text_completion",
            "created": call.created, "model": call.model, "choices": listed,
            "usage": _usage([pieces[-1] for pieces in choices])}


def _chunk(call: Call, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
    body: dict[str, Any] = {"id": call.response_id, "object": "chat.completion.chunk" if call.chat else
                            "text_completion", "created": call.created, "model": call.model, "choices": choices}
    if call.include_usage:
        body["usage"] = usage
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def _choice(call: Call, index: int, text: str | None, reason: str | None, role: bool = False,
            logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    if not call.chat:
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
    delta: dict[str, Any] = {"role": "assistant"} if role else {}
    if text is not None:
        delta["content"] = text
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}


def _piece_chunks(call: Call, index: int, piece: Piece, shape: LogprobsShape) -> list[bytes]:
    """The events of one response of choice `index`'s stream: its text and tokens, then (chat) the finish reason
    on its own."""
    chunks = []
    if piece.text or piece.logprobs or (piece.finish_reason and not call.chat):
        reason = None if call.chat else piece.finish_reason
        chunks.append(_chunk(call, [_choice(call, index, piece.text, reason, logprobs=shape([piece]))]))
    if piece.finish_reason and call.chat:
        chunks.append(_chunk(call, [_choice(call, index, None, piece.finish_reason)]))
    return chunks


Parts = AsyncIterator[tuple[int, StreamPart]]


async def _events(call: Call, first: tuple[int, StreamPart], rest: Parts) -> AsyncIterator[bytes]:
    """The server-sent events of a streamed answer, every choice's as they come, then the usage once all have
    finished. Leaving early (the client went away) withdraws the requests."""
    shapes = [LogprobsShape(call) for _ in range(call.n)]
    lasts: dict[int, Piece] = {}
    try:
        if call.chat:
            for index in range(call.n):
                yield _chunk(call, [_choice(call, index, "", None, role=True)])
        item: tuple[int, StreamPart] | None = first
        while item is not None:
            index, part = item
            if part.error is not None:
                error = part.error
                status = http_status(error) if isinstance(error, ServerError) else 500
                message = error.message if isinstance(error, ServerError) else "internal error"
                yield b"data: " + json.dumps(_error_body(status, message, None, None)).encode() + b"\n\n"
                return
            if part.response is not None:
                piece = read_piece(part.response)
                if piece.finish_reason:
                    lasts[index] = piece
                for chunk in _piece_chunks(call, index, piece, shapes[index]):
                    yield chunk
            item = await anext(rest, None)
        if call.include_usage and lasts:
            yield _chunk(call, [], _usage([lasts[i] for i in sorted(lasts)]))
        yield b"data: [DONE]\n\n"
    finally:
        await rest.aclose()


async def _answer(call: Call, first: tuple[int, StreamPart], rest: Parts) -> Response:
    """The non-streamed answer: each choice's pieces joined (the model sends one when not streaming)."""
    choices: list[list[Piece]] = [[] for _ in range(call.n)]
    item: tuple[int, StreamPart] | None = first
    try:
        while item is not None:
            index, part = item
            if part.error is not None:
                return _error_response(part.error)
            if part.response is not None:
                choices[index].append(read_piece(part.response))
            item = await anext(rest, None)
    finally:
        await rest.aclose()
    if not all(choices):
        return _error_response(ServerError(ErrorKind.INTERNAL, f"model '{call.model}' sent no response"))
    return JSONResponse(_whole(call, choices))


# -- the routes ---------------------------------------------------------------------------------------------------
async def _generative_model(core: Any, name: str) -> None:
    """`name` is a loaded generative model: else 404 (OpenAI's answer to a model it does not serve)."""
    try:
        config = await core.model_config(name)
    except ServerError as e:
        if e.kind in (ErrorKind.NOT_FOUND, ErrorKind.UNAVAILABLE):
            raise OpenAIError(404, e.message, "model", "model_not_found") from None
        raise
    if config.get("backend") != GENERATIVE_BACKEND:
        raise OpenAIError(404, f"model '{name}' is not a generative model (backend \"{GENERATIVE_BACKEND}\"); the /v1 "
                          "routes serve only those", "model", "model_not_found")


async def _body(request: Request) -> Any:
    raw = await request.body()
    request.app.state.limits.check_json_size(len(raw))  # --http-max-input-size, as for every JSON body
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise OpenAIError(400, f"the request body is not JSON: {str(e)[:200]}") from None


async def _serve(request: Request, core: Any, chat: bool) -> Response:
    try:
        call = parse_call(await _body(request), chat)
        await _generative_model(core, call.model)
    except (OpenAIError, ServerError) as e:
        return _error_response(e)
    parts = merged_stream_parts(core.submit_stream, [call.infer_request(i) for i in range(call.n)])
    first = await anext(parts)
    if first[1].final and first[1].error is not None:  # refused before it ran (a bad value, a prompt too long)
        await parts.aclose()
        return _error_response(first[1].error)
    if call.stream:
        return StreamingResponse(_events(call, first, parts), media_type="text/event-stream; charset=utf-8")
    return await _answer(call, first, parts)


@router.post("/v1/completions")
async def completions(request: Request, core: CoreDep) -> Response:
    """OpenAI's completions: a prompt continued."""
    return await _serve(request, core, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, core: CoreDep) -> Response:
    """OpenAI's chat completions: messages rendered with the model's chat template, the assistant's reply."""
    return await _serve(request, core, chat=True)


async def _generative_models(core: Any) -> list[dict[str, Any]]:
    names = sorted({m["name"] for m in await core.repository_index(ready=True)})
    models = []
    for name in names:
        try:
            config = await core.model_config(name)
        except ServerError:  # unloaded meanwhile
            continue
        if config.get("backend") == GENERATIVE_BACKEND:
            models.append({"id": name, "object": "model", "created": 0, "owned_by": "kiln"})
    return models


@router.get("/v1/models")
async def list_models(core: CoreDep) -> Response:
    """The loaded generative models, as OpenAI lists models."""
    return JSONResponse({"object": "list", "data": await _generative_models(core)})


@router.get("/v1/models/{model_name}")
async def retrieve_model(model_name: str, core: CoreDep) -> Response:
    """One loaded generative model, or 404."""
    found = [m for m in await _generative_models(core) if m["id"] == model_name]
    if not found:
        return _error_response(OpenAIError(404, f"The model '{model_name}' does not exist or is not a loaded "
                                           "generative model", "model", "model_not_found"))
    return JSONResponse(found[0])
