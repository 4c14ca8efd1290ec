"""Weight streaming: the pure schedule (engine_core.weight_streaming) and the engine's reference API."""

from __future__ import annotations

import numpy as np
import pytest

import engine_core as kiln
from engine_core.types import BuilderFlag
from engine_core.weight_streaming import automatic_budget, choose_resident, plan_streaming
from tests.engine import models

# four layers in run order; "emb" is read by the first and the last (tied weights)
LAYERS = [
    ("embed", [("emb", 4000)]),
    ("fc1", [("w1", 3000), ("b1", 100)]),
    ("relu", []),
    ("fc2", [("w2", 2000)]),
    ("head", [("emb", 4000)]),
]
TOTAL = 4000 + 3000 + 100 + 2000


def test_budget_at_or_above_the_total_streams_nothing():
    for budget in (TOTAL, TOTAL * 2):
        plan = plan_streaming(LAYERS, budget)
        assert not plan.streaming and plan.scratch_bytes == 0 and plan.resident_bytes == TOTAL


def test_budget_zero_streams_everything_double_buffered():
    plan = plan_streaming(LAYERS, 0)
    assert plan.resident == () and plan.streamable_bytes == TOTAL
    assert [(s.layer, s.slot, s.issue_after) for s in plan.steps] == [
        ("embed", 0, -1), ("fc1", 1, -1), ("fc2", 0, 0), ("head", 1, 1)]  # a slot refills after its last reader
    fc1 = plan.steps[1]
    assert [(u.weight, u.offset) for u in fc1.uploads] == [("w1", 0), ("b1", 3072)]  # 256-byte aligned
    assert plan.slot_bytes == (4096, 4096)  # slot 0: embed, fc2; slot 1: fc1 (3072 + 256), head
    assert plan.steps[1].nbytes == 3100 and plan.scratch_bytes == 8192
    assert plan.streamed_bytes_per_run == 4000 + 3100 + 2000 + 4000  # the tied weight goes up twice


def test_weights_with_more_readers_stay_resident_first():
    assert choose_resident(LAYERS, 4000) == {"emb"}  # read twice: saves 8000 bytes of uploads per run
    assert choose_resident(LAYERS, 3999) == {"w1", "b1"}  # earliest first among single readers, while they fit
    plan = plan_streaming(LAYERS, 4100)
    assert plan.resident == ("b1", "emb") and [s.layer for s in plan.steps] == ["fc1", "fc2"]
    assert plan.step_for(1).uploads[0].weight == "w1" and plan.step_for(0) is None


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="must be >= 0"):
        plan_streaming(LAYERS, -1)
    with pytest.raises(ValueError, match="sizes 4000 and 10"):
        plan_streaming([("a", [("emb", 4000)]), ("b", [("emb", 10)])], 0)


def test_automatic_budget_fits_free_memory():
    assert automatic_budget(LAYERS, free_bytes=10**9, activation_bytes=0) == TOTAL  # everything fits
    worst = plan_streaming(LAYERS, 0).scratch_bytes
    assert worst == 8192  # all of it doesn't fit in 10000 - 500 - 1000: keep what fits beside the worst scratch
    assert automatic_budget(LAYERS, free_bytes=10000, activation_bytes=500, headroom=1000) == 10000 - 500 - worst - 1000
    assert automatic_budget(LAYERS, free_bytes=100, activation_bytes=500) == 0


# -- the engine API -----------------------------------------------------------------------------


def _engine(flags=(BuilderFlag.WEIGHT_STREAMING,)) -> kiln.CudaEngine:
    builder = kiln.Builder()
    network = builder.create_network()
    assert kiln.OnnxParser(network).parse(models.mlp().SerializeToString())
    config = builder.create_builder_config()
    config.backend = "cpu"
    for flag in flags:
        config.set_flag(flag)
    profile = builder.create_optimization_profile()
    profile.set_shape("x", (1, 16), (2, 16), (4, 16))
    config.add_optimization_profile(profile)
    return kiln.Runtime().load(kiln.build_plan(network, config))


def test_engine_budget_semantics_and_outputs_unchanged(rng):
    engine = _engine()
    weights = engine.plan.graph.constants
    total = sum(v.nbytes for v in weights.values() if v.dtype.kind == "f")
    assert engine.streamable_weights_size == total > 0
    assert engine.weight_streaming_budget_v2 == total  # default: streaming off
    assert engine.weight_streaming_scratch_memory_size == 0
    assert engine.device_memory_size_v2 == engine.device_memory_size
    assert engine.weight_streaming_budget == -1
    x = rng.standard_normal((3, 16)).astype(np.float32)
    context = engine.create_execution_context()
    expected = context.infer({"x": x})["y"]
    with pytest.raises(ValueError, match="while execution contexts"):
        engine.weight_streaming_budget_v2 = 0
    del context  # the reference: the budget changes only while the engine has no contexts
    engine.weight_streaming_budget_v2 = 0
    plan = engine.weight_streaming_plan
    assert plan.resident == () and engine.weight_streaming_scratch_memory_size == plan.scratch_bytes > 0
    assert engine.device_memory_size_v2 == engine.device_memory_size + plan.scratch_bytes
    assert engine.minimum_weight_streaming_budget == plan.scratch_bytes
    np.testing.assert_array_equal(engine.create_execution_context().infer({"x": x})["y"], expected)


def test_engine_budget_errors_are_reported(rng):
    engine = _engine()
    engine.error_recorder = recorder = kiln.ErrorRecorder()
    with pytest.raises(ValueError, match="must be >= 0"):
        engine.weight_streaming_budget_v2 = -5
    assert recorder.get_error_code(0) == kiln.ErrorCode.INVALID_ARGUMENT
    engine.weight_streaming_budget = 0  # v1: Kiln chooses; on the CPU backend every weight fits
    assert engine.weight_streaming_budget_v2 == engine.get_weight_streaming_automatic_budget() == engine.streamable_weights_size
    plain = _engine(flags=())
    assert plain.streamable_weights_size == 0
    with pytest.raises(ValueError, match="not built with BuilderFlag.WEIGHT_STREAMING"):
        plain.weight_streaming_budget_v2 = 0
