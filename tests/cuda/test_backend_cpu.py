"""CUDA backend pieces that need no GPU: memory planner, pointwise codegen (NVRTC for sm_90),
lowering checked by a numpy emulation of every launch, and tactic choice with a fake timer."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import engine_core as kiln
from engine_core.backends.cuda import KERNEL_FILES, prepare_plan, select_gemm_tactics
from engine_core.backends.cuda.lowering import lower_graph
from engine_core.backends.cuda.memory import ALIGNMENT, Interval, liveness, plan_memory
from engine_core.backends.cuda.pointwise import (
    Unsupported,
    coalesce,
    pointwise_kernel,
    pointwise_source,
)
from engine_core.backends.cuda.tactics import choose_tactic
from engine_core.cuda import compile_cubin
from engine_core.interpret import GraphRunner
from engine_core.ops import TensorInfo
from engine_core.passes import PIPELINE, infer_shapes
from tests.cuda.emulate import Emulator
from tests.cuda.models import (
    attention_feeds,
    attention_model,
    bert_feeds,
    bert_small,
    cnn_fp16,
    mlp,
    mobilenet_small,
    op_mix,
    resnet_small,
    small_model,
)

# -- memory planner ---------------------------------------------------------------------------------


def _check_no_overlap(intervals, plan):
    for i, a in enumerate(intervals):
        for b in intervals[i + 1:]:
            if a.overlaps(b) and a.nbytes and b.nbytes:
                a0, b0 = plan.offsets[a.name], plan.offsets[b.name]
                assert a0 + a.nbytes <= b0 or b0 + b.nbytes <= a0, (a, b, a0, b0)


def test_planner_reuses_dead_buffers_in_a_chain():
    # x0 -> x1 -> x2 -> x3: only two neighbours are ever live, so two slots suffice
    steps = [([f"t{i}"], [f"t{i + 1}"]) for i in range(6)]
    sizes = {f"t{i}": 1000 for i in range(1, 7)}
    intervals = liveness(steps, sizes)
    plan = plan_memory(intervals)
    assert plan.size == 2 * 1024  # 1000 rounded up to 256-byte multiples, two live at once
    assert plan.total_unshared == 6 * 1024
    assert all(off % ALIGNMENT == 0 for off in plan.offsets.values())
    _check_no_overlap(intervals, plan)


def test_planner_keeps_live_tensors_apart_randomized():
    rng = np.random.default_rng(0)
    intervals = []
    for i in range(200):
        first = int(rng.integers(0, 50))
        intervals.append(Interval(f"t{i}", int(rng.integers(0, 5000)), first, first + int(rng.integers(0, 10))))
    plan = plan_memory(intervals)
    _check_no_overlap(intervals, plan)
    peak_live = max(sum(-(-t.nbytes // 256) * 256 for t in intervals if t.first <= s <= t.last) for s in range(60))
    assert peak_live <= plan.size <= plan.total_unshared


def test_liveness_keeps_outputs_written_but_unread():
    intervals = {t.name: t for t in liveness([(["a"], ["b"]), (["b"], ["c"]), (["c"], ["d"])],
                                             {"b": 8, "c": 8, "d": 8}, keep_alive=["b"])}
    assert (intervals["b"].first, intervals["b"].last) == (0, 2)
    assert (intervals["d"].first, intervals["d"].last) == (2, 2)


# -- pointwise codegen --------------------------------------------------------------------------------


def test_coalesce_merges_contiguous_dims_and_keeps_broadcast_ones():
    assert coalesce((2, 3, 4), [(12, 4, 1), (12, 4, 1)]) == ([24], [[1], [1]])
    assert coalesce((2, 3, 4), [(12, 4, 1), (0, 1, 0)]) == ([2, 3, 4], [[12, 4, 1], [0, 1, 0]])
    assert coalesce((1, 5, 1), [(5, 1, 1)]) == ([5], [[1]])


def test_pointwise_family_compiles_for_sm90(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    f32, i64, b = np.dtype(np.float32), np.dtype(np.int64), np.dtype(np.bool_)
    kernels = [pointwise_kernel(op, f32, [f32]) for op in ("Relu", "Sigmoid", "Tanh", "Erf", "Exp", "Log", "Sqrt",
                                                           "Neg", "Abs", "Reciprocal", "Floor", "Ceil", "Softsign",
                                                           "ThresholdedRelu", "Mish", "Tan", "Asin", "Acos", "Atan",
                                                           "Sinh", "Cosh", "Asinh", "Acosh", "Atanh")]
    kernels += [pointwise_kernel(op, np.dtype(np.float16), [np.dtype(np.float16)]) for op in ("Mish", "Softsign")]
    kernels += [pointwise_kernel(op, f32, [f32, f32]) for op in ("Add", "Sub", "Mul", "Div", "Pow", "Max", "Min")]
    kernels += [pointwise_kernel("Add", i64, [i64, i64]), pointwise_kernel("Less", b, [i64, i64]),
                pointwise_kernel("Where", f32, [b, f32, f32]), pointwise_kernel("Cast", b, [f32]),
                pointwise_kernel("Cast", f32, [i64]), pointwise_kernel("Clip", f32, [f32, f32, f32]),
                pointwise_kernel("And", b, [b, b]), pointwise_kernel("Not", b, [b])]
    cubin = compile_cubin(pointwise_source(kernels), "pw.cu", "sm_90")
    assert cubin[:4] == b"\x7fELF"
    for k in kernels:
        assert k.name.encode() in cubin, k.name


def test_pointwise_rejects_what_it_cannot_do():
    with pytest.raises(Unsupported):
        pointwise_kernel("Sigmoid", np.int64, [np.int64])
    with pytest.raises(Unsupported):
        pointwise_kernel("Add", np.complex64, [np.complex64, np.complex64])
    with pytest.raises(Unsupported):
        pointwise_kernel("Not", np.float32, [np.float32])


# -- lowering, checked by emulating every launch on the host ------------------------------------------


def _graph_and_infos(model, shapes):
    net = kiln.Builder().create_network()
    kiln.OnnxParser(net).parse(model)
    graph = copy.deepcopy(net.graph)
    for graph_pass in PIPELINE:
        graph_pass(graph)
    infos = {v.name: TensorInfo(v.dtype, shapes[v.name]) for v in graph.inputs}
    return graph, infer_shapes(graph, infos, values=True)


def _emulate_vs_ort(model, feeds, rtol=1e-5, atol=1e-5, gemm_choice=None):
    graph, infos = _graph_and_infos(model, {k: v.shape for k, v in feeds.items()})
    lowered = lower_graph(graph, infos, gemm_choice)
    got = Emulator(graph, lowered, feeds).run()
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=rtol, atol=atol, err_msg=name)
    return lowered


def test_lowered_mlp_matches_onnxruntime():
    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    lowered = _emulate_vs_ort(mlp(), {"x": x})
    # Gemm+Relu and MatMul+Add+Tanh are fused: a GEMM each, then one epilogue kernel
    assert lowered.tactics() == {"fc1": "gemm:cublas", "fc2": "gemm:cublas", "softmax": "kernel:Softmax"}
    assert [s.node.op_type for s in lowered.steps] == ["FusedMatMul", "FusedMatMul", "Softmax"]
    assert [len(s.ops) for s in lowered.steps] == [2, 2, 1]
    assert lowered.memory.size <= lowered.memory.total_unshared  # two intermediates, both live at fc2


def test_activations_and_trigonometry_run_as_generated_kernels():
    """Softsign, Mish, ThresholdedRelu and the trigonometric/hyperbolic ops lower to generated pointwise kernels (no
    host fallback) and match onnxruntime; each op feeds an output of its own, on inputs inside its domain."""
    h = onnx.helper
    ops = [("Softsign", "x", {}), ("Mish", "x", {}), ("ThresholdedRelu", "x", {"alpha": 0.25}), ("Tan", "x", {}),
           ("Asin", "x", {}), ("Acos", "x", {}), ("Atan", "x", {}), ("Sinh", "x", {}), ("Cosh", "x", {}),
           ("Asinh", "x", {}), ("Atanh", "x", {}), ("Acosh", "x_ge1", {})]
    nodes = [h.make_node("Abs", ["x"], ["x_abs"], name="abs"), h.make_node("Add", ["x_abs", "one"], ["x_ge1"], name="ge1")]
    nodes += [h.make_node(op, [source], [f"y_{op}"], name=op.lower(), **attrs) for op, source, attrs in ops]
    graph = h.make_graph(nodes, "activations", [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4, 64])],
                         [h.make_tensor_value_info(f"y_{op}", onnx.TensorProto.FLOAT, [4, 64]) for op, _, _ in ops],
                         [onnx.numpy_helper.from_array(np.array(1.1, np.float32), "one")])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 18)])
    model.ir_version = 8
    x = np.random.default_rng(0).uniform(-0.9, 0.9, (4, 64)).astype(np.float32)
    tactics = _emulate_vs_ort(model, {"x": x}).tactics()
    assert all(tactics[op.lower()].startswith("pointwise") for op, _, _ in ops), tactics


def test_lowered_op_mix_matches_onnxruntime_with_visible_host_fallback():
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, 5, 6)).astype(np.float32), "ids": np.array([[1, 2, 3], [9, 0, -1]])}
    lowered = _emulate_vs_ort(op_mix(), feeds)
    tactics = lowered.tactics()
    assert tactics["cumsum_host"] == "host"
    assert [n for n, t in tactics.items() if t == "host"] == ["cumsum_host"]
    assert tactics["reshape_view"] == "view" and tactics["matmul_batched"] == "gemm:cublas"
    _emulate_vs_ort(op_mix(), feeds, gemm_choice={"matmul_batched": "kiln_gemm", "gemm_ta": "kiln_gemm"})


def test_lowered_bert_small_matches_onnxruntime_and_folds_shape_math():
    feeds = bert_feeds(2, 16)
    lowered = _emulate_vs_ort(bert_small(), feeds, rtol=1e-4, atol=1e-4)
    tactics = lowered.tactics()
    assert "host" not in tactics.values()
    assert not any(s.node.op_type in ("Shape", "Range") for s in lowered.steps)  # computed by shape inference
    # liveness reuse: the peak is a fraction of all activations (fp32 attention keeps its step-local copies)
    assert lowered.memory.size < lowered.memory.total_unshared / 3


# -- tactic choice and the build step -------------------------------------------------------------------


def test_choose_tactic_takes_the_fastest_and_survives_failures():
    times = {"cublas": 2.0, "kiln_gemm": 1.5}
    assert choose_tactic(["cublas", "kiln_gemm"], times.__getitem__) == ("kiln_gemm", times)

    def broken(name):
        if name == "kiln_gemm":
            raise RuntimeError("launch failed")
        return 3.0

    best, measured = choose_tactic(["cublas", "kiln_gemm"], broken)
    assert best == "cublas" and measured["kiln_gemm"] == float("inf")


def test_prepare_plan_records_timed_tactics_kernels_and_peak(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    graph, infos = _graph_and_infos(mlp(), {"x": (8, 64)})
    _, big = _graph_and_infos(mlp(), {"x": (64, 64)})
    seen = []

    def timer_for(gemm):
        seen.append((gemm.m, gemm.n, gemm.k))
        return lambda tactic: {"cublas": 1.0 + gemm.k / 1000, "kiln_gemm": 1.1}[tactic]

    build = prepare_plan(graph, {(0, 0): infos, (0, 1): infos, (0, 2): big}, arch="sm_90", timer_for=timer_for)
    assert sorted(seen) == [(8, 32, 256), (8, 256, 64)]  # timed once each, at the opt shapes
    assert build.tactics["fc1"] == "gemm:cublas" and build.tactics["fc2"] == "gemm:kiln_gemm"
    assert set(build.kernels) == {"pointwise", *KERNEL_FILES}
    assert all(cubin[:4] == b"\x7fELF" for cubin in build.kernels.values())
    lowered_max = lower_graph(graph, big)
    assert build.device_memory_size == lowered_max.memory.size > 0


def test_select_gemm_tactics_only_times_gemm_layers():
    graph, infos = _graph_and_infos(mlp(), {"x": (4, 64)})
    choice, timings = select_gemm_tactics(lower_graph(graph, infos), lambda op: (lambda t: 1.0))
    assert set(choice) == {"fc1", "fc2"} and set(timings["fc1"]) == {"cublas", "kiln_gemm"}


# -- convolutions, channels-last layouts, fp16, attention (emulated launches vs the CPU backend) ---------


def _emulate_vs_cpu(model, feeds, options, rtol, atol, unfused_convs=False):
    from engine_core.backends.cuda.lowering import LoweringOptions

    graph, infos = _graph_and_infos(model, {k: v.shape for k, v in feeds.items()})
    lowered = lower_graph(graph, infos, None, LoweringOptions(**options))
    got = Emulator(graph, lowered, feeds, unfused_convs).run()
    want = GraphRunner(graph).run(feeds)
    for name, value in want.items():
        np.testing.assert_allclose(got[name].astype(np.float32), value.astype(np.float32), rtol=rtol, atol=atol,
                                   err_msg=name)
    return lowered


def test_fp16_cnn_runs_convolutions_channels_last_with_visible_reformats():
    x = np.random.default_rng(0).standard_normal((2, 3, 16, 16)).astype(np.float16)
    lowered = _emulate_vs_cpu(cnn_fp16(), {"x": x}, {"cudnn": True}, rtol=2e-2, atol=2e-2)
    tactics = lowered.tactics()
    assert "host" not in tactics.values(), tactics
    assert tactics["conv1"] == tactics["conv2"] == "conv:cudnn"
    assert tactics["pool1"] == "kernel:MaxPool" and tactics["bn"].startswith("pointwise:")
    (pool,) = next(s for s in lowered.steps if s.node.name == "pool1").ops
    channels = lowered.infos["p1"].shape[1]  # the channels-last kernel needs 16 bytes (8 fp16) of channels
    assert pool.function == ("max_pool_nhwc_f16" if channels % 8 == 0 else "max_pool_f16"), (pool.function, channels)
    # the image enters channels-last through a reformat; activations stay NHWC; outputs are linear
    assert [n for n, t in tactics.items() if t.startswith("reformat")] == ["reformat:x->nhwc"]
    assert lowered.layouts["r1"] == lowered.layouts["p1"] == "nhwc"  # conv1+relu1 fused: r1 is the conv output
    assert {s.node.op_type for s in lowered.steps if s.tactic == "conv:cudnn"} == {"FusedConv", "Conv"}
    # conv3 + residual + relu2 writes the graph output r2: cuDNN writes channels-last into a step buffer,
    # a reformat copy writes r2; the epilogue is ready as kernels in case cuDNN cannot fuse it
    step = next(s for s in lowered.steps if "r2" in s.node.outputs)
    conv = step.ops[0]
    assert step.scratch == [f"{step.node.name}#conv"] and conv.y.tensor == step.scratch[0]
    assert conv.z is not None and conv.activation == "Relu" and len(conv.fallback) == 1
    assert [type(op).__name__ for op in step.ops] == ["Conv", "Launch"]
    assert lowered.layouts.get("r2", "linear") == "linear" and lowered.weight_transforms["w1#krsc"] == ("w1", "krsc")


def test_convolutions_fall_back_to_the_host_visibly_without_cudnn():
    x = np.random.default_rng(1).standard_normal((1, 3, 16, 16)).astype(np.float16)
    lowered = _emulate_vs_cpu(cnn_fp16(), {"x": x}, {"cudnn": False}, rtol=2e-2, atol=2e-2)
    assert lowered.tactics()["conv1"] == "host" and not lowered.layouts.get("c1")


def test_small_resnet_and_mobilenet_lower_without_host_layers():
    rng = np.random.default_rng(2)
    for model in (resnet_small(), mobilenet_small()):
        x = rng.standard_normal((1, 3, 64, 64)).astype(np.float32)
        lowered = _emulate_vs_cpu(model, {model.graph.input[0].name: x}, {"cudnn": True}, rtol=1e-3, atol=1e-4)
        host = [n for n, t in lowered.tactics().items() if t == "host"]
        assert host == [], host


def test_resnet50_qdq_in_float_runs_each_fake_quantization_as_one_kernel(tmp_path, monkeypatch):
    """resnet50_qdq without INT8 convolutions (the default): every activation's Q -> DQ pair is one generated
    kernel between cuDNN convolutions (53 chains, none on the host), the emulated launches equal the CPU
    backend exactly, and the generated kernels compile for sm_90."""
    monkeypatch.setenv("KILN_INT8_CONV", "0")
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    x = np.random.default_rng(3).standard_normal((2, 3, 64, 64)).astype(np.float32)
    lowered = _emulate_vs_cpu(small_model("resnet50_qdq"), {"input": x}, {"cudnn": True}, rtol=0, atol=0)
    assert compile_cubin(pointwise_source(lowered.kernels), "pw.cu", "sm_90")[:4] == b"\x7fELF"
    tactics = lowered.tactics()
    assert "host" not in tactics.values()
    chains = [s for s in lowered.steps if s.node.op_type == "PointwiseChain"]
    assert len(chains) == 53 and all(
        [n.op_type for n in s.node.attrs["body"].nodes] == ["QuantizeLinear", "DequantizeLinear"] for s in chains)
    # only the classifier's input quantization stands alone (its QMatMul reads the int8 tensor)
    assert [s.node.op_type for s in lowered.steps if s.node.op_type in ("QuantizeLinear", "DequantizeLinear")] \
        == ["QuantizeLinear"]


@pytest.mark.parametrize("case, options, tactic", [
    (dict(causal=0), {}, "kernel:flash_attention"),
    (dict(causal=1), {}, "kernel:flash_attention"),
    (dict(dtype=onnx.TensorProto.BFLOAT16, dim=64, seq=80, kv_seq=70, mask="bool"), {}, "kernel:flash_attention"),
    (dict(dtype=onnx.TensorProto.FLOAT, three_d=True, heads=4, kv_heads=2, seq=70), {"tf32": True},
     "kernel:flash_attention"),
    (dict(three_d=True, dim=128, causal=1, mask=""), {}, "kernel:flash_attention"),
    (dict(three_d=True, dim=64, mask="row"), {}, "kernel:flash_attention"),
    (dict(dtype=onnx.TensorProto.FLOAT, causal=1), {}, "gemm:cublas"),          # fp32 without TF32: no flash
    (dict(dtype=onnx.TensorProto.FLOAT, three_d=True), {}, "gemm:cublas"),      # ... the 3-D form through copies
    (dict(dim=48), {}, "gemm:cublas"),                                          # no kernel for this head size
])
def test_attention_lowering_flash_or_gemms_around_the_masked_softmax(case, options, tactic):
    model = attention_model(**case)
    feeds = attention_feeds(model, np.random.default_rng(3))
    fp32 = case.get("dtype") == onnx.TensorProto.FLOAT
    tol = 1e-4 if fp32 and not options else 2e-2
    lowered = _emulate_vs_cpu(model, feeds, options, rtol=tol, atol=tol)
    step = next(s for s in lowered.steps if s.node.op_type == "Attention")
    assert step.tactic == tactic
    if tactic == "kernel:flash_attention":
        assert [o.function for o in step.ops] == [f"flash_attention_{case.get('dim', 32)}_"
                                                  f"{'tf32' if fp32 else 'bf16' if 'dtype' in case else 'f16'}"]
        assert step.scratch == []
    else:
        kinds = [type(o).__name__ for o in step.ops]
        copies = 4 if case.get("three_d") else 0  # Q, K, V in; Y out
        assert kinds.count("Gemm") == 2 and len(kinds) == 3 + copies and "attention#scores" in step.scratch


def test_fp16_and_channels_last_kernels_compile_for_sm90(tmp_path, monkeypatch):
    from engine_core.backends.cuda.lowering import LoweringOptions

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    graph, infos = _graph_and_infos(cnn_fp16(), {"x": (2, 3, 16, 16)})
    lowered = lower_graph(graph, infos, None, LoweringOptions(cudnn=True))
    cubin = compile_cubin(pointwise_source(lowered.kernels), "pw.cu", "sm_90")
    for kernel in lowered.kernels:
        assert kernel.name.encode() in cubin


def test_a_reformatted_conv_input_stays_alive_until_the_conv_has_read_it():
    from engine_core.backends.cuda.lowering import LoweringOptions

    graph, infos = _graph_and_infos(cnn_fp16(), {"x": (4, 3, 16, 16)})
    lowered = lower_graph(graph, infos, None, LoweringOptions(cudnn=True))
    conv1 = next(s for s in lowered.steps if s.node.name == "conv1")
    assert conv1.node.inputs[0] == "x#nhwc"
    placed = lowered.locations
    out = conv1.node.outputs[0]
    a, b = placed["x#nhwc"][1], placed[out][1]
    size = lambda n: int(np.prod(lowered.infos[n].shape)) * 2  # noqa: E731
    assert a + size("x#nhwc") <= b or b + size(out) <= a  # input copy and conv output never share bytes


def test_conv_plans_are_timed_once_per_signature_and_cached():
    from engine_core.backends.cuda import select_conv_plans
    from engine_core.backends.cuda.lowering import LoweringOptions
    from engine_core.timing_cache import TimingCache

    graph, infos = _graph_and_infos(resnet_small(), {"input": (2, 3, 64, 64)})
    lowered = lower_graph(graph, infos, None, LoweringOptions(cudnn=True))
    tuned = []

    def tuner(conv):
        tuned.append(conv.key())
        return 1, {0: 2.0, 1: 1.0, 2: 3.0}

    cache = TimingCache("sm_90")
    choice, _ = select_conv_plans([lowered], tuner, cache, "sm_90")
    assert len(tuned) == len(set(tuned)) == len(choice) and set(choice.values()) == {1}
    again, _ = select_conv_plans([lowered], lambda conv: pytest.fail("timed again"), cache, "sm_90")
    assert again == choice and cache.hits == len(choice)


def test_prepare_plan_defers_lowering_when_shapes_depend_on_input_values(tmp_path, monkeypatch):
    from onnx import TensorProto, helper

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    node = helper.make_node("Reshape", ["x", "shape"], ["y"])
    model = helper.make_model(helper.make_graph(
        [node, helper.make_node("Relu", ["y"], ["z"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6]),
         helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)]), opset_imports=[helper.make_opsetid("", 17)])
    graph, infos = _graph_and_infos(model, {"x": (2, 6), "shape": (2,)})
    build = prepare_plan(graph, {(0, 0): infos, (0, 1): infos, (0, 2): infos}, arch="sm_90",
                         timer_for=lambda gemm: pytest.fail("nothing to time"))
    assert build.tactics == {} and "pointwise" in build.kernels  # lowered per binding at run time


def test_qdq_per_channel_runs_as_pointwise_kernels():
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(9)
    scale = (rng.random(4) * 0.05 + 0.01).astype(np.float32)
    zero = rng.integers(-5, 5, 4).astype(np.int8)
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], axis=1),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], axis=1)]
    model = helper.make_model(helper.make_graph(
        nodes, "qdq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 3]),
         helper.make_tensor_value_info("q", TensorProto.INT8, [2, 4, 3])],
        [numpy_helper.from_array(scale, "s"), numpy_helper.from_array(zero, "z")]),
        opset_imports=[helper.make_opsetid("", 21)])
    x = (rng.standard_normal((2, 4, 3)) * 3).astype(np.float32)
    lowered = _emulate_vs_ort(model, {"x": x}, rtol=0, atol=1e-6)
    assert [t.split(":")[0] for t in lowered.tactics().values()] == ["pointwise", "pointwise"]


@pytest.mark.parametrize("mode", [True, "bias_only"])
@pytest.mark.parametrize("model", ["cnn", "resnet", "mobilenet"])
def test_conv_epilogue_kernels_stand_in_when_cudnn_cannot_fuse(model, mode):
    """cuDNN may have no engine for a fused graph (exact fp32, odd channel counts): the bare convolution then
    runs and the lowering's fallback kernels add bias, residual and activation."""
    rng = np.random.default_rng(10)
    if model == "cnn":
        feeds, make, tol = {"x": rng.standard_normal((2, 3, 16, 16)).astype(np.float16)}, cnn_fp16, 2e-2
    else:
        feeds = {"input": rng.standard_normal((2, 3, 64, 64)).astype(np.float32)}
        make, tol = (resnet_small if model == "resnet" else mobilenet_small), 1e-3
    lowered = _emulate_vs_cpu(make(), feeds, {"cudnn": True}, rtol=tol, atol=tol * 10, unfused_convs=mode)
    assert any(op.fallback for s in lowered.steps for op in s.ops if type(op).__name__ == "Conv")


def test_an_identity_of_a_channels_last_tensor_reads_it_as_linear():
    """Identity is a view: aliasing a channels-last conv output would hand its NHWC bytes on as NCHW (a graph
    output came out scrambled); views get linear inputs first."""
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((4, 3, 3, 3)) * 0.3).astype(np.float32)
    nodes = [onnx.helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             onnx.helper.make_node("Identity", ["c"], ["y"], name="identity"),
             onnx.helper.make_node("Relu", ["c"], ["r"], name="relu"),
             onnx.helper.make_node("Identity", ["r"], ["i"], name="inner"),
             onnx.helper.make_node("Neg", ["i"], ["z"], name="neg")]
    graph = onnx.helper.make_graph(
        nodes, "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3, 8, 8])],
        [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in ("y", "z")],
        [onnx.numpy_helper.from_array(w, "w")])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    lowered = _emulate_vs_cpu(model, {"x": x}, {"cudnn": True}, rtol=1e-4, atol=1e-4)
    assert lowered.tactics()["conv"] == "conv:cudnn"
