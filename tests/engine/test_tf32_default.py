"""TF32 is on by default, as in the reference ("TensorRT allows the use of TF32 Tensor Cores by default"), and
clearing it gives strict fp32: through the API, `kiln build --no-tf32`, and with no effect on CPU results."""

from __future__ import annotations

import numpy as np
import onnx

import engine_core as kiln
from engine_core.cli import main
from engine_core.plan import deserialize_plan
from tests.engine import models


def test_a_new_config_allows_tf32_and_clearing_it_gives_strict_fp32():
    config = kiln.Builder().create_builder_config()
    assert config.get_flag(kiln.BuilderFlag.TF32)
    assert config.enabled_flags == ["TF32"]
    config.clear_flag(kiln.BuilderFlag.TF32)
    assert not config.get_flag(kiln.BuilderFlag.TF32) and config.enabled_flags == []
    assert kiln.BuilderConfig("cpu").get_flag(kiln.BuilderFlag.TF32)  # the server constructs configs directly


def _cli_plan_flags(tmp_path, *extra: str) -> list[str]:
    model_path, plan_path = tmp_path / "m.onnx", tmp_path / "m.plan"
    onnx.save(models.small_cnn(), model_path)
    assert main(["build", str(model_path), "-o", str(plan_path), "--backend", "cpu", "--shapes", "x:2x3x16x16",
                 *extra]) == 0
    return deserialize_plan(plan_path.read_bytes()).build_info["flags"]


def test_cli_builds_with_tf32_unless_no_tf32(tmp_path, capsys):
    assert "TF32" in _cli_plan_flags(tmp_path)
    assert "TF32" in _cli_plan_flags(tmp_path, "--tf32")
    assert "TF32" not in _cli_plan_flags(tmp_path, "--no-tf32")
    assert "TF32" in _cli_plan_flags(tmp_path, "--fp16")  # fp16 builds keep TF32 for the layers left in fp32


def _cpu_outputs(tf32: bool, x: np.ndarray) -> np.ndarray:
    builder = kiln.Builder()
    network = builder.create_network()
    assert kiln.OnnxParser(network).parse(models.small_cnn().SerializeToString())
    config = builder.create_builder_config()
    config.backend = "cpu"
    if not tf32:
        config.clear_flag(kiln.BuilderFlag.TF32)
    profile = builder.create_optimization_profile()
    profile.set_shape("x", x.shape, x.shape, x.shape)
    config.add_optimization_profile(profile)
    return kiln.Runtime().load(kiln.build_plan(network, config)).create_execution_context().infer({"x": x})["y"]


def test_tf32_does_not_change_cpu_results():
    """The CPU backend computes fp32 with numpy whatever the flag says: the flag only picks CUDA math."""
    x = np.random.default_rng(0).standard_normal((2, 3, 16, 16)).astype(np.float32)
    np.testing.assert_array_equal(_cpu_outputs(True, x), _cpu_outputs(False, x))
