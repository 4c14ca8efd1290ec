"""Real architectures from tools/make_models.py (small sizes) match onnxruntime on the CPU backend."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import engine_core as kiln
from tests.engine.util import build, ort_run
from tools.make_models import MODELS


@pytest.fixture(scope="module")
def small_models() -> dict[str, onnx.ModelProto]:
    return {name: small() for name, (_, small) in MODELS.items()}


def _token_feeds(rng: np.random.Generator, batch: int, seq: int) -> dict[str, np.ndarray]:
    mask = np.ones((batch, seq), np.int64)
    mask[0, seq // 2 :] = 0  # padded tail on the first sequence
    return {
        "input_ids": rng.integers(0, 1000, (batch, seq)).astype(np.int64),
        "attention_mask": mask,
        "token_type_ids": (np.arange(seq) >= seq // 2).astype(np.int64)[None].repeat(batch, 0),
    }


@pytest.mark.parametrize("name", ["resnet50", "mobilenetv2"])
def test_image_classifiers(small_models, rng, name):
    model = small_models[name]
    plan = build(model, {"input": ((1, 3, 64, 64), (2, 3, 64, 64), (4, 3, 64, 64))})
    x = rng.standard_normal((3, 3, 64, 64)).astype(np.float32)
    out = kiln.Runtime().load(plan).create_execution_context().infer({"input": x})
    ref = ort_run(model, {"input": x})[0]
    # Random weights grow the logits to ~1e4: fp32 summation-order error scales with that, so the
    # absolute tolerance does too (onnxruntime's own optimization levels differ by ~1e-6 of the peak).
    np.testing.assert_allclose(out["logits"], ref, rtol=1e-3, atol=1e-5 * np.abs(ref).max())


def test_bert_three_shapes_two_profiles(small_models, rng):
    """One plan, two profiles (short and long sequences); three shapes; out-of-range shape is refused."""
    model = small_models["bert_base"]
    builder = kiln.Builder()
    network = builder.create_network()
    assert kiln.OnnxParser(network).parse(model.SerializeToString())
    config = builder.create_builder_config()
    for lo, opt, hi in [((1, 1), (4, 16), (8, 32)), ((1, 33), (4, 64), (8, 128))]:
        profile = builder.create_optimization_profile()
        for name in ("input_ids", "attention_mask", "token_type_ids"):
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
    engine = kiln.Runtime().load(kiln.build_plan(network, config))
    assert engine.get_tensor_shape("last_hidden_state") == (-1, -1, 64)
    contexts = [engine.create_execution_context() for _ in range(2)]
    contexts[1].set_optimization_profile_async(1, 0)
    for profile_index, (batch, seq) in [(0, (1, 5)), (0, (3, 32)), (1, (2, 100))]:
        feeds = _token_feeds(rng, batch, seq)
        out = contexts[profile_index].infer(feeds)
        ref = ort_run(model, feeds)
        np.testing.assert_allclose(out["last_hidden_state"], ref[0], rtol=1e-3, atol=1e-4)
        np.testing.assert_allclose(out["pooler_output"], ref[1], rtol=1e-3, atol=1e-4)
    with pytest.raises(kiln.ShapeError, match=r"profile 0: min \[1, 1\], max \[8, 32\]"):
        contexts[0].infer(_token_feeds(rng, 2, 40))


def test_gpt2_decoder(small_models, rng):
    model = small_models["gpt2"]
    plan = build(model, {"input_ids": ((1, 1), (1, 16), (2, 64))})
    ids = rng.integers(0, 1000, (2, 9)).astype(np.int64)
    out = kiln.Runtime().load(plan).create_execution_context().infer({"input_ids": ids})
    np.testing.assert_allclose(out["logits"], ort_run(model, {"input_ids": ids})[0], rtol=1e-3, atol=1e-4)


def test_yolo_head_with_nms(small_models, rng):
    model = small_models["yolo_nms"]
    plan = build(model, {"input": ((1, 3, 128, 128), (1, 3, 128, 128), (2, 3, 128, 128))})
    engine = kiln.Runtime().load(plan)
    assert engine.get_tensor_shape("selected_indices") == (-1, 3)  # data-dependent
    x = rng.standard_normal((2, 3, 128, 128)).astype(np.float32)
    out = engine.create_execution_context().infer({"input": x})
    boxes, scores, selected = ort_run(model, {"input": x})
    np.testing.assert_allclose(out["boxes"], boxes, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(out["scores"], scores, rtol=1e-3, atol=1e-4)
    np.testing.assert_array_equal(out["selected_indices"], selected)
