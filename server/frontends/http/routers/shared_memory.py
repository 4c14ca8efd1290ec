"""System and CUDA shared-memory extensions (Triton's paths and JSON; the work is in server/core/shared_memory)."""

from __future__ import annotations

import base64
import binascii
from typing import Any

from fastapi import APIRouter, Response
from pydantic import BaseModel

from server.core.errors import invalid

from ..deps import CoreDep, body_doc, json_body
from ..schemas import CudaSharedMemoryRegisterRequest, SystemSharedMemoryRegion, SystemSharedMemoryRegisterRequest

router = APIRouter(tags=["shared memory"])


class CudaSharedMemoryRegion(BaseModel):
    """One registered CUDA region, as Triton's status reports it."""

    name: str
    device_id: int
    byte_size: int


@router.get("/v2/systemsharedmemory/status", response_model=list[SystemSharedMemoryRegion])
@router.get("/v2/systemsharedmemory/region/{region_name}/status", response_model=list[SystemSharedMemoryRegion])
async def system_status(core: CoreDep, region_name: str = "") -> list[dict[str, Any]]:
    return await core.system_shared_memory_status(region_name)


@router.post("/v2/systemsharedmemory/region/{region_name}/register",
             openapi_extra=body_doc(SystemSharedMemoryRegisterRequest))
async def system_register(core: CoreDep, region_name: str,
                          body: SystemSharedMemoryRegisterRequest = json_body(SystemSharedMemoryRegisterRequest)
                          ) -> Response:
    await core.register_system_shared_memory(region_name, body.key, body.offset, body.byte_size)
    return Response(status_code=200)


@router.post("/v2/systemsharedmemory/unregister")
@router.post("/v2/systemsharedmemory/region/{region_name}/unregister")
async def system_unregister(core: CoreDep, region_name: str = "") -> Response:
    await core.unregister_system_shared_memory(region_name)
    return Response(status_code=200)


@router.get("/v2/cudasharedmemory/status", response_model=list[CudaSharedMemoryRegion])
@router.get("/v2/cudasharedmemory/region/{region_name}/status", response_model=list[CudaSharedMemoryRegion])
async def cuda_status(core: CoreDep, region_name: str = "") -> list[dict[str, Any]]:
    return await core.cuda_shared_memory_status(region_name)


@router.post("/v2/cudasharedmemory/region/{region_name}/register",
             openapi_extra=body_doc(CudaSharedMemoryRegisterRequest))
async def cuda_register(core: CoreDep, region_name: str,
                        body: CudaSharedMemoryRegisterRequest = json_body(CudaSharedMemoryRegisterRequest)
                        ) -> Response:
    try:
        handle = base64.b64decode(body.raw_handle.b64, validate=True)
    except (binascii.Error, ValueError):
        raise invalid("raw_handle.b64 is not valid base64") from None
    await core.register_cuda_shared_memory(region_name, handle, body.device_id, body.byte_size)
    return Response(status_code=200)


@router.post("/v2/cudasharedmemory/unregister")
@router.post("/v2/cudasharedmemory/region/{region_name}/unregister")
async def cuda_unregister(core: CoreDep, region_name: str = "") -> Response:
    await core.unregister_cuda_shared_memory(region_name)
    return Response(status_code=200)
