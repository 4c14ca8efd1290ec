"""One Python model instance's stub process, from the server's side: start it, call it, serve its BLS requests, and
notice when it dies.

Why a process per instance (as Triton's stubs): a model's Python never holds the server's interpreter lock, and a
model that crashes (a segfault in an extension, `os._exit`, the OOM killer) takes only its own process down. The
stub is server/python_backend/stub.py, run by the model's interpreter (its EXECUTION_ENV_PATH's, else the
server's) with one end of a socket pair; messages are server/python_backend/wire.py's, read here with remote.py's
`FrameDecoder` (the same frame layout). A BLS request from the stub runs through the core's own entry point (`infer`,
as an ensemble's steps do) and its response goes back on the same connection.

The process exiting is the one sign of death (`_watch`): its pending calls fail with `StubFailure`, naming how it
ended, and so do its open streams (a decoupled model's requests still sending). Who restarts it is the caller's
choice (python_model.Instance restarts it).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from server.python_backend import wire

from .custom_metrics import CustomMetrics
from .decoupled import StreamPart
from .errors import ErrorKind, ServerError
from .framing import FrameDecoder
from .types import InferInput, InferRequest, InferResponse, RequestedOutput, datatype_of_numpy

log = logging.getLogger("kiln.server.python")

STUB_SCRIPT = Path(wire.__file__).resolve().parent / "stub.py"

class BlsRunner(Protocol):
    """How BLS requests run: the core's own entry points (`ServerCore`), as an ensemble's steps do."""

    async def infer(self, request: InferRequest) -> InferResponse: ...

    def submit_stream(self, request: InferRequest, on_part: Callable[[StreamPart], None]) -> Any: ...

    async def load_model(self, name: str, config: str | None = None, files: dict[str, bytes] | None = None) -> None: ...

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None: ...

    async def model_ready(self, name: str, version: str = "") -> bool: ...

    @property
    def custom_metrics(self) -> CustomMetrics: ...
#: where a decoupled request's responses go, on the event loop: (result, final) with result None for a bare final
#: flag, else the stub's `{"outputs": ...}` or `{"error": (code, message)}`
StreamSink = Callable[[dict | None, bool], None]

# TritonError code names (pb_utils) <-> the core's error kinds
_KIND_OF_CODE = {"UNKNOWN": ErrorKind.INTERNAL, "INTERNAL": ErrorKind.INTERNAL, "NOT_FOUND": ErrorKind.NOT_FOUND,
                 "INVALID_ARG": ErrorKind.INVALID_ARGUMENT, "UNAVAILABLE": ErrorKind.UNAVAILABLE,
                 "UNSUPPORTED": ErrorKind.UNIMPLEMENTED, "ALREADY_EXISTS": ErrorKind.ALREADY_EXISTS,
                 "CANCELLED": ErrorKind.UNAVAILABLE}
_CODE_OF_KIND = {ErrorKind.INVALID_ARGUMENT: "INVALID_ARG", ErrorKind.NOT_FOUND: "NOT_FOUND",
                 ErrorKind.UNAVAILABLE: "UNAVAILABLE", ErrorKind.RESOURCE_EXHAUSTED: "UNAVAILABLE",
                 ErrorKind.ALREADY_EXISTS: "ALREADY_EXISTS", ErrorKind.INTERNAL: "INTERNAL",
                 ErrorKind.UNIMPLEMENTED: "UNSUPPORTED"}
# pb_utils.Logger levels -> logging levels (VERBOSE shows with --log-verbose)
_LOG_LEVELS = {0: logging.INFO, 1: logging.WARNING, 2: logging.ERROR, 3: logging.DEBUG}
# request flags (pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_*) <-> Triton's request parameters
_SEQUENCE_START, _SEQUENCE_END = 1, 2


class StubFailure(Exception):
    """The stub process died (or was stopped) before answering: its calls cannot complete."""


class StubCallError(Exception):
    """The stub answered a call with the model's error: `code` is a TritonError code name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def as_server_error(self, prefix: str = "") -> ServerError:
        return ServerError(_KIND_OF_CODE.get(self.code, ErrorKind.INTERNAL), prefix + self.message)


@dataclass
class StubLaunch:
    """How to start one instance's stub."""

    python: str  # the interpreter: the model's EXECUTION_ENV_PATH's bin/python, or the server's
    label: str  # Triton's instance name ("<group>_<index>"), in messages and logs
    model_name: str
    environment: dict[str, str] = field(default_factory=dict)  # variables set for the process, on top of the server's


