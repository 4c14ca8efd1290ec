"""``kiln.QMatMul`` on the GPU: an INT8 tensor-core GEMM (cuBLASLt IMMA) plus one dequantizing epilogue.

Lowering: ``Int8Gemm`` computes acc[M, N] (int32) = x_q[M, K] @ W_q^T from int8 operands; a generated
pointwise kernel then writes ``act(float(acc) * x_scale * w_scale[n] + bias[n])`` into the float output
(fp32/fp16/bf16), in the order and rounding of the CPU implementation (engine_core/ops/fused.py). A
requantizing QMatMul (``y_scale``, input 5) ends that program with a Cast to its float type (the value the
unfused graph would hold) and the pointwise QuantizeLinear, and the kernel stores int8.

Why this shape: cuBLASLt's IMMA kernels with ordinary (column-major) layouts take only the "TN" form --
op(A) = T, op(B) = N -- with m and k multiples of 4. Row-major Y[M, N] = X W is column-major
Y^T = W^T X^T, so cuBLASLt's A is the weight stored as [N, K] row-major (a transB Gemm weight as it is;
a MatMul [K, N] weight transposed once per engine: weight transform "nk") and its B is X as it lies.
Leading batch dims of X fold into M. Shapes outside these rules run on the host (visible as "host").

FP8 (E4M3, sm_89+/Hopper): ``Fp8Gemm`` is the same "TN" call with ``CUDA_R_8F_E4M3`` A/B,
``CUBLAS_COMPUTE_32F``, ``CUDA_R_32F`` scale type and a float32 C/D (a combination cuBLASLt's FP8 table
lists), alpha 1, beta 0, no A/B scale pointers: D holds the raw float32 sums and the same generated epilogue
applies ``x_scale * w_scale[n]``, bias and activation. Why not cuBLASLt's A/B/D scales: the epilogue kernel
runs anyway (bias, activation, requantization), so folding the scales into the GEMM saves nothing, while
keeping them there gives per-column weight scales (cuBLASLt's are per tensor), scales of any float type (its
scale pointers must be float32) and the CPU op's rounding order (only the summation order differs: cuBLASLt
sums in float32, the CPU op rounds the exact sum once). cuBLASLt's FP8 kernels need 16-byte aligned operands
and leading dimensions: K and N multiples of 16 here (M is free); other shapes run on the host.

A requantizing FP8 layer would end its epilogue with an E4M3 store, which the generated pointwise kernels do
not have yet (fp8 QuantizeLinear runs on the host): until they do, the epilogue writes the float result to a
step-local buffer and the step's last op is that QuantizeLinear on the host -- correct, and visible as a
``Host`` op in the step (CUDA-graph capture is then off for the engine, as for any host layer).
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any, ClassVar

import numpy as np

from engine_core.backends.cuda import qgemm
from engine_core.backends.cuda.cublaslt import (
    EPILOGUES,
    WORKSPACE_BYTES,
    CublasLt,
    best_algorithm,
    check,
    make_layouts,
)
from engine_core.backends.cuda.lowering_context import (
    Host,
    Launch,
    LoweringContext,
    Ref,
    launch_program,
    lowering_rule,
    optional_input,
)
from engine_core.backends.cuda.pointwise import FLOATS, PwNode, Unsupported, broadcast_strides, program_kernel
from engine_core.cuda.driver import CudaError
from engine_core.ir import Node
from engine_core.ops import TensorInfo
from engine_core.ops.fused import FP8, qmatmul_float_dtype
from engine_core.types import np_to_onnx

INT8, INT32, F32 = np.dtype(np.int8), np.dtype(np.int32), np.dtype(np.float32)
#: weight transform turning a [K, N] weight into the [N, K] rows cuBLASLt's "TN" form reads
NK_TRANSFORM = "nk"
#: cudaDataType / cublasComputeType_t values (library_types.h, cublas_api.h of the CUDA 13 wheels)
_CUDA_R_32F, _CUDA_R_8I, _CUDA_R_32I, _CUDA_R_8F_E4M3 = 0, 3, 10, 28
_COMPUTE_32F, _COMPUTE_32I = 68, 72
_DESC_POINTER_MODE, _DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER = 2, 3, 4, 7, 8
#: cublasLtPointerMode_t: alpha a device vector (one value per row of Lt's D), beta zero / a host scalar
_ALPHA_VECTOR_BETA_ZERO, _ALPHA_VECTOR_BETA_HOST = 3, 4
_OP_N, _OP_T = 0, 1
#: activation name -> (pointwise op, attributes) of the epilogue
_ACTIVATIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "Relu": ("Relu", {}), "Sigmoid": ("Sigmoid", {}), "Tanh": ("Tanh", {}), "Gelu": ("Gelu", {}),
    "GeluTanh": ("Gelu", {"approximate": "tanh"}),
}


@dataclass
class Int8Gemm:
    """acc[m, n] (int32, row-major) = x[m, k] (int8, row-major) @ w[n, k]^T (int8, row-major)."""

    x: Ref
    w: Ref
    y: Ref
    m: int
    n: int
    k: int
    #: the layer's tactic name (without the "gemm:" prefix)
    tactic: ClassVar[str] = "cublaslt_int8"
    #: cuBLASLt types: (A/B cudaDataType, C/D cudaDataType, compute type, scale type)
    types: ClassVar[tuple[int, int, int, int]] = (_CUDA_R_8I, _CUDA_R_32I, _COMPUTE_32I, _CUDA_R_32I)
    #: the accumulator's element type
    acc_dtype: ClassVar[np.dtype] = INT32

    def refs(self) -> list[Ref]:
        """Every tensor the GEMM addresses (for the runner's read sets and weight streaming)."""
        return [self.x, self.w, self.y]

    def plan_args(self) -> tuple:
        """``_Plan``'s arguments after the handle: what its cuBLASLt descriptors depend on (the plan cache key)."""
        return self.m, self.n, self.k, self.types


@dataclass
class Fp8Gemm(Int8Gemm):
    """acc[m, n] (float32 sums, row-major) = x[m, k] (e4m3) @ w[n, k]^T (e4m3). A subclass so the runner's
    Int8Gemm dispatch (one cuBLASLt handle and workspace per context) runs it; the plan follows ``types``."""

    tactic: ClassVar[str] = "cublaslt_fp8"
    types: ClassVar[tuple[int, int, int, int]] = (_CUDA_R_8F_E4M3, _CUDA_R_32F, _COMPUTE_32F, _CUDA_R_32F)
    acc_dtype: ClassVar[np.dtype] = F32


@dataclass
class Int8GemmRequant(Int8Gemm):
    """y[m, n] (int8) = saturate(round(act(alpha[n] * acc + beta * c[m, n] + bias[n]))) in one cuBLASLt IMMA
    call: a requantizing layer whose scales and bias are constants, with the scales and the output scale folded
    into ``alpha`` = x_scale * w_scale[n] / y_scale (a device vector: ``CUBLASLT_POINTER_MODE_ALPHA_DEVICE_VECTOR_BETA_HOST``),
    ``bias`` = bias / y_scale (float32, the BIAS / RELU_BIAS epilogue) and an int8 residual ``c`` read with
    ``beta`` = its scale / y_scale. Why: the int32 accumulators never leave the GEMM (the implicit GEMM's
    epilogue kernel reads and writes 5 bytes per output element more), and no second kernel runs.

    It rounds once in float32 where the CPU op rounds at each step (and, in FP16 builds, to fp16 before
    quantizing): outputs may differ from the CPU backend by one quantization step, as TensorRT's do."""

    alpha: Ref | None = None
    bias: Ref | None = None
    c: Ref | None = None
    beta: float = 0.0
    relu: bool = False
    tactic: ClassVar[str] = "cublaslt_int8_requant"
    types: ClassVar[tuple[int, int, int, int]] = (_CUDA_R_8I, _CUDA_R_8I, _COMPUTE_32I, _CUDA_R_32F)
    acc_dtype: ClassVar[np.dtype] = INT8

    def refs(self) -> list[Ref]:
        return [self.x, self.w, self.y, *[r for r in (self.alpha, self.bias, self.c) if r is not None]]

    def plan_args(self) -> tuple:
        return *super().plan_args(), self.epilogue, self.c is not None

    @property
    def epilogue(self) -> str:
        """The cuBLASLt epilogue name (cublaslt.EPILOGUES)."""
        return {(False, False): "default", (True, False): "relu", (False, True): "bias",
                (True, True): "relu_bias"}[(self.relu, self.bias is not None)]


def nk_weight(value: np.ndarray) -> np.ndarray:
    """The ``nk`` weight transform: a [K, N] weight as contiguous [N, K] rows."""
    return np.ascontiguousarray(np.asarray(value).T)


def _output_columns(w: TensorInfo, trans_b: bool) -> tuple[int, int]:
    """(N, K) of a QMatMul weight."""
    n, k = w.shape if trans_b else w.shape[::-1]
    return int(n), int(k)


def _weight_rows(node: Node, ctx: LoweringContext, trans_b: bool) -> str:
    """The weight as [N, K] rows: itself for transB, else a derived weight transposed once per engine."""
    name = node.inputs[2]
    if trans_b:
        return name
    derived = f"{name}#{NK_TRANSFORM}"
    ctx.weight_transforms[derived] = (name, NK_TRANSFORM)
    w = ctx.info(name)
    ctx.infos[derived] = TensorInfo(w.dtype, tuple(w.shape[::-1]))
    return derived


def dequant_program(node: Node, ctx: LoweringContext, n_inputs: int, adds: list[int], requantize: bool,
                    out_dtype: np.dtype, dequantize: Mapping[int, int] | None = None) -> list[PwNode]:
    """The epilogue program of a QMatMul / QConv over inputs [acc, x_scale, w_scale, ...]: float(acc) * x_scale *
    w_scale, plus each input in ``adds`` (bias, residual), the node's activation, and with ``requantize`` a Cast
    to the node's float type then QuantizeLinear (scale: the last input) to ``out_dtype`` -- the CPU op's order.
    ``dequantize`` maps an int8 addend to its scale input: it is added as its DequantizeLinear stored it
    (float32 product rounded to the float type; engine_core/ops/fused.py ``qconv_residual``)."""
    nodes: list[PwNode] = []
    result = qmatmul_float_dtype(node, ctx.info(node.inputs[1]).dtype)

    def emit(op: str, inputs: list[int], dtype: np.dtype = F32, attrs: dict | None = None) -> int:
        nodes.append(PwNode.make(op, inputs, dtype, attrs or {}))
        return n_inputs + len(nodes) - 1

    def as_float(index: int) -> int:
        scale = (dequantize or {}).get(index)
        if scale is None:
            return index
        value = emit("Mul", [emit("Cast", [index], F32, {"to": 1}), scale])
        if result != F32:
            value = emit("Cast", [emit("Cast", [value], result, {"to": np_to_onnx(result)})], F32, {"to": 1})
        return value

    addends = [as_float(index) for index in adds]
    last = emit("Mul", [emit("Mul", [emit("Cast", [0], F32, {"to": 1}), 1]), 2])
    for index in addends:
        last = emit("Add", [last, index])
    activation = node.attr("activation", "")
    if activation:
        if activation not in _ACTIVATIONS:
            raise Unsupported(f"{node.op_type} activation {activation}")
        op, attrs = _ACTIVATIONS[activation]
        last = emit(op, [last], F32, attrs)
    if requantize:
        if result != F32:  # round like the float tensor the unfused graph stores
            last = emit("Cast", [last], result, {"to": np_to_onnx(result)})
        emit("QuantizeLinear", [last, n_inputs - 1, -1], out_dtype)
    return nodes


def _dequant_epilogue(node: Node, ctx: LoweringContext, acc: str, float_out: str = "") -> Launch:
    """One generated kernel: act(float(acc) * x_scale * w_scale + bias) -> the node's output; with y_scale
    then Cast to the float type and QuantizeLinear (the pointwise op's own code) -> int8. ``float_out``: stop
    before the requantization and write the float result there instead."""
    out_name = float_out or node.outputs[0]
    out = ctx.info(out_name)
    bias, y_scale = optional_input(node, 4), "" if float_out else optional_input(node, 5)
    inputs = [acc, node.inputs[1], node.inputs[3], *([bias] if bias else []), *([y_scale] if y_scale else [])]
    nodes = dequant_program(node, ctx, len(inputs), [3] if bias else [], bool(y_scale), out.dtype)
    kernel = ctx.kernel(program_kernel(nodes, out.dtype, [ctx.info(n).dtype for n in inputs]))
    strides = [broadcast_strides(ctx.info(n).shape, out.shape) for n in inputs]
    return launch_program(kernel, Ref(out_name), [Ref(n) for n in inputs], out.shape, ctx.strides(out_name), strides)


def _host_requantize(node: Node, ctx: LoweringContext, acc: str) -> list:
    """[the epilogue into a step-local float buffer, QuantizeLinear(that, y_scale) on the host]: a
    requantizing layer whose output type the pointwise kernels cannot store (float8e4m3fn)."""
    out = ctx.info(node.outputs[0])
    result = qmatmul_float_dtype(node, ctx.info(node.inputs[1]).dtype)
    buffer = ctx.new_scratch(f"{node.name}#float", result, tuple(out.shape))
    quantize = Node("QuantizeLinear", [buffer.tensor, node.inputs[5]], [node.outputs[0]],
                    {"output_dtype": np_to_onnx(out.dtype), "saturate": 1}, f"{node.name}#quantize", "", 21, [])
    return [_dequant_epilogue(node, ctx, acc, buffer.tensor), Host(quantize)]


@lowering_rule("QMatMul")
def lower_qmatmul(node: Node, ctx: LoweringContext) -> list:
    """``kiln.QMatMul`` -> Kiln's sm_90 INT8 GEMM with the epilogue in registers (``qgemm.lower``) where it
    applies, else [Int8Gemm / Fp8Gemm into a step-local int32 / float32 buffer, the dequantizing epilogue];
    raises Unsupported (the layer then runs on the host) for shapes cuBLASLt's IMMA / FP8 kernels do not take."""
    x, w, out = ctx.info(node.inputs[0]), ctx.info(node.inputs[2]), ctx.info(node.outputs[0])
    if x.dtype != w.dtype or x.dtype not in (INT8, FP8) or len(w.shape) != 2:
        raise Unsupported(f"QMatMul over {x.dtype} x {w.dtype} {w.shape}")
    gemm_type = Fp8Gemm if x.dtype == FP8 else Int8Gemm
    trans_b = bool(node.attr("transB", 0))
    n, k = _output_columns(w, trans_b)
    m = int(np.prod(x.shape[:-1], dtype=np.int64))
    multiple = 16 if gemm_type is Fp8Gemm else 4
    if n % multiple or k % multiple:
        kind = "FP8" if gemm_type is Fp8Gemm else "INT8"
        raise Unsupported(f"{kind} GEMM needs N and K multiples of {multiple}, got N={n}, K={k}")
    y_scale = optional_input(node, 5)
    for name in (node.inputs[1], node.inputs[3], optional_input(node, 4), y_scale):
        if name and ctx.info(name).dtype not in FLOATS:
            raise Unsupported(f"QMatMul {name} is {ctx.info(name).dtype}, not a float type")
    if (out.dtype == x.dtype) != bool(y_scale) or (not y_scale and out.dtype not in FLOATS):
        raise Unsupported(f"QMatMul writing {out.dtype} ({'with' if y_scale else 'without'} an output scale)")
    if m * n == 0:
        return []
    weight = _weight_rows(node, ctx, trans_b)
    whole = qgemm.lower(node, ctx, weight, m, n, k)
    if whole is not None:
        return [whole]
    acc = ctx.new_scratch(f"{node.name}#acc", gemm_type.acc_dtype, tuple(out.shape))
    gemm = gemm_type(Ref(node.inputs[0]), Ref(weight), acc, m, n, k)
    try:
        return [gemm, _dequant_epilogue(node, ctx, acc.tensor)]
    except Unsupported:
        if not y_scale or out.dtype == INT8:
            raise
    return [gemm, *_host_requantize(node, ctx, acc.tensor)]


# -- execution ---------------------------------------------------------------------------------------


class _Plan:
    """cuBLASLt descriptors and the heuristic's algorithm for one (types, m, n, k[, epilogue, residual]) INT8 /
    FP8 GEMM."""

    def __init__(self, lt: CublasLt, m: int, n: int, k: int,
                 types: tuple[int, int, int, int] = Int8Gemm.types, epilogue: str = "", residual: bool = False,
                 pointer_mode: int | None = None) -> None:
        c, lib = ctypes, lt.lib
        operand, result, compute, scale = types
        self.desc = c.c_void_p()
        check(lib.cublasLtMatmulDescCreate(c.byref(self.desc), compute, scale), "cublasLtMatmulDescCreate")
        # alpha 1, beta 0 in the scale type (int32 for IMMA, float32 for FP8 and the requantizing GEMM)
        self.one, self.zero = (c.c_float(1.0), c.c_float(0.0)) if scale == _CUDA_R_32F else (c.c_int32(1), c.c_int32(0))
        op_a, op_b = c.c_int(_OP_T), c.c_int(_OP_N)  # Lt's A: the weight rows; Lt's B: x as it lies
        check(lib.cublasLtMatmulDescSetAttribute(self.desc, _DESC_TRANSA, c.byref(op_a), 4), "TRANSA")
        check(lib.cublasLtMatmulDescSetAttribute(self.desc, _DESC_TRANSB, c.byref(op_b), 4), "TRANSB")
        if epilogue:  # the requantizing GEMM: alpha is a device vector over Lt's rows (our output columns)
            if pointer_mode is None:  # BETA_ZERO would fit a GEMM without residual, but the H100's cuBLASLt
                # (13.1) has no int8-output algorithm in that mode; BETA_HOST with beta 0 runs the same epilogue
                pointer_mode = _ALPHA_VECTOR_BETA_HOST
            mode = c.c_int(pointer_mode)
            check(lib.cublasLtMatmulDescSetAttribute(self.desc, _DESC_POINTER_MODE, c.byref(mode), 4), "POINTER_MODE")
            self.epilogue = c.c_int(EPILOGUES[epilogue])
            check(lib.cublasLtMatmulDescSetAttribute(self.desc, _DESC_EPILOGUE, c.byref(self.epilogue), 4), "EPILOGUE")
        self.layouts = make_layouts(lib, [(operand, k, n, k), (operand, k, m, k), (result, n, m, n)])
        self.heuristic = best_algorithm(lib, lt.handle, self.desc, self.layouts)
        if self.heuristic is None:
            what = "FP8" if operand == _CUDA_R_8F_E4M3 else "INT8"
            raise CudaError(f"cuBLASLt has no {what} algorithm for M={m} N={n} K={k}"
                            + (f" writing int8 with epilogue {epilogue}" if epilogue else ""))


class Int8GemmRunner:
    """Runs ``Int8Gemm``, ``Int8GemmRequant`` and ``Fp8Gemm`` steps on one cuBLASLt handle and workspace (an
    execution context's)."""

    def __init__(self, lt: CublasLt | None = None) -> None:
        if lt is None:
            lt = CublasLt()
        self.lt = lt
        self._plans: dict[tuple, _Plan] = {}

    def plan(self, op: Int8Gemm) -> _Plan:
        """The cached cuBLASLt plan of ``op``'s signature; raises CudaError when cuBLASLt has no algorithm."""
        key = op.plan_args()
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _Plan(self.lt, *key)
        return plan

    def run(self, op: Int8Gemm, resolve: Any, stream: int) -> None:
        """Enqueue acc = x @ w^T (or the requantizing GEMM) on ``stream``; ``resolve`` maps a Ref to its device
        address."""
        plan = self.plan(op)
        c, lt = ctypes, self.lt
        a_l, b_l, y_l = plan.layouts
        y = c.c_void_p(resolve(op.y))
        alpha, beta, source = c.byref(plan.one), c.byref(plan.zero), y
        if isinstance(op, Int8GemmRequant):
            alpha = c.c_void_p(resolve(op.alpha))
            if op.bias is not None:
                pointer = c.c_void_p(resolve(op.bias))
                check(lt.lib.cublasLtMatmulDescSetAttribute(plan.desc, _DESC_BIAS_POINTER, c.byref(pointer), 8),
                      "BIAS_POINTER")
            if op.c is not None:
                beta_value = c.c_float(op.beta)
                beta, source = c.byref(beta_value), c.c_void_p(resolve(op.c))
        check(lt.lib.cublasLtMatmul(lt.handle, plan.desc, alpha, c.c_void_p(resolve(op.w)), a_l,
                                     c.c_void_p(resolve(op.x)), b_l, beta, source, y_l, y, y_l,
                                     c.byref(plan.heuristic), c.c_void_p(lt.workspace.ptr),
                                     c.c_size_t(WORKSPACE_BYTES), c.c_void_p(stream)), f"cublasLtMatmul ({op.tactic})")


@cache
def requant_unsupported() -> str:
    """Why this GPU cannot run ``Int8GemmRequant`` ("" when it can): its cuBLASLt must have int8-output IMMA
    algorithms with a per-column alpha vector, the bias / ReLU epilogues and an int8 residual (probed once on a
    small "TN" shape). The builder lowers requantizing INT8 layers to it only when it can, and records the
    reason in the plan (``build_info.cuda.int8_requant_unsupported``)."""
    try:
        runner = Int8GemmRunner()
        for epilogue in ("default", "relu_bias"):
            for residual in (False, True):
                _Plan(runner.lt, 256, 64, 64, Int8GemmRequant.types, epilogue, residual)
        return ""
    except (CudaError, OSError, ImportError) as e:  # no GPU, no cuBLASLt, or no such algorithm: the int32 path
        return f"{type(e).__name__}: {e}"


def probe_report(m: int = 256, n: int = 64, k: int = 64) -> dict[str, str]:
    """Which int8-output IMMA configurations this GPU's cuBLASLt has algorithms for ("ok" or the error), per
    epilogue x pointer mode (0 host alpha, 3 alpha vector / beta zero, 4 alpha vector / beta host): what to read
    when ``requant_unsupported`` says no. ``python -m engine_core.backends.cuda.int8_gemm`` prints it."""
    runner, report = Int8GemmRunner(), {}
    for epilogue in ("default", "bias", "relu", "relu_bias"):
        for mode in (0, _ALPHA_VECTOR_BETA_ZERO, _ALPHA_VECTOR_BETA_HOST):
            try:
                _Plan(runner.lt, m, n, k, Int8GemmRequant.types, epilogue, pointer_mode=mode)
                report[f"{epilogue}/mode{mode}"] = "ok"
            except CudaError as e:
                report[f"{epilogue}/mode{mode}"] = str(e)
    return report


def unplanned_requant_gemms(ops: list[Int8Gemm]) -> list[str]:
    """The requantizing GEMMs among ``ops`` cuBLASLt has no algorithm for on this GPU (checked at build time, so a
    plan never holds a step that cannot run); empty when all can run."""
    runner, missing = None, []
    for op in ops:
        if not isinstance(op, Int8GemmRequant):
            continue
        runner = runner or Int8GemmRunner()
        try:
            runner.plan(op)
        except CudaError as e:
            missing.append(str(e))
    return missing


if __name__ == "__main__":
    import json

    reason = requant_unsupported()
    try:
        configurations: dict[str, str] | str = probe_report()
    except (CudaError, OSError, ImportError) as e:
        configurations = f"{type(e).__name__}: {e}"
    print(json.dumps({"requant_unsupported": reason, "configurations": configurations}, indent=1))
