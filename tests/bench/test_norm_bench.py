"""bench.norm's models are what its table says they time: one fused SkipLayerNorm layer (writing int8 too in the
quantizing case), equal to the unfused graph on the CPU backend."""

from __future__ import annotations

import numpy as np
import pytest

from bench import norm
from bench.engine import layer_engine
from engine_core.backends.cpu import GraphRunner
from tests.engine.util import parsed_graph


@pytest.mark.parametrize("quantize", [False, True])
def test_norm_bench_case_is_one_fused_skip_layer_norm(quantize):
    rows = 16
    model = norm.model(rows, quantize)
    engine = layer_engine(model, {"x": (rows, norm.COLS), "skip": (rows, norm.COLS)})
    assert [layer["type"] for layer in engine.plan.layers] == ["SkipLayerNorm"], engine.plan.layers
    rng = np.random.default_rng(1)
    feeds = {name: rng.standard_normal((rows, norm.COLS)).astype(np.float16) for name in ("x", "skip")}
    got = engine.create_execution_context().infer(feeds)
    want = GraphRunner(parsed_graph(model)).run(feeds)
    for name in ("yq", "y") if quantize else ("y",):
        np.testing.assert_array_equal(got[name], want[name])
