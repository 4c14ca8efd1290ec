"""Convolutions (with fused bias, residual add and ReLU) through the cuDNN frontend graph API.

Why cuDNN: its runtime-fusion engines are the state of the art for convolutions on tensor cores, and
one cuDNN graph runs conv + bias + residual + activation as one kernel (the epilogue fusions of the
reference's fusion list). The frontend (``nvidia-cudnn-frontend``, in the ``gpu`` extra) is optional:
without it convolutions run on the host, visibly.

Graphs are built per distinct ``Conv.key()`` (shapes, layouts, dtype, epilogue) and cached per
execution context together with a workspace; executing passes raw device pointers, so captured CUDA
graphs replay them.

Handle, workspace, stream and release at exit: ``cudnn_graph.CudnnGraphs``.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

import numpy as np

from engine_core.backends.cuda import cudnn_plan_cache as plan_cache
from engine_core.backends.cuda.cudnn_graph import CudnnGraphs, plan_graph
from engine_core.backends.cuda.lowering import Conv, Ref
from engine_core.backends.cuda.tactics import time_first_runnable
from engine_core.cuda.driver import CudaError, DeviceBuffer

log = logging.getLogger("kiln.cudnn")


@cache
def available() -> bool:
    """True when the cuDNN frontend imports (and so libcudnn loads)."""
    try:
        import cudnn

        cudnn.backend_version()
        return True
    except Exception:
        return False


def _data_type(cudnn: Any, dtype_name: str) -> Any:
    types = {"float32": cudnn.data_type.FLOAT, "float16": cudnn.data_type.HALF, "bfloat16": cudnn.data_type.BFLOAT16,
             "int8": cudnn.data_type.INT8}
    if dtype_name not in types:
        raise CudaError(f"cuDNN convolution over {dtype_name}")
    return types[dtype_name]


#: execution plans the build times per convolution (those that build, in heuristics order)
AUTOTUNE_PLANS = 4
#: strict fp32: cuDNN's heuristics rank its FFMA engines (implicit / precomputed GEMM, Winograd, FFT) less
#: reliably than its tensor-core ones, and their speeds differ several-fold by shape, so more of them are timed.
#: Timing 32 or 64 plans with 8 GiB of workspace allowed gave the same ResNet-50 batch-128 time on an H100 (30.1 ms,
#: ~52% of FP32 FFMA peak; TF32 7.4 ms): beyond this, faster strict fp32 needs another kernel family (e.g. 3xTF32
#: split-precision GEMMs on tensor cores), not more cuDNN plans.
STRICT_FP32_AUTOTUNE_PLANS = 8
#: a plan asking for more workspace is passed over (FFT engines can ask for gigabytes at large batches: memory the
#: plan's device_memory_size does not count)
MAX_WORKSPACE_BYTES = 1 << 30


def strict_fp32(op: Conv) -> bool:
    """An fp32 convolution without TF32: cuDNN's tensor-core engines are deselected (they would round to TF32)."""
    return op.dtype.name == "float32" and not op.tf32


def autotune_plans(op: Conv) -> int:
    """How many buildable execution plans the build times for ``op``."""
    return STRICT_FP32_AUTOTUNE_PLANS if strict_fp32(op) else AUTOTUNE_PLANS


class _Built:
    """A graph with one plan built: ``index`` in the graph's own plan list, ``ranked`` the heuristics rank it has
    (the same for a graph the heuristics planned; a remembered plan is its graph's only one)."""

    def __init__(self, graph: Any, tensors: dict[str, Any], index: int, workspace: int, ranked: int) -> None:
        self.graph, self.tensors, self.index, self.workspace, self.ranked = graph, tensors, index, workspace, ranked


def signature(op: Conv) -> str:
    """A stable text key of a convolution's cuDNN graph (for the plan's and the timing cache's choices)."""
    return "conv|" + "|".join(str(part) for part in op.key())


