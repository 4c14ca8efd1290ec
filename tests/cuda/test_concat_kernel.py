"""cuda_kernels/concat.cu: a Concat of several inputs as one launch. Each input is read in its own layout (linear or
channels-last) along any axis, in vector units where both tensors allow, element by element where an address is not
aligned to them; more than 32 inputs take one launch per 32.

The CPU tests compile the kernel, run the lowering's tables through a step-by-step numpy model of the kernel (which
block copies which input, the unaligned fallback, each unit's offsets) and through the emulator for whole graphs; the
GPU tests launch the kernel on the same tables and run a DenseNet-like model through CUDA graph capture and replay."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from engine_core.backends.cuda.lower_rules.movement import (
    CONCAT_MAX_INPUTS,
    CONCAT_ROW,
    concat_launch,
    concat_part,
    concat_table,
)
from engine_core.backends.cuda.lowering import Copy, Launch, LoweringOptions, Ref
from engine_core.backends.cuda.lowering_context import THREADS, nhwc_strides
from engine_core.backends.cuda.pointwise import contiguous_strides
from engine_core.cuda.nvrtc import compile_kernel_file
from engine_core.ops import TensorInfo
from tests.cuda.emulate import Emulator
from tests.cuda.test_channels_last_concat import _emulated_matches_cpu, _engine, _lowered, concat_mixed, densenet_like


@dataclass(frozen=True)
class _Case:
    """Inputs of ``shapes`` (logical), each in its layout ("linear" / "nhwc"), concatenated along ``axis`` into an
    output in ``out_layout``."""

    dtype: type
    shapes: tuple[tuple[int, ...], ...]
    axis: int
    layouts: tuple[str, ...]
    out_layout: str = "linear"

    def inputs(self) -> list[np.ndarray]:
        rng = np.random.default_rng(len(self.shapes) * 7 + self.axis)
        if np.dtype(self.dtype) == np.bool_:
            return [rng.random(s) < 0.5 for s in self.shapes]
        if np.issubdtype(self.dtype, np.integer):
            info = np.iinfo(self.dtype)
            return [rng.integers(max(info.min, -1000), min(info.max, 1000), s).astype(self.dtype) for s in self.shapes]
        return [rng.standard_normal(s).astype(self.dtype) for s in self.shapes]


def _strides(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    return nhwc_strides(shape) if layout == "nhwc" else contiguous_strides(shape)


def _stored(x: np.ndarray, layout: str) -> np.ndarray:
    """``x``'s bytes as the tensor holds them."""
    return np.ascontiguousarray(x.transpose(0, 2, 3, 1) if layout == "nhwc" else x).view(np.uint8).reshape(-1)


#: DenseNet's closing Concat of a block (fp16 NHWC, 32-channel growth: 16-byte units), odd channel counts (narrower
#: units, elements), NHWC outputs of mixed-layout inputs along C and H, linear tensors along first and last axes,
#: integer and bool types, ranks 1 to 5, and more inputs than one launch takes
CASES = {
    "densenet_block_f16": _Case(np.float16, ((2, 64, 7, 7), (2, 32, 7, 7), (2, 32, 7, 7), (2, 32, 7, 7)), 1,
                                ("nhwc",) * 4, "nhwc"),
    "odd_channels_f16": _Case(np.float16, ((2, 12, 5, 3), (2, 8, 5, 3), (2, 3, 5, 3)), 1, ("nhwc",) * 3, "nhwc"),
    "mixed_layouts_c_f32": _Case(np.float32, ((2, 8, 4, 4), (2, 4, 4, 4), (2, 4, 4, 4)), 1,
                                 ("nhwc", "linear", "nhwc"), "nhwc"),
    "mixed_layouts_h_f32": _Case(np.float32, ((2, 8, 3, 4), (2, 8, 5, 4)), 2, ("nhwc", "linear"), "nhwc"),
    "nhwc_along_w_f16": _Case(np.float16, ((1, 16, 3, 2), (1, 16, 3, 6)), 3, ("nhwc", "nhwc"), "nhwc"),
    "linear_batch_f32": _Case(np.float32, ((1, 3, 4, 4), (3, 3, 4, 4)), 0, ("linear", "linear")),
    "linear_last_f16": _Case(np.float16, ((2, 3, 4, 5), (2, 3, 4, 3), (2, 3, 4, 8)), 3, ("linear",) * 3),
    "int8_rank3": _Case(np.int8, ((4, 3, 32), (4, 17, 32)), 1, ("linear",) * 2),
    "int32_rank2": _Case(np.int32, ((5, 3), (5, 4), (5, 1)), 1, ("linear",) * 3),
    "int64_rank1": _Case(np.int64, ((3,), (1,), (7,)), 0, ("linear",) * 3),
    "bool_rank5": _Case(np.bool_, ((2, 1, 3, 2, 5), (2, 1, 3, 2, 4)), 4, ("linear",) * 2),
    "forty_inputs_i32": _Case(np.int32, tuple((2, 1 + i % 3) for i in range(40)), 1, ("linear",) * 40),
}


