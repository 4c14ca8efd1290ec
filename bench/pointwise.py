"""Kiln's generated pointwise kernels at BERT-base sizes vs the GPU's copy bandwidth and torch eager, same run.

    python -m bench.pointwise [--rows 8192] [--unrolls 1,2,4] [--out bench/results]

Each case is a one-layer ONNX model (onnx.helper) whose layer the builder turns into one generated kernel:
the INT8 GEMM epilogues of BERT-base INT8 at batch 64 x seq 128 (int32 sums -> float scales and bias -> fp16,
and -> GELU -> int8 requantization), the activation QuantizeLinear, GELU, a bias add and a residual add. Kiln
builds each case once per ``--unrolls`` value (``pointwise.VECTOR_UNROLL``: vectors per thread in the vector
path; ``auto`` is Kiln's default rule, 1 the pre-session-6 kernel shape with its grid sized to the vectors). Times are GPU kernel times from CUPTI (``bench.engine.kernel_profile``:
no host enqueue in them), in microseconds per call; ``GB/s`` counts each input and output byte once. Peers in
the same run: ``copy``, a device-to-device copy of the same number of bytes (read + write: the memory
roofline a pointwise kernel can reach), and torch eager computing the same expression. Writes
``pointwise_<time>.json``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from bench.engine import kernel_us, layer_engine, write_results

HIDDEN, FFN = 768, 3072


@dataclass
class Case:
    """One pointwise layer: the ONNX model's nodes over input ``x`` [rows, cols] and its torch equivalent."""

    name: str
    cols: int
    x_type: int
    y_type: int
    nodes: list[onnx.NodeProto]
    inits: dict[str, np.ndarray]
    #: torch expression over (x, {initializer name: tensor}) -> output
    torch_fn: Callable


def _scales(cols: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"x_scale": np.float32(0.02), "w_scale": (rng.random(cols, np.float32) * 1e-3 + 1e-4),
            "bias": rng.standard_normal(cols).astype(np.float16), "y_scale": np.float32(0.05),
            "zero": np.int8(0)}


def _dequant_nodes(out: str) -> list[onnx.NodeProto]:
    n = helper.make_node
    return [n("Cast", ["x"], ["xf"], to=TensorProto.FLOAT), n("Mul", ["xf", "x_scale"], ["s1"]),
            n("Mul", ["s1", "w_scale"], ["s2"]), n("Cast", ["bias"], ["bf"], to=TensorProto.FLOAT),
            n("Add", ["s2", "bf"], [out])]


def cases() -> list[Case]:
    n = helper.make_node
    epilogue = Case("int8 epilogue -> fp16 [M,768]", HIDDEN, TensorProto.INT32, TensorProto.FLOAT16,
                    _dequant_nodes("s3") + [n("Cast", ["s3"], ["y"], to=TensorProto.FLOAT16)],
                    {k: v for k, v in _scales(HIDDEN).items() if k in ("x_scale", "w_scale", "bias")},
                    lambda x, c: (x.float() * c["x_scale"] * c["w_scale"] + c["bias"].float()).half())
    gelu_q = Case("int8 epilogue + GELU -> int8 [M,3072]", FFN, TensorProto.INT32, TensorProto.INT8,
                  _dequant_nodes("s3") + [n("Gelu", ["s3"], ["g"]), n("Cast", ["g"], ["gh"], to=TensorProto.FLOAT16),
                                          n("QuantizeLinear", ["gh", "y_scale", "zero"], ["y"])],
                  _scales(FFN),
                  lambda x, c: _torch_quantize(__import__("torch").nn.functional.gelu(
                      x.float() * c["x_scale"] * c["w_scale"] + c["bias"].float()).half(), c["y_scale"]))
    quant = Case("QuantizeLinear fp16 -> int8 [M,768]", HIDDEN, TensorProto.FLOAT16, TensorProto.INT8,
                 [n("QuantizeLinear", ["x", "y_scale", "zero"], ["y"])],
                 {k: v for k, v in _scales(HIDDEN).items() if k in ("y_scale", "zero")},
                 lambda x, c: _torch_quantize(x, c["y_scale"]))
    gelu = Case("Gelu fp16 [M,3072]", FFN, TensorProto.FLOAT16, TensorProto.FLOAT16, [n("Gelu", ["x"], ["y"])], {},
                lambda x, c: __import__("torch").nn.functional.gelu(x))
    bias = Case("bias add fp16 [M,3072] + [3072]", FFN, TensorProto.FLOAT16, TensorProto.FLOAT16,
                [n("Add", ["x", "bias"], ["y"])], {"bias": _scales(FFN)["bias"]}, lambda x, c: x + c["bias"])
    return [epilogue, gelu_q, quant, gelu, bias]


