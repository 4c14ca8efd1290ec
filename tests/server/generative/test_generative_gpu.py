"""A generative model on the CUDA backend (instance_group KIND_GPU): the tiny decoder served in strict fp32 gives the
greedy reference's text through the OpenAI routes, alone and as several sequences batched together (left-padded
pasts in one decode step), and a client that disconnects frees its KV blocks. Needs an NVIDIA GPU.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from .conftest import (
    CONFIG,
    LONG_CONTEXT,
    LONG_MODEL,
    MAX_CONTEXT,
    MODEL,
    generative,
    metric,
    run_server,
    wait_until_idle,
    write_repository,
)

pytestmark = pytest.mark.gpu

GPU_CONFIG = CONFIG.replace("KIND_CPU", "KIND_GPU") + \
    'parameters { key: "kiln_precision" value { string_value: "fp32" } }\n'  # strict fp32: argmax as onnxruntime's
PROMPTS = ["hello world", "the system is", "an assistant", "or the user", "is it", "we and you", "to the", "s"]
STEPS = 32


@pytest.fixture(scope="module")
def gpu_server(tmp_path_factory):
    base = tmp_path_factory.mktemp("generative_gpu")
    repository = write_repository(base, GPU_CONFIG)
    long_config = repository / LONG_MODEL / "config.pbtxt"
    long_config.write_text(long_config.read_text().replace("KIND_CPU", "KIND_GPU"))
    with run_server(repository, base / "server.log", [MODEL, LONG_MODEL], ready_timeout_s=600) as server:
        yield server


def _completion(server, prompt: str) -> str:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=STEPS, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text


def test_cuda_greedy_text_matches_the_reference_alone_and_batched(gpu_server):
    from engine_core.generate.tokenizer import Tokenizer

    directory = gpu_server.repository / MODEL / "1"
    tokenizer = Tokenizer.from_directory(directory)
    expected = [tokenizer.decode(generative.reference_greedy(directory, tokenizer.encode(p), STEPS)) for p in PROMPTS]
    assert _completion(gpu_server, PROMPTS[0]) == expected[0]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # more streams than max_batch_size: some wait for a slot
        assert list(pool.map(lambda p: _completion(gpu_server, p), PROMPTS)) == expected
    wait_until_idle(gpu_server)


def test_cuda_stream_cut_by_the_client_frees_its_blocks(gpu_server):
    """A client that leaves mid-stream cancels its sequence and its blocks go back. The long model's 2,288 tokens keep
    even an H100 busy for longer than the client takes to leave (the short model's finished first)."""
    wait_until_idle(gpu_server, model=LONG_MODEL)
    before = metric(gpu_server, "kiln_generation_tokens_total", kind="completion", model=LONG_MODEL)
    wanted = LONG_CONTEXT - 16
    body = {"model": LONG_MODEL, "prompt": "the system", "max_tokens": wanted, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=120) as client, client.stream("POST", f"{gpu_server.base_url}/v1/completions",
                                                          json=body) as response:
        first = next(line for line in response.iter_lines() if line.startswith("data: "))
        assert json.loads(first[len("data: "):])["choices"][0]["finish_reason"] is None, first
    wait_until_idle(gpu_server, model=LONG_MODEL)  # the connection is gone: withdrawn, its blocks freed
    generated = metric(gpu_server, "kiln_generation_tokens_total", kind="completion", model=LONG_MODEL) - before
    assert 0 < generated < wanted, gpu_server.log_path.read_text()[-3000:]


def test_cuda_generation_runs_to_the_end_of_the_context(gpu_server):
    """Every decode past bucket up to the context (all captured at load) generates: max_tokens tokens come back."""
    client = openai.OpenAI(base_url=f"{gpu_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    done = client.completions.create(model=MODEL, prompt="the system", max_tokens=MAX_CONTEXT - 16, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == MAX_CONTEXT - 16 and done.choices[0].finish_reason == "length"
    log = gpu_server.log_path.read_text()
    # the loop out of the core's process: its own, or one per GPU where KIND_AUTO finds several
    assert "shape buckets captured" in log and re.search(r"\(cuda, (own process|\d+ replicas: GPU 0, GPU 1),", log)


@pytest.fixture(scope="module")
def replicated_gpu_server(tmp_path_factory):
    """The tiny decoder with two generation loops on every visible GPU (a KIND_GPU group without gpus)."""
    base = tmp_path_factory.mktemp("generative_gpu_replicas")
    repository = base / "models"
    generative.write_tiny_decoder(repository / "tiny_llm_x2" / "1", max_positions=MAX_CONTEXT)
    (repository / "tiny_llm_x2" / "config.pbtxt").write_text(
        GPU_CONFIG.replace("{ kind: KIND_GPU }", "{ kind: KIND_GPU count: 2 }"))
    with run_server(repository, base / "server.log", ["tiny_llm_x2"], ready_timeout_s=600) as server:
        yield server


def test_cuda_replicas_on_every_gpu_give_the_reference_text(replicated_gpu_server):
    from engine_core.cuda import device_count
    from engine_core.generate.tokenizer import Tokenizer

    server, gpus = replicated_gpu_server, device_count()
    config = httpx.get(f"{server.base_url}/v2/models/tiny_llm_x2/config", timeout=10).json()
    assert [(g["count"], g["gpus"]) for g in config["instance_group"]] == [(2, list(range(gpus)))]
    directory = server.repository / "tiny_llm_x2" / "1"
    tokenizer = Tokenizer.from_directory(directory)
    expected = [tokenizer.decode(generative.reference_greedy(directory, tokenizer.encode(p), STEPS)) for p in PROMPTS]
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)

    def complete(prompt: str) -> str:
        return client.completions.create(model="tiny_llm_x2", prompt=prompt, max_tokens=STEPS, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        assert list(pool.map(complete, PROMPTS)) == expected
    wait_until_idle(server, model="tiny_llm_x2")
    assert metric(server, "kiln_kv_cache_blocks_total", model="tiny_llm_x2") == 2 * gpus * 4 * MAX_CONTEXT // 8
    assert metric(server, "kiln_generation_tokens_total", kind="completion", model="tiny_llm_x2") == \
        len(PROMPTS) * STEPS
    placed = ", ".join(f"GPU {gpu}" for _ in range(2) for gpu in range(gpus))
    assert f"{2 * gpus} replicas: {placed}" in server.log_path.read_text()
