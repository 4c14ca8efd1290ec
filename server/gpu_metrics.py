"""Triton's GPU gauges (`nv_gpu_*`, `nv_energy_consumption`) read through NVML, labelled by `gpu_uuid`.

Triton reads them through DCGM; NVML (the `nvidia-ml-py` package, imported as `pynvml`, in Kiln's `gpu` extra)
gives the same numbers without a DCGM daemon. Without the package, without a driver or without a GPU the families
are simply not exported (logged once at info), never an error: a CPU-only server scrapes as before. Values are
read at most once per `--metrics-interval-ms` (Triton's "per interval" metrics), `Sampled` keeping the last ones.
Only the GPUs CUDA shows the server are reported (CUDA_VISIBLE_DEVICES, `kiln serve --gpus`), matched to NVML's by
PCI bus id as Triton matches DCGM's; when CUDA cannot say (no driver bindings), every GPU NVML sees.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

from prometheus_client.core import Metric

log = logging.getLogger("kiln.server.metrics")

# family -> (help as Triton's, type)
_FAMILIES = {
    "nv_gpu_utilization": ("GPU utilization rate [0.0 - 1.0)", "gauge"),
    "nv_gpu_memory_total_bytes": ("GPU total memory, in bytes", "gauge"),
    "nv_gpu_memory_used_bytes": ("GPU used memory, in bytes", "gauge"),
    "nv_gpu_power_usage": ("GPU power usage in watts", "gauge"),
    "nv_gpu_power_limit": ("GPU power management limit in watts", "gauge"),
    "nv_energy_consumption": ("GPU energy consumption in joules since the Triton Server started", "counter"),
}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def bus_key(bus_id: str) -> tuple[int, ...]:
    """A PCI bus id as numbers, so CUDA's "0000:19:00.0" and NVML's "00000000:19:00.0" compare equal."""
    domain, bus, rest = bus_id.strip().lower().split(":")
    device, function = rest.split(".")
    return int(domain, 16), int(bus, 16), int(device, 16), int(function, 16)


def cuda_bus_ids() -> set[tuple[int, ...]] | None:
    """The PCI bus ids of the GPUs CUDA shows this process, None when CUDA cannot be asked."""
    try:
        from engine_core.cuda import driver

        return {bus_key(driver.pci_bus_id(i)) for i in range(driver.device_count())}
    except Exception:  # noqa: BLE001 - no cuda-python, no driver: NVML's whole list
        return None


class NvmlGpus:
    """The GPUs NVML sees; `families()` reads them. Set up on first use, so a server that is never scraped never
    loads NVML. `load` imports the module (tests pass a fake)."""

    def __init__(self, load: Callable[[], ModuleType] = lambda: importlib.import_module("pynvml"),
                 visible: Callable[[], set[tuple[int, ...]] | None] = cuda_bus_ids) -> None:
        self._load = load
        self._visible = visible
        self._nvml: ModuleType | None = None
        self._devices: list[tuple[str, Any]] = []  # (uuid, handle)
        self._energy_start_mj: dict[str, int] = {}
        self._tried = False

    def _start(self) -> None:
        self._tried = True
        try:
            nvml = self._load()
            nvml.nvmlInit()
            devices = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
            visible = self._visible()
            if visible is not None:  # the GPUs this server may use, as Triton reports them
                devices = [h for h in devices if bus_key(_text(nvml.nvmlDeviceGetPciInfo(h).busId)) in visible]
            self._devices = [(_text(nvml.nvmlDeviceGetUUID(handle)), handle) for handle in devices]
        except Exception as e:  # noqa: BLE001 - no package, no driver (NVMLError), no permission: no GPU metrics
            log.info("GPU metrics are not exported: NVML is not usable (%s: %s); install kiln[gpu] on a machine "
                     "with an NVIDIA driver for them", type(e).__name__, e)
            return
        if not self._devices:
            log.info("GPU metrics are not exported: NVML sees no GPU this server may use")
            return
        self._nvml = nvml
        for uuid, handle in self._devices:
            energy = self._read(nvml.nvmlDeviceGetTotalEnergyConsumption, handle)
            if energy is not None:
                self._energy_start_mj[uuid] = int(energy)

    @staticmethod
    def _read(function: Callable[[Any], Any], handle: Any) -> Any:
        """One NVML reading, None when this GPU does not support it (Triton leaves the value out then too)."""
        try:
            return function(handle)
        except Exception:  # noqa: BLE001 - NVMLError_NotSupported and friends
            return None

    def _values(self, uuid: str, handle: Any) -> dict[str, float | None]:
        nvml = self._nvml
        assert nvml is not None
        utilization = self._read(nvml.nvmlDeviceGetUtilizationRates, handle)
        memory = self._read(nvml.nvmlDeviceGetMemoryInfo, handle)
        power = self._read(nvml.nvmlDeviceGetPowerUsage, handle)  # milliwatts
        limit = self._read(nvml.nvmlDeviceGetPowerManagementLimit, handle)  # milliwatts
        energy = self._read(nvml.nvmlDeviceGetTotalEnergyConsumption, handle)  # millijoules since driver load
        start = self._energy_start_mj.get(uuid)
        return {
            "nv_gpu_utilization": None if utilization is None else utilization.gpu / 100.0,
            "nv_gpu_memory_total_bytes": None if memory is None else float(memory.total),
            "nv_gpu_memory_used_bytes": None if memory is None else float(memory.used),
            "nv_gpu_power_usage": None if power is None else power / 1000.0,
            "nv_gpu_power_limit": None if limit is None else limit / 1000.0,
            "nv_energy_consumption": None if energy is None or start is None else (energy - start) / 1000.0,
        }

    def families(self) -> Iterable[Metric]:
        if not self._tried:
            self._start()
        if self._nvml is None:
            return []
        readings = [(uuid, self._values(uuid, handle)) for uuid, handle in self._devices]
        result = []
        for name, (help_text, kind) in _FAMILIES.items():
            family = Metric(name, help_text, kind)
            for uuid, values in readings:
                if values[name] is not None:
                    family.add_sample(name, {"gpu_uuid": uuid}, float(values[name]))  # type: ignore[arg-type]
            result.append(family)
        return result


class Sampled:
    """Families read at most once per `interval_s` (Triton polls its per-interval metrics on a timer; reading at
    scrape time, no more often than that, gives the same values without a thread)."""

    def __init__(self, read: Callable[[], Iterable[Metric]], interval_s: float) -> None:
        self._read = read
        self._interval_s = interval_s
        self._at: float | None = None
        self._families: list[Metric] = []
        self._lock = threading.Lock()

    def families(self) -> list[Metric]:
        with self._lock:
            now = time.monotonic()
            if self._at is None or now - self._at >= self._interval_s:
                self._families = list(self._read())
                self._at = now
            return self._families
