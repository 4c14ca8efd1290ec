"""ONNX Attention through cuDNN's fused flash attention (the frontend graph API's ``sdpa``), run in place of Kiln's
flash_attention kernel wherever cuDNN builds a graph for the layer.

Why cuDNN: its SDPA engines (wgmma and TMA on Hopper) are the state of the art; on an H100 they ran every measured
shape faster than cuda_kernels/flash_attention.cu (bench/results/attention_20261126T015606.json, fp16, torch's SDPA
calling cuDNN: BERT-base b64 s128 25.4 against 33.1 us, b8 s512 29.7 against 42.1, b8 s128 5.8 against 7.1, causal
d128 b4 h16 s1024 48.7 against 110.5). So the choice is a rule, not a timing: cuDNN whenever the build may use it
(``LoweringOptions.cudnn``) and the layer is one it takes (``sdpa_for``: fp16 / bf16, an additive mask or none,
16-byte aligned strides), the flash kernel otherwise and wherever cuDNN declines at run time. (The builder's timed
choices, GEMM tactics and cuDNN convolution plans, are recorded in the plan for the runner; timing attention too would
need the flash module at tuning time and a recorded choice the runner reads: worth it once a shape turns up where
the flash kernel wins.)

Representation: ``SdpaLaunch`` is the layer's flash_attention ``Launch`` itself, carrying the same attention as a
cuDNN description (``Sdpa``: Q/K/V/Y as [batch, heads, seq, dim] views by element strides, so the 3-D packed form
needs no transposes; the mask as a broadcast bias; top-left causal masking; grouped-query K/V with fewer heads; the
scale). A runner runs the cuDNN graph through ``CudnnAttentions.run`` and, when that declines (no frontend here, no
engine for the graph, check_support or a plan build failing, an unaligned address), the launch: the same attention,
never a crash. Anything that does not know the type runs the launch too.

Graphs are built per distinct ``Sdpa.key()`` in a run that is not captured (the runner's first run of a binding is
eager) and cached per execution context with a workspace; executing passes raw device pointers, so captured CUDA
graphs replay them. A new workspace bumps ``workspace_generation`` (graphs captured with the old one are stale).
Handle, workspace, stream and release at exit: ``cudnn_graph.CudnnGraphs``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine_core.backends.cuda.cudnn_graph import CudnnGraphs, plan_graph
from engine_core.backends.cuda.lowering_context import F16, Launch, Ref
from engine_core.backends.cuda.pointwise import BF16
from engine_core.logger import DEFAULT_LOGGER, Severity

#: Q/K/V/Y/bias element types cuDNN's SDPA takes (fp32 runs the flash kernel in TF32, or the GEMMs)
SDPA_DTYPES = (F16, BF16)
#: byte alignment of every stride but the unit one, and of every address: the Hopper engines load tiles with TMA
ALIGN_BYTES = 16
#: cuDNN's largest head size on Hopper
MAX_HEAD_DIM = 256
#: a plan asking for more workspace is passed over (cudnn_conv.MAX_WORKSPACE_BYTES: the same cap for convolutions)
MAX_WORKSPACE_BYTES = 1 << 30


@dataclass(frozen=True)
class Sdpa:
    """softmax(scale Q K^T + bias, causal) V over [batch, heads, seq, dim] views addressed by element strides (the
    layout cuDNN's SDPA tensors take). K/V have ``kv_heads`` heads (grouped-query when fewer than ``heads``);
    ``bias`` is broadcast by ``bias_strides`` (0 along broadcast dims) over ``bias_dims``."""

    q: Ref
    k: Ref
    v: Ref
    y: Ref
    bias: Ref | None
    batch: int
    heads: int
    kv_heads: int
    sq: int
    skv: int
    d: int
    dv: int
    q_strides: tuple[int, ...]
    k_strides: tuple[int, ...]
    v_strides: tuple[int, ...]
    y_strides: tuple[int, ...]
    bias_dims: tuple[int, ...] | None
    bias_strides: tuple[int, ...] | None
    dtype: np.dtype
    scale: float
    causal: bool

    def key(self) -> tuple:
        """What the cuDNN graph depends on (everything but the tensors' addresses)."""
        return (self.batch, self.heads, self.kv_heads, self.sq, self.skv, self.d, self.dv, self.q_strides,
                self.k_strides, self.v_strides, self.y_strides, self.bias_dims, self.bias_strides, str(self.dtype),
                self.scale, self.causal)

    def tensors(self) -> dict[str, Ref]:
        """The tensors cuDNN addresses, by the graph's names for them."""
        refs = {"q": self.q, "k": self.k, "v": self.v, "y": self.y}
        if self.bias is not None:
            refs["bias"] = self.bias
        return refs


@dataclass(kw_only=True)
class SdpaLaunch(Launch):
    """An Attention layer's flash_attention launch, with the same attention as a cuDNN SDPA graph (``sdpa``):
    runners with the cuDNN frontend run the graph instead (``CudnnAttentions.run``), and the launch wherever
    that declines."""

    sdpa: Sdpa


def bias_view(mask_strides: tuple[int, ...], batch: int, heads: int, sq: int, skv: int
              ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(dims, element strides) of an additive mask as cuDNN's SDPA bias, from its strides broadcast to the scores
    [batch, heads, sq, skv] (0 along broadcast dims); None when its keys are not contiguous.

    The form torch hands cuDNN: batch and query dims at full extent (stride 0 where broadcast), heads only when the
    mask varies by head (else 1), keys contiguous. A dim of extent 1 gets its contiguous stride (it never moves)."""
    mb, mh, mq, mk = mask_strides
    if skv > 1 and mk != 1:
        return None
    dims = (batch, heads if mh and heads > 1 else 1, sq, skv)
    natural = (dims[1] * sq * skv, sq * skv, skv, 1)
    strides = tuple(n if extent == 1 else s for extent, s, n in zip(dims, (mb, mh, mq, 1), natural))
    return dims, strides


def aligned(dims: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    """Every stride of a dim that moves (extent above 1) but the last is a multiple of ``ALIGN_BYTES``, and the last
    is 1."""
    if strides[-1] != 1 and dims[-1] > 1:
        return False
    return all(extent == 1 or s * itemsize % ALIGN_BYTES == 0 for extent, s in zip(dims[:-1], strides[:-1]))


def sdpa_for(tensors: Sequence[str | None], dims: tuple[int, ...],
             views: tuple[tuple[int, ...], ...], dtype: np.dtype, scale: float, causal: bool, mask_kind: int,
             mask_strides: tuple[int, ...]) -> Sdpa | None:
    """The cuDNN description of an Attention layer (``tensors``: Q, K, V, Y and the mask or None; ``dims``: batch,
    heads, kv heads, sq, skv, d, dv; ``views``: the Q/K/V/Y strides), or None where cuDNN's SDPA does not take it:
    fp32 (no fp32 SDPA), a boolean mask (cuDNN's bias is additive; the flash kernel reads booleans as they are),
    head sizes that are not multiples of 8 up to 256, a stride or head size missing 16-byte alignment."""
    batch, heads, kv_heads, sq, skv, d, dv = dims
    if dtype not in SDPA_DTYPES or mask_kind == 2:
        return None
    if d % 8 or dv % 8 or d > MAX_HEAD_DIM or dv > MAX_HEAD_DIM:
        return None
    shapes = ((batch, heads, sq, d), (batch, kv_heads, skv, d), (batch, kv_heads, skv, dv), (batch, heads, sq, dv))
    if not all(aligned(shape, strides, dtype.itemsize) for shape, strides in zip(shapes, views)):
        return None
    bias_dims = bias_strides = None
    if tensors[4] is not None:
        bias = bias_view(mask_strides, batch, heads, sq, skv)
        if bias is None or not aligned(*bias, dtype.itemsize):
            return None
        bias_dims, bias_strides = bias
    q, k, v, y, mask = (Ref(name) if name else None for name in tensors)
    assert q and k and v and y
    q_st, k_st, v_st, y_st = (tuple(int(s) for s in view) for view in views)
    return Sdpa(q, k, v, y, mask, batch, heads, kv_heads, sq, skv, d, dv, q_st, k_st, v_st, y_st, bias_dims,
                bias_strides, dtype, float(scale), bool(causal))


class _Built:
    def __init__(self, graph: Any, tensors: dict[str, Any], index: int, workspace: int) -> None:
        self.graph, self.tensors, self.index, self.workspace = graph, tensors, index, workspace


class CudnnAttentions(CudnnGraphs):
    """The SDPA graphs one context's cuDNN handle has built, and those cuDNN declined."""

    def __init__(self) -> None:
        super().__init__()
        self._built: dict[tuple, _Built] = {}
        #: Sdpa.key() -> why cuDNN does not run it (the flash kernel does); reported once each
        self.declined: dict[tuple, str] = {}

    def close(self) -> None:
        """Drop every cuDNN graph built here (a later run builds again); the handle and workspace stay."""
        self._built.clear()

    def _graph(self, op: Sdpa) -> tuple[Any, dict[str, Any]]:
        """The validated SDPA graph of ``op`` with its execution plans created (not built)."""
        cudnn = self.cudnn
        io = cudnn.data_type.HALF if op.dtype == F16 else cudnn.data_type.BFLOAT16
        f32 = cudnn.data_type.FLOAT
        graph = cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=self.handle)
        q_dims, kv_dims = [op.batch, op.heads, op.sq, op.d], [op.batch, op.kv_heads, op.skv, op.d]
        tensors = {"q": graph.tensor(name="Q", dim=q_dims, stride=list(op.q_strides), data_type=io),
                   "k": graph.tensor(name="K", dim=kv_dims, stride=list(op.k_strides), data_type=io),
                   "v": graph.tensor(name="V", dim=[op.batch, op.kv_heads, op.skv, op.dv], stride=list(op.v_strides),
                                     data_type=io)}
        if op.bias_dims is not None and op.bias_strides is not None:
            tensors["bias"] = graph.tensor(name="bias", dim=list(op.bias_dims), stride=list(op.bias_strides),
                                           data_type=io)
        # causal without past keys: key k is seen by query q when k <= q (top-left aligned, no band to the right)
        o, _ = graph.sdpa(name="sdpa", q=tensors["q"], k=tensors["k"], v=tensors["v"], generate_stats=False,
                          attn_scale=op.scale, bias=tensors.get("bias"),
                          diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT,
                          diagonal_band_right_bound=0 if op.causal else None, compute_data_type=f32)
        o.set_output(True).set_dim([op.batch, op.heads, op.sq, op.dv]).set_stride(list(op.y_strides))
        o.set_data_type(io)
        tensors["y"] = o
        plan_graph(cudnn, graph)
        return graph, tensors

    def _build(self, op: Sdpa) -> _Built:
        """``op``'s graph with the first execution plan (heuristics order) that builds within the workspace cap."""
        graph, tensors = self._graph(op)
        for index in range(int(graph.get_execution_plan_count())):
            try:
                graph.build_plan_at_index(index)
                workspace = int(graph.get_workspace_size_plan_at_index(index))
            except Exception:
                continue
            if workspace <= MAX_WORKSPACE_BYTES:
                break
        else:
            raise RuntimeError("no execution plan builds")
        self._grow_workspace(workspace, 1 << 20)
        return _Built(graph, tensors, index, workspace)

    def built(self, op: Sdpa) -> _Built | None:
        """``op``'s built graph, built on first use; None when cuDNN declines it (remembered, reported once)."""
        key = op.key()
        built = self._built.get(key)
        if built is not None or key in self.declined:
            return built
        try:
            built = self._built[key] = self._build(op)
        except Exception as e:  # no frontend support, check_support, no engine or plan for this graph
            self.declined[key] = f"{type(e).__name__}: {e}"[:400]
            DEFAULT_LOGGER.log(Severity.INFO, f"cuDNN SDPA declined attention {key}: {self.declined[key]}; "
                                              "the flash_attention kernel runs it")
        return built

    def run(self, op: SdpaLaunch, resolve: Any, stream: int) -> bool:
        """Execute ``op``'s cuDNN graph on ``stream`` (``resolve(Ref) -> device pointer``); False when cuDNN
        declines (the caller runs the launch itself)."""
        pointers = {name: resolve(ref) for name, ref in op.sdpa.tensors().items()}
        if any(p % ALIGN_BYTES for p in pointers.values()):
            return False
        built = self.built(op.sdpa)
        if built is None:
            return False
        self._use_stream(stream)
        assert self._workspace is not None  # _build allocated it
        pack = {built.tensors[name]: ptr for name, ptr in pointers.items()}
        built.graph.execute_plan_at_index(pack, self._workspace.ptr, built.index, handle=self.handle)
        return True


__all__ = ["ALIGN_BYTES", "CudnnAttentions", "Sdpa", "SdpaLaunch", "aligned", "bias_view", "sdpa_for"]
