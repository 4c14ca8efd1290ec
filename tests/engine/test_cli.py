"""The kiln CLI: build, run, inspect on real files (called through main(), as the console script does)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from engine_core.cli import main, parse_shape_specs
from tests.engine import models


def test_shape_specs():
    assert parse_shape_specs(["x:1x3x224x224,y:2"]) == {"x": (1, 3, 224, 224), "y": (2,)}
    assert parse_shape_specs(["ns:in:1x2"]) == {"ns:in": (1, 2)}


def test_build_run_inspect(tmp_path, capsys):
    model_path, plan_path = tmp_path / "m.onnx", tmp_path / "m.plan"
    onnx.save(models.add_sub(), model_path)
    assert main(["build", str(model_path), "-o", str(plan_path), "--min-shapes", "a:1x4,b:1x4",
                 "--opt-shapes", "a:2x4,b:2x4", "--max-shapes", "a:8x4,b:8x4"]) == 0
    out = capsys.readouterr().out
    assert "Add" in out and "Sub" in out and f"wrote {plan_path}" in out

    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", a)
    assert main(["run", str(plan_path), "--input", f"a={tmp_path / 'a.npy'}", "--input", f"b={tmp_path / 'b.npy'}",
                 "--save-outputs", str(tmp_path / "out"), "--iterations", "3", "--profile"]) == 0
    np.testing.assert_array_equal(np.load(tmp_path / "out" / "sum.npy"), a + a)
    out = capsys.readouterr().out
    assert "latency over 3 runs" in out and "mean ms" in out

    assert main(["inspect", str(plan_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert [t["name"] for t in info["io"]] == ["a", "b", "sum", "diff"]
    assert info["profiles"][0]["a"] == {"min": [1, 4], "opt": [2, 4], "max": [8, 4]}


def test_build_errors_are_reported(tmp_path, capsys):
    model_path = tmp_path / "m.onnx"
    onnx.save(models.add_sub(), model_path)
    assert main(["build", str(model_path), "-o", str(tmp_path / "x.plan")]) == 1
    err = capsys.readouterr().err
    assert "dynamic shapes" in err and "--min-shapes" in err
    (tmp_path / "bad.plan").write_bytes(b"junk")
    assert main(["inspect", str(tmp_path / "bad.plan")]) == 1
    assert "not a Kiln plan" in capsys.readouterr().err


def _nonzero_model() -> onnx.ModelProto:
    """A data-dependent layer (NonZero) beside a plain one: what a CUDA build runs on the host today."""
    h = onnx.helper
    nodes = [h.make_node("Relu", ["x"], ["y"], name="relu"), h.make_node("NonZero", ["y"], ["nz"], name="nonzero")]
    graph = h.make_graph(nodes, "nz", [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])],
                         [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3]),
                          h.make_tensor_value_info("nz", onnx.TensorProto.INT64, [2, None])])
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])


def test_host_layers_are_named_and_strict_refuses_them(tmp_path, capsys, monkeypatch):
    """The gate on the summary a CUDA build gives when a layer runs on the host (made here from a CPU build's
    summary: CI has no GPU; the GPU test below builds one for real)."""
    from engine_core import cli

    real = cli.engine_summary

    def as_cuda_with_a_host_layer(plan):
        summary = real(plan)
        summary["backend"] = "cuda"
        summary["layers"][0] = summary["layers"][0] | {"tactic": "host"}
        return summary

    monkeypatch.setattr(cli, "engine_summary", as_cuda_with_a_host_layer)
    model_path, plan_path = tmp_path / "m.onnx", tmp_path / "m.plan"
    onnx.save(models.add_sub(), model_path)
    shapes = ["--shapes", "a:2x4,b:2x4"]
    assert main(["build", str(model_path), "-o", str(plan_path), "--strict", *shapes]) == 1
    err = capsys.readouterr().err
    assert "--strict: 1 of 2 layers run on the host:" in err and "no plan written" in err and not plan_path.exists()
    assert main(["build", str(model_path), "-o", str(plan_path), *shapes]) == 0
    assert "warning: 1 of 2 layers run on the host" in capsys.readouterr().err and plan_path.exists()
    assert main(["inspect", str(plan_path)]) == 0
    assert "1 of 2 layers run on the host" in capsys.readouterr().out


def test_a_cpu_build_has_no_host_layers_to_report(tmp_path, capsys):
    model_path, plan_path = tmp_path / "m.onnx", tmp_path / "m.plan"
    onnx.save(_nonzero_model(), model_path)
    assert main(["build", str(model_path), "-o", str(plan_path), "--backend", "cpu", "--strict"]) == 0
    assert "on the host" not in capsys.readouterr().err


@pytest.mark.gpu
def test_strict_cuda_build_names_the_host_layer_and_writes_nothing(tmp_path, capsys):
    model_path, plan_path = tmp_path / "m.onnx", tmp_path / "m.plan"
    onnx.save(_nonzero_model(), model_path)
    assert main(["build", str(model_path), "-o", str(plan_path), "--backend", "cuda", "--strict"]) == 1
    err = capsys.readouterr().err
    assert "nonzero (NonZero)" in err and not plan_path.exists()
