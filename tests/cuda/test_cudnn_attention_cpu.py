"""cuDNN's SDPA as the second implementation of Attention, without a GPU: which layers the lowering hands it
(``SdpaLaunch``) and which keep the plain flash launch, the cuDNN description (Q/K/V/Y strides, the mask as a
broadcast bias, causal, grouped-query heads) computing what the CPU backend computes when emulated from that
description alone, the graph calls made from it, and the fallbacks: a graph cuDNN declines or an unaligned address
runs the flash launch, never raises."""

from __future__ import annotations

import copy
import sys
import types

import numpy as np
import onnx
import pytest
from onnx import TensorProto

import engine_core as kiln
from engine_core.backends.cuda import cudnn_graph
from engine_core.backends.cuda.cudnn_attention import CudnnAttentions, Sdpa, SdpaLaunch, bias_view
from engine_core.backends.cuda.lowering import Launch, LoweringOptions, lower_graph
from engine_core.interpret import GraphRunner
from engine_core.ops import TensorInfo
from engine_core.passes import PIPELINE, infer_shapes
from tests.cuda.emulate import Emulator
from tests.cuda.models import attention_inputs, attention_model

CUDNN = LoweringOptions(cudnn=True)


def attention(batch=2, heads=4, seq=16, dim=64, *, kv_heads=None, kv_seq=None, three_d=False, mask=None, causal=0,
              dtype=TensorProto.FLOAT16, quantize=False) -> onnx.ModelProto:
    """One ONNX Attention (opset 23): [B, H, S, D] operands or the 3-D packed form [B, S, H*D]; ``mask``: the
    additive mask's shape (same type as Q), "bool" for a boolean [Sq, Skv] band, None for none; ``quantize``:
    a QuantizeLinear after it (the builder fuses the pair into kiln.AttentionQuantize)."""
    return attention_model(batch, heads, seq, dim, causal, dtype, kv_heads, three_d,
                           "" if mask is None else mask, kv_seq, quantize)


