"""The OpenAI-compatible routes (server/frontends/http/routers/openai.py) driven by the stock `openai` client on a
real server with the tiny decoder: models, chat and text completions streamed and whole (the same text, the greedy
reference's), usage, stop, penalties and log-probabilities (against onnxruntime's logits), OpenAI's error shape and
statuses, and a client that disconnects mid-stream freeing its KV blocks, in the server process and across frontend
processes.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import openai
import pytest

from server.core.generative_request import MAX_STOP_STRINGS
from server.frontends.http.routers.openai import MAX_STOP, OpenAIError, parse_call

from .conftest import LONG_MODEL, MAX_CONTEXT, MODEL, generative, greedy_text, metric, wait_until_idle

MESSAGES = [{"role": "system", "content": "you are a system"}, {"role": "user", "content": "hello there"}]
STEPS = 20


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=30)


def _chat_prompt_ids(tokenizer, messages: list[dict] = MESSAGES) -> list[int]:
    """The chat as the model's template renders it (what the server tokenizes)."""
    from engine_core.generate.chat_template import render_chat

    text = render_chat(tokenizer.chat_template, messages, add_generation_prompt=True, bos_token=tokenizer.bos_token,
                       eos_token=tokenizer.eos_token)
    return tokenizer.encode(text, add_special_tokens=False)


def test_models_lists_the_generative_models_only(llm_server):
    client = _client(llm_server)
    assert [m.id for m in client.models.list()] == [MODEL, LONG_MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("identity")


@pytest.mark.parametrize("where", ["llm_server", "llm_remote"])
def test_chat_streamed_and_whole_agree_with_the_greedy_reference(where, request, llm_repository, tokenizer):
    server = request.getfixturevalue(where)
    client = _client(server)
    text, reason = greedy_text(llm_repository, tokenizer, _chat_prompt_ids(tokenizer), STEPS)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=STEPS, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert content == text and finishes == [reason]
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.prompt_tokens == len(_chat_prompt_ids(tokenizer))
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=STEPS, temperature=0)
    assert whole.choices[0].message.content == content and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == reason and whole.usage.model_dump() == usage.model_dump()
    assert whole.id.startswith("chatcmpl-") and whole.object == "chat.completion"


def test_chats_sharing_a_system_prompt_reuse_its_kv_blocks(llm_server, llm_repository, tokenizer):
    """The second of two chats with one long system prompt takes its prompt's cached blocks (kv_block_tokens 8):
    kiln_prefix_cache_hits_total grows by them, queries by its prompt, and its text is still the greedy reference's."""
    client = _client(llm_server)
    system = {"role": "system", "content": "you are a careful system that answers every question well. " * 6}
    chats = [[system, {"role": "user", "content": question}] for question in ("hello there", "what is the system")]
    prompts = [_chat_prompt_ids(tokenizer, chat) for chat in chats]
    common = next(i for i, (a, b) in enumerate(zip(*prompts)) if a != b)
    assert common > 64
    counts = []
    for chat, prompt in zip(chats, prompts):
        text, _ = greedy_text(llm_repository, tokenizer, prompt, 6)
        answer = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=6, temperature=0)
        assert answer.choices[0].message.content == text
        counts.append((metric(llm_server, "kiln_prefix_cache_queries_total"),
                       metric(llm_server, "kiln_prefix_cache_hits_total")))
    assert counts[1][0] - counts[0][0] == len(prompts[1])
    assert counts[1][1] - counts[0][1] == min(common, len(prompts[1]) - 1) // 8 * 8


