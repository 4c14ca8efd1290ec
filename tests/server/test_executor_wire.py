"""The executor's socket channel (server/core/executor_wire.py `Channel`): messages, descriptors and large payloads
cross whole, a lane's one-read path included, and a queued message is never swallowed by the one before it."""

from __future__ import annotations

import os
import socket
import tempfile
import threading

import numpy as np
import pytest

from server.core.executor_wire import Channel, ExecutorGone


def _pair(alternating: bool) -> tuple[Channel, Channel]:
    ours, theirs = socket.socketpair()
    return Channel(ours, alternating), Channel(theirs, alternating)


def _file_with(text: bytes) -> int:
    fd, path = tempfile.mkstemp()
    os.unlink(path)
    os.write(fd, text)
    return fd


def _read_back(fd: int) -> bytes:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        return os.read(fd, 100)
    finally:
        os.close(fd)


@pytest.mark.parametrize("alternating", [True, False])
def test_a_message_its_descriptors_and_a_large_payload_arrive_whole(alternating: bool) -> None:
    a, b = _pair(alternating)
    fd = _file_with(b"region")
    try:
        a.send({"kind": "rows", "n": 3}, [fd])
        message, fds = b.recv()
        assert message == {"kind": "rows", "n": 3} and [_read_back(f) for f in fds] == [b"region"]
        big = np.arange(300_000, dtype=np.float32)  # 1.2 MB: past the channel's first buffer and the socket's
        sender = threading.Thread(target=b.send, args=(("ok", big),))
        sender.start()
        reply, fds = a.recv()
        sender.join(10)
        assert fds == [] and reply[0] == "ok"
        np.testing.assert_array_equal(reply[1], big)
        a.send("small again")  # after the buffer grew
        assert b.recv() == ("small again", [])
    finally:
        os.close(fd)
        a.close()
        b.close()


def test_messages_queued_on_a_control_channel_are_read_one_by_one_with_their_own_descriptors() -> None:
    a, b = _pair(alternating=False)
    fds = [_file_with(b"first"), _file_with(b"second")]
    try:
        a.send(("map", 1), [fds[0]])
        a.send(("forget", 7))
        a.send(("map", 2), [fds[1]])
        a.send(("sync",))
        got = [b.recv() for _ in range(4)]
        assert [message for message, _ in got] == [("map", 1), ("forget", 7), ("map", 2), ("sync",)]
        assert [[_read_back(f) for f in received] for _, received in got] == [[b"first"], [], [b"second"], []]
    finally:
        for fd in fds:
            os.close(fd)
        a.close()
        b.close()


@pytest.mark.parametrize("alternating", [True, False])
def test_a_closed_peer_is_executor_gone(alternating: bool) -> None:
    a, b = _pair(alternating)
    a.close()
    with pytest.raises(ExecutorGone):
        b.recv()
    b.close()
