"""bench/int8.py end to end on the CPU backend with make_models' small models (what the GPU run does at full size)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

import engine_core as kiln
from bench import int8
from tools.make_models import MODELS

FAST = ["--device", "cpu", "--small", "--models", "bert_base", "--batches", "1,2", "--sequences", "4",
        "--calib-batches", "2", "--iters", "1"]


def _run(out: Path, *extra: str) -> dict:
    before = set(out.glob("int8_*.json"))
    assert int8.main([*FAST, "--out", str(out), *extra]) == 0
    (path,) = set(out.glob("int8_*.json")) - before
    return json.loads(path.read_text())


def test_cpu_small_bert_writes_every_variant_and_batch(tmp_path):
    result = _run(tmp_path)
    assert result["backend"] == "cpu" and result["versions"]["kiln"] and "--small" in result["argv"]
    rows = {(r["variant"], r["batch"]): r for r in result["rows"]}
    assert [r for r in result["rows"] if "error" in r] == []
    assert set(rows) == {(v, b) for v in ("fp32", "fp16", "int8_implicit", "int8_explicit") for b in (1, 2)}
    for (variant, batch), r in rows.items():
        assert r["kiln_ms"] > 0 and r["items_per_s"] == pytest.approx(batch / r["kiln_ms"] * 1000, rel=0.01)
        assert r["accuracy"]["items"] == 4 and r["plan"]["host_layers"] == 0
        if variant != "fp32":
            assert r["speedup_vs_kiln_fp16"] == pytest.approx(rows["fp16", batch]["kiln_ms"] / r["kiln_ms"], rel=0.01)
    fp32, fp16 = rows["fp32", 2], rows["fp16", 2]
    assert fp32["accuracy"]["max_abs_err"] == 0 and fp32["accuracy"]["cosine_min"] == pytest.approx(1.0)
    assert fp32["plan"]["int8_gemm_layers"] == 0 and fp16["plan"]["int8"] is None
    assert 0 < fp16["accuracy"]["rel_l2_err"] < 0.01
    for variant, mode in (("int8_implicit", "implicit"), ("int8_explicit", "explicit")):
        r = rows[variant, 2]
        # 2 layers x (Q, K, V, output, 2 FFN) + the pooler: every linear layer became an int8 GEMM
        assert r["plan"]["int8_gemm_layers"] == 13 and r["plan"]["int8"]["mode"] == mode
        assert r["plan"]["passes"]["fuse_qdq_matmul"] == 13
        assert 0 < r["accuracy"]["rel_l2_err"] < 0.05 and r["accuracy"]["cosine_min"] > 0.99
    assert rows["int8_explicit", 1]["qdq"]["quantized_layers"] == 13
    calibration = rows["int8_implicit", 1]["calibration"]
    assert calibration["algorithm"] == "entropy" and not calibration["reused"]
    assert Path(calibration["cache"]).parent == tmp_path and Path(calibration["cache"]).read_bytes().startswith(b"KILN-")

    again = _run(tmp_path, "--variants", "int8_implicit")  # the cache next to the JSON is read, not recomputed
    assert {r["variant"] for r in again["rows"]} == {"fp32", "int8_implicit"}
    reused = next(r for r in again["rows"] if r["variant"] == "int8_implicit")
    assert reused["calibration"]["reused"] and reused["calibration"]["cache"] == calibration["cache"]
    assert reused["accuracy"] == rows["int8_implicit", 1]["accuracy"]
    assert reused["speedup_vs_kiln_fp16"] is None  # no fp16 row in that run


def test_cpu_small_bert_with_an_int8_residual_stream(tmp_path):
    """int8_explicit_residual: the 4 encoder residual Adds quantized as well as the 13 linear layers; the plan keeps
    no DequantizeLinear and no QuantizeLinear but the pooler's, and stays close to fp32."""
    result = _run(tmp_path, "--variants", "int8_explicit_residual")
    row = next(r for r in result["rows"] if r["variant"] == "int8_explicit_residual" and r["batch"] == 2)
    assert "error" not in row and row["qdq"]["quantized_layers"] == 13 + 4
    assert row["plan"]["int8_gemm_layers"] == 13 and row["plan"]["qdq_layers"] == 1 and row["plan"]["host_layers"] == 0
    assert 0 < row["accuracy"]["rel_l2_err"] < 0.05 and row["accuracy"]["cosine_min"] > 0.99


def test_quantize_explicitly_quantizes_resnet_like_make_models():
    """The small make_models ResNet-50 made Q/DQ by bench.int8: BN folded, 53 convs + the classifier + 16
    residual Adds quantized, and onnxruntime's output of the Q/DQ model stays close to the float model's."""
    ort = pytest.importorskip("onnxruntime")
    float_model = MODELS["resnet50"][1]()
    feeds = [{"input": np.random.default_rng(k).standard_normal((2, 3, 64, 64), dtype=np.float32)} for k in range(2)]
    model, counts = int8.quantize_explicitly(onnx.ModelProto.FromString(float_model.SerializeToString()), True, feeds)
    assert counts == {"quantized_layers": 70, "quantized_activations": 54, "skipped_shared_or_nonconstant_weight": 0}
    ops = [n.op_type for n in model.graph.node]
    assert "BatchNormalization" not in ops
    assert ops.count("QuantizeLinear") == 54 and ops.count("DequantizeLinear") == 54 + 54  # activations + weights

    def run(m: onnx.ModelProto) -> np.ndarray:
        m.ir_version = min(m.ir_version, 10)
        session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        return session.run(None, feeds[0])[0]

    ref, quantized = run(float_model), run(model)
    assert 0 < np.linalg.norm(quantized - ref) / np.linalg.norm(ref) < 0.1


@pytest.mark.parametrize("args, message", [
    (["--models", "vgg"], "unknown model 'vgg'"),
    (["--variants", "int4"], "unknown variant 'int4'"),
    (["--batches", "1,x"], "comma-separated integers"),
    (["--batches", "0"], "batch sizes must be >= 1"),
    (["--images", "0"], "must be >= 1"),
])
def test_bad_arguments_are_named(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        int8.main(["--device", "cpu", "--small", *args])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_cuda_without_a_cuda_backend_says_so(capsys):
    if "cuda" in kiln.available_backends():
        pytest.skip("this machine has the CUDA backend")
    with pytest.raises(SystemExit) as exit_info:
        int8.main(["--device", "cuda"])
    assert exit_info.value.code == 2 and "CUDA backend" in capsys.readouterr().err


def test_quantize_explicitly_accepts_nodes_without_inputs():
    """torch's BERT export has Constant nodes (no inputs): the BN fold looked at every node's first input and
    raised IndexError on them, so the H100 run's `int8_explicit` BERT rows were errors."""
    pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w")
    shift = numpy_helper.from_array(np.ones(8, np.float32), "shift_value")
    graph = helper.make_graph(
        [helper.make_node("Constant", [], ["shift"], value=shift),
         helper.make_node("MatMul", ["x", "w"], ["h"]),
         helper.make_node("Add", ["h", "shift"], ["y"])],
        "constant_then_matmul", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = [{"x": rng.standard_normal((2, 8)).astype(np.float32)}]
    model, counts = int8.quantize_explicitly(model, False, feeds)
    assert counts["quantized_layers"] == 1
    assert [n.op_type for n in model.graph.node].count("QuantizeLinear") == 1