class Stub:
    """A running stub process and its connection. Create with `await Stub.start(launch, core)`."""

    def __init__(self, launch: StubLaunch, core: BlsRunner) -> None:
        self.launch = launch
        self._core = core
        self._process: asyncio.subprocess.Process | None = None
        self._protocol: _StubProtocol | None = None
        self._ids = itertools.count(1)
        self._calls: dict[int, asyncio.Future] = {}
        self._bls: set[asyncio.Future] = set()
        self._bls_streams: dict[int, Any] = {}  # the model's decoupled BLS calls (exec(decoupled=True)) not yet final
        self._streams: dict[int, StreamSink] = {}  # decoupled requests sent to the stub and not yet final
        self._ended: asyncio.Future | None = None  # the process's exit description, once it exited
        self._killed = False
        self.exit_reason = ""
        #: told once the process has exited and its calls have failed (python_model.Instance restarts it)
        self.on_exit: Callable[[Stub], None] | None = None

    @classmethod
    async def start(cls, launch: StubLaunch, core: BlsRunner) -> Stub:
        stub = cls(launch, core)
        await stub._spawn()
        return stub

    @property
    def alive(self) -> bool:
        """Started, not ended and not being killed: a stub that can take calls."""
        return self._ended is not None and not self._ended.done() and not self._killed

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    async def _spawn(self) -> None:
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.launch.environment}
        try:
            self._process = await asyncio.create_subprocess_exec(
                self.launch.python, str(STUB_SCRIPT), str(theirs.fileno()), pass_fds=(theirs.fileno(),),
                stdin=asyncio.subprocess.DEVNULL, env=env)
        except OSError as e:
            ours.close()
            raise StubFailure(f"could not start the stub of '{self.launch.label}' with {self.launch.python}: "
                              f"{e}") from None
        finally:
            theirs.close()
        _, self._protocol = await loop.create_unix_connection(lambda: _StubProtocol(self), sock=ours)
        self._ended = loop.create_future()
        self._watcher = asyncio.ensure_future(self._watch())
        log.info("started the Python stub of '%s' (pid %d, %s)", self.launch.label, self._process.pid,
                 self.launch.python)

    async def _watch(self) -> None:
        """Wait for the process to end; then every pending call fails with how it ended."""
        assert self._process is not None and self._ended is not None
        code = await self._process.wait()
        self.exit_reason = _describe_exit(code)
        if self._protocol is not None:
            self._protocol.close()
        failure = StubFailure(f"Stub process '{self.launch.label}' is not healthy: it {self.exit_reason}")
        for future in self._calls.values():
            if not future.done():
                future.set_exception(failure)
        self._calls.clear()
        for stream in list(self._streams):
            self.close_stream(stream, {"error": ("INTERNAL", str(failure))})
        for task in self._bls:
            task.cancel()
        for handle in list(self._bls_streams.values()):
            handle.cancel()
        self._bls_streams.clear()
        self._core.custom_metrics.release(id(self))  # its metrics go with it, as Triton's go with the objects
        self._ended.set_result(self.exit_reason)
        if self.on_exit is not None:
            self.on_exit(self)

    async def call(self, kind: str, body: Any, timeout_s: float | None = None) -> Any:
        """Call the stub and wait for its answer: StubCallError for the model's error, StubFailure if the process
        ends first. Past `timeout_s` the process is killed (a model that hangs cannot be interrupted otherwise)."""
        if not self.alive or self._protocol is None:
            raise StubFailure(f"Stub process '{self.launch.label}' is not healthy: it {self.exit_reason or 'is gone'}")
        call_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._protocol.send((kind, call_id, body))
        try:
            if timeout_s is None:  # no timer: the future itself (wait_for and shield cost two more per call)
                value, error = await future
            else:
                value, error = await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except TimeoutError:
            self.kill()
            limit_ms = (timeout_s or 0) * 1000  # only a set timeout times out
            raise StubFailure(f"Stub process '{self.launch.label}' ran {kind} longer than {limit_ms:g} ms "
                              "(kiln_execution_timeout_ms) and was killed") from None
        finally:
            self._calls.pop(call_id, None)
        if error is not None:
            raise StubCallError(*error)
        return value

    def open_stream(self, sink: StreamSink) -> int:
        """A decoupled request's id for the stub (its sender's): its responses go to `sink` until the final one."""
        stream = next(self._ids)
        self._streams[stream] = sink
        return stream

    def close_stream(self, stream: int, result: dict | None = None, notify: bool = True) -> None:
        """End a stream from this side (execute() failed, the stub died): later responses from the stub are
        dropped, and with `notify` its sink gets `result` and the final flag."""
        sink = self._streams.pop(stream, None)
        if sink is not None and notify:
            sink(result, True)

    def cancel_stream(self, stream: int) -> None:
        """The request's client gave up: the model's sender says so (`is_cancelled()`); its responses still come."""
        if stream in self._streams and self._protocol is not None and self.alive:
            self._protocol.send((wire.CANCEL, stream, None))

    async def ended(self) -> None:
        """Wait until the process has exited (and its calls have failed)."""
        if self._ended is not None:
            await asyncio.shield(self._ended)

    def kill(self) -> None:
        self._killed = True
        if self._process is not None and self._process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._process.kill()

    async def stop(self, grace_s: float = 5.0) -> None:
        """FINALIZE (the model's `finalize()`), then the process ends; killed if it takes longer than `grace_s`."""
        if self.alive:
            try:
                await self.call(wire.FINALIZE, None, timeout_s=grace_s)
            except StubCallError as e:
                log.error("'%s': finalize failed: %s", self.launch.label, e.message)
            except StubFailure:
                pass
        if self._protocol is not None:
            self._protocol.close()  # the stub exits when its connection closes
        if self._ended is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._ended), grace_s)
            except TimeoutError:
                self.kill()
                await self._ended

    # -- messages from the stub -----------------------------------------------------------------------------------
    def received(self, message: Any) -> None:
        try:
            self._dispatch(message)
        except Exception:  # noqa: BLE001 - one bad message must not take the connection (and the stub) down
            log.exception("'%s': could not handle a message from the stub", self.launch.label)

    def _dispatch(self, message: Any) -> None:
        kind, call_id, body = message
        if kind == wire.REPLY:
            future = self._calls.get(call_id)
            if future is not None and not future.done():
                future.set_result(body)
        elif kind == wire.RESPONSE:
            result, flags = body
            final = bool(flags & wire.FINAL)
            sink = self._streams.pop(call_id, None) if final else self._streams.get(call_id)
            if sink is not None:
                sink(result, final)
        elif kind == wire.INFER:
            if body.get("decoupled"):
                self._run_bls_stream(call_id, body)
            else:
                self._run_bls(call_id, body)
        elif kind == wire.CONTROL:
            self._run_control(call_id, body)
        elif kind == wire.METRIC:
            self._metric(call_id, body)
        elif kind == wire.CANCEL:  # the model cancelled a decoupled BLS call's response iterator
            handle = self._bls_streams.pop(call_id, None)
            if handle is not None:
                handle.cancel()  # a withdrawn stream says nothing more: its iterator ends here
                if self._protocol is not None and self.alive:
                    self._protocol.send((wire.PART, call_id, (None, ("CANCELLED", "request cancelled"), True)))
        elif kind == wire.LOG:
            level, text = body
            log.log(_LOG_LEVELS.get(level, logging.INFO), "%s: %s", self.launch.label, text)

    def _run_bls(self, call_id: int, body: dict) -> None:
        """A model's BLS request, run through the core; the answer (or the error) goes back to the stub."""
        try:
            task = asyncio.ensure_future(self._core.infer(bls_request(body)))
        except ServerError as e:
            self._reply(call_id, None, _error_code(e))
            return
        self._bls.add(task)
        task.add_done_callback(lambda done: self._bls_done(call_id, done))

    def _run_bls_stream(self, call_id: int, body: dict) -> None:
        """A model's `exec(decoupled=True)`: the request runs as a stream (the core's `submit_stream`, for decoupled
        and ordinary models alike) and each response goes back to the stub as it comes, as a PART message; the
        last one carries the final flag (alone, for a bare final flag: the model sees an empty response)."""
        finished = False

        def on_part(part: StreamPart) -> None:
            nonlocal finished
            error = None if part.error is None else _error_code(part.error)
            value = None if part.response is None else _outputs_of(part.response)
            if part.final:
                finished = True
                self._bls_streams.pop(call_id, None)
            if self._protocol is not None and self.alive:
                self._protocol.send((wire.PART, call_id, (value, error, part.final)))

        try:
            handle = self._core.submit_stream(bls_request(body), on_part)
        except ServerError as e:
            on_part(StreamPart(error=e, final=True))
            return
        if handle is not None and not finished:
            self._bls_streams[call_id] = handle

    def _metric(self, call_id: int, body: dict) -> None:
        """A custom-metric operation (pb_utils.MetricFamily / Metric) on the core's registry; created and read
        values are answered, a failed update (the stub checks them first) is logged."""
        metrics, owner = self._core.custom_metrics, id(self)
        try:
            op = body["op"]
            value: Any = None
            if op == "family":
                metrics.family(owner, str(body["name"]), str(body["description"]), str(body["kind"]))
            elif op == "metric":
                value = metrics.metric(owner, str(body["name"]), dict(body["labels"]), body.get("buckets"))
            elif op == "value":
                value = metrics.value(int(body["id"]))
            else:
                metrics.update(int(body["id"]), op, float(body["value"]))
        except (ValueError, KeyError, TypeError) as e:
            if call_id:
                self._reply(call_id, None, ("INVALID_ARG", str(e)))
            else:
                log.warning("'%s': custom metric update refused: %s", self.launch.label, e)
            return
        if call_id:
            self._reply(call_id, value, None)

    def _run_control(self, call_id: int, body: dict) -> None:
        """`pb_utils.load_model` / `unload_model` / `is_model_ready`: the core's repository API (explicit mode only,
        as in Triton); the answer or the error goes back to the stub."""
        op, name = body.get("op"), str(body.get("name", ""))
        if op == "load":
            work: Awaitable[Any] = self._core.load_model(name, body.get("config"), body.get("files") or None)
        elif op == "unload":
            work = self._core.unload_model(name, bool(body.get("unload_dependents")))
        elif op == "ready":
            work = self._core.model_ready(name, str(body.get("version", "")))
        else:
            self._reply(call_id, None, ("INVALID_ARG", f"unknown model control operation {op!r}"))
            return
        task = asyncio.ensure_future(work)
        self._bls.add(task)
        task.add_done_callback(lambda done: self._bls_done(call_id, done, plain=True))

    def _bls_done(self, call_id: int, done: asyncio.Future, plain: bool = False) -> None:
        self._bls.discard(done)
        if done.cancelled():
            return
        error = done.exception()
        if error is None and plain:  # a model-control answer: the value as it is
            self._reply(call_id, done.result(), None)
        elif error is None:
            self._reply(call_id, _outputs_of(done.result()), None)
        else:
            if not isinstance(error, ServerError):
                log.error("'%s': BLS request failed", self.launch.label, exc_info=error)
            self._reply(call_id, None, _error_code(error))

    def _reply(self, call_id: int, value: Any, error: tuple[str, str] | None) -> None:
        if self._protocol is not None and self.alive:
            self._protocol.send((wire.REPLY, call_id, (value, error)))


