"""The CUDA runner: lowered steps -> kernel launches, cuBLAS calls and copies on one stream.

``CudaEngineState`` holds what all contexts of an engine share (loaded CUBINs, weights uploaded
once); ``CudaContextState`` holds one context's arena and its per-input-shape bindings (lowering,
folded shape values on the device, prepared kernel parameter blocks).
"""

from __future__ import annotations

import ctypes
import os
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from engine_core.backends.cpu import GraphRunner, run_node, run_scoped
from engine_core.backends.cuda.lowering import (
    Conv,
    Copy,
    Gemm,
    Host,
    Launch,
    Lowered,
    LoweringOptions,
    Ref,
    lower_graph,
    transform_weight,
)
from engine_core.backends.cuda.pointwise import Unsupported
from engine_core.cuda.driver import DeviceBuffer, Module, check, primary_context
from engine_core.errors import ExecutionError
from engine_core.ir.graph import has_subgraph, subgraph_reads
from engine_core.logger import DEFAULT_LOGGER, Severity
from engine_core.ops import TensorInfo
from engine_core.passes import infer_shapes
from engine_core.plan import Plan

Shapes = Mapping[str, tuple[int, ...]]
#: captured graphs kept per input-shape binding (one per distinct set of I/O addresses)
MAX_GRAPHS_PER_SHAPE = 4
#: integer inputs up to this many elements may key a binding when shapes depend on their values
MAX_SHAPE_VALUES = 4096


class UserMemory:
    """Caller-owned device memory used as a context's arena (not freed by Kiln)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr, self.nbytes = ptr, nbytes


class ShapesNeedValues(ExecutionError):
    """Some tensor shapes depend on input values the binding was not given."""


class CudaEngineState:
    """Per engine: modules from the plan's CUBINs and the weights, on the device once."""

    def __init__(self, plan: Plan) -> None:
        primary_context()
        self.plan = plan
        self.modules = {name: Module(cubin) for name, cubin in plan.kernels.items()}
        self._functions: dict[tuple[str, str], Any] = {}
        self.weights = {name: DeviceBuffer.from_array(np.ascontiguousarray(value))
                        for name, value in plan.graph.constants.items()
                        if isinstance(value, np.ndarray) and value.dtype.kind not in "OSU"}
        self.gemm_choice = {layer["name"]: layer["tactic"].split(":", 1)[1] for layer in plan.layers
                            if str(layer.get("tactic", "")).startswith("gemm:")}
        self.options = lowering_options(plan)
        #: cuDNN execution plan chosen at build time per convolution signature (heuristics' first otherwise)
        self.conv_plans: dict[str, int] = dict(plan.build_info.get("cuda", {}).get("conv_plans", {}))
        if self.options.cudnn:
            from engine_core.backends.cuda.cudnn_conv import available

            if not available():
                raise ExecutionError("this plan runs convolutions with cuDNN, but the cuDNN frontend is not "
                                     "installed here (pip install kiln[gpu])")
        self.contexts: weakref.WeakSet[CudaContextState] = weakref.WeakSet()

    def function(self, module: str, name: str) -> Any:
        key = (module, name)
        if key not in self._functions:
            self._functions[key] = self.modules[module].function(name)
        return self._functions[key]

    def ensure_pointwise(self, kernels: list) -> None:
        """Make every generated kernel of a binding launchable: one the build did not compile (shapes
        that were only known at run time, e.g. from input values) is compiled by NVRTC now."""
        missing = []
        for kernel in kernels:
            try:
                self.function("pointwise", kernel.name)
            except Exception:
                missing.append(kernel)
        if not missing:
            return
        from engine_core.backends.cuda.pointwise import pointwise_source
        from engine_core.cuda.nvrtc import compile_cubin

        module = Module(compile_cubin(pointwise_source(missing), "pointwise_runtime.cu", self.plan.arch))
        self.modules[f"pointwise#{len(self.modules)}"] = module
        for kernel in missing:
            self._functions[("pointwise", kernel.name)] = module.function(kernel.name)

    def derived_weight(self, name: str, source: str, transform: str) -> DeviceBuffer:
        """A weight in another layout (e.g. KRSC filters), made on the device once per engine."""
        if name not in self.weights:
            self.weights[name] = DeviceBuffer.from_array(transform_weight(self.plan.graph.constants[source], transform))
        return self.weights[name]

    def create_context(self) -> CudaContextState:
        state = CudaContextState(self)
        self.contexts.add(state)
        return state

    def refit(self, weights: Mapping[str, np.ndarray]) -> None:
        """Overwrite device weights in place (captured CUDA graphs keep their addresses) and drop
        per-shape bindings, whose host-folded values may have read the old weights."""
        for name, value in weights.items():
            if name in self.weights:
                self.weights[name].copy_from(np.ascontiguousarray(value))
            for derived in [d for d in self.weights if d.startswith(f"{name}#")]:
                transform = derived.split("#", 1)[1]
                self.weights[derived].copy_from(transform_weight(np.asarray(value), transform))
        for ctx in self.contexts:
            ctx._bindings.clear()


