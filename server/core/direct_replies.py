"""Responses that an executor process sends straight to the frontend process that asked, not back through the core.

Why (docs/performance.md "process by process", issue #29): a batch's outputs went executor -> core lane thread ->
core event loop (a response per member) -> frontend: at BERT-base's c=64 about 1 ms of a 7 ms request, in two
hand-offs and the core loop's answer work, during which the other requests waited for that loop.

How: a frontend process listens on an inbox, a Unix socket of its own, and names it to the core (`remote.INBOX`);
the core tells every executor (`executor.inbox_registered`), whose control thread connects to it. A job the core
would answer without work of its own (`route_for`: a request from a frontend process to a model in executor
processes, every requested output in the engine's dtype and shape, no classification, shared memory, response
cache or trace) carries a `Route`: the frontend's inbox, its call id and what the response names. The executor sends
each routed part its rows as the very response the core would have sent, in framing.py's frames (one frame per
frontend and batch), then tells the core which parts it delivered; for those the core records statistics, gives back
the in-flight slot and sends nothing (`DELIVERED`). A part the executor cannot deliver (no inbox connected, a send
that fails) comes back to the core with its outputs and is answered as before; a failed execution is answered by
the core as before.

What a client may see: its response before the core has counted it in the model's statistics (Triton's backends
also report statistics after sending the responses). `KILN_DIRECT_REPLIES=0` turns direct replies off.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from .framing import HIGH_WATER, encode
from .types import InferOutput, InferResponse, RequestedOutput

log = logging.getLogger("kiln.server.direct")

#: the output parameters a routed request may carry: the frontends' own (the core passes them through unchanged)
PLAIN_OUTPUT_PARAMETERS = frozenset({"binary_data"})
#: how long an executor waits for a frontend's inbox to take a frame before it gives up on that inbox (the core
#: then answers that frontend's parts): a stuck frontend must not hold a GPU lane
SEND_TIMEOUT_S = 5.0


class _Delivered:
    """The result of a job whose response the executor sent to its frontend (`DELIVERED`)."""

    def __repr__(self) -> str:
        return "DELIVERED"


#: a job's outputs, and a call's reply value in the core, when the executor answered the frontend itself
DELIVERED: Any = _Delivered()


def enabled() -> bool:
    return os.environ.get("KILN_DIRECT_REPLIES", "1") not in ("0", "")


class Route(NamedTuple):
    """Where a job's response goes and what it names: the frontend's inbox and call id, the response's model,
    version and id, and per requested output its name, datatype and parameters (in request order)."""

    inbox: int
    call_id: int
    model: str
    version: str
    request_id: str
    outputs: tuple[tuple[str, str, dict[str, Any]], ...]


def route_for(model: Any, requested: Sequence[RequestedOutput], request_id: str, inbox: int, call_id: int,
              writes_in_place: Callable[[Any, str], bool]) -> Route | None:
    """The route of a job of `model` asking for `requested`, or None when the core has work to do on its answer
    (the caller checked trace, cache and output destinations): a model outside executor processes, or an output
    that is converted, reshaped, classified or written to shared memory on the host (`writes_in_place`:
    request_io's rule, passed in so that this module stays below the model's)."""
    if not getattr(model, "executors", None):
        return None
    outputs = []
    for output in requested:
        if not PLAIN_OUTPUT_PARAMETERS.issuperset(output.parameters) or not writes_in_place(model, output.name):
            return None
        outputs.append((output.name, model.outputs[output.name].datatype, dict(output.parameters)))
    return Route(inbox, call_id, model.name, str(model.version), request_id, tuple(outputs))


class Inboxes:
    """An executor's connections to the frontends' inboxes, by the id the core gave each; used by every lane."""

    def __init__(self) -> None:
        self._sockets: dict[int, socket.socket] = {}
        self._locks: dict[int, threading.Lock] = {}

    def connect(self, inbox: int, path: str) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
        except OSError as e:
            sock.close()
            log.warning("could not connect to a frontend's inbox %s (%s): its responses go through the core", path, e)
            return
        sock.settimeout(SEND_TIMEOUT_S)
        with contextlib.suppress(OSError):  # room for a burst of responses while the frontend's loop is busy
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, HIGH_WATER)
        lock = self._locks.setdefault(inbox, threading.Lock())
        old = self._sockets.get(inbox)
        self._sockets[inbox] = sock
        if old is not None:
            with lock:
                old.close()

    def forget(self, inbox: int) -> None:
        """Close the inbox's connection, once no lane is sending on it (a descriptor closed under a send could be
        reused by the next socket opened, and the send would land there)."""
        sock = self._sockets.pop(inbox, None)
        if sock is not None:
            with self._locks[inbox]:
                sock.close()

    def send(self, inbox: int, messages: list[Any]) -> bool:
        """One frame of `messages` to the inbox, whole or not at all (a partial one closes the connection, so the
        frontend never decodes it); whether it went."""
        sock = self._sockets.get(inbox)
        if sock is None:
            return False
        frames = encode(messages)
        with self._locks[inbox]:
            try:
                _send_all(sock, frames)
            except OSError as e:
                log.warning("a frontend's inbox did not take a response (%s): its responses go through the core", e)
                if self._sockets.get(inbox) is sock:
                    del self._sockets[inbox]
                sock.close()
                return False
        return True


def _send_all(sock: socket.socket, frames: list[Any]) -> None:
    views = [memoryview(frame).cast("B") for frame in frames]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]


def deliver(inboxes: Inboxes, routes: Sequence[Route | None], rows: Sequence[int],
            outputs: Mapping[str, Any]) -> list[int]:
    """Send each routed part its rows of the batch's `outputs` (whole arrays, parts in order of `rows`) as its
    response, one frame per inbox; the indexes of the parts delivered."""
    total = sum(rows)
    if any(not isinstance(v, np.ndarray) or v.ndim == 0 or v.shape[0] != total for v in outputs.values()):
        return []  # an output without the batch's rows: the core answers (it has the rules for that)
    by_inbox: dict[int, tuple[list[int], list[Any]]] = {}
    start = 0
    for index, (route, count) in enumerate(zip(routes, rows)):
        stop = start + count
        if route is not None and all(name in outputs for name, _, _ in route.outputs):
            response = InferResponse(route.model, route.version, [
                InferOutput(name, datatype, (count, *outputs[name].shape[1:]), outputs[name][start:stop], parameters)
                for name, datatype, parameters in route.outputs], id=route.request_id)
            indexes, messages = by_inbox.setdefault(route.inbox, ([], []))
            indexes.append(index)
            messages.append((route.call_id, response, None))
        start = stop
    delivered: list[int] = []
    for inbox, (indexes, messages) in by_inbox.items():
        if inboxes.send(inbox, messages):
            delivered.extend(indexes)
    return delivered
