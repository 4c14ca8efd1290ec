"""What the CUDA lowering produces and what its rules share: the step types (kernel launches, GEMMs,
convolutions, copies, host fallbacks), the build options, the lowering context the rules read and extend,
and the small helpers every rule uses (launch geometry, layouts, generated copies), and the registry of lowering
rules (``LOWERING_RULES``, filled by ``lowering_rule``).

lowering.py (the driver), the rules by family (lower_rules/*.py) and the INT8 rules (int8_gemm.py, int8_conv.py,
qgemm.py) all build on this module, so the driver can import every rule module without those importing it back.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from engine_core.backends.cuda.memory import MemoryPlan
from engine_core.backends.cuda.pointwise import (
    PointwiseKernel,
    Unsupported,
    contiguous_strides,
    make_indexer,
    pointwise_kernel,
)
from engine_core.ir import Node
from engine_core.ops.registry import TensorInfo

if TYPE_CHECKING:
    from engine_core.backends.cuda.host_tail import HostTail

F32, F16, INT8 = np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.int8)
THREADS = 256
#: Kiln's own kernel files every CUDA plan embeds (besides the generated pointwise module); ``Launch.module`` names
#: one of these, an ON_DEMAND_KERNEL_FILES entry, or "pointwise"
KERNEL_FILES = ("softmax", "layer_norm", "skip_layer_norm", "reduce", "gather", "gemm", "pool")
#: kernel files a plan embeds only when one of its launches uses them (large kernels: qgemm_sm90 and flash_attention
#: take NVRTC 20-50 s each, most of a cold first build, needless in a plan without INT8 GEMMs or attention;
#: depthwise_conv's 24 specialisations 3 s and 0.5 MB), or the runner compiles when it first needs them
#: (copy_segments: batches from CUDA shared memory; any of them for shapes known only at run time); concat: Concats
#: of several inputs
ON_DEMAND_KERNEL_FILES = ("qgemm_sm90", "copy_segments", "depthwise_conv", "concat", "flash_attention")


@dataclass(frozen=True)
class LoweringOptions:
    """Build choices the lowering needs: TF32 math for fp32 GEMM/conv, whether cuDNN runs convolutions."""

    tf32: bool = False
    cudnn: bool = False
    #: cuBLASLt runs FusedMatMul with its bias / activation fused into the GEMM
    cublaslt: bool = False
    #: cuBLASLt's int8-output IMMA GEMMs (alpha vector, bias / ReLU epilogue, int8 residual) run requantizing
    #: INT8 convolutions as one call (int8_gemm.Int8GemmRequant); probed on the GPU at build time
    int8_requant: bool = False
    #: cuDNN runs ``kiln.QConv`` as one INT8 graph (INT32 sums, the requantizing epilogue fused); probed on the GPU
    #: at build time (cudnn_conv.int8_unsupported)
    cudnn_int8: bool = False
    #: INT8 ``kiln.QMatMul`` runs Kiln's Hopper wgmma GEMM with the epilogue in registers (qgemm.py): sm_90 GPUs,
    #: unless KILN_QGEMM=0
    qgemm_sm90: bool = False
    #: strict fp32 convolutions (fp32 without TF32) run NCHW with KCRS filters: cuDNN's FFMA engines (implicit /
    #: precomputed GEMM, Winograd, FFT) are NCHW kernels, and with the tensor-core engines deselected an NHWC fp32
    #: graph is left with slow generic ones (ResNet-50 at batch 128: 395.6 ms against 10.8 ms in TF32). Plans
    #: built before this option ran such convolutions channels-last and still do (the runner lowers as recorded)
    strict_fp32_nchw: bool = False


@dataclass(frozen=True)
class Ref:
    """A device pointer argument: a tensor's address plus a byte offset."""

    tensor: str
    offset: int = 0


@dataclass(frozen=True)
class TensorMap:
    """A TMA descriptor argument (CUtensorMap, 128 bytes by value) of a row-major int8 matrix [rows, cols] at a
    tensor's address, read in boxes of ``box`` (rows, bytes) with the 128-byte swizzle. Why an argument kind: the
    descriptor holds the address, so the runner encodes it when it first resolves the tensor and again whenever
    the address changes (a new arena, other I/O addresses)."""

    ref: Ref
    rows: int
    cols: int
    box: tuple[int, int]


