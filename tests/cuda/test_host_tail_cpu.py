"""Where a CUDA plan is cut for its host tail (host_tail.py), without a GPU: a conv -> NonMaxSuppression model keeps
its convolution and everything up to the boxes and scores on the device, the NonMaxSuppression and the layers reading
its selection go to the host; the emulated device part followed by the host tail computes what onnxruntime does; the
build (``prepare_plan``) names the tail's layers; shapes that only wait for input values are not cut."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import engine_core as kiln
from engine_core.backends.cuda import prepare_plan
from engine_core.backends.cuda.host_tail import split_host_tail
from engine_core.backends.cuda.lowering import LoweringOptions, lower_split
from engine_core.backends.cuda.pointwise import Unsupported
from engine_core.cli import host_layers_line
from engine_core.ops import TensorInfo
from engine_core.passes import PIPELINE, infer_shapes
from tests.cuda.emulate import Emulator

CLASSES, SIDE = 3, 8
#: the layers a conv -> NonMaxSuppression model runs on the host: the NMS and what reads its selection
TAIL = ["nms", "batch_and_box", "picked"]


def conv_nms_model(batch: int = 2, seed: int = 0) -> onnx.ModelProto:
    """A detector in miniature: x[B, 3, 8, 8] -> 1x1 Conv -> per-cell boxes [B, 64, 4] (an output) and class scores
    [B, 3, 64] (internal) -> NonMaxSuppression -> ``selected`` [K, 3], and ``picked`` [K, 4] = the selected boxes
    (a tail layer that also reads a device tensor)."""
    rng = np.random.default_rng(seed)
    cells = SIDE * SIDE
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv"),
        helper.make_node("Reshape", ["y", "flat"], ["y_flat"], name="flatten"),
        helper.make_node("Transpose", ["y_flat"], ["per_cell"], name="per_cell", perm=[0, 2, 1]),
        helper.make_node("Split", ["per_cell", "parts"], ["boxes", "logits"], name="split", axis=2),
        helper.make_node("Transpose", ["logits"], ["class_logits"], name="by_class", perm=[0, 2, 1]),
        helper.make_node("Sigmoid", ["class_logits"], ["scores"], name="sigmoid"),
        helper.make_node("NonMaxSuppression", ["boxes", "scores", "max_boxes", "iou", "min_score"], ["selected"],
                         name="nms"),
        helper.make_node("Gather", ["selected", "batch_box"], ["batch_and_box"], name="batch_and_box", axis=1),
        helper.make_node("GatherND", ["boxes", "batch_and_box"], ["picked"], name="picked"),
    ]
    inits = {"w": (rng.standard_normal((4 + CLASSES, 3, 1, 1)) * 1.5).astype(np.float32),
             "b": rng.standard_normal(4 + CLASSES).astype(np.float32) * 0.1,
             "flat": np.array([batch, 4 + CLASSES, cells], np.int64), "parts": np.array([4, CLASSES], np.int64),
             "max_boxes": np.array([5], np.int64), "iou": np.array([0.5], np.float32),
             "min_score": np.array([0.6], np.float32), "batch_box": np.array([0, 2], np.int64)}
    graph = helper.make_graph(
        nodes, "conv_nms", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, SIDE, SIDE])],
        [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, [batch, cells, 4]),
         helper.make_tensor_value_info("selected", TensorProto.INT64, ["detections", 3]),
         helper.make_tensor_value_info("picked", TensorProto.FLOAT, ["detections", 4])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def conv_nms_feeds(batch: int = 2, seed: int = 1) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((batch, 3, SIDE, SIDE)).astype(np.float32)}


def _graph_and_infos(model: onnx.ModelProto, shapes: dict, values: dict | None = None):
    net = kiln.Builder().create_network()
    assert kiln.OnnxParser(net).parse(model)
    graph = copy.deepcopy(net.graph)
    for graph_pass in PIPELINE:
        graph_pass(graph)
    infos = {v.name: TensorInfo(v.dtype, shapes[v.name], (values or {}).get(v.name)) for v in graph.inputs}
    return graph, infer_shapes(graph, infos, values=True)


def test_the_cut_is_at_the_nms_and_upstream_layers_stay_on_the_device():
    graph, infos = _graph_and_infos(conv_nms_model(), {"x": (2, 3, SIDE, SIDE)})
    lowered = lower_split(graph, infos, None, LoweringOptions(cudnn=True))
    tactics, tail = lowered.tactics(), lowered.tail
    assert tail is not None and tail.layers == TAIL
    assert sorted(n for n, t in tactics.items() if t == "host") == sorted(TAIL)
    assert tactics["conv"] == "conv:cudnn" and tactics["sigmoid"].startswith("pointwise:")
    # the device part computes the boxes (an output) and the scores (internal) for the tail: its I/O
    assert tail.boundary == ["boxes", "scores"] and tail.graph_inputs == []
    assert tail.device.output_names == ["boxes", "scores"] and tail.graph.output_names == ["selected", "picked"]
    assert lowered.locations["scores"] == ("io", "scores")  # linear, never reused by the arena
    assert lowered.layouts.get("scores", "linear") == "linear"
    assert "NonMaxSuppression 'nms'" in tail.reason
    assert not any(s.node.name in TAIL for s in lowered.steps)


def test_the_emulated_device_part_and_the_host_tail_match_onnxruntime():
    model, feeds = conv_nms_model(), conv_nms_feeds()
    graph, infos = _graph_and_infos(model, {"x": feeds["x"].shape})
    lowered = lower_split(graph, infos, None, LoweringOptions(cudnn=True))
    tail = lowered.tail
    device = Emulator(tail.device, lowered, feeds).run()
    computed = {**device, **tail.run({name: device[name] for name in tail.boundary})}
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    assert len(want["selected"]) > 2, "the model should select a few boxes"
    np.testing.assert_allclose(computed["boxes"], want["boxes"], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(computed["selected"], want["selected"])
    np.testing.assert_allclose(computed["picked"], want["picked"], rtol=1e-5, atol=1e-5)


def test_the_build_names_the_host_tail(monkeypatch):
    """prepare_plan (kernels stubbed: the cut is the point): tactic "host" for the tail's layers only, the cut recorded
    in the build info, convolutions autotuned as the device part's."""
    from engine_core.cuda import nvrtc

    monkeypatch.setattr(nvrtc, "compile_kernel_file", lambda stem, arch: b"\x7fELF" + stem.encode())
    monkeypatch.setattr(nvrtc, "compile_cubin", lambda source, name, arch, options=(): b"\x7fELF")
    graph, infos = _graph_and_infos(conv_nms_model(), {"x": (2, 3, SIDE, SIDE)})
    tuned = []
    build = prepare_plan(graph, {(0, 0): infos, (0, 1): infos, (0, 2): infos}, arch="sm_90",
                         timer_for=lambda gemm: pytest.fail("nothing to time"),
                         options=LoweringOptions(cudnn=True), conv_tuner=lambda conv: (tuned.append(conv), (0, {0: 1.0}))[1])
    assert sorted(build.info["host_layers"]) == sorted(TAIL)
    assert {n: build.tactics[n] for n in TAIL} == {n: "host" for n in TAIL} and build.tactics["conv"] == "conv:cudnn"
    assert build.info["host_tail"]["boundary"] == ["boxes", "scores"] and len(tuned) == 1
    assert "host_fallback" not in build.info and build.device_memory_size > 0
    summary = {"backend": "cuda", "build_info": {"cuda": build.info},
               "layers": [{"name": n, "type": t, "tactic": build.tactics.get(n, "shape")}
                          for n, t in ((node.name, node.op_type) for node in graph.nodes)]}
    line = host_layers_line(summary)
    assert line is not None and line.startswith(f"3 of {len(graph.nodes)} layers run on the host: nms (NonMaxSuppression)")
    assert "after the device part" in line and "NonMaxSuppression 'nms'" in line


