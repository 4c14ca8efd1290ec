"""``kiln.QMatMul`` on Hopper as one kernel: Kiln's wgmma INT8 GEMM with the epilogue in registers.

``cuda_kernels/qgemm_sm90.cu`` computes the int32 sums of x[M, K] (int8, row-major) and w[N, K] (int8 rows: the
"nk" weight transform) on the tensor cores and, before anything leaves the registers, applies the QMatMul's
epilogue in the CPU op's order -- ``float(acc) * x_scale * w_scale[n] + bias[n]``, then ReLU or GELU (a fitted
polynomial as accurate as the CPU op's fp32 erf form: ``GELU_LOG2_PHI``; where the result is requantized to int8, a
cheaper form whose error is under 1% of the step: ``GELU_SIGMOID``) -- and
stores the float type, or requantizes ``rint(v / y_scale)`` (after rounding to the layer's float type) to int8.

Why: the cuBLASLt path (``int8_gemm.Int8Gemm`` + a dequantizing pointwise kernel) writes the int32 sums to memory
and reads them back: 4 + 4 bytes per output element more than the result itself, which cost BERT-base INT8 more
than its GEMMs did (docs/cuda-backend.md, "Session 6"). The kernel needs the scales and bias at build time
(folded to float32 vectors: exact conversions), K a multiple of 16 and N even; other layers keep the cuBLASLt path.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache

import numpy as np

from engine_core.backends.cuda.lowering_context import F16, F32, INT8, Launch, LoweringContext, Ref, TensorMap
from engine_core.backends.cuda.pointwise import BF16, contiguous_strides
from engine_core.builder_config import build_knobs
from engine_core.ir import Node
from engine_core.ops.fused import qmatmul_float_dtype

MODULE = "qgemm_sm90"
#: output rows and columns per tile, K bytes per pipeline stage (cuda_kernels/qgemm_sm90.cu)
TILE_M, TILE_N, TILE_K = 128, 128, 128


@dataclass(frozen=True)
class Form:
    """One form of the kernel (cuda_kernels/qgemm_sm90.cu, kiln_qgemm; one block per SM): its name prefix, pipeline
    stages, threads per block, the bytes a row of each consumer warp's epilogue staging slice (KilnQgShape::CHUNK)
    and its consumer warps."""

    prefix: str
    stages: int
    threads: int
    chunk: int
    consumer_warps: int

    def shared_bytes(self) -> int:
        """Dynamic shared memory of one block: the stage ring, the consumer warps' staging slices (16 rows each)
        and slack to align the ring to 1024 bytes."""
        return self.stages * (TILE_M + TILE_N) * TILE_K + self.consumer_warps * 16 * self.chunk + 1024

    def grid_blocks(self, m: int, n: int) -> int:
        """Blocks of the persistent kernel: one per output tile, at most as many as the GPU runs at once."""
        return max(1, min(tiles(m, n), sm_count()))


#: two teams of consumers taking turns over whole tiles, one block per SM: ping-pong (a team is one warpgroup, a
#: producer warpgroup; 209 KiB) for layers without GELU; pairs (a team is two warpgroups sharing each tile, a producer
#: warp; 209 KiB + 8 KiB of static scale and bias rows) for GELU, whose epilogue runs faster on eight warps at once
#: (sessions 8 and 13, bench.qgemm: docs/cuda-backend.md)
PINGPONG, GELU = Form("qgemm_sm90", 6, 384, 128, 8), Form("qgemm_sm90_gelu", 6, 544, 64, 16)
#: QMatMul activation -> the kernel's code (QG_ACT_*). Each has its own copy of the epilogue in the kernels, so the
#: rarer ones (Tanh, Sigmoid) keep the cuBLASLt path rather than growing every kernel and its compile time
ACTIVATIONS = {"": 0, "Relu": 1, "Gelu": 2}
#: the kernel's GELU (kiln_gelu): log2 Phi(-t) = -1 + t (c1 + t (c2 + ... c9)) for t = min(|x|, GELU_LIMIT), c1 .. c9
#: as ``python -m tools.fit_gelu`` fits them (absolute error of GELU <= 4e-7, as the CPU op's fp32 erf form)
GELU_LOG2_PHI = (-1.1511279344558716, -0.4590352475643158, -0.052937086671590805, 0.007591825909912586,
                 -0.0004709532659035176, -7.357532740570605e-05, 2.131196015398018e-05, -2.1366759028751403e-06,
                 8.220337832653968e-08)
GELU_LIMIT = 5.5
#: GELU where the result is requantized to int8 (kiln_gelu_q, QG_ACT_GELU_Q = 3): x / (1 + 2^(x q(t))), t = min(x^2,
#: GELU_SIGMOID_T_MAX), q = k0 + k1 t + k2 t^2 (``python -m tools.fit_gelu --form sigmoid``): 2.6e-5 absolute error
#: in 7 instructions against kiln_gelu's 4e-7 in ~17, on an epilogue that is issue-bound (BERT's FFN1)
GELU_SIGMOID = (-2.301121234893799, -0.10677571594715118, 0.0010142630198970437)
GELU_SIGMOID_T_MAX = 36.0
GELU_Q = 3
#: the int8 output scale from which the cheaper GELU's error is under 1% of a step (2.6e-5 / (1 / 256) = 0.7%): a
#: requantized value can then differ by one step only where the exact one lies within 2.6e-5 of a rounding boundary
GELU_SIGMOID_MIN_SCALE = 1.0 / 256
#: the layer's float type -> the rounding applied before requantizing (QG_ROUND_*)
ROUNDING = {F32: 0, F16: 1, BF16: 2}
#: output dtype -> kernel name suffix
OUTPUTS = {F32: "f32", F16: "f16", BF16: "bf16", INT8: "i8"}
#: streaming multiprocessors the persistent grid is sized for; None: the GPU's own (``sm_count``)
SMS: int | None = None
#: where no GPU answers (lowering without one: the emulator's tests): the H100 SXM's
DEFAULT_SMS = 132
#: output tiles below which a layer keeps the cuBLASLt path (its small-tile / split-K kernels spread a small layer
#: over more SMs). Measured on the H100 (bench.qgemm with MIN_TILES = 0, session 8): at M = 1024 the 48-tile layers
#: (N = 768) ran 6.5 vs 9.5 us (K = 768) and 11.5 vs 13.3 us (K = 3072) here against cuBLASLt + its epilogue kernel,
#: at M = 2048 7.7 vs 13.9 and 13.0 vs 20.2; smaller layers are unmeasured
MIN_TILES = 48


def available() -> bool:
    """Whether builds here use the kernel: an sm_90 GPU (wgmma is sm_90a code), unless the build's
    ``BuilderConfig.qgemm`` is False (outside a build: ``KILN_QGEMM=0``; then the cuBLASLt path)."""
    if not build_knobs().qgemm:
        return False
    from engine_core.cuda.driver import compute_capability

    return compute_capability() == (9, 0)


def sm_count() -> int:
    """``SMS``, else GPU 0's multiprocessors (sm_90 parts have 78-132; a node's GPUs are alike), else
    ``DEFAULT_SMS``. Why not a constant 132: on an H100 PCIe (114 SMs) the 18 persistent blocks past what runs at
    once would start only when others had done all their tiles, nearly doubling the layer's time."""
    return SMS if SMS is not None else _device_sms()


