"""The process of one Python model instance (Triton's stub): runs `TritonPythonModel` for the server.

    <python> stub.py <socket fd>

The server (server/core/python_stub.py) starts one per model instance with one end of a socket pair, then calls it
(wire.py's messages): AUTO_COMPLETE (the class's `auto_complete_config`), INITIALIZE (import model.py as Triton
does, make the instance, call `initialize(args)`), EXECUTE (a batch of requests -> one `execute()` call ->
one response per request), FINALIZE. Calls run one at a time on the main thread; a reader thread takes the server's
messages, so BLS replies reach a model that waits for them in `exec()` or awaits them in `async def execute`.
A decoupled model's execute() returns None; its response senders send each response to the server at once, from
whatever thread the model sends it (RESPONSE messages), before or after execute() returns.
When the server goes away (the socket closes) the process exits.

Only the standard library and numpy: the interpreter may be a model's own environment (EXECUTION_ENV_PATH).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import itertools
import json
import os
import queue
import signal
import socket
import sys
import threading
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent


def _load_sibling(module_name: str, filename: str) -> ModuleType:
    """A module of this directory by path: the directory stays off sys.path, so a model's own `wire` or `stub`
    module is never shadowed by ours."""
    spec = importlib.util.spec_from_file_location(module_name, HERE / filename)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[module_name] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


class StubRuntime:
    """The stub's side of the connection, and what `triton_python_backend_utils` asks of it (BLS, logs)."""

    def __init__(self, sock: socket.socket, wire: ModuleType, pb_utils: ModuleType | None) -> None:
        self.sock = sock
        self.wire = wire
        self.pb_utils = pb_utils
        self.model_dir = ""
        self.calls: queue.Queue = queue.Queue()  # the server's calls, run in order on the main thread
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._waiting: dict[int, Any] = {}  # our BLS calls: call id -> callable taking (value, error)
        self._waiting_lock = threading.Lock()
        self._cancelled: set[int] = set()  # decoupled requests whose client gave up (CANCEL from the server)

    # -- the connection -------------------------------------------------------------------------------------------
    def send(self, message: Any) -> None:
        with self._send_lock:
            self.wire.send(self.sock, message)

    def read_forever(self) -> None:
        """Reader thread: the server's calls go to the main thread's queue, replies to whoever waits for them.
        The server gone, the process ends (nothing could use its results)."""
        while True:
            message = self.wire.receive(self.sock)
            if message is None:
                os._exit(0)
            kind, call_id, body = message
            if kind == self.wire.CANCEL:
                self._cancelled.add(call_id)
            elif kind == self.wire.REPLY:
                with self._waiting_lock:
                    deliver = self._waiting.pop(call_id, None)
                if deliver is not None:
                    deliver(*body)
            elif kind == self.wire.PART:  # a response of a decoupled BLS call; the final one ends it
                with self._waiting_lock:
                    deliver = self._waiting.pop(call_id, None) if body[2] else self._waiting.get(call_id)
                if deliver is not None:
                    deliver(*body)
            else:
                self.calls.put((kind, call_id, body))

    # -- what pb_utils asks -----------------------------------------------------------------------------------------
    def exec(self, request: Any) -> Any:
        """A BLS request, waited for on this thread."""
        return self._response(*self._wait_for(self.wire.INFER, _bls_body(request)))

    def async_exec(self, request: Any) -> asyncio.Future:
        """A BLS request as a future of the running event loop (the one `async def execute` runs on)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def deliver(value: Any, error: Any) -> None:
            response = self._response(value, error)
            loop.call_soon_threadsafe(lambda: future.done() or future.set_result(response))

        self._call(self.wire.INFER, _bls_body(request), deliver)
        return future

    def exec_decoupled(self, request: Any) -> Any:
        """A BLS request whose responses come as they are sent (`exec(decoupled=True)`): a ResponseIterator."""
        iterator = self.pb_utils.ResponseIterator()

        def deliver(value: Any, error: Any, final: bool) -> None:
            iterator._put(self._response(value, error), final)

        call_id = self._call(self.wire.INFER, {**_bls_body(request), "decoupled": True}, deliver)
        iterator._cancel = lambda: self.send((self.wire.CANCEL, call_id, None))
        return iterator

    def async_exec_decoupled(self, request: Any) -> asyncio.Future:
        """`async_exec(decoupled=True)`: a future of the ResponseIterator (its responses arrive as they are sent)."""
        future = asyncio.get_running_loop().create_future()
        future.set_result(self.exec_decoupled(request))
        return future

    def control(self, op: str, **arguments: Any) -> Any:
        """Model control through the server (load, unload, ready), waited for on this thread; the server's error
        is raised as TritonModelException with its message."""
        return self._ask(self.wire.CONTROL, {"op": op, **arguments})

    def metric(self, op: str, wait: bool, **arguments: Any) -> Any:
        """A custom-metric operation on the server: waited for (create, read) or sent (updates, in order)."""
        if not wait:
            self.send((self.wire.METRIC, 0, {"op": op, **arguments}))
            return None
        return self._ask(self.wire.METRIC, {"op": op, **arguments})

    def _ask(self, kind: str, body: dict) -> Any:
        """A call answered with a value, waited for on this thread; its error raised as TritonModelException."""
        value, error = self._wait_for(kind, body)
        if error is not None:
            raise self.pb_utils.TritonModelException(error[1])
        return value

    def _wait_for(self, kind: str, body: dict) -> tuple[Any, Any]:
        """Call the server and wait on this thread for the (value, error) of its REPLY."""
        done = threading.Event()
        result: list[tuple[Any, Any]] = []

        def deliver(value: Any, error: Any) -> None:
            result.append((value, error))
            done.set()

        self._call(kind, body, deliver)
        done.wait()
        return result[0]

    def _call(self, kind: str, body: dict, deliver: Any) -> int:
        """Send a call whose REPLY (or PARTs) the reader thread hands to `deliver`; its call id."""
        call_id = next(self._ids)
        with self._waiting_lock:
            self._waiting[call_id] = deliver
        try:
            self.send((kind, call_id, body))
        except Exception:
            with self._waiting_lock:
                self._waiting.pop(call_id, None)
            raise
        return call_id

    def log(self, level: int, message: str) -> None:
        self.send((self.wire.LOG, 0, (level, message)))

    def send_response(self, stream: int, response: Any, flags: int, requested: list[str]) -> None:
        """A decoupled request's response (or bare final flag), sent now from the caller's thread."""
        result = None if response is None else _result(self.pb_utils, requested, response)
        self.send((self.wire.RESPONSE, stream, (result, flags)))
        if flags & self.wire.FINAL:
            self._cancelled.discard(stream)

    def is_cancelled(self, stream: int) -> bool:
        return stream in self._cancelled

    def _response(self, value: Any, error: Any) -> Any:
        pb = self.pb_utils
        if error is not None:
            code, message = error
            return pb.InferenceResponse(error=pb.TritonError(message, pb._error_code(code)))
        if value is None:  # a decoupled call's bare final flag: Triton's empty last response
            return pb.InferenceResponse()
        return pb.InferenceResponse(output_tensors=[pb.Tensor(name, array) for name, array in value["outputs"]])


class ModelHost:
    """The model: model.py imported as Triton does, the `TritonPythonModel` instance, and the calls on it."""

    def __init__(self, runtime: StubRuntime) -> None:
        self.runtime = runtime
        self.pb_utils = runtime.pb_utils
        self.module: ModuleType | None = None
        self.instance: Any = None
        self.name = ""
        self._loop: asyncio.AbstractEventLoop | None = None

    def load(self, body: dict) -> None:
        """Import `<version>/<file>` as module `<version>.<file stem>`, with the version directory and the model
        directory on sys.path (Triton's stub does exactly this, so a model's relative imports work the same)."""
        if self.module is not None:
            return
        path = Path(body["model_file"])
        self.name = body["model_name"]
        self.runtime.model_dir = str(path.parent)
        sys.path.extend([str(path.parent), str(path.parent.parent)])
        self.module = importlib.import_module(f"{path.parent.name}.{path.stem}")
        if not hasattr(self.module, "TritonPythonModel"):
            raise self.pb_utils.TritonModelException(f"{path} defines no class TritonPythonModel")

    def auto_complete(self, body: dict) -> str:
        self.load(body)
        model_class = self.module.TritonPythonModel  # type: ignore[union-attr]
        config = self.pb_utils.ModelConfig(body["config"])
        if hasattr(model_class, "auto_complete_config"):
            config = model_class.auto_complete_config(config)
        if not isinstance(config, self.pb_utils.ModelConfig):
            raise self.pb_utils.TritonModelException(f"auto_complete_config function in model '{self.name}' must "
                                                     "return a valid pb.ModelConfig object.")
        return json.dumps(config.as_dict())

    def initialize(self, body: dict) -> None:
        self.load(body)
        self.instance = self.module.TritonPythonModel()  # type: ignore[union-attr]
        if not hasattr(self.instance, "execute"):
            raise self.pb_utils.TritonModelException(f"Python model '{self.name}' does not implement `execute` "
                                                     "method.")
        if hasattr(self.instance, "initialize"):
            self.instance.initialize(body["args"])

    def execute(self, requests: list[dict]) -> list[dict] | None:
        """One execute() call for the batch; per request its outputs (only the requested ones, as Triton prunes
        them) or its response's error. An exception fails the whole batch (the caller answers it)."""
        pb = self.pb_utils
        batch = [_request(pb, self.name, body) for body in requests]
        if any("stream" in body for body in requests):
            return self._execute_decoupled(batch)
        returned = self.instance.execute(batch)
        if asyncio.iscoroutine(returned):
            returned = asyncio.run_coroutine_threadsafe(returned, self._event_loop()).result()
        if returned is None:  # the model answered through the requests' response senders (Triton 24.06+)
            returned = [None] * len(batch)
        if not isinstance(returned, list):
            raise pb.TritonModelException(f"Expected a list in the execute return, found type "
                                          f"'{type(returned)}'.")
        if len(returned) != len(batch):
            raise pb.TritonModelException("Number of InferenceResponse objects do not match the number of "
                                          f"InferenceRequest objects. InferenceRequest(s) size is:{len(batch)}, and "
                                          f"InferenceResponse(s) size is:{len(returned)}\n")
        return [_result(pb, request.requested_output_names(), _answer(pb, request, response))
                for request, response in zip(batch, returned)]

    def _execute_decoupled(self, batch: list[Any]) -> None:
        """execute() of a decoupled model: it must return None (an `async def` one runs on in the background, as in
        Triton). When it raises, every sender is closed: the server fails the requests not yet finished."""
        pb = self.pb_utils
        try:
            returned = self.instance.execute(batch)
            if asyncio.iscoroutine(returned):
                asyncio.run_coroutine_threadsafe(returned, self._event_loop())
            elif returned is not None:
                raise pb.TritonModelException(f"Python model '{self.name}' is using the decoupled mode and the "
                                              "execute function must return None.")
        except BaseException:
            for request in batch:
                request.get_response_sender()._close()
            raise
        return None

    def finalize(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self.instance is not None and hasattr(self.instance, "finalize"):
            self.instance.finalize()

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        """One event loop in a thread of its own for `async def execute` (Triton's stub keeps one too), so tasks a
        model leaves running go on between calls."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="model-event-loop", daemon=True).start()
        return self._loop


def _request(pb: ModuleType, model_name: str, body: dict) -> Any:
    request = pb.InferenceRequest(
        request_id=body["request_id"], correlation_id=body["correlation_id"],
        inputs=[pb.Tensor(name, array) for name, array in body["inputs"]],
        requested_output_names=body["outputs"], model_name=model_name, model_version=body["model_version"],
        flags=body["flags"])
    request._parameters = body["parameters"]  # the client's JSON as it came (any value types)
    if "stream" in body:  # a decoupled model's request
        request._response_sender = pb.InferenceResponseSender(body["stream"], body["outputs"])
    return request


def _answer(pb: ModuleType, request: Any, returned: Any) -> Any:
    """A default-mode request's response: the one execute() returned for it, or the one the model sent through
    the request's response sender (waited for until the final flag), not both."""
    sender = request._response_sender
    if returned is not None:
        if sender is not None and sender._sent:
            return pb.InferenceResponse(error=pb.TritonError("Unable to send response. Non-decoupled model cannot "
                                                             "send more than one response."))
        return returned
    if sender is None:
        return None  # neither returned nor sent: _result says so
    return sender._wait()


def _bls_body(request: Any) -> dict:
    """A BLS request (pb_utils.InferenceRequest) as the server takes it (server/core/python_stub.bls_request)."""
    return {
        "model_name": request._model_name, "model_version": request._model_version,
        "request_id": request.request_id(), "correlation_id": request.correlation_id(),
        "inputs": [(t.name(), _wire_array(t.as_numpy())) for t in request.inputs()],
        "outputs": request.requested_output_names(), "flags": request.flags(), "timeout": request.timeout(),
        "parameters": json.loads(request.parameters()),
    }


def _result(pb: ModuleType, requested: list[str], response: Any) -> dict:
    if response is None:
        raise pb.TritonModelException("Expected an 'InferenceResponse' object in the execute function return list, "
                                      "found type '<class 'NoneType'>' (Kiln answers every request)")
    if not isinstance(response, pb.InferenceResponse):
        raise pb.TritonModelException("Expected an 'InferenceResponse' object in the execute function return list, "
                                      f"found type '{type(response)}'.")
    if response.has_error():
        error = response.error()
        return {"error": (pb._CODE_NAMES.get(error.code(), "INTERNAL"), error.message())}
    wanted = set(requested)
    return {"outputs": [(t.name(), _wire_array(t.as_numpy())) for t in response.output_tensors()
                        if t.name() in wanted]}


def _wire_array(array: Any) -> Any:
    """What the server takes: BYTES as an object array of bytes (text encoded as UTF-8, other objects as their
    str(), as Triton serializes them); every other array as it is."""
    import numpy as np  # here, not at the top: without numpy the stub must still start and say what is missing

    if array.dtype.kind not in "OSU":
        return array
    items = [item if isinstance(item, bytes) else str(item).encode("utf-8") for item in array.flat]
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out.reshape(array.shape)


def describe_exception(error: BaseException) -> str:
    """`Type: message` and the frames, innermost first, as pybind11 words a Python error in Triton's stub."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename != __file__]  # the model's only
    lines = [f"  {frame.filename}({frame.lineno}): {frame.name}" for frame in reversed(frames)]
    text = f"{type(error).__name__}: {error}"
    return f"{text}\n\nAt:\n" + "\n".join(lines) if lines else text


def serve(runtime: StubRuntime, host: ModelHost | None, startup_error: str = "") -> None:
    """Run the server's calls in order until FINALIZE; each gets one REPLY. Without a host (the stub could not
    set itself up, e.g. no numpy in the model's environment) every call is answered with `startup_error`."""
    wire = runtime.wire
    handlers = {} if host is None else {wire.AUTO_COMPLETE: host.auto_complete, wire.INITIALIZE: host.initialize,
                                        wire.EXECUTE: host.execute, wire.FINALIZE: lambda _: host.finalize()}
    while True:
        kind, call_id, body = runtime.calls.get()
        if host is None:
            value, error = None, ("INTERNAL", startup_error)
        else:
            try:
                value, error = handlers[kind](body), None
            except BaseException as e:  # noqa: BLE001 - the model's failure goes to the server, the stub serves on
                value, error = None, ("INTERNAL", describe_exception(e))
        runtime.send((wire.REPLY, call_id, (value, error)))
        if kind == wire.FINALIZE:
            return


def yield_on_wakeup() -> None:
    """Run this process's threads (those started later inherit it) under Linux's SCHED_BATCH policy: the same
    share of the CPU, but a stub woken by the server's message no longer preempts the server's event loop on a
    busy machine. The loop feeds every model and answers every client, and one preempted while it hands a batch
    to a stub stalled all of them until the stub's execute() had run (on a 2-core machine serving a 3-model Python
    pipeline the loop was preempted 0.8 times per request; 0.5 with this, and the p99 latency fell by 30-50 %).
    Elsewhere, or where the policy cannot be set, nothing changes."""
    setter = getattr(os, "sched_setscheduler", None)
    policy = getattr(os, "SCHED_BATCH", None)
    if setter is None or policy is None:
        return
    try:
        setter(0, policy, os.sched_param(0))
    except OSError:
        pass


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the server's to handle
    yield_on_wakeup()
    while str(HERE) in sys.path:  # the script's directory: see _load_sibling
        sys.path.remove(str(HERE))
    sock = socket.socket(fileno=int(argv[1]))
    wire = _load_sibling("_kiln_stub_wire", "wire.py")
    runtime = StubRuntime(sock, wire, None)
    threading.Thread(target=runtime.read_forever, name="stub-reader", daemon=True).start()
    try:
        runtime.pb_utils = _load_sibling("triton_python_backend_utils", "triton_python_backend_utils.py")
    except Exception as e:  # noqa: BLE001 - said to the server, which fails the load with it
        serve(runtime, None, f"the stub could not import triton_python_backend_utils with {sys.executable} "
                             f"(Python {sys.version.split()[0]}): {type(e).__name__}: {e}")
        return 1
    runtime.pb_utils._runtime = runtime
    serve(runtime, ModelHost(runtime))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
