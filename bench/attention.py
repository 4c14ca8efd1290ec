"""Kiln's fused attention kernel vs torch's scaled_dot_product_attention, same run.

    python -m bench.attention [--cases 0,1,2,3] [--out bench/results] [--profile-runs]

Each case is a one-layer ONNX model (onnx.helper) of ``Attention`` (opset 23), fp16: BERT-base's shape (the 3-D
form [batch, seq, 768], 12 heads of 64, its padding mask [batch, 1, 1, seq]), a longer sequence, a causal
head size 128 case without a mask, and the 3-D form without a mask at the shapes of ViT-B/16 (197 tokens, 12 heads)
and Whisper-tiny's encoder (1500 frames, 6 heads of 64). Columns (GPU kernel time from CUPTI, microseconds per call,
every kernel of the layer):
  kiln      cuDNN's fused SDPA where the build may use cuDNN and it takes the layer (tactic attention:cudnn_sdpa),
            else one ``flash_attention_*`` launch
  kiln+q    the same Attention followed by an int8 QuantizeLinear (scale 0.02), which the builder fuses into one
            ``flash_attention_q_*`` launch (kiln.AttentionQuantize: what explicitly quantized BERT runs)
  torch     torch ``F.scaled_dot_product_attention`` on contiguous [batch, heads, seq, dim] tensors with the same
            mask (torch picks its backend: flash without a mask, memory-efficient with one)
  torch+q   torch's attention, then ``(y / scale).round().clamp(-128, 127).to(int8)`` in eager kernels
TFLOP/s counts 4 batch heads Sq Skv D (halved for causal). ``max diff`` compares Kiln's fp16 output with
torch's. Writes ``attention_<time>.json``. ``--profile-runs``: only Kiln's two engines of each case, a few launches
each, no CUPTI and no torch peer, for a kernel profiler (bench/ncu_flash.sh).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from bench.engine import kernel_us, layer_engine, write_results

SCALE = 0.02


@dataclass
class Case:
    name: str
    batch: int
    heads: int
    seq: int
    dim: int
    #: the 3-D form [batch, seq, heads * dim] with a [batch, 1, 1, seq] additive mask (BERT), else 4-D, no mask
    bert: bool
    causal: int = 0
    #: the 3-D form's padding mask (False: the 3-D form without one, as ViT and Whisper's encoder run it)
    mask: bool = True

    def flops(self) -> float:
        return 4.0 * self.batch * self.heads * self.seq * self.seq * self.dim / (2 if self.causal else 1)


CASES = [Case("BERT-base b64 s128", 64, 12, 128, 64, True),
         Case("BERT-base b8 s512", 8, 12, 512, 64, True),
         Case("causal d128 b4 h16 s1024", 4, 16, 1024, 128, False, 1),
         Case("BERT-base b8 s128", 8, 12, 128, 64, True),
         Case("ViT-B/16 b64 s197", 64, 12, 197, 64, True, mask=False),
         Case("Whisper-tiny enc b16 s1500", 16, 6, 1500, 64, True, mask=False)]


def _shapes(case: Case) -> dict[str, tuple[int, ...]]:
    qkv = (case.batch, case.seq, case.heads * case.dim) if case.bert else (case.batch, case.heads, case.seq, case.dim)
    shapes = {name: qkv for name in "qkv"}
    if case.bert and case.mask:
        shapes["mask"] = (case.batch, 1, 1, case.seq)
    return shapes


def model(case: Case, quantize: bool) -> onnx.ModelProto:
    shapes = _shapes(case)
    attrs = {"q_num_heads": case.heads, "kv_num_heads": case.heads} if case.bert else {}
    nodes = [helper.make_node("Attention", list(shapes), ["y"], is_causal=case.causal, **attrs)]
    inits, out = [], ("y", TensorProto.FLOAT16)
    if quantize:
        nodes.append(helper.make_node("QuantizeLinear", ["y", "scale", "zero"], ["yq"]))
        inits = [numpy_helper.from_array(np.array(SCALE, np.float32), "scale"),
                 numpy_helper.from_array(np.array(0, np.int8), "zero")]
        out = ("yq", TensorProto.INT8)
    graph = helper.make_graph(nodes, "attention", [helper.make_tensor_value_info(n, TensorProto.FLOAT16, s)
                                                   for n, s in shapes.items()],
                              [helper.make_tensor_value_info(out[0], out[1], None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


def _bound(torch, case: Case, quantize: bool, feeds: dict):
    """(engine, execution context with the feeds and a fresh output bound, the output)."""
    engine = layer_engine(model(case, quantize), _shapes(case))
    ctx = engine.create_execution_context()
    y = torch.empty(feeds["q"].shape, dtype=torch.int8 if quantize else torch.float16, device="cuda")
    for name, value in feeds.items():
        ctx.set_tensor_address(name, value.data_ptr())
    ctx.set_tensor_address("yq" if quantize else "y", y.data_ptr())
    return engine, ctx, y


def _kiln(torch, case: Case, quantize: bool, feeds: dict, stream) -> tuple[dict, object]:
    engine, ctx, y = _bound(torch, case, quantize, feeds)
    us, kernels = kernel_us(lambda: ctx.execute_async_v3(stream.cuda_stream), stream)
    tactic = next(layer["tactic"] for layer in engine.plan.layers if "Attention" in layer["type"])
    return {"us": round(us, 2), "tflops": round(case.flops() / us / 1e6, 1), "tactic": tactic, "kernels": kernels}, y


def _feeds(torch, case: Case) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    feeds = {name: torch.randn(shape, device="cuda", generator=gen).half() for name, shape in _shapes(case).items()
             if name != "mask"}
    if "mask" in _shapes(case):  # the last eighth of every other sequence is padding
        mask = torch.zeros(_shapes(case)["mask"], device="cuda", dtype=torch.float16)
        mask[1::2, ..., case.seq - case.seq // 8:] = -10000.0
        feeds["mask"] = mask
    return feeds


def profile_runs(torch, case: Case, runs: int = 3) -> None:
    """Kiln's attention engines of ``case`` (float and int8 output), ``runs`` launches each and nothing else."""
    stream, feeds = torch.cuda.current_stream(), _feeds(torch, case)
    for quantize in (False, True):
        _, ctx, _ = _bound(torch, case, quantize, feeds)
        for _ in range(runs):
            ctx.execute_async_v3(stream.cuda_stream)
        torch.cuda.synchronize()