class _PreparedLaunch:
    """A launch whose parameter block is built once; only pointer slots change between runs."""

    def __init__(self, launch: Launch, function: Any) -> None:
        self.launch = launch
        self.function = function
        self.objects: list[Any] = []
        self.refs: list[tuple[ctypes.c_void_p, Ref]] = []
        for value, ctype in launch.args:
            if isinstance(value, Ref):
                obj = ctypes.c_void_p(0)
                self.refs.append((obj, value))
            elif isinstance(value, ctypes.Structure):
                obj = value
            else:
                obj = ctype(value)
            self.objects.append(obj)
        self.params = (ctypes.c_void_p * len(self.objects))(*[ctypes.addressof(o) for o in self.objects])

    def run(self, resolve, stream: int) -> None:
        from cuda.bindings import driver

        for obj, ref in self.refs:
            obj.value = resolve(ref)
        grid, block = self.launch.grid, self.launch.block
        check(driver.cuLaunchKernel(self.function, *grid, *block, 0, stream, ctypes.addressof(self.params), 0),
              f"launch {self.launch.function}")


class _Binding:
    """Everything one set of input shapes needs: lowering, folded values, prepared launches."""

    def __init__(self, state: CudaEngineState, lowered: Lowered) -> None:
        self.lowered = lowered
        for name, (source, transform) in lowered.weight_transforms.items():
            state.derived_weight(name, source, transform)
        self.folded = {name: DeviceBuffer.from_array(v) for name, v in lowered.folded.items()}
        state.ensure_pointwise(lowered.kernels)
        self.prepared: dict[int, _PreparedLaunch] = {}
        for step in lowered.steps:
            for op in step.ops:
                if isinstance(op, Launch):
                    self.prepared[id(op)] = _PreparedLaunch(op, state.function(op.module, op.function))
        self.io_buffers: dict[str, DeviceBuffer] = {}
        self.has_host = any(isinstance(op, Host) for step in lowered.steps for op in step.ops)
        self.graphs: dict[tuple, _Graph] = {}
        self.graph_failed = False
        self.runs = 0


class _Graph:
    """An instantiated CUDA graph (and the graph it came from), destroyed with the object."""

    def __init__(self, graph: Any, exec_: Any) -> None:
        self.graph, self.exec = graph, exec_

    def __del__(self) -> None:
        try:
            from cuda.bindings import driver

            driver.cuGraphExecDestroy(self.exec)
            driver.cuGraphDestroy(self.graph)
        except Exception:
            pass


