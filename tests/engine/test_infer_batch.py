"""ExecutionContext.infer_batch and warm_up on the CPU backend: gathering, zero padding, splitting, whole
outputs, and the errors the server maps to 400s. The CUDA backend follows the same rules
(tests/cuda/test_serving_io_gpu.py compares the two)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import engine_core as kiln
from engine_core.batching import gather_rows, part_shape, row_spans, split_outputs
from tests.engine.util import build

SHAPES = {"x": ((1, 3), (4, 3), (16, 3)), "ids": ((1, 2), (4, 2), (16, 2))}


def batch_model() -> onnx.ModelProto:
    """y = x * 2 (rows), k = ids + 1 (rows), s = ReduceSum(x + 1, axis 0) (no batch dim: padding rows add 1)."""
    n = helper.make_node
    nodes = [n("Mul", ["x", "two"], ["y"]), n("Add", ["ids", "one_i"], ["k"]), n("Add", ["x", "one"], ["x1"]),
             n("ReduceSum", ["x1", "axes"], ["s"], keepdims=0)]
    inits = [helper.make_tensor("two", TensorProto.FLOAT, [], [2.0]), helper.make_tensor("one", TensorProto.FLOAT, [], [1.0]),
             helper.make_tensor("one_i", TensorProto.INT64, [], [1]), helper.make_tensor("axes", TensorProto.INT64, [1], [0])]
    graph = helper.make_graph(
        nodes, "batch", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 3]),
                         helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 3]),
         helper.make_tensor_value_info("k", TensorProto.INT64, ["B", 2]),
         helper.make_tensor_value_info("s", TensorProto.FLOAT, [3])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


@pytest.fixture(scope="module")
def engine() -> kiln.CudaEngine:
    return kiln.Runtime().load(build(batch_model(), SHAPES))


def _part(seed: int, rows: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((rows, 3)).astype(np.float32), "ids": rng.integers(0, 9, (rows, 2))}


def test_parts_get_their_rows_and_whole_outputs(engine) -> None:
    context = engine.create_execution_context()
    parts = [_part(0, 2), _part(1, 3), _part(2, 1)]
    results = context.infer_batch(parts)
    everything = np.concatenate([p["x"] for p in parts])
    assert len(results) == 3
    for part, result in zip(parts, results):
        assert list(result) == ["y", "k", "s"]
        np.testing.assert_array_equal(result["y"], part["x"] * 2)
        np.testing.assert_array_equal(result["k"], part["ids"] + 1)
        np.testing.assert_allclose(result["s"], (everything + 1).sum(axis=0), rtol=1e-6)
    assert not np.shares_memory(results[0]["s"], results[1]["s"])  # whole outputs: a copy each


def test_padding_rows_are_zero_and_cut_from_the_parts(engine) -> None:
    context = engine.create_execution_context()
    parts = [_part(3, 2), _part(4, 3)]
    results = context.infer_batch(parts, pad_to=8)
    everything = np.concatenate([p["x"] for p in parts])
    for part, result in zip(parts, results):
        assert result["y"].shape == part["x"].shape
        np.testing.assert_array_equal(result["y"], part["x"] * 2)
    # three zero rows each add x + 1 = 1 to the sum over the batch
    np.testing.assert_allclose(results[0]["s"], (everything + 1).sum(axis=0) + 3, rtol=1e-6)
    assert context.get_tensor_shape("x") == (8, 3)


def test_one_part_equals_infer(engine) -> None:
    context = engine.create_execution_context()
    part = _part(5, 4)
    (result,) = context.infer_batch([part])
    want = context.infer(part)
    for name in want:
        np.testing.assert_array_equal(result[name], want[name])
    assert context.infer_batch([]) == []


def test_errors_name_the_input(engine) -> None:
    context = engine.create_execution_context()
    good = _part(6, 2)
    with pytest.raises(kiln.ShapeError, match=r"input 'x': part 1 has shape \[2, 4\]"):
        context.infer_batch([good, {**good, "x": np.zeros((2, 4), np.float32)}])
    with pytest.raises(TypeError, match="input 'ids' of part 1 has dtype int32"):
        context.infer_batch([good, {**good, "ids": good["ids"].astype(np.int32)}])
    with pytest.raises(kiln.ShapeError, match="part 0: its inputs have different batch sizes"):
        context.infer_batch([{**good, "ids": np.zeros((3, 2), np.int64)}])
    with pytest.raises(kiln.ShapeError, match="input 'x' of part 0 is a scalar"):
        context.infer_batch([{**good, "x": np.float32(1)}])
    with pytest.raises(kiln.ShapeError, match=r"part 0: missing inputs \['ids'\]"):
        context.infer_batch([{"x": good["x"]}])
    with pytest.raises(kiln.ShapeError, match="part 1: unknown inputs"):
        context.infer_batch([good, {**good, "z": good["x"]}])
    with pytest.raises(kiln.ShapeError, match="outside optimization profile"):
        context.infer_batch([good], pad_to=32)
    with pytest.raises(ValueError, match="pad_to 1 is below the 2 rows"):
        context.infer_batch([good], pad_to=1)


def test_device_views_need_a_cuda_engine(engine) -> None:
    context = engine.create_execution_context()
    good = _part(7, 2)
    view = kiln.DeviceView(0x1000, (2, 3), np.float32)
    with pytest.raises(TypeError, match="input 'x' is given in device memory, which needs a CUDA engine"):
        context.infer_batch([{**good, "x": view}])
    with pytest.raises(TypeError, match="destinations are DeviceViews, which need a CUDA engine"):
        context.infer_batch([good], destinations=[{"y": view}])
    with pytest.raises(TypeError, match="destination of output 'k' for part 0 has dtype float32"):
        context.infer_batch([good], destinations=[{"k": view}])
    with pytest.raises(kiln.ShapeError, match="'w' is not an output"):
        context.infer_batch([good], destinations=[{"w": view}])
    with pytest.raises(ValueError, match="destinations has 2 entries for 1 parts"):
        context.infer_batch([good], destinations=[{}, {}])
    with pytest.raises(TypeError, match="input 'x' of part 0 has dtype int64"):
        context.infer_batch([{**good, "x": kiln.DeviceView(0x1000, (2, 3), np.int64)}])


def test_device_view_is_plain_validated_data() -> None:
    view = kiln.DeviceView(np.uint64(4096), [2, 3], "float16")
    assert (view.ptr, view.shape, view.dtype, view.nbytes) == (4096, (2, 3), np.dtype(np.float16), 12)
    with pytest.raises(ValueError, match="negative"):
        kiln.DeviceView(4096, (-1, 3), np.float32)
    with pytest.raises(ValueError, match="null pointer"):
        kiln.DeviceView(0, (1,), np.float32)
    assert kiln.DeviceView(0, (0, 3), np.float32).nbytes == 0


def test_batching_helpers() -> None:
    assert row_spans([2, 0, 3]) == [(0, 2), (2, 2), (2, 5)]
    assert part_shape((8, 4), (2, 5), 8) == (3, 4) and part_shape((4,), (2, 5), 8) == (4,)
    assert part_shape((), (0, 1), 1) == ()
    rows = gather_rows([np.ones((2, 2), np.int32), np.full((1, 2), 2, np.int32)], 5)
    np.testing.assert_array_equal(rows, [[1, 1], [1, 1], [2, 2], [0, 0], [0, 0]])
    out = np.arange(10).reshape(5, 2)
    parts = split_outputs({"o": out, "w": np.arange(3), "seq": [np.ones(1)]}, [(0, 2), (2, 3)], 5)
    np.testing.assert_array_equal(parts[1]["o"], [[4, 5]])
    assert not np.shares_memory(parts[0]["o"], out) and parts[0]["w"].tolist() == [0, 1, 2]
    assert parts[0]["seq"] is not parts[1]["seq"]


def test_warm_up_runs_once_on_zeros(engine) -> None:
    context = engine.create_execution_context()
    seen, infer = [], context.infer
    context.infer = lambda feeds: seen.append({k: (v.shape, v.any()) for k, v in feeds.items()}) or infer(feeds)
    context.warm_up({"x": (8, 3), "ids": (8, 2)})
    assert seen == [{"x": ((8, 3), False), "ids": ((8, 2), False)}]
    assert context.get_tensor_shape("x") == (8, 3)
    with pytest.raises(kiln.ShapeError, match="warm_up needs a shape for input 'ids'"):
        context.warm_up({"x": (8, 3)})
    with pytest.raises(kiln.ShapeError, match="outside optimization profile"):
        context.warm_up({"x": (64, 3), "ids": (64, 2)})
    with pytest.raises(kiln.ShapeError, match="unknown inputs"):
        context.warm_up({"x": (8, 3), "ids": (8, 2), "z": (1,)})


def test_warm_up_skips_engines_whose_shapes_need_values(monkeypatch) -> None:
    """Reshape to a shape fed at run time: zeros would be no shape at all, so warm_up leaves it."""
    n = helper.make_node
    graph = helper.make_graph(
        [n("Reshape", ["x", "shape"], ["y"])], "reshape",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 6]),
         helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    engine = kiln.Runtime().load(build(model, {"x": ((1, 6), (2, 6), (4, 6)), "shape": ((2,), (2,), (2,))}))
    context = engine.create_execution_context()
    ran = []
    monkeypatch.setattr(context, "infer", lambda feeds: ran.append(feeds))
    context.warm_up({"x": (2, 6), "shape": (2,)})
    assert ran == []
    monkeypatch.undo()
    np.testing.assert_array_equal(
        context.infer({"x": np.ones((2, 6), np.float32), "shape": np.array([3, 4])})["y"], np.ones((3, 4)))


def test_infer_rows_runs_a_whole_batch_and_refuses_what_does_not_fit(engine) -> None:
    """``infer_rows``: the batch given whole (host arrays here), padded, outputs for the batch's rows only."""
    context = engine.create_execution_context()
    part = _part(3, 5)
    outputs = context.infer_rows(part, pad_to=8)
    np.testing.assert_array_equal(outputs["y"], part["x"] * 2)
    np.testing.assert_array_equal(outputs["k"], part["ids"] + 1)
    np.testing.assert_allclose(outputs["s"], (part["x"] + 1).sum(axis=0) + 3, rtol=1e-6)  # 3 zero rows padded
    with pytest.raises(kiln.ShapeError, match="different row counts"):
        context.infer_rows({"x": part["x"], "ids": part["ids"][:2]})
    with pytest.raises(TypeError, match="dtype"):
        context.infer_rows({"x": part["x"].astype(np.float64), "ids": part["ids"]})
    rows = kiln.DeviceRows(np.array([0x1000, 0x2000]), np.array([2, 3]), (3,), np.float32)
    assert rows.shape == (5, 3) and rows.gather_copies(0x9000)[1].tolist() == [0x9000 + 24, 0x2000, 36]
    with pytest.raises(TypeError, match="given in device memory, which needs a CUDA engine"):
        context.infer_rows({"x": rows, "ids": part["ids"]})
