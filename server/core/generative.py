"""Generative models (`backend: "kiln_llm"`): a decoder-only ONNX model served by a continuous-batching generation
loop (engine_core/generate), streamed as text.

Loading (`load_versions`): the config is completed (generative_config.py), then per version the tokenizer is read
from the version directory (tokenizer.json, tokenizer_config.json; generation_config.json's eos_token_id adds end
tokens), and each replica the instance groups place (`generative_config.place_replicas`: count loops per listed GPU,
or on the CPU) builds the decoder engine (`build_decoder_engine`: instance_group KIND_CPU -> cpu, KIND_GPU -> cuda)
and starts a `Generator` loop, all replicas together; several are served as one (generation_replicas.Replicas).
Unloading closes the generator(s): sequences still going end with an error.

Serving: the version is decoupled and has its own `submit_stream` (decoupled.py hands it every stream: gRPC
ModelStreamInfer, HTTP generate / generate_stream, the OpenAI routes). A request is read (generative_request.py),
tokenized and submitted; the generator's events (one per token, from its thread) come back to the event loop, where
the text grows through `CompletionText`. With `stream` true every new piece of text is one response; otherwise one
response carries the whole text (after the prompt unless `exclude_input_in_output`). Every response has
text_output, finish_reason ("" until the last: "stop" or "length"), num_input_tokens and num_output_tokens (those
the request asked for, when it names outputs); with `return_logprobs` also `logprobs`, the vLLM backend's JSON of
the tokens since the previous response (`token_logprobs_entry`). Withdrawing the stream (a client that left) cancels
the sequence, and the generator frees its KV blocks.

Statistics as a decoupled model's: each request counts once, success or failure, when it ends (a withdrawn one as a
success: it ran); one execution per request. Time to first token and inter-token latency go to histograms read by
/metrics (server/metrics_generative.py).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from engine_core.generate.decoder import build_decoder_engine
from engine_core.generate.generator import GenerationEvent, GenerationHandle, Generator
from engine_core.generate.sampling import TokenLogprobs
from engine_core.generate.tokenizer import Tokenizer, TokenizerError
from server.repository import ModelSource, select_versions

from .decoupled import OnPart, Stream, StreamPart
from .errors import ErrorKind, ServerError, invalid
from .generation_process import RemoteGenerator, RemoteHandle, use_process
from .generation_replicas import Replicas, start_together
from .generative_config import (
    GenerationSettings,
    complete_generative_config,
    generation_settings,
    is_generative,
    place_replicas,
)
from .generative_request import CompletionText, GenerationRequest, read_request
from .latency import Histogram
from .loading import load_together
from .model import ServedModel, _backend_for
from .model_config import ModelConfig
from .placement import Devices, child_visible_devices, visible_devices
from .statistics import ExecutionTimes
from .types import InferRequest

__all__ = ["GenerativeVersion", "is_generative", "load_versions"]

log = logging.getLogger("kiln.server.generative")

#: upper bounds (seconds) of the time-to-first-token and inter-token-latency histograms (vLLM's, and finer ones for
#: small models)
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
#: prompts longer than this (bytes) are templated and tokenized in a worker thread: pure-Python BPE takes ~1 ms per
#: 1,500 characters, which on the event loop would hold every other request of the server
INLINE_PROMPT_BYTES = 4096
ITL_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
#: the lowest log-probability sent (JSON has no -Infinity; vLLM's OpenAI server clamps there too)
MIN_LOGPROB = -9999.0


class GenerativeVersion(ServedModel):
    """A loaded generative model version: its tokenizer and generation loop, served as a stream of text."""

    decoupled = True

    def __init__(self, name: str, version: int, config: ModelConfig, tokenizer: Tokenizer,
                 generator: Generator | RemoteGenerator | Replicas, backend: str) -> None:
        super().__init__(name, version, config, labels={})
        self.tokenizer = tokenizer
        self.generator = generator
        self.backend = backend
        self.time_to_first_token = Histogram(TTFT_BUCKETS_S)
        self.inter_token_latency = Histogram(ITL_BUCKETS_S)
        self.label = f"model '{name}' version {version}"
        self._token_texts: dict[int, str] = {}
        self._pump: EventPump | None = None

    def pump(self) -> EventPump:
        """The version's EventPump (made on the event loop's thread, at the first request)."""
        if self._pump is None:
            self._pump = EventPump(asyncio.get_running_loop())
        return self._pump

    def token_text(self, token_id: int) -> str:
        """One token decoded on its own, special tokens spelled out (vLLM's `decoded_token`; a piece of a UTF-8
        character is U+FFFD)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def check_inputs(self, arrays: dict[str, Any], datatypes: dict[str, str]) -> tuple[dict[str, np.ndarray], int]:
        """Every input optional (generative_request says which prompt input a request needs), each one element:
        shape [1], or [1, 1] with the batch dim a batching config gives its inputs (one prompt per request)."""
        unknown = sorted(set(arrays) - set(self.inputs))
        if unknown:
            raise invalid(f"unexpected inference input {unknown} for model '{self.name}' (inputs: {sorted(self.inputs)})")
        batch = 0
        for name, array in arrays.items():
            spec, shape = self.inputs[name], tuple(np.shape(array))
            if datatypes[name] != spec.datatype:
                raise invalid(f"inference input '{name}' data-type is '{datatypes[name]}', but model '{self.name}' "
                              f"expects '{spec.datatype}'")
            if shape not in ((1,), (1, 1)):
                raise invalid(f"unexpected shape for input '{name}' for model '{self.name}'. Expected [1] (or [1, 1] "
                              f"with a batch dim: one prompt per request), got {list(shape)}")
            batch = max(batch, len(shape) - 1)
        return {name: np.asarray(array) for name, array in arrays.items()}, batch

    def submit_stream(self, core: Any, request: InferRequest, on_part: OnPart) -> _Withdrawal | None:
        """`decoupled.submit_stream` for this model (see the module docstring): returns what to cancel to withdraw
        the request, or None when it was answered at once (a bad request: one final error part). A prompt over
        `INLINE_PROMPT_BYTES` is read (templated, tokenized) in a worker thread, not on the event loop."""
        started = time.perf_counter_ns()
        try:
            inputs, batched, requested = core._checked(self, request)
            stream = Stream(core, self, request, requested, on_part)
            read = functools.partial(read_request, self.tokenizer, inputs, request.parameters, f"model '{self.name}'")
            withdrawal = _Withdrawal(self, stream, bool(batched), started)
            if _prompt_bytes(inputs) <= INLINE_PROMPT_BYTES:
                withdrawal.start(read())
            else:
                asyncio.get_running_loop().run_in_executor(None, read).add_done_callback(withdrawal.read)
        except Exception as e:  # noqa: BLE001 - answered, as a request that never ran
            on_part(StreamPart(error=self.refusal(e, started), final=True))
            return None
        return withdrawal

    def refusal(self, error: BaseException, started_ns: int) -> ServerError:
        """What a request that never ran is answered (counted as a failure)."""
        self.statistics.record_failure(time.perf_counter_ns() - started_ns)
        return error if isinstance(error, ServerError) else _internal(self, error)

    def close(self) -> None:
        """Stop the generation loop(s); the sequences still going end (their streams with an error)."""
        self.generator.close()


