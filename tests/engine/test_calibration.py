"""INT8 post-training calibration: statistics, calibrators, cache, implicit Q/DQ insertion, builds, CLI."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import engine_core as kiln
from engine_core.builder import BuilderConfig
from engine_core.calibration import CalibrationAlgoType as Algo
from engine_core.calibration import (
    IInt8EntropyCalibrator2,
    IInt8MinMaxCalibrator,
    TensorStats,
    calibrate,
    entropy_amax,
    load_calibration_data,
    make_calibrator,
    parse_cache,
    percentile_amax,
    quantization_report,
    run_observed,
    serialize_cache,
)
from engine_core.cli import main
from engine_core.errors import BuildError
from engine_core.passes.quantize_implicit import DQ_PREFIX, int8_policy, quantize_implicit
from engine_core.plan import deserialize_plan
from tools.make_models import MODELS


def conv_mlp(seed: int = 0) -> onnx.ModelProto:
    """x[N,4,8,8] -> Conv(per-channel weights) -> Relu -> Flatten -> MatMul -> Gemm(transB) -> y[N,5]."""
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array(rng.standard_normal((4, 4, 3, 3)).astype(np.float32) * [[[[1]]], [[[4]]], [[[.1]]], [[[2]]]],
                                "w"),
        numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b"),
        numpy_helper.from_array((rng.standard_normal((256, 16)) * 0.1).astype(np.float32), "m"),
        numpy_helper.from_array((rng.standard_normal((5, 16)) * 0.3).astype(np.float32), "g"),
        numpy_helper.from_array(np.zeros(5, np.float32), "gb"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("Flatten", ["r"], ["f"], name="flatten"),
        helper.make_node("MatMul", ["f", "m"], ["h"], name="matmul"),
        helper.make_node("Gemm", ["h", "g", "gb"], ["y"], name="gemm", transB=1),
    ]
    graph = helper.make_graph(nodes, "conv_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _network(model: onnx.ModelProto) -> kiln.NetworkDefinition:
    network = kiln.Builder().create_network()
    assert kiln.OnnxParser(network).parse(model.SerializeToString())
    return network


def _config(shape: tuple[int, ...], calibrator=None, name: str = "x") -> BuilderConfig:
    """CPU build config with one profile (batch 1..8, opt ``shape``); INT8 when given a calibrator."""
    builder = kiln.Builder()
    config = builder.create_builder_config()
    config.backend = "cpu"
    profile = builder.create_optimization_profile()
    profile.set_shape(name, (1, *shape[1:]), shape, (8, *shape[1:]))
    config.add_optimization_profile(profile)
    if calibrator is not None:
        config.set_flag(kiln.BuilderFlag.INT8)
        config.int8_calibrator = calibrator
    return config


class CountingCalibrator(IInt8MinMaxCalibrator):
    """A user calibrator written the reference way: batches from get_batch, table to a bytes attribute."""

    def __init__(self, batches: list[np.ndarray], cache: bytes | None = None) -> None:
        self.batches, self.cache, self.calls = batches, cache, 0

    def get_batch_size(self) -> int:
        return self.batches[0].shape[0] if self.batches else 2

    def get_batch(self, names):
        self.calls += 1
        assert names == ["x"]
        return [self.batches.pop(0)] if self.batches else None

    def read_calibration_cache(self):
        return self.cache

    def write_calibration_cache(self, cache: bytes) -> None:
        self.cache = cache


# -- statistics and range rules -------------------------------------------------------------------


def test_histogram_widens_without_losing_counts():
    stats = TensorStats()
    stats.add(np.linspace(-1, 1, 1001, dtype=np.float32))
    first_width = stats.width
    stats.add(np.array([-37.5, 3.0], np.float32))
    assert stats.amax == 37.5 and stats.counts.sum() == 1003
    assert stats.width >= 37.5 / stats.bins and stats.width / first_width == 2 ** round(np.log2(stats.width / first_width))
    assert stats.counts[int(37.5 / stats.width)] == 1


def test_range_rules_on_gaussian_with_outliers(rng):
    stats = TensorStats()
    for _ in range(4):
        stats.add(rng.standard_normal(50_000).astype(np.float32))
    stats.add(np.array([60.0, -45.0], np.float32))  # two outliers far out
    assert stats.amax == 60.0  # min-max keeps them
    p = percentile_amax(stats, 99.9)
    assert abs(p - 3.29) < 0.1  # 99.9 % of |N(0,1)| lies below 3.29
    e = entropy_amax(stats)
    assert 2.0 < e < 20.0, e  # entropy clips the outliers but keeps the body of the distribution
    assert entropy_amax(TensorStats()) == 0.0


def test_calibrator_classes_pick_their_rule(rng):
    stats = TensorStats()
    stats.add(np.concatenate([rng.standard_normal(100_000), [100.0]]).astype(np.float32))
    assert make_calibrator([], "minmax").compute_amax(stats) == 100.0
    assert make_calibrator([], "percentile", percentile=99.0).compute_amax(stats) < 3.0
    assert make_calibrator([], "entropy").get_algorithm() == Algo.ENTROPY_CALIBRATION_2
    assert isinstance(make_calibrator([], "entropy"), IInt8EntropyCalibrator2)
    with pytest.raises(ValueError, match="unknown calibrator 'kl'"):
        make_calibrator([], "kl")
    with pytest.raises(ValueError, match="percentile"):
        make_calibrator([], "percentile", percentile=120)


# -- the cache ------------------------------------------------------------------------------------


def test_cache_round_trip_and_corrupt_caches():
    data = serialize_cache({"x": 2.54, "conv:out": 127.0}, Algo.MINMAX_CALIBRATION)
    assert data.splitlines()[0].startswith(b"KILN-") and data.splitlines()[0].endswith(b"MinMaxCalibration")
    assert data.splitlines()[2] == b"conv:out: 3f800000"  # scale 1.0 as big-endian float32 bits
    ranges = parse_cache(data)
    assert ranges["conv:out"] == 127.0 and abs(ranges["x"] - 2.54) < 1e-6
    assert parse_cache(b"TRT-8601-EntropyCalibration2\ninput: 3c010a14\n")["input"] == pytest.approx(0.00787 * 127, 1e-3)
    for bad, message in [(b"\xff\xfe", "not text"), (b"x: 3f800000\n", "header"),
                         (b"KILN-1-MinMax\nx: zz\n", "line 2"), (b"KILN-1-MinMax\nx: 7fc00000\n", "invalid scale")]:
        with pytest.raises(kiln.KilnError, match=message):
            parse_cache(bad)


# -- calibrate() ----------------------------------------------------------------------------------


def test_calibrate_runs_float_graph_then_cache_skips_running(rng):
    network = _network(conv_mlp())
    batches = [rng.standard_normal((2, 4, 8, 8)).astype(np.float32) for _ in range(3)]
    calibrator = CountingCalibrator(list(batches))
    ranges = calibrate(network.graph, _config((2, 4, 8, 8), calibrator))
    assert calibrator.calls == 4  # three batches, then None
    assert set(ranges) >= {"x", "c", "r", "f", "h", "y"}
    assert ranges["x"] == pytest.approx(max(float(np.abs(b).max()) for b in batches), rel=1e-6)
    seen: dict[str, float] = {}
    for b in batches:
        run_observed(network.graph, {"x": b}, lambda n, v: seen.__setitem__(n, max(seen.get(n, 0), float(np.abs(v).max()))))
    assert ranges["h"] == pytest.approx(seen["h"], rel=1e-6)
    assert calibrator.cache is not None
    cached = CountingCalibrator([], cache=calibrator.cache)
    again = calibrate(network.graph, _config((2, 4, 8, 8), cached))
    assert cached.calls == 0 and again == pytest.approx(ranges, rel=1e-6)


@pytest.mark.parametrize("batch, message", [
    (lambda r: [r.standard_normal((2, 4, 8, 8)).astype(np.float32)] * 2, "2 arrays for 1 inputs"),
    (lambda r: [r.standard_normal((3, 4, 8, 8)).astype(np.float32)], "holds 3 samples, get_batch_size"),
    (lambda r: [np.ones((2, 4, 8, 8), np.int32)], "is int32, the network expects float32"),
    (lambda r: [r.standard_normal((2, 3, 9, 8)).astype(np.float32)], "has shape"),
])
def test_bad_batches_are_build_errors(rng, batch, message):
    class Bad(IInt8MinMaxCalibrator):
        def get_batch_size(self):
            return 2

        def get_batch(self, names):
            return batch(rng)

    with pytest.raises(BuildError, match=message):
        calibrate(_network(conv_mlp()).graph, _config((2, 4, 8, 8), Bad()))


def test_no_batches_and_no_calibrator_are_build_errors():
    network = _network(conv_mlp())
    with pytest.raises(BuildError, match="no batches"):
        calibrate(network.graph, _config((2, 4, 8, 8), CountingCalibrator([])))
    config = _config((2, 4, 8, 8))
    config.set_flag(kiln.BuilderFlag.INT8)
    with pytest.raises(BuildError, match="int8_calibrator"):
        int8_policy(config, network)
    assert int8_policy(_config((2, 4, 8, 8)), network) is None


def test_calibration_data_directory(tmp_path, rng):
    a = rng.standard_normal((2, 3)).astype(np.float32)
    np.save(tmp_path / "img0.npy", a)
    np.save(tmp_path / "img1.npy", a * 2)
    assert [b["x"][0, 0] for b in load_calibration_data(str(tmp_path), ["x"])] == [a[0, 0], 2 * a[0, 0]]
    multi = tmp_path / "multi"
    multi.mkdir()
    np.save(multi / "ids_0.npy", a)
    np.save(multi / "ids_1.npy", a)
    np.save(multi / "mask_0.npy", a)
    np.savez(multi / "z.npz", ids=a, mask=a)
    with pytest.raises(kiln.KilnError, match="batch 2 .* no data for input\\(s\\) \\['mask'\\]"):
        load_calibration_data(str(multi), ["ids", "mask"])
    np.save(multi / "mask_1.npy", a)
    assert len(load_calibration_data(str(multi), ["ids", "mask"])) == 3
    np.save(multi / "other.npy", a)
    with pytest.raises(kiln.KilnError, match="'other.npy' names no network input"):
        load_calibration_data(str(multi), ["ids", "mask"])
    with pytest.raises(kiln.KilnError, match="does not exist"):
        load_calibration_data(str(tmp_path / "nope"), ["x"])


# -- quantize_implicit ----------------------------------------------------------------------------


def test_quantize_implicit_inserts_qdq_with_per_channel_weights(rng):
    network = _network(conv_mlp())
    batches = [rng.standard_normal((2, 4, 8, 8)).astype(np.float32) for _ in range(2)]
    ranges = calibrate(network.graph, _config((2, 4, 8, 8), CountingCalibrator(list(batches))))
    graph = network.graph
    reference = run_observed(graph, {"x": batches[0]}, lambda n, v: None)["y"]
    import copy

    quantized = copy.deepcopy(graph)
    assert quantize_implicit(quantized, ranges) == 3  # conv, matmul, gemm
    producers = quantized.producers()
    conv = next(n for n in quantized.nodes if n.op_type == "Conv")
    weight_dq = producers[conv.inputs[1]]
    assert weight_dq.op_type == "DequantizeLinear" and weight_dq.attrs["axis"] == 0
    q_weight = quantized.constants[weight_dq.inputs[0]]
    assert q_weight.dtype == np.int8 and np.abs(q_weight).max() == 127
    scales = quantized.constants[weight_dq.inputs[1]]
    assert scales.shape == (4,)  # one scale per output channel: channels of very different size
    w = graph.constants["w"]
    np.testing.assert_allclose(scales, np.abs(w).reshape(4, -1).max(1) / 127, rtol=1e-6)
    assert conv.inputs[2] == "b"  # bias stays float
    act_dq = producers[conv.inputs[0]]
    assert act_dq.name == DQ_PREFIX + "x" and producers[act_dq.inputs[0]].op_type == "QuantizeLinear"
    assert quantized.constants[act_dq.inputs[1]] == pytest.approx(ranges["x"] / 127)
    gemm = next(n for n in quantized.nodes if n.op_type == "Gemm")
    assert producers[gemm.inputs[1]].attrs["axis"] == 0  # transB weights: output channels on axis 0
    matmul = next(n for n in quantized.nodes if n.op_type == "MatMul")
    assert producers[matmul.inputs[1]].attrs["axis"] == 1
    out = run_observed(quantized, {"x": batches[0]}, lambda n, v: None)["y"]
    error = np.abs(out - reference).max() / np.abs(reference).max()
    assert 0 < error < 0.05, error  # int8 noise: present, and small
    assert quantize_implicit(copy.deepcopy(graph), {}) == 0


def test_quantization_report_names_quantized_layers(rng):
    network = _network(conv_mlp())
    x = rng.standard_normal((2, 4, 8, 8)).astype(np.float32)
    ranges = calibrate(network.graph, _config((2, 4, 8, 8), CountingCalibrator([x])))
    rows = quantization_report(network.graph, {"x": x}, ranges)
    assert [r.layer for r in rows] == ["conv", "matmul", "gemm"]
    assert all(0 < r.relative_error < 0.05 and r.max_abs_error >= r.mean_abs_error for r in rows)


# -- through the builder (BuilderFlag.INT8 + config.int8_calibrator) ------------------------------------


def test_int8_build_with_calibrator_and_cache(rng, tmp_path):
    network = _network(conv_mlp())
    batches = [{"x": rng.standard_normal((4, 4, 8, 8)).astype(np.float32)} for _ in range(2)]
    cache = tmp_path / "calib.cache"
    fp32 = kiln.build_plan(network, _config((4, 4, 8, 8)))
    plan = kiln.build_plan(network, _config((4, 4, 8, 8), make_calibrator(batches, "minmax", str(cache))))
    info = deserialize_plan(plan).build_info
    assert info["passes"]["quantize_implicit"] == 3 and info["int8"]["mode"] == "implicit"
    assert cache.read_bytes().startswith(b"KILN-")
    x = rng.standard_normal((3, 4, 8, 8)).astype(np.float32)
    y8 = kiln.Runtime().load(plan).create_execution_context().infer({"x": x})["y"]
    y32 = kiln.Runtime().load(fp32).create_execution_context().infer({"x": x})["y"]
    assert 0 < np.abs(y8 - y32).max() < 0.1 * np.abs(y32).max()
    again = kiln.build_plan(network, _config((4, 4, 8, 8), make_calibrator([], "minmax", str(cache))))  # cache only
    y8b = kiln.Runtime().load(again).create_execution_context().infer({"x": x})["y"]
    np.testing.assert_array_equal(y8b, y8)


def test_small_resnet50_int8_keeps_top1(rng):
    """Implicit INT8 (min-max calibration on 2 seeded batches) of the small ResNet-50 vs its fp32 build."""
    network = _network(MODELS["resnet50"][1]())
    batches = [{"input": rng.standard_normal((4, 3, 64, 64)).astype(np.float32)} for _ in range(2)]
    fp32 = kiln.build_plan(network, _config((4, 3, 64, 64), name="input"))
    int8 = kiln.build_plan(network, _config((4, 3, 64, 64), make_calibrator(batches, "minmax"), name="input"))
    assert deserialize_plan(int8).build_info["passes"]["quantize_implicit"] == 53  # 52 convs (not the RGB stem) + the classifier
    x = rng.standard_normal((8, 3, 64, 64)).astype(np.float32)
    a = kiln.Runtime().load(int8).create_execution_context().infer({"input": x})["logits"]
    b = kiln.Runtime().load(fp32).create_execution_context().infer({"input": x})["logits"]
    assert np.mean(a.argmax(1) == b.argmax(1)) >= 0.875
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 0.1


def test_implicit_int8_resnet50_quantizes_identity_shortcuts(rng, monkeypatch):
    """The 12 identity shortcuts of ResNet-50 (16 blocks, 4 with a projection) get Q/DQ like the convolutions'
    inputs, so with INT8 convolutions (KILN_INT8_CONV=1) every block output is written quantized by its QConv:
    2 standalone QuantizeLinear layers are left (after the stem's max pool and before the classifier), not 14."""
    from engine_core.passes import PRE_PASSES

    network = _network(MODELS["resnet50"][1]())
    batches = [{"input": rng.standard_normal((4, 3, 64, 64)).astype(np.float32)} for _ in range(2)]
    graph = _network(MODELS["resnet50"][1]()).graph
    for fold in PRE_PASSES:  # BatchNorm folded into the convolutions, as the builder does first
        fold(graph)
    quantize_implicit(graph, calibrate(graph, _config((4, 3, 64, 64), make_calibrator(batches, "minmax"), name="input")))
    producers = graph.producers()
    adds = [n for n in graph.nodes if n.op_type == "Add" and not any(i in graph.constants for i in n.inputs)]
    kinds = sorted(tuple(sorted(producers[i].op_type for i in add.inputs)) for add in adds)
    assert kinds == [("Conv", "Conv")] * 4 + [("Conv", "DequantizeLinear")] * 12
    monkeypatch.setenv("KILN_INT8_CONV", "1")
    fp32 = kiln.build_plan(network, _config((4, 3, 64, 64), name="input"))
    int8 = kiln.build_plan(network, _config((4, 3, 64, 64), make_calibrator(batches, "minmax"), name="input"))
    types = [layer["type"] for layer in deserialize_plan(int8).layers]
    assert types.count("QConv") == 52 and types.count("QuantizeLinear") == 2
    x = rng.standard_normal((4, 3, 64, 64)).astype(np.float32)
    a = kiln.Runtime().load(int8).create_execution_context().infer({"input": x})["logits"]
    b = kiln.Runtime().load(fp32).create_execution_context().infer({"input": x})["logits"]
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 0.1


# -- the CLI ------------------------------------------------------------------------------------------


def test_cli_int8_build_with_calib_data_cache_and_report(tmp_path, capsys, rng):
    model_path = tmp_path / "m.onnx"
    onnx.save(conv_mlp(), model_path)
    data = tmp_path / "calib"
    data.mkdir()
    for k in range(2):
        np.save(data / f"batch{k}.npy", rng.standard_normal((4, 4, 8, 8)).astype(np.float32))
    cache = tmp_path / "m.cache"
    shapes = ["--min-shapes", "x:1x4x8x8", "--opt-shapes", "x:4x4x8x8", "--max-shapes", "x:8x4x8x8"]
    args = ["build", str(model_path), "-o", str(tmp_path / "m.plan"), "--int8", "--calib-data", str(data),
            "--calib-cache", str(cache), "--calibrator", "percentile", "--quant-report", *shapes]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "INT8 quantization error per layer" in out and "max rel err" in out
    assert all(name in out for name in ("conv", "matmul", "gemm"))
    assert "output 'y': INT8 plan vs float32 plan" in out and "top-1 agreement" in out
    assert cache.read_bytes().startswith(b"KILN-") and b"PercentileCalibration" in cache.read_bytes()
    # the cache alone is enough for a rebuild
    assert main(["build", str(model_path), "-o", str(tmp_path / "m2.plan"), "--int8", "--calib-cache", str(cache),
                 *shapes]) == 0
    capsys.readouterr()
    for bad, message in [(["--calib-data", str(data)], "add --int8"),
                         (["--int8", "--calib-cache", str(tmp_path / "none.cache")], "does not exist"),
                         (["--int8", "--calib-data", str(tmp_path / "nodir")], "does not exist"),
                         (["--int8", "--quant-report"], "needs --calib-data")]:
        assert main(["build", str(model_path), *bad, *shapes]) == 2
        assert message in capsys.readouterr().err
    assert main(["build", str(model_path), "--int8", *shapes]) == 1
    assert "int8_calibrator" in capsys.readouterr().err


def test_quantize_implicit_leaves_an_rgb_stem_float(rng):
    """A Conv over 3 input channels keeps float input and weight (fuse_qdq_conv.INT8_CHANNEL_MULTIPLE): the
    MatMul and Gemm are still quantized."""
    model = conv_mlp()
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w"))
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 3
    network = _network(model)
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    ranges = calibrate(network.graph, _config((2, 3, 8, 8), CountingCalibrator([x])))
    assert quantize_implicit(network.graph, ranges) == 2
    conv = next(n for n in network.graph.nodes if n.op_type == "Conv")
    assert conv.inputs[:2] == ["x", "w"]
