"""The runner's host side of I/O: page-locked host memory (``PinnedBuffer``: streamed weights, I/O mirrors), each I/O
tensor's device buffer and pinned mirror (``_Stage``), the copies captured with a run (``StagedCopies``), and how
``infer_batch`` gathers parts into the staging buffers and delivers each part's outputs (``StagingMixin``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine_core.backends.cuda.runner_binding import HostValueNotTensor, Shapes, _Binding
from engine_core.batching import Span, check_destination, gather_rows, is_batched, split_outputs
from engine_core.cuda.driver import (
    DEVICE_LOCK,
    DeviceBuffer,
    check,
    primary_context,
)
from engine_core.cuda.view import DeviceView
from engine_core.errors import ExecutionError


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


class _Stage:
    """One I/O tensor of a binding as ``infer`` moves it: the device buffer the plan reads or writes and a
    page-locked host mirror (with a numpy view of it). Why pinned: a copy from pageable memory is staged
    synchronously through the driver; from page-locked memory it is a DMA queued on the stream. Both are
    made once per binding, so every run of these shapes uses the same device addresses (its CUDA graph)."""

    def __init__(self, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        self.dtype, self.shape = np.dtype(dtype), tuple(int(d) for d in shape)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self.device = DeviceBuffer(self.nbytes)
        self.host = PinnedBuffer(self.nbytes)
        self.array = self.host.view(self.dtype, self.shape)
        #: bytes of one row along the leading dim (the whole tensor for scalars)
        self.row_bytes = self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.nbytes
        #: leading rows of the host mirror that may hold data; rows past it are zero (padding needs no clearing)
        self.written = self.shape[0] if self.shape else 0

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
        from cuda.bindings import driver

        if end > begin:
            check(driver.cuMemcpyHtoDAsync(self.device.ptr + begin, self.host.ptr + begin, end - begin, stream),
                  "cuMemcpyHtoDAsync")

    def download(self, begin: int, end: int, stream: int) -> None:
        """Device bytes [begin, end) -> the host mirror, queued on ``stream``."""
        from cuda.bindings import driver

        if end > begin:
            check(driver.cuMemcpyDtoHAsync(self.host.ptr + begin, self.device.ptr + begin, end - begin, stream),
                  "cuMemcpyDtoHAsync")


@dataclass(frozen=True)
class StagedCopies:
    """Copies around one run, captured with it: (device, host, nbytes) uploads from pinned host mirrors before
    the run and (host, device, nbytes) downloads after it. Frozen and hashable: part of a graph's key."""

    uploads: tuple[tuple[int, int, int], ...] = ()
    downloads: tuple[tuple[int, int, int], ...] = ()

    def upload(self, stream: int) -> None:
        from cuda.bindings import driver

        for device, host, nbytes in self.uploads:
            check(driver.cuMemcpyHtoDAsync(device, host, nbytes, stream), "cuMemcpyHtoDAsync")

    def download(self, stream: int) -> None:
        from cuda.bindings import driver

        for host, device, nbytes in self.downloads:
            check(driver.cuMemcpyDtoHAsync(host, device, nbytes, stream), "cuMemcpyDtoHAsync")