class _Withdrawal:
    """What a stream's caller cancels: the request before its generation starts (while its prompt is read in a
    worker thread), then its sequence (the generator frees its KV blocks)."""

    def __init__(self, model: GenerativeVersion, stream: Stream, batched: bool, started_ns: int) -> None:
        self._model = model
        self._stream = stream
        self._batched = batched
        self._started_ns = started_ns
        self._generation: _Generation | None = None
        self._cancelled = False

    def read(self, done: asyncio.Future) -> None:
        """The worker thread read the request: start it (unless the caller left meanwhile) or refuse it."""
        if self._cancelled:
            return
        try:
            self.start(done.result())
        except Exception as e:  # noqa: BLE001 - answered, as a request that never ran
            self._stream.deliver(None, self._model.refusal(e, self._started_ns), True)

    def start(self, wanted: GenerationRequest) -> None:
        """Submit the read request to the generator; raises ServerError when it cannot run."""
        model = self._model
        generation = _Generation(model, self._stream, wanted, self._batched, self._started_ns)
        try:
            generation.handle = model.generator.submit(wanted.prompt_ids, wanted.params, generation.event)
        except ValueError as e:  # the prompt does not fit (too long, empty, unknown ids): the client's to fix
            raise invalid(f"model '{model.name}': {e}") from None
        except RuntimeError as e:  # closed: the version was unloaded meanwhile
            raise ServerError(ErrorKind.UNAVAILABLE, f"{model.label}: {e}") from None
        self._generation = generation

    def cancel(self) -> None:
        self._cancelled = True
        if self._generation is not None:
            self._generation.withdraw()
        else:
            self._stream.withdraw()


