"""Server metadata, model metadata, model configuration and statistics."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from ..deps import CoreDep
from ..schemas import ModelMetadata, ModelStatisticsBody, ServerMetadata

router = APIRouter(tags=["models"])


@router.get("/v2", response_model=ServerMetadata)
async def server_metadata(core: CoreDep) -> dict[str, Any]:
    return await core.server_metadata()


# Statistics routes come before `/v2/models/{model_name}` so that "stats" is not taken for a model name.
@router.get("/v2/models/stats", response_model=ModelStatisticsBody)
@router.get("/v2/models/{model_name}/stats", response_model=ModelStatisticsBody)
@router.get("/v2/models/{model_name}/versions/{model_version}/stats", response_model=ModelStatisticsBody)
async def model_statistics(core: CoreDep, model_name: str = "", model_version: str = "") -> dict[str, Any]:
    return await core.model_statistics(model_name, model_version)


@router.get("/v2/models/{model_name}", response_model=ModelMetadata)
@router.get("/v2/models/{model_name}/versions/{model_version}", response_model=ModelMetadata)
async def model_metadata(core: CoreDep, model_name: str, model_version: str = "") -> dict[str, Any]:
    return await core.model_metadata(model_name, model_version)


@router.get("/v2/models/{model_name}/config")
@router.get("/v2/models/{model_name}/versions/{model_version}/config")
async def model_config(core: CoreDep, model_name: str, model_version: str = "") -> dict[str, Any]:
    """Triton's model configuration (model_config.proto) as JSON."""
    return await core.model_config(model_name, model_version)
