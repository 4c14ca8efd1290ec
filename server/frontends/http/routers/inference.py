"""POST .../infer: JSON and binary tensor data, compression, classification, shared memory.

The body is read raw (not through a pydantic body parameter) because binary tensor data may follow the
JSON header; `codec` validates the header with the schema and converts the tensors.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import APIRouter, Request, Response

from server.core import InferRequest, InferResponse, ServerCore
from server.core.errors import ServerError
from server.core.limits import RequestLimits

from ..codec import (
    HEADER_LENGTH,
    compress,
    decode_request,
    decompress,
    encode_response,
    is_raw_binary,
    parse_header_length,
    pick_encoding,
)
from ..deps import CoreDep
from ..schemas import InferRequestBody, InferResponseBody

router = APIRouter(tags=["inference"])

_DOC = {"requestBody": {"content": {"application/json": {"schema": InferRequestBody.model_json_schema()},
                                    "application/octet-stream": {}}}}


@router.post("/v2/models/{model_name}/infer", response_model=InferResponseBody, openapi_extra=_DOC)
@router.post("/v2/models/{model_name}/versions/{model_version}/infer", response_model=InferResponseBody,
             openapi_extra=_DOC)
async def infer(core: CoreDep, request: Request, model_name: str, model_version: str = "") -> Response:
    """FastAPI's route (OpenAPI docs, and the requests the protocol's own inference road leaves to ASGI:
    `Expect: 100-continue`, pipelined behind another request, percent-encoded paths; `protocol.py`)."""
    outcome = await run_infer(core, request.app.state.limits, await request.body(), request.headers.get,
                              model_name, model_version, lambda: wait_for_disconnect(request.receive))
    if outcome is None:  # nobody is listening any more
        return Response(status_code=499)
    return Response(content=outcome.content, media_type=outcome.media_type, headers=outcome.headers)


@dataclass
class InferOutcome:
    """A successful inference answer, protocol-level: body, its media type and the extra headers."""

    content: bytes
    media_type: str
    headers: dict[str, str]


class UnparsedBody(Exception):
    """The request's JSON header did not decode (`error` says why). Triton looks the model up before it parses
    the body, so an unknown model answers 404 whatever else is wrong: the caller asks `core.model_metadata`
    first, and answers `error` when the model is there."""

    def __init__(self, error: ServerError) -> None:
        super().__init__(error.message)
        self.error = error


def read_infer_request(limits: RequestLimits, raw: bytes, header: Callable[[str], str | None], model_name: str,
                       model_version: str) -> InferRequest:
    """The request in `raw` (its body) and headers (`header` looks a name up case-insensitively): decompressed,
    size-checked and decoded. Raises ServerError, or `UnparsedBody` when the JSON header did not decode."""
    body = decompress(raw, header("content-encoding"), limits.decompressed_limit(len(raw)),
                      limits.decompression_refusal)
    header_length = header(HEADER_LENGTH)
    if is_raw_binary(header_length):
        limits.check_raw_input_size(len(body))
        return InferRequest(model_name, [], model_version, raw_input=body, traceparent=header("traceparent") or "")
    length = parse_header_length(header_length)  # one that lies about the body is decode_request's 400
    limits.check_json_size(len(body) if length is None else min(length, len(body)))
    try:
        request = decode_request(body, header_length, model_name, model_version)
    except ServerError as e:
        raise UnparsedBody(e) from None
    request.traceparent = header("traceparent") or ""  # W3C trace context, continued by OpenTelemetry traces
    return request


def infer_outcome(request: InferRequest, response: InferResponse, header: Callable[[str], str | None]) -> InferOutcome:
    """The answer to `request`: the response encoded (binary where asked), compressed as the client accepts."""
    # A raw binary request has no JSON that could ask for JSON outputs: Triton sends every output binary.
    binary_default = request.raw_input is not None or bool(request.parameters.get("binary_data_output", False))
    content, header_length = encode_response(response, binary_default)
    headers = {}
    if header_length is not None:
        headers[HEADER_LENGTH] = str(header_length)
    encoding = pick_encoding(header("accept-encoding"))
    if encoding is not None:
        content = compress(content, encoding)
        headers["Content-Encoding"] = encoding
    media_type = "application/octet-stream" if header_length is not None else "application/json"
    return InferOutcome(content, media_type, headers)


async def run_infer(core: ServerCore, limits: RequestLimits, raw: bytes, header: Callable[[str], str | None],
                    model_name: str, model_version: str,
                    disconnected: Callable[[], Awaitable[None]]) -> InferOutcome | None:
    """One inference request from its raw body and headers to the response body; None when the client went away
    first. Raises ServerError for every client-visible failure. The route runs this; the HTTP protocol's own
    inference road (`protocol.py`) runs the same two halves, `read_infer_request` and `infer_outcome`."""
    try:
        infer_request = read_infer_request(limits, raw, header, model_name, model_version)
    except UnparsedBody as unparsed:
        await core.model_metadata(model_name, model_version)
        raise unparsed.error from None
    response = await _infer_unless_disconnected(core, infer_request, disconnected)
    if response is None:
        return None
    return infer_outcome(infer_request, response, header)


async def wait_for_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    """Returns when the client goes away (the body is already read, so the only message left is disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _infer_unless_disconnected(core: ServerCore, infer_request: InferRequest,
                                     disconnected: Callable[[], Awaitable[None]]) -> InferResponse | None:
    """Run the request, cancelling it if the client disconnects first (a queued job then never runs). The request
    runs in this task; only the disconnect watcher gets one of its own (a task and an `asyncio.wait` per request
    more were ~8% of the event loop's time on the CPU)."""
    current = asyncio.current_task()
    gone = False

    def on_disconnect(watcher: asyncio.Future) -> None:
        nonlocal gone
        if not watcher.cancelled() and watcher.exception() is None and current is not None:
            gone = True
            current.cancel()

    watcher = asyncio.ensure_future(disconnected())
    watcher.add_done_callback(on_disconnect)
    try:
        return await core.infer(infer_request)
    except asyncio.CancelledError:
        if not gone:
            raise
        current.uncancel()  # type: ignore[union-attr]
        return None
    finally:
        watcher.remove_done_callback(on_disconnect)
        watcher.cancel()
