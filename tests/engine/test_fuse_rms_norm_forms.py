"""fuse_rms_norm on the forms transformers exports (test_fusions.py has the plain one): LlamaRMSNorm's float32 chain
between Casts, torch.rsqrt written as Pow(-0.5), a float32 chain over a 16-bit input cast back to it, a Cast after
gamma; and the Casts it must not drop. Each: the layers after the pass, and its outputs against the unfused graph
on the CPU backend (and onnxruntime through a build)."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from engine_core.interpret import GraphRunner
from engine_core.passes import fuse_rms_norm
from tests.engine.test_fusions import _matches_ort
from tests.engine.util import parsed_graph

WIDTH = 16


def _model(nodes: list[onnx.NodeProto], x_type: int, out_type: int, gamma: np.ndarray,
           outputs: tuple[str, ...] = ("y",)) -> onnx.ModelProto:
    inits = {"two": np.float32(2), "eps": np.float32(1e-6), "one": np.float32(1), "minus_half": np.float32(-0.5),
             "gamma": gamma}
    used = {i for n in nodes for i in n.input}
    graph = helper.make_graph(nodes, "rms", [helper.make_tensor_value_info("x", x_type, ["batch", 3, WIDTH])],
                              [helper.make_tensor_value_info(o, out_type, None) for o in outputs],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items() if k in used])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def _statistic(inverse: str) -> list[onnx.NodeProto]:
    """xf -> inv: 1 / sqrt(mean(xf^2) + eps) as Div(1, Sqrt) (torch.rsqrt's usual export) or Pow(-0.5)."""
    nodes = [helper.make_node("Pow", ["xf", "two"], ["sq"]),
             helper.make_node("ReduceMean", ["sq"], ["ms"], axes=[-1], keepdims=1),
             helper.make_node("Add", ["ms", "eps"], ["me"])]
    if inverse == "pow":
        return nodes + [helper.make_node("Pow", ["me", "minus_half"], ["inv"])]
    return nodes + [helper.make_node("Sqrt", ["me"], ["r"]), helper.make_node("Div", ["one", "r"], ["inv"])]


def _llama(inverse: str = "div", x_type: int = TensorProto.FLOAT, back_to: int = TensorProto.FLOAT,
           residual: bool = False) -> onnx.ModelProto:
    """LlamaRMSNorm: xf = x.to(float32); y = gamma * (xf * rsqrt(mean(xf^2) + eps)).to(back_to); ``residual``: xf
    also read by an Add (the export's residual connection reads the Cast's output)."""
    nodes = [helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT), *_statistic(inverse),
             helper.make_node("Mul", ["xf", "inv"], ["n"]), helper.make_node("Cast", ["n"], ["nc"], to=back_to),
             helper.make_node("Mul", ["gamma", "nc"], ["y"])]
    if residual:
        nodes.append(helper.make_node("Add", ["xf", "y"], ["z"]))
    gamma = (np.random.default_rng(1).standard_normal(WIDTH) * 0.3 + 1).astype(helper.tensor_dtype_to_np_dtype(back_to))
    return _model(nodes, x_type, back_to, gamma, ("z",) if residual else ("y",))


def _fused(model: onnx.ModelProto, count: int = 1):
    before = parsed_graph(model)
    after = copy.deepcopy(before)
    assert fuse_rms_norm(after) == count
    return before, after


def _feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    dtype = helper.tensor_dtype_to_np_dtype(model.graph.input[0].type.tensor_type.elem_type)
    return {"x": np.random.default_rng(0).standard_normal((2, 3, WIDTH)).astype(dtype)}


def _close(before, after, feeds: dict[str, np.ndarray], tol: float) -> None:
    want, got = GraphRunner(before).run(feeds), GraphRunner(after).run(feeds)
    for name in before.output_names:
        assert got[name].dtype == want[name].dtype
        np.testing.assert_allclose(got[name].astype(np.float32), want[name].astype(np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("inverse", ["div", "pow"])
def test_llama_rms_norm_between_casts_that_convert_nothing(inverse):
    """An fp32 export: both Casts are to float32 of float32 tensors. The fused layer reads x itself (the input Cast
    converts nothing), and the Cast stays only for the residual Add that reads it too."""
    model = _llama(inverse, residual=True)
    before, after = _fused(model)
    assert [n.op_type for n in after.nodes] == ["Cast", "RMSNormalization", "Add"]
    norm = after.nodes[1]
    assert norm.inputs == ["x", "gamma"] and norm.outputs == ["y"] and norm.attrs["epsilon"] == pytest.approx(1e-6)
    assert len(norm.origin) == len(model.graph.node) - 2  # all but the input Cast and the residual Add
    _close(before, after, _feeds(model), 1e-5)
    _matches_ort(model, _feeds(model), rtol=1e-5, atol=1e-5)


def test_an_fp32_chain_over_fp16_cast_back_is_rms_normalization_of_the_fp16_input():
    """x fp16 -> float32 statistic -> fp16 again -> fp16 gamma: RMSNormalization(x, gamma) in fp16 (its statistic is
    float32, stash_type 1), both Casts covered (the input Cast has no other reader)."""
    model = _llama(x_type=TensorProto.FLOAT16, back_to=TensorProto.FLOAT16)
    before, after = _fused(model)
    (norm,) = after.nodes
    assert norm.op_type == "RMSNormalization" and norm.inputs == ["x", "gamma"]
    assert len(norm.origin) == len(model.graph.node)
    _close(before, after, _feeds(model), 2e-3)


def test_a_cast_that_rounds_the_normalized_value_stays_unfused():
    """An fp32 x normalized in fp32, then rounded to fp16 before an fp16 gamma: the Cast converts, and no
    RMSNormalization over x's type rounds there, so nothing fuses."""
    model = _llama(x_type=TensorProto.FLOAT, back_to=TensorProto.FLOAT16)
    _fused(model, count=0)


def test_a_cast_after_gamma_to_its_type_is_covered():
    """Gemma-style: the Cast comes last, y = Cast(gamma * normalized, to=gamma's type)."""
    nodes = [helper.make_node("Identity", ["x"], ["xf"]), *_statistic("div"),
             helper.make_node("Mul", ["xf", "inv"], ["n"]), helper.make_node("Mul", ["n", "gamma"], ["g"]),
             helper.make_node("Cast", ["g"], ["y"], to=TensorProto.FLOAT)]
    model = _model(nodes, TensorProto.FLOAT, TensorProto.FLOAT, np.linspace(0.5, 1.5, WIDTH, dtype=np.float32))
    before, after = _fused(model)
    assert [n.op_type for n in after.nodes] == ["Identity", "RMSNormalization"] and after.nodes[1].outputs == ["y"]
    _close(before, after, _feeds(model), 1e-5)
