"""The runner's host side of I/O: page-locked host memory (``PinnedBuffer``: streamed weights, I/O mirrors), each I/O
tensor's device buffer and pinned mirror (``_Stage``), the copies captured with a run (``StagedCopies``), and how
``infer_batch`` gathers parts into the staging buffers and delivers each part's outputs (``StagingMixin``).

Two runs of one context may be in flight at once (``STAGING_SLOTS``): each takes a staging slot, whose pinned
mirrors it fills and reads back without any lock, while everything it enqueues on the context's stream (copies,
the run, the event that says it is done) happens under the context's run lock. Why: a server worker thread then
gathers and copies out one batch while the device runs the other, instead of the device idling through the host
work of every batch (on an H100 BERT-base's worker spent about half its time in host work; docs/performance.md).
Device buffers stay one per binding: the stream orders the runs that share them.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from engine_core.backends.cuda.runner_binding import HostValueNotTensor, Shapes, _Binding
from engine_core.batching import Span, check_destination, gather_rows, is_batched, split_outputs
from engine_core.cuda.driver import (
    DEVICE_LOCK,
    DeviceBuffer,
    check,
    copy_pinned_async,
    launch_held,
    memcpy_batch_async,
    memcpy_dtod_async,
    memset_d8_async,
    primary_context,
    record_event,
)
from engine_core.cuda.view import DeviceRows, DeviceView
from engine_core.errors import ExecutionError
from engine_core.logger import DEFAULT_LOGGER, Severity

#: runs of one context that may be in flight at once, each with pinned mirrors of its own (``IoSlots``)
STAGING_SLOTS = 2


class PinnedBuffer:
    """Page-locked host memory (cuMemHostAlloc), freed with the object. Why pinned: only copies from
    page-locked memory run asynchronously on the copy stream (and may be captured in CUDA graphs)."""

    def __init__(self, nbytes: int) -> None:
        from cuda.bindings import driver

        primary_context()
        self.nbytes = int(nbytes)
        self.ptr = int(check(driver.cuMemHostAlloc(max(self.nbytes, 1), 0), "cuMemHostAlloc"))

    @staticmethod
    def from_array(array: np.ndarray) -> PinnedBuffer:
        buf = PinnedBuffer(np.asarray(array).nbytes)
        buf.copy_from(array)
        return buf

    def copy_from(self, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array)
        if array.nbytes != self.nbytes:
            raise ExecutionError(f"cannot write {array.nbytes} bytes into a {self.nbytes}-byte host weight buffer")
        if array.nbytes:
            ctypes.memmove(self.ptr, array.ctypes.data, array.nbytes)

    def view(self, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """A numpy array over this memory (valid while the buffer lives: keep both together)."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        if count * dtype.itemsize > self.nbytes:
            raise ExecutionError(f"a {dtype} array of shape {list(shape)} does not fit {self.nbytes} pinned bytes")
        if count == 0:
            return np.empty(shape, dtype)
        raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(self.ptr)
        return np.frombuffer(raw, dtype=dtype).reshape(shape)

    def __del__(self) -> None:
        try:
            from cuda.bindings import driver

            with DEVICE_LOCK:
                driver.cuMemFreeHost(self.ptr)
        except Exception:
            pass


#: a run's device-to-device copies at or above this count go as one copy_segments launch (CUDA shared memory:
#: a copy per request and tensor), fewer through the driver (``memcpy_dtod_batch``)
SEGMENT_KERNEL_MIN_COPIES = 8
SEGMENTS_MODULE = "copy_segments"  # cuda_kernels/copy_segments.cu, compiled on first use (ON_DEMAND_KERNEL_FILES)
SEGMENT_CHUNK_BYTES = 32768  # KILN_SEGMENT_CHUNK in copy_segments.cu: the bytes of a segment one block moves


