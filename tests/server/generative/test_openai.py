"""The OpenAI-compatible routes (server/frontends/http/routers/openai.py) driven by the stock `openai` client on a
real server with the tiny decoder: models, chat and text completions streamed and whole (the same text, the greedy
reference's), usage, stop, OpenAI's error shape and statuses, and a client that disconnects mid-stream freeing its
KV blocks, in the server process and across frontend processes.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from .conftest import LONG_MODEL, MAX_CONTEXT, MODEL, generative, greedy_text, metric, wait_until_idle

MESSAGES = [{"role": "system", "content": "you are a system"}, {"role": "user", "content": "hello there"}]
STEPS = 20


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=30)


def _chat_prompt_ids(tokenizer) -> list[int]:
    """The chat as the model's template renders it (what the server tokenizes)."""
    from engine_core.generate.chat_template import render_chat

    text = render_chat(tokenizer.chat_template, MESSAGES, add_generation_prompt=True, bos_token=tokenizer.bos_token,
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


@pytest.mark.parametrize(("call", "error", "param", "words"), [
    ({"model": "nope"}, openai.NotFoundError, "model", ["nope"]),
    ({"model": "identity"}, openai.NotFoundError, "model", ["not a generative model"]),
    ({"temperature": 3}, openai.BadRequestError, "temperature", ["temperature", "[0, 2]"]),
    ({"n": 2}, openai.BadRequestError, "n", ["'n' must be 1"]),
    ({"extra_body": {"logprobs": True, "tools": [{"type": "function"}]}}, openai.BadRequestError, "logprobs",
     ["logprobs", "tools"]),
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