def feeds_for(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded Q/K/V; an additive mask hiding the last third of the keys of every other batch (and, where it varies
    by head or query, a few more), or a boolean band."""
    rng = np.random.default_rng(seed)

    def padded_and_sprinkled(shape: list[int], dtype: np.dtype) -> np.ndarray:
        mask = np.where(rng.random(shape) < 0.1, -10000, 0).astype(dtype)
        mask[1::2, ..., shape[-1] - shape[-1] // 3:] = -10000
        return mask

    return attention_inputs(model, rng, padded_and_sprinkled)


def lowered(model: onnx.ModelProto, feeds: dict[str, np.ndarray], options: LoweringOptions = CUDNN):
    """(graph after the pipeline, its CUDA lowering at the feeds' shapes with ``options``)."""
    net = kiln.Builder().create_network()
    assert kiln.OnnxParser(net).parse(model)
    graph = copy.deepcopy(net.graph)
    for graph_pass in PIPELINE:
        graph_pass(graph)
    infos = infer_shapes(graph, {v.name: TensorInfo(v.dtype, feeds[v.name].shape) for v in graph.inputs}, values=True)
    return graph, lower_graph(graph, infos, None, options)


def attention_op(low):
    (step,) = [s for s in low.steps if s.node.op_type in ("Attention", "AttentionQuantize")]
    (op,) = step.ops
    return step, op


class SdpaEmulator(Emulator):
    """Runs an SdpaLaunch from its cuDNN description alone (not its flash launch's arguments): what cuDNN's graph
    computes from the dims and strides it is given."""

    def _sdpalaunch(self, op: SdpaLaunch) -> None:
        s = op.sdpa
        self.ran.append(s)
        q = self.view(s.q, s.dtype, (s.batch, s.heads, s.sq, s.d), s.q_strides).astype(np.float64)
        k = self.view(s.k, s.dtype, (s.batch, s.kv_heads, s.skv, s.d), s.k_strides).astype(np.float64)
        v = self.view(s.v, s.dtype, (s.batch, s.kv_heads, s.skv, s.dv), s.v_strides).astype(np.float64)
        group = s.heads // s.kv_heads  # query head h reads K/V head h // group
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("bhqd,bhkd->bhqk", q, k) * s.scale
        if s.bias is not None:
            scores = scores + self.view(s.bias, s.dtype, s.bias_dims, s.bias_strides).astype(np.float64)
        if s.causal:  # top-left: query q sees keys 0..q
            scores = np.where(np.arange(s.skv)[None, :] > np.arange(s.sq)[:, None], -np.inf, scores)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out = np.einsum("bhqk,bhkd->bhqd", p / p.sum(-1, keepdims=True), v)
        self.view(s.y, s.dtype, (s.batch, s.heads, s.sq, s.dv), s.y_strides)[...] = out

    def run(self):
        self.ran: list[Sdpa] = []
        return super().run()


CASES = {
    "bert 3-D, padding mask [B,1,1,S]": dict(batch=3, heads=12, seq=32, three_d=True, mask=[3, 1, 1, 32]),
    "4-D, mask [B,1,Sq,Skv]": dict(mask=[2, 1, 16, 16]),
    "per-head mask [1,H,Sq,Skv] (T5)": dict(heads=4, seq=24, mask=[1, 4, 24, 24]),
    "causal d128": dict(dim=128, seq=40, causal=1),
    "causal, fewer queries than keys": dict(seq=24, kv_seq=40, causal=1, mask=[2, 1, 1, 40]),
    "grouped-query 3-D": dict(heads=8, kv_heads=2, seq=24, three_d=True, mask=[2, 1, 1, 24]),
    "whisper-like seq 1500": dict(batch=1, heads=2, seq=1500, three_d=True),
    "bf16 causal with a mask": dict(dtype=TensorProto.BFLOAT16, seq=32, causal=1, mask=[2, 1, 32, 32]),
    "head size 32": dict(dim=32, seq=16, mask=[2, 1, 1, 16]),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_the_cudnn_description_computes_what_the_cpu_backend_computes(case):
    model = attention(**case)
    feeds = feeds_for(model)
    graph, low = lowered(model, feeds)
    step, op = attention_op(low)
    assert isinstance(op, SdpaLaunch) and step.tactic.endswith(("cudnn_sdpa", "flash_attention"))
    assert {ref.tensor for ref in op.sdpa.tensors().values()} == set(feeds) | {"y"}  # the layer's own I/O
    emulator = SdpaEmulator(graph, low, feeds)
    got = emulator.run()["y"].astype(np.float32)
    assert emulator.ran == [op.sdpa]
    want = GraphRunner(graph).run(feeds)["y"].astype(np.float32)
    tol = 3e-2 if case.get("dtype") == TensorProto.BFLOAT16 else 1e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_without_the_cudnn_option_the_layer_is_the_plain_flash_launch():
    """``LoweringOptions(cudnn=False)`` means no cuDNN: the same flash launch, not an SdpaLaunch; with it, the
    SdpaLaunch is that launch (what runs wherever cuDNN declines) plus the description."""
    model = attention(**CASES["bert 3-D, padding mask [B,1,1,S]"])
    feeds = feeds_for(model)
    _, plain = attention_op(lowered(model, feeds, LoweringOptions())[1])
    _, sdpa = attention_op(lowered(model, feeds)[1])
    assert type(plain) is Launch and plain.function == "flash_attention_64_f16"
    assert isinstance(sdpa, SdpaLaunch)
    assert {name: value for name, value in vars(sdpa).items() if name not in ("sdpa", "args")} == \
        {name: value for name, value in vars(plain).items() if name != "args"}
    assert [value for value, _ in sdpa.args[:5]] == [value for value, _ in plain.args[:5]]  # Q, K, V, Y, mask
    s = sdpa.sdpa
    assert (s.batch, s.heads, s.kv_heads, s.sq, s.skv, s.d, s.dv) == (3, 12, 12, 32, 32, 64, 64)
    assert s.q_strides == (32 * 768, 64, 768, 1)  # [B, S, H*D] read as [B, H, S, D]: no transposes
    assert (s.bias_dims, s.bias_strides) == ((3, 1, 32, 32), (32, 32 * 32, 0, 1))


@pytest.mark.parametrize("case, why", [
    (dict(mask="bool"), "boolean mask (cuDNN's bias is additive)"),
    (dict(dtype=TensorProto.FLOAT, three_d=True), "fp32 (TF32 flash kernel; no fp32 SDPA)"),
    (dict(seq=80, kv_seq=70, mask=[2, 1, 80, 70]), "mask rows of 70 fp16: not 16-byte aligned"),
    (dict(mask=[2, 1, 1, 16], quantize=True), "AttentionQuantize: its flash kernel writes int8 itself"),
])
def test_layers_cudnn_does_not_take_keep_the_flash_launch(case, why):
    model = attention(**case)
    feeds = feeds_for(model)
    options = LoweringOptions(cudnn=True, tf32=case.get("dtype") == TensorProto.FLOAT)
    step, op = attention_op(lowered(model, feeds, options)[1])
    assert type(op) is Launch and op.module == "flash_attention", why
    assert step.tactic.startswith("kernel:flash_attention"), why


@pytest.mark.parametrize("strides, shape, want", [
    # BERT's padding mask [B, 1, 1, S] over 12 heads and 128 queries: batch rows, queries broadcast
    ((128, 0, 0, 1), (4, 12, 128, 128), ((4, 1, 128, 128), (128, 128 * 128, 0, 1))),
    # a [Sq, Skv] mask shared by every batch: batch broadcast by a zero stride, heads not expanded
    ((0, 0, 64, 1), (2, 8, 32, 64), ((2, 1, 32, 64), (0, 32 * 64, 64, 1))),
    # T5's per-head bias [1, H, Sq, Skv] at batch 1: the batch dim never moves (its contiguous stride)
    ((0, 256, 16, 1), (1, 4, 16, 16), ((1, 4, 16, 16), (4 * 256, 256, 16, 1))),
    # keys that are not contiguous: not a bias cuDNN reads
    ((0, 0, 1, 40), (2, 4, 40, 40), None),
])
def test_bias_view_is_the_mask_broadcast_to_the_scores(strides, shape, want):
    assert bias_view(strides, *shape) == want


# -- CudnnAttentions with a stand-in for the frontend (no GPU, no cuDNN) ----------------------------------------


class FakeTensor:
    def __init__(self, **attrs):
        self.attrs = dict(attrs)

    def set_output(self, value):
        self.attrs["output"] = value
        return self

    def set_dim(self, dims):
        self.attrs["dim"] = dims
        return self

    def set_stride(self, strides):
        self.attrs["stride"] = strides
        return self

    def set_data_type(self, dtype):
        self.attrs["data_type"] = dtype
        return self


class FakeGraph:
    def __init__(self, frontend, **attrs):
        self.frontend, self.attrs, self.tensors, self.executed = frontend, attrs, {}, []
        frontend.graphs.append(self)

    def tensor(self, name, **attrs):
        self.tensors[name] = FakeTensor(name=name, **attrs)
        return self.tensors[name]

    def sdpa(self, **kwargs):
        self.sdpa_args = kwargs
        self.output = FakeTensor()
        return [self.output, None]

    def validate(self):
        pass

    def build_operation_graph(self):
        pass

    def create_execution_plans(self, modes):
        pass

    def check_support(self):
        if self.frontend.unsupported:
            raise RuntimeError("[cudnn_frontend] Error: GRAPH_NOT_SUPPORTED")

    def get_execution_plan_count(self):
        return 2

    def build_plan_at_index(self, index):
        if index == 0:
            raise RuntimeError("plan 0 does not build")

    def get_workspace_size_plan_at_index(self, index):
        return 4096

    def execute_plan_at_index(self, pack, workspace, index, handle=None):
        self.executed.append((pack, workspace, index, handle))


class FakeBuffer:
    def __init__(self, nbytes):
        self.nbytes, self.ptr = nbytes, 0x7000


def fake_frontend(unsupported: bool = False) -> types.ModuleType:
    """A stand-in ``cudnn`` module recording the graphs made through it (the real frontend's names)."""
    frontend = types.ModuleType("cudnn")
    frontend.graphs, frontend.unsupported, frontend.streams = [], unsupported, []
    frontend.data_type = types.SimpleNamespace(HALF="half", BFLOAT16="bf16", FLOAT="float")
    frontend.diagonal_alignment = types.SimpleNamespace(TOP_LEFT="top_left", BOTTOM_RIGHT="bottom_right")
    frontend.heur_mode = types.SimpleNamespace(A="A", FALLBACK="FALLBACK")
    frontend.create_handle = lambda: 0x1234
    frontend.set_stream = lambda handle, stream: frontend.streams.append(stream)
    frontend.pygraph = lambda **attrs: FakeGraph(frontend, **attrs)
    return frontend


@pytest.fixture
def frontend(monkeypatch):
    module = fake_frontend()
    monkeypatch.setitem(sys.modules, "cudnn", module)
    monkeypatch.setattr(cudnn_graph, "DeviceBuffer", FakeBuffer)
    return module


def sdpa_launch(case: str = "grouped-query 3-D") -> SdpaLaunch:
    model = attention(**CASES[case])
    return attention_op(lowered(model, feeds_for(model))[1])[1]


def addresses(op: SdpaLaunch, misaligned: str = ""):
    """resolve() for ``op``'s tensors: 256-byte aligned addresses, ``misaligned``'s 8 bytes off."""
    base = {name: 0x10000 * (i + 1) + (8 if name == misaligned else 0) for i, name in enumerate(op.sdpa.tensors())}
    by_tensor = {ref.tensor: base[name] for name, ref in op.sdpa.tensors().items()}
    return lambda ref: by_tensor[ref.tensor], base


def test_the_graph_is_made_from_the_description(frontend):
    """Q/K/V/Y as [B, H, S, D] tensors with the description's strides (grouped-query K/V with their own head count),
    the bias broadcast by strides, the scale, no stats; the first plan that builds runs with a workspace."""
    op = sdpa_launch()
    s = op.sdpa
    resolve, pointers = addresses(op)
    attentions = CudnnAttentions()
    assert attentions.run(op, resolve, stream=5)
    (graph,) = frontend.graphs
    assert graph.attrs["io_data_type"] == "half" and graph.attrs["compute_data_type"] == "float"
    dims = {name: (t.attrs["dim"], t.attrs["stride"]) for name, t in graph.tensors.items()}
    assert dims == {"Q": ([2, 8, 24, 64], [24 * 512, 64, 512, 1]), "K": ([2, 2, 24, 64], [24 * 128, 64, 128, 1]),
                    "V": ([2, 2, 24, 64], [24 * 128, 64, 128, 1]),
                    "bias": ([2, 1, 24, 24], [24, 24 * 24, 0, 1])}
    args = graph.sdpa_args
    assert args["attn_scale"] == s.scale == pytest.approx(1 / 8) and args["generate_stats"] is False
    assert args["bias"] is graph.tensors["bias"] and args["diagonal_band_right_bound"] is None
    assert graph.output.attrs == {"output": True, "dim": [2, 8, 24, 64], "stride": [24 * 512, 64, 512, 1],
                                  "data_type": "half"}
    ((pack, workspace, index, handle),) = graph.executed
    assert index == 1 and handle == 0x1234 and workspace == 0x7000 and frontend.streams == [5]
    want = {graph.tensors["Q"]: pointers["q"], graph.tensors["K"]: pointers["k"], graph.tensors["V"]: pointers["v"],
            graph.tensors["bias"]: pointers["bias"], graph.output: pointers["y"]}
    assert pack == want
    assert attentions.run(op, resolve, stream=5) and len(frontend.graphs) == 1  # built once, the stream set once
    assert frontend.streams == [5] and attentions.workspace_generation == 1


def test_causal_is_top_left_with_no_band_to_the_right(frontend):
    op = sdpa_launch("causal, fewer queries than keys")
    assert CudnnAttentions().run(op, addresses(op)[0], stream=0)
    args = frontend.graphs[0].sdpa_args
    assert args["diagonal_alignment"] == "top_left" and args["diagonal_band_right_bound"] == 0


def test_a_graph_cudnn_declines_runs_the_flash_launch_and_is_not_tried_again(frontend):
    frontend.unsupported = True
    op = sdpa_launch()
    attentions = CudnnAttentions()
    assert not attentions.run(op, addresses(op)[0], stream=0)
    assert not attentions.run(op, addresses(op)[0], stream=0)
    assert len(frontend.graphs) == 1 and not frontend.graphs[0].executed
    assert "GRAPH_NOT_SUPPORTED" in attentions.declined[op.sdpa.key()]


@pytest.mark.parametrize("tensor", ["q", "bias", "y"])
def test_an_unaligned_address_runs_the_flash_launch(frontend, tensor):
    op = sdpa_launch()
    attentions = CudnnAttentions()
    assert not attentions.run(op, addresses(op, misaligned=tensor)[0], stream=0)
    assert frontend.graphs == [] and attentions.declined == {}  # nothing built or remembered: addresses vary
    assert attentions.run(op, addresses(op)[0], stream=0)


def test_close_drops_the_built_graphs(frontend):
    op = sdpa_launch()
    attentions = CudnnAttentions()
    assert attentions.run(op, addresses(op)[0], stream=0)
    attentions.close()
    assert attentions.run(op, addresses(op)[0], stream=0) and len(frontend.graphs) == 2


@pytest.mark.parametrize("enabled", [True, False])
def test_the_cudnn_attention_knob_decides_between_cudnn_and_the_flash_launch(frontend, enabled):
    """BuilderConfig.cudnn_attention / KILN_CUDNN_ATTENTION=0: every attention runs its flash launch, cuDNN untouched."""
    from engine_core.backends.cuda.runner_launch import LaunchMixin

    op = sdpa_launch()
    resolve, _ = addresses(op)
    flash: list[int] = []
    forgotten: list[bool] = []
    runner = types.SimpleNamespace(cudnn_attention=enabled, _attentions=None, forget_graphs=lambda: forgotten.append(True))
    runner._sdpa = lambda op, resolve, stream: LaunchMixin._sdpa(runner, op, resolve, stream)  # type: ignore[arg-type]
    binding = types.SimpleNamespace(prepared={id(op): types.SimpleNamespace(run=lambda resolve, stream: flash.append(stream))})
    LaunchMixin._run_step(runner, types.SimpleNamespace(ops=[op]), binding, resolve, 7)  # type: ignore[arg-type]
    assert (len(frontend.graphs), flash) == ((1, []) if enabled else (0, [7]))
    assert forgotten == ([True] if enabled else [])  # cuDNN's first workspace: graphs captured before are stale