class CopyTable:
    """The copy_segments kernel's argument: rows of (dst, src, nbytes) written to pinned memory and uploaded to a
    device twin on the run's stream. One per staging slot and purpose (gathers, deliveries), so a table is
    rewritten only after the run that reads it is done (a slot is taken again only then)."""

    def __init__(self) -> None:
        self.capacity = 0
        self.host: PinnedBuffer | None = None
        self.device: DeviceBuffer | None = None

    def upload(self, copies: Sequence[tuple[int, int, int]] | np.ndarray, stream: int) -> int:
        """``copies`` into the table, queued to the device; the device table's address."""
        count = len(copies)
        if count > self.capacity:
            self.capacity = max(256, 2 * count)
            self.host, self.device = PinnedBuffer(24 * self.capacity), DeviceBuffer(24 * self.capacity)
        assert self.host is not None and self.device is not None
        self.host.view(np.dtype(np.uint64), (count, 3))[...] = copies
        copy_pinned_async(self.device.ptr, self.host.ptr, 24 * count, stream, to_device=True)
        return self.device.ptr


class _Stage:
    """One I/O tensor of a binding as ``infer`` moves it: the device buffer the plan reads or writes and a
    page-locked host mirror (with a numpy view of it). Why pinned: a copy from pageable memory is staged
    synchronously through the driver; from page-locked memory it is a DMA queued on the stream. Both are
    made once per binding, so every run of these shapes uses the same device addresses (its CUDA graph)."""

    def __init__(self, dtype: np.dtype, shape: tuple[int, ...], device: DeviceBuffer | None = None) -> None:
        self.dtype, self.shape = np.dtype(dtype), tuple(int(d) for d in shape)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self.device = device if device is not None else DeviceBuffer(self.nbytes)
        self.host = PinnedBuffer(self.nbytes)
        self.array = self.host.view(self.dtype, self.shape)
        #: bytes of one row along the leading dim (the whole tensor for scalars)
        self.row_bytes = self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.nbytes
        #: leading rows of the host mirror that may hold data; rows past it are zero (padding needs no clearing)
        self.written = self.shape[0] if self.shape else 0

    def twin(self) -> _Stage:
        """The same device buffer with a pinned mirror of its own: this tensor in another staging slot."""
        return _Stage(self.dtype, self.shape, self.device)

    def fill(self, values: Sequence[np.ndarray]) -> None:
        """Host parts one after another into the mirror, the rows after them zero (cleared only where an
        earlier run wrote). A scalar tensor has one part, the whole value."""
        if not self.shape:
            np.copyto(self.array, values[0])
            return
        row = sum(int(value.shape[0]) for value in values)
        if len(values) == 1:
            np.copyto(self.array[:row], values[0])
        elif row:
            np.concatenate(values, out=self.array[:row])  # one C loop over the parts, not one call each
        if self.written > row:
            self.array[row:self.written] = 0
        self.written = row

    def upload(self, begin: int, end: int, stream: int) -> None:
        """Host mirror bytes [begin, end) -> the device buffer, queued on ``stream``."""
        if end > begin:
            copy_pinned_async(self.device.ptr + begin, self.host.ptr + begin, end - begin, stream, to_device=True)

    def download(self, begin: int, end: int, stream: int) -> None:
        """Device bytes [begin, end) -> the host mirror, queued on ``stream``."""
        if end > begin:
            copy_pinned_async(self.host.ptr + begin, self.device.ptr + begin, end - begin, stream, to_device=False)


@dataclass(frozen=True)
class StagedCopies:
    """Copies around one run, captured with it: (device, host, nbytes) uploads from pinned host mirrors before
    the run and (host, device, nbytes) downloads after it. Frozen and hashable: part of a graph's key."""

    uploads: tuple[tuple[int, int, int], ...] = ()
    downloads: tuple[tuple[int, int, int], ...] = ()

    def upload(self, stream: int) -> None:
        for device, host, nbytes in self.uploads:
            copy_pinned_async(device, host, nbytes, stream, to_device=True)

    def download(self, stream: int) -> None:
        for host, device, nbytes in self.downloads:
            copy_pinned_async(host, device, nbytes, stream, to_device=False)


