"""Shared-memory regions for one `kiln perf` client worker, as perf_analyzer's --shared-memory=system|cuda.

Each worker creates one region per input (filled once with its data) and one per output, registers them with
the server once, and every request of that worker names them instead of carrying tensors: concurrent requests
share the regions (inputs are only read; outputs are overwritten, which a load test never reads), exactly as
perf_analyzer does. System regions come from `tritonclient.utils.shared_memory` (POSIX /dev/shm), CUDA ones
from `tritonclient.utils.cuda_shared_memory` (device 0), imported only when asked for so a CPU machine never
loads CUDA. `close` unregisters and frees them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

KINDS = ("none", "system", "cuda")
CUDA_DEVICE = 0
DEFAULT_OUTPUT_BYTES = 102400  # perf_analyzer's --output-shared-memory-size default


@dataclass(frozen=True)
class Span:
    """A registered region a tensor lives in: what `set_shared_memory` needs."""

    region: str
    byte_size: int


@dataclass
class Regions:
    """The worker's regions of one kind: created and filled on `create`, registered on `register`."""

    kind: str
    prefix: str
    handles: dict[str, Any] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    registered: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.kind not in ("system", "cuda"):
            raise ValueError(f"shared memory kind must be 'system' or 'cuda', got '{self.kind}'")

    @property
    def _module(self) -> Any:
        _pkg_resources_shim()
        if self.kind == "cuda":
            import tritonclient.utils.cuda_shared_memory as module
        else:
            import tritonclient.utils.shared_memory as module
        return module

    def _create(self, name: str, byte_size: int) -> str:
        region = f"{self.prefix}_{name}"
        if self.kind == "cuda":
            self.handles[region] = self._module.create_shared_memory_region(region, byte_size, CUDA_DEVICE)
        else:
            self.handles[region] = self._module.create_shared_memory_region(region, f"/{region}", byte_size)
        self.sizes[region] = byte_size
        return region

    def add_input(self, name: str, array: np.ndarray) -> Span:
        """A region holding `array` (written once, here)."""
        data = np.ascontiguousarray(array)
        region = self._create(f"in_{name}", max(data.nbytes, 1))
        self._module.set_shared_memory_region(self.handles[region], [data])
        return Span(region, data.nbytes)

    def add_output(self, name: str, byte_size: int) -> Span:
        region = self._create(f"out_{name}", max(byte_size, 1))
        return Span(region, byte_size)

    async def register(self, client: Any) -> None:
        """Register every region with the server through `client` (a tritonclient asyncio client)."""
        for region, handle in self.handles.items():
            if self.kind == "cuda":
                raw = self._module.get_raw_handle(handle)  # base64 bytes; str suits both clients' encoders
                raw = raw.decode() if isinstance(raw, bytes) else raw
                await client.register_cuda_shared_memory(region, raw, CUDA_DEVICE, self.sizes[region])
            else:
                await client.register_system_shared_memory(region, f"/{region}", self.sizes[region])
            self.registered.append(region)

    async def unregister(self, client: Any) -> None:
        for region in self.registered:
            try:
                if self.kind == "cuda":
                    await client.unregister_cuda_shared_memory(region)
                else:
                    await client.unregister_system_shared_memory(region)
            except Exception:  # the server may be gone already: freeing our side still matters
                pass
        self.registered = []

    def destroy(self) -> None:
        for handle in self.handles.values():
            try:
                self._module.destroy_shared_memory_region(handle)
            except Exception:
                pass
        self.handles, self.sizes = {}, {}


def _pkg_resources_shim() -> None:
    """tritonclient 2.41's shared_memory modules import `pkg_resources` (gone from setuptools >= 81) only for
    `resource_filename(package, name)`; answer that from the package's directory when it is missing."""
    try:
        import pkg_resources  # noqa: F401
    except ImportError:
        import importlib.util
        import sys
        import types
        from pathlib import Path

        shim = types.ModuleType("pkg_resources")
        shim.resource_filename = lambda package, name: str(  # type: ignore[attr-defined]
            Path(importlib.util.find_spec(package).origin).parent / name)
        sys.modules["pkg_resources"] = shim


def region_prefix(seed: int) -> str:
    """Names unique to this worker process (several workers and several runs may share a server)."""
    return f"kiln_perf_{os.getpid()}_{seed}"


def output_bytes(outputs: Sequence[dict[str, Any]], batch_size: int, batching: bool, fallback: int) -> dict[str, int]:
    """Region size per output from the model metadata: fixed shapes exactly (a leading -1 is the batch), else
    `fallback` (perf_analyzer's --output-shared-memory-size: variable shapes and BYTES)."""
    from tritonclient.utils import triton_to_np_dtype

    sizes = {}
    for entry in outputs:
        dims = [int(d) for d in entry.get("shape", [])]
        if batching and dims and dims[0] == -1:
            dims[0] = batch_size
        if entry["datatype"] == "BYTES" or any(d < 0 for d in dims):
            sizes[entry["name"]] = fallback
        else:
            sizes[entry["name"]] = int(np.prod(dims, dtype=np.int64)) * np.dtype(triton_to_np_dtype(entry["datatype"])).itemsize
    return sizes