@dataclass
class Launch:
    """One kernel launch; ``args`` are (value, ctypes type) pairs, the value a Ref (a device pointer), a TensorMap
    (a 128-byte descriptor by value; its type is None) or a constant. ``program`` is the pointwise program a
    generated kernel evaluates (the emulator runs it on the host)."""

    module: str
    function: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: list[tuple[Any, Any]]
    program: PointwiseKernel | None = None
    #: dynamic shared memory per block (bytes); above 48 KiB the runner raises the function's limit first
    shared_bytes: int = 0

    def refs(self) -> list[Ref]:
        """The tensors the launch addresses: its Ref arguments and its tensor maps' tensors."""
        return [v.ref if isinstance(v, TensorMap) else v for v, _ in self.args if isinstance(v, (Ref, TensorMap))]


@dataclass
class Gemm:
    """Y[b] = alpha * A[b] @ B[b] + beta * Y[b]; operands addressed by element strides (row, col, batch)."""

    a: Ref
    b: Ref
    y: Ref
    m: int
    n: int
    k: int
    batch: int
    a_strides: tuple[int, int, int]
    b_strides: tuple[int, int, int]
    alpha: float = 1.0
    beta: float = 0.0
    tactic: str = "cublas"
    dtype: np.dtype = F32
    tf32: bool = False
    #: cuBLASLt epilogue ("bias", "relu_bias", "gelu_bias") reading ``bias`` (bias[N]); tactic "cublaslt"
    bias: Ref | None = None
    epilogue: str = ""

    @property
    def trans_a(self) -> bool:
        return self.a_strides[1] != 1

    @property
    def trans_b(self) -> bool:
        return self.b_strides[1] != 1


@dataclass
class Conv:
    """Y = act(conv(X, W) + B + Z) through cuDNN; every tensor described by logical NCHW dims and the
    element strides of its physical layout. ``key()`` identifies the cuDNN graph (cached per engine)."""

    x: Ref
    w: Ref
    y: Ref
    b: Ref | None
    z: Ref | None
    x_dims: tuple[int, ...]
    w_dims: tuple[int, ...]
    y_dims: tuple[int, ...]
    x_strides: tuple[int, ...]
    w_strides: tuple[int, ...]
    y_strides: tuple[int, ...]
    z_strides: tuple[int, ...] | None
    pads_begin: tuple[int, ...]
    pads_end: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    dtype: np.dtype
    activation: str = ""
    alpha: float = 0.0
    beta: float = 0.0
    tf32: bool = False
    #: bias + residual + activation as generated kernels, for when cuDNN has no engine for the fused graph
    #: (then the bare convolution runs and these follow)
    fallback: list = field(default_factory=list)
    #: residual + activation alone as generated kernels, for running cuDNN with the bias epilogue only (a
    #: binding whose captured CUDA graph did not reproduce with the full epilogue in cuDNN)
    rest: list = field(default_factory=list)
    #: INT8 convolutions (``kiln.QConv``, int8 ``dtype``): the float32 [K] multiplier of the INT32 sums
    #: (x_scale * w_scale[k] / y_scale); ``b`` is then float32 too (bias / y_scale)
    scale: Ref | None = None
    #: INT8 convolutions: the float32 [K] multiplier of the residual ``z`` (its scale / y_scale)
    z_scale: Ref | None = None
    #: INT8 convolutions: the residual's and the output's element types (int8 when requantizing, else a float)
    z_dtype: np.dtype | None = None
    y_dtype: np.dtype | None = None

    @property
    def int8(self) -> bool:
        """An INT8 convolution: int8 x and w, INT32 sums, the float requantizing epilogue in the same graph."""
        return self.scale is not None

    def refs(self) -> list[Ref]:
        """Every tensor cuDNN addresses (the epilogue kernels' arguments not included)."""
        return [r for r in (self.x, self.w, self.y, self.b, self.z, self.scale, self.z_scale) if r is not None]

    def bare(self) -> Conv:
        """The convolution alone (no bias, residual or activation)."""
        return replace(self, b=None, z=None, z_strides=None, activation="", fallback=[], rest=[])

    def bias_only(self) -> Conv:
        """The convolution with its bias only (residual and activation left to ``rest``)."""
        return replace(self, z=None, z_strides=None, activation="", fallback=[], rest=[])

    def key(self) -> tuple:
        return (self.x_dims, self.w_dims, self.y_dims, self.x_strides, self.w_strides, self.y_strides,
                self.z_strides, self.b is not None, self.pads_begin, self.pads_end, self.strides, self.dilations,
                str(self.dtype), self.activation, self.alpha, self.beta, self.tf32, self.int8, str(self.z_dtype),
                str(self.y_dtype))


