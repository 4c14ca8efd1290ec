"""The `kiln_precision` model-config parameter: builder flags, the plan they produce, clear refusals."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format

import engine_core as kiln
from server.core.errors import ServerError
from server.core.model import apply_precision, precision_flags
from server.plan_cache import build_description
from server.protos import model_config_pb2


def _config(value: str | None) -> model_config_pb2.ModelConfig:
    config = model_config_pb2.ModelConfig(name="m")
    if value is not None:
        text_format.Parse(f'parameters {{ key: "kiln_precision" value {{ string_value: "{value}" }} }}', config)
    return config


@pytest.mark.parametrize(("value", "flags"), [
    (None, {kiln.BuilderFlag.TF32}), ("fp32", set()), ("TF32", {kiln.BuilderFlag.TF32}),
    ("fp16", {kiln.BuilderFlag.FP16, kiln.BuilderFlag.TF32}), ("bf16", {kiln.BuilderFlag.BF16, kiln.BuilderFlag.TF32}),
])
def test_precision_parameter_maps_to_builder_flags(value, flags):
    assert set(precision_flags(_config(value))) == flags


@pytest.mark.parametrize(("value", "tf32"), [(None, True), ("fp32", False), ("tf32", True), ("fp16", True)])
def test_applied_precision_clears_tf32_only_for_strict_fp32(value, tf32):
    """Unset follows the engine (a new config allows TF32); fp32 must clear it, which setting flags cannot do."""
    config = kiln.BuilderConfig("cuda")
    config.set_flag(kiln.BuilderFlag.REFIT)
    apply_precision(_config(value), config)
    assert config.get_flag(kiln.BuilderFlag.TF32) is tf32
    assert config.get_flag(kiln.BuilderFlag.REFIT)  # flags kiln_precision does not decide are left alone
    assert config.get_flag(kiln.BuilderFlag.FP16) is (value == "fp16")


def test_plan_cache_key_ignores_tf32_on_cpu_only():
    """TF32 changes no CPU plan's results (a CPU plan cached before it became the default is still valid), but it
    changes every fp32 GEMM and convolution of a CUDA plan."""
    descriptions = {}
    for backend in ("cpu", "cuda"):
        for tf32 in (True, False):
            config = kiln.BuilderConfig(backend)
            if not tf32:
                config.clear_flag(kiln.BuilderFlag.TF32)
            descriptions[backend, tf32] = build_description(config)
    assert descriptions["cpu", True] == descriptions["cpu", False]
    assert descriptions["cuda", True] != descriptions["cuda", False]


def test_an_unknown_precision_names_the_model_and_the_choices():
    with pytest.raises(ServerError, match="model 'm': parameter kiln_precision must be one of fp32, tf32, fp16, bf16"):
        precision_flags(_config("int4"))


def test_fp16_flags_give_an_fp16_plan_with_fp32_io():
    from tests.cuda.models import mlp

    builder = kiln.Builder()
    net = builder.create_network()
    kiln.OnnxParser(net).parse(mlp())
    cfg = builder.create_builder_config()
    cfg.backend = "cpu"
    for flag in precision_flags(_config("fp16")):
        cfg.set_flag(flag)
    profile = builder.create_optimization_profile()
    profile.set_shape("x", (1, 64), (4, 64), (8, 64))
    cfg.add_optimization_profile(profile)
    engine = kiln.Runtime().load(kiln.build_plan(net, cfg))
    assert np.dtype(np.float16) in {v.dtype for v in engine.plan.graph.constants.values() if hasattr(v, "dtype")}
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    assert engine.create_execution_context().infer({"x": x})["y"].dtype == np.float32
