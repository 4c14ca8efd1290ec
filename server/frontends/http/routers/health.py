"""Liveness and readiness (server and model): 200 means yes, 400 means no, as KServe specifies; a model that is not
ready (unknown ones too) says why in Triton's words."""

from __future__ import annotations

from fastapi import APIRouter, Response

from ..deps import CoreDep
from ..errors import error_response

router = APIRouter(tags=["health"])


def _status(flag: bool) -> Response:
    return Response(status_code=200 if flag else 400)


@router.get("/v2/health/live")
async def server_live(core: CoreDep) -> Response:
    return _status(await core.live())


@router.get("/v2/health/ready")
async def server_ready(core: CoreDep) -> Response:
    return _status(await core.ready())


@router.get("/v2/models/{model_name}/ready")
@router.get("/v2/models/{model_name}/versions/{model_version}/ready")
async def model_ready(core: CoreDep, model_name: str, model_version: str = "") -> Response:
    if await core.model_ready(model_name, model_version):
        return Response(status_code=200)
    return error_response(400, "Model version not ready")  # Triton's http_server.cc