def _prompt_bytes(inputs: dict[str, np.ndarray]) -> int:
    """How long the request's prompt is (text_input or messages), in bytes as it came."""
    return sum(len(bytes(v)) if isinstance(v, bytes | bytearray) else len(str(v))
               for name in ("text_input", "messages") if name in inputs
               for v in np.asarray(inputs[name], dtype=object).reshape(-1))


class EventPump:
    """The generator's events to the event loop, many per wake-up: one decode step of 64 sequences is one
    `call_soon_threadsafe` (a self-pipe write and a loop wake-up each), not 64. Events keep their order and the
    time they came."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._queue: list[tuple[Callable[[GenerationEvent, int], None], GenerationEvent, int]] = []
        self._scheduled = False

    def put(self, handler: Callable[[GenerationEvent, int], None], event: GenerationEvent) -> None:
        """From the generator's thread: `handler(event, at_ns)` runs on the loop soon."""
        item = (handler, event, time.perf_counter_ns())
        with self._lock:
            self._queue.append(item)
            if self._scheduled:
                return
            self._scheduled = True
        self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            items, self._queue = self._queue, []
            self._scheduled = False
        for handler, event, at_ns in items:
            try:
                handler(event, at_ns)
            except Exception:  # noqa: BLE001 - one request's bug must not drop the other requests' events
                log.exception("generation event handler failed")


class _Generation:
    """One request while it generates: the generator's events turned into responses on the event loop."""

    def __init__(self, model: GenerativeVersion, stream: Stream, request: GenerationRequest, batched: bool,
                 started_ns: int) -> None:
        self.model = model
        self.stream = stream
        self.request = request
        self.batched = batched
        self.started_ns = started_ns
        self.text = CompletionText(model.tokenizer, request.stops)
        self.handle: GenerationHandle | RemoteHandle | None = None
        self.last_token_ns: int | None = None
        self.logprobs: list[dict[str, dict[str, Any]]] = []  # the tokens' since the last response (return_logprobs)
        self._pump = model.pump()
        self._ended = False

    def event(self, event: GenerationEvent) -> None:
        """The generator's callback, on its thread: the event goes to the event loop, with when it came."""
        self._pump.put(self._handle, event)

    def _handle(self, event: GenerationEvent, at_ns: int) -> None:
        if self._ended:
            return
        if event.token_id is not None:
            self._timed(at_ns)
            self.text.push(event.token_id)
            if self.request.return_logprobs and event.logprobs is not None:
                self.logprobs.append(token_logprobs_entry(self.model, event.token_id, event.logprobs))
        if event.finish_reason in ("error", "cancelled") and not self.text.stopped:
            self._fail(event)
            return
        if event.final:
            self.text.finish()
        reason = "stop" if self.text.stopped else event.finish_reason
        if reason is not None and not event.final and self.handle is not None:
            self.handle.cancel()  # a stop string ended it: the generator frees its blocks
        final = reason is not None
        if self.request.stream:
            piece = self.text.take(final)
            if piece or final:
                self._send(piece, reason, event, final)
        elif final:
            prefix = "" if self.request.exclude_input else self.request.prompt_text
            self._send(prefix + self.text.take(True), reason, event, True)
        if final:
            self._end(succeeded=True)

    def _timed(self, at_ns: int) -> None:
        if self.last_token_ns is None:
            self.model.time_to_first_token.observe((at_ns - self.started_ns) / 1e9)
        else:
            self.model.inter_token_latency.observe((at_ns - self.last_token_ns) / 1e9)
        self.last_token_ns = at_ns

    def _send(self, text: str, reason: str | None, event: GenerationEvent, final: bool) -> None:
        lead = (1,) if self.batched else ()
        outputs = {"text_output": np.array([text.encode()], dtype=object).reshape(*lead, 1),
                   "finish_reason": np.array([(reason or "").encode()], dtype=object).reshape(*lead, 1),
                   "num_input_tokens": np.array([event.prompt_tokens], np.uint32).reshape(*lead, 1),
                   "num_output_tokens": np.array([event.completion_tokens], np.uint32).reshape(*lead, 1)}
        if self.request.return_logprobs:
            asked = self.request.params.logprobs is not None
            text = json.dumps(self.logprobs if asked else None, separators=(",", ":"))
            outputs["logprobs"] = np.array([text.encode()], dtype=object).reshape(*lead, 1)
            self.logprobs = []
        self.stream.deliver(outputs, None, final)

    def _fail(self, event: GenerationEvent) -> None:
        if event.finish_reason == "cancelled":  # not withdrawn by the caller: the generator was closed
            error = ServerError(ErrorKind.UNAVAILABLE, f"{self.model.label} was unloaded while the request was "
                                                       "generating")
        else:
            error = _internal(self.model, event.error or RuntimeError("generation failed"))
        self.stream.deliver(None, error, True)
        self._end(succeeded=False)

    def withdraw(self) -> None:
        """The caller left: nothing more reaches it, and the sequence is cancelled."""
        if self._ended:
            return
        self.stream.withdraw()
        if self.handle is not None:
            self.handle.cancel()
        self._end(succeeded=True)

    def _end(self, succeeded: bool) -> None:
        self._ended = True
        total = time.perf_counter_ns() - self.started_ns
        statistics = self.model.statistics
        if succeeded:
            times = ExecutionTimes(compute_infer_ns=total)
            statistics.record_success(1, total, times)
            statistics.record_execution(1, times)
        else:
            statistics.record_failure(total)


