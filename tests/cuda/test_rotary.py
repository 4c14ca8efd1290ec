"""``kiln.Rotary`` on the CUDA backend (lower_rules/rotary.py): one generated pointwise kernel over the output seen as
[..., 2, D/2] (interleaved: [..., D/2, 2]), x read twice through strides (its pair partner one half further on, the
pair axis negated), cos / sin broadcast. Without a GPU: the launch the lowering makes, the emulated launch against the
CPU backend for each form, x layout (Llama's head Transpose read through perm, or x itself) and float type, and NVRTC
compiling the kernels for sm_90. On the device (``gpu``): CUDA builds against CPU builds, at the zoo Llama's sizes too.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto

from engine_core.backends.cuda.lowering import lower_graph
from engine_core.backends.cuda.pointwise import pointwise_source
from engine_core.cuda import compile_cubin
from engine_core.interpret import GraphRunner
from tests.cuda.emulate import Emulator
from tests.cuda.test_backend_cpu import _graph_and_infos
from tests.engine.test_fuse_rotary import feeds_for, rotary_model

DTYPES = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}
#: the kernel computes in float32 and rounds once; the CPU backend rounds each product and the sum
TOLERANCE = {"fp32": 1e-6, "fp16": 4e-3, "bf16": 3e-2}


def _lowered(model, feeds):
    graph, infos = _graph_and_infos(model, {k: v.shape for k, v in feeds.items()})
    return graph, lower_graph(graph, infos)


@pytest.mark.parametrize("transposed", [True, False], ids=["head_transpose", "plain"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("form", ["runtime_slices", "interleaved"])
def test_rotary_is_one_generated_kernel_emulating_like_the_cpu_backend(form, dtype, transposed):
    model = rotary_model(form, DTYPES[dtype], transposed, width=16)
    feeds = feeds_for(model, batch=3)
    graph, lowered = _lowered(model, feeds)
    (step,) = [s for s in lowered.steps if s.node.op_type == "Rotary"]
    assert step.tactic == "kernel:Rotary" and lowered.tactics().get("transpose0_0") is None
    (launch,) = step.ops
    assert launch.module == "pointwise" and [n.op for n in launch.program.nodes] == ["Mul", "Mul", "Mul", "Add"]
    n, rank, indexer = (value for value, _ in launch.args[-3:])
    # the half-split form moves 16-byte vectors (halves of 8 elements); the interleaved one's partner stride is -1
    vector = launch.program.vector_threads(n, rank, indexer)
    assert (vector is not None) == (form != "interleaved"), vector
    got, want = Emulator(graph, lowered, feeds).run(), GraphRunner(graph).run(feeds)
    for name, value in want.items():
        np.testing.assert_allclose(got[name].astype(np.float32), value.astype(np.float32), rtol=TOLERANCE[dtype],
                                   atol=TOLERANCE[dtype], err_msg=name)


def test_rotary_kernels_compile_for_sm90(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    kernels = []
    for form in ("runtime_slices", "interleaved"):
        for dtype in DTYPES.values():
            model = rotary_model(form, dtype)
            kernels += _lowered(model, feeds_for(model))[1].kernels
    cubin = compile_cubin(pointwise_source(kernels), "pw.cu", "sm_90")
    assert cubin[:4] == b"\x7fELF"
    for kernel in kernels:
        assert kernel.name.encode() in cubin, kernel.name


@pytest.mark.gpu
@pytest.mark.parametrize("sizes", [{}, {"heads": 8, "seq": 128, "width": 64}], ids=["small", "llama_small"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("form", ["runtime_slices", "split", "interleaved"])
def test_rotary_on_the_gpu_matches_the_cpu_backend(form, dtype, sizes):
    """Each form through a whole CUDA build (the head Transpose read through perm): what the CPU backend computes, at
    a small size and at the zoo Llama's (8 heads of 64, 128 positions; batch 32 as in its benchmark)."""
    from tests.cuda.test_backend_gpu import _build

    model = rotary_model(form, DTYPES[dtype], **sizes)
    feeds = feeds_for(model, batch=32 if sizes else 3)
    shape = feeds["x"].shape
    profile = {"x": ((1, *shape[1:]), shape, (32, *shape[1:]))}
    gpu, cpu = _build(model, "cuda", profile), _build(model, "cpu", profile)
    assert [layer["tactic"] for layer in gpu.plan.layers if layer["type"] == "Rotary"] == ["kernel:Rotary"]
    got = gpu.create_execution_context().infer(feeds)
    want = cpu.create_execution_context().infer(feeds)
    for name, value in want.items():
        np.testing.assert_allclose(got[name].astype(np.float32), value.astype(np.float32), rtol=TOLERANCE[dtype],
                                   atol=TOLERANCE[dtype], err_msg=name)