@dataclass
class Copy:
    dst: Ref
    src: Ref
    nbytes: int


@dataclass
class Host:
    """Run the numpy implementation: inputs device->host, outputs host->device."""

    node: Node


@dataclass
class Step:
    node: Node
    tactic: str
    ops: list[Launch | Gemm | Conv | Copy | Host]
    #: step-local scratch tensors (planned in the arena for this step only)
    scratch: list[str] = field(default_factory=list)


@dataclass
class Lowered:
    steps: list[Step]
    #: tensor -> ("arena", offset) | ("io", name) | ("weight", name) | ("folded", name)
    locations: dict[str, tuple[str, Any]]
    memory: MemoryPlan
    #: host-known tensors (shape computations) that device steps read: uploaded per shape set
    folded: dict[str, np.ndarray]
    kernels: list[PointwiseKernel]
    infos: dict[str, TensorInfo]
    #: derived weights: name -> (source weight, transform), e.g. ("w", "krsc") for channels-last filters
    weight_transforms: dict[str, tuple[str, str]] = field(default_factory=dict)
    layouts: dict[str, str] = field(default_factory=dict)
    #: element strides of the tensors whose layout is "strided" (views of another tensor's bytes: Split parts)
    view_strides: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: the layers after the first data-dependent ones (host_tail.py): these steps are the device part's
    tail: HostTail | None = None

    def tactics(self) -> dict[str, str]:
        """Layer -> tactic; the host tail's layers are "host"."""
        device = {s.node.name: s.tactic for s in self.steps}
        return device if self.tail is None else {**device, **{name: "host" for name in self.tail.layers}}


