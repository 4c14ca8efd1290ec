"""The kiln CLI: build, run, inspect on real files (called through main(), as the console script does)."""

from __future__ import annotations

import json

import numpy as np
import onnx

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
