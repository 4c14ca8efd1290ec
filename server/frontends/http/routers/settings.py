"""Trace settings (global and per model) and log settings."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from ..deps import CoreDep, body_doc, json_body
from ..schemas import LogSettingsBody, TraceSettingsBody

router = APIRouter(tags=["settings"])


@router.get("/v2/trace/setting")
@router.get("/v2/models/{model_name}/trace/setting")
async def get_trace_settings(core: CoreDep, model_name: str = "") -> dict[str, Any]:
    return await core.trace_settings(model_name)


@router.post("/v2/trace/setting", openapi_extra=body_doc(TraceSettingsBody))
@router.post("/v2/models/{model_name}/trace/setting", openapi_extra=body_doc(TraceSettingsBody))
async def update_trace_settings(core: CoreDep, body: TraceSettingsBody = json_body(TraceSettingsBody),
                                model_name: str = "") -> dict[str, Any]:
    """Values are strings (trace_level a list of strings); null clears a setting."""
    return await core.trace_settings(model_name, body)


@router.get("/v2/logging", response_model=LogSettingsBody)
async def get_log_settings(core: CoreDep) -> dict[str, Any]:
    return await core.log_settings()


@router.post("/v2/logging", response_model=LogSettingsBody, openapi_extra=body_doc(LogSettingsBody))
async def update_log_settings(core: CoreDep, body: LogSettingsBody = json_body(LogSettingsBody)) -> dict[str, Any]:
    return await core.log_settings(body.model_dump(exclude_unset=True))
