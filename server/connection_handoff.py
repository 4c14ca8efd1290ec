"""gRPC connections accepted by the server process and handed to the frontend processes in turn.

Why: with SO_REUSEPORT the kernel hashes each connection to one listening process, and gRPC clients keep a few
long-lived HTTP/2 connections, so they land unevenly: on an H100 (BERT-base, 8 `kiln perf` processes, 7
frontends) 8 connections went to 5 frontends, one of them at 50% CPU while two served nothing
(docs/performance.md). Here the server process listens on the gRPC port and passes each accepted socket over a
Unix channel (SCM_RIGHTS) to the next live frontend, round robin; the frontend serves it as if it had accepted it.
HTTP keeps SO_REUSEPORT: its clients open a connection per concurrent request, which the kernel spreads well.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable

log = logging.getLogger("kiln.server.frontends")


def channel_pair() -> tuple[socket.socket, socket.socket]:
    """(the server process's end, the frontend's end) of one handoff channel: one message per connection."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


class Handoff:
    """The server process's side: accepts on `listener` and hands each connection to the next live channel."""

    def __init__(self, listener: socket.socket) -> None:
        listener.setblocking(False)
        self.listener = listener
        self._channels: dict[int, socket.socket] = {}  # frontend index -> its channel
        self._next = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.listener.fileno(), self._accept)

    def attach(self, index: int, channel: socket.socket) -> None:
        """Frontend `index` (re)started with this channel end: it takes connections from now on."""
        old = self._channels.pop(index, None)
        if old is not None:
            old.close()
        channel.setblocking(False)
        self._channels[index] = channel

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of descriptors, say: the client retries; the listener stays
                log.warning("gRPC: cannot accept a connection (%s)", e)
                return
            with connection:
                self._hand(connection)

    def _hand(self, connection: socket.socket) -> None:
        """Pass `connection` to the next frontend that takes it (a dead one's channel fails and is dropped)."""
        order = sorted(self._channels)
        for step in range(len(order)):
            index = order[(self._next + step) % len(order)]
            try:
                socket.send_fds(self._channels[index], [b"c"], [connection.fileno()])
            except OSError:  # the frontend is gone (its restart attaches a new channel) or its queue is full
                continue
            self._next = (order.index(index) + 1) % len(order)
            return
        log.warning("gRPC: no frontend process took a connection; it is closed")

    def close(self) -> None:
        """Stop accepting (drain): the port refuses new connections; the channels close."""
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self.listener.fileno())
        self.listener.close()
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()


class Receiver:
    """A frontend's side: connections arriving on `channel` go to `adopt` (which serves the socket)."""

    def __init__(self, channel: socket.socket, adopt: Callable[[socket.socket], Awaitable[object]]) -> None:
        channel.setblocking(False)
        self.channel = channel
        self._adopt = adopt
        self._loop = asyncio.get_running_loop()
        self._tasks: set[asyncio.Task] = set()
        self._loop.add_reader(channel.fileno(), self._receive)

    def _receive(self) -> None:
        while True:
            try:
                message, fds, _, _ = socket.recv_fds(self.channel, 16, 8)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.close()
                return
            if not message and not fds:  # the server process closed the channel (drain or exit)
                self.close()
                return
            for fd in fds:
                connection = socket.socket(fileno=fd)
                connection.setblocking(False)
                task = self._loop.create_task(self._serve(connection))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _serve(self, connection: socket.socket) -> None:
        try:
            await self._adopt(connection)
        except Exception as e:  # noqa: BLE001 - a failed TLS handshake, say: that client's connection only
            log.info("gRPC: a handed connection failed to start (%s)", e)
            connection.close()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._loop.remove_reader(self.channel.fileno())
        self.channel.close()
