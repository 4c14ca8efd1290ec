"""bench.norm's models are what its table says they time: one fused SkipLayerNorm layer (writing int8 too in the
quantizing case), equal to the unfused graph on the CPU backend."""

from __future__ import annotations

import numpy as np
import pytest

from bench import norm
from bench.engine import layer_engine
from engine_core.interpret import GraphRunner
from tests.engine.util import parsed_graph


@pytest.mark.parametrize("quantize, int8_inputs", [(False, False), (True, False), (True, True)])
def test_norm_bench_case_is_one_fused_skip_layer_norm(quantize, int8_inputs):
    rows = 16
    model = norm.model(rows, quantize, int8_inputs)
    engine = layer_engine(model, {"x": (rows, norm.COLS), "skip": (rows, norm.COLS)}, fp16=int8_inputs)
    assert [layer["type"] for layer in engine.plan.layers] == ["SkipLayerNorm"], engine.plan.layers
    rng = np.random.default_rng(1)
    feeds = {name: rng.standard_normal((rows, norm.COLS)).astype(np.float16) for name in ("x", "skip")}
    if int8_inputs:
        feeds = {name: rng.integers(-127, 128, (rows, norm.COLS)).astype(np.int8) for name in feeds}
    got = engine.create_execution_context().infer(feeds)
    if int8_inputs:  # an fp16 build of the fp32 model: the int8 output within one step of the fp32 graph's
        (layer,) = engine.plan.graph.nodes
        assert layer.outputs[0] == "" and len(layer.inputs) == 8
        want = GraphRunner(parsed_graph(model)).run(feeds)
        steps = np.abs(got["yq"].astype(np.int32) - want["yq"])
        assert steps.max() <= 1 and np.mean(steps > 0) < 0.05
        return
    want = GraphRunner(parsed_graph(model)).run(feeds)
    for name in ("yq", "y") if quantize else ("y",):
        np.testing.assert_array_equal(got[name], want[name])
