"""A generative model version's generation loop in a process of its own (`generation_main.py`), behind the
`Generator` interface the core uses (`submit`, `stats`, `close`).

Why: in the core, the generator's thread and the event loop share one interpreter lock. The loop streams every
sequence's tokens (detokenising, one response per token and stream), and each of the generator's driver calls in a
step gives the lock away and waits to get it back. On an H100 a 1B model's 5.3 ms decode step served a 7.9 ms
inter-token latency at 64 streams in the core's thread; prefill runs between decode steps account for part of that,
the lock for the rest (not yet measured apart: docs/next-steps.md). vLLM runs its engine core in a process for the
same reason.

`RemoteGenerator` starts the process, hands it the model and the generator's settings, and waits until the engine is
built and warm (a failure fails the load with the process's message). `submit` is one round trip (the process
checks the prompt as `Generator.submit` does: ValueError for the client's mistakes); events come back in batches on
a reader thread and go to each request's callback, as the in-process generator's would from its thread. A process
that exits ends every sequence it was running with an error event; the version then refuses new requests
(RuntimeError -> UNAVAILABLE) until it is loaded again.

A replica on a GPU other than the server's device 0 (generation_replicas.py) always runs in a process: its
CUDA_VISIBLE_DEVICES lists that GPU first, so the engine's device 0 there is that GPU.

`KILN_GENERATION_PROCESS` picks where generative models run: `1` a process for every backend, `0` the core's thread
for every backend; unset, CUDA models get a process and CPU models the thread.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from engine_core.generate.generator import GenerationEvent, GeneratorStats
from engine_core.generate.sampling import SamplingParams

from .executor import stop_process
from .executor_wire import ExecutorGone, child_launch, env_number, raise_reply

log = logging.getLogger("kiln.server.generation")

#: seconds a load may take (build and warm-up of a large model on a cold machine)
START_TIMEOUT_S = env_number("KILN_GENERATION_START_TIMEOUT_S", 900, 0.001)
#: seconds a command's reply may take before the process counts as hung
REPLY_TIMEOUT_S = 60.0


def use_process(backend: str) -> bool:
    """Whether a generative model on ``backend`` runs its loop in a process (module docstring)."""
    setting = os.environ.get("KILN_GENERATION_PROCESS", "")
    return setting == "1" if setting in ("0", "1") else backend == "cuda"


class RemoteHandle:
    """The submitter's hold on a sequence in the process (as `GenerationHandle`)."""

    def __init__(self, generator: RemoteGenerator, request_id: int) -> None:
        self._generator, self._id = generator, request_id
        self._cancelled = False

    def cancel(self) -> None:
        """Stop the sequence at the process's next step boundary (idempotent)."""
        if not self._cancelled:
            self._cancelled = True
            self._generator._send(("cancel", self._id), quiet=True)

    @property
    def cancelled(self) -> bool:
        return self._cancelled


class _Reply:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.message: tuple | None = None


