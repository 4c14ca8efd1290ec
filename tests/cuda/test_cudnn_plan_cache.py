"""cuDNN plan choices remembered on disk (engine_core/backends/cuda/cudnn_plan_cache.py): the file's round trip and
merging without a GPU; on the GPU, a second process-like start builds its convolutions from them, without asking
cuDNN's heuristics, and computes the same outputs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine_core.backends.cuda import cudnn_plan_cache
from engine_core.backends.cuda.cudnn_plan_cache import PlanChoices


def test_choices_survive_a_new_process_and_keep_their_section(tmp_path):
    path = tmp_path / "cudnn_plans.json"
    first = PlanChoices(path, "cudnn 1 | GPU A")
    first.put("conv|a", 0, 7, {3: 1, 5: 2}, 0)
    first.put("conv|a", 2, 9, {}, 3)  # rank 2 did not build: rank 3 did
    first.flush()
    again = PlanChoices(path, "cudnn 1 | GPU A")
    assert again.get("conv|a", 0) == (7, {3: 1, 5: 2}, 0)
    assert again.get("conv|a", 2) == (9, {}, 3)
    assert again.get("conv|a", 1) is None and again.get("conv|b", 0) is None
    assert again.known("conv|a") and not again.known("conv|")
    assert PlanChoices(path, "cudnn 2 | GPU A").get("conv|a", 0) is None  # another cuDNN: its own section


def test_two_writers_merge_and_a_refused_entry_asks_the_heuristics_from_then_on(tmp_path):
    path = tmp_path / "cudnn_plans.json"
    one, two = PlanChoices(path, "s"), PlanChoices(path, "s")
    one.put("conv|a", 0, 1, {}, 0)
    two.put("conv|b", 0, 2, {}, 0)
    one.flush()
    two.flush()  # merges with what `one` wrote
    three = PlanChoices(path, "s")
    assert three.get("conv|a", 0) == (1, {}, 0) and three.get("conv|b", 0) == (2, {}, 0)
    three.refuse("conv|a", 0)
    three.put("conv|a", 0, 1, {}, 0)  # what the heuristics built next: not remembered over the refusal
    assert three.get("conv|a", 0) is None and three.known("conv|a")
    three.flush()
    assert PlanChoices(path, "s").get("conv|a", 0) is None  # a later process asks the heuristics too


def test_a_damaged_file_or_entry_reads_as_nothing_remembered(tmp_path):
    path = tmp_path / "cudnn_plans.json"
    path.write_text("{not json")
    assert PlanChoices(path, "s").get("conv|a", 0) is None
    path.write_text(json.dumps({"s": {"conv|a#0": [1, {}]}}))  # an entry of another format
    assert PlanChoices(path, "s").get("conv|a", 0) is None


def test_entries_are_written_at_most_every_few_seconds_and_flush_writes_the_rest(tmp_path, monkeypatch):
    path = tmp_path / "cudnn_plans.json"
    choices = PlanChoices(path, "s")
    choices.put("conv|a", 0, 1, {}, 0)
    assert not path.exists()  # just created: not yet due
    monkeypatch.setattr(cudnn_plan_cache, "WRITE_EVERY_S", 0.0)
    choices.put("conv|b", 0, 2, {}, 0)
    assert set(json.loads(path.read_text())["s"]) == {"conv|a#0", "conv|b#0"}


def test_the_cache_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("KILN_CUDNN_PLAN_CACHE", "0")
    assert cudnn_plan_cache.choices(object()) is None


@pytest.mark.gpu
def test_a_new_context_builds_every_convolution_from_remembered_plans(tmp_path, monkeypatch):
    import engine_core as kiln
    from engine_core.backends.cuda import cudnn_conv
    from tests.cuda.models import build_engine, resnet_small, small_model_feeds, small_model_profiles

    if not cudnn_conv.available():
        pytest.skip("needs the cuDNN frontend (pip install kiln[gpu])")
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cudnn_plan_cache, "_CHOICES", None)
    ranked = []
    original = cudnn_conv.CudnnConvs._build_ranked
    monkeypatch.setattr(cudnn_conv.CudnnConvs, "_build_ranked",
                        lambda self, op, index: ranked.append(op) or original(self, op, index))
    engine = build_engine(resnet_small(), "cuda", small_model_profiles("resnet50"), flags=[kiln.BuilderFlag.TF32])
    feeds = small_model_feeds("resnet50", 2, 0)
    want = engine.create_execution_context().infer(feeds)
    assert ranked, "the first context asks the heuristics"
    cudnn_plan_cache.flush()
    assert (tmp_path / "cudnn_plans.json").exists()

    first = len(ranked)
    monkeypatch.setattr(cudnn_plan_cache, "_CHOICES", None)  # as a new process: read from the file
    ranked.clear()
    fresh = kiln.Runtime().load(engine.serialize()).create_execution_context()
    got = fresh.infer(feeds)
    # a plan the frontend cannot name (its delegating entry) is not remembered: those few ask again
    assert len(ranked) <= first // 4, f"{len(ranked)} of {first} convolutions asked the heuristics again"
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
