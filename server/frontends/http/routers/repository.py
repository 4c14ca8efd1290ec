"""Model repository extension: index, load (with config override and uploaded files), unload."""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from fastapi import APIRouter, Response

from server.core.errors import invalid
from server.core.limits import check_load_request

from ..deps import CoreDep, body_doc, json_body
from ..schemas import LoadRequest, RepositoryIndexRequest, RepositoryModel, UnloadRequest

router = APIRouter(tags=["repository"])


@router.post("/v2/repository/index", response_model=list[RepositoryModel],
             openapi_extra=body_doc(RepositoryIndexRequest))
async def repository_index(core: CoreDep, body: RepositoryIndexRequest | None = json_body(RepositoryIndexRequest, False)
                           ) -> list[dict[str, Any]]:
    return await core.repository_index(ready=body.ready if body else False)


def load_parameters(parameters: dict[str, Any]) -> tuple[str | None, dict[str, bytes]]:
    """The `config` JSON (a string, or an object we serialize) and the base64-decoded `file:` entries."""
    config = parameters.get("config")
    if config is not None and not isinstance(config, str):
        config = json.dumps(config)
    files = {}
    for key, value in parameters.items():
        if not key.startswith("file:"):
            continue
        if not isinstance(value, str):
            raise invalid(f"load parameter '{key}' must be base64 text")
        try:
            files[key.removeprefix("file:")] = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise invalid(f"load parameter '{key}' is not valid base64") from None
    return config, files


@router.post("/v2/repository/models/{model_name}/load", openapi_extra=body_doc(LoadRequest))
async def load_model(core: CoreDep, model_name: str, body: LoadRequest | None = json_body(LoadRequest, False)
                     ) -> Response:
    config, files = load_parameters(body.parameters or {} if body else {})
    check_load_request(model_name, config, files)
    await core.load_model(model_name, config, files)
    return Response(status_code=200)


@router.post("/v2/repository/models/{model_name}/unload", openapi_extra=body_doc(UnloadRequest))
async def unload_model(core: CoreDep, model_name: str, body: UnloadRequest | None = json_body(UnloadRequest, False)
                       ) -> Response:
    parameters = body.parameters or {} if body else {}
    dependents = parameters.get("unload_dependents", False)
    if not isinstance(dependents, bool):
        raise invalid("unload parameter 'unload_dependents' must be a boolean")
    await core.unload_model(model_name, unload_dependents=dependents)
    return Response(status_code=200)
