"""Kiln's HTTP/2 gRPC transport (server/frontends/grpc/{http2,calls,server}.py) against grpcio's own client, and
against a raw socket where the HTTP/2 rules themselves are the subject (pings, prefaces, keepalive).

The handlers here are tiny test services, so each test sees the transport alone: flow control in both directions
with messages far above the windows, streaming, deadlines, cancellation, limits, compression, graceful stop.
"""

from __future__ import annotations

import asyncio
import gc
import socket
import struct
import time

import grpc
import pytest

from server.auth import RestrictedApi
from server.core.limits import InflightLimiter
from server.frontends.grpc.http2 import ENHANCE_YOUR_CALM, GOAWAY, PING, PREFACE, SETTINGS, Stream, frame
from server.frontends.grpc.options import GrpcOptions
from server.frontends.grpc.server import GrpcServer

pytestmark = pytest.mark.timeout(60)

SERVICE = "kiln.test.Transport"


class _Handlers:
    """Echo, sleep, abort and a bidirectional chat; records what the server side saw."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()

    async def echo(self, request: bytes, context) -> bytes:
        return request

    async def sleep(self, request: bytes, context) -> bytes:
        try:
            await asyncio.sleep(float(request.decode()))
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return b"slept"

    async def abort(self, request: bytes, context) -> bytes:
        await context.abort(grpc.StatusCode.NOT_FOUND, request.decode())
        return b""  # pragma: no cover - abort raises

    async def metadata(self, request: bytes, context) -> bytes:
        return repr(sorted(context.invocation_metadata())).encode()

    async def chat(self, requests, context):
        async for request in requests:
            yield request[::-1]

    def generic(self) -> grpc.GenericRpcHandler:
        unary = grpc.unary_unary_rpc_method_handler
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Echo": unary(self.echo), "Sleep": unary(self.sleep), "Abort": unary(self.abort),
            "Metadata": unary(self.metadata), "Chat": grpc.stream_stream_rpc_method_handler(self.chat)})


async def _serve(**options) -> tuple[GrpcServer, _Handlers]:
    server = GrpcServer(GrpcOptions.from_kwargs(**options), InflightLimiter(), RestrictedApi())
    handlers = _Handlers()
    server.add_generic_rpc_handlers((handlers.generic(),))
    await server.start("127.0.0.1", 0, reuse_port=False)
    return server, handlers


def _run(test, **options) -> None:
    """Run `test(channel, server, handlers)` against a fresh server in a fresh loop."""

    async def main() -> None:
        server, handlers = await _serve(**options)
        try:
            unlimited = [("grpc.max_receive_message_length", -1)]
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=unlimited) as channel:
                await test(channel, server, handlers)
        finally:
            await server.stop(0)

    asyncio.run(main())


def _method(channel: grpc.aio.Channel, name: str):
    return channel.unary_unary(f"/{SERVICE}/{name}")


def test_messages_far_above_the_flow_control_windows_in_both_directions() -> None:
    """40 MiB each way: the server's receive window (4 MiB a stream) needs updates, and its sends wait for the
    client's (64 KiB at first) window updates."""
    payload = bytes(range(256)) * (40 * 4096)

    async def test(channel, server, handlers) -> None:
        echo = _method(channel, "Echo")
        assert await echo(b"hello") == b"hello"
        results = await asyncio.gather(*(echo(payload) for _ in range(3)))
        assert all(r == payload for r in results)

    _run(test)


def test_compressed_requests_and_compressed_responses() -> None:
    async def test(channel, server, handlers) -> None:
        echo = _method(channel, "Echo")
        data = b"abc" * 100_000
        assert await echo(data, compression=grpc.Compression.Gzip) == data
        assert await echo(data, compression=grpc.Compression.Deflate) == data

    _run(test, compression="gzip")


def test_bidirectional_stream_with_many_messages() -> None:
    async def test(channel, server, handlers) -> None:
        chat = channel.stream_stream(f"/{SERVICE}/Chat")
        messages = [bytes([i % 256]) * (256 << 10) + bytes([i % 7]) for i in range(64)]  # 16 MiB in all

        async def send():
            for message in messages:
                yield message

        replies = [reply async for reply in chat(send())]
        assert replies == [m[::-1] for m in messages]

    _run(test)