def test_completion_streamed_and_whole_agree_with_the_greedy_reference(llm_server, llm_repository, tokenizer):
    client = _client(llm_server)
    prompt = "hello world"
    extra = {"ignore_eos": True}  # vLLM's extension: exactly max_tokens tokens
    ids = generative.reference_greedy(llm_repository / MODEL / "1", tokenizer.encode(prompt), STEPS)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=STEPS, temperature=0, stream=True,
                                            extra_body=extra))
    streamed = "".join(c.choices[0].text for c in chunks)
    assert streamed == tokenizer.decode(ids) and chunks[-1].choices[0].finish_reason == "length"
    whole = client.completions.create(model=MODEL, prompt=[prompt], max_tokens=STEPS, temperature=0, extra_body=extra)
    assert whole.choices[0].text == streamed and whole.usage.completion_tokens == STEPS
    assert whole.usage.prompt_tokens == len(tokenizer.encode(prompt)) and whole.object == "text_completion"


def test_stop_and_seeded_sampling(llm_server, llm_repository, tokenizer):
    client = _client(llm_server)
    text, _ = greedy_text(llm_repository, tokenizer, tokenizer.encode("the"), STEPS)
    stop = text[3:5]
    cut = client.completions.create(model=MODEL, prompt="the", max_tokens=STEPS, temperature=0, stop=stop)
    assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"
    sampled = [client.completions.create(model=MODEL, prompt="the", max_tokens=8, temperature=1.0, top_p=0.95,
                                         seed=3).choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_n_choices_whole_and_streamed(llm_server, llm_repository, tokenizer):
    """`n` choices: each its own sampled sequence (choice i seeded seed + i, so choice 0 replays an n=1 request with
    the seed), indexed 0..n-1; the usage counts the prompt once and every choice's tokens; a stream carries every
    choice's chunks under its index, each choice's finish reason, and the usage once at the end."""
    client = _client(llm_server)
    sampled = dict(model=MODEL, prompt="the", max_tokens=6, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    whole = client.completions.create(n=3, **sampled)
    single = client.completions.create(**sampled)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert whole.choices[0].text == single.choices[0].text
    assert len({c.text for c in whole.choices}) > 1  # other seeds, other samples
    assert whole.usage.prompt_tokens == single.usage.prompt_tokens == len(tokenizer.encode("the"))
    assert whole.usage.completion_tokens == 3 * single.usage.completion_tokens == 3 * 6

    text, reason = greedy_text(llm_repository, tokenizer, _chat_prompt_ids(tokenizer), STEPS)
    greedy = dict(model=MODEL, messages=MESSAGES, max_tokens=STEPS, temperature=0, stream=True,
                  stream_options={"include_usage": True})
    chunks = list(client.chat.completions.create(n=2, **greedy))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == text  # greedy: both choices the reference's
        assert [c.finish_reason for c in mine if c.finish_reason] == [reason]
    usages = [c.usage for c in chunks if c.usage is not None]
    one = [c.usage for c in client.chat.completions.create(**greedy) if c.usage is not None]
    assert len(usages) == 1 and not chunks[-1].choices
    assert usages[0].completion_tokens == 2 * one[0].completion_tokens and usages[0].prompt_tokens == one[0].prompt_tokens


@pytest.mark.parametrize(("call", "error", "param", "words"), [
    ({"model": "nope"}, openai.NotFoundError, "model", ["nope"]),
    ({"model": "identity"}, openai.NotFoundError, "model", ["not a generative model"]),
    ({"temperature": 3}, openai.BadRequestError, "temperature", ["temperature", "[0, 2]"]),
    ({"n": 0}, openai.BadRequestError, "n", ["'n' must be between 1 and 128"]),
    ({"extra_body": {"response_format": {"type": "json_object"}, "tools": [{"type": "function"}]}},
     openai.BadRequestError, "response_format", ["response_format", "tools"]),
    ({"presence_penalty": 2.5}, openai.BadRequestError, "presence_penalty", ["presence_penalty", "[-2, 2]"]),
    ({"frequency_penalty": "lots"}, openai.BadRequestError, "frequency_penalty", ["frequency_penalty", "float"]),
    ({"extra_body": {"repetition_penalty": 0}}, openai.BadRequestError, "repetition_penalty",
     ["repetition_penalty"]),
    ({"logprobs": True, "top_logprobs": 21}, openai.BadRequestError, "top_logprobs", ["top_logprobs", "20"]),
    ({"top_logprobs": 2}, openai.BadRequestError, "top_logprobs", ["logprobs"]),
    ({"logprobs": 3}, openai.BadRequestError, "logprobs", ["logprobs", "bool"]),
    ({"max_tokens": 10 * MAX_CONTEXT}, openai.BadRequestError, None, ["context"]),
    ({"stream_options": {"include_usage": True}}, openai.BadRequestError, "stream_options", ["stream"]),
])
def test_bad_chat_requests_get_openai_errors_and_the_server_serves_on(llm_server, call, error, param, words):
    client = _client(llm_server)
    arguments = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **call}
    with pytest.raises(error) as caught:
        client.chat.completions.create(**arguments)
    body = caught.value.body
    assert body["param"] == param and body["type"] == "invalid_request_error"
    assert all(word in body["message"] for word in words), body
    assert client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2).choices[0].finish_reason


