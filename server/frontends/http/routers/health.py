"""Liveness and readiness (server and model): 200 means yes, 400 means no, as KServe specifies."""

from __future__ import annotations

from fastapi import APIRouter, Response

from ..deps import CoreDep

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
    return _status(await core.model_ready(model_name, model_version))