def token_logprobs_entry(model: GenerativeVersion, token_id: int, logprobs: TokenLogprobs) -> dict[str, dict[str, Any]]:
    """One token's entry of the `logprobs` output, as Triton's vLLM backend writes vLLM's: token id (a string, JSON's
    keys) -> {logprob, rank, decoded_token}, the chosen token first, then the most likely ones (the chosen one once)."""
    entry = {str(token_id): _logprob(model, token_id, logprobs.logprob, logprobs.rank)}
    for rank, (token, logprob) in enumerate(logprobs.top, 1):
        entry.setdefault(str(token), _logprob(model, token, logprob, rank))
    return entry


def _logprob(model: GenerativeVersion, token_id: int, logprob: float, rank: int) -> dict[str, Any]:
    return {"logprob": max(logprob, MIN_LOGPROB), "rank": rank, "decoded_token": model.token_text(token_id)}


def _internal(model: GenerativeVersion, error: BaseException) -> ServerError:
    log.error("%s: generation failed", model.label, exc_info=error)
    return ServerError(ErrorKind.INTERNAL, f"{model.label}: generation failed: {type(error).__name__}: {error}")


# -- loading ----------------------------------------------------------------------------------------------------
async def load_versions(source: ModelSource, config: ModelConfig, default_max_batch_size: int
                        ) -> dict[int, ServedModel]:
    """Every version the config's policy selects, loaded together (all or none)."""
    config = complete_generative_config(config, source.name, default_max_batch_size)
    settings = generation_settings(config)
    backend = _backend_for(config)
    devices = visible_devices() if backend == "cuda" else Devices(0, str)
    replicas = place_replicas(config, backend, lambda: devices)  # the config now lists the GPUs
    wanted = select_versions(config.version_policy, list(source.versions))
    return dict(await load_together(asyncio.to_thread(_load_version, source, v, config, settings, backend, replicas,
                                                      devices.count) for v in wanted))