class CudnnConvs(CudnnGraphs):
    """The convolution graphs one context's cuDNN handle has built."""

    def __init__(self) -> None:
        super().__init__()
        self._built: dict[tuple, _Built] = {}
        #: fused graphs cuDNN has no engine for: their bare convolution runs, the caller adds the epilogue
        self._unfusable: set[tuple] = set()
        self._fusable: set[tuple] = set()
        #: graphs ``fusable`` described to decide, kept for the ``build`` that follows (describing one asks cuDNN's
        #: heuristics and checks every plan's support: most of a binding's time on convolution networks)
        self._described: dict[tuple, tuple[Any, dict[str, Any]]] = {}

    def close(self) -> None:
        """Drop every cuDNN graph (and its tensors) built here. Safe while in use: a later run builds again; the
        handle and workspace stay (a run on another thread may still hold them)."""
        self._built.clear()
        self._fusable.clear()
        self._unfusable.clear()
        self._described.clear()

    def _graph(self, op: Conv, heuristics: bool = True) -> tuple[Any, dict[str, Any]]:
        """The validated cuDNN graph of ``op`` with its execution plans created (not built); without ``heuristics``
        with none (a remembered plan is added)."""
        if op.int8:
            return self._int8_graph(op, heuristics)
        cudnn = self.cudnn
        io = _data_type(cudnn, op.dtype.name)
        f32 = cudnn.data_type.FLOAT
        graph = cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=self.handle)
        x = graph.tensor(name="X", dim=list(op.x_dims), stride=list(op.x_strides), data_type=io)
        w = graph.tensor(name="W", dim=list(op.w_dims), stride=list(op.w_strides), data_type=io)
        tensors = {"x": x, "w": w}
        y = graph.conv_fprop(image=x, weight=w, pre_padding=list(op.pads_begin), post_padding=list(op.pads_end),
                             stride=list(op.strides), dilation=list(op.dilations), compute_data_type=f32, name="conv")
        channels = op.y_dims[1]
        if op.b is not None:
            tensors["b"] = graph.tensor(name="B", dim=[1, channels, 1, 1], stride=[channels, 1, channels, channels],
                                        data_type=io)
            y = graph.bias(input=y, bias=tensors["b"], name="bias")
        if op.z is not None:
            tensors["z"] = graph.tensor(name="Z", dim=list(op.y_dims), stride=list(op.z_strides), data_type=io)
            y = graph.add(a=y, b=tensors["z"], name="residual")
        if op.activation == "Relu":
            y = graph.relu(input=y, name="relu")
        y.set_output(True).set_dim(list(op.y_dims)).set_stride(list(op.y_strides)).set_data_type(io)
        tensors["y"] = y
        plan_graph(cudnn, graph, check=False, heuristics=heuristics)
        if not heuristics:
            return graph, tensors
        if strict_fp32(op):  # exact fp32: no TF32 (tensor-core) or down-converting engines, as PyTorch filters them
            notes = cudnn.numerical_note
            graph.deselect_numeric_notes([notes.TENSOR_CORE, notes.DOWN_CONVERT_INPUTS,
                                          notes.REDUCED_PRECISION_REDUCTION])
        graph.check_support()
        return graph, tensors

    def _int8_graph(self, op: Conv, heuristics: bool = True) -> tuple[Any, dict[str, Any]]:
        """An INT8 convolution with its requantizing epilogue as one graph: int8 x and w, INT32 sums, then in
        float32 ``* scale[k] + b[k] (+ z * z_scale[k])``, ReLU, written as ``y_dtype`` (int8: rounded to
        nearest even and saturated by cuDNN's conversion). Why one graph: the INT32 sums never reach memory,
        and cuDNN's runtime-fusion engines run it as one kernel (bench/cudnn_int8.py checks the rounding)."""
        cudnn = self.cudnn
        i8, f32 = cudnn.data_type.INT8, cudnn.data_type.FLOAT
        graph = cudnn.pygraph(io_data_type=i8, intermediate_data_type=f32, compute_data_type=f32, handle=self.handle)
        channels = op.y_dims[1]
        vector = {"dim": [1, channels, 1, 1], "stride": [channels, 1, channels, channels], "data_type": f32}
        tensors = {"x": graph.tensor(name="X", dim=list(op.x_dims), stride=list(op.x_strides), data_type=i8),
                   "w": graph.tensor(name="W", dim=list(op.w_dims), stride=list(op.w_strides), data_type=i8),
                   "scale": graph.tensor(name="scale", **vector)}
        y = graph.conv_fprop(image=tensors["x"], weight=tensors["w"], pre_padding=list(op.pads_begin),
                             post_padding=list(op.pads_end), stride=list(op.strides), dilation=list(op.dilations),
                             compute_data_type=cudnn.data_type.INT32, name="conv")
        y.set_data_type(f32)
        y = graph.mul(a=y, b=tensors["scale"], compute_data_type=f32, name="scale")
        if op.b is not None:
            tensors["b"] = graph.tensor(name="B", **vector)
            y = graph.add(a=y, b=tensors["b"], compute_data_type=f32, name="bias")
        if op.z is not None:
            tensors["z"] = graph.tensor(name="Z", dim=list(op.y_dims), stride=list(op.z_strides),
                                        data_type=_data_type(cudnn, np.dtype(op.z_dtype).name))
            tensors["z_scale"] = graph.tensor(name="z_scale", **vector)
            z = graph.mul(a=tensors["z"], b=tensors["z_scale"], compute_data_type=f32, name="z_scale")
            y = graph.add(a=y, b=z, compute_data_type=f32, name="residual")
        if op.activation == "Relu":
            y = graph.relu(input=y, compute_data_type=f32, name="relu")
        y.set_output(True).set_dim(list(op.y_dims)).set_stride(list(op.y_strides))
        y.set_data_type(_data_type(cudnn, np.dtype(op.y_dtype).name))
        tensors["y"] = y
        plan_graph(cudnn, graph, heuristics=heuristics)
        return graph, tensors

    def build(self, op: Conv, index: int = 0) -> _Built:
        """``op``'s graph with execution plan ``index`` (heuristics order) built; the first plan that
        builds when ``index`` does not. A plan built before for this graph and index (in any process:
        cudnn_plan_cache.py) is built again without asking the heuristics."""
        key = (op.key(), index)
        built = self._built.get(key)
        if built is not None:
            return built
        built = self._build_remembered(op, index) or self._build_ranked(op, index)
        self._built[key] = built
        if built.workspace:
            self._grow_workspace(built.workspace, 32 << 20)
        return built

    def _build_ranked(self, op: Conv, index: int) -> _Built:
        """Ask the heuristics for the ranked plans and build ``index`` (or the first that builds); remember it."""
        described = self._described.pop(op.key(), None)
        graph, tensors = described if described is not None else self._graph(op)
        count = int(graph.get_execution_plan_count())
        for candidate in dict.fromkeys([index, *range(count)]):
            if candidate >= count:
                continue
            try:
                graph.build_plan_at_index(candidate)
                workspace = int(graph.get_workspace_size_plan_at_index(candidate))
            except Exception:
                continue
            if workspace > MAX_WORKSPACE_BYTES:
                continue
            self._remember(op, index, graph, candidate)
            return _Built(graph, tensors, candidate, workspace, candidate)
        raise CudaError(f"cuDNN has no buildable plan for convolution {signature(op)}")

    def _build_remembered(self, op: Conv, index: int) -> _Built | None:
        """The remembered plan of ``op`` at ``index`` built on a graph without heuristics, or None (none remembered,
        or it no longer builds: then it is kept as "ask the heuristics", cudnn_plan_cache.PlanChoices.refuse)."""
        choices = plan_cache.choices(self.cudnn)
        remembered = choices.get(signature(op), index) if choices is not None else None
        if remembered is None:
            return None
        engine_id, knobs, ranked = remembered
        try:
            graph, tensors = self._graph(op, heuristics=False)
            graph.create_execution_plan(engine_id, {self.cudnn.knob_type(k): v for k, v in knobs.items()})
            if hasattr(graph, "_cpp_plans_created"):  # frontend 1.32's pygraph asks the heuristics before any
                graph._cpp_plans_created = True  # build (~9 ms a graph, for plans nobody uses here): it has its plan
            built = int(graph.get_execution_plan_count()) - 1
            graph.build_plan_at_index(built)
            workspace = int(graph.get_workspace_size_plan_at_index(built))
        except Exception as e:  # noqa: BLE001 - a stale hint: the heuristics decide, now and from now on
            # seen for ResNet-50's stem (7x7, 3 channels) on cuDNN 9.19: one of its knobs does not convert back
            # ("convert_to_backend_knob_type ... CUDNN_STATUS_INVALID_VALUE")
            log.debug("a remembered cuDNN plan of %s did not build (%s); asking the heuristics", signature(op), e)
            assert choices is not None
            choices.refuse(signature(op), index)
            return None
        return _Built(graph, tensors, built, workspace, ranked) if workspace <= MAX_WORKSPACE_BYTES else None

    def _remember(self, op: Conv, index: int, graph: Any, built: int) -> None:
        choices = plan_cache.choices(self.cudnn)
        if choices is None:
            return
        try:
            engine_id, knobs = graph.get_engine_and_knobs_at_index(built)
            choices.put(signature(op), index, int(engine_id), dict(knobs or {}), built)
        except Exception as e:  # noqa: BLE001 - an engine the frontend cannot name (e.g. a delegating entry)
            log.debug("cuDNN plan of %s not remembered: %s", signature(op), e)

    def fusable(self, op: Conv) -> Conv:
        """``op`` itself, or its bare convolution when cuDNN has no engine for the fused graph (remembered)."""
        key = op.key()
        if key in self._unfusable:
            return op.bare()
        if op.int8 or key in self._fusable or (op.b is None and op.z is None and not op.activation):
            return op  # an INT8 graph has no bare form: its requantization is the layer (the build checked it)
        choices = plan_cache.choices(self.cudnn)
        if choices is not None and choices.known(signature(op)):  # it built before: no need to ask
            self._fusable.add(key)
            return op
        try:  # decided once, in the first (eager) run: nothing cuDNN does here may land in a CUDA-graph capture
            self._described[key] = self._graph(op)
            self._fusable.add(key)
            return op
        except Exception:  # cuDNN: no engine supports this epilogue here (e.g. exact fp32, odd channel counts)
            self._unfusable.add(key)
            return op.bare()

    def run(self, op: Conv, resolve: Any, stream: int, index: int = 0, bias_only: bool = False) -> str:
        """Execute ``op`` on ``stream`` with plan ``index`` (``resolve(Ref) -> device pointer``). Returns what
        the caller must still run: "" (cuDNN did it all), "rest" (``op.rest``: residual and activation, with
        ``bias_only``) or "fallback" (``op.fallback``: cuDNN has no engine for the fused graph, only the bare
        convolution ran)."""
        wanted = op.bias_only() if bias_only and op.rest else op
        target = self.fusable(wanted)
        try:
            built = self.build(target, index)
        except CudaError:
            if target is wanted and target.bare().key() != wanted.key():
                self._unfusable.add(wanted.key())
                target = op.bare()
                built = self.build(target, index)
            else:
                raise
        self._use_stream(stream)
        pack = {built.tensors["x"]: resolve(target.x), built.tensors["w"]: resolve(target.w),
                built.tensors["y"]: resolve(target.y)}
        for name, ref in (("b", target.b), ("z", target.z), ("scale", target.scale), ("z_scale", target.z_scale)):
            if isinstance(ref, Ref):
                pack[built.tensors[name]] = resolve(ref)
        workspace = self._workspace.ptr if self._workspace is not None and built.workspace else None
        built.graph.execute_plan_at_index(pack, workspace, built.index, handle=self.handle)
        if target is wanted:
            return "rest" if wanted is not op else ""
        return "fallback"

    def autotune(self, op: Conv, candidates: int | None = None, repeats: int = 5) -> tuple[int, dict[int, float]]:
        """Time the first ``candidates`` execution plans (default ``autotune_plans(op)``) that build at their own
        index, on scratch buffers: (fastest index, ms by index). Deselected plans (strict fp32's tensor-core ones)
        do not count, so strict fp32 times its FFMA engines instead of nothing."""
        from cuda.bindings import driver

        from engine_core.cuda.driver import check

        size = op.dtype.itemsize
        vector = 4 if op.int8 else size  # an INT8 graph's scales and bias are float32
        buffers = {name: _scratch(dims, strides, itemsize) for name, dims, strides, itemsize in (
            ("x", op.x_dims, op.x_strides, size), ("w", op.w_dims, op.w_strides, size),
            ("y", op.y_dims, op.y_strides, np.dtype(op.y_dtype or op.dtype).itemsize),
            ("b", (op.y_dims[1],), (1,), vector), ("scale", (op.y_dims[1],), (1,), 4),
            ("z_scale", (op.y_dims[1],), (1,), 4),
            ("z", op.y_dims, op.z_strides or op.y_strides, np.dtype(op.z_dtype or op.dtype).itemsize))}
        refs = {Ref(name): buf.ptr for name, buf in buffers.items()}
        timed = Conv(**{**op.__dict__, **{name: Ref(name) if getattr(op, name) is not None else None
                                          for name in ("x", "w", "y", "b", "z", "scale", "z_scale")}})
        stream = int(check(driver.cuStreamCreate(0), "cuStreamCreate"))
        limit = candidates or autotune_plans(op)
        op = self.fusable(op)
        timed = timed if op.key() == timed.key() else timed.bare()
        graph, _ = self._described.get(op.key()) or self._graph(op)  # the graph fusable() described, if it did

        def time_plan(index: int) -> float:
            self.run(timed, refs.__getitem__, stream, index)
            if self._built[(op.key(), index)].ranked != index:
                raise CudaError(f"plan {index} does not build")  # deselected or unsupported: another one ran
            start = check(driver.cuEventCreate(0), "cuEventCreate")
            stop = check(driver.cuEventCreate(0), "cuEventCreate")
            try:
                check(driver.cuEventRecord(start, stream), "cuEventRecord")
                for _ in range(repeats):
                    self.run(timed, refs.__getitem__, stream, index)
                check(driver.cuEventRecord(stop, stream), "cuEventRecord")
                check(driver.cuEventSynchronize(stop), "cuEventSynchronize")
                return float(check(driver.cuEventElapsedTime(start, stop), "time")) / repeats
            finally:
                driver.cuEventDestroy(start)
                driver.cuEventDestroy(stop)

        times = time_first_runnable(range(int(graph.get_execution_plan_count())), time_plan, limit)
        check(driver.cuStreamSynchronize(stream), "cuStreamSynchronize")
        driver.cuStreamDestroy(stream)
        self._stream = None
        if not times:
            return 0, {}
        return min(times, key=times.__getitem__), times