def _torch_quantize(x, scale):
    import torch

    return torch.clamp(torch.round(x.float() / scale), -128, 127).to(torch.int8)


def _model(case: Case, rows: int) -> onnx.ModelProto:
    graph = helper.make_graph(case.nodes, case.name.split()[0],
                              [helper.make_tensor_value_info("x", case.x_type, [rows, case.cols])],
                              [helper.make_tensor_value_info("y", case.y_type, [rows, case.cols])],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in case.inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


def run_case(torch, case: Case, rows: int, unrolls: list[int | None]) -> dict:
    from engine_core.backends.cuda import pointwise

    types = {TensorProto.INT32: torch.int32, TensorProto.FLOAT16: torch.float16, TensorProto.INT8: torch.int8}
    gen = torch.Generator(device="cuda").manual_seed(0)
    if case.x_type == TensorProto.INT32:
        x = torch.randint(-40000, 40000, (rows, case.cols), dtype=torch.int32, device="cuda", generator=gen)
    else:
        x = torch.randn((rows, case.cols), device="cuda", generator=gen).to(types[case.x_type])
    consts = {k: torch.as_tensor(np.asarray(v)).cuda() for k, v in case.inits.items()}
    want = case.torch_fn(x, consts)
    moved = x.numel() * x.element_size() + want.numel() * want.element_size()
    stream = torch.cuda.current_stream()
    row = {"case": case.name, "rows": rows, "cols": case.cols, "bytes": moved}
    src = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    row["copy_us"], _ = kernel_us(lambda: dst.copy_(src), stream)
    row["torch_eager_us"], _ = kernel_us(lambda: case.torch_fn(x, consts), stream)
    model = _model(case, rows)
    default = pointwise.VECTOR_UNROLL
    try:
        for unroll in unrolls:
            pointwise.VECTOR_UNROLL = unroll
            engine = layer_engine(model, (rows, case.cols))
            ctx = engine.create_execution_context()
            y = torch.empty_like(want)
            ctx.set_tensor_address("x", x.data_ptr())
            ctx.set_tensor_address("y", y.data_ptr())
            us, kernels = kernel_us(lambda c=ctx: c.execute_async_v3(stream.cuda_stream), stream)
            torch.cuda.synchronize()
            steps = (y.float() - want.float()).abs().max().item()
            row[f"kiln_u{unroll or 'auto'}"] = {"us": round(us, 2), "gb_s": round(moved / us / 1e3, 1), "kernels": kernels,
                                      "max_abs_diff_vs_torch": steps}
    finally:
        pointwise.VECTOR_UNROLL = default
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8192, help="GEMM rows: batch x sequence (BERT 64 x 128)")
    parser.add_argument("--unrolls", default="auto,1,2")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    import torch

    unrolls = [None if u == "auto" else int(u) for u in args.unrolls.split(",")]
    print(f"{torch.cuda.get_device_name()}: GPU kernel us per call (CUPTI), rows {args.rows}")
    print(f"{'case':<40} {'MB':>6} {'copy':>7} {'torch':>7} " + " ".join(f"{'u' + str(u or 'auto'):>7} {'GB/s':>6}" for u in unrolls))
    rows = []
    for case in cases():
        row = run_case(torch, case, args.rows, unrolls)
        rows.append(row)
        timed = [row[f"kiln_u{u or 'auto'}"] for u in unrolls]
        kiln = " ".join(f"{t['us']:7.1f} {t['gb_s']:6.0f}" for t in timed)
        print(f"{case.name:<40} {row['bytes'] / 1e6:6.1f} {row['copy_us']:7.1f} {row['torch_eager_us']:7.1f} {kiln}")
    write_results(args.out, "pointwise", {"device": torch.cuda.get_device_name(), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