class CudaContextState:
    """Per execution context: the activation arena and bindings by input shapes."""

    def __init__(self, engine: CudaEngineState) -> None:
        self.engine = engine
        self.arena: DeviceBuffer | None = None
        self._bindings: dict[tuple, _Binding] = {}
        self._user_memory = False
        self._cublas = None
        self._cublaslt = None
        self._convs = None
        self._host_runner: GraphRunner | None = None
        #: why runs went to the host as a whole (data-dependent output shapes, non-tensor I/O)
        self.host_fallback: list[str] = []
        self._stream: int | None = None
        self.use_graphs = os.environ.get("KILN_CUDA_GRAPHS", "1") != "0"

    # -- binding ----------------------------------------------------------------------------------
    def bind(self, shapes: Shapes, values: Mapping[str, np.ndarray] | None = None) -> _Binding:
        """The binding for these input shapes (lowered, arena sized), made on first use.

        ``values``: host values of small integer inputs, for graphs whose shapes depend on input values
        (shape-tensor style inputs such as Reshape's shape or Squeeze's axes fed at run time); the
        binding is then keyed on those values too. Without them such graphs raise ExecutionError.
        """
        key = tuple(sorted((k, tuple(v)) for k, v in shapes.items()))
        if values:
            key += tuple(sorted((k, v.dtype.str, tuple(v.shape), v.tobytes()) for k, v in values.items()))
        binding = self._bindings.get(key)
        if binding is None:
            graph = self.engine.plan.graph
            infos = {v.name: TensorInfo(v.dtype, tuple(shapes[v.name]) if v.is_tensor else None,
                                        (values or {}).get(v.name)) for v in graph.inputs}
            inferred = infer_shapes(graph, infos, values=True)
            unknown = [o for o in graph.output_names if inferred.get(o) is None or inferred[o].shape is None]
            try:
                if unknown:
                    raise Unsupported(f"output shapes of {unknown} depend on input values")
                lowered = lower_graph(graph, inferred, self.engine.gemm_choice, self.engine.options)
            except Unsupported as e:
                raise ShapesNeedValues(f"{e}: the CUDA backend needs every tensor shape before launching "
                                       "(feed such inputs through infer(), or declare them shape inputs)") from None
            need = max(lowered.memory.size, self.engine.plan.device_memory_size, 1)
            if self.arena is not None and self.arena.nbytes < lowered.memory.size and self._user_memory:
                raise ExecutionError(f"the device memory given to this context ({self.arena.nbytes} bytes) is "
                                     f"smaller than these shapes need ({lowered.memory.size} bytes)")
            if self.arena is None or self.arena.nbytes < lowered.memory.size:
                self.arena = DeviceBuffer(need)
                for other in self._bindings.values():  # graphs captured the old arena's addresses
                    other.graphs.clear()
            binding = self._bindings[key] = _Binding(self.engine, lowered)
        return binding

    def use_memory(self, ptr: int, size: int) -> None:
        """Activations live in caller-owned device memory from now on (USER_MANAGED strategy)."""
        self.arena = UserMemory(ptr, size)
        self._user_memory = True
        for binding in self._bindings.values():  # graphs captured the old arena's addresses
            binding.graphs.clear()

    def _resolver(self, binding: _Binding, addresses: Mapping[str, int]):
        locations, weights, folded = binding.lowered.locations, self.engine.weights, binding.folded
        base = self.arena.ptr if self.arena is not None else 0

        def resolve(ref: Ref) -> int:
            kind, key = locations[ref.tensor]
            if kind == "arena":
                return base + key + ref.offset
            if kind == "io":
                if key not in addresses:
                    raise ExecutionError(f"no device address set for '{key}'")
                return addresses[key] + ref.offset
            if kind == "weight":
                return weights[key].ptr + ref.offset
            return folded[key].ptr + ref.offset

        return resolve

    # -- running ----------------------------------------------------------------------------------
    def execute(self, shapes: Shapes, addresses: Mapping[str, int], stream: int, profiler: Any = None,
                values: Mapping[str, np.ndarray] | None = None) -> None:
        """Launch every step on ``stream``; host syncs happen only around host-fallback layers.

        Why CUDA graphs: a layer costs ~10 us of Python to launch, more than most kernels run. The
        second run with the same shapes and I/O addresses on a non-default stream is captured into a
        graph; later runs with those addresses replay it with one launch. Plans with host-fallback
        layers (they synchronize) and KILN_CUDA_GRAPHS=0 always launch layer by layer; with a
        ``profiler`` (IProfiler) each layer is timed with CUDA events and reported after the run.
        """
        binding = self.bind(shapes, values)
        if profiler is not None:
            self._launch_profiled(binding, addresses, stream, profiler)
            return
        if not self.use_graphs or stream == 0 or binding.has_host or binding.graph_failed:
            self._launch_all(binding, addresses, stream)
            return
        key = tuple(sorted(addresses.items()))
        graph = binding.graphs.get(key)
        if graph is None:
            binding.runs += 1
            if binding.runs < 2:  # first run eagerly: library initialisation must not be captured
                self._launch_all(binding, addresses, stream)
                return
            graph = self._capture(binding, addresses, stream)
            if graph is None:
                return
            if len(binding.graphs) >= MAX_GRAPHS_PER_SHAPE:
                binding.graphs.pop(next(iter(binding.graphs)))
            binding.graphs[key] = graph
        from cuda.bindings import driver

        check(driver.cuGraphLaunch(graph.exec, stream), "cuGraphLaunch")

    def _capture(self, binding: _Binding, addresses: Mapping[str, int], stream: int) -> _Graph | None:
        """Capture one run into an instantiated graph; on failure, run eagerly and stop trying."""
        from cuda.bindings import driver

        mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        check(driver.cuStreamBeginCapture(stream, mode), "cuStreamBeginCapture")
        try:
            self._launch_all(binding, addresses, stream)
        except Exception:
            driver.cuStreamEndCapture(stream)
            binding.graph_failed = True
            raise
        graph = check(driver.cuStreamEndCapture(stream), "cuStreamEndCapture")
        try:
            return _Graph(graph, check(driver.cuGraphInstantiate(graph, 0), "cuGraphInstantiate"))
        except Exception:
            binding.graph_failed = True
            self._launch_all(binding, addresses, stream)
            return None

    def _launch_profiled(self, binding: _Binding, addresses: Mapping[str, int], stream: int, profiler: Any) -> None:
        from cuda.bindings import driver

        events = [check(driver.cuEventCreate(0), "cuEventCreate") for _ in range(len(binding.lowered.steps) + 1)]
        check(driver.cuEventRecord(events[0], stream), "cuEventRecord")
        self._launch_all(binding, addresses, stream, events[1:])
        check(driver.cuEventSynchronize(events[-1]), "cuEventSynchronize")
        for step, start, stop in zip(binding.lowered.steps, events, events[1:]):
            profiler.report_layer_time(step.node.name, float(check(driver.cuEventElapsedTime(start, stop), "time")))
        for event in events:
            driver.cuEventDestroy(event)

    def _launch_all(self, binding: _Binding, addresses: Mapping[str, int], stream: int,
                    after_step: list | None = None) -> None:
        from cuda.bindings import driver

        resolve = self._resolver(binding, addresses)
        for index, step in enumerate(binding.lowered.steps):
            if after_step is not None and index:
                check(driver.cuEventRecord(after_step[index - 1], stream), "cuEventRecord")
            for op in step.ops:
                if isinstance(op, Launch):
                    binding.prepared[id(op)].run(resolve, stream)
                elif isinstance(op, Gemm):
                    self._gemm(op, resolve, stream)
                elif isinstance(op, Conv):
                    self._conv(op, resolve, stream)
                elif isinstance(op, Copy):
                    _memcpy_dtod(resolve(op.dst), resolve(op.src), op.nbytes, stream)
                elif isinstance(op, Host):
                    self._host(op, binding, resolve, stream)
        if after_step:
            check(driver.cuEventRecord(after_step[-1], stream), "cuEventRecord")

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

    def _conv(self, op: Conv, resolve, stream: int) -> None:
        if self._convs is None:
            from engine_core.backends.cuda.cudnn_conv import CudnnConvs

            self._convs = CudnnConvs()
        from engine_core.backends.cuda.cudnn_conv import signature

        before = self._convs.workspace_generation
        self._convs.run(op, resolve, stream, self.engine.conv_plans.get(signature(op), 0))
        if self._convs.workspace_generation != before:  # a new workspace: graphs captured the old one
            for binding in self._bindings.values():
                binding.graphs.clear()

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
            info = infos[name]
            value = np.ascontiguousarray(np.asarray(value, dtype=info.dtype))
            if value.shape != tuple(info.shape) and value.size == int(np.prod(info.shape, dtype=np.int64)):
                value = value.reshape(info.shape)  # e.g. a (1,) result where inference says scalar
            if value.shape != tuple(info.shape):
                raise ExecutionError(f"layer {node}: host output '{name}' has shape {value.shape}, "
                                     f"shape inference said {info.shape}")
            if value.nbytes:
                check(driver.cuMemcpyHtoD(resolve(Ref(name)), value.ctypes.data, value.nbytes), "cuMemcpyHtoD")

    def _on_host(self, feeds: Mapping[str, np.ndarray], reason: str) -> dict[str, np.ndarray]:
        """The whole graph on the CPU backend, for runs the device path cannot plan ahead; logged once
        per reason and kept in ``host_fallback`` (the inspector's per-layer report covers planned runs)."""
        if reason not in self.host_fallback:
            self.host_fallback.append(reason)
            DEFAULT_LOGGER.log(Severity.WARNING, f"CUDA plan '{self.engine.plan.name}' runs on the host: {reason}")
        if self._host_runner is None:
            self._host_runner = GraphRunner(self.engine.plan.graph)
        return self._host_runner.run(feeds)

    def stream(self) -> int:
        if self._stream is None:
            from cuda.bindings import driver

            self._stream = int(check(driver.cuStreamCreate(0), "cuStreamCreate"))
        return self._stream

    def infer(self, feeds: Mapping[str, np.ndarray], profiler: Any = None) -> dict[str, np.ndarray]:
        """Host numpy in/out: inputs to device buffers, run on the context's stream, outputs back."""
        from cuda.bindings import driver

        shapes = {name: tuple(np.shape(value)) for name, value in feeds.items()}
        values = None
        graph = self.engine.plan.graph
        if not all(v.is_tensor for v in (*graph.inputs, *graph.outputs)):
            return self._on_host(feeds, "sequence/optional/map inputs or outputs")
        try:
            binding = self.bind(shapes)
        except ShapesNeedValues:
            values = {name: np.asarray(v) for name, v in feeds.items()
                      if np.asarray(v).dtype.kind in "iub" and np.asarray(v).size <= MAX_SHAPE_VALUES}
            try:
                binding = self.bind(shapes, values)
            except ShapesNeedValues as e:  # data-dependent output shapes (NonZero, NMS, Unique, ...)
                return self._on_host(feeds, str(e))
        stream = self.stream()
        graph, infos = self.engine.plan.graph, binding.lowered.infos
        arrays = {name: np.ascontiguousarray(value) for name, value in feeds.items()}
        outputs = {name: np.empty(infos[name].shape, infos[name].dtype) for name in graph.output_names}
        addresses = {}
        for name, array in (*arrays.items(), *outputs.items()):
            buf = binding.io_buffers.get(name)
            if buf is None or buf.nbytes < array.nbytes:
                buf = binding.io_buffers[name] = DeviceBuffer(array.nbytes)
            addresses[name] = buf.ptr
        for name, array in arrays.items():
            if array.nbytes:
                check(driver.cuMemcpyHtoDAsync(addresses[name], array.ctypes.data, array.nbytes, stream), "HtoD")
        self.execute(shapes, addresses, stream, profiler, values)
        for name, array in outputs.items():
            if array.nbytes:
                check(driver.cuMemcpyDtoHAsync(array.ctypes.data, addresses[name], array.nbytes, stream), "DtoH")
        check(driver.cuStreamSynchronize(stream), "cuStreamSynchronize")
        return outputs


