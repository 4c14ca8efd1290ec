"""`kiln serve --frontend-processes N`: HTTP and gRPC in child processes, the core in the server process.

The wire format and the remote core run in-process first (a Unix socket in a temporary directory); then a real
server with two frontend processes is driven with the stock tritonclient over both protocols, including
errors, shared memory, statistics, a killed frontend and SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from server.core.errors import ErrorKind, ServerError
from server.core.framing import FrameDecoder, encode
from server.core.limits import PayloadTooLarge
from server.core.remote import CoreService, RemoteCore
from server.core.types import InferInput, InferRequest
from server.frontend_processes import frontend_count

from .conftest import examples, run_server


def _roundtrip(message, chunk: int = 0):
    """`message` encoded and decoded, the frames fed whole or in `chunk`-byte pieces (as a socket may split them)."""
    decoded: list = []
    decoder = FrameDecoder(decoded.append)
    data = b"".join(bytes(frame) for frame in encode(message))
    step = chunk or len(data)
    for start in range(0, len(data), step):
        decoder.feed(data[start:start + step])
    assert len(decoded) == 1
    return decoded[0]


def test_messages_carry_arrays_of_every_layout_and_errors_whole():
    arrays = {"f": np.arange(12, dtype=np.float32).reshape(3, 4), "empty": np.zeros((2, 0), np.int64),
              "strided": np.arange(20).reshape(4, 5)[:, ::2], "bytes": np.array([b"a", b"bc"], dtype=object)}
    back = _roundtrip((7, "infer", (arrays,), {}))
    assert back[:2] == (7, "infer")
    for name, array in arrays.items():
        assert back[2][0][name].dtype == array.dtype
        np.testing.assert_array_equal(back[2][0][name], array)
    error = _roundtrip(PayloadTooLarge("body over 10 bytes"))
    assert type(error) is PayloadTooLarge and error.kind == ErrorKind.RESOURCE_EXHAUSTED
    assert error.http_status == 413 and str(error) == error.message == "body over 10 bytes"


@pytest.mark.parametrize("chunk", [0, 1, 7, 4096])
def test_frames_decode_however_the_socket_splits_them(chunk: int):
    """Requests as frontends send them (dataclasses, a 1 MiB tensor that gets a buffer of its own, fp16 and BYTES),
    several frames in one read, and frames split anywhere, header included."""
    big = np.random.default_rng(0).standard_normal((1, 512, 512)).astype(np.float32)
    request = InferRequest("m", [InferInput("x", "FP32", big.shape, big),
                                 InferInput("h", "FP16", (2,), np.array([1.5, -2], np.float16)),
                                 InferInput("s", "BYTES", (2,), np.array([b"a", b""], dtype=object))],
                           model_version="2", id="r1", parameters={"priority": 1})
    decoded: list = []
    decoder = FrameDecoder(decoded.append)
    messages = [(1, "infer", (request,), {}), (2, "ready", (), {}), (3, "infer", (request,), {"timeout": 5})]
    data = b"".join(bytes(frame) for message in messages for frame in encode(message))
    step = chunk or len(data)
    for start in range(0, len(data), step):
        decoder.feed(data[start:start + step])
    assert [m[:2] for m in decoded] == [(1, "infer"), (2, "ready"), (3, "infer")] and decoded[2][3] == {"timeout": 5}
    for message in (decoded[0], decoded[2]):
        back = message[2][0]
        assert (back.model_name, back.model_version, back.id, back.parameters) == ("m", "2", "r1", {"priority": 1})
        for sent, got in zip(request.inputs, back.inputs):
            assert (got.name, got.datatype, tuple(got.shape), got.data.dtype) == \
                (sent.name, sent.datatype, tuple(sent.shape), sent.data.dtype)
            np.testing.assert_array_equal(got.data, sent.data)


class _FakeCore:
    """Answers like the core: a value, a ServerError, or an unexpected exception."""

    async def model_metadata(self, name: str, version: str = "") -> dict:
        if name == "missing":
            raise ServerError(ErrorKind.NOT_FOUND, "unknown model: 'missing'")
        return {"name": name, "versions": [version or "1"]}

    def submit_infer(self, request: InferRequest, reply, inbox: tuple[int, int] | None = None) -> asyncio.Future:
        """As `ServerCore.submit_infer`: answers through `reply`, returns a future that cancelling withdraws (no
        executors: `inbox` is never used)."""

        async def run() -> np.ndarray:
            if request.model_name == "slow":
                await asyncio.sleep(30)
            await asyncio.sleep(0.01 * (3 - len(request.inputs)))  # later calls finish first: replies out of order
            return request.inputs[0].data * 2

        def done(task: asyncio.Task) -> None:
            if task.cancelled():
                self.withdrawn = request.model_name
                reply(None, asyncio.CancelledError())
            else:
                reply(task.result(), None)

        job = asyncio.ensure_future(run())
        job.add_done_callback(done)
        return job

    async def repository_index(self, ready: bool = False) -> list:
        raise RuntimeError("boom")

    async def ready(self) -> bool:
        return True

    async def load_model(self, name: str) -> None:
        """Slow: the caller gives up before it ends, and the cancellation must reach this coroutine."""
        self.loading = asyncio.Event()
        try:
            self.loading.set()
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.cancelled = name
            raise


def test_remote_core_forwards_calls_results_and_errors(tmp_path: Path):
    async def go():
        service = CoreService(_FakeCore(), str(tmp_path / "core.sock"))
        await service.start()
        remote = RemoteCore(service.path)
        await remote.connect()
        lost = []
        remote.on_lost = lambda: lost.append(True)
        assert await remote.model_metadata("m", version="3") == {"name": "m", "versions": ["3"]}
        with pytest.raises(ServerError) as missing:
            await remote.model_metadata("missing")
        assert missing.value.kind == ErrorKind.NOT_FOUND and "unknown model" in missing.value.message
        with pytest.raises(ServerError) as boom:
            await remote.repository_index()
        assert boom.value.kind == ErrorKind.INTERNAL and "RuntimeError: boom" in boom.value.message
        with pytest.raises(AttributeError):
            remote.stop  # noqa: B018 - not a frontend method: never forwarded
        requests = [InferRequest("m", [InferInput("x", "FP32", (2,), np.full(2, i, np.float32))] * (i + 1))
                    for i in range(3)]
        results = await asyncio.gather(*(remote.infer(r) for r in requests))
        for i, result in enumerate(results):
            np.testing.assert_array_equal(result, np.full(2, 2 * i, np.float32))
        core = service.core
        slow = asyncio.ensure_future(remote.load_model("big"))
        while not hasattr(core, "loading"):
            await asyncio.sleep(0.01)
        slow.cancel()  # a client disconnect: the call stops in the core too (a queued request leaves its queue)
        for _ in range(100):
            if getattr(core, "cancelled", None):
                break
            await asyncio.sleep(0.01)
        assert core.cancelled == "big"
        slow_infer = asyncio.ensure_future(remote.infer(InferRequest("slow", requests[0].inputs)))
        while service.limiter.count == 0:
            await asyncio.sleep(0.01)
        slow_infer.cancel()  # a queued inference request is withdrawn, and its in-flight slot freed
        for _ in range(100):
            if getattr(core, "withdrawn", None):
                break
            await asyncio.sleep(0.01)
        assert core.withdrawn == "slow" and service.limiter.count == 0
        assert await remote.ready()
        remote.begin_drain()
        assert not await remote.ready()  # a draining frontend answers without asking the core
        await service.stop()
        for _ in range(100):
            if lost:
                break
            await asyncio.sleep(0.01)
        assert lost
        with pytest.raises(ServerError) as gone:
            await remote.model_metadata("m")
        assert gone.value.kind == ErrorKind.UNAVAILABLE
        await remote.close()

    asyncio.run(go())


def test_frontend_count_flag():
    assert frontend_count("0") == 0 and frontend_count("3") == 3
    assert frontend_count("auto") >= 0
    with pytest.raises(Exception, match="auto"):
        frontend_count("-1")


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _frontends(pid: int) -> list[int]:
    """The server's frontend processes (its other children are build processes, if any)."""
    return [c for c in _children(pid) if "spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes().decode(errors="replace")]


@pytest.fixture(scope="module")
def two_frontends(tmp_path_factory):
    base = tmp_path_factory.mktemp("frontends")
    repository = examples.make_repository(base / "models")
    with run_server(repository, base / "server.log", ["add_sub", "identity"],
                    ["--frontend-processes", "2", "--allow-client-shm", "true"]) as server:
        yield server


def _add_sub_inputs(module, a: np.ndarray, b: np.ndarray):
    inputs = [module.InferInput("INPUT0", list(a.shape), "INT32"), module.InferInput("INPUT1", list(b.shape), "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs


def test_both_protocols_serve_through_frontend_processes(two_frontends):
    assert len(_frontends(two_frontends.process.pid)) == 2
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.ones((1, 16), np.int32)
    http = httpclient.InferenceServerClient(two_frontends.http_url, concurrency=4)
    grpc = grpcclient.InferenceServerClient(two_frontends.grpc_url)
    for _ in range(8):  # several connections: both frontends see some
        result = httpclient.InferenceServerClient(two_frontends.http_url).infer("add_sub", _add_sub_inputs(httpclient, a, b))
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(grpc.infer("add_sub", _add_sub_inputs(grpcclient, a, b)).as_numpy("OUTPUT1"), a - b)
    assert http.get_model_metadata("add_sub")["name"] == "add_sub"
    assert grpc.is_server_ready() and http.is_server_live()
    stats = http.get_inference_statistics("add_sub")["model_stats"][0]
    assert stats["inference_stats"]["success"]["count"] == 9  # one core counts both protocols and all frontends


def _grpc_connections(pid: int, port: int) -> set[str]:
    """The peers (address:port, hex) of established TCP connections on the server's gRPC `port` that process `pid`
    holds (from /proc). Peers, not a count: a connection of an earlier test may close meanwhile."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            link = os.readlink(fd)
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    peers = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01" and fields[9] in inodes:
                peers.add(fields[2])
    return peers


def test_grpc_connections_are_handed_to_the_frontends_in_turn(two_frontends):
    """The server process accepts gRPC connections and hands them round robin (server/connection_handoff.py): a
    few long-lived client connections do not pile onto one frontend, as SO_REUSEPORT's hash let them."""
    port = int(two_frontends.grpc_url.rsplit(":", 1)[1])
    frontends = _frontends(two_frontends.process.pid)
    before = [_grpc_connections(pid, port) for pid in frontends]
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    # each client its own connection (grpc shares one between alike channels unless told not to), kept open
    clients = [grpcclient.InferenceServerClient(two_frontends.grpc_url,
                                                channel_args=[("grpc.use_local_subchannel_pool", 1)])
               for _ in range(4)]
    for client in clients:
        np.testing.assert_array_equal(client.infer("add_sub", _add_sub_inputs(grpcclient, a, a)).as_numpy("OUTPUT0"),
                                      2 * a)
    after = [_grpc_connections(pid, port) for pid in frontends]
    assert [len(n - m) for n, m in zip(after, before)] == [2, 2], (before, after)  # two new ones each
    assert not _grpc_connections(two_frontends.process.pid, port)  # the server process keeps none of them
    for client in clients:
        client.close()


def test_errors_keep_their_status_and_text_across_the_process_boundary(two_frontends):
    http = httpclient.InferenceServerClient(two_frontends.http_url)
    wrong = [httpclient.InferInput("INPUT0", [1, 16], "FP32"), httpclient.InferInput("INPUT1", [1, 16], "INT32")]
    wrong[0].set_data_from_numpy(np.zeros((1, 16), np.float32))
    wrong[1].set_data_from_numpy(np.zeros((1, 16), np.int32))
    with pytest.raises(InferenceServerException) as e:
        http.infer("add_sub", wrong)
    assert e.value.status() == "400" and "data-type is 'FP32'" in e.value.message()
    with pytest.raises(InferenceServerException) as e:
        grpcclient.InferenceServerClient(two_frontends.grpc_url).get_model_metadata("no_such_model")
    assert "StatusCode.NOT_FOUND" in str(e.value.status())
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    np.testing.assert_array_equal(http.infer("add_sub", _add_sub_inputs(httpclient, a, a)).as_numpy("OUTPUT0"), 2 * a)


def test_system_shared_memory_is_read_and_written_by_the_core(two_frontends):
    client = grpcclient.InferenceServerClient(two_frontends.grpc_url)
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    key = f"/kiln_fp_{os.getpid()}"
    region = shm.create_shared_memory_region("fp_io", key, 4 * a.nbytes)
    try:
        shm.set_shared_memory_region(region, [a, a])
        client.register_system_shared_memory("fp_io", key, 4 * a.nbytes)
        inputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"), grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_shared_memory("fp_io", a.nbytes)
        inputs[1].set_shared_memory("fp_io", a.nbytes, offset=a.nbytes)
        output = grpcclient.InferRequestedOutput("OUTPUT0")
        output.set_shared_memory("fp_io", a.nbytes, offset=2 * a.nbytes)
        client.infer("add_sub", inputs, outputs=[output])
        result = shm.get_contents_as_numpy(region, np.int32, [1, 16], offset=2 * a.nbytes)
        np.testing.assert_array_equal(result, 2 * a)
        assert client.get_system_shared_memory_status(as_json=True)["regions"]["fp_io"]["key"] == key
        client.unregister_system_shared_memory("fp_io")
    finally:
        shm.destroy_shared_memory_region(region)


def test_a_killed_frontend_is_replaced_and_sigterm_drains_everything(tmp_path: Path):
    repository = examples.make_repository(tmp_path / "models")
    with run_server(repository, tmp_path / "server.log", ["add_sub"], ["--frontend-processes", "2"]) as server:
        pid = server.process.pid
        deadline = time.monotonic() + 60
        while "frontend processes serve" not in server.log() and time.monotonic() < deadline:
            time.sleep(0.1)  # ready answers as soon as one frontend listens; the others may still be starting
        first = _frontends(pid)
        os.kill(first[0], signal.SIGKILL)
        deadline = time.monotonic() + 60
        now = _frontends(pid)  # one listing per look: two could straddle the killed child's exit
        while time.monotonic() < deadline and (len(now) < 2 or first[0] in now):
            time.sleep(0.2)
            now = _frontends(pid)
        assert len(now) == 2 and first[0] not in now, f"frontends before {first}, now {now}; log:\n{server.log()[-3000:]}"
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        for _ in range(4):
            client = httpclient.InferenceServerClient(server.http_url)
            deadline = time.monotonic() + 30
            while True:  # the replacement may still be starting: a refused connection is retried
                try:
                    result = client.infer("add_sub", _add_sub_inputs(httpclient, a, a))
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 2 * a)
        children = _frontends(pid)
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=60) == 0, server.log()
        for child in children:
            assert not Path(f"/proc/{child}").exists() or "zombie" in Path(f"/proc/{child}/status").read_text()
    assert "frontend process" in server.log()


def test_load_and_unload_reach_the_core(two_frontends):
    client = httpclient.InferenceServerClient(two_frontends.http_url)
    client.unload_model("identity")
    assert not client.is_model_ready("identity")
    client.load_model("identity")
    assert grpcclient.InferenceServerClient(two_frontends.grpc_url).is_model_ready("identity")
    with pytest.raises(InferenceServerException, match="load"):
        client.load_model("identity", config='{"max_batch_size": "not a number"}')
