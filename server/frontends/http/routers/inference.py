"""POST .../infer: JSON and binary tensor data, compression, classification, shared memory.

The body is read raw (not through a pydantic body parameter) because binary tensor data may follow the
JSON header; `codec` validates the header with the schema and converts the tensors.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

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
    body = decompress(await request.body(), request.headers.get("content-encoding"))
    infer_request = decode_request(body, request.headers.get(HEADER_LENGTH), model_name, model_version)
    response = await core.infer(infer_request)
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