@cache
def int8_unsupported() -> str:
    """Why cuDNN cannot run INT8 convolutions here ("" when it can): a small requantizing NHWC graph (bias, int8
    residual, ReLU) must have a buildable plan. The builder lowers ``kiln.QConv`` to cuDNN only when it can and
    records the reason in the plan (``build_info.cuda.cudnn_int8_unsupported``)."""
    if not available():
        return "no cuDNN frontend (pip install kiln[gpu])"
    i8 = np.dtype(np.int8)
    dims, w_dims = (2, 8, 6, 6), (8, 8, 3, 3)
    strides = (6 * 6 * 8, 1, 6 * 8, 8)
    op = Conv(Ref("x"), Ref("w"), Ref("y"), Ref("b"), Ref("z"), dims, w_dims, dims, strides, (72, 1, 24, 8), strides,
              strides, (1, 1), (1, 1), (1, 1), (1, 1), i8, "Relu", scale=Ref("scale"), z_scale=Ref("z_scale"),
              z_dtype=i8, y_dtype=i8)
    return "; ".join(unbuildable_convs([op]))


def unbuildable_convs(ops: list) -> list[str]:
    """Why cuDNN cannot build each INT8 convolution among ``ops`` on this GPU (checked at build time, so a plan
    never holds an INT8 graph that cannot run; float convolutions fall back at run time to their bare form)."""
    convs, missing = None, []
    for op in ops:
        if not isinstance(op, Conv) or not op.int8:
            continue
        try:
            convs = convs or CudnnConvs()
            convs.build(op)
        except Exception as e:  # no engine for this graph (CudaError), or cuDNN itself failed
            missing.append(f"{type(e).__name__}: {e}"[:400])
    return missing


def _scratch(dims: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> DeviceBuffer:
    """Zeroed device memory covering a tensor of ``dims`` laid out with ``strides``."""
    from cuda.bindings import driver

    from engine_core.cuda.driver import check

    span = 1 + sum((d - 1) * s for d, s in zip(dims, strides))
    buf = DeviceBuffer(max(span * itemsize, 256))
    check(driver.cuMemsetD8(buf.ptr, 0, buf.nbytes), "cuMemsetD8")
    return buf
