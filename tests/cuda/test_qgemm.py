"""Kiln's sm_90 INT8 GEMM with the epilogue in registers (engine_core/backends/cuda/qgemm.py,
cuda_kernels/qgemm_sm90.cu).

Without a GPU: QMatMul layers lowered with the kernel on (``LoweringOptions.qgemm_sm90``) are one launch each, and
the numpy emulation of that launch (exact int32 sums, the kernel's float32 epilogue) equals the CPU backend.
With a GPU (``-m gpu``, an sm_90 one): Q/DQ MLPs whose M, N and K are not tile multiples, both tile widths, against
the CPU backend.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import engine_core as kiln
from engine_core.backends.cuda import lowering, qgemm
from engine_core.backends.cuda.int8_gemm import Int8Gemm, lower_qmatmul
from engine_core.backends.cuda.lowering import Launch, LoweringOptions
from engine_core.interpret import GraphRunner
from engine_core.ir import Graph, Node
from engine_core.ops import TensorInfo
from tests.cuda.emulate import Emulator
from tests.cuda.models import bert_feeds, build_engine, lowered_at, optimized_graph, small_model
from tests.cuda.test_int8_gemm import qdq_mlp

QGEMM = LoweringOptions(qgemm_sm90=True)


@pytest.fixture(autouse=True)
def any_size(monkeypatch):
    """Small test shapes take the kernel too (``MIN_TILES`` keeps layers of fewer than 48 tiles on cuBLASLt)."""
    monkeypatch.setattr(qgemm, "MIN_TILES", 0)


@pytest.mark.parametrize("flag, batch", [(None, 1), (None, 130), (kiln.BuilderFlag.FP16, 7)])
def test_emulated_qgemm_mlp_equals_the_cpu_backend(flag, batch):
    """fc1 (per-column weight scales, bias, ReLU, requantized to int8 after rounding to the build's float type: the
    ping-pong form) and fc2 (per-tensor scale, bias, GELU, float output: the GELU form) are one kernel launch each,
    equal to the CPU op up to the kernel's polynomial GELU (fp32: a few 1e-7; fp16: an ulp where it rounds apart)."""
    x = np.random.default_rng(batch).standard_normal((batch, 64)).astype(np.float32)
    graph = optimized_graph(qdq_mlp(), {"x": x}, flag)
    lowered = lowered_at(graph, {"x": x}, QGEMM)
    steps = {s.node.name: s for s in lowered.steps}
    out = "f32" if flag is None else "f16"
    fc1_round = "0" if flag is None else "1"  # fc1 rounds to the build's float type before requantizing
    for name, form, suffix in (("fc1", qgemm.PINGPONG, f"1{fc1_round}_i8"), ("fc2", qgemm.GELU, f"20_{out}")):
        (launch,) = steps[name].ops
        assert isinstance(launch, Launch) and launch.function == f"{form.prefix}_128_{suffix}", launch.function
        assert launch.shared_bytes == form.shared_bytes() and launch.block == (form.threads, 1, 1)
        assert launch.grid == (-(-batch // 128), 1, 1)
        assert lowered.tactics()[name] == "gemm:qgemm_sm90"
    got, want = Emulator(graph, lowered, {"x": x}).run()["y"], GraphRunner(graph).run({"x": x})["y"]
    tolerance = 1e-6 if flag is None else 1e-3
    np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance * float(np.abs(want).max()))


def test_the_kernels_gelu_polynomial_is_the_fitted_one_and_as_accurate_as_the_cpu_op():
    """kiln_gelu's coefficients (parsed from the kernel) are ``qgemm.GELU_LOG2_PHI``, and its fp32 evaluation is
    within 4e-7 of exact GELU on [-9, 9] (the CPU op's fp32 erf form: 4.5e-7)."""
    import math
    import re

    from engine_core.cuda import nvrtc
    from tools.fit_gelu import gelu_fp32

    source = nvrtc.kernel_sources()[qgemm.MODULE].read_text()
    body = source[source.index("float kiln_gelu("):source.index("float h;")]
    found = [float(v) for v in re.findall(r"(-?[0-9.]+(?:e-?[0-9]+)?)f[;)]", body)]  # LIMIT, c9 .. c1, -1
    assert found[0] == qgemm.GELU_LIMIT and found[-1] == -1.0, found
    assert tuple(found[-2:0:-1]) == qgemm.GELU_LOG2_PHI, found
    x = np.linspace(-9.0, 9.0, 200_001).astype(np.float32)
    exact = x.astype(np.float64) * 0.5 * np.vectorize(math.erfc)(-x.astype(np.float64) / math.sqrt(2.0))
    got = gelu_fp32(x, np.array(qgemm.GELU_LOG2_PHI, np.float32), qgemm.GELU_LIMIT).astype(np.float64)
    assert float(np.abs(got - exact).max()) <= 4e-7


def test_the_int8_output_gelu_is_the_fitted_sigmoid_form_within_its_error_bound():
    """kiln_gelu_q's constants (parsed from the kernel) are ``qgemm.GELU_SIGMOID`` / ``GELU_SIGMOID_T_MAX``; its fp32
    evaluation is within 2.6e-5 of exact GELU on [-9, 9] and goes to 0 and x far out (no overflow to NaN)."""
    import math
    import re

    from engine_core.cuda import nvrtc
    from tools.fit_gelu import gelu_sigmoid_fp32

    source = nvrtc.kernel_sources()[qgemm.MODULE].read_text()
    body = source[source.index("float kiln_gelu_q("):source.index("float e, r;")]
    found = [float(v) for v in re.findall(r"(-?[0-9.]+(?:e-?[0-9]+)?)f[;),]", body)]  # T_MAX, k2, k1, k0
    assert found == [qgemm.GELU_SIGMOID_T_MAX, *qgemm.GELU_SIGMOID[::-1]], found
    coeffs = np.array(qgemm.GELU_SIGMOID, np.float32)
    x = np.linspace(-9.0, 9.0, 200_001).astype(np.float32)
    exact = x.astype(np.float64) * 0.5 * np.vectorize(math.erfc)(-x.astype(np.float64) / math.sqrt(2.0))
    got = gelu_sigmoid_fp32(x, coeffs, qgemm.GELU_SIGMOID_T_MAX).astype(np.float64)
    assert float(np.abs(got - exact).max()) <= 2.6e-5
    far = gelu_sigmoid_fp32(np.array([-1e4, -60.0, 60.0, 1e4], np.float32), coeffs, qgemm.GELU_SIGMOID_T_MAX)
    np.testing.assert_array_equal(far, [0.0, 0.0, 60.0, 1e4])


@pytest.mark.parametrize("scale, act", [(2.0 ** -4, qgemm.GELU_Q), (2.0 ** -9, qgemm.ACTIVATIONS["Gelu"])])
def test_gelu_requantized_at_a_coarse_scale_takes_the_cheaper_gelu(scale, act):
    """fc1's GELU -> int8: from ``GELU_SIGMOID_MIN_SCALE`` on the kernel with kiln_gelu_q, below it the exact form;
    either way the emulated int8 result is the CPU op's but for at most one element one step apart."""
    from tests.engine.test_fuse_qdq_matmul import _requant_mlp

    model, feeds = _requant_mlp(np.random.default_rng(5), q_scale=np.float32(scale))
    graph = optimized_graph(model, feeds)
    lowered = lowered_at(graph, feeds, QGEMM)
    (launch,) = next(s for s in lowered.steps if s.node.name == "fc1").ops
    assert launch.function == f"{qgemm.GELU.prefix}_128_{act}0_i8", launch.function
    got, want = Emulator(graph, lowered, feeds).run(), GraphRunner(graph).run(feeds)
    diff = np.abs(got["h_q"].astype(np.int32) - want["h_q"].astype(np.int32))
    assert diff.max() <= 1 and np.count_nonzero(diff) <= 1, np.count_nonzero(diff)
    assert len(np.unique(want["h_q"])) > 40  # many steps exercised, not a saturated or all-zero layer


def test_emulated_bert_qdq_runs_every_encoder_linear_layer_as_one_qgemm_launch():
    """The 12 encoder layers (GELU or none) are one launch each; the pooler's Tanh keeps the cuBLASLt path."""
    feeds = bert_feeds(2, 16)
    graph = optimized_graph(small_model("bert_qdq"), feeds, kiln.BuilderFlag.FP16)
    lowered = lowered_at(graph, feeds, QGEMM)
    qmatmuls = [s for s in lowered.steps if s.node.op_type == "QMatMul"]
    tactics = lowered.tactics()
    assert [tactics[s.node.name] for s in qmatmuls] == ["gemm:qgemm_sm90"] * 12 + ["gemm:cublaslt_int8"]
    assert all(len(s.ops) == 1 and isinstance(s.ops[0], Launch) for s in qmatmuls[:12])
    assert qmatmuls[-1].node.attr("activation") == "Tanh"
    got, want = Emulator(graph, lowered, feeds).run(), GraphRunner(graph).run(feeds)
    for name, value in want.items():  # as test_int8_gemm's fp16 bert_qdq: LayerNorm/attention rounding elsewhere
        scale = float(np.abs(value).max())
        assert float(np.abs(got[name] - value).max()) <= 1e-2 * scale, name


def _qmatmul_context(k: int, n: int, constants: dict[str, np.ndarray], options: LoweringOptions = QGEMM):
    node = Node("QMatMul", ["x", "s", "w", "ws", ""], ["y"], {"transB": 1, "activation": ""}, "fc", "kiln", 1)
    i8, f32 = np.dtype(np.int8), np.dtype(np.float32)
    infos = {"x": TensorInfo(i8, (4, k)), "s": TensorInfo(f32, ()), "w": TensorInfo(i8, (n, k)),
             "ws": TensorInfo(f32, (n,)), "y": TensorInfo(f32, (4, n))}
    return node, lowering.LoweringContext(infos, frozenset({"y"}), {}, options, Graph(nodes=[node]).constants | constants)


@pytest.mark.parametrize("k, n, constant, options, why", [
    (40, 64, True, QGEMM, "K not a multiple of 16"),
    (64, 64, False, QGEMM, "scales computed at run time"),
    (64, 64, True, LoweringOptions(), "the build has the kernel off"),
])
def test_layers_outside_the_kernel_keep_the_cublaslt_path(k, n, constant, options, why):
    scales = {"s": np.array(0.02, np.float32), "ws": np.full(n, 0.01, np.float32)} if constant else {}
    node, ctx = _qmatmul_context(k, n, scales, options)
    ops = lower_qmatmul(node, ctx)
    assert isinstance(ops[0], Int8Gemm) and len(ops) == 2, why


def test_layers_with_fewer_than_min_tiles_keep_the_cublaslt_path(monkeypatch):
    monkeypatch.undo()  # the module's own MIN_TILES (48), not the fixture's 0: these layers have 2 tiles
    x = np.random.default_rng(0).standard_normal((130, 64)).astype(np.float32)
    lowered = lowered_at(optimized_graph(qdq_mlp(), {"x": x}), {"x": x}, QGEMM)
    assert {lowered.tactics()[name] for name in ("fc1", "fc2")} == {"gemm:cublaslt_int8"}


def test_persistent_grid_is_one_block_per_tile_up_to_what_the_sms_hold():
    for form in (qgemm.PINGPONG, qgemm.GELU):
        assert form.grid_blocks(300, 304) == 3 * 3
    for form in (qgemm.PINGPONG, qgemm.GELU):  # 384 and 1,536 tiles: blocks take several
        assert form.grid_blocks(8192, 768) == form.grid_blocks(8192, 3072) == qgemm.sm_count()


@pytest.mark.parametrize("answer, expected", [(114, 114), (None, qgemm.DEFAULT_SMS)])
def test_persistent_grid_is_sized_to_the_gpus_multiprocessors(answer, expected, monkeypatch):
    """An H100 PCIe has 114 SMs: a grid of 132 persistent blocks would leave 18 to start after the others' last tile.
    Without a GPU to ask (the driver raises), the H100 SXM's 132."""
    from engine_core.cuda import driver

    def multiprocessor_count(ordinal: int = 0) -> int:
        if answer is None:
            raise driver.CudaError("cuInit: CUDA_ERROR_NO_DEVICE")
        return answer

    monkeypatch.setattr(qgemm, "SMS", None)
    monkeypatch.setattr(driver, "multiprocessor_count", multiprocessor_count)
    qgemm._device_sms.cache_clear()
    try:
        assert qgemm.GELU.grid_blocks(8192, 3072) == qgemm.PINGPONG.grid_blocks(8192, 768) == expected
        assert qgemm.PINGPONG.grid_blocks(300, 304) == 9
    finally:
        qgemm._device_sms.cache_clear()


def test_a_misaligned_tma_operand_is_an_error_that_names_it():
    """TMA needs 16-byte-aligned tensors: a caller's odd input address fails the launch with a message naming the
    tensor (before any driver call: this runs without a GPU)."""
    from engine_core.backends.cuda.lowering import Ref, TensorMap
    from engine_core.backends.cuda.runner import _PreparedLaunch
    from engine_core.errors import ExecutionError

    launch = Launch(qgemm.MODULE, "qgemm_sm90_128_00_f16", (1, 1, 1), (384, 1, 1),
                    [(TensorMap(Ref("x"), 128, 64, (128, 128)), None)])
    with pytest.raises(ExecutionError, match="'x' through TMA, which needs a 16-byte-aligned address; got 0x1008"):
        _PreparedLaunch(launch, None).run(lambda ref: 0x1008, 0)


# -- on the GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("flag, tolerance", [(None, 1e-6), (kiln.BuilderFlag.FP16, 2e-3)])
@pytest.mark.parametrize("sms", [None, 2])
@pytest.mark.parametrize("dout", [40, 36])
def test_ragged_qgemm_mlp_on_the_gpu_matches_the_cpu_backend(flag, tolerance, sms, dout, monkeypatch):
    """M, N and K off the tile grid (K = 160 and 304: a partial 128-byte K slice; N = 304 and 40 or 36; M up to
    300), with a block per tile and with few blocks taking several tiles each (``SMS`` = 2: 2 blocks whose two teams of
    consumers take turns, one warpgroup each in fc1's ping-pong form, two in fc2's GELU form; the producer's stage
    ring runs from one tile into the next). Rows of 16-byte multiples take the staged epilogue; fc2's fp16 rows of 36 (72 bytes) the direct one.
    The int32 sums are exact and the epilogue keeps the CPU op's order: fp32 differs only by GELU's last bits (the
    kernel's polynomial), FP16 by one fp16 ulp."""
    if not qgemm.available():
        pytest.skip("not an sm_90 GPU (or KILN_QGEMM=0)")
    monkeypatch.setattr(qgemm, "SMS", sms)
    model = qdq_mlp(din=160, hidden=304, dout=dout, seed=7)
    profiles = {"x": ((1, 160), (64, 160), (300, 160))}
    gpu, cpu = build_engine(model, "cuda", profiles, flag), build_engine(model, "cpu", profiles, flag)
    tactics = {layer["name"]: layer["tactic"] for layer in gpu.plan.layers if layer["type"] == "QMatMul"}
    assert tactics == {"fc1": "gemm:qgemm_sm90", "fc2": "gemm:qgemm_sm90"}, tactics
    gctx, cctx = gpu.create_execution_context(), cpu.create_execution_context()
    rng = np.random.default_rng(11)
    for batch in (1, 7, 129, 300):
        x = {"x": rng.standard_normal((batch, 160)).astype(np.float32)}
        got, want = gctx.infer(x)["y"], cctx.infer(x)["y"]
        np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance * float(np.abs(want).max()))


