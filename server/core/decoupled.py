"""Decoupled models (Triton's `model_transaction_policy { decoupled: true }`): a request answered by zero, one or
many responses, then a final flag, each response passed on as the model sends it.

Why a separate road: `submit_infer` answers a request exactly once, which is what HTTP /infer and gRPC ModelInfer
need (and why they refuse a decoupled model, with Triton's texts). Streams (gRPC ModelStreamInfer, HTTP
generate_stream) take `submit_stream`: `on_part(StreamPart)` is called for every response and once with `final`
set, on the event loop. An ordinary model's request goes through `submit_infer` and comes back as one final part,
so a stream serves both kinds. Only Python models can be decoupled (python_model.py runs their response senders).

Statistics as Triton's Python backend reports a decoupled request: success or failure when its execute() call
returns (the responses sent later count as that request's), queue and compute times as for any execution.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from . import request_io
from .errors import ErrorKind, ServerError
from .model import ServedModel
from .scheduler import Job
from .types import InferRequest, InferResponse, RequestedOutput

#: Triton's refusals of a decoupled model where one response is expected (http_server.cc, grpc/infer_handler.cc)
HTTP_REFUSAL = "HTTP end point doesn't support models with decoupled transaction policy"
GRPC_REFUSAL = "ModelInfer RPC doesn't support models with decoupled transaction policy"


def refused() -> ServerError:
    """What a single-response call to a decoupled model gets (HTTP's wording; gRPC ModelInfer says its own)."""
    return ServerError(ErrorKind.UNIMPLEMENTED, HTTP_REFUSAL)


def single_response(model: ServedModel) -> ServedModel:
    """`model`, for a call that takes one response; Triton's refusal when it is decoupled."""
    if is_decoupled(model):
        raise refused()
    return model


def is_decoupled(model: ServedModel) -> bool:
    """Only a Python model runs decoupled (`PythonVersion.decoupled`; an ONNX model loaded with --lenient-config
    ignores the field)."""
    return getattr(model, "decoupled", False) is True


@dataclass
class StreamPart:
    """One thing a stream says: a response, or its error (the stream goes on unless `final`), or only the final flag
    (`response` and `error` None: Triton's empty final response)."""

    response: InferResponse | None = None
    error: BaseException | None = None
    final: bool = False


OnPart = Callable[[StreamPart], None]


class _Core(Protocol):
    """What a stream needs of `ServerCore` (core.py passes itself)."""

    system_shm: Any

    def _version(self, name: str, version: str = "") -> ServedModel: ...

    def _checked(self, model: ServedModel, request: InferRequest) -> tuple[dict[str, Any], int, list[RequestedOutput]]: ...

    def submit_infer(self, request: InferRequest, reply: Callable[[Any, BaseException | None], None]
                     ) -> asyncio.Future | None: ...


class Stream:
    """One decoupled request's `ResponseStream` (scheduler.py): the model's responses become StreamParts; nothing
    passes once the final flag has (or the caller withdrew)."""

    def __init__(self, core: _Core, model: ServedModel, request: InferRequest, requested: list[RequestedOutput],
                 on_part: OnPart) -> None:
        self._core = core
        self._model = model
        self._request = request
        self._requested = requested
        self._on_part = on_part
        self.done = False
        self.on_cancel: Callable[[], None] | None = None

    def deliver(self, outputs: dict[str, np.ndarray] | None, error: BaseException | None, final: bool) -> None:
        if self.done:
            return
        self.done = final
        response = None
        if outputs is not None and error is None:
            try:
                response = self._response(outputs)
            except Exception as e:  # noqa: BLE001 - this response fails; the stream goes on
                error = e
        self._on_part(StreamPart(response, error, final))

    def _response(self, outputs: dict[str, np.ndarray]) -> InferResponse:
        """The outputs the model put in this response, post-processed as the request asks (shared memory,
        classification)."""
        model = self._model
        converted = [request_io.output(self._core.system_shm, model, o, outputs[o.name])
                     for o in self._requested if o.name in outputs]
        return InferResponse(model.name, str(model.version), converted, id=self._request.id)

    def withdraw(self) -> None:
        """The caller gave up: nothing more reaches it, and the model's sender says so (`is_cancelled()`)."""
        if not self.done:
            self.done = True
            if self.on_cancel is not None:
                self.on_cancel()


class _Withdrawal:
    """What a stream's caller cancels: the queued job (it leaves the queue) and the stream."""

    def __init__(self, job: asyncio.Future, stream: Stream) -> None:
        self._job = job
        self._stream = stream

    def cancel(self) -> None:
        self._job.cancel()
        self._stream.withdraw()


def submit_stream(core: _Core, request: InferRequest, on_part: OnPart) -> Any:
    """Start `request` as a stream (see the module docstring). Returns what to `cancel()` to withdraw it, or None
    when it was answered at once."""
    started = time.perf_counter_ns()
    try:
        model = core._version(request.model_name, request.model_version)
    except ServerError as e:
        on_part(StreamPart(error=e, final=True))
        return None
    if not is_decoupled(model):
        return core.submit_infer(request, lambda response, error: _answered(on_part, response, error))
    own = getattr(model, "submit_stream", None)  # a decoupled ensemble runs its steps itself (ensemble.py)
    if own is not None:
        return own(core, request, on_part)
    try:
        inputs, batch, requested = core._checked(model, request)
        stream = Stream(core, model, request, requested, on_part)
        job = Job(inputs, batch, parameters=request.parameters, request_id=request.id,
                  outputs=tuple(o.name for o in requested), responses=stream)
        future = model.scheduler.enqueue(job)
    except Exception as e:  # noqa: BLE001 - answered, as a request that never ran
        model.statistics.record_failure(time.perf_counter_ns() - started)
        on_part(StreamPart(error=e, final=True))
        return None
    future.add_done_callback(lambda done: _executed(done, model, stream, batch, started))
    return _Withdrawal(future, stream)


def _answered(on_part: OnPart, response: InferResponse | None, error: BaseException | None) -> None:
    if not isinstance(error, asyncio.CancelledError):
        on_part(StreamPart(response, error, final=True))


def _executed(done: asyncio.Future, model: ServedModel, stream: Stream, batch: int, started: int) -> None:
    """The request's execute() returned (or failed, or the request left the queue): its statistics; a failure ends
    the stream with its error unless the final flag came already."""
    if done.cancelled():
        return
    error = done.exception()
    if error is None:
        model.statistics.record_success(batch, time.perf_counter_ns() - started, done.result().times)
        return
    model.statistics.record_failure(time.perf_counter_ns() - started)
    stream.deliver(None, error, True)


async def stream_parts(submit: Callable[[InferRequest, OnPart], Any], request: InferRequest
                       ) -> AsyncIterator[StreamPart]:
    """`submit_stream` as an async iterator of its parts, up to the final one; leaving early withdraws the request."""
    async for _, part in merged_stream_parts(submit, [request]):
        yield part


async def merged_stream_parts(submit: Callable[[InferRequest, OnPart], Any], requests: Sequence[InferRequest]
                              ) -> AsyncIterator[tuple[int, StreamPart]]:
    """Several requests' streams as one async iterator of (request index, part), in arrival order, until every
    stream's final part (OpenAI's `n` choices); leaving early withdraws the requests still running."""
    parts: asyncio.Queue[tuple[int, StreamPart]] = asyncio.Queue()
    handles = [submit(request, functools.partial(_tagged, parts, index)) for index, request in enumerate(requests)]
    running = set(range(len(requests)))
    try:
        while running:
            index, part = await parts.get()
            if part.final:
                running.discard(index)
            yield index, part
    finally:
        for index in running:
            if handles[index] is not None:
                handles[index].cancel()


def _tagged(parts: asyncio.Queue[tuple[int, StreamPart]], index: int, part: StreamPart) -> None:
    parts.put_nowait((index, part))