def test_stop_and_messages_are_checked_with_openais_limit_and_errors():
    assert MAX_STOP < MAX_STOP_STRINGS  # the model's own input takes more stop strings than OpenAI's API
    body = {"model": MODEL, "messages": MESSAGES}
    assert parse_call({**body, "stop": ["a"] * MAX_STOP}, chat=True).sampling["stop"] == ["a"] * MAX_STOP
    assert "stop" not in parse_call({**body, "stop": []}, chat=True).sampling
    for bad, param, words in ((dict(stop=["a"] * (MAX_STOP + 1)), "stop", [f"at most {MAX_STOP}"]),
                              (dict(stop=[""]), "stop", ["'stop'"]),
                              (dict(messages=[]), "messages", ["'messages'", "non-empty"]),
                              (dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages",
                               ["messages[0].content", "images"])):
        with pytest.raises(OpenAIError) as caught:
            parse_call({**body, **bad}, chat=True)
        assert (caught.value.status, caught.value.param) == (400, param)
        assert all(word in caught.value.message for word in words), caught.value.message


def test_error_shape_of_a_body_that_is_not_json(llm_server):
    answer = httpx.post(f"{llm_server.base_url}/v1/completions", content=b"{nope", timeout=10)
    assert answer.status_code == 400
    assert set(answer.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("where", ["llm_server", "llm_remote"])
def test_a_client_that_disconnects_mid_stream_frees_its_kv_blocks(where, request):
    server = request.getfixturevalue(where)
    wait_until_idle(server)
    before = metric(server, "kiln_generation_tokens_total", kind="completion")
    wanted = MAX_CONTEXT - 16
    body = {"model": MODEL, "prompt": "the system", "max_tokens": wanted, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=30) as client, client.stream("POST", f"{server.base_url}/v1/completions",
                                                          json=body) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[len("data: "):])["choices"][0]["finish_reason"] is None
        assert metric(server, "kiln_kv_cache_blocks_used") > 0  # the sequence holds its blocks while it streams
        assert metric(server, "kiln_generation_sequences", state="running") == 1
    wait_until_idle(server)  # the connection is gone: the request was withdrawn and its blocks freed
    generated = metric(server, "kiln_generation_tokens_total", kind="completion") - before
    assert 0 < generated < wanted  # cancelled, not run to its end
    assert _client(server).completions.create(model=MODEL, prompt="the", max_tokens=2).choices[0].text is not None


# -- penalties and log-probabilities ------------------------------------------------------------------------------
PENALTIES = {"presence_penalty": 0.8, "frequency_penalty": 0.5}


