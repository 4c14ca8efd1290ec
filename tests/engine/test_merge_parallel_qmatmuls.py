"""merge_parallel_qmatmuls: a BERT layer's Q, K and V QMatMuls (one int8 input) become one QMatMul of concatenated
weights and a Split, bit for bit the same outputs; on the CUDA backend's INT8 GEMM the kernel writes the Split's
parts itself (emulated here), and where that kernel does not apply the merged GEMM and a copying Split run."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import engine_core as kiln
from engine_core import builder
from engine_core.backends.cuda import qgemm
from engine_core.backends.cuda.lowering import LoweringOptions
from engine_core.interpret import GraphRunner
from engine_core.passes import FUSION_PASSES, merge_parallel_qmatmuls
from engine_core.passes.merge_parallel_qmatmuls import WIDTH_MULTIPLE
from tests.cuda.emulate import Emulator
from tests.cuda.models import bert_feeds, lowered_at, optimized_graph
from tools.make_models import bert_qdq

LAYERS, HIDDEN = 2, 128


@functools.cache
def _bert(hidden: int = HIDDEN):
    return bert_qdq(layers=LAYERS, hidden=hidden, heads=4, ffn=2 * hidden, vocab=1000, max_positions=128)


def _without_merge(monkeypatch) -> None:
    monkeypatch.setattr(builder, "FUSION_PASSES", tuple(p for p in FUSION_PASSES if p is not merge_parallel_qmatmuls))


def test_the_merge_width_is_the_int8_gemms_tile():
    assert WIDTH_MULTIPLE == qgemm.TILE_N


def test_q_k_v_of_each_layer_become_one_qmatmul_and_a_split_with_the_same_outputs(monkeypatch):
    feeds = bert_feeds(2, 16)
    merged = optimized_graph(_bert(), feeds)
    splits = [n for n in merged.nodes if n.op_type == "Split"]
    assert len(splits) == LAYERS
    for split in splits:
        gemm = next(n for n in merged.nodes if n.outputs == [split.inputs[0]])
        assert gemm.op_type == "QMatMul" and merged.constants[split.inputs[1]].tolist() == [HIDDEN] * 3
        assert merged.constants[gemm.inputs[2]].shape in ((3 * HIDDEN, HIDDEN), (HIDDEN, 3 * HIDDEN))
    _without_merge(monkeypatch)
    plain = optimized_graph(_bert(), feeds)
    assert not [n for n in plain.nodes if n.op_type == "Split"]
    assert sum(n.op_type == "QMatMul" for n in plain.nodes) == sum(n.op_type == "QMatMul" for n in merged.nodes) + 2 * LAYERS
    got, want = GraphRunner(merged).run(feeds), GraphRunner(plain).run(feeds)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value)


def test_widths_off_the_tile_stay_separate():
    graph = optimized_graph(_bert(hidden=64), bert_feeds(2, 16))  # 64-wide Q / K / V: half a tile
    assert not [n for n in graph.nodes if n.op_type == "Split"]


@pytest.mark.parametrize("min_tiles", [0, 10**6], ids=["kernel-writes-the-parts", "cublaslt-and-a-copying-split"])
def test_emulated_merged_qkv_equals_the_cpu_backend(min_tiles, monkeypatch):
    """Kiln's INT8 GEMM: one launch for Q, K and V writing the three tensors (the Split has no launches); under
    ``MIN_TILES`` the cuBLASLt INT8 GEMM writes the merged tensor and the Split's parts are views of it, which the
    int8 flash attention reads through their strides (no launches either)."""
    monkeypatch.setattr(qgemm, "MIN_TILES", min_tiles)
    feeds = bert_feeds(2, 16)
    graph = optimized_graph(_bert(), feeds, kiln.BuilderFlag.FP16)
    lowered = lowered_at(graph, feeds, LoweringOptions(qgemm_sm90=True))
    splits = [s for s in lowered.steps if s.node.name.endswith("_merged_split")]
    gemms = [s for s in lowered.steps if s.node.name.endswith("_merged")]
    assert len(splits) == len(gemms) == LAYERS
    for gemm, split in zip(gemms, splits):
        if min_tiles == 0:
            (launch,) = gemm.ops
            assert launch.function == "qgemm_sm90_128_00_f16" and launch.args[3][0] == HIDDEN  # the part width
            assert len(gemm.node.outputs) == 3 and not split.ops and split.tactic == "fused:qgemm_split"
        else:
            assert gemm.tactic == "gemm:cublaslt_int8" and not split.ops and split.tactic == "view"
    got, want = Emulator(graph, lowered, feeds).run(), GraphRunner(graph).run(feeds)
    for name, value in want.items():  # as test_qgemm's bert_qdq: LayerNorm / attention rounding elsewhere
        assert float(np.abs(got[name] - value).max()) <= 1e-2 * float(np.abs(value).max()), name


@pytest.mark.gpu
def test_merged_qkv_on_the_gpu_matches_the_cpu_backend(monkeypatch):
    """The sm_90 INT8 GEMM writing Q, K and V through one launch (``MIN_TILES`` 0: these small layers take it)
    against the CPU backend, captured CUDA graph replay included."""
    if not qgemm.available():
        pytest.skip("not an sm_90 GPU (or KILN_QGEMM=0)")
    from tests.cuda.models import build_engine

    monkeypatch.setattr(qgemm, "MIN_TILES", 0)
    profiles = {n: ((1, 16), (2, 16), (4, 16)) for n in ("input_ids", "attention_mask", "token_type_ids")}
    gpu, cpu = (build_engine(_bert(), backend, profiles, kiln.BuilderFlag.FP16) for backend in ("cuda", "cpu"))
    gctx, cctx = gpu.create_execution_context(), cpu.create_execution_context()
    for batch in (1, 4, 4):  # the repeated shape replays its captured graph
        feeds = bert_feeds(batch, 16, seed=batch)
        got, want = gctx.infer(feeds), cctx.infer(feeds)
        for name, value in want.items():
            assert float(np.abs(got[name] - value).max()) <= 1e-2 * float(np.abs(value).max()), name
    tactics = {step.node.name: step.tactic for b in gctx._backend_context._bindings.values() for step in b.lowered.steps}
    assert sum(t == "fused:qgemm_split" for t in tactics.values()) == LAYERS, tactics
