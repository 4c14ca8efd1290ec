"""Kiln's residual-add + LayerNorm kernel (kiln.SkipLayerNorm) at BERT sizes vs torch, same run, with bandwidth.

    python -m bench.norm [--rows 8192,1024] [--out bench/results]

Each case is a one-layer ONNX model (onnx.helper), fp16: ``LayerNormalization(x + skip)`` over 768 columns, which
the builder fuses into one ``skip_layer_norm_warp_f16`` launch; and the same followed by an int8 QuantizeLinear of
the output (scale 0.02: explicitly quantized BERT's next-layer input), fused into ``skip_layer_norm_q_warp_f16``
(both outputs kept); and the residual stream in int8 (``bench.int8``'s int8_explicit_residual): int8 x and skip
through DequantizeLinear (scale 0.05) and only the int8 output, fused into ``skip_layer_norm_dq_warp_f16`` (fp32 model
built with FP16). Columns (GPU kernel time from CUPTI, microseconds per call, every kernel of the layer):
  kiln / kiln+q / kiln i8   Kiln's launches
  torch / torch+q torch eager ``F.layer_norm(x + skip)`` (two kernels), then ``(y / scale).round().clamp().to(int8)``
  copy            torch's device-to-device copy of the bytes Kiln's kernel moves (x, skip read; y written): the
                  memory system's reference for the same traffic
TB/s counts the bytes Kiln's kernel reads and writes. Writes ``norm_<time>.json``. ``--profile-runs`` runs the three
Kiln engines a few times each without timing or peers, for a kernel profiler (``ncu -k regex:skip_layer_norm``).
"""

from __future__ import annotations

import argparse

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from bench.engine import kernel_us, layer_engine, write_results

COLS, SCALE, IN_SCALE = 768, 0.02, 0.05


