"""bench/zoo.py's exports on the CPU: each zoo model's ONNX file, as the GPU run builds it, parses and computes what
torch computes (Kiln's CPU backend, batch 1). Needs torch, torchvision and transformers (not CI dependencies: the
module skips without them); the GPU run itself is `python -m bench.zoo` on the device."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("torchvision")
pytest.importorskip("transformers")

import torch  # noqa: E402

import engine_core as kiln  # noqa: E402
from bench import zoo  # noqa: E402


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):
    monkeypatch.setattr(zoo, "DEVICE", "cpu")


def _kiln_cpu(path: Path, model: zoo.ZooModel, inputs: tuple) -> np.ndarray:
    builder = kiln.Builder()
    net = builder.create_network()
    assert kiln.OnnxParser(net).parse_from_file(str(path))
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    for name, t in zip(model.names, inputs):
        profile.set_shape(name, tuple(t.shape), tuple(t.shape), tuple(t.shape))
    config.add_optimization_profile(profile)
    context = kiln.Runtime().load(kiln.build_plan(net, config)).create_execution_context()
    (out,) = context.infer({n: t.numpy() for n, t in zip(model.names, inputs)}).values()
    return out


@pytest.mark.parametrize("name", ["mobilenet_v2", "vit_b_16", "gpt2", "llama_small", "whisper_tiny_encoder"])
def test_export_computes_what_torch_computes(tmp_path, name):
    model = zoo.ZOO[name]
    inputs = model.inputs(1)
    with torch.no_grad():
        ref = zoo.keyword_output(model.make(), model.names)(*inputs)
    assert ref.abs().max() > 0  # random weights that give all-zero outputs would hide any error
    y = _kiln_cpu(zoo.export(model, tmp_path), model, inputs)
    assert zoo.relative_error(torch.as_tensor(y), ref) < 1e-4


def test_detector_selects_the_boxes_torch_selects(tmp_path):
    model = zoo.ZOO["yolo_nms"]
    inputs = model.inputs(1)
    with torch.no_grad():
        ref = model.make()(*inputs)
    assert 50 <= ref.shape[0] < 2000  # some boxes pass the score threshold, not all
    y = _kiln_cpu(zoo.export(model, tmp_path), model, inputs)
    assert zoo.selection_agreement(torch.as_tensor(y), ref) == 1.0


def test_table_has_a_line_per_row_and_shows_failures():
    rows = [{"model": "m", "batch": 1, "kiln_ms": 1.0, "torch_eager_ms": 2.0, "torch_compile_ms": 1.5,
             "speedup_vs_compile": 1.5, "err_vs_torch_fp16": 0.9, "build_s": 3.0, "warm_cache_build_s": 0.5,
             "host_layers": []},
            {"model": "broken", "error": "RuntimeError: no"}]
    lines = zoo.table(rows).splitlines()
    assert len(lines) == 3 and "1.50" in lines[1] and "RuntimeError: no" in lines[2]