class RemoteGenerator:
    """`Generator`'s interface over a generation process (module docstring). ``build`` are
    `build_decoder_engine`'s keyword arguments, ``generator`` `Generator`'s; ``env`` variables the process gets on
    top of the server's (a GPU replica's CUDA_VISIBLE_DEVICES, its GPU first: `placement.child_visible_devices`)."""

    def __init__(self, model_path: Path, *, build: dict[str, Any], generator: dict[str, Any], label: str,
                 env: Mapping[str, str] | None = None) -> None:
        self.label = label
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._handlers: dict[int, Callable[[GenerationEvent], None]] = {}
        self._replies: dict[tuple[str, int], _Reply] = {}
        self._ids = itertools.count()
        self._closed = False
        self._exit: str | None = None
        self._process, self._channel = child_launch("server.core.generation_main", env)
        ours = self._channel.sock
        try:
            self._channel.send({"model_path": str(model_path), "build": build, "generator": generator})
            ours.settimeout(START_TIMEOUT_S)
            try:
                reply, _ = self._channel.recv()
            except TimeoutError:
                raise RuntimeError(f"{label}: the generation process was not ready within {START_TIMEOUT_S:g} s "
                                   "(KILN_GENERATION_START_TIMEOUT_S)") from None
            except ExecutorGone:
                raise RuntimeError(f"{label}: the generation process exited with code {self._process.wait()} "
                                   "while loading (its log above says why)") from None
            ours.settimeout(None)
            info = raise_reply(reply)  # ValueError (not a decoder) as raised; others as RemoteError
        except BaseException:
            self._channel.close()
            stop_process(self._process, 30.0)
            raise
        self.vocab_size: int = info["vocab_size"]
        self.max_batch_size: int = info["max_batch_size"]
        self.max_context: int = info["max_context"]
        self.warmed_shapes: int = info["warmed_shapes"]
        self.warm_up_seconds: float = info["warm_up_seconds"]
        self._reader = threading.Thread(target=self._read, name=f"kiln-generation-{label}", daemon=True)
        self._reader.start()

    # -- the Generator interface ------------------------------------------------------------------------------
    def submit(self, prompt: Sequence[int], params: SamplingParams,
               on_event: Callable[[GenerationEvent], None]) -> RemoteHandle:
        """Queue a sequence in the process; ``on_event`` is called from the reader thread once per event. ValueError
        (the client's to fix) as `Generator.submit` raises it; RuntimeError once closed or the process is gone."""
        request_id = next(self._ids)
        with self._lock:
            self._check_open()
            self._handlers[request_id] = on_event  # before the submit: events may come before its reply
        try:
            reply = self._request(("submit", request_id, [int(t) for t in prompt], params), ("submit", request_id))
        except BaseException:
            with self._lock:
                self._handlers.pop(request_id, None)
            raise
        if reply[0] == "refused":
            with self._lock:
                self._handlers.pop(request_id, None)
            _, _, kind, message = reply
            raise (ValueError if kind == "ValueError" else RuntimeError)(message)
        return RemoteHandle(self, request_id)

    def stats(self) -> GeneratorStats:
        """The process's generator statistics (one round trip); all zero but the pool's size once it is gone."""
        token = next(self._ids)
        try:
            return self._request(("stats", token), ("stats", token))[2]
        except RuntimeError:
            return GeneratorStats(running=0, waiting=0, kv_blocks_used=0, kv_blocks_total=0, prompt_tokens_total=0,
                                  completion_tokens_total=0)

    def close(self) -> None:
        """Close the process's generator (its running sequences end with "cancelled" events) and wait for the process
        to exit (killed after a while). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._send(("close",), quiet=True)
        stop_process(self._process, 30.0)
        self._reader.join(timeout=10)
        self._channel.close()

    # -- the wire ---------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the generator is closed")
        if self._exit is not None:
            raise RuntimeError(self._exit)

    def _send(self, message: tuple, quiet: bool = False) -> None:
        try:
            with self._send_lock:
                self._channel.send(message)
        except (ExecutorGone, OSError) as e:
            if not quiet:
                raise RuntimeError(f"{self.label}: the generation process is gone: {e}") from None

    def _request(self, message: tuple, key: tuple[str, int]) -> tuple:
        waiter = _Reply()
        with self._lock:
            self._check_open()
            self._replies[key] = waiter
        try:
            self._send(message)
            if not waiter.done.wait(REPLY_TIMEOUT_S):
                raise RuntimeError(f"{self.label}: the generation process did not answer within {REPLY_TIMEOUT_S:g} s")
        finally:
            with self._lock:
                self._replies.pop(key, None)
        if waiter.message is None:
            raise RuntimeError(self._exit or f"{self.label}: the generation process is gone")
        return waiter.message

    def _read(self) -> None:
        """The reader thread: events to their callbacks, replies to their waiters; at the end (the process exited or
        closed), every sequence still going ends with an error event."""
        try:
            while True:
                message, _ = self._channel.recv()
                if message[0] == "events":
                    self._deliver(message[1])
                else:
                    key = ("submit", message[1]) if message[0] in ("accepted", "refused") else ("stats", message[1])
                    with self._lock:
                        waiter = self._replies.get(key)
                    if waiter is not None:
                        waiter.message = message
                        waiter.done.set()
        except (ExecutorGone, OSError):
            pass
        self._gone()

    def _deliver(self, events: list[tuple[int, GenerationEvent]]) -> None:
        for request_id, event in events:
            with self._lock:
                handler = self._handlers.pop(request_id, None) if event.final else self._handlers.get(request_id)
            if handler is None:
                continue
            try:
                handler(event)
            except Exception:  # noqa: BLE001 - one request's consumer must not stop the others' events
                log.exception("%s: generation event handler failed", self.label)

    def _gone(self) -> None:
        code = self._process.poll()
        with self._lock:
            if not self._closed:
                self._exit = (f"{self.label}: the generation process exited"
                              + (f" with code {code}" if code is not None else "") + "; load the model again")
                log.error("%s", self._exit)
            handlers, self._handlers = self._handlers, {}
            waiters = list(self._replies.values())
        for waiter in waiters:
            waiter.done.set()
        error = RuntimeError(self._exit or f"{self.label}: the generation process was closed")
        for handler in handlers.values():
            try:
                handler(GenerationEvent(None, "error" if self._exit else "cancelled", 0, 0, error))
            except Exception:  # noqa: BLE001
                log.exception("%s: generation event handler failed", self.label)