def _parts_and_tables(case: _Case) -> tuple[list, list[np.ndarray], tuple[int, ...]]:
    """The lowering's parts of ``case`` (input k is Ref("x{k}")), its tables per launch and the output's strides."""
    out_shape = list(case.shapes[0])
    out_shape[case.axis] = sum(s[case.axis] for s in case.shapes)
    out_strides = _strides(tuple(out_shape), case.out_layout)
    itemsize, parts, start = np.dtype(case.dtype).itemsize, [], 0
    for k, (shape, layout) in enumerate(zip(case.shapes, case.layouts)):
        parts.append(concat_part(Ref(f"x{k}"), shape, out_strides, _strides(shape, layout),
                                 start * out_strides[case.axis], itemsize))
        start += shape[case.axis]
    chunks = [parts[i:i + CONCAT_MAX_INPUTS] for i in range(0, len(parts), CONCAT_MAX_INPUTS)]
    return parts, [concat_table(chunk) for chunk in chunks], out_strides


def _model_launch(rows: np.ndarray, elem_bytes: int, y: np.ndarray, sources: list[np.ndarray], y_address: int = 0,
                  addresses: list[int] | None = None) -> None:
    """concat_copy step by step on host bytes: each block's input (the warps' ballot over the rows' first blocks), the
    element fallback where an address is not aligned to a row's unit, and every unit's offsets as the kernel computes
    them (dims right-aligned; the outermost used slot takes the rest of the index)."""
    grid = int(rows[-1, 0] + rows[-1, 1])
    owners = [int(np.count_nonzero(rows[:, 0] <= block)) - 1 for block in range(grid)]
    assert owners == [k for k, row in enumerate(rows) for _ in range(int(row[1]))]
    for k, (row, x) in enumerate(zip(rows, sources)):
        units, offset, rank, unit = (int(v) for v in row[2:6])
        shape, dst, src = (row[6 + 6 * j:12 + 6 * j].copy() for j in range(3))
        if unit > elem_bytes and ((y_address + offset * unit) | (addresses[k] if addresses else 0)) % unit:
            scale = unit // elem_bytes
            units, offset, unit = units * scale, offset * scale, elem_bytes
            shape[5] *= scale
            dst[:5] *= scale
            src[:5] *= scale
        rest, od, os = np.arange(units), np.zeros(units, np.int64), np.zeros(units, np.int64)
        for d in range(5, -1, -1):
            if d > 6 - rank:
                coord, rest = rest % shape[d], rest // shape[d]
            else:
                coord = rest if d == 6 - rank else 0
            od, os = od + coord * dst[d], os + coord * src[d]
        lanes = np.arange(unit)
        y[((offset + od) * unit)[:, None] + lanes] = x[(os * unit)[:, None] + lanes]


def _expected(case: _Case, xs: list[np.ndarray]) -> np.ndarray:
    return _stored(np.concatenate(xs, axis=case.axis), case.out_layout)


