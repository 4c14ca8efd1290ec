"""Generative models (`backend: "kiln_llm"`, server/core/generative.py) through Triton's protocols on a real server:
the completed config, HTTP generate / generate_stream and the stock tritonclient's gRPC stream giving the greedy
reference's text, sampling parameters and stop strings, bad requests, statistics and metrics; and the config
completion and the stop-string text on their own. The OpenAI routes are test_openai.py's.
"""

from __future__ import annotations

import json
import queue

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from server.core.errors import ServerError
from server.core.generative import INLINE_PROMPT_BYTES
from server.core.generative_config import complete_generative_config, generation_settings
from server.core.generative_request import MAX_STOP_STRINGS, CompletionText, chat_messages, read_request
from server.core.model_config import parse_config_text

from ..conftest import require_grpc
from .conftest import LONG_MODEL, MAX_CONTEXT, MODEL, greedy_text, metric, wait_until_idle

PROMPT = "the system is"
STEPS = 24


@pytest.fixture(scope="module")
def expected(llm_repository, tokenizer):
    """The greedy reference's text after PROMPT (at most STEPS tokens) and its finish reason."""
    return greedy_text(llm_repository, tokenizer, tokenizer.encode(PROMPT), STEPS)


def _generate(server, path: str, body: dict, model: str = MODEL) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v2/models/{model}/{path}", json=body, timeout=30)


def _events(response: httpx.Response) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in response.text.splitlines() if line.startswith("data: ")]


def test_config_is_completed_as_the_vllm_backend_serves(llm_server):
    config = httpx.get(f"{llm_server.base_url}/v2/models/{MODEL}/config", timeout=10).json()
    assert config["backend"] == "kiln_llm" and config["model_transaction_policy"]["decoupled"] is True
    assert config["max_batch_size"] == 4
    assert [(i["name"], i["data_type"], i["optional"]) for i in config["input"]] == [
        ("text_input", "TYPE_STRING", True), ("messages", "TYPE_STRING", True), ("stream", "TYPE_BOOL", True),
        ("sampling_parameters", "TYPE_STRING", True), ("exclude_input_in_output", "TYPE_BOOL", True),
        ("return_logprobs", "TYPE_BOOL", True)]
    assert [o["name"] for o in config["output"]] == ["text_output", "finish_reason", "num_input_tokens",
                                                     "num_output_tokens", "logprobs"]


def test_generate_gives_the_prompt_and_the_greedy_text(llm_server, expected, tokenizer):
    body = {"text_input": PROMPT, "parameters": {"max_tokens": STEPS, "temperature": 0}}
    answer = _generate(llm_server, "generate", body)
    assert answer.status_code == 200, answer.text
    text, reason = expected
    result = answer.json()
    assert result["text_output"] == PROMPT + text and result["finish_reason"] == reason
    assert result["num_input_tokens"] == len(tokenizer.encode(PROMPT))
    excluded = _generate(llm_server, "generate", {**body, "exclude_input_in_output": True}).json()
    assert excluded["text_output"] == text


