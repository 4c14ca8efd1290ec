"""One decoder run on a CUDA engine by device address, its KV cache in a ``DeviceKVPool``.

Per step, on one stream of its own:
1. the run's small inputs (token ids, attention mask, position ids, the block tables, lengths and counts the KV
   kernels read), packed into one page-locked host buffer, go to the device in ONE copy;
2. the gather kernel fills every layer's past inputs from the pool's blocks (``DeviceKVPool.gather_into``);
3. the engine runs on its device buffers (``ExecutionContext.set_input_shape`` / ``set_tensor_address`` /
   ``execute_async_v3``), writing every layer's present keys and values and the logits on the device;
4. the scatter kernel stores the new rows of the present outputs in the pool (``scatter_from``);
5. only each sequence's logits at its last new token come back ([rows, vocab]: decode's rows are one copy), and the
   host waits once.
The cache never crosses PCIe. The engine-side buffers (inputs, pasts, presents, logits) are allocated once for the
largest run seen so far and only ever grow (doubling, up to what the engine's profile allows), so every run of one
shape binds the same addresses and the runtime replays the CUDA graph it captured for that shape (its graphs are
keyed on shapes and addresses) instead of launching layer by layer.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Generic, Protocol, TypeVar

import numpy as np

from engine_core.cuda.driver import DeviceBuffer, Stream, copy_pinned_async, primary_context
from engine_core.cuda.host_memory import HostRegistration
from engine_core.error_recorder import ErrorRecorder
from engine_core.errors import ExecutionError, ShapeError
from engine_core.generate.device_argmax import launch_rows_argmax
from engine_core.generate.device_kv import ALIGNMENT, DeviceKVPool, slice_bytes
from engine_core.generate.kv_layout import KV_PARTS, PAST, PRESENT, StepLayout, pad_layout, row_runs
from engine_core.generate.logits_rows import LOGITS_ROWS
from engine_core.runtime import ExecutionContext
from engine_core.types import nptype

#: host pages: pinned buffers start on one
PAGE = 4096

T = TypeVar("T")


class KVSignature(Protocol):
    """What the device path reads of ``decoder.DecoderSignature``."""

    @property
    def layers(self) -> int: ...

    @property
    def kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def kv_dtype(self) -> np.dtype: ...


def pack(arrays: Mapping[str, np.ndarray]) -> tuple[dict[str, int], int]:
    """Byte offsets of ``arrays`` laid one after another in one buffer, each starting on ALIGNMENT bytes, and the
    bytes they take: the run's small inputs go to the device in one copy."""
    offsets, end = {}, 0
    for name, array in arrays.items():
        offsets[name] = end
        end += -(-array.nbytes // ALIGNMENT) * ALIGNMENT
    return offsets, end


class Growing(Generic[T]):
    """A buffer made by ``make(nbytes)`` that only grows: at least double the old size (no more than ``limit``,
    unless a request is larger), so a run of growing shapes reallocates a few times, and every run that fits keeps
    the same address (the engine's CUDA graphs are keyed on it)."""

    def __init__(self, make: Callable[[int], T], limit: int | None = None) -> None:
        self._make, self._limit = make, limit
        self.buffer: T | None = None
        self.capacity = 0
        self.allocations = 0

    def ensure(self, nbytes: int) -> T:
        """The buffer, at least ``nbytes`` (and ALIGNMENT) bytes; the old one is dropped before a larger is made
        (nothing may still be using it: every step waits for its stream)."""
        nbytes = max(int(nbytes), ALIGNMENT)
        buffer = self.buffer
        if buffer is None or nbytes > self.capacity:
            capacity = max(nbytes, 2 * self.capacity)
            if self._limit is not None:
                capacity = max(nbytes, min(capacity, self._limit))
            self.buffer = buffer = None
            buffer = self.buffer = self._make(capacity)
            self.capacity, self.allocations = capacity, self.allocations + 1
        return buffer

    def release(self) -> None:
        self.buffer, self.capacity = None, 0


class PinnedBytes:
    """``nbytes`` of page-locked host memory (a page-aligned numpy buffer registered with the driver): what an
    asynchronous copy to or from the device needs. Unpinned, then released, with the object."""

    def __init__(self, nbytes: int) -> None:
        raw = np.empty(nbytes + PAGE, np.uint8)
        skip = -raw.ctypes.data % PAGE
        self.nbytes = nbytes
        self.array = raw[skip:skip + nbytes]
        self.ptr = raw.ctypes.data + skip
        # the registration holds `raw` until it has unpinned it
        self._registration = HostRegistration(self.ptr, nbytes, on_release=lambda: _keep(raw))


def _keep(*_: object) -> None:
    """Nothing: a callback that references what must outlive its caller."""


class DeviceStepper:
    """Runs a decoder engine's steps on the device (the module docstring): one per ``DecoderRunner`` on a CUDA
    engine, holding the engine-side device buffers and a stream. ``close`` frees them."""

    def __init__(self, context: ExecutionContext, signature: KVSignature, index_dtypes: Mapping[str, np.dtype], *,
                 max_batch: int, max_context: int) -> None:
        primary_context()
        #: runs of several new tokens (prefill) go to ``context``, single-token runs (decode) to a context of their
        #: own: a context re-infers output shapes whenever its input shapes change, and one that grows its activation
        #: memory for a long prefill drops every CUDA graph it captured; decode's shapes then stay put between blocks
        self.context, self.decode_context = context, context.engine.create_execution_context()
        self.signature = signature
        self._max_batch, self._max_context = max_batch, max_context
        self._index_dtypes = dict(index_dtypes)
        #: the engine computes the head for the rows ``logits_rows`` names: logits [batch, 1, vocab]
        self._head_rows = LOGITS_ROWS in self._index_dtypes
        self._logits_dtype = np.dtype(nptype(context.engine.get_tensor_dtype("logits")))
        self._stream: Stream | None = Stream()
        s, itemsize = signature, signature.kv_dtype.itemsize
        slices = 2 * s.layers
        self._inputs: Growing[DeviceBuffer] = Growing(DeviceBuffer)
        self._past = Growing(DeviceBuffer, slices * slice_bytes(max_batch, s.kv_heads, max_context - 1, s.head_dim,
                                                                itemsize))
        self._present = Growing(DeviceBuffer, slices * slice_bytes(max_batch, s.kv_heads, max_context, s.head_dim,
                                                                   itemsize))
        self._logits = Growing(DeviceBuffer, max_batch * max_context * s.vocab_size * self._logits_dtype.itemsize)
        self._host_inputs: Growing[PinnedBytes] = Growing(PinnedBytes)
        self._host_logits = Growing(PinnedBytes, max_batch * s.vocab_size * self._logits_dtype.itemsize)
        self._recorders: list[ErrorRecorder] = []
        for each in (self.context, self.decode_context):
            if each.error_recorder is None:  # so a failed run's message reaches the exception
                each.error_recorder = ErrorRecorder()
                self._recorders.append(each.error_recorder)

    def close(self) -> None:
        """Free the device and pinned buffers now (idempotent)."""
        if self._stream is not None:
            self._stream.synchronize()
        for buffer in (self._inputs, self._past, self._present, self._logits, self._host_inputs, self._host_logits):
            buffer.release()
        self._stream = None

    def step(self, pool: DeviceKVPool, seqs: Sequence[Hashable], layout: StepLayout, copy: bool = True,
             argmax: bool = False) -> np.ndarray:
        """Run ``layout`` (planned with shape buckets) for ``seqs``, whose blocks ``pool`` has reserved: the new rows
        go into the pool and each sequence's next-token logits [len(seqs), vocab] (float32) come back; with
        ``copy=False`` in the pinned host buffer itself when the engine writes float32, valid until the next step.
        ``argmax`` (only where ``finds_argmax``): each sequence's argmax token id instead [len(seqs)] (int64), found
        on the device (device_argmax.py)."""
        if argmax and not self.finds_argmax:
            raise ValueError(f"the argmax kernel reads float32 logits; this engine writes {self._logits_dtype}")
        if self._stream is None:
            raise ExecutionError("the decoder's device buffers are closed")
        primary_context()
        stream = self._stream.handle
        tables = pool.tables_for(seqs, layout)
        small = self._small_inputs(layout, tables)
        # each sequence's last new token's logits row: where its flat position is, or (an engine with logits_rows)
        # the first rows in order
        rows = np.arange(layout.rows) if self._head_rows else np.arange(layout.rows) * layout.new + layout.last
        if argmax:  # where each row starts, and the ids' slot (written on the device, read back)
            small["#rows"] = (rows * self.signature.vocab_size).astype(np.int64)
            small["#ids"] = np.zeros(layout.rows, np.int32)
        offsets, total = pack(small)
        host, device = self._host_inputs.ensure(total), self._inputs.ensure(total)
        for name, array in small.items():
            host.array[offsets[name]:offsets[name] + array.nbytes] = array.reshape(-1).view(np.uint8)
        kv = _EngineBuffers(self, layout)
        batch, past, new = layout.batch, layout.past, layout.new
        row_bytes = self.signature.vocab_size * self._logits_dtype.itemsize
        logits_out = None if argmax else self._host_logits.ensure(layout.rows * row_bytes)
        waits = self._stream
        context = self.decode_context if new == 1 else self.context
        try:
            copy_pinned_async(device.ptr, host.ptr, total, stream, to_device=True)
            pool.gather_into(kv.past, kv.past_stride, device.ptr + offsets["#tables"], device.ptr + offsets["#lengths"],
                             batch=batch, past_len=past, max_blocks=tables.shape[1], stream=stream)
            self._bind(context, layout, {n: device.ptr + offsets[n] for n in small if not n.startswith("#")}, kv)
            if not context.execute_async_v3(stream):
                raise ExecutionError(f"the decoder engine's run failed: {self._last_error(context)}")
            pool.scatter_from(kv.present, kv.present_stride, device.ptr + offsets["#tables"],
                              device.ptr + offsets["#lengths"], device.ptr + offsets["#counts"], batch=batch,
                              past_len=past, new_len=new, max_blocks=tables.shape[1], stream=stream)
            if logits_out is None:
                launch_rows_argmax(kv.logits, device.ptr + offsets["#rows"], layout.rows, self.signature.vocab_size,
                                   device.ptr + offsets["#ids"], stream)
                copy_pinned_async(host.ptr + offsets["#ids"], device.ptr + offsets["#ids"], layout.rows * 4, stream,
                                  to_device=False)
            else:
                for first, count, at in row_runs(rows):
                    copy_pinned_async(logits_out.ptr + at * row_bytes, kv.logits + first * row_bytes,
                                      count * row_bytes, stream, to_device=False)
            waits.synchronize()
        except BaseException:
            try:  # nothing queued may still read the pinned inputs when the next step refills them
                waits.synchronize()
            except Exception:
                pass
            raise
        pool.commit(seqs, layout)
        if logits_out is None:
            at = offsets["#ids"]
            return host.array[at:at + layout.rows * 4].view(np.int32).astype(np.int64)
        logits = logits_out.array[:layout.rows * row_bytes].view(self._logits_dtype)
        return logits.reshape(layout.rows, self.signature.vocab_size).astype(np.float32, copy=copy)

    def warm_up(self, pool: DeviceKVPool, shapes: Sequence[tuple[int, int, int]], block_tokens: int) -> None:
        """Capture the CUDA graph of every (batch, past, new) of ``shapes`` (largest first) before any sequence needs
        it: each runs twice on pad rows (``pad_layout``: no block of ``pool`` is read or written), the first run
        binding the shape and launching layer by layer, the second capturing and checking the graph. The buffers
        are sized for the largest shapes first (and the run's small inputs for any run up to the engine's limits),
        so no later run moves an address a captured graph holds."""
        slices = 2 * self.signature.layers
        pasts, presents, logits = zip(*(self._engine_bytes(*shape) for shape in shapes))
        self._past.ensure(slices * max(pasts))
        self._present.ensure(slices * max(presents))
        self._logits.ensure(max(logits))
        batch, context = self._max_batch, self._max_context
        index = batch * context * 8  # the widest index dtype, for ids, mask and positions
        self._inputs.ensure(3 * index + batch * (-(-context // block_tokens) + 1) * 4 + batch * 32 + 10 * ALIGNMENT)
        for shape in shapes:
            layout = pad_layout(*shape)
            for _ in range(2):
                self.step(pool, [], layout, copy=False)

    def _engine_bytes(self, batch: int, past: int, new: int) -> tuple[int, int, int]:
        """(bytes of one layer's past slice, of one present slice, of the logits) of a run at these shapes."""
        s, itemsize = self.signature, self.signature.kv_dtype.itemsize
        return (slice_bytes(batch, s.kv_heads, past, s.head_dim, itemsize),
                slice_bytes(batch, s.kv_heads, past + new, s.head_dim, itemsize),
                batch * (1 if self._head_rows else new) * s.vocab_size * self._logits_dtype.itemsize)

    @property
    def finds_argmax(self) -> bool:
        """Whether ``step(argmax=True)`` can find the argmax on the device: the kernel reads float32 logits."""
        return self._logits_dtype == np.float32

    def _small_inputs(self, layout: StepLayout, tables: np.ndarray) -> dict[str, np.ndarray]:
        """The run's host-made inputs: the engine's (by their names) and the KV kernels' ("#" names)."""
        dtypes = self._index_dtypes
        small = {"input_ids": np.ascontiguousarray(layout.tokens, dtypes["input_ids"]),
                 "attention_mask": np.ascontiguousarray(layout.mask, dtypes["attention_mask"])}
        if "position_ids" in dtypes:
            small["position_ids"] = np.ascontiguousarray(layout.positions, dtypes["position_ids"])
        if LOGITS_ROWS in dtypes:
            small[LOGITS_ROWS] = np.ascontiguousarray(layout.logits_rows, dtypes[LOGITS_ROWS])
        small["#tables"] = np.ascontiguousarray(tables, np.int32)
        small["#lengths"] = layout.lengths.astype(np.int32)
        small["#counts"] = layout.counts.astype(np.int32)
        return small

    def _bind(self, context: ExecutionContext, layout: StepLayout, small: Mapping[str, int], kv: _EngineBuffers
              ) -> None:
        """Input shapes and every I/O address for this run on ``context``, each set only when it changed (a new
        input shape makes the context infer output shapes again)."""
        s = self.signature
        batch, past, new = layout.batch, layout.past, layout.new
        shapes: dict[str, tuple[int, ...]] = {"input_ids": (batch, new), "attention_mask": (batch, past + new)}
        if "position_ids" in small:
            shapes["position_ids"] = (batch, new)
        if LOGITS_ROWS in small:
            shapes[LOGITS_ROWS] = (batch,)
        addresses = dict(small)
        addresses["logits"] = kv.logits
        for i in range(s.layers):
            for part_index, part in enumerate(KV_PARTS):
                slot = 2 * i + part_index
                shapes[PAST.format(i, part)] = (batch, s.kv_heads, past, s.head_dim)
                addresses[PAST.format(i, part)] = kv.past + slot * kv.past_stride
                addresses[PRESENT.format(i, part)] = kv.present + slot * kv.present_stride
        for name, shape in shapes.items():
            if tuple(context.get_tensor_shape(name)) != shape and not context.set_input_shape(name, shape):
                raise ShapeError(f"the decoder engine refuses input '{name}' of shape {list(shape)}: "
                                 f"{self._last_error(context)}")
        for name, address in addresses.items():
            if context.get_tensor_address(name) != address:
                context.set_tensor_address(name, address)

    def _last_error(self, context: ExecutionContext) -> str:
        """``context``'s newest recorded error (a recorder this stepper installed is emptied: it keeps only its
        first 64)."""
        recorder = context.error_recorder
        count = recorder.num_errors() if recorder is not None else 0
        message = recorder.get_error_desc(count - 1) if count else "see the log"
        if any(recorder is mine for mine in self._recorders):
            recorder.clear()
        return message


class _EngineBuffers:
    """The device addresses of one run's engine-side tensors: every layer's past inputs, present outputs (one
    (layer, part) slice after another, ``*_stride`` bytes apart) and the logits; grown to fit the run first."""

    def __init__(self, stepper: DeviceStepper, layout: StepLayout) -> None:
        slices = 2 * stepper.signature.layers
        self.past_stride, self.present_stride, logits_bytes = stepper._engine_bytes(layout.batch, layout.past,
                                                                                   layout.new)
        self.past = stepper._past.ensure(slices * self.past_stride).ptr
        self.present = stepper._present.ensure(slices * self.present_stride).ptr
        self.logits = stepper._logits.ensure(logits_bytes).ptr
