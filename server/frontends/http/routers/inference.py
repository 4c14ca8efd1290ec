"""POST .../infer: JSON and binary tensor data, compression, classification, shared memory.

The body is read raw (not through a pydantic body parameter) because binary tensor data may follow the
JSON header; `codec` validates the header with the schema and converts the tensors.
"""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import APIRouter, Request, Response

from server.core import InferRequest, InferResponse, ServerCore

from ..codec import HEADER_LENGTH, compress, decode_request, decompress, encode_response, pick_encoding
from ..deps import CoreDep
from ..schemas import InferRequestBody, InferResponseBody

router = APIRouter(tags=["inference"])

_DOC = {"requestBody": {"content": {"application/json": {"schema": InferRequestBody.model_json_schema()},
                                    "application/octet-stream": {}}}}


@router.post("/v2/models/{model_name}/infer", response_model=InferResponseBody, openapi_extra=_DOC)
@router.post("/v2/models/{model_name}/versions/{model_version}/infer", response_model=InferResponseBody,
             openapi_extra=_DOC)
async def infer(core: CoreDep, request: Request, model_name: str, model_version: str = "") -> Response:
    raw = await request.body()
    limit = request.app.state.limits.decompressed_limit(len(raw))
    body = decompress(raw, request.headers.get("content-encoding"), limit)
    infer_request = decode_request(body, request.headers.get(HEADER_LENGTH), model_name, model_version)
    response = await _infer_unless_disconnected(core, infer_request, request)
    if response is None:  # nobody is listening any more
        return Response(status_code=499)
    binary_default = bool(infer_request.parameters.get("binary_data_output", False))
    content, header_length = encode_response(response, binary_default)
    headers = {}
    if header_length is not None:
        headers[HEADER_LENGTH] = str(header_length)
    encoding = pick_encoding(request.headers.get("accept-encoding"))
    if encoding is not None:
        content = compress(content, encoding)
        headers["Content-Encoding"] = encoding
    media_type = "application/octet-stream" if header_length is not None else "application/json"
    return Response(content=content, media_type=media_type, headers=headers)


async def _wait_for_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body is already read, so the only message left is disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _infer_unless_disconnected(core: ServerCore, infer_request: InferRequest,
                                     request: Request) -> InferResponse | None:
    """Run the request, cancelling it if the client disconnects first (a queued job then never runs)."""
    work = asyncio.ensure_future(core.infer(infer_request))
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait([work, watcher], return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        raise
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    if not work.done():
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await work
        return None
    return work.result()