def test_generate_stream_sends_the_same_text_in_pieces(llm_server, expected):
    sampling = json.dumps({"max_tokens": STEPS, "temperature": 0.0})
    answer = _generate(llm_server, "generate_stream", {"text_input": PROMPT, "stream": True,
                                                       "sampling_parameters": sampling})
    assert answer.status_code == 200, answer.text
    events = _events(answer)
    assert len(events) > 1 and "".join(e["text_output"] for e in events) == expected[0]
    assert [e["finish_reason"] for e in events] == [""] * (len(events) - 1) + [expected[1]]
    counts = [e["num_output_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] <= STEPS


def _grpc_stream(server, text: str, sampling: dict, stream: bool = True) -> list:
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(require_grpc(server).grpc_url)
    inputs = []
    for name, value, datatype in (("text_input", text.encode(), "BYTES"), ("stream", stream, "BOOL"),
                                  ("sampling_parameters", json.dumps(sampling).encode(), "BYTES")):
        tensor = grpcclient.InferInput(name, [1], datatype)
        tensor.set_data_from_numpy(np.array([value], dtype=object if datatype == "BYTES" else bool))
        inputs.append(tensor)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer(MODEL, inputs, request_id="g1")
        got = []
        while True:
            result, error = results.get(timeout=30)
            got.append((result, error))
            if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
                return got
    finally:
        client.stop_stream()
        client.close()


@pytest.mark.parametrize("where", ["llm_server", "llm_remote"])
def test_tritonclient_grpc_stream_gives_the_greedy_text(where, request, expected):
    server = request.getfixturevalue(where)
    got = _grpc_stream(server, PROMPT, {"max_tokens": STEPS, "temperature": 0})
    assert all(error is None for _, error in got)
    pieces = [result.as_numpy("text_output").reshape(-1)[0].decode() for result, _ in got]
    assert "".join(pieces) == expected[0]
    assert got[-1][0].as_numpy("finish_reason").reshape(-1)[0].decode() == expected[1]
    whole = _grpc_stream(server, PROMPT, {"max_tokens": STEPS, "temperature": 0}, stream=False)
    assert len(whole) == 1 and whole[0][0].as_numpy("text_output").reshape(-1)[0].decode() == PROMPT + expected[0]


def test_a_stop_string_cuts_the_text_and_finishes_with_stop(llm_server, expected):
    text = expected[0]
    stop = text[len(text) // 2: len(text) // 2 + 2]
    sampling = {"max_tokens": STEPS, "temperature": 0, "stop": [stop]}
    answer = _generate(llm_server, "generate_stream", {"text_input": PROMPT, "stream": True,
                                                       "sampling_parameters": json.dumps(sampling)})
    events = _events(answer)
    assert "".join(e["text_output"] for e in events) == text[:text.index(stop)]
    assert events[-1]["finish_reason"] == "stop"
    wait_until_idle(llm_server)  # the sequence was cancelled at the stop: its blocks are back


def test_seeded_sampling_repeats_and_request_parameters_count(llm_server):
    body = {"text_input": PROMPT, "exclude_input_in_output": True,
            "parameters": {"max_tokens": 8, "temperature": 0.9, "top_p": 0.9, "top_k": 20, "seed": 7}}
    first, second = (_generate(llm_server, "generate", body).json() for _ in range(2))
    assert first["text_output"] == second["text_output"] and first["num_output_tokens"] <= 8


@pytest.mark.parametrize(("body", "words"), [
    ({"text_input": PROMPT, "sampling_parameters": '{"temperature": -1}'}, ["temperature"]),
    ({"text_input": PROMPT, "sampling_parameters": '{"best_of": 2}'}, ["best_of"]),
    ({"text_input": PROMPT, "sampling_parameters": "[1]"}, ["sampling_parameters", "JSON object"]),
    ({"text_input": PROMPT, "parameters": {"max_tokens": 10 * MAX_CONTEXT}}, ["context"]),
    ({"text_input": ""}, ["empty"]),
    ({"stream": True}, ["text_input", "messages"]),
    ({"messages": '[{"content": "hi"}]'}, ["role"]),
    ({"text_input": PROMPT, "sampling_parameters": '{"stop": [""]}'}, ["stop"]),
])
def test_bad_requests_are_400_naming_what_is_wrong_and_the_server_serves_on(llm_server, body, words):
    answer = _generate(llm_server, "generate", body)
    assert answer.status_code == 400, answer.text
    assert all(word in answer.json()["error"] for word in words), answer.json()
    assert _generate(llm_server, "generate", {"text_input": PROMPT, "parameters": {"max_tokens": 2}}).status_code == 200


def test_a_long_prompt_is_read_in_a_worker_thread_with_the_same_answers(llm_server, llm_repository, tokenizer):
    """A prompt over INLINE_PROMPT_BYTES is templated and tokenized off the event loop: the greedy text as for any
    prompt, a stream of it, and the 400 of a prompt too long for the context all come back the same way."""
    prompt = "the system is " * 300
    assert len(prompt.encode()) > INLINE_PROMPT_BYTES
    text, reason = greedy_text(llm_repository, tokenizer, tokenizer.encode(prompt), 4, model=LONG_MODEL)
    body = {"text_input": prompt, "exclude_input_in_output": True, "parameters": {"max_tokens": 4, "temperature": 0}}
    answer = _generate(llm_server, "generate", body, LONG_MODEL)
    assert answer.status_code == 200, answer.text
    assert (answer.json()["text_output"], answer.json()["finish_reason"]) == (text, reason)
    streamed = _generate(llm_server, "generate_stream", {**body, "stream": True}, LONG_MODEL)
    assert "".join(event["text_output"] for event in _events(streamed)) == text
    too_long = _generate(llm_server, "generate", body)  # tiny_llm's context is MAX_CONTEXT tokens
    assert too_long.status_code == 400 and "context" in too_long.json()["error"], too_long.text


def test_infer_is_refused_as_for_any_decoupled_model(llm_server):
    body = {"inputs": [{"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": ["hi"]}]}
    answer = httpx.post(f"{llm_server.base_url}/v2/models/{MODEL}/infer", json=body, timeout=10)
    assert answer.status_code == 501 and "decoupled" in answer.json()["error"]
    with pytest.raises(InferenceServerException, match="decoupled"):
        client = grpcclient.InferenceServerClient(require_grpc(llm_server).grpc_url)
        tensor = grpcclient.InferInput("text_input", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([b"hi"], dtype=object))
        client.infer(MODEL, [tensor])


def test_statistics_and_metrics_count_requests_and_tokens(llm_server):
    stats = httpx.get(f"{llm_server.base_url}/v2/models/{MODEL}/stats", timeout=10).json()["model_stats"][0]
    before = stats["inference_stats"]["success"]["count"]
    tokens = metric(llm_server, "kiln_generation_tokens_total", kind="completion")
    answer = _generate(llm_server, "generate", {"text_input": PROMPT, "parameters": {"max_tokens": 5,
                                                                                     "ignore_eos": True}})
    assert answer.json()["num_output_tokens"] == 5
    stats = httpx.get(f"{llm_server.base_url}/v2/models/{MODEL}/stats", timeout=10).json()["model_stats"][0]
    assert stats["inference_stats"]["success"]["count"] == before + 1
    assert metric(llm_server, "kiln_generation_tokens_total", kind="completion") == tokens + 5
    assert metric(llm_server, "kiln_kv_cache_blocks_total") == 4 * MAX_CONTEXT // 8
    assert metric(llm_server, "kiln_time_to_first_token_seconds_count") >= 1
    assert metric(llm_server, "kiln_inter_token_latency_seconds_bucket", le="+Inf") >= 4
    assert metric(llm_server, "kiln_time_to_first_token_seconds_bucket", le="1") >= 1  # bounds as Triton's: "1"
    wait_until_idle(llm_server)


# -- the config and the text on their own ---------------------------------------------------------------------------
def _complete(text: str):
    return complete_generative_config(parse_config_text('backend: "kiln_llm"\n' + text, "m"), "m", 8)


def test_completion_defaults_and_settings():
    config = _complete("")
    assert config.max_batch_size == 8 and config.model_transaction_policy.decoupled
    settings = generation_settings(config)
    assert (settings.max_context, settings.block_tokens, settings.num_blocks, settings.max_prefill_tokens,
            settings.prefix_caching, settings.fp16, settings.tf32) == (2048, 16, None, 512, True, False, True)
    declared = _complete('input [ { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] } ]\n'
                         'parameters { key: "kv_cache_blocks" value { string_value: "128" } }\n'
                         'parameters { key: "max_prefill_tokens" value { string_value: "64" } }\n'
                         'parameters { key: "kiln_precision" value { string_value: "fp16" } }\n'
                         'parameters { key: "enable_prefix_caching" value { string_value: "false" } }\n')
    assert len(declared.input) == 6 and generation_settings(declared).num_blocks == 128
    assert not generation_settings(declared).prefix_caching
    assert generation_settings(declared).max_prefill_tokens == 64
    assert generation_settings(declared).fp16
    strict = _complete('parameters { key: "kiln_precision" value { string_value: "fp32" } }')
    assert not generation_settings(strict).tf32 and not generation_settings(strict).fp16


@pytest.mark.parametrize(("text", "words"), [
    ("dynamic_batching { }", ["dynamic_batching", "continuous batching"]),
    ('parameters { key: "max_context" value { string_value: "lots" } }', ["max_context", "lots"]),
    ('parameters { key: "max_prefill_tokens" value { string_value: "0" } }', ["max_prefill_tokens", "'0'"]),
    ('parameters { key: "max_context" value { string_value: "4096" } }\n'
     'parameters { key: "kv_cache_blocks" value { string_value: "10" } }', ["kv_cache_blocks", "at least 256"]),
    ('input [ { name: "prompt" data_type: TYPE_STRING dims: [ 1 ] } ]', ["prompt", "text_input"]),
    ('output [ { name: "text_output" data_type: TYPE_INT32 dims: [ 1 ] } ]', ["text_output", "TYPE_STRING"]),
    ("instance_group [ { kind: KIND_CPU }, { kind: KIND_GPU } ]", ["different kinds"]),
    ("instance_group [ { count: -1 kind: KIND_CPU } ]", ["count", ">= 0", "-1"]),
    ('parameters { key: "kiln_pad_batch" value { string_value: "true" } }', ["kiln_pad_batch"]),
    ('parameters { key: "kiln_precision" value { string_value: "bf16" } }', ["kiln_precision", "bf16"]),
    ('parameters { key: "enable_prefix_caching" value { string_value: "sometimes" } }',
     ["enable_prefix_caching", "'true' or 'false'"]),
])
def test_completion_refuses_what_a_generative_model_cannot_do(text, words):
    with pytest.raises(ServerError) as caught:
        _complete(text)
    assert all(word in caught.value.message for word in words), caught.value.message


def _read(tokenizer, sampling: dict):
    inputs = {"text_input": np.array([b"hi"], dtype=object),
              "sampling_parameters": np.array([json.dumps(sampling).encode()], dtype=object)}
    return read_request(tokenizer, inputs, {}, MODEL)


def test_stop_strings_are_checked_against_the_models_limit(tokenizer):
    assert _read(tokenizer, {"stop": ["a"] * MAX_STOP_STRINGS}).stops == ("a",) * MAX_STOP_STRINGS
    assert _read(tokenizer, {"stop": "a"}).stops == ("a",) and _read(tokenizer, {"stop": []}).stops == ()
    with pytest.raises(ServerError) as caught:
        _read(tokenizer, {"stop": ["a"] * (MAX_STOP_STRINGS + 1)})
    assert caught.value.message.startswith(f"sampling parameter 'stop' must be a non-empty string or a list of at "
                                           f"most {MAX_STOP_STRINGS} of them, got ['a'")


@pytest.mark.parametrize(("messages", "words"), [
    ([], ["'messages'", "non-empty"]),
    ([{"content": "hi"}], ["messages[0]", "'role'"]),
    ([{"role": "user", "content": [{"type": "image_url"}]}], ["messages[0].content", "text parts"]),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], ["messages[0].content", "text parts"]),
    ([{"role": "user", "content": 3}], ["messages[0].content", "text parts"]),
])
def test_chat_messages_refuse_through_the_callers_error(messages, words):
    with pytest.raises(KeyError) as caught:
        chat_messages(messages, KeyError)
    assert all(word in caught.value.args[0] for word in words), caught.value.args[0]


def test_chat_messages_join_text_parts():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert chat_messages([{"role": "user", "content": parts}, {"role": "assistant"}], ValueError) == [
        {"role": "user", "content": "ab"}, {"role": "assistant", "content": ""}]


def test_completion_text_holds_back_a_possible_stop_and_cuts_at_it(tokenizer):
    text = CompletionText(tokenizer, ("world",))
    pieces = []
    for token in tokenizer.encode("hello wor"):
        text.push(token)
        pieces.append(text.take())
    assert "".join(pieces) == "hello " and not text.stopped  # "wor" may begin the stop string
    for token in tokenizer.encode("ld and more"):
        text.push(token)
    assert text.stopped and text.take() == "" and text.text == "hello "
    plain = CompletionText(tokenizer, ())
    for token in tokenizer.encode("hello wor"):
        plain.push(token)
    plain.finish()
    assert plain.take(final=True) == "hello wor"


def test_return_logprobs_gives_the_vllm_backends_logprobs_output(llm_server, llm_repository, tokenizer):
    """`return_logprobs` adds the `logprobs` output: per token since the last response, token id -> {logprob, rank,
    decoded_token}, the chosen token first (Triton's vLLM backend's JSON); null when sampling asks for none."""
    from .test_openai import penalised_reference

    tokens, logprobs = penalised_reference(llm_repository, tokenizer, tokenizer.encode(PROMPT), 6)
    body = {"text_input": PROMPT, "return_logprobs": True, "exclude_input_in_output": True,
            "parameters": {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 2}}
    entries = json.loads(_generate(llm_server, "generate", body).json()["logprobs"])
    assert [int(next(iter(entry))) for entry in entries] == tokens
    for entry, row in zip(entries, logprobs):
        best = [int(t) for t in np.argsort(-row, kind="stable")[:2]]
        assert [int(t) for t in entry] == best  # greedy: the chosen token is the most likely, listed once
        for rank, t in enumerate(best, 1):
            assert entry[str(t)] == {"logprob": pytest.approx(row[t], abs=1e-3), "rank": rank,
                                     "decoded_token": tokenizer.decode([t], skip_special_tokens=False)}
    events = _events(_generate(llm_server, "generate_stream", {**body, "stream": True}))
    assert [e for event in events for e in json.loads(event["logprobs"])] == entries
    unasked = {**body, "parameters": {"max_tokens": 2}}
    assert _generate(llm_server, "generate", unasked).json()["logprobs"] == "null"
    assert "logprobs" not in _generate(llm_server, "generate", {**unasked, "return_logprobs": False}).json()


@pytest.mark.parametrize(("sampling", "words"), [
    ({"presence_penalty": 3}, ["presence_penalty", "[-2, 2]"]),
    ({"repetition_penalty": -1}, ["repetition_penalty", "> 0"]),
    ({"logprobs": 50}, ["logprobs", "<= 20"]),
])
def test_bad_penalties_and_logprobs_are_400_naming_the_field(llm_server, sampling, words):
    answer = _generate(llm_server, "generate", {"text_input": PROMPT, "sampling_parameters": json.dumps(sampling)})
    assert answer.status_code == 400 and all(word in answer.json()["error"] for word in words), answer.text


def test_the_event_pump_wakes_the_loop_once_for_a_steps_events_in_order():
    """A decode step's events (one per sequence) reach the event loop in one wake-up, in order; a handler that fails
    drops nothing of the others."""
    import asyncio
    import threading

    from engine_core.generate.generator import GenerationEvent
    from server.core.generative import EventPump

    async def run() -> list[int]:
        loop = asyncio.get_running_loop()
        wakeups: list[object] = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *args: wakeups.append(args) or real(*args)  # type: ignore[method-assign]
        pump = EventPump(loop)
        seen: list[int] = []

        def handler(event: GenerationEvent, at_ns: int) -> None:
            if event.token_id == 3:
                raise RuntimeError("a broken request")
            seen.append(event.token_id)

        def step() -> None:
            for token in range(8):
                pump.put(handler, GenerationEvent(token, None, 1, token + 1))

        thread = threading.Thread(target=step)
        thread.start()
        thread.join()
        await asyncio.sleep(0.01)
        assert len(wakeups) == 1
        return seen

    assert asyncio.run(run()) == [0, 1, 2, 4, 5, 6, 7]