def _reshape_then_nms() -> onnx.ModelProto:
    """boxes = Reshape(x, shape) with ``shape`` fed at run time, then NonMaxSuppression."""
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["boxes"], name="reshape"),
             helper.make_node("NonMaxSuppression", ["boxes", "scores"], ["selected"], name="nms")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8]),
                     helper.make_tensor_value_info("shape", TensorProto.INT64, [3]),
                     helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, 1, 2])],
        [helper.make_tensor_value_info("selected", TensorProto.INT64, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_shape_waiting_for_an_input_value_is_not_cut_until_values_are_given():
    shapes = {"x": (8,), "shape": (3,), "scores": (1, 1, 2)}
    graph, infos = _graph_and_infos(_reshape_then_nms(), shapes)
    with pytest.raises(Unsupported, match="depends on input values"):
        split_host_tail(graph, infos)  # the runner binds again with the values
    graph, infos = _graph_and_infos(_reshape_then_nms(), shapes, {"shape": np.array([1, 2, 4], np.int64)})
    tail = split_host_tail(graph, infos, values_given=True)
    assert tail is not None and tail.layers == ["nms"] and tail.graph_inputs == ["scores"]
    assert tail.boundary == ["boxes"] and [n.name for n in tail.device.nodes] == ["reshape"]


def test_with_values_given_any_unknown_shape_starts_the_tail():
    """TopK whose K is computed from data: no DATA_DEPENDENT_OPS layer, yet unknown once the input values are in."""
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("ReduceMax", ["r"], ["top"], name="top", keepdims=0),
             helper.make_node("Cast", ["top"], ["k_scalar"], name="k", to=TensorProto.INT64),
             helper.make_node("Reshape", ["k_scalar", "one"], ["k_vec"], name="k_vec"),
             helper.make_node("TopK", ["r", "k_vec"], ["values", "indices"], name="topk"),
             helper.make_node("Neg", ["x"], ["neg"], name="neg")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6])],
                              [helper.make_tensor_value_info("values", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("neg", TensorProto.FLOAT, [6])],
                              [numpy_helper.from_array(np.array([1], np.int64), "one")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    graph, infos = _graph_and_infos(model, {"x": (6,)})
    with pytest.raises(Unsupported):
        split_host_tail(graph, infos)
    tail = split_host_tail(graph, infos, values_given=True)
    assert tail is not None and tail.layers == ["topk"] and tail.boundary == ["r", "k_vec"]
    assert tail.device.output_names == ["neg", "r", "k_vec"]  # the independent Neg stays on the device
    x = np.array([3.0, -1.0, 2.0, 0.5, 1.0, -4.0], np.float32)
    values = tail.run({"r": np.maximum(x, 0), "k_vec": np.array([3], np.int64)})["values"]
    np.testing.assert_array_equal(values, [3.0, 2.0, 1.0])


def test_a_build_lowered_per_binding_still_names_the_data_dependent_layers(monkeypatch):
    from engine_core.cuda import nvrtc

    monkeypatch.setattr(nvrtc, "compile_kernel_file", lambda stem, arch: b"\x7fELF")
    monkeypatch.setattr(nvrtc, "compile_cubin", lambda source, name, arch, options=(): b"\x7fELF")
    graph, infos = _graph_and_infos(_reshape_then_nms(), {"x": (8,), "shape": (3,), "scores": (1, 1, 2)})
    build = prepare_plan(graph, {(0, 0): infos, (0, 1): infos, (0, 2): infos}, arch="sm_90",
                         timer_for=lambda gemm: pytest.fail("nothing to time"))
    assert build.tactics == {"nms": "host"} and build.info["host_layers"] == ["nms"]
    assert "cut per binding at run time" in build.info["host_tail"]["reason"]
