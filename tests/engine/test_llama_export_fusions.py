"""fuse_rms_norm and fuse_rotary on the zoo's real Llama export (bench/zoo.py ``llama_small``: transformers'
LlamaModel, 4 layers, GQA 8/2 heads, exported by ``zoo.export``): every RMSNorm (two per layer and the final one)
and the rotary embedding of every q and k fuse, and the fused graph computes what the pipeline without the two passes
computes, on the CPU backend. The export is 110 MB and lives outside the repository: the test skips without it
(KILN_ZOO_DIR, default /tmp/zc, holds the zoo's exports)."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest

from engine_core.interpret import GraphRunner
from engine_core.ir import Graph
from engine_core.passes import PIPELINE, fuse_rms_norm, fuse_rotary
from tests.engine.util import parsed_graph

EXPORT = Path(os.environ.get("KILN_ZOO_DIR", "/tmp/zc")) / "llama_small.onnx"
LAYERS = 4


def _optimized(model: onnx.ModelProto, skip: tuple = ()) -> tuple[Graph, dict[str, int]]:
    graph = parsed_graph(model)
    counts = {p.__name__: p(graph) for p in PIPELINE if p not in skip}
    return graph, counts


@pytest.mark.skipif(not EXPORT.is_file(), reason=f"no zoo export at {EXPORT}")
def test_llama_export_fuses_every_rms_norm_and_rotary_embedding():
    model = onnx.load(str(EXPORT))
    unfused, _ = _optimized(model, skip=(fuse_rms_norm, fuse_rotary))
    fused, counts = _optimized(model)
    assert counts["fuse_rms_norm"] == 2 * LAYERS + 1 and counts["fuse_rotary"] == 2 * LAYERS
    before, after = Counter(n.op_type for n in unfused.nodes), Counter(n.op_type for n in fused.nodes)
    assert after["RMSNormalization"] == 2 * LAYERS + 1 and after["Rotary"] == 2 * LAYERS
    for op in ("Pow", "ReduceMean", "Slice", "Neg"):  # left in no layer
        assert before[op] >= 2 * LAYERS and not after[op], op
    assert before["Transpose"] - after["Transpose"] == 2 * LAYERS  # the q and k head Transposes, read through perm
    rotaries = [n for n in fused.nodes if n.op_type == "Rotary"]
    assert all(n.attrs == {"interleaved": 0, "perm": [0, 2, 1, 3]} for n in rotaries)

    rng = np.random.default_rng(0)
    mask = np.ones((2, 128), np.int64)
    mask[1, 100:] = 0
    feeds = {"input_ids": rng.integers(0, 32000, (2, 128)).astype(np.int64), "attention_mask": mask}
    want, got = GraphRunner(unfused).run(feeds), GraphRunner(fused).run(feeds)
    for name in unfused.output_names:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=name)