def _int8_input_layer(k: int, n: int, requantize: bool = False) -> onnx.ModelProto:
    """An int8 input read by the GEMM itself (DequantizeLinear -> MatMul with a per-column int8 weight -> + bias):
    the kernel's x descriptor then holds the caller's address. ``requantize``: a QuantizeLinear after it (int8
    output)."""
    rng = np.random.default_rng(k + n)
    inits = {"x_scale": np.array(0.02, np.float32), "zero": np.array(0, np.int8),
             "w": rng.integers(-127, 128, (k, n)).astype(np.int8), "w_scale": rng.random(n, np.float32) * 1e-2,
             "wz": np.zeros(n, np.int8), "bias": rng.standard_normal(n).astype(np.float32),
             "y_scale": np.array(0.3, np.float32)}
    nodes = [helper.make_node("DequantizeLinear", ["x", "x_scale", "zero"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w", "w_scale", "wz"], ["wd"], axis=1),
             helper.make_node("MatMul", ["xd", "wd"], ["h"]),
             helper.make_node("Add", ["h", "bias"], ["yf" if requantize else "y"])]
    if requantize:
        nodes.append(helper.make_node("QuantizeLinear", ["yf", "y_scale", "zero"], ["y"]))
    out_type = TensorProto.INT8 if requantize else TensorProto.FLOAT
    graph = helper.make_graph(nodes, "layer", [helper.make_tensor_value_info("x", TensorProto.INT8, ["m", k])],
                              [helper.make_tensor_value_info("y", out_type, ["m", n])],
                              [numpy_helper.from_array(v, name) for name, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


@pytest.mark.gpu
def test_qgemm_follows_the_callers_input_address_from_run_to_run():
    """x's TMA descriptor is encoded from the caller's buffer: alternating two input buffers (eager, captured and
    replayed runs) reads each one, as the CPU backend computes it."""
    if not qgemm.available():
        pytest.skip("not an sm_90 GPU (or KILN_QGEMM=0)")
    from cuda.bindings import driver

    from engine_core.cuda.driver import DeviceBuffer, check

    m, k, n = 300, 96, 136
    model = _int8_input_layer(k, n)
    profiles = {"x": ((1, k), (m, k), (m, k))}
    gpu, cpu = build_engine(model, "cuda", profiles), build_engine(model, "cpu", profiles)
    assert [layer["tactic"] for layer in gpu.plan.layers if layer["type"] == "QMatMul"] == ["gemm:qgemm_sm90"]
    rng = np.random.default_rng(3)
    xs = [rng.integers(-128, 128, (m, k)).astype(np.int8) for _ in range(2)]
    wants = [cpu.create_execution_context().infer({"x": x})["y"] for x in xs]
    buffers, dy = [DeviceBuffer.from_array(x) for x in xs], DeviceBuffer(m * n * 4)
    ctx, stream = gpu.create_execution_context(), int(check(driver.cuStreamCreate(0), "cuStreamCreate"))
    ctx.set_input_shape("x", (m, k))
    ctx.set_tensor_address("y", dy.ptr)
    for i in (0, 1, 0, 1, 0, 1):
        ctx.set_tensor_address("x", buffers[i].ptr)
        assert ctx.execute_async_v3(stream)
        check(driver.cuStreamSynchronize(stream), "cuStreamSynchronize")
        np.testing.assert_allclose(dy.to_array(np.float32, (m, n)), wants[i], rtol=1e-6, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [40, 48])
def test_requantized_rows_of_any_width_equal_the_cpu_backend(n):
    """An int8 output of 40 columns (rows of 40 bytes: the direct epilogue) and of 48 (16-byte multiples: the staged
    one, a ragged last tile) equals the CPU backend exactly: the epilogue has the CPU op's order and rounding."""
    if not qgemm.available():
        pytest.skip("not an sm_90 GPU (or KILN_QGEMM=0)")
    m, k = 300, 96
    model = _int8_input_layer(k, n, requantize=True)
    profiles = {"x": ((1, k), (m, k), (m, k))}
    gpu, cpu = build_engine(model, "cuda", profiles), build_engine(model, "cpu", profiles)
    assert [layer["tactic"] for layer in gpu.plan.layers if layer["type"] == "QMatMul"] == ["gemm:qgemm_sm90"]
    x = {"x": np.random.default_rng(n).integers(-128, 128, (m, k)).astype(np.int8)}
    got, want = gpu.create_execution_context().infer(x)["y"], cpu.create_execution_context().infer(x)["y"]
    assert got.dtype == np.int8
    np.testing.assert_array_equal(got, want)