def grid_for(n: int, threads: int = THREADS) -> tuple[int, int, int]:
    return (max(1, min((n + threads - 1) // threads, 1 << 20)), 1, 1)


def same_bytes_in_both_layouts(shape: tuple[int, ...]) -> bool:
    """A 4-D tensor whose NCHW and NHWC byte orders coincide (one channel, or one spatial position): converting
    its layout moves nothing, so a reformat is an alias. Why: EfficientNet-B0's squeeze-and-excitation blocks had
    33 copy kernels of [N, C, 1, 1] tensors."""
    return len(shape) == 4 and (shape[1] == 1 or shape[2] * shape[3] == 1)


def nhwc_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a logical NCHW tensor stored channels-last (NHWC)."""
    n, c, h, w = shape
    return (h * w * c, 1, w * c, c)


def transform_weight(value: np.ndarray, transform: str) -> np.ndarray:
    """A derived weight's host value (the runner uploads it once per engine)."""
    if transform == "krsc":
        return np.ascontiguousarray(np.transpose(value, (0, 2, 3, 1)))
    if transform == "rskc":  # [K, C, R, S] filters as [R, S, K, C]: a depthwise filter's taps, channels contiguous
        return np.ascontiguousarray(np.transpose(value, (2, 3, 0, 1)))
    if transform == "nk":  # a [K, N] int8 GEMM weight as the [N, K] rows cuBLASLt's IMMA "TN" form reads
        return np.ascontiguousarray(value.T)
    raise ValueError(f"unknown weight transform {transform}")


@dataclass
class LoweringContext:
    """What a lowering rule reads and adds to while it lowers one graph at one set of shapes: tensor infos and
    constants, layouts, the generated kernels, reformat steps, folded values and scratch tensors."""
    infos: dict[str, TensorInfo]
    graph_outputs: frozenset[str]
    gemm_choice: Mapping[str, str]
    options: LoweringOptions
    constants: Mapping[str, Any]
    layouts: dict[str, str] = field(default_factory=dict)
    kernels: list[PointwiseKernel] = field(default_factory=list)
    pre_steps: list[Step] = field(default_factory=list)
    reformatted: dict[tuple[str, str], str] = field(default_factory=dict)
    folded_extra: dict[str, np.ndarray] = field(default_factory=dict)
    weight_transforms: dict[str, tuple[str, str]] = field(default_factory=dict)
    scratch: list[str] = field(default_factory=list)
    #: inputs a lowering read under another name (a reformatted copy): the step node lists that name,
    #: so liveness keeps the copy alive until the step has run
    renamed: dict[str, str] = field(default_factory=dict)
    #: a QMatMul output -> the last-axis Split that is its only reader (``split_readers``): Kiln's INT8 GEMM can
    #: write the parts itself (qgemm.lower adds the output to ``split_written``); that Split then has no step
    split_readers: dict[str, Node] = field(default_factory=dict)
    split_written: set[str] = field(default_factory=set)
    #: the graph's inputs: like its outputs, bound by the caller (no arena offset can address a part of one)
    graph_inputs: frozenset[str] = frozenset()
    #: tensor -> (the tensor it aliases at last, byte offset into it): lower_graph keeps it, from the views below
    aliases: dict[str, tuple[str, int]] = field(default_factory=dict)
    #: tensors a rule made views of another's bytes: name -> (the tensor viewed, byte offset into it)
    views: dict[str, tuple[str, int]] = field(default_factory=dict)
    #: element strides of the tensors whose layout is "strided" (views that are not contiguous, e.g. a Split part)
    view_strides: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def info(self, name: str) -> TensorInfo:
        info = self.infos.get(name)
        if info is None or info.shape is None:
            raise Unsupported(f"tensor '{name}' has no known shape")
        return info

    def value(self, name: str) -> np.ndarray | None:
        info = self.infos.get(name)
        return None if info is None else info.value

    def constant(self, name: str) -> np.ndarray | None:
        """``name``'s value when the build knows it (a weight, or a value folded at these shapes), else None."""
        value = self.constants.get(name)
        return self.value(name) if value is None else np.asarray(value)

    def strides(self, name: str) -> tuple[int, ...]:
        """Element strides of ``name``'s physical layout (logical dims)."""
        shape = self.info(name).shape
        layout = self.layouts.get(name)
        if layout == "strided":
            return self.view_strides[name]
        return nhwc_strides(shape) if layout == "nhwc" else contiguous_strides(shape)

    def view(self, name: str, source: str, byte_offset: int, strides: tuple[int, ...]) -> None:
        """``name`` is ``source``'s bytes from ``byte_offset`` on, read through ``strides`` (no step writes it):
        "strided" unless those are the contiguous strides."""
        self.views[name] = (source, byte_offset)
        if tuple(strides) == contiguous_strides(self.info(name).shape):
            self.layouts.pop(name, None)
        else:
            self.layouts[name] = "strided"
            self.view_strides[name] = tuple(strides)

    def in_arena(self, name: str) -> bool:
        """Whether ``name``'s bytes are an arena tensor's (or a view of one): what a view at an offset may alias.
        Graph inputs and outputs are the caller's buffers, weights and host-known values have their own."""
        root = self.aliases.get(name, (name, 0))[0]
        info = self.infos.get(root)
        return (root not in self.graph_inputs and root not in self.graph_outputs and root not in self.constants
                and root not in self.weight_transforms and info is not None and info.value is None)

    def kernel(self, kernel: PointwiseKernel) -> PointwiseKernel:
        self.kernels.append(kernel)
        return kernel

    def as_layout(self, name: str, layout: str) -> str:
        """``name`` in ``layout`` ("linear" or "nhwc"): itself, or a reformat step's output."""
        current = self.layouts.get(name, "linear")
        if current == layout:
            return name
        key = (name, layout)
        if key not in self.reformatted:
            info = self.info(name)
            out = f"{name}#{layout}"
            self.infos[out] = TensorInfo(info.dtype, info.shape)
            if layout == "nhwc":
                self.layouts[out] = "nhwc"
            node = Node("Identity", [name], [out], {}, f"reformat:{name}->{layout}", "", 1, [name])
            if current != "strided" and same_bytes_in_both_layouts(info.shape):  # [N, C, 1, 1] (squeeze-and-excitation) or [N, 1, H, W]
                self.pre_steps.append(Step(node, "view", []))  # an alias of the same bytes (lower_graph)
            else:
                launch = copy_launch(self, info.dtype, Ref(out), Ref(name), info.shape, self.strides(out),
                                     self.strides(name))
                self.pre_steps.append(Step(node, f"reformat:{layout}", [launch]))
            self.reformatted[key] = out
        return self.reformatted[key]

    def fold(self, name: str, value: np.ndarray) -> Ref:
        """A host-computed constant for this step (uploaded with the binding's folded values)."""
        self.folded_extra[name] = np.ascontiguousarray(value)
        self.infos[name] = TensorInfo(value.dtype, value.shape, value)
        return Ref(name)

    def new_scratch(self, name: str, dtype: np.dtype, shape: tuple[int, ...]) -> Ref:
        self.infos[name] = TensorInfo(np.dtype(dtype), tuple(shape))
        self.scratch.append(name)
        return Ref(name)


def launch_program(kernel: PointwiseKernel, y: Ref, xs: list[Ref], shape, out_strides, in_strides) -> Launch:
    n = int(np.prod(shape, dtype=np.int64))
    ix, rank = make_indexer(shape, out_strides, in_strides)
    threads = kernel.vector_threads(n, rank, ix)
    if threads is None:  # the strided path: rank <= 1 moves 4 elements per thread (pointwise.cu), others one
        threads = (n + 3) // 4 if rank <= 1 else n
    grid = grid_for(threads)
    return Launch("pointwise", kernel.name, grid, (THREADS, 1, 1),
                  [(y, ctypes.c_void_p), *[(x, ctypes.c_void_p) for x in xs], (n, ctypes.c_longlong),
                   (rank, ctypes.c_int), (ix, type(ix))], kernel)


def copy_launch(ctx: LoweringContext, dtype: np.dtype, dst: Ref, src: Ref, shape, dst_strides, src_strides) -> Launch:
    return launch_program(ctx.kernel(pointwise_kernel("Identity", dtype, [dtype])), dst, [src], shape, dst_strides,
                          [src_strides])


def optional_input(node: Node, index: int) -> str:
    """The name of the node's input ``index``, or "" when the node omits it (absent or empty)."""
    return node.inputs[index] if len(node.inputs) > index and node.inputs[index] else ""


#: a lowering rule: one layer -> its device ops (raises Unsupported for what it does not take: the layer then runs on
#: the host)
LoweringRule = Callable[[Node, LoweringContext], list]
#: op type -> its lowering rule. The rules register themselves (``lowering_rule``) in the modules of their family
#: (lower_rules/*.py, int8_gemm.py, int8_conv.py); lowering.py imports those modules, so it sees them all
LOWERING_RULES: dict[str, LoweringRule] = {}


def lowering_rule(*op_types: str) -> Callable[[LoweringRule], LoweringRule]:
    """Decorator: register the function as the lowering rule of ``op_types`` (one rule per op type)."""

    def register(rule: LoweringRule) -> LoweringRule:
        for op_type in op_types:
            if LOWERING_RULES.get(op_type, rule) is not rule:
                raise ValueError(f"two CUDA lowering rules for {op_type}: {LOWERING_RULES[op_type].__qualname__} "
                                 f"and {rule.__qualname__}")
            LOWERING_RULES[op_type] = rule
        return rule

    return register
