"""Launching one run layer by layer: the schedule's actions on the compute and copy streams, each step's kernel
launches (an attention's through cuDNN's SDPA where it takes it), GEMMs (cuBLAS, cuBLASLt, Kiln's), INT8 GEMMs,
cuDNN convolutions, copies and host-fallback layers,
profiled runs (CUDA events per layer), weight-streaming uploads and debug tensors (``LaunchMixin``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from engine_core.backends.cuda.cudnn_attention import SdpaLaunch
from engine_core.backends.cuda.gemm import run_kiln_gemm
from engine_core.backends.cuda.int8_gemm import Int8Gemm
from engine_core.backends.cuda.lowering_context import (
    Conv,
    Copy,
    Gemm,
    Host,
    Launch,
    Ref,
    Step,
)
from engine_core.backends.cuda.runner_binding import HostValueNotTensor, _Binding
from engine_core.backends.cuda.runner_schedule import COMPUTE, COPY, RunSchedule
from engine_core.backends.cuda.runner_staging import StagedCopies, _memcpy_dtod
from engine_core.cuda.driver import (
    DeviceBuffer,
    check,
)
from engine_core.errors import ExecutionError
from engine_core.interpret import run_node, run_scoped
from engine_core.ir.graph import has_subgraph, subgraph_reads
from engine_core.ops import TensorInfo
from engine_core.types import TensorLocation, datatype_of


class LaunchMixin:
    """CudaContextState's layer-by-layer launching (eager, captured, profiled, debug)."""

    def _launch_profiled(self, binding: _Binding, schedule: RunSchedule, addresses: Mapping[str, int], stream: int,
                         profiler: Any, consumed_event: Any = None, listener: Any = None,
                         staged: StagedCopies | None = None) -> None:
        from cuda.bindings import driver

        # an event after each step that launches something; views (no ops) get none and are not reported, as
        # layers TensorRT removed are not: events around them timed only the host's gap between two launches
        start = check(driver.cuEventCreate(0), "cuEventCreate")
        after = [check(driver.cuEventCreate(0), "cuEventCreate") if step.ops else None
                 for step in binding.lowered.steps]
        check(driver.cuEventRecord(start, stream), "cuEventRecord")
        self._launch_all(binding, schedule, addresses, stream, consumed_event, after_step=after,
                         listener=listener, staged=staged)
        recorded = [event for event in after if event is not None]
        check(driver.cuEventSynchronize(recorded[-1] if recorded else start), "cuEventSynchronize")
        previous = start
        for step, event in zip(binding.lowered.steps, after):
            if event is not None:
                profiler.report_layer_time(step.node.name, float(check(driver.cuEventElapsedTime(previous, event),
                                                                       "time")))
                previous = event
        for event in [start, *recorded]:
            driver.cuEventDestroy(event)

    def _ensure_slots(self, schedule: RunSchedule) -> None:
        """Scratch slots at least as large as ``schedule`` needs; growing them invalidates captured graphs."""
        for slot, need in enumerate(schedule.streaming.slot_bytes):
            if need and (self._slots[slot] is None or self._slots[slot].nbytes < need):
                self._slots[slot] = DeviceBuffer(need)
                self.forget_graphs()

    def copy_stream(self) -> int:
        """The stream weight uploads run on (non-blocking: ordered by events only)."""
        if self._copy_stream is None:
            from cuda.bindings import driver

            flags = int(driver.CUstream_flags.CU_STREAM_NON_BLOCKING)
            self._copy_stream = int(check(driver.cuStreamCreate(flags), "cuStreamCreate"))
        return self._copy_stream

    def _launch_all(self, binding: _Binding, schedule: RunSchedule, addresses: Mapping[str, int], stream: int,
                    consumed_event: Any = None, after_step: list | None = None, capturing: bool = False,
                    listener: Any = None, staged: StagedCopies | None = None) -> None:
        """Enqueue one run: interpret ``schedule.actions`` on the compute and copy streams, between the
        ``staged`` uploads and downloads."""
        if staged is not None:
            staged.upload(stream)
        self._launch_steps(binding, schedule, addresses, stream, consumed_event, after_step, capturing, listener)
        if staged is not None:
            staged.download(stream)

    def _launch_steps(self, binding: _Binding, schedule: RunSchedule, addresses: Mapping[str, int], stream: int,
                      consumed_event: Any, after_step: list | None, capturing: bool, listener: Any) -> None:
        from cuda.bindings import driver

        resolve, current = self._resolver(binding, addresses)
        steps, events = binding.lowered.steps, binding.events
        streams = {COMPUTE: stream, COPY: self.copy_stream() if schedule.uses_copy_stream else stream}
        for action in schedule.actions:
            kind = action[0]
            if kind == "step":
                index = action[1]
                current.clear()
                for key, (slot, offset) in schedule.streamed.get(index, {}).items():
                    current[key] = self._slots[slot].ptr + offset
                self._run_step(steps[index], binding, resolve, stream)
                if after_step is not None and after_step[index] is not None:
                    check(driver.cuEventRecord(after_step[index], stream), "cuEventRecord")
            elif kind == "record":
                check(driver.cuEventRecord(events[action[2]], streams[action[1]]), "cuEventRecord")
            elif kind == "wait":
                check(driver.cuStreamWaitEvent(streams[action[1]], events[action[2]], 0), "cuStreamWaitEvent")
            elif kind == "upload":
                self._upload(schedule.streaming.steps[action[1]], streams[COPY])
            elif kind == "consumed":
                if capturing:  # a plain record inside a capture would only order the capture's own nodes
                    flag = int(driver.CUevent_record_flags.CU_EVENT_RECORD_EXTERNAL)
                    check(driver.cuEventRecordWithFlags(consumed_event, stream, flag), "cuEventRecordWithFlags")
                else:
                    check(driver.cuEventRecord(consumed_event, stream), "cuEventRecord(input consumed)")
            elif kind == "debug" and listener is not None:
                self._report_debug(listener, action[1], binding, resolve, stream)

    def _run_step(self, step: Step, binding: _Binding, resolve, stream: int) -> None:
        for op in step.ops:
            if isinstance(op, Launch):
                if not (isinstance(op, SdpaLaunch) and self.cudnn_attention and self._sdpa(op, resolve, stream)):
                    binding.prepared[id(op)].run(resolve, stream)  # cuDNN declined: the flash kernel
            elif isinstance(op, Gemm):
                self._gemm(op, resolve, stream)
            elif isinstance(op, Int8Gemm):
                self._int8_gemm(op, resolve, stream)
            elif isinstance(op, Conv):
                remaining = self._conv(op, resolve, stream, binding.conv_bias_only)
                for launch in op.fallback if remaining == "fallback" else op.rest if remaining == "rest" else []:
                    binding.prepared[id(launch)].run(resolve, stream)  # the epilogue cuDNN did not run
            elif isinstance(op, Copy):
                _memcpy_dtod(resolve(op.dst), resolve(op.src), op.nbytes, stream)
            elif isinstance(op, Host):
                self._host(op, binding, resolve, stream)

    def _upload(self, sstep: Any, copy_stream: int) -> None:
        """One streaming step's weights, pinned host -> its slot, on the copy stream."""
        from cuda.bindings import driver

        slot = self._slots[sstep.slot].ptr
        for upload in sstep.uploads:
            source = self.engine.host_weights[upload.weight]
            check(driver.cuMemcpyHtoDAsync(slot + upload.offset, source.ptr, upload.nbytes, copy_stream),
                  f"upload of streamed weight '{upload.weight}'")

    # -- debug tensors ------------------------------------------------------------------------------
    def _report_debug(self, listener: Any, name: str, binding: _Binding, resolve, stream: int) -> None:
        """Hand one debug tensor to the listener: a device pointer valid in ``stream`` order at the time of
        the call (the layers after it are not enqueued yet), in the linear layout of its logical shape."""
        info = binding.lowered.infos.get(name)
        if info is None or info.shape is None:
            raise ExecutionError(f"debug tensor '{name}' has no shape in this run")
        pointer = self._debug_pointer(name, info, binding, resolve, stream)
        listener.process_debug_tensor(pointer, TensorLocation.DEVICE, datatype_of(info.dtype), tuple(info.shape),
                                      name, stream)

    def _debug_pointer(self, name: str, info: TensorInfo, binding: _Binding, resolve, stream: int) -> int:
        """Where the listener reads ``name``: in place when it is linear and device-resident, else a copy in a
        per-binding buffer (channels-last activations, streamed weights, values known only on the host)."""
        from cuda.bindings import driver

        location = binding.lowered.locations.get(name)
        streamed = location is not None and location[0] == "weight" and location[1] not in self.engine.weights
        nhwc = binding.lowered.layouts.get(name) == "nhwc"
        if location is not None and not streamed and not nhwc:
            return resolve(Ref(name))
        nbytes = int(np.prod(info.shape, dtype=np.int64)) * info.dtype.itemsize
        if nhwc:  # the arena holds N,H,W,C: bring it to N,C,H,W
            n, c, h, w = info.shape
            raw = np.empty((n, h, w, c), info.dtype)
            check(driver.cuStreamSynchronize(stream), "cuStreamSynchronize")
            if nbytes:
                check(driver.cuMemcpyDtoH(raw.ctypes.data, resolve(Ref(name)), nbytes), "cuMemcpyDtoH")
            value = raw.transpose(0, 3, 1, 2)
        elif name in self.engine.plan.graph.constants:
            value = np.asarray(self.engine.plan.graph.constants[name])
        elif info.value is not None:
            value = np.asarray(info.value, info.dtype)
        else:
            raise ExecutionError(f"debug tensor '{name}' is not computed on the device in this run")
        buffer = binding.debug_buffers.get(name)
        if buffer is None or buffer.nbytes < nbytes:
            buffer = binding.debug_buffers[name] = DeviceBuffer(nbytes)
        if nbytes:
            array = np.ascontiguousarray(value)
            check(driver.cuMemcpyHtoDAsync(buffer.ptr, array.ctypes.data, nbytes, stream), "cuMemcpyHtoDAsync")
            check(driver.cuStreamSynchronize(stream), "cuStreamSynchronize")  # the host array is temporary
        return buffer.ptr

    def _gemm(self, op: Gemm, resolve, stream: int) -> None:
        a, b, y = resolve(op.a), resolve(op.b), resolve(op.y)
        if op.tactic == "cublaslt":
            if self._cublaslt is None:
                from engine_core.backends.cuda.cublaslt import CublasLt

                self._cublaslt = CublasLt()
            self._cublaslt.matmul(a, b, y, resolve(op.bias) if op.bias else 0, op.m, op.n, op.k, op.trans_a,
                                  op.trans_b, op.alpha, op.dtype, op.tf32, op.epilogue, stream)
            return
        if op.tactic == "cublas":
            if self._cublas is None:
                from engine_core.backends.cuda.cublas import Cublas

                self._cublas = Cublas()
            self._cublas.gemm(a, b, y, op.m, op.n, op.k, op.batch, op.trans_a, op.trans_b, op.a_strides[2],
                              op.b_strides[2], op.alpha, op.beta, stream, op.dtype, op.tf32)
            return
        run_kiln_gemm(self.engine.function("gemm", "gemm_f32"), op, a, b, y, stream)

    def _int8_gemm(self, op: Int8Gemm, resolve, stream: int) -> None:
        if self._int8 is None:
            from engine_core.backends.cuda.cublaslt import CublasLt
            from engine_core.backends.cuda.int8_gemm import Int8GemmRunner

            if self._cublaslt is None:
                self._cublaslt = CublasLt()
            self._int8 = Int8GemmRunner(self._cublaslt)  # shares the context's cuBLASLt handle and workspace
        self._int8.run(op, resolve, stream)

    def _conv(self, op: Conv, resolve, stream: int, bias_only: bool = False) -> str:
        """Run ``op`` through cuDNN; returns which of its epilogue lists the caller must run ("" / "rest" /
        "fallback", see CudnnConvs.run)."""
        if self._convs is None:
            from engine_core.backends.cuda.cudnn_conv import CudnnConvs

            self._convs = CudnnConvs()
        from engine_core.backends.cuda.cudnn_conv import signature

        before = self._convs.workspace_generation
        # heuristic_conv_plans (BuilderConfig.cudnn_heuristic_conv_plans, KILN_CUDNN_HEURISTIC=1): cuDNN's first
        # heuristic plan, ignoring the autotuned choice -- for telling a tuning problem from a kernel problem
        index = 0 if self.heuristic_conv_plans else self.engine.conv_plans.get(signature(op), 0)
        remaining = self._convs.run(op, resolve, stream, index, bias_only)
        if self._convs.workspace_generation != before:  # a new workspace: graphs captured the old one
            self.forget_graphs()
        return remaining

    def _sdpa(self, op: SdpaLaunch, resolve, stream: int) -> bool:
        """Run ``op``'s attention through cuDNN's SDPA; False when cuDNN declines it (the caller launches the flash
        kernel)."""
        if self._attentions is None:
            from engine_core.backends.cuda.cudnn_attention import CudnnAttentions

            self._attentions = CudnnAttentions()
        before = self._attentions.workspace_generation
        ran = self._attentions.run(op, resolve, stream)
        if self._attentions.workspace_generation != before:  # a new workspace: graphs captured the old one
            self.forget_graphs()
        return ran

    def _host(self, op: Host, binding: _Binding, resolve, stream: int) -> None:
        from cuda.bindings import driver

        node, infos = op.node, binding.lowered.infos
        check(driver.cuStreamSynchronize(stream), "cuStreamSynchronize")

        def fetch(name: str) -> np.ndarray:
            if name in self.engine.plan.graph.constants:
                return self.engine.plan.graph.constants[name]
            if infos.get(name) is not None and infos[name].value is not None:
                return infos[name].value
            info = infos[name]
            out = np.empty(info.shape, info.dtype)
            if out.nbytes:
                check(driver.cuMemcpyDtoH(out.ctypes.data, resolve(Ref(name)), out.nbytes), "cuMemcpyDtoH")
            return out

        args = [fetch(name) if name else None for name in node.inputs]
        try:
            if has_subgraph(node):  # bodies read enclosing tensors: hand them over as the scope
                scope = {name: fetch(name) for name in subgraph_reads(node) if name in binding.lowered.locations
                         or name in self.engine.plan.graph.constants or name in infos}
                results = run_scoped(node, args, scope)
            else:
                results = run_node(node, args)
        except Exception as e:
            raise ExecutionError(f"layer {node} (host fallback) failed: {type(e).__name__}: {e}") from e
        for name, value in zip(node.outputs, results):
            if not name:
                continue
            if value is None or isinstance(value, (list, tuple, dict)):
                raise HostValueNotTensor(f"layer {node} (host) produces a non-tensor value")
            info = infos[name]
            value = np.ascontiguousarray(np.asarray(value, dtype=info.dtype))
            if value.shape != tuple(info.shape) and value.size == int(np.prod(info.shape, dtype=np.int64)):
                value = value.reshape(info.shape)  # e.g. a (1,) result where inference says scalar
            if value.shape != tuple(info.shape):
                raise ExecutionError(f"layer {node}: host output '{name}' has shape {value.shape}, "
                                     f"shape inference said {info.shape}")
            if value.nbytes:
                check(driver.cuMemcpyHtoD(resolve(Ref(name)), value.ctypes.data, value.nbytes), "cuMemcpyHtoD")