def run_case(torch, case: Case) -> dict:
    import torch.nn.functional as F

    stream = torch.cuda.current_stream()
    feeds = _feeds(torch, case)
    row: dict = {"case": case.name, "batch": case.batch, "heads": case.heads, "seq": case.seq, "dim": case.dim,
                 "causal": case.causal}
    row["kiln"], y = _kiln(torch, case, False, feeds, stream)
    row["kiln_q"], _ = _kiln(torch, case, True, feeds, stream)

    def heads(t):  # [batch, heads, seq, dim] contiguous, as torch's kernels want it
        return t.view(case.batch, case.seq, case.heads, case.dim).transpose(1, 2).contiguous() if case.bert else t

    q, k, v = (heads(feeds[n]) for n in "qkv")
    mask = feeds.get("mask")

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=bool(case.causal))

    def sdpa_q():
        return (sdpa() / SCALE).round().clamp(-128, 127).to(torch.int8)

    row["torch_us"], row["torch_kernels"] = kernel_us(sdpa, stream)
    row["torch_q_us"], _ = kernel_us(sdpa_q, stream)
    torch.cuda.synchronize()
    row["max_diff_vs_torch"] = (heads(y).float() - sdpa().float()).abs().max().item()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(str(i) for i in range(len(CASES))),
                        help="comma-separated indexes into " + "; ".join(f"{i}: {c.name}" for i, c in enumerate(CASES)))
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--profile-runs", action="store_true", help="only run the Kiln engines, for a profiler")
    args = parser.parse_args(argv)
    import torch

    if args.profile_runs:
        for case in (CASES[int(i)] for i in args.cases.split(",")):
            profile_runs(torch, case)
        return 0
    print(f"{torch.cuda.get_device_name()}: GPU kernel us per call (CUPTI)")
    print(f"{'case':<26} {'kiln':>7} {'kiln+q':>7} {'torch':>7} {'torch+q':>7} {'TFLOP/s':>7} {'x torch':>7} "
          f"{'max diff':>8}")
    results = []
    for case in (CASES[int(i)] for i in args.cases.split(",")):
        row = run_case(torch, case)
        results.append(row)
        kiln = row["kiln"]
        print(f"{case.name:<26} {kiln['us']:>7.1f} {row['kiln_q']['us']:>7.1f} {row['torch_us']:>7.1f}"
              f" {row['torch_q_us']:>7.1f} {kiln['tflops']:>7.0f} {row['torch_us'] / kiln['us']:>7.2f}"
              f" {row['max_diff_vs_torch']:>8.3g}")
    write_results(args.out, "attention", {"device": torch.cuda.get_device_name(), "rows": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