def lowering_options(plan: Plan) -> LoweringOptions:
    """The lowering choices the build recorded (TF32, cuDNN convolutions): runs must lower identically."""
    recorded = plan.build_info.get("cuda", {}).get("lowering", {})
    return LoweringOptions(tf32=bool(recorded.get("tf32", False)), cudnn=bool(recorded.get("cudnn", False)),
                           cublaslt=bool(recorded.get("cublaslt", False)))


def _memcpy_dtod(dst: int, src: int, nbytes: int, stream: int) -> None:
    from cuda.bindings import driver

    if nbytes:
        check(driver.cuMemcpyDtoDAsync(dst, src, nbytes, stream), "cuMemcpyDtoDAsync")


def run_kiln_gemm(function: Any, op: Gemm, a: int, b: int, y: int, stream: int) -> None:
    """Kiln's own tiled GEMM (cuda_kernels/gemm.cu): 64x64 tiles, 256 threads."""
    from engine_core.cuda.driver import launch

    grid = ((op.n + 63) // 64, (op.m + 63) // 64, op.batch)
    c = ctypes
    launch(function, grid, (256, 1, 1), [
        (a, c.c_void_p), (b, c.c_void_p), (y, c.c_void_p), (op.m, c.c_int), (op.n, c.c_int), (op.k, c.c_int),
        (op.a_strides[0], c.c_longlong), (op.a_strides[1], c.c_longlong), (op.a_strides[2], c.c_longlong),
        (op.b_strides[0], c.c_longlong), (op.b_strides[1], c.c_longlong), (op.b_strides[2], c.c_longlong),
        (op.m * op.n, c.c_longlong), (op.alpha, c.c_float), (op.beta, c.c_float)], stream=stream)