@cache
def _device_sms() -> int:
    from engine_core.cuda.driver import CudaError, multiprocessor_count

    try:
        return multiprocessor_count()
    except (CudaError, ImportError, RuntimeError):  # no driver or GPU here (RuntimeError: libcuda not found)
        return DEFAULT_SMS


def tiles(m: int, n: int) -> int:
    """Output tiles of an [m, n] result."""
    return -(-m // TILE_M) * -(-n // TILE_N)


def lower(node: Node, ctx: LoweringContext, weight: str, m: int, n: int, k: int) -> Launch | None:
    """The whole QMatMul as one ``qgemm_sm90`` launch, or None when it does not fit the kernel: the build has
    it off (not sm_90, or KILN_QGEMM=0), fp8 operands, K % 16 or N odd, another activation (Tanh, Sigmoid, tanh GELU, ...),
    scales or bias computed at run time, operands not laid out contiguously, or fewer than ``MIN_TILES`` output
    tiles (this input shape: the runner lowers each binding's shapes)."""
    x_name, out_name = node.inputs[0], node.outputs[0]
    x, out = ctx.info(x_name), ctx.info(out_name)
    activation = node.attr("activation", "")
    result = qmatmul_float_dtype(node, ctx.info(node.inputs[1]).dtype)
    if (not ctx.options.qgemm_sm90 or x.dtype != INT8 or k % 16 or n % 2 or activation not in ACTIVATIONS
            or result not in ROUNDING or out.dtype not in OUTPUTS or tiles(m, n) < MIN_TILES):
        return None
    parts = _split_parts(ctx, out_name, n)
    if ctx.strides(x_name) != contiguous_strides(x.shape) or any(
            ctx.strides(name) != contiguous_strides(ctx.info(name).shape) for name in parts or [out_name]):
        return None
    names = {"x_scale": node.inputs[1], "w_scale": node.inputs[3]}
    names.update({key: node.inputs[i] for key, i in (("bias", 4), ("y_scale", 5))
                  if len(node.inputs) > i and node.inputs[i]})
    values = {key: ctx.constant(name) for key, name in names.items()}
    if any(v is None for v in values.values()):
        return None
    f32 = {key: np.asarray(v).astype(np.float32) for key, v in values.items()}  # exact: float16 / bfloat16 fit
    w_scale = ctx.fold(f"{node.name}#w_scale", np.broadcast_to(f32["w_scale"].reshape(-1), (n,)).copy())
    # zeros when the layer has none: the kernel always adds (v + 0 is v but for -0, which no positive scale makes)
    bias = ctx.fold(f"{node.name}#bias", f32["bias"].reshape(-1).copy() if "bias" in f32 else np.zeros(n, np.float32))
    y_scale = float(f32["y_scale"].reshape(())) if "y_scale" in f32 else 1.0
    x_map, w_map = TensorMap(Ref(x_name), m, k, (TILE_M, TILE_K)), TensorMap(Ref(weight), n, k, (TILE_N, TILE_K))
    ys = [Ref(name) for name in parts or [out_name]]
    if parts:
        ctx.split_written.add(out_name)  # the Split reading the output has no step of its own
    args = [*[(y, ctypes.c_void_p) for y in (ys + ys[:1] * 2)[:3]], (n // len(parts) if parts else 0, ctypes.c_int),
            (x_map, None), (w_map, None),
            (w_scale, ctypes.c_void_p), (bias, ctypes.c_void_p),
            (m, ctypes.c_int), (n, ctypes.c_int), (k, ctypes.c_int),
            (float(f32["x_scale"].reshape(())), ctypes.c_float), (y_scale, ctypes.c_float)]
    act = ACTIVATIONS[activation]
    if activation == "Gelu" and out.dtype == INT8 and y_scale >= GELU_SIGMOID_MIN_SCALE:
        act = GELU_Q
    form = GELU if activation == "Gelu" else PINGPONG
    return Launch(MODULE, kernel_name(form, act, result, out.dtype), (form.grid_blocks(m, n), 1, 1),
                  (form.threads, 1, 1), args, shared_bytes=form.shared_bytes())


def _split_parts(ctx: LoweringContext, out_name: str, n: int) -> list[str]:
    """The outputs of the Split that is ``out_name``'s only reader (``LoweringContext.split_readers``) when the
    kernel can write them itself: two or three equal parts of whole tiles, shaped and typed as the output's columns;
    else []."""
    split = ctx.split_readers.get(out_name)
    if split is None or len(split.outputs) not in (2, 3) or not all(split.outputs):
        return []
    out = ctx.info(out_name)
    width = n // len(split.outputs)
    infos = [ctx.info(name) for name in split.outputs]
    if width % TILE_N or any(i.dtype != out.dtype or tuple(i.shape) != (*out.shape[:-1], width) for i in infos):
        return []
    return list(split.outputs)


def kernel_name(form: Form, act: int, result: np.dtype, out: np.dtype) -> str:
    """``<prefix>_128_<act><round>_<output>``: one kernel per activation code (``ACTIVATIONS``, or ``GELU_Q``) and
    (int8 outputs) the float type rounded to before requantizing, compiled in (cuda_kernels/qgemm_sm90.cu says why)."""
    rounding = ROUNDING[result] if out == INT8 else 0
    return f"{form.prefix}_{TILE_N}_{act}{rounding}_{OUTPUTS[out]}"