def _whole_copies(inputs: Sequence[str], outputs: Sequence[str], stages: Mapping[str, _Stage]) -> StagedCopies:
    """Uploads of every input's whole mirror and downloads of every output's, for runs through ``stages``."""
    return StagedCopies(
        tuple((stages[n].device.ptr, stages[n].host.ptr, stages[n].nbytes) for n in inputs if stages[n].nbytes),
        tuple((stages[n].host.ptr, stages[n].device.ptr, stages[n].nbytes) for n in outputs if stages[n].nbytes))


class IoSlots:
    """The staging slots of one context: a run takes one (the lowest free, or the one asked for) for its whole life,
    waiting while all are taken."""

    def __init__(self, count: int = STAGING_SLOTS) -> None:
        self.count = count
        self._free = set(range(count))
        self._changed = threading.Condition()

    @contextmanager
    def take(self, slot: int | None = None) -> Iterator[int]:
        with self._changed:
            while not self._free or (slot is not None and slot not in self._free):
                self._changed.wait()
            taken = min(self._free) if slot is None else slot
            self._free.remove(taken)
        try:
            yield taken
        finally:
            with self._changed:
                self._free.add(taken)
                self._changed.notify_all()


class StagingMixin:
    """CudaContextState's staging: per-binding I/O buffers and per-slot mirrors, gathering a batch's parts,
    delivering each part's rows."""

    if TYPE_CHECKING:  # set by CudaContextState
        _io_slots: IoSlots
        _run_lock: threading.RLock
        _events: Any  # runner_binding._Events
        _copy_tables: dict[tuple[int, str], CopyTable]

    def _staging(self, binding: _Binding, shapes: Shapes, slot: int = 0) -> tuple[dict[str, _Stage], StagedCopies]:
        """``binding``'s staging per I/O tensor in staging slot ``slot`` (inputs at ``shapes``, outputs as
        inferred: those the device part writes, ``binding.output_names``), made once, and the copies of whole
        mirrors that runs through them enqueue. Slot 0 is ``binding.stages`` / ``binding.staged``; other slots share
        its device buffers (``binding.twins``)."""
        graph, infos = self.engine.plan.graph, binding.lowered.infos  # type: ignore[attr-defined]
        inputs, outputs = graph.input_names, binding.output_names
        for value in graph.inputs:
            if value.name not in binding.stages:
                binding.stages[value.name] = _Stage(value.dtype, shapes[value.name])
        for name in outputs:
            if name not in binding.stages:
                binding.stages[name] = _Stage(infos[name].dtype, infos[name].shape)
        if binding.staged is None:
            binding.staged = _whole_copies(inputs, outputs, binding.stages)
        if slot == 0:
            return binding.stages, binding.staged
        twin = binding.twins.get(slot)
        if twin is None:
            stages = {name: stage.twin() for name, stage in binding.stages.items()}
            twin = binding.twins[slot] = (stages, _whole_copies(inputs, outputs, stages))
        return twin

    def _run_done(self, slot: int, stream: int) -> Any:
        """The event of ``slot``'s run, recorded on ``stream`` after what this thread enqueued (under the run
        lock: nothing of another run's may come between)."""
        event = self._events[f"slot{slot}"]
        record_event(event, stream)
        return event

    def _infer_staged(self, slot: int, stages: Mapping[str, _Stage], staged: StagedCopies,
                      inputs: Mapping[str, Sequence[np.ndarray]], spans: Sequence[Span], total: int, stream: int,
                      profiler: Any, debug: tuple[Any, Sequence[str]] | None) -> list[dict[str, np.ndarray]]:
        """Host parts only: gathered into the slot's pinned mirrors (padding zero there) without a lock, then
        copies and run as one replayed graph under the run lock, a wait for the slot's event, each part's rows
        copied out of the output mirrors. Three driver calls a run."""
        shapes = {name: stage.shape for name, stage in stages.items() if name in inputs}
        addresses = {name: stage.device.ptr for name, stage in stages.items()}
        with _synchronized_on_error(stream):
            for name, values in inputs.items():
                stages[name].fill(values)  # type: ignore[arg-type]
            with self._run_lock:
                try:
                    self.execute(shapes, addresses, stream, profiler, None, debug,  # type: ignore[attr-defined]
                                 staged=staged)
                except HostValueNotTensor as e:  # a host layer produced a sequence/optional: not for the device
                    _synchronize(stream)
                    outputs = self._on_host(self._gathered_on_host(inputs, total), str(e),  # type: ignore[attr-defined]
                                            debug)
                    return self._scatter(outputs, spans, total, [{} for _ in spans])
                done = self._run_done(slot, stream)
            _wait(done)
        results: list[dict[str, np.ndarray]] = [{} for _ in spans]
        for name in self.engine.plan.graph.output_names:  # type: ignore[attr-defined]
            stage = stages[name]
            whole = _copy_out(stage.array)  # one copy out of the mirror; the parts get views of it
            batched = is_batched(stage.shape, total)
            for result, (start, stop) in zip(results, spans):
                result[name] = whole[start:stop] if batched else whole
        return results

    def _copy_on_device(self, copies: Sequence[tuple[int, int, int] | np.ndarray], stream: int, slot: int,
                        purpose: str) -> None:
        """A run's device-to-device copies (a batch's gathers or deliveries, under the run lock): (dst, src, nbytes)
        rows, or arrays of such rows (``DeviceRows``); many small ones as one copy_segments launch reading this
        slot's table, a few through the driver (``memcpy_dtod_batch``)."""
        if any(isinstance(copy, np.ndarray) for copy in copies):
            table_rows = np.concatenate([np.asarray(c, np.uint64).reshape(-1, 3) for c in copies])
            table_rows = table_rows[table_rows[:, 2] > 0]
            count = len(table_rows)
        else:
            copies = [copy for copy in copies if copy[2]]
            count = len(copies)
            if count < SEGMENT_KERNEL_MIN_COPIES:
                memcpy_dtod_batch(copies, stream)  # type: ignore[arg-type]
                return
            table_rows = np.array(copies, np.uint64).reshape(-1, 3)
        if count < SEGMENT_KERNEL_MIN_COPIES:
            memcpy_dtod_batch([(int(d), int(s), int(n)) for d, s, n in table_rows], stream)
            return
        table = self._copy_tables.setdefault((slot, purpose), CopyTable())
        address = table.upload(table_rows, stream)
        function = self.engine.function(SEGMENTS_MODULE, SEGMENTS_MODULE)  # type: ignore[attr-defined]
        chunks = min(-(-int(table_rows[:, 2].max()) // SEGMENT_CHUNK_BYTES), 1024)
        launch_held(function, (min(count, 4096), chunks), 128, [ctypes.c_uint64(address), ctypes.c_int(count)],
                    stream)

    def _deliver(self, stages: Mapping[str, _Stage], spans: Sequence[Span], total: int,
                 destinations: Sequence[Mapping[str, DeviceView]], stream: int,
                 slot: int = 0) -> list[tuple[str, _Stage, bool, list[int]]]:
        """Enqueue each part's piece of every output (under the run lock): device to device into its destination,
        else one download of the rows parts want on the host (from the first such part's to the last's).
        Returns what ``_collect`` reads once the run is done."""
        on_host: list[tuple[str, _Stage, bool, list[int]]] = []
        copies: list[tuple[int, int, int] | np.ndarray] = []
        for name in self.engine.plan.graph.output_names:  # type: ignore[attr-defined]
            stage = stages[name]
            batched = is_batched(stage.shape, total)
            wanted = []
            for index, (start, stop) in enumerate(spans):
                begin, end = (start * stage.row_bytes, stop * stage.row_bytes) if batched else (0, stage.nbytes)
                view = destinations[index].get(name)
                if view is None:
                    wanted.append((index, begin, end))
                elif isinstance(view, DeviceRows):  # many parts' rows (infer_rows): one table for them all
                    copies.append(view.scatter_copies(stage.device.ptr + begin))
                else:
                    copies.append((view.ptr, stage.device.ptr + begin, end - begin))
            if wanted:
                stage.download(wanted[0][1], wanted[-1][2], stream)
                on_host.append((name, stage, batched, [index for index, _, _ in wanted]))
        self._copy_on_device(copies, stream, slot, "deliver")
        return on_host

    @staticmethod
    def _collect(on_host: Sequence[tuple[str, _Stage, bool, list[int]]], spans: Sequence[Span]
                 ) -> list[dict[str, np.ndarray]]:
        """The downloaded pieces ``_deliver`` enqueued, as fresh arrays per part (after the run's event)."""
        results: list[dict[str, np.ndarray]] = [{} for _ in spans]
        for name, stage, batched, indices in on_host:
            for index in indices:
                start, stop = spans[index]
                results[index][name] = (stage.array[start:stop] if batched else stage.array).copy()
        return results

    def _gathered_on_host(self, inputs: Mapping[str, Sequence[np.ndarray | DeviceView]],
                          total: int) -> dict[str, np.ndarray]:
        """The batch as host arrays (device parts read back): for runs that go through ``infer`` or the host."""
        return {name: gather_rows([_read_view(v) if isinstance(v, (DeviceView, DeviceRows)) else v for v in values],
                                  total)
                for name, values in inputs.items()}

    def _scatter(self, outputs: Mapping[str, np.ndarray], spans: Sequence[Span], total: int,
                 destinations: Sequence[Mapping[str, DeviceView]]) -> list[dict[str, np.ndarray]]:
        """Host outputs split per part; pieces with a destination are copied there (complete on return)."""
        from cuda.bindings import driver

        parts = split_outputs(outputs, spans, total)
        stream, pending = self.stream(), []
        for index, (part, targets) in enumerate(zip(parts, destinations)):
            for name, view in targets.items():
                piece = np.ascontiguousarray(part.pop(name))
                if isinstance(view, DeviceRows):  # each part's rows to its own address
                    for dst, src, nbytes in view.scatter_copies(piece.ctypes.data):
                        if nbytes:
                            check(driver.cuMemcpyHtoDAsync(int(dst), int(src), int(nbytes), stream), "HtoD")
                    pending.append(piece)
                    continue
                check_destination(name, index, view, piece.shape, piece.dtype)
                if piece.nbytes:
                    check(driver.cuMemcpyHtoDAsync(view.ptr, piece.ctypes.data, piece.nbytes, stream), "HtoD")
                pending.append(piece)  # alive until the copies are done
        _synchronize(stream)
        return parts


def _gather(stage: _Stage, values: Sequence[np.ndarray | DeviceView | DeviceRows], total: int, stream: int,
            copies: list[tuple[int, int, int] | np.ndarray]) -> None:
    """One input's parts into its device buffer in order: host parts into the pinned mirror (one upload per
    run of consecutive host parts), rows past the parts zeroed; device parts' copies are added to ``copies``
    (dst, src, nbytes), for the caller to enqueue as one batch (``memcpy_dtod_batch``)."""

    row, pending = 0, None  # pending: first row of host parts not uploaded yet
    stage.written = stage.shape[0] if stage.shape else 0  # padding is zeroed on the device, not in the mirror
    for value in values:
        count = int(value.shape[0])
        if isinstance(value, (DeviceView, DeviceRows)):
            if pending is not None:
                stage.upload(pending * stage.row_bytes, row * stage.row_bytes, stream)
                pending = None
            base = stage.device.ptr + row * stage.row_bytes
            copies.append(value.gather_copies(base) if isinstance(value, DeviceRows)
                          else (base, value.ptr, count * stage.row_bytes))
        else:
            np.copyto(stage.array[row:row + count], value)
            pending = row if pending is None else pending
        row += count
    if pending is not None:
        stage.upload(pending * stage.row_bytes, row * stage.row_bytes, stream)
    if row < total:
        memset_d8_async(stage.device.ptr + row * stage.row_bytes, 0, (total - row) * stage.row_bytes, stream)


def _read_view(view: DeviceView | DeviceRows) -> np.ndarray:
    """A host copy of a caller's device tensor, or of every part's rows stacked (synchronous)."""
    from cuda.bindings import driver

    out = np.empty(view.shape, view.dtype)
    copies = (view.gather_copies(out.ctypes.data) if isinstance(view, DeviceRows)
              else [(out.ctypes.data, view.ptr, out.nbytes)])
    with DEVICE_LOCK:  # a legacy-stream copy: never during another thread's capture
        for dst, src, nbytes in copies:
            if nbytes:
                check(driver.cuMemcpyDtoH(int(dst), int(src), int(nbytes)), "cuMemcpyDtoH")
    return out


@contextmanager
def _synchronized_on_error(stream: int) -> Iterator[None]:
    """On an exception, wait for ``stream`` before it propagates: copies queued from a pinned mirror must not
    still be reading it when the next run refills it."""
    try:
        yield
    except BaseException:
        try:
            _synchronize(stream)
        except Exception:
            pass
        raise


#: outputs up to this size leave the pinned mirror in a copy that keeps the interpreter lock (numpy's releases it,
#: and getting it back can cost more than the copy); larger ones let other threads run meanwhile
_COPY_HOLDING_LOCK_BYTES = 1 << 20


def _copy_out(array: np.ndarray) -> np.ndarray:
    """A writable copy of a pinned mirror's (contiguous) array."""
    if array.nbytes > _COPY_HOLDING_LOCK_BYTES:
        return array.copy()
    return np.frombuffer(bytearray(array.data), array.dtype).reshape(array.shape)


def _wait(event: Any) -> None:
    """Until ``event`` has happened (the interpreter lock is released meanwhile)."""
    from cuda.bindings import driver

    check(driver.cuEventSynchronize(event), "cuEventSynchronize")


def _synchronize(stream: int) -> None:
    from cuda.bindings import driver

    check(driver.cuStreamSynchronize(stream), "cuStreamSynchronize")


class _BatchCopies:
    """Whether cuMemcpyBatchAsync works here (CUDA 12.8+ drivers; cleared, and logged, at its first failure)."""

    usable = True


def memcpy_dtod_batch(copies: Sequence[tuple[int, int, int]], stream: int) -> None:
    """Device-to-device copies (dst, src, nbytes), unordered among themselves, in stream order as a whole: one
    cuMemcpyBatchAsync where the driver has it, else one cuMemcpyDtoDAsync each, all with the interpreter lock
    held. Why: a batch from CUDA shared memory has a copy per request and input (and output); a driver call that
    releases the interpreter lock in a worker thread beside a busy event loop costs up to a switch interval."""
    copies = [copy for copy in copies if copy[2]]
    if len(copies) > 1 and _BatchCopies.usable:
        try:
            memcpy_batch_async(copies, stream)
            return
        except Exception as e:  # noqa: BLE001 - an older driver: one copy per call still works
            _BatchCopies.usable = False
            DEFAULT_LOGGER.log(Severity.WARNING, f"cuMemcpyBatchAsync unavailable ({type(e).__name__}: {e}); "
                                                 "device-to-device copies go one call each")
    for dst, src, nbytes in copies:
        _memcpy_dtod(dst, src, nbytes, stream)


def _memcpy_dtod(dst: int, src: int, nbytes: int, stream: int) -> None:
    if nbytes:
        memcpy_dtod_async(dst, src, nbytes, stream)