def test_deadline_cancels_the_handler_and_answers_deadline_exceeded() -> None:
    async def test(channel, server, handlers) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _method(channel, "Sleep")(b"5", timeout=0.2)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await asyncio.wait_for(handlers.cancelled.wait(), 2)
        assert await _method(channel, "Echo")(b"still serving") == b"still serving"

    _run(test)


def test_a_client_cancel_reaches_the_handler() -> None:
    async def test(channel, server, handlers) -> None:
        call = _method(channel, "Sleep")(b"5")
        await asyncio.sleep(0.2)
        call.cancel()
        await asyncio.wait_for(handlers.cancelled.wait(), 2)
        assert server._active == 0

    _run(test)


def test_status_codes_for_unknown_methods_aborts_and_limits() -> None:
    async def test(channel, server, handlers) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _method(channel, "Nope")(b"")
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _method(channel, "Abort")("naïve 100% ✓".encode())
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and info.value.details() == "naïve 100% ✓"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _method(channel, "Echo")(b"x" * 5000)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in info.value.details()
        slow = asyncio.ensure_future(_method(channel, "Sleep")(b"0.5"))
        await asyncio.sleep(0.1)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _method(channel, "Echo")(b"second")
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await slow == b"slept"
        assert await _method(channel, "Echo")(b"after") == b"after"

    _run(test, max_message_size=4096, max_concurrent_rpcs=1)


def test_invocation_metadata_reaches_the_handler() -> None:
    async def test(channel, server, handlers) -> None:
        seen = await _method(channel, "Metadata")(b"", metadata=(("x-token", "abc"), ("trace-bin", b"\x00\xff")))
        text = seen.decode()
        assert "('x-token', 'abc')" in text and "('trace-bin', b'\\x00\\xff')" in text

    _run(test)


def test_stop_lets_calls_in_flight_finish_and_refuses_new_ones() -> None:
    async def main() -> None:
        server, handlers = await _serve()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            slow = asyncio.ensure_future(_method(channel, "Sleep")(b"0.3"))
            await asyncio.sleep(0.1)
            await server.stop(5)
            assert await slow == b"slept"
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _method(channel, "Echo")(b"late", timeout=2)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(main())


# -- raw HTTP/2 -----------------------------------------------------------------------------------------------------
def _read_frames(sock: socket.socket, until_type: int, timeout: float) -> list[tuple[int, int, bytes]]:
    """Frames (type, flags, payload) up to and including the first of `until_type`; [] if the peer closed first."""
    sock.settimeout(timeout)
    data, frames = b"", []
    while True:
        while len(data) >= 9 and len(data) >= 9 + int.from_bytes(data[:3], "big"):
            length = int.from_bytes(data[:3], "big")
            frames.append((data[3], data[4], data[9:9 + length]))
            data = data[9 + length:]
            if frames[-1][0] == until_type:
                return frames
        chunk = sock.recv(65536)
        if not chunk:
            return []
        data += chunk