def _error_code(error: BaseException) -> tuple[str, str]:
    """An error as the stub takes it: (TritonError code name, message)."""
    if isinstance(error, ServerError):
        return _CODE_OF_KIND.get(error.kind, "INTERNAL"), error.message
    return "INTERNAL", f"{type(error).__name__}: {error}"


def _outputs_of(response: InferResponse) -> dict:
    """A response's outputs as the stub takes them."""
    return {"outputs": [(o.name, o.data) for o in response.outputs]}


def bls_request(body: dict) -> InferRequest:
    """A stub's BLS request as the core's request: flags, correlation id and timeout become Triton's request
    parameters (sequence_start/sequence_end, sequence_id, timeout in microseconds)."""
    parameters = dict(body["parameters"])
    if body["correlation_id"]:
        parameters["sequence_id"] = body["correlation_id"]
    if body["flags"] & _SEQUENCE_START:
        parameters["sequence_start"] = True
    if body["flags"] & _SEQUENCE_END:
        parameters["sequence_end"] = True
    if body["timeout"]:
        parameters["timeout"] = body["timeout"]
    inputs = [InferInput(name, datatype_of_numpy(array.dtype), tuple(array.shape), array)
              for name, array in body["inputs"]]
    version = body["model_version"]
    return InferRequest(body["model_name"], inputs, "" if version < 0 else str(version), body["request_id"],
                        [RequestedOutput(name) for name in body["outputs"]], parameters)


class _StubProtocol(asyncio.BufferedProtocol):
    """The server's end of a stub's socket: frames in through remote.py's decoder, wire.py's frames out."""

    def __init__(self, stub: Stub) -> None:
        self._stub = stub
        self._decoder = FrameDecoder(stub.received)
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._decoder.buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self._decoder.advance(nbytes)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._stub.kill()  # a stub without its connection can do nothing more; _watch reports the exit

    def send(self, message: Any) -> None:
        if self.transport is not None and not self.transport.is_closing():
            parts = wire.encode(message)
            frame = wire.joined(parts)  # a small frame: one write, not one per part
            if frame is not None:
                self.transport.write(frame)
            else:
                self.transport.writelines(parts)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is gone"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (signal {-code})"
    return f"exited with code {code}"


def server_python() -> str:
    """The interpreter stubs run with when a model names no environment of its own."""
    return sys.executable
