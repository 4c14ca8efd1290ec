"""The generation process: one generative model version's engine and `Generator`, out of the core's interpreter lock.

Started by `generation_process.RemoteGenerator` as `python -m server.core.generation_main FD` (the repository root on
PYTHONPATH) with one end of a socket pair. Why a process: the generator's thread steps the engine, and each of its driver calls gives the
interpreter lock away; in the core the event loop (streaming 64 sequences' tokens, detokenising them) holds it
most of the time, so every step waited for it several times (vLLM runs its engine core in a process for this).

Protocol (length-prefixed pickles, `executor_wire.Channel`): the first message is the load (model path, Generator
keyword arguments, build options); the reply is ("ok", info) once the engine is built and warm, or an error. Then
commands: ("submit", id, prompt, params) -> ("accepted", id) or ("refused", id, message); ("cancel", id);
("stats", token) -> ("stats", token, GeneratorStats); ("close",). Events go back as ("events", [(id, event),
...]): every event the generator emitted since the last message, so one decode step of 64 sequences is one message.
The parent closing its end closes the generator and ends the process.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine_core.generate.decoder import build_decoder_engine
from engine_core.generate.generator import GenerationEvent, GenerationHandle, Generator
from server.core.executor_wire import Channel, ExecutorGone, child_start, error_reply

log = logging.getLogger("kiln.generation")


class Outbox:
    """Events from the generator's thread to the socket, sent by a thread of their own in batches: the generator's
    thread only appends."""

    def __init__(self, channel: Channel, send_lock: threading.Lock) -> None:
        self._channel, self._send_lock = channel, send_lock
        self._events: list[tuple[int, GenerationEvent]] = []
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="kiln-generation-outbox", daemon=True)
        self._thread.start()

    def put(self, request_id: int, event: GenerationEvent) -> None:
        if event.error is not None:  # any exception crosses as its text (not every one pickles)
            event = replace(event, error=RuntimeError(f"{type(event.error).__name__}: {event.error}"))
        with self._wake:
            self._events.append((request_id, event))
            self._wake.notify()

    def close(self) -> None:
        """Send what is left, then stop."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._events and not self._closed:
                    self._wake.wait()
                events, self._events = self._events, []
                closed = self._closed
            if events:
                try:
                    with self._send_lock:
                        self._channel.send(("events", events))
                except ExecutorGone:
                    return
            if closed:
                return


def serve(channel: Channel, generator: Generator) -> None:
    """Answer the parent's commands until it closes or sends ("close",)."""
    send_lock = threading.Lock()
    outbox = Outbox(channel, send_lock)
    handles: dict[int, GenerationHandle] = {}
    ended: set[int] = set()  # ended before submit returned its handle (a fast sequence)
    handles_lock = threading.Lock()

    def reply(message: tuple) -> None:
        with send_lock:
            channel.send(message)

    try:
        while True:
            try:
                message, _ = channel.recv()
            except ExecutorGone:
                break
            kind = message[0]
            if kind == "submit":
                _, request_id, prompt, params = message

                def on_event(event: GenerationEvent, request_id: int = request_id) -> None:
                    if event.final:
                        with handles_lock:
                            if handles.pop(request_id, None) is None:
                                ended.add(request_id)
                    outbox.put(request_id, event)

                try:
                    handle = generator.submit(prompt, params, on_event)
                except (ValueError, RuntimeError) as e:
                    reply(("refused", request_id, type(e).__name__, str(e)))
                    continue
                with handles_lock:
                    if request_id in ended:
                        ended.discard(request_id)
                    else:
                        handles[request_id] = handle
                reply(("accepted", request_id))
            elif kind == "cancel":
                held = handles.get(message[1])
                if held is not None:
                    held.cancel()
            elif kind == "stats":
                reply(("stats", message[1], generator.stats()))
            elif kind == "close":
                break
    finally:
        generator.close()  # the sequences still going end with "cancelled" events
        outbox.close()


def load(request: dict[str, Any]) -> tuple[Generator, dict[str, Any]]:
    """Build the engine and start the generator (warm-up included) as the load message asks."""
    engine = build_decoder_engine(Path(request["model_path"]), **request["build"])
    generator = Generator(engine, **request["generator"])
    info = {"vocab_size": generator.vocab_size, "warmed_shapes": generator.warmed_shapes,
            "warm_up_seconds": generator.warm_up_seconds, "max_batch_size": generator.max_batch_size,
            "max_context": generator.max_context}
    return generator, info


def main(argv: list[str] | None = None) -> int:
    started = child_start(argv, "kiln-generation")
    if started is None:
        return 0
    channel, request = started  # child_start set the switch interval: the command and outbox threads get the lock
    # back within a fraction of a step (a submit is a round trip the core's event loop waits for), not Python's 5 ms
    try:
        generator, info = load(request)
    except Exception as e:  # noqa: BLE001 - the parent fails the load with the message
        channel.send(error_reply(e))
        return 1
    channel.send(("ok", info))
    serve(channel, generator)
    channel.close()
    return 0


if __name__ == "__main__":
    os._exit(main())
