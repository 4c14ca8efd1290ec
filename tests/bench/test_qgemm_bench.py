"""bench.qgemm's models are what its table says they time: one fused QMatMul layer per case (requantizing to int8
in the int8-output cases, GELU in FFN1's), equal to the unfused graph on the CPU backend."""

from __future__ import annotations

import numpy as np
import pytest

from bench import qgemm
from bench.engine import layer_engine
from engine_core.interpret import GraphRunner
from tests.engine.util import parsed_graph


@pytest.mark.parametrize("case", qgemm.CASES, ids=lambda c: c.name)
def test_qgemm_bench_case_is_one_fused_qmatmul(case):
    rows = 8
    model = qgemm.int8_model(case, rows)
    engine = layer_engine(model, (rows, case.k), fp16=True)
    (layer,) = engine.plan.graph.nodes
    assert layer.op_type == "QMatMul" and layer.attr("activation", "") == ("Gelu" if case.gelu else "")
    assert (len(layer.inputs) > 5 and bool(layer.inputs[5])) == case.int8_out  # y_scale: the requantizing epilogue
    x = np.random.default_rng(0).integers(-127, 128, (rows, case.k)).astype(np.int8)
    got = engine.create_execution_context().infer({"x": x})["y"]
    assert got.dtype == (np.int8 if case.int8_out else np.float16)
    want = GraphRunner(parsed_graph(model)).run({"x": x})["y"]
    if case.int8_out:  # fp16 rounding before the quantizer in the fp16 build: a value on a boundary may move a step
        assert np.abs(got.astype(np.int32) - want).max() <= 1
    else:  # the unfused fp16 graph rounds the dequantized operands and its sums to fp16
        error = np.abs(got.astype(np.float32) - want.astype(np.float32))
        assert float(error.max()) <= 1e-2 * float(np.abs(want).max())
