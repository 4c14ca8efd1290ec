"""Real servers with examples/generative.py's tiny decoder as `tiny_llm` (backend kiln_llm, KIND_CPU), started once for
test_generative.py and test_openai.py, and what those tests compute the expected text with: Kiln's tokenizer on the
same files and onnxruntime's greedy reference (no KV cache).

`llm_server` runs HTTP and gRPC in the server process (or as KILN_TEST_FRONTEND_PROCESSES says); `llm_remote`
runs them in two frontend processes, so streams and withdrawals cross server/core/remote.py.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest

from engine_core.generate.tokenizer import Tokenizer
from tests.support.examples import load_example

from ..conftest import examples, run_server

MODEL = "tiny_llm"
MAX_CONTEXT = 768  # long enough that a stream cut early is still generating when the server notices
CONFIG = f'''backend: "kiln_llm"
max_batch_size: 4
instance_group [ {{ kind: KIND_CPU }} ]
parameters {{ key: "max_context" value {{ string_value: "{MAX_CONTEXT}" }} }}
parameters {{ key: "kv_block_tokens" value {{ string_value: "8" }} }}
'''


#: the same decoder with a context for prompts over generative.INLINE_PROMPT_BYTES (read in a worker thread)
LONG_MODEL, LONG_CONTEXT = "tiny_llm_long", 2304

generative = load_example("generative.py")


def write_repository(base: Path, config: str = CONFIG) -> Path:
    repo = base / "models"
    generative.write_tiny_decoder(repo / MODEL / "1", max_positions=MAX_CONTEXT)
    (repo / MODEL / "config.pbtxt").write_text(config)
    generative.write_tiny_decoder(repo / LONG_MODEL / "1", max_positions=LONG_CONTEXT)
    (repo / LONG_MODEL / "config.pbtxt").write_text(
        CONFIG.replace("max_batch_size: 4", "max_batch_size: 1").replace(f'"{MAX_CONTEXT}"', f'"{LONG_CONTEXT}"'))
    examples.write_model(repo, "identity", examples.identity_model(), examples.IDENTITY_CONFIG)  # not generative
    return repo


@pytest.fixture(scope="session")
def llm_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_repository(tmp_path_factory.mktemp("generative"))


@pytest.fixture(scope="session")
def llm_server(llm_repository: Path, tmp_path_factory: pytest.TempPathFactory):
    with run_server(llm_repository, tmp_path_factory.mktemp("llm_log") / "server.log",
                    [MODEL, LONG_MODEL, "identity"]) as server:
        yield server


@pytest.fixture(scope="session")
def llm_remote(llm_repository: Path, tmp_path_factory: pytest.TempPathFactory):
    """Everything out of the core's process: frontends in two processes, the generation loop in its own
    (server/core/generation_process.py, the CUDA models' default)."""
    with run_server(llm_repository, tmp_path_factory.mktemp("llm_remote_log") / "server.log", [MODEL],
                     ["--frontend-processes", "2"], env={"KILN_GENERATION_PROCESS": "1"}) as server:
        yield server


@pytest.fixture(scope="session")
def tokenizer(llm_repository: Path) -> Tokenizer:
    return Tokenizer.from_directory(llm_repository / MODEL / "1")


def greedy_text(repository: Path, tokenizer: Tokenizer, prompt_ids: list[int], steps: int, model: str = MODEL
                ) -> tuple[str, str]:
    """The text the greedy reference generates after `prompt_ids` in at most `steps` tokens (cut before an end
    token, as the server stops there) and the finish reason ("stop" or "length")."""
    ids = generative.reference_greedy(repository / model / "1", prompt_ids, steps)
    ends = {tokenizer.token_id(token) for token in (generative.IM_END, generative.ENDOFTEXT)}
    cut = next((i for i, token in enumerate(ids) if token in ends), None)
    if cut is None:
        return tokenizer.decode(ids), "length"
    return tokenizer.decode(ids[:cut]), "stop"


def metric(server, name: str, **labels: str) -> float:
    """The value of one sample of /metrics (model tiny_llm, version 1, and `labels`)."""
    text = httpx.get(server.metrics_url, timeout=10).text
    wanted = {"model": MODEL, "version": "1", **labels}
    for line in text.splitlines():
        match = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
        if match and dict(re.findall(r'(\w+)="([^"]*)"', match.group(1))) == wanted:
            return float(match.group(2))
    raise AssertionError(f"no sample {name}{wanted} in /metrics")


def wait_until_idle(server, timeout_s: float = 10.0, model: str = MODEL) -> None:
    """Until no sequence of ``model`` runs or waits and none of its KV blocks is held (the generator frees blocks
    between steps)."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = (metric(server, "kiln_kv_cache_blocks_used", model=model),
                  metric(server, "kiln_generation_sequences", state="running", model=model),
                  metric(server, "kiln_generation_sequences", state="waiting", model=model))
        if values == (0, 0, 0):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"still busy after {timeout_s} s: blocks used, running, waiting = {values}")
        time.sleep(0.05)
