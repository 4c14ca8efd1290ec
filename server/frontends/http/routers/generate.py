"""Triton's generate extension: POST .../generate (one JSON response) and .../generate_stream (server-sent events,
one `data: {...}` event per response: how HTTP clients read a decoupled model's responses).

JSON in and out as Triton documents it (docs/protocol/extension_generate.md): the request's top-level fields
named like the model's inputs are those inputs (a scalar is a [1] tensor, a list its own shape, a batch dim of 1
added for a batching model), `parameters` are the request's parameters; the response has `model_name`,
`model_version` and one field per output (one element as a scalar, more as a list). Errors before any response
are an ordinary JSON error with its status; in the event stream a failed response is `data: {"error": ...}`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from server.core import InferInput, InferRequest, InferResponse, numpy_dtype
from server.core.decoupled import StreamPart, stream_parts
from server.core.errors import ServerError, invalid

from ..deps import CoreDep

router = APIRouter(tags=["generate"])
RESERVED = ("parameters", "id")  # request fields that are not inputs


@router.post("/v2/models/{model_name}/generate")
@router.post("/v2/models/{model_name}/versions/{model_version}/generate")
async def generate(request: Request, core: CoreDep, model_name: str, model_version: str = "") -> Response:
    """Exactly one response: a model that sends more (a decoupled one) is told to use generate_stream."""
    infer = await _infer_request(request, core, model_name, model_version)
    responses = []
    async for part in stream_parts(core.submit_stream, infer):
        if part.error is not None:
            raise part.error
        if part.response is not None:
            responses.append(part.response)
    if len(responses) != 1:
        raise invalid(f"generate: model '{model_name}' sent {len(responses)} responses to the request, and "
                      "/generate returns exactly one; use /generate_stream")
    return JSONResponse(_generate_json(responses[0]))


@router.post("/v2/models/{model_name}/generate_stream")
@router.post("/v2/models/{model_name}/versions/{model_version}/generate_stream")
async def generate_stream(request: Request, core: CoreDep, model_name: str, model_version: str = "") -> Response:
    """Each response as a server-sent event as the model sends it; a failure before the first one is a JSON
    error with its status, as in Triton."""
    infer = await _infer_request(request, core, model_name, model_version)
    parts = stream_parts(core.submit_stream, infer)
    first = await anext(parts)
    if first.final and first.error is not None:
        raise first.error
    return StreamingResponse(_events(first, parts), media_type="text/event-stream; charset=utf-8")


async def _events(first: StreamPart, rest: AsyncIterator[StreamPart]) -> AsyncIterator[bytes]:
    """`data: {...}` per response or error; a bare final flag says nothing. Leaving early (the client went away)
    withdraws the request."""
    try:
        part: StreamPart | None = first
        while part is not None:
            if part.response is not None:
                yield _event(_generate_json(part.response))
            elif part.error is not None:
                message = part.error.message if isinstance(part.error, ServerError) else "internal error"
                yield _event({"error": message})
            part = None if part.final else await anext(rest, None)
    finally:
        await rest.aclose()


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


async def _infer_request(request: Request, core: Any, model_name: str, model_version: str) -> InferRequest:
    """The generate JSON as an inference request: fields named like the model's inputs are its inputs."""
    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError as e:
        raise invalid(f"generate: the body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise invalid("generate: the body must be a JSON object")
    metadata = await core.model_metadata(model_name, model_version)
    batching = (await core.model_config(model_name, model_version)).get("max_batch_size", 0) > 0
    inputs = []
    for spec in metadata["inputs"]:
        if spec["name"] in body:
            array = _array(spec["name"], spec["datatype"], body[spec["name"]], batching)
            inputs.append(InferInput(spec["name"], spec["datatype"], tuple(array.shape), array))
    parameters = body.get("parameters", {})
    if not isinstance(parameters, dict):
        raise invalid("generate: 'parameters' must be a JSON object")
    return InferRequest(model_name, inputs, model_version, str(body.get("id", "")), parameters=dict(parameters))


def _array(name: str, datatype: str, value: Any, batching: bool) -> np.ndarray:
    try:
        if datatype == "BYTES":
            array = np.array(value, dtype=object)
            array = np.vectorize(lambda v: v.encode() if isinstance(v, str) else v, otypes=[object])(array)
        else:
            array = np.array(value, dtype=numpy_dtype(datatype))
    except (TypeError, ValueError) as e:
        raise invalid(f"generate: input '{name}' is not {datatype} data: {e}") from None
    if array.ndim == 0:
        array = array.reshape(1)
    return array[None] if batching else array


def _generate_json(response: InferResponse) -> dict[str, Any]:
    body: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version}
    for output in response.outputs:
        if output.data is not None:
            values = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v
                      for v in output.data.flatten().tolist()]
            body[output.name] = values[0] if len(values) == 1 else values
    return body