def _load_version(source: ModelSource, version: int, config: ModelConfig, settings: GenerationSettings, backend: str,
                  replicas: list[int | None], device_count: int) -> GenerativeVersion:
    """One version (blocking: runs in a thread): its replicas (one per entry of `replicas`: a GPU, or None for the
    CPU) started together."""
    label = f"model '{source.name}' version {version}"
    path: Path = source.model_file(version, config.default_model_filename)
    if not path.is_file():
        raise invalid(f"{label}: '{config.default_model_filename}' is missing in {path.parent}")
    try:
        tokenizer = Tokenizer.from_directory(path.parent)
    except (TokenizerError, OSError, ValueError) as e:
        raise invalid(f"{label}: its tokenizer cannot be read: {e}") from None
    build: dict[str, Any] = {"max_batch_size": settings.max_batch_size, "max_context": settings.max_context,
                             "backend": backend, "fp16": settings.fp16, "tf32": settings.tf32}
    loop: dict[str, Any] = {"max_batch_size": settings.max_batch_size, "max_context": settings.max_context,
                            "eos_token_ids": _eos_token_ids(tokenizer, path.parent, label),
                            "block_tokens": settings.block_tokens, "num_blocks": settings.num_blocks,
                            "max_prefill_tokens": settings.max_prefill_tokens,
                            "enable_prefix_caching": settings.prefix_caching, "warm_up": settings.warm_up,
                            "name": f"kiln-llm-{source.name}-{version}"}
    several = len(replicas) > 1
    starts = [functools.partial(_start_replica, path, build,
                                {**loop, "name": f"{loop['name']}-{index}"} if several else loop,
                                f"{label} replica {index} ({_device_name(device)})" if several else label,
                                device, device_count)
              for index, device in enumerate(replicas)]
    try:
        generator = start_together(starts)
    except ValueError as e:  # not a decoder the generation loop can run (its message names what is missing)
        raise invalid(f"{label}: {e}") from None
    log.info("%s: generation loop%s ready (%s, %s, %d sequences per step, context %d tokens, %d KV blocks of %d "
             "tokens, prefix caching %s, %d shape buckets captured in %.1f s)", label, "s" if several else "",
             backend, _where(generator, replicas), settings.max_batch_size, settings.max_context,
             generator.stats().kv_blocks_total, settings.block_tokens, "on" if settings.prefix_caching else "off",
             generator.warmed_shapes, generator.warm_up_seconds)
    return GenerativeVersion(source.name, version, config, tokenizer, generator, backend)


def _start_replica(path: Path, build: dict[str, Any], loop: dict[str, Any], label: str, device: int | None,
                   device_count: int) -> Generator | RemoteGenerator:
    """One generation loop: a GPU other than the server's device 0 always in a process of its own that sees that GPU
    as its device 0; else where `use_process` says."""
    if device is not None and (device != 0 or use_process(build["backend"])):
        env = {"CUDA_VISIBLE_DEVICES": child_visible_devices(device, device_count, os.environ)}
        return RemoteGenerator(path, build=build, generator=loop, label=label, env=env)
    if use_process(build["backend"]):
        return RemoteGenerator(path, build=build, generator=loop, label=label)
    return Generator(build_decoder_engine(path, **build), **loop)


def _device_name(device: int | None) -> str:
    return "CPU" if device is None else f"GPU {device}"


def _where(generator: Generator | RemoteGenerator | Replicas, replicas: list[int | None]) -> str:
    """Where the version's loops run, for the load's log line."""
    if isinstance(generator, Replicas):
        return f"{len(replicas)} replicas: " + ", ".join(_device_name(device) for device in replicas)
    return "own process" if isinstance(generator, RemoteGenerator) else "core thread"


def _eos_token_ids(tokenizer: Tokenizer, directory: Path, label: str) -> frozenset[int]:
    """The tokenizer's end tokens and generation_config.json's eos_token_id (an id or a list of them)."""
    ids = set(tokenizer.eos_token_ids)
    path = directory / "generation_config.json"
    if path.is_file():
        try:
            value = json.loads(path.read_text()).get("eos_token_id")
        except (ValueError, AttributeError) as e:
            raise invalid(f"{label}: generation_config.json: {e}") from None
        values = value if isinstance(value, list) else [value] if value is not None else []
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            raise invalid(f"{label}: generation_config.json: eos_token_id must be a token id or a list of them, "
                          f"got {value!r}")
        ids.update(values)
    if not ids:
        log.warning("%s: no end-of-sequence token (tokenizer_config.json eos_token, generation_config.json "
                    "eos_token_id): sequences end at max_tokens or a stop", label)
    return frozenset(ids)
