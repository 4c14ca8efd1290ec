"""A thin layer over the CUDA driver API (cuda.bindings.driver): context, memory, streams, modules.

Only what the engine needs, with errors turned into exceptions that name the call. No torch/cupy.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from functools import cache
from typing import Any

import numpy as np

from engine_core.errors import KilnError


class CudaError(KilnError):
    """A CUDA driver call failed."""


def check(result: Any, what: str = "CUDA call") -> Any:
    """Unpack a cuda.bindings (err, *values) result, raising CudaError on failure."""
    from cuda.bindings import driver

    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, msg = driver.cuGetErrorString(err)
        raise CudaError(f"{what}: {err.name} ({msg.decode() if msg else 'no message'})")
    return rest[0] if len(rest) == 1 else tuple(rest)


@cache
def _init() -> None:
    from cuda.bindings import driver

    check(driver.cuInit(0), "cuInit")


def device_count() -> int:
    from cuda.bindings import driver

    _init()
    return int(check(driver.cuDeviceGetCount(), "cuDeviceGetCount"))


@cache
def _retained_primary_context(ordinal: int) -> Any:
    from cuda.bindings import driver

    _init()
    device = check(driver.cuDeviceGet(ordinal), "cuDeviceGet")
    return check(driver.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")


@cache
def _holding_the_lock() -> Any:
    """libcuda through ctypes.PyDLL: its calls keep the interpreter lock. cuda.bindings releases it for every call,
    and a thread that released it waits up to a switch interval to get it back while another thread runs Python
    (a server's event loop): for a call of a few microseconds that wait is the whole cost."""
    return ctypes.PyDLL("libcuda.so.1")


def _held_call(symbol: str, *args: Any) -> None:
    """libcuda's ``symbol`` called with the interpreter lock held; raises as ``check`` does on an error."""
    err = getattr(_holding_the_lock(), symbol)(*args)
    if err:
        from cuda.bindings import driver

        check(driver.CUresult(err), symbol)


def launch_graph(graph_exec: Any, stream: int) -> None:
    """cuGraphLaunch without releasing the interpreter lock (the launch itself is a few microseconds)."""
    _held_call("cuGraphLaunch", ctypes.c_void_p(int(graph_exec)), ctypes.c_void_p(int(stream)))


def record_event(event: Any, stream: int) -> None:
    """cuEventRecord without releasing the interpreter lock (it only enqueues)."""
    _held_call("cuEventRecord", ctypes.c_void_p(int(event)), ctypes.c_void_p(int(stream)))


def memset_d8_async(dst: int, value: int, nbytes: int, stream: int) -> None:
    """cuMemsetD8Async without releasing the interpreter lock (it only enqueues)."""
    _held_call("cuMemsetD8Async", ctypes.c_uint64(dst), ctypes.c_ubyte(value), ctypes.c_size_t(nbytes),
               ctypes.c_void_p(int(stream)))


def memcpy_dtod_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """cuMemcpyDtoDAsync without releasing the interpreter lock (it only enqueues)."""
    _held_call("cuMemcpyDtoDAsync_v2", ctypes.c_uint64(dst), ctypes.c_uint64(src), ctypes.c_size_t(nbytes),
               ctypes.c_void_p(int(stream)))


class _MemcpyAttributes(ctypes.Structure):
    """CUmemcpyAttributes (cuda.h): the source access order, source and destination location hints (type, id:
    left invalid, they are for managed memory) and flags."""

    _fields_ = [("src_access_order", ctypes.c_int), ("src_hint", ctypes.c_int * 2), ("dst_hint", ctypes.c_int * 2),
                ("flags", ctypes.c_uint)]


_SRC_ACCESS_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: sources are read in stream order


def memcpy_batch_async(copies: Sequence[tuple[int, int, int]], stream: int) -> None:
    """(dst, src, nbytes) copies as one cuMemcpyBatchAsync (CUDA 13's entry point, ``_v2``), sources read in
    stream order, without releasing the interpreter lock. Raises AttributeError where libcuda lacks it."""
    count = len(copies)
    dsts = (ctypes.c_uint64 * count)(*(dst for dst, _, _ in copies))
    srcs = (ctypes.c_uint64 * count)(*(src for _, src, _ in copies))
    sizes = (ctypes.c_size_t * count)(*(nbytes for _, _, nbytes in copies))
    attributes = _MemcpyAttributes(_SRC_ACCESS_ORDER_STREAM)
    first = ctypes.c_size_t(0)  # the attributes apply from copy 0 on
    _held_call("cuMemcpyBatchAsync_v2", dsts, srcs, sizes, ctypes.c_size_t(count), ctypes.byref(attributes),
               ctypes.byref(first), ctypes.c_size_t(1), ctypes.c_void_p(int(stream)))


def launch_held(function: Any, grid: int | tuple[int, int], block: int, args: Sequence[Any], stream: int) -> None:
    """cuLaunchKernel of a 1-D or 2-D grid (``(x, y)``) without releasing the interpreter lock; ``args`` are ctypes
    values, in the kernel's parameter order."""
    params = (ctypes.c_void_p * len(args))(*(ctypes.cast(ctypes.pointer(arg), ctypes.c_void_p) for arg in args))
    grid_x, grid_y = grid if isinstance(grid, tuple) else (grid, 1)
    one = ctypes.c_uint(1)
    _held_call("cuLaunchKernel", ctypes.c_void_p(int(function)), ctypes.c_uint(grid_x), ctypes.c_uint(grid_y), one,
               ctypes.c_uint(block), one, one, ctypes.c_uint(0), ctypes.c_void_p(int(stream)), params, None)


def copy_pinned_async(dst: int, src: int, nbytes: int, stream: int, to_device: bool) -> None:
    """cuMemcpyHtoDAsync / cuMemcpyDtoHAsync between device memory and *pinned* host memory, without releasing
    the interpreter lock: from pinned memory the driver only enqueues (from pageable memory it would copy
    synchronously, so those keep cuda.bindings)."""
    if to_device:
        _held_call("cuMemcpyHtoDAsync_v2", ctypes.c_uint64(dst), ctypes.c_void_p(src), ctypes.c_size_t(nbytes),
                   ctypes.c_void_p(int(stream)))
    else:
        _held_call("cuMemcpyDtoHAsync_v2", ctypes.c_void_p(dst), ctypes.c_uint64(src), ctypes.c_size_t(nbytes),
                   ctypes.c_void_p(int(stream)))


def primary_context(ordinal: int = 0) -> Any:
    """Retain (once) and make current *on this thread* the device's primary context.

    The current context is per thread: server workers run inference on pool threads, so every
    caller asks. A thread that made it current here already skips the driver call: each call releases
    and takes back the interpreter lock, which costs up to a switch interval when other threads are busy.
    """
    from cuda.bindings import driver

    ctx = _retained_primary_context(ordinal)
    if getattr(_CURRENT, "ctx", None) is not ctx:
        check(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        _CURRENT.ctx = ctx
    return ctx


#: per thread, the context `primary_context` last made current (Kiln sets contexts only through it)
_CURRENT = threading.local()


def _attribute(name: str, ordinal: int) -> int:
    """The device's ``CU_DEVICE_ATTRIBUTE_<name>``."""
    from cuda.bindings import driver

    _init()
    device = check(driver.cuDeviceGet(ordinal), "cuDeviceGet")
    attr = getattr(driver.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}")
    return int(check(driver.cuDeviceGetAttribute(attr, device), f"cuDeviceGetAttribute({name})"))


def compute_capability(ordinal: int = 0) -> tuple[int, int]:
    return _attribute("COMPUTE_CAPABILITY_MAJOR", ordinal), _attribute("COMPUTE_CAPABILITY_MINOR", ordinal)


def multiprocessor_count(ordinal: int = 0) -> int:
    """Streaming multiprocessors of the device: what a persistent kernel's grid is sized to."""
    return _attribute("MULTIPROCESSOR_COUNT", ordinal)


def device_name(ordinal: int = 0) -> str:
    """The device's name as the driver reports it (e.g. "NVIDIA H100 80GB HBM3")."""
    from cuda.bindings import driver

    _init()
    device = check(driver.cuDeviceGet(ordinal), "cuDeviceGet")
    return _c_string(check(driver.cuDeviceGetName(256, device), "cuDeviceGetName"))


def pci_bus_id(ordinal: int = 0) -> str:
    """The device's PCI bus id as the driver writes it ("0000:19:00.0"): how NVML's view of the same GPU is found."""
    from cuda.bindings import driver

    _init()
    device = check(driver.cuDeviceGet(ordinal), "cuDeviceGet")
    return _c_string(check(driver.cuDeviceGetPCIBusId(32, device), "cuDeviceGetPCIBusId")).strip()


def _c_string(value: Any) -> str:
    """A string the driver filled into a fixed-size buffer: bytes up to the first NUL (or the binding's str)."""
    return value.split(b"\0", 1)[0].decode() if isinstance(value, bytes) else str(value)


def memory_info(ordinal: int = 0) -> tuple[int, int]:
    """(free, total) bytes of the device's memory, as the driver reports them in its primary context."""
    from cuda.bindings import driver

    primary_context(ordinal)
    free, total = check(driver.cuMemGetInfo(), "cuMemGetInfo")
    return int(free), int(total)


#: Held around work that must not overlap a CUDA graph capture in another thread: captures and every run that
#: is not a graph replay (a library's first use allocates and copies on the legacy stream), and synchronous
#: copies, memsets and frees. Such a legacy-stream operation while a blocking stream captures elsewhere fails
#: that capture (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT): servers load and warm models on several threads at once.
#: Graph replays, the serving path, do not take it.
DEVICE_LOCK = threading.RLock()


class DeviceBuffer:
    """Device memory from cuMemAlloc, freed with the object."""

    def __init__(self, nbytes: int) -> None:
        from cuda.bindings import driver

        primary_context()
        self.nbytes = int(nbytes)
        self.ptr = int(check(driver.cuMemAlloc(max(self.nbytes, 1)), "cuMemAlloc"))

    @staticmethod
    def from_array(array: np.ndarray) -> DeviceBuffer:
        buf = DeviceBuffer(array.nbytes)
        buf.copy_from(array)
        return buf

    def copy_from(self, array: np.ndarray) -> None:
        copy_to_device(self.ptr, array)

    def to_array(self, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        return copy_to_host(self.ptr, dtype, shape)

    def __del__(self) -> None:
        try:
            from cuda.bindings import driver

            with DEVICE_LOCK:
                driver.cuMemFree(self.ptr)
        except Exception:
            pass


def copy_to_device(ptr: int, array: np.ndarray) -> None:
    """``array``'s bytes to device address ``ptr`` (synchronous: the host array may go right after)."""
    from cuda.bindings import driver

    array = np.ascontiguousarray(array)
    with DEVICE_LOCK:
        check(driver.cuMemcpyHtoD(ptr, array.ctypes.data, array.nbytes), "cuMemcpyHtoD")


def copy_to_host(ptr: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """A new host array of ``shape`` read from device address ``ptr`` (synchronous)."""
    from cuda.bindings import driver

    out = np.empty(shape, dtype)
    with DEVICE_LOCK:
        check(driver.cuMemcpyDtoH(out.ctypes.data, ptr, out.nbytes), "cuMemcpyDtoH")
    return out


class Module:
    """A loaded CUBIN; ``function(name)`` looks kernels up (extern "C" names)."""

    def __init__(self, cubin: bytes) -> None:
        from cuda.bindings import driver

        primary_context()
        self._cubin = cubin  # keep alive while loaded
        self.handle = check(driver.cuModuleLoadData(cubin), "cuModuleLoadData")

    def function(self, name: str) -> Any:
        from cuda.bindings import driver

        return check(driver.cuModuleGetFunction(self.handle, name.encode()), f"cuModuleGetFunction({name})")


def launch(function: Any, grid: tuple[int, int, int], block: tuple[int, int, int],
           args: list[tuple[Any, Any]], shared_bytes: int = 0, stream: int = 0) -> None:
    """Launch ``function``; ``args`` are (value, ctypes type) pairs as cuLaunchKernel expects."""
    from cuda.bindings import driver

    values = tuple(v for v, _ in args)
    types = tuple(t for _, t in args)
    check(driver.cuLaunchKernel(function, *grid, *block, shared_bytes, stream, (values, types), 0), "cuLaunchKernel")


def encode_tensor_map(address: int, rows: int, cols: int, box: tuple[int, int]) -> bytes:
    """The 128-byte CUtensorMap (TMA descriptor) of a row-major int8 matrix [rows, cols] at ``address``, read in
    boxes of ``box`` = (rows, bytes) with the 128-byte swizzle (the layout wgmma reads; box bytes <= 128) and
    zeros past the edges. Needs 16-byte-aligned ``address`` and ``cols`` (the row pitch)."""
    from cuda.bindings import driver

    u32, u64 = driver.cuuint32_t, driver.cuuint64_t
    tensor_map = check(driver.cuTensorMapEncodeTiled(
        driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, address, [u64(cols), u64(rows)], [u64(cols)],
        [u32(box[1]), u32(box[0])], [u32(1), u32(1)], driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), "cuTensorMapEncodeTiled")
    return np.array(tensor_map.opaque, np.uint64).tobytes()


def synchronize() -> None:
    from cuda.bindings import driver

    check(driver.cuCtxSynchronize(), "cuCtxSynchronize")


class Stream:
    """A stream of its own in the primary context (non-blocking by default: it does not wait for the legacy
    stream), destroyed with the object; ``handle`` is what ``execute_async_v3`` and launches take."""

    def __init__(self, non_blocking: bool = True) -> None:
        from cuda.bindings import driver

        primary_context()
        kinds = driver.CUstream_flags
        flags = kinds.CU_STREAM_NON_BLOCKING if non_blocking else kinds.CU_STREAM_DEFAULT
        self.handle = int(check(driver.cuStreamCreate(int(flags)), "cuStreamCreate"))

    def synchronize(self) -> None:
        from cuda.bindings import driver

        check(driver.cuStreamSynchronize(self.handle), "cuStreamSynchronize")

    def __del__(self) -> None:
        try:
            from cuda.bindings import driver

            driver.cuStreamDestroy(self.handle)
        except Exception:
            pass


class EventTimer:
    """Device time of the work enqueued on ``stream`` between ``start()`` and ``stop()``, measured with two CUDA
    events (gaps between the host's launches included)."""

    def __init__(self, stream: int) -> None:
        from cuda.bindings import driver

        primary_context()
        self.stream = int(stream)
        self._start = check(driver.cuEventCreate(0), "cuEventCreate")
        self._stop = check(driver.cuEventCreate(0), "cuEventCreate")

    def start(self) -> None:
        from cuda.bindings import driver

        check(driver.cuEventRecord(self._start, self.stream), "cuEventRecord")

    def stop(self) -> float:
        """Milliseconds since ``start()``, once the work enqueued in between has finished."""
        from cuda.bindings import driver

        check(driver.cuEventRecord(self._stop, self.stream), "cuEventRecord")
        check(driver.cuEventSynchronize(self._stop), "cuEventSynchronize")
        return float(check(driver.cuEventElapsedTime(self._start, self._stop), "cuEventElapsedTime"))

    def __del__(self) -> None:
        try:
            from cuda.bindings import driver

            driver.cuEventDestroy(self._start)
            driver.cuEventDestroy(self._stop)
        except Exception:
            pass