def test_concat_kernel_compiles_for_sm90(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    assert b"concat_copy" in compile_kernel_file("concat", arch="sm_90")


@pytest.mark.parametrize("unaligned", [False, True], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_kernel_model_on_the_lowering_tables_matches_numpy(name, unaligned):
    """Unaligned: the output one element past a vector boundary, so every vector row takes the element fallback."""
    case = CASES[name]
    xs = case.inputs()
    parts, tables, _ = _parts_and_tables(case)
    sources = [_stored(x, layout) for x, layout in zip(xs, case.layouts)]
    want = _expected(case, xs)
    y = np.zeros_like(want)
    itemsize = np.dtype(case.dtype).itemsize
    for i, rows in enumerate(tables):
        chunk = sources[i * CONCAT_MAX_INPUTS:(i + 1) * CONCAT_MAX_INPUTS]
        _model_launch(rows, itemsize, y, chunk, y_address=itemsize if unaligned else 0)
    np.testing.assert_array_equal(y, want)


def test_densenet_channel_slices_move_in_16_byte_units():
    """fp16 NHWC inputs of 64 and 32 channels: rows of 8 and 4 vectors a pixel, written 20 vectors
    (160 channels) apart."""
    parts, (rows,), _ = _parts_and_tables(CASES["densenet_block_f16"])
    assert [p.unit_bytes for p in parts] == [16] * 4
    assert [p.shape for p in parts] == [(2 * 7 * 7, 8), (2 * 7 * 7, 4), (2 * 7 * 7, 4), (2 * 7 * 7, 4)]
    assert [p.dst_strides for p in parts] == [(20, 1)] * 4 and [p.offset for p in parts] == [0, 8, 12, 16]
    assert rows.shape == (4, CONCAT_ROW) and list(rows[:, 0]) == [0, 1, 2, 3]  # one block each at these sizes


def test_mixed_layouts_read_element_by_element():
    """A linear input into an NHWC output has no contiguous innermost dim in common: element units, rank 3."""
    parts, _, _ = _parts_and_tables(CASES["mixed_layouts_c_f32"])
    assert [p.unit_bytes for p in parts] == [16, 4, 16]
    assert len(parts[1].shape) == 3 and parts[1].dst_strides[-1] == 1 and parts[1].src_strides[-1] == 16


def test_forty_inputs_take_two_launches_with_their_own_block_numbers():
    _, tables, _ = _parts_and_tables(CASES["forty_inputs_i32"])
    assert [len(t) for t in tables] == [32, 8] and tables[1][0, 0] == 0


def test_big_inputs_get_capped_block_counts_and_loop():
    part = concat_part(Ref("x"), (1 << 26,), (1,), (1,), 0, 4)
    assert part is not None and part.unit_bytes == 16
    (row,) = concat_table([part])
    assert row[1] == 4096 and row[1] * THREADS * 4 < row[2]  # the threads loop over the rest


def test_dims_that_do_not_merge_past_rank_6_have_no_part():
    shape = (2,) * 7
    transposed = tuple(reversed(contiguous_strides(shape)))  # no two neighbours merge
    assert concat_part(Ref("x"), shape, contiguous_strides(shape), transposed, 0, 4) is None


# -- the lowering: whole graphs, emulated --------------------------------------------------------------------------


def _concat_ops(lowered, name: str) -> list:
    (step,) = [s for s in lowered.steps if s.node.name == name]
    return step.ops


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_every_densenet_concat_of_several_inputs_is_one_launch(dtype):
    x = np.random.default_rng(0).standard_normal((2, 3, 16, 16)).astype(dtype)
    graph, lowered = _lowered(densenet_like(dtype), {"x": x.shape}, LoweringOptions(cudnn=True))
    concats = [s for s in lowered.steps if s.node.op_type == "Concat"]
    for step in concats:
        (launch,) = step.ops
        assert isinstance(launch, Launch)
        if len(step.node.inputs) >= 2:
            assert (launch.module, launch.function) == ("concat", "concat_copy"), step.node.name
            table = launch.args[1][0].tensor
            assert lowered.locations[table][0] == "folded"  # uploaded with the binding: the same in every replay
            assert lowered.folded[table].shape == (len(step.node.inputs), CONCAT_ROW)
        else:  # torch.onnx's one-input Concat: the strided copy
            assert launch.module == "pointwise"
    assert sum(len(s.node.inputs) >= 2 for s in concats) == 5
    _emulated_matches_cpu(graph, lowered, {"x": x}, tol=2e-2 if dtype == np.float16 else 1e-5)


def test_a_linear_input_concatenated_along_h_into_nhwc_is_one_launch():
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((2, 4, 8, 8)).astype(np.float32),
             "z": rng.standard_normal((2, 8, 8, 8)).astype(np.float32)}
    graph, lowered = _lowered(concat_mixed(), {k: v.shape for k, v in feeds.items()}, LoweringOptions(cudnn=True))
    (launch,) = _concat_ops(lowered, "cat_h")
    rows = lowered.folded[launch.args[1][0].tensor]
    assert launch.function == "concat_copy" and list(rows[:, 5]) == [16, 4]  # z (linear) element by element
    _emulated_matches_cpu(graph, lowered, feeds, tol=1e-5)


_ONNX = {np.dtype(np.float16): TensorProto.FLOAT16, np.dtype(np.float32): TensorProto.FLOAT,
         np.dtype(np.int8): TensorProto.INT8, np.dtype(np.int32): TensorProto.INT32,
         np.dtype(np.int64): TensorProto.INT64, np.dtype(np.bool_): TensorProto.BOOL}


def _concat_model(case: _Case) -> onnx.ModelProto:
    t = _ONNX[np.dtype(case.dtype)]
    names = [f"in{k}" for k in range(len(case.shapes))]
    graph = helper.make_graph([helper.make_node("Concat", names, ["y"], name="cat", axis=case.axis)], "concat",
                              [helper.make_tensor_value_info(n, t, s) for n, s in zip(names, case.shapes)],
                              [helper.make_tensor_value_info("y", t, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


@pytest.mark.parametrize("name", ["linear_batch_f32", "linear_last_f16", "int8_rank3", "int32_rank2", "int64_rank1",
                                  "bool_rank5", "forty_inputs_i32"])
def test_concats_of_graph_inputs_lower_to_concat_launches(name):
    case = CASES[name]
    feeds = {f"in{k}": x for k, x in enumerate(case.inputs())}
    graph, lowered = _lowered(_concat_model(case), {k: v.shape for k, v in feeds.items()}, LoweringOptions())
    ops = _concat_ops(lowered, "cat")
    assert [op.function for op in ops] == ["concat_copy"] * -(-len(case.shapes) // CONCAT_MAX_INPUTS)
    got = Emulator(graph, lowered, feeds).run()["y"]
    np.testing.assert_array_equal(got, np.concatenate(list(feeds.values()), axis=case.axis))


def test_one_input_and_empty_inputs():
    """A Concat with one non-empty input is a view of it (movement.view_source): as the graph output, one copy of
    its bytes; empty inputs have no part."""
    case = _Case(np.float32, ((2, 0), (2, 3), (2, 0)), 1, ("linear",) * 3)
    feeds = {f"in{k}": x for k, x in enumerate(case.inputs())}
    graph, lowered = _lowered(_concat_model(case), {k: v.shape for k, v in feeds.items()}, LoweringOptions())
    (copy,) = _concat_ops(lowered, "cat")
    assert isinstance(copy, Copy) and copy.src == Ref("in1") and copy.nbytes == 2 * 3 * 4
    np.testing.assert_array_equal(Emulator(graph, lowered, feeds).run()["y"], feeds["in1"])


def test_plans_embed_the_concat_kernel_when_a_launch_uses_it(monkeypatch):
    """concat is an on-demand kernel file: prepare_plan compiles it for a plan with a concat launch (NVRTC stubbed
    here; test_concat_kernel_compiles_for_sm90 compiles it)."""
    from engine_core.backends.cuda import prepare_plan
    from engine_core.cuda import nvrtc
    from engine_core.passes import infer_shapes

    monkeypatch.setattr(nvrtc, "compile_kernel_file", lambda stem, arch="sm_90", options=(): stem.encode())
    monkeypatch.setattr(nvrtc, "compile_cubin", lambda source, name="", arch="", options=(): b"pointwise")
    case = CASES["int32_rank2"]
    shapes = {f"in{k}": s for k, s in enumerate(case.shapes)}
    graph, _ = _lowered(_concat_model(case), shapes, LoweringOptions())
    infos = infer_shapes(graph, {v.name: TensorInfo(v.dtype, shapes[v.name]) for v in graph.inputs})
    build = prepare_plan(graph, {(0, 0): infos, (0, 1): infos, (0, 2): infos}, arch="sm_90",
                         timer_for=lambda gemm: lambda tactic: 1.0)
    assert build.tactics["cat"] == "kernel:Concat" and build.kernels["concat"] == b"concat"


# -- on the device --------------------------------------------------------------------------------------------------


def _launch_on_device(case: _Case, xs: list[np.ndarray], unaligned: bool) -> np.ndarray:
    """Every launch of ``case`` on the GPU; unaligned: the output and the first input one element past a 256-byte
    boundary (the kernel's element fallback for vector rows)."""
    from engine_core.cuda import driver
    from engine_core.cuda.driver import DeviceBuffer, Module

    major, minor = driver.compute_capability()
    function = Module(compile_kernel_file("concat", arch=f"sm_{major}{minor}")).function("concat_copy")
    itemsize = np.dtype(case.dtype).itemsize
    shift = itemsize if unaligned else 0
    parts, tables, _ = _parts_and_tables(case)
    keep, addresses = [], {}
    for k, (x, layout) in enumerate(zip(xs, case.layouts)):
        stored = _stored(x, layout)
        lead = shift if k == 0 else 0
        buffer = DeviceBuffer(stored.nbytes + lead)
        if stored.nbytes:
            driver.copy_to_device(buffer.ptr + lead, stored)
        keep.append(buffer)
        addresses[f"x{k}"] = buffer.ptr + lead
    want = _expected(case, xs)
    y = DeviceBuffer(want.nbytes + shift)
    table = DeviceBuffer.from_array(np.concatenate(tables))
    addresses["y"], addresses["table"] = y.ptr + shift, table.ptr
    for i, rows in enumerate(tables):
        chunk = parts[i * CONCAT_MAX_INPUTS:(i + 1) * CONCAT_MAX_INPUTS]
        launch = concat_launch(Ref("y"), Ref("table", i * CONCAT_MAX_INPUTS * CONCAT_ROW * 8), chunk, rows, itemsize)
        args = [(addresses[v.tensor] + v.offset if isinstance(v, Ref) else v, t) for v, t in launch.args]
        driver.launch(function, launch.grid, launch.block, args)
    driver.synchronize()
    raw = driver.copy_to_host(y.ptr, np.dtype(np.uint8), (want.nbytes + shift,))
    return raw[shift:]


@pytest.mark.gpu
@pytest.mark.parametrize("unaligned", [False, True], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_concat_kernel_matches_numpy(name, unaligned):
    case = CASES[name]
    xs = case.inputs()
    np.testing.assert_array_equal(_launch_on_device(case, xs, unaligned), _expected(case, xs))


@pytest.mark.gpu
@pytest.mark.parametrize("flags, tol", [("fp16", 2e-2), ("fp32", 1e-4)])
def test_densenet_like_concats_replay_in_cuda_graphs(flags, tol):
    """The plan embeds concat.cu; the eager run, the captured run and two replays all match the CPU backend."""
    import engine_core as kiln

    model = densenet_like()
    gpu = _engine(model, "cuda", (kiln.BuilderFlag.FP16,) if flags == "fp16" else ())
    cpu = _engine(model, "cpu")
    assert "concat" in gpu.plan.kernels
    rng = np.random.default_rng(3)
    for batch in (1, 4):
        feeds = {"x": rng.standard_normal((batch, 3, 16, 16)).astype(np.float32)}
        want = cpu.create_execution_context().infer(feeds)["y"]
        context = gpu.create_execution_context()
        for run in range(4):
            got = context.infer(feeds)["y"]
            assert float(np.abs(got - want).max()) <= tol * float(np.abs(want).max()), (batch, run)
