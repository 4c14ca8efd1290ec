"""BERT-base's linear layers in INT8: Kiln's sm_90 GEMM with the epilogue in registers vs the cuBLASLt path and fp16.

    python -m bench.qgemm [--rows 8192,1024] [--out bench/results]

Each case is a one-layer ONNX model (onnx.helper) of an explicitly quantized linear layer at BERT-base sizes
(``--rows`` = batch x sequence, 8192 = 64 x 128): int8 input x [rows, K] -> DequantizeLinear -> MatMul with a
per-column int8 weight's DequantizeLinear -> + bias, then either fp16 out (Q/K/V, attention output, FFN2) or GELU
-> QuantizeLinear -> int8 out (FFN1, whose output only FFN2 reads), or QuantizeLinear -> int8 out without GELU (the
attention output and FFN2 of ``bench.int8``'s int8_explicit_residual, whose residual stream is int8). FP16 builds; the builder fuses each into one
``kiln.QMatMul``. Kiln columns (GPU kernel time from CUPTI, microseconds per call, every kernel of the layer):
  qgemm   the default on sm_90: one ``qgemm_sm90`` launch
  lt      ``KILN_QGEMM=0``: cuBLASLt IMMA (int32 sums to memory) + the generated dequantizing kernel
  fp16    the same layer as an fp16 model (fp16 weights, cuBLASLt with its bias epilogue; GELU a kernel)
Peers in the same run: torch fp16 ``F.linear`` (+ GELU) and torch ``_int_mm`` (int8 x int8 -> int32 only). TOPS
count 2 M N K per call. ``max diff`` compares qgemm's output with lt's (int8 cases: quantization steps).
Writes ``qgemm_<time>.json``. ``--kiln-only`` times the qgemm column alone (no cuBLASLt, fp16 or torch rows): for
A/B runs of a kernel change on one machine, where the peers are unchanged. ``--profile-runs`` runs Kiln's qgemm and
fp16 engines a few times each without timing or peers, for a kernel profiler: ``ncu --kernel-name regex:qgemm python
-m bench.qgemm --profile-runs``.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from bench.engine import kernel_us, layer_engine, write_results

HIDDEN, FFN = 768, 3072


@dataclass
class Case:
    name: str
    k: int
    n: int
    #: GELU (FFN1)
    gelu: bool
    #: requantize to int8; else an fp16 output
    int8_out: bool


CASES = [Case("QKV / attention out [768 -> 768]", HIDDEN, HIDDEN, False, False),
         Case("FFN1 + GELU -> int8 [768 -> 3072]", HIDDEN, FFN, True, True),
         Case("FFN2 [3072 -> 768]", FFN, HIDDEN, False, False),
         Case("attention out -> int8 [768 -> 768]", HIDDEN, HIDDEN, False, True),
         Case("FFN2 -> int8 [3072 -> 768]", FFN, HIDDEN, False, True),
         Case("Q/K/V as one [768 -> 3 x 768]", HIDDEN, 3 * HIDDEN, False, False)]


def _weights(case: Case) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(case.k * 7 + case.n)
    return {"w": rng.integers(-127, 128, (case.k, case.n)).astype(np.int8),
            "w_scale": (rng.random(case.n, np.float32) * 2e-3 + 5e-4), "bias": (0.1 * rng.standard_normal(case.n)).astype(np.float32),
            "x_scale": np.array(0.02, np.float32), "y_scale": np.array(0.05, np.float32), "zero": np.array(0, np.int8)}


def int8_model(case: Case, rows: int) -> onnx.ModelProto:
    n = helper.make_node
    nodes = [n("DequantizeLinear", ["x", "x_scale", "zero"], ["xd"]),
             n("DequantizeLinear", ["w", "w_scale", "wz"], ["wd"], axis=1),
             n("MatMul", ["xd", "wd"], ["h"]), n("Add", ["h", "bias"], ["hb"])]
    inits = _weights(case) | {"wz": np.zeros(case.n, np.int8)}
    if case.int8_out:
        if case.gelu:
            nodes.append(n("Gelu", ["hb"], ["g"]))
        nodes.append(n("QuantizeLinear", ["g" if case.gelu else "hb", "y_scale", "zero"], ["y"]))
        return _model(nodes, TensorProto.INT8, TensorProto.INT8, rows, case, inits)
    nodes[-1].output[0] = "y"  # fp16 scales and bias: the layer computes fp16 and writes it (no Cast layer)
    inits |= {k: inits[k].astype(np.float16) for k in ("x_scale", "w_scale", "bias")}
    return _model(nodes, TensorProto.INT8, TensorProto.FLOAT16, rows, case, inits)


def fp16_model(case: Case, rows: int) -> onnx.ModelProto:
    n = helper.make_node
    w = _weights(case)
    inits = {"w": (w["w"].astype(np.float32) * w["w_scale"]).astype(np.float16), "bias": w["bias"].astype(np.float16)}
    nodes = [n("MatMul", ["x", "w"], ["h"]), n("Add", ["h", "bias"], ["y" if not case.gelu else "hb"])]
    if case.gelu:
        nodes.append(n("Gelu", ["hb"], ["y"]))
    return _model(nodes, TensorProto.FLOAT16, TensorProto.FLOAT16, rows, case, inits)


def _model(nodes, x_type: int, y_type: int, rows: int, case: Case, inits: dict) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "layer", [helper.make_tensor_value_info("x", x_type, [rows, case.k])],
                              [helper.make_tensor_value_info("y", y_type, [rows, case.n])],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _run_kiln(torch, model, rows: int, case: Case, x, y, stream, env: dict[str, str] | None = None) -> dict:
    saved_env = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:  # until the runs are done: the runner lowers each new input shape again when it first runs
        engine = layer_engine(model, (rows, case.k), fp16=True)
        ctx = engine.create_execution_context()
        ctx.set_tensor_address("x", x.data_ptr())
        ctx.set_tensor_address("y", y.data_ptr())
        us, kernels = kernel_us(lambda: ctx.execute_async_v3(stream.cuda_stream), stream)
        torch.cuda.synchronize()
    finally:
        for k, v in saved_env.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    tactic = next((layer["tactic"] for layer in engine.plan.layers if layer["type"] in ("QMatMul", "FusedMatMul", "MatMul")), "")
    return {"us": round(us, 2), "tops": round(2 * rows * case.n * case.k / us / 1e6, 1), "tactic": tactic, "kernels": kernels}


def run_case(torch, case: Case, rows: int, kiln_only: bool = False) -> dict:
    import torch.nn.functional as F

    stream = torch.cuda.current_stream()
    gen = torch.Generator(device="cuda").manual_seed(0)
    xq = torch.randint(-127, 128, (rows, case.k), dtype=torch.int8, device="cuda", generator=gen)
    out_dtype = torch.int8 if case.int8_out else torch.float16
    row: dict = {"case": case.name, "m": rows, "n": case.n, "k": case.k}
    model = int8_model(case, rows)
    y = torch.empty((rows, case.n), dtype=out_dtype, device="cuda")
    row["qgemm"] = _run_kiln(torch, model, rows, case, xq, y, stream)
    if kiln_only:
        return row
    y_lt = torch.empty((rows, case.n), dtype=out_dtype, device="cuda")
    row["lt"] = _run_kiln(torch, model, rows, case, xq, y_lt, stream, env={"KILN_QGEMM": "0"})
    row["max_diff_vs_lt"] = (y.float() - y_lt.float()).abs().max().item()
    xh = torch.randn((rows, case.k), device="cuda", generator=gen).half()
    yh = torch.empty((rows, case.n), dtype=torch.float16, device="cuda")
    row["fp16"] = _run_kiln(torch, fp16_model(case, rows), rows, case, xh, yh, stream)
    w = torch.randn((case.n, case.k), device="cuda", generator=gen).half()
    b = torch.randn(case.n, device="cuda", generator=gen).half()
    linear = (lambda: F.gelu(F.linear(xh, w, b))) if case.gelu else (lambda: F.linear(xh, w, b))
    row["torch_fp16_us"], _ = kernel_us(linear, stream)
    wq = torch.randint(-127, 128, (case.k, case.n), dtype=torch.int8, device="cuda", generator=gen)
    row["torch_int_mm_us"], _ = kernel_us(lambda: torch._int_mm(xq, wq), stream)
    return row


def profile_runs(torch, case: Case, rows: int, runs: int = 3) -> None:
    """Kiln's qgemm and fp16 engines of ``case``, ``runs`` launches each and nothing else (no CUPTI)."""
    stream = torch.cuda.current_stream()
    cases = ((int8_model(case, rows), torch.randint(-127, 128, (rows, case.k), dtype=torch.int8, device="cuda"),
              torch.int8 if case.int8_out else torch.float16),
             (fp16_model(case, rows), torch.randn((rows, case.k), device="cuda").half(), torch.float16))
    for model, x, out_dtype in cases:
        ctx = layer_engine(model, (rows, case.k), fp16=True).create_execution_context()
        y = torch.empty((rows, case.n), dtype=out_dtype, device="cuda")
        ctx.set_tensor_address("x", x.data_ptr())
        ctx.set_tensor_address("y", y.data_ptr())
        for _ in range(runs):
            ctx.execute_async_v3(stream.cuda_stream)
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="8192,1024", help="comma-separated GEMM rows: batch x sequence (BERT 64 x 128)")
    parser.add_argument("--cases", default=",".join(str(i) for i in range(len(CASES))),
                        help="comma-separated indexes into " + "; ".join(f"{i}: {c.name}" for i, c in enumerate(CASES)))
    parser.add_argument("--profile-runs", action="store_true", help="only run the Kiln engines, for a profiler")
    parser.add_argument("--kiln-only", action="store_true", help="time Kiln's qgemm alone (A/B runs of the kernel)")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    import torch

    cases = [CASES[int(i)] for i in args.cases.split(",")]
    if args.profile_runs:
        for rows in [int(r) for r in args.rows.split(",")]:
            for case in cases:
                profile_runs(torch, case, rows)
        return 0

    print(f"{torch.cuda.get_device_name()}: GPU kernel us per call (CUPTI)")
    print(f"{'case':<36} {'rows':>5} {'qgemm':>7} {'lt':>7} {'fp16':>7} {'torch16':>7} {'int_mm':>7} {'TOPS':>6} "
          f"{'x fp16':>6} {'x lt':>6} {'max diff':>8}")
    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        for case in cases:
            row = run_case(torch, case, rows, args.kiln_only)
            results.append(row)
            q = row["qgemm"]
            if args.kiln_only:
                print(f"{case.name:<36} {rows:>5} {q['us']:>7.1f} {'':>7} {'':>7} {'':>7} {'':>7} {q['tops']:>6.0f}")
                continue
            print(f"{case.name:<36} {rows:>5} {q['us']:>7.1f} {row['lt']['us']:>7.1f} {row['fp16']['us']:>7.1f}"
                  f" {row['torch_fp16_us']:>7.1f} {row['torch_int_mm_us']:>7.1f} {q['tops']:>6.0f}"
                  f" {row['fp16']['us'] / q['us']:>6.2f} {row['lt']['us'] / q['us']:>6.2f} {row['max_diff_vs_lt']:>8.3g}")
    write_results(args.out, "qgemm", {"device": torch.cuda.get_device_name(), "rows": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