def model(rows: int, quantize: bool, int8_inputs: bool = False) -> onnx.ModelProto:
    """fp16 ``LayerNorm(x + skip)`` (and its QuantizeLinear); ``int8_inputs``: fp32 (build with FP16), int8 x and
    skip dequantized, only the quantized output."""
    rng = np.random.default_rng(0)
    dtype, onnx_type = (np.float32, TensorProto.FLOAT) if int8_inputs else (np.float16, TensorProto.FLOAT16)
    inits = [numpy_helper.from_array(rng.standard_normal(COLS).astype(dtype), "gamma"),
             numpy_helper.from_array((0.1 * rng.standard_normal(COLS)).astype(dtype), "beta"),
             numpy_helper.from_array(np.array(0, np.int8), "zero")]
    nodes = [helper.make_node("Add", ["xd", "skipd"] if int8_inputs else ["x", "skip"], ["s"]),
             helper.make_node("LayerNormalization", ["s", "gamma", "beta"], ["y"], axis=-1, epsilon=1e-12)]
    outputs = [] if int8_inputs else [helper.make_tensor_value_info("y", onnx_type, [rows, COLS])]
    if int8_inputs:
        nodes[:0] = [helper.make_node("DequantizeLinear", [n, "in_scale", "zero"], [f"{n}d"]) for n in ("x", "skip")]
        inits.append(numpy_helper.from_array(np.array(IN_SCALE, np.float32), "in_scale"))
    if quantize or int8_inputs:
        nodes.append(helper.make_node("QuantizeLinear", ["y", "scale", "zero"], ["yq"]))
        inits.append(numpy_helper.from_array(np.array(SCALE, np.float32), "scale"))
        outputs.append(helper.make_tensor_value_info("yq", TensorProto.INT8, [rows, COLS]))
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT8 if int8_inputs else onnx_type, [rows, COLS])
              for n in ("x", "skip")]
    graph = helper.make_graph(nodes, "skip_layer_norm", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _kiln(torch, rows: int, quantize: bool, feeds: dict, stream, int8_inputs: bool = False, runs: int = 0) -> dict:
    """Kiln's layer timed by CUPTI; ``runs`` > 0: only launched that many times (for a profiler)."""
    shape = (rows, COLS)
    engine = layer_engine(model(rows, quantize, int8_inputs), {"x": shape, "skip": shape}, fp16=int8_inputs)
    ctx = engine.create_execution_context()
    outs = {} if int8_inputs else {"y": torch.empty(shape, dtype=torch.float16, device="cuda")}
    if quantize or int8_inputs:
        outs["yq"] = torch.empty(shape, dtype=torch.int8, device="cuda")
    if int8_inputs:
        feeds = {name: (value / IN_SCALE).round().clamp(-127, 127).to(torch.int8) for name, value in feeds.items()}
    for name, value in {**feeds, **outs}.items():
        ctx.set_tensor_address(name, value.data_ptr())
    if runs:
        for _ in range(runs):
            ctx.execute_async_v3(stream.cuda_stream)
        torch.cuda.synchronize()
        return {}
    us, kernels = kernel_us(lambda: ctx.execute_async_v3(stream.cuda_stream), stream)
    # x, skip read; y (and yq) written
    moved = rows * COLS * (3 if int8_inputs else 2 * 2 + 2 + (1 if quantize else 0))
    return {"us": round(us, 2), "tb_s": round(moved / us / 1e6, 2), "kernels": kernels}


def run_case(torch, rows: int) -> dict:
    import torch.nn.functional as F

    stream = torch.cuda.current_stream()
    gen = torch.Generator(device="cuda").manual_seed(0)
    feeds = {name: torch.randn((rows, COLS), device="cuda", generator=gen).half() for name in ("x", "skip")}
    gamma, beta = torch.ones(COLS, device="cuda").half(), torch.zeros(COLS, device="cuda").half()
    row: dict = {"rows": rows, "cols": COLS, "kiln": _kiln(torch, rows, False, feeds, stream),
                 "kiln_q": _kiln(torch, rows, True, feeds, stream), "kiln_i8": _kiln(torch, rows, True, feeds, stream, True)}

    def norm():
        return F.layer_norm(feeds["x"] + feeds["skip"], (COLS,), gamma, beta, 1e-12)

    def norm_q():
        return (norm() / SCALE).round().clamp(-128, 127).to(torch.int8)

    source = torch.empty(rows * COLS * 3, dtype=torch.float16, device="cuda")  # x + skip + y bytes, copied
    target = torch.empty_like(source)
    row["torch_us"], _ = kernel_us(norm, stream)
    row["torch_q_us"], _ = kernel_us(norm_q, stream)
    copy_us, _ = kernel_us(lambda: target.copy_(source), stream)
    row["copy_us"], row["copy_tb_s"] = round(copy_us, 2), round(2 * source.numel() * 2 / copy_us / 1e6, 2)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="8192,1024", help="comma-separated rows: batch x sequence (BERT 64 x 128)")
    parser.add_argument("--profile-runs", action="store_true", help="only run the Kiln engines, for a profiler")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    import torch

    if args.profile_runs:
        stream = torch.cuda.current_stream()
        for rows in (int(r) for r in args.rows.split(",")):
            feeds = {name: torch.randn((rows, COLS), device="cuda").half() for name in ("x", "skip")}
            for quantize, int8_inputs in ((False, False), (True, False), (True, True)):
                _kiln(torch, rows, quantize, feeds, stream, int8_inputs, runs=3)
        return 0

    print(f"{torch.cuda.get_device_name()}: GPU kernel us per call (CUPTI), SkipLayerNorm over {COLS} fp16 columns")
    print(f"{'rows':>6} {'kiln':>7} {'kiln+q':>7} {'kiln i8':>7} {'torch':>7} {'torch+q':>7} {'copy':>7} {'TB/s':>6} "
          f"{'+q TB/s':>7} {'i8 TB/s':>7} {'copy TB/s':>9}")
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        row = run_case(torch, rows)
        results.append(row)
        print(f"{rows:>6} {row['kiln']['us']:>7.1f} {row['kiln_q']['us']:>7.1f} {row['kiln_i8']['us']:>7.1f}"
              f" {row['torch_us']:>7.1f} {row['torch_q_us']:>7.1f} {row['copy_us']:>7.1f} {row['kiln']['tb_s']:>6.2f}"
              f" {row['kiln_q']['tb_s']:>7.2f} {row['kiln_i8']['tb_s']:>7.2f} {row['copy_tb_s']:>9.2f}")
    write_results(args.out, "norm", {"device": torch.cuda.get_device_name(), "rows": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