class StagingMixin:
    """CudaContextState's staging: per-binding I/O buffers and mirrors, gathering a batch's parts,
    delivering each part's rows."""

    def _staging(self, binding: _Binding, shapes: Shapes) -> dict[str, _Stage]:
        """``binding``'s staging per I/O tensor (inputs at ``shapes``, outputs as inferred), made once, and
        the copies of whole mirrors that runs through them enqueue (``binding.staged``)."""
        graph, infos = self.engine.plan.graph, binding.lowered.infos
        for value in graph.inputs:
            if value.name not in binding.stages:
                binding.stages[value.name] = _Stage(value.dtype, shapes[value.name])
        for name in graph.output_names:
            if name not in binding.stages:
                binding.stages[name] = _Stage(infos[name].dtype, infos[name].shape)
        if binding.staged is None:
            stages = binding.stages
            binding.staged = StagedCopies(
                tuple((stages[v.name].device.ptr, stages[v.name].host.ptr, stages[v.name].nbytes)
                      for v in graph.inputs if stages[v.name].nbytes),
                tuple((stages[n].host.ptr, stages[n].device.ptr, stages[n].nbytes)
                      for n in graph.output_names if stages[n].nbytes))
        return binding.stages

    def _infer_staged(self, binding: _Binding, stages: Mapping[str, _Stage],
                      inputs: Mapping[str, Sequence[np.ndarray]], spans: Sequence[Span], total: int,
                      addresses: Mapping[str, int], stream: int, profiler: Any,
                      debug: tuple[Any, Sequence[str]] | None) -> list[dict[str, np.ndarray]]:
        """Host parts only: gathered into the pinned mirrors (padding zero there), then copies and run as one
        replayed graph, one sync, each part's rows copied out of the output mirrors. Two driver calls a run."""
        shapes = {name: stage.shape for name, stage in stages.items() if name in inputs}
        with _synchronized_on_error(stream):
            for name, values in inputs.items():
                stages[name].fill(values)  # type: ignore[arg-type]
            try:
                self.execute(shapes, addresses, stream, profiler, None, debug, staged=binding.staged)
            except HostValueNotTensor as e:  # a host layer produced a sequence/optional: the device cannot hold it
                _synchronize(stream)
                outputs = self._on_host(self._gathered_on_host(inputs, total), str(e), debug)
                return self._scatter(outputs, spans, total, [{} for _ in spans])
            _synchronize(stream)
        results: list[dict[str, np.ndarray]] = [{} for _ in spans]
        for name in self.engine.plan.graph.output_names:
            stage = stages[name]
            whole = _copy_out(stage.array)  # one copy out of the mirror; the parts get views of it
            batched = is_batched(stage.shape, total)
            for result, (start, stop) in zip(results, spans):
                result[name] = whole[start:stop] if batched else whole
        return results

    def _deliver(self, stages: Mapping[str, _Stage], spans: Sequence[Span], total: int,
                 destinations: Sequence[Mapping[str, DeviceView]], stream: int) -> list[dict[str, np.ndarray]]:
        """Each part's piece of every output: device to device into its destination, else one download of
        the rows parts want on the host (from the first such part's to the last's), then one sync."""
        results: list[dict[str, np.ndarray]] = [{} for _ in spans]
        on_host = []
        for name in self.engine.plan.graph.output_names:
            stage = stages[name]
            batched = is_batched(stage.shape, total)
            wanted = []
            for index, (start, stop) in enumerate(spans):
                begin, end = (start * stage.row_bytes, stop * stage.row_bytes) if batched else (0, stage.nbytes)
                view = destinations[index].get(name)
                if view is None:
                    wanted.append((index, begin, end))
                else:
                    _memcpy_dtod(view.ptr, stage.device.ptr + begin, end - begin, stream)
            if wanted:
                stage.download(wanted[0][1], wanted[-1][2], stream)
                on_host.append((name, stage, batched, [index for index, _, _ in wanted]))
        _synchronize(stream)
        for name, stage, batched, indices in on_host:
            for index in indices:
                start, stop = spans[index]
                results[index][name] = (stage.array[start:stop] if batched else stage.array).copy()
        return results

    def _gathered_on_host(self, inputs: Mapping[str, Sequence[np.ndarray | DeviceView]],
                          total: int) -> dict[str, np.ndarray]:
        """The batch as host arrays (device parts read back): for runs that go through ``infer`` or the host."""
        return {name: gather_rows([_read_view(v) if isinstance(v, DeviceView) else v for v in values], total)
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
                check_destination(name, index, view, piece.shape, piece.dtype)
                if piece.nbytes:
                    check(driver.cuMemcpyHtoDAsync(view.ptr, piece.ctypes.data, piece.nbytes, stream), "HtoD")
                pending.append(piece)  # alive until the copies are done
        _synchronize(stream)
        return parts


def _gather(stage: _Stage, values: Sequence[np.ndarray | DeviceView], total: int, stream: int) -> None:
    """One input's parts into its device buffer in order: host parts into the pinned mirror (one upload per
    run of consecutive host parts), device parts device to device, rows past the parts zeroed."""
    from cuda.bindings import driver

    row, pending = 0, None  # pending: first row of host parts not uploaded yet
    stage.written = stage.shape[0] if stage.shape else 0  # padding is zeroed on the device, not in the mirror
    for value in values:
        count = int(value.shape[0])
        if isinstance(value, DeviceView):
            if pending is not None:
                stage.upload(pending * stage.row_bytes, row * stage.row_bytes, stream)
                pending = None
            _memcpy_dtod(stage.device.ptr + row * stage.row_bytes, value.ptr, count * stage.row_bytes, stream)
        else:
            np.copyto(stage.array[row:row + count], value)
            pending = row if pending is None else pending
        row += count
    if pending is not None:
        stage.upload(pending * stage.row_bytes, row * stage.row_bytes, stream)
    if row < total:
        check(driver.cuMemsetD8Async(stage.device.ptr + row * stage.row_bytes, 0, (total - row) * stage.row_bytes,
                                     stream), "cuMemsetD8Async")


def _read_view(view: DeviceView) -> np.ndarray:
    """A host copy of a caller's device tensor (synchronous)."""
    from cuda.bindings import driver

    out = np.empty(view.shape, view.dtype)
    if out.nbytes:
        with DEVICE_LOCK:  # a legacy-stream copy: never during another thread's capture
            check(driver.cuMemcpyDtoH(out.ctypes.data, view.ptr, out.nbytes), "cuMemcpyDtoH")
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


def _synchronize(stream: int) -> None:
    from cuda.bindings import driver

    check(driver.cuStreamSynchronize(stream), "cuStreamSynchronize")


def _memcpy_dtod(dst: int, src: int, nbytes: int, stream: int) -> None:
    from cuda.bindings import driver

    if nbytes:
        check(driver.cuMemcpyDtoDAsync(dst, src, nbytes, stream), "cuMemcpyDtoDAsync")
