"""Kiln's build knobs as BuilderConfig fields (issue #32, item 4): each takes its default from its ``KILN_*``
variable once, when the config is made; the builder hands the config's values to the passes and the backend for the
whole build (not the environment of the moment); the run-time ones are recorded in the plan, the variable at load
time overriding them; and the server's plan-cache key tells configs that differ in a knob apart.
"""

from __future__ import annotations

import types

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import engine_core as kiln
from engine_core.builder import build_environment
from engine_core.builder_config import (
    KNOB_ENVIRONMENT,
    KNOBS_KEY,
    MAX_CONSTANT_BYTES,
    BuilderConfig,
    BuildKnobs,
    build_knobs,
    building_with,
    recorded_knob,
)
from engine_core.errors import BuildError
from engine_core.passes import fold_constants
from engine_core.plan import deserialize_plan
from tests.engine.test_fuse_qdq_conv import qdq_conv_model
from tests.engine.util import parsed_graph

F = TensorProto.FLOAT


@pytest.fixture(autouse=True)
def no_knob_variables(monkeypatch):
    """Every test starts with none of the KILN_* build variables set."""
    for variable in KNOB_ENVIRONMENT.values():
        monkeypatch.delenv(variable, raising=False)


def _qdq_matmul_model(rng) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """x -> Q/DQ -> MatMul <- DQ(int8 W, per channel) -> y: what fuse_qdq_matmul turns into a QMatMul."""
    w = rng.integers(-127, 128, (32, 16)).astype(np.int8)
    inits = {"x_s": np.array(2.0 ** -5, np.float32), "x_z": np.array(0, np.int8), "w_q": w,
             "w_s": (2.0 ** -rng.integers(6, 9, 16)).astype(np.float32), "w_z": np.zeros(16, np.int8)}
    nodes = [helper.make_node("QuantizeLinear", ["x", "x_s", "x_z"], ["x_q"], name="q_x"),
             helper.make_node("DequantizeLinear", ["x_q", "x_s", "x_z"], ["x_dq"], name="dq_x"),
             helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["w_dq"], name="dq_w", axis=1),
             helper.make_node("MatMul", ["x_dq", "w_dq"], ["y"], name="fc")]
    graph = helper.make_graph(nodes, "qdq_matmul", [helper.make_tensor_value_info("x", F, [4, 32])],
                              [helper.make_tensor_value_info("y", F, None)],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model, {"x": rng.standard_normal((4, 32)).astype(np.float32)}


def _tiled_constant_model(repeats: int) -> onnx.ModelProto:
    """y = x + Tile(c, repeats): the Tile reads constants only, so constant folding computes it at build time;
    its output takes ``repeats * 64`` bytes."""
    inits = {"c": np.arange(16, dtype=np.float32), "r": np.array([repeats], np.int64)}
    nodes = [helper.make_node("Tile", ["c", "r"], ["tiled"], name="tile"),
             helper.make_node("Add", ["x", "tiled"], ["y"], name="add")]
    graph = helper.make_graph(nodes, "tiled", [helper.make_tensor_value_info("x", F, [16 * repeats])],
                              [helper.make_tensor_value_info("y", F, None)],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def _network(model: onnx.ModelProto) -> kiln.NetworkDefinition:
    network = kiln.Builder().create_network()
    parser = kiln.OnnxParser(network)
    assert parser.parse(model.SerializeToString()), [str(e) for e in parser.errors]
    return network


def _config(**knobs) -> BuilderConfig:
    config = kiln.Builder().create_builder_config()
    config.backend = "cpu"
    for name, value in knobs.items():
        setattr(config, name, value)
    return config


def _build(model: onnx.ModelProto, config: BuilderConfig, feeds: dict[str, np.ndarray]):
    """(outputs, layer types, build_info) of ``model`` built with ``config`` (fixed shapes: no profile)."""
    engine = kiln.Runtime().load(kiln.build_plan(_network(model), config))
    outputs = engine.create_execution_context().infer(feeds)
    return outputs, [layer["type"] for layer in engine.plan.layers], engine.plan.build_info


# -- defaults from the environment, once ------------------------------------------------------------------------


def test_defaults_are_the_built_in_ones_without_the_variables():
    config = BuilderConfig("cpu")
    assert config.knobs() == BuildKnobs()
    assert (config.int8_gemm, config.int8_conv, config.qgemm, config.cuda_graphs) == (True, None, True, True)
    assert config.max_constant_bytes == MAX_CONSTANT_BYTES and config.cudnn_heuristic_conv_plans is False
    assert config.cudnn_attention is True
    assert BuildKnobs().changed() == {}


def test_each_variable_gives_its_field_default_when_the_config_is_made_and_only_then(monkeypatch):
    values = {"KILN_INT8_GEMM": "0", "KILN_INT8_CONV": "1", "KILN_QGEMM": "0", "KILN_MAX_CONSTANT_BYTES": "4096",
              "KILN_CUDA_GRAPHS": "0", "KILN_CUDNN_HEURISTIC": "1", "KILN_CUDNN_ATTENTION": "0"}
    assert set(values) == set(KNOB_ENVIRONMENT.values())
    for variable, value in values.items():
        monkeypatch.setenv(variable, value)
    config = BuilderConfig("cpu")
    expected = BuildKnobs(int8_gemm=False, int8_conv=True, qgemm=False, max_constant_bytes=4096, cuda_graphs=False,
                          cudnn_heuristic_conv_plans=True, cudnn_attention=False)
    assert config.knobs() == expected
    assert expected.changed() == {"int8_gemm": False, "int8_conv": True, "qgemm": False, "max_constant_bytes": 4096,
                                  "cuda_graphs": False, "cudnn_heuristic_conv_plans": True, "cudnn_attention": False}
    for variable in values:  # read once: a later change of the environment leaves the config alone
        monkeypatch.delenv(variable)
    assert config.knobs() == expected and BuilderConfig("cpu").knobs() == BuildKnobs()


def test_variables_keep_the_meanings_they_always_had():
    env = BuildKnobs.from_environment
    assert env({"KILN_INT8_GEMM": "1"}).int8_gemm and env({"KILN_INT8_GEMM": "no"}).int8_gemm  # only "0" turns off
    assert env({"KILN_INT8_CONV": "0"}).int8_conv is False and env({"KILN_INT8_CONV": "yes"}).int8_conv is None
    assert env({"KILN_MAX_CONSTANT_BYTES": " 123 "}).max_constant_bytes == 123
    assert env({"KILN_MAX_CONSTANT_BYTES": "lots"}).max_constant_bytes == MAX_CONSTANT_BYTES
    assert not env({"KILN_CUDNN_HEURISTIC": "yes"}).cudnn_heuristic_conv_plans  # only "1" turns on
    assert env({"KILN_CUDNN_ATTENTION": "no"}).cudnn_attention and not env({"KILN_CUDNN_ATTENTION": "0"}).cudnn_attention


def test_a_knob_of_the_wrong_type_fails_the_build():
    network = _network(_tiled_constant_model(4))
    for name, value in (("max_constant_bytes", -1), ("max_constant_bytes", 1.5), ("int8_gemm", "0"),
                        ("int8_conv", 1)):
        with pytest.raises(BuildError, match=name):
            kiln.build_plan(network, _config(**{name: value}))
        assert kiln.Builder().build_serialized_network(network, _config(**{name: value})) is None


# -- the config's values reach the passes and the backend -------------------------------------------------------


class _KnobsSeen:
    """A progress monitor that notes the knobs the build's code sees (``build_knobs()``) at each phase."""

    def __init__(self) -> None:
        self.seen: list[BuildKnobs] = []

    def phase_start(self, phase_name, parent_phase, num_steps) -> None:
        self.seen.append(build_knobs())

    def step_complete(self, phase_name, step) -> bool:
        return True

    def phase_finish(self, phase_name) -> None:
        pass


def test_the_build_hands_the_config_knobs_to_its_code_not_the_environment(monkeypatch):
    from engine_core.backends.cuda import qgemm

    monitor = _KnobsSeen()
    config = _config(int8_gemm=False, qgemm=False, max_constant_bytes=1 << 20, cuda_graphs=False)
    config.progress_monitor = monitor
    network = _network(_tiled_constant_model(4))
    monkeypatch.setenv("KILN_INT8_GEMM", "1")  # set after the config was made: not what this build uses
    monkeypatch.setenv("KILN_MAX_CONSTANT_BYTES", "7")
    kiln.build_plan(network, config)
    assert monitor.seen and all(k == config.knobs() for k in monitor.seen)
    assert build_knobs() == BuildKnobs.from_environment()  # outside the build: the environment, read now
    assert build_knobs().max_constant_bytes == 7
    with building_with(config.knobs()):
        assert not qgemm.available()  # the backend's INT8 GEMM choice follows BuilderConfig.qgemm


def test_int8_gemm_decides_whether_qdq_matmuls_become_qmatmul(rng, monkeypatch):
    model, feeds = _qdq_matmul_model(rng)
    monkeypatch.setenv("KILN_INT8_GEMM", "0")
    from_env = _config()  # the variable is the default ...
    assert from_env.int8_gemm is False
    floats, float_types, float_info = _build(model, from_env, feeds)
    float_y = floats["y"]
    assert "QMatMul" not in float_types and "MatMul" in float_types
    assert float_info[KNOBS_KEY] == {"int8_gemm": False}
    overridden = _config(int8_gemm=True)  # ... and code overrides it
    int8, int8_types, int8_info = _build(model, overridden, feeds)
    assert int8_types.count("QMatMul") == 1 and "MatMul" not in int8_types and KNOBS_KEY not in int8_info
    np.testing.assert_allclose(int8["y"], float_y, rtol=1e-5, atol=1e-5 * np.abs(float_y).max())


def test_int8_conv_forces_qdq_convolutions_into_int8_on_the_cpu_backend(rng, monkeypatch):
    model, feeds = qdq_conv_model(rng)
    default, default_types, _ = _build(model, _config(), feeds)  # None: the build's choice, float on the CPU
    assert "QConv" not in default_types and "FusedConv" in default_types
    monkeypatch.setenv("KILN_INT8_CONV", "1")
    forced = _config()
    assert forced.int8_conv is True
    monkeypatch.delenv("KILN_INT8_CONV")
    int8, int8_types, info = _build(model, forced, feeds)
    assert int8_types.count("QConv") == 1 and "FusedConv" not in int8_types and info[KNOBS_KEY] == {"int8_conv": True}
    np.testing.assert_array_equal(int8["y"], default["y"])  # exact scales: the same numbers either way
    monkeypatch.setenv("KILN_INT8_CONV", "1")
    _, off_types, _ = _build(model, _config(int8_conv=False), feeds)  # False forces float against the variable
    assert "QConv" not in off_types


def test_max_constant_bytes_bounds_what_constant_folding_computes(monkeypatch):
    model = _tiled_constant_model(64)  # the folded Tile: 1024 floats, 4096 bytes
    x = np.ones(1024, np.float32)
    y, types_, _ = _build(model, _config(), {"x": x})
    assert types_ == ["Add"]  # the Tile was folded into a constant
    np.testing.assert_array_equal(y["y"], 1 + np.tile(np.arange(16, dtype=np.float32), 64))
    assert _build(model, _config(max_constant_bytes=4096), {"x": x})[1] == ["Add"]  # the bound is inclusive
    with pytest.raises(BuildError, match=r"4096 bytes, over the limit of 4095 \(BuilderConfig.max_constant_bytes"):
        kiln.build_plan(_network(model), _config(max_constant_bytes=4095))
    network, graph = _network(model), parsed_graph(model)
    monkeypatch.setenv("KILN_MAX_CONSTANT_BYTES", "100")  # the variable, as the default of a new config
    with pytest.raises(BuildError, match="over the limit of 100"):
        kiln.build_plan(network, _config())
    # the pass on its own, outside a build, reads the environment as before
    with pytest.raises(BuildError, match="over the limit of 100"):
        fold_constants(graph)
    with building_with(BuildKnobs(max_constant_bytes=4096)):
        assert fold_constants(graph) == 1


# -- knobs that act when a plan runs ----------------------------------------------------------------------------


def test_run_time_knobs_are_recorded_in_the_plan_and_the_variables_override_them(monkeypatch):
    from engine_core.backends.cuda import runner

    network = _network(_tiled_constant_model(4))
    plan = deserialize_plan(kiln.build_plan(network, _config(cuda_graphs=False, cudnn_heuristic_conv_plans=True,
                                                             cudnn_attention=False)))
    assert plan.build_info[KNOBS_KEY] == {"cuda_graphs": False, "cudnn_heuristic_conv_plans": True,
                                          "cudnn_attention": False}
    default = deserialize_plan(kiln.build_plan(network, _config()))
    assert KNOBS_KEY not in default.build_info  # a default build's plan records nothing new
    state = runner.CudaContextState(types.SimpleNamespace(plan=plan))
    assert state.use_graphs is False and state.heuristic_conv_plans is True and state.cudnn_attention is False
    state = runner.CudaContextState(types.SimpleNamespace(plan=default))
    assert state.use_graphs is True and state.heuristic_conv_plans is False and state.cudnn_attention is True
    monkeypatch.setenv("KILN_CUDA_GRAPHS", "1")  # set at load time: overrides the plan's record
    monkeypatch.setenv("KILN_CUDNN_HEURISTIC", "0")
    monkeypatch.setenv("KILN_CUDNN_ATTENTION", "1")
    state = runner.CudaContextState(types.SimpleNamespace(plan=plan))
    assert state.use_graphs is True and state.heuristic_conv_plans is False and state.cudnn_attention is True
    monkeypatch.setenv("KILN_CUDA_GRAPHS", "0")
    assert recorded_knob(default.build_info, "cuda_graphs") is False
    assert recorded_knob(None, "cudnn_heuristic_conv_plans") is False


# -- the server's plan-cache key ------------------------------------------------------------------------------


def test_configs_that_differ_in_a_knob_get_different_build_descriptions_and_cache_keys(monkeypatch):
    from server.plan_cache import build_description, cache_key

    base = _config()
    assert build_environment(base) == {} and "environment" not in build_description(base)  # keys of before
    changes = {"int8_gemm": False, "int8_conv": True, "qgemm": False, "max_constant_bytes": 1 << 20,
               "cuda_graphs": False, "cudnn_heuristic_conv_plans": True, "cudnn_attention": False}
    assert set(changes) == set(KNOB_ENVIRONMENT)
    keys = {cache_key("m", build_description(base), "cpu")}
    for name, value in changes.items():
        config = _config(**{name: value})
        assert build_environment(config) == {KNOB_ENVIRONMENT[name]: str(int(value)) if not isinstance(value, bool)
                                             else ("1" if value else "0")}
        keys.add(cache_key("m", build_description(config), "cpu"))
    keys.add(cache_key("m", build_description(_config(int8_conv=False)), "cpu"))  # forced off: not the default
    assert len(keys) == len(changes) + 2
    monkeypatch.setenv("KILN_INT8_GEMM", "0")  # from the environment: the same key as set in code
    assert build_description(_config()) == build_description(_config(int8_gemm=False))
    # a variable set now counts, with the config's value: True set in code against KILN_INT8_GEMM=0 is not the
    # plan of a config that took the variable's False
    assert build_environment(_config(int8_gemm=True)) == {"KILN_INT8_GEMM": "1"}
    assert build_description(_config(int8_gemm=True)) != build_description(_config())