def _raw_connection(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(PREFACE + frame(SETTINGS, 0, 0))
    return sock


def _in_thread(port_test, **options) -> None:
    async def main() -> None:
        server, _ = await _serve(**options)
        try:
            await asyncio.get_running_loop().run_in_executor(None, port_test, server.port)
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_frames_split_anywhere_across_reads_are_read_whole() -> None:
    """The preface, a SETTINGS frame and a PING arrive a few bytes at a time (each write flushed on its own): the
    connection's buffer keeps the pieces and answers the PING with its payload."""
    def test(port: int) -> None:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            data = PREFACE + frame(SETTINGS, 0, 0, b"") + frame(PING, 0, 0, b"kiln-ok!")
            for at in range(0, len(data), 3):
                sock.sendall(data[at:at + 3])
                time.sleep(0.002)
            frames = _read_frames(sock, PING, 5)
            assert frames[-1] == (PING, 1, b"kiln-ok!")

    _in_thread(test)


def test_too_many_pings_end_the_connection_with_enhance_your_calm() -> None:
    def test(port: int) -> None:
        with _raw_connection(port) as sock:
            for i in range(4):
                sock.sendall(frame(PING, 0, 0, struct.pack(">Q", i)))
            frames = _read_frames(sock, GOAWAY, 5)
            goaway = frames[-1][2]
            assert int.from_bytes(goaway[4:8], "big") == ENHANCE_YOUR_CALM and b"too_many_pings" in goaway
            assert sum(1 for kind, flags, _ in frames if kind == PING and flags & 1) == 3  # acks before the 3rd strike

    _in_thread(test)


def test_keepalive_pings_and_closes_a_silent_peer() -> None:
    def test(port: int) -> None:
        with _raw_connection(port) as sock:
            frames = _read_frames(sock, PING, 5)
            assert frames and frames[-1][1] == 0  # a server ping, not an ack
            sock.settimeout(5)
            while sock.recv(65536):  # never answered: the server closes after keepalive_timeout
                pass

    _in_thread(test, keepalive_time_ms=200, keepalive_timeout_ms=300, keepalive_permit_without_calls=True)


def test_a_connection_that_is_not_http2_is_closed() -> None:
    def test(port: int) -> None:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            frames = _read_frames(sock, GOAWAY, 5)
            assert frames and frames[-1][0] == GOAWAY

    _in_thread(test)


def test_a_compressed_message_is_measured_after_decompression() -> None:
    """A small gzip message that inflates past max_message_size is RESOURCE_EXHAUSTED, not inflated in full."""

    async def test(channel, server, handlers) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _method(channel, "Echo")(bytes(1 << 20), compression=grpc.Compression.Gzip)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await _method(channel, "Echo")(bytes(100), compression=grpc.Compression.Gzip) == bytes(100)

    _run(test, max_message_size=4096)


def test_a_client_table_size_below_the_default_is_signalled_in_the_next_header_block() -> None:
    """RFC 7541 4.2: after SETTINGS_HEADER_TABLE_SIZE 0 the server's next header block starts with a size update
    (strict decoders such as nghttp2 refuse the block otherwise), and the block still decodes."""
    from server.frontends.grpc.hpack import Decoder, Encoder
    from server.frontends.grpc.http2 import END_HEADERS, END_STREAM, HEADERS, SETTINGS_HEADER_TABLE_SIZE

    def test(port: int) -> None:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(PREFACE + frame(SETTINGS, 0, 0, struct.pack(">HI", SETTINGS_HEADER_TABLE_SIZE, 0)))
            request = Encoder().encode([(":method", "POST"), (":scheme", "http"), (":path", f"/{SERVICE}/Nope"),
                                        (":authority", "test"), ("content-type", "application/grpc"), ("te", "trailers")])
            sock.sendall(frame(HEADERS, END_HEADERS | END_STREAM, 1, request))
            block = _read_frames(sock, HEADERS, 5)[-1][2]
            assert block[0] == 0x20
            decoder = Decoder(max_table_size=0)
            decoder.max_allowed_table_size = 0
            headers = dict(decoder.decode(bytes(block)))
            assert headers["grpc-status"] == str(grpc.StatusCode.UNIMPLEMENTED.value[0])

    _in_thread(test)


def test_finished_calls_leave_no_cycles_for_the_collector() -> None:
    """A finished stream drops its callbacks: its call's objects go with reference counting (cyclic garbage per
    call made the collector pause the event loop every few hundred calls)."""
    async def test(channel, server, handlers) -> None:
        echo = channel.unary_unary(f"/{SERVICE}/Echo")
        assert await echo(b"warm") == b"warm"
        gc.collect()
        gc.disable()
        try:
            for i in range(20):
                assert await echo(b"x%d" % i) == b"x%d" % i
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            streams = [o for o in gc.garbage if isinstance(o, Stream)]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
        assert streams == []

    _run(test)