def penalised_reference(repository, tokenizer, prompt_ids: list[int], steps: int, **penalties):
    """The greedy tokens of the penalised reference (onnxruntime, no KV cache) and each step's raw log-softmax."""
    from engine_core.generate import SamplingParams
    from tests.generate.test_generator import reference_penalized_greedy
    from tests.generate.test_sampling import log_softmax

    params = SamplingParams(max_tokens=steps, temperature=0, **penalties)
    tokens, rows = reference_penalized_greedy(repository / MODEL / "1", prompt_ids, params)
    return tokens, [log_softmax(row) for row in rows]


def test_penalties_change_the_greedy_text_as_the_reference_says(llm_server, llm_repository, tokenizer):
    client = _client(llm_server)
    ids = tokenizer.encode("the system")
    plain = generative.reference_greedy(llm_repository / MODEL / "1", ids, STEPS)
    wanted, _ = penalised_reference(llm_repository, tokenizer, ids, STEPS, repetition_penalty=1.3, **PENALTIES)
    assert wanted != plain
    answer = client.completions.create(model=MODEL, prompt="the system", max_tokens=STEPS, temperature=0,
                                       extra_body={"ignore_eos": True, "repetition_penalty": 1.3}, **PENALTIES)
    assert answer.choices[0].text == tokenizer.decode(wanted)


def test_completion_logprobs_whole_and_streamed(llm_server, llm_repository, tokenizer):
    client = _client(llm_server)
    steps, top = 8, 3
    tokens, logprobs = penalised_reference(llm_repository, tokenizer, tokenizer.encode("hello world"), steps,
                                            **PENALTIES)
    arguments = {"model": MODEL, "prompt": "hello world", "max_tokens": steps, "temperature": 0, "logprobs": top,
                 "extra_body": {"ignore_eos": True}, **PENALTIES}
    whole = client.completions.create(**arguments).choices[0].logprobs
    texts = [tokenizer.decode([t], skip_special_tokens=False) for t in tokens]
    assert whole.tokens == texts
    assert whole.token_logprobs == pytest.approx([row[t] for row, t in zip(logprobs, tokens)], abs=1e-3)
    assert whole.text_offset == [sum(map(len, texts[:i])) for i in range(steps)]
    for listed, row, token in zip(whole.top_logprobs, logprobs, tokens):  # the top 3, then the chosen token
        expected: dict[str, float] = {}  # by text: tokens of one text (U+FFFD) keep the likeliest
        for t in [*np.argsort(-row, kind="stable")[:top], token]:
            expected.setdefault(tokenizer.decode([int(t)], skip_special_tokens=False), row[t])
        assert listed == pytest.approx(expected, abs=1e-3)
    chunks = list(client.completions.create(stream=True, **arguments))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for lp in streamed for v in getattr(lp, name)] == getattr(whole, name)


def test_chat_logprobs_whole_and_streamed(llm_server, llm_repository, tokenizer):
    client = _client(llm_server)
    arguments = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "logprobs": True,
                 "top_logprobs": 2}
    whole = client.chat.completions.create(**arguments)
    content = whole.choices[0].logprobs.content
    tokens, logprobs = penalised_reference(llm_repository, tokenizer, _chat_prompt_ids(tokenizer), 8)
    ended = whole.choices[0].finish_reason == "stop"  # the end token is counted, not listed (nor in the text)
    assert len(content) == whole.usage.completion_tokens - ended > 0
    for entry, token, row in zip(content, tokens, logprobs):
        assert entry.token == tokenizer.decode([token], skip_special_tokens=False)
        assert entry.bytes == list(entry.token.encode()) and entry.logprob == pytest.approx(row[token], abs=1e-3)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(sorted(row, reverse=True)[:2], abs=1e-3)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the most likely
    chunks = list(client.chat.completions.create(stream=True, **arguments))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    bare = client.chat.completions.create(**{**arguments, "top_logprobs": None})
    assert [(e.token, e.top_logprobs) for e in bare.choices[0].logprobs.content] == [
        (e.token, []) for e in content]
    assert client.chat.completions.create(**{**arguments, "logprobs": False, "top_logprobs": None}
                                          ).choices[0].logprobs is None
