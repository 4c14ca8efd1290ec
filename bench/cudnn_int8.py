"""Can cuDNN run ResNet-50's requantizing INT8 convolutions on this GPU, and how fast against fp16? (issue #7)

    python -m bench.cudnn_int8 [--batch 128] [--plans 4] [--out bench/results]

For every distinct convolution of torchvision's ResNet-50 (v1.5, NHWC) at ``--batch``, builds two cuDNN frontend
graphs and times the fastest of their first ``--plans`` execution plans (10 calls captured in a CUDA graph,
median of 20 replays):
  fp16  conv + bias + ReLU (+ residual), fp16 in/out: what Kiln's fp16 builds run today
  int8  int8 x / w (NHWC / KRSC, C padded to 4), INT32 conv, then float pointwise ops: * alpha[k] (x_scale *
        w_scale[k] / y_scale), + bias[k] / y_scale, (+ int8 residual * beta), ReLU, written as int8 NHWC: the
        whole ``kiln.QConv`` with its requantization, in one cuDNN graph
Each int8 graph's output is checked against a float64 torch reference rounded half to even (ONNX
QuantizeLinear): the count of elements that differ and the largest difference in quantization steps.
1x1 stride-1 layers are also timed as Kiln's int8-output cuBLASLt GEMM (``Int8GemmRequant``, "lt ms").
The table sums the per-shape times weighted by how often ResNet-50 has each shape: the projected convolution
time of the network. torch here only allocates, fills and checks tensors (a benchmark may use torch; Kiln
itself does not). Writes ``cudnn_int8_<time>.json``.
"""

from __future__ import annotations

import argparse

from bench.engine import write_results

#: (C, K, kernel, stride, input H=W, residual, count in ResNet-50)
RESNET50_CONVS = [
    (3, 64, 7, 2, 224, False, 1),
    (64, 64, 1, 1, 56, False, 1), (64, 64, 3, 1, 56, False, 3), (64, 256, 1, 1, 56, True, 3),
    (64, 256, 1, 1, 56, False, 1), (256, 64, 1, 1, 56, False, 2),
    (256, 128, 1, 1, 56, False, 1), (128, 128, 3, 2, 56, False, 1), (128, 512, 1, 1, 28, True, 4),
    (256, 512, 1, 2, 56, False, 1), (512, 128, 1, 1, 28, False, 3), (128, 128, 3, 1, 28, False, 3),
    (512, 256, 1, 1, 28, False, 1), (256, 256, 3, 2, 28, False, 1), (256, 1024, 1, 1, 14, True, 6),
    (512, 1024, 1, 2, 28, False, 1), (1024, 256, 1, 1, 14, False, 5), (256, 256, 3, 1, 14, False, 5),
    (1024, 512, 1, 1, 14, False, 1), (512, 512, 3, 2, 14, False, 1), (512, 2048, 1, 1, 7, True, 3),
    (1024, 2048, 1, 2, 14, False, 1), (2048, 512, 1, 1, 7, False, 2), (512, 512, 3, 1, 7, False, 2),
]


def _nhwc(n: int, c: int, h: int, w: int) -> list[int]:
    return [h * w * c, 1, w * c, c]


def _graph(cudnn, handle, int8: bool, n, c, k, r, stride, hw, residual):
    """(graph, tensors) of one convolution layer; int8 with the requantizing epilogue."""
    f32 = cudnn.data_type.FLOAT
    io = cudnn.data_type.INT8 if int8 else cudnn.data_type.HALF
    pad = r // 2
    oh = (hw + 2 * pad - r) // stride + 1
    g = cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
    t = {"x": g.tensor(name="X", dim=[n, c, hw, hw], stride=_nhwc(n, c, hw, hw), data_type=io),
         "w": g.tensor(name="W", dim=[k, c, r, r], stride=_nhwc(k, c, r, r), data_type=io)}
    y = g.conv_fprop(image=t["x"], weight=t["w"], pre_padding=[pad, pad], post_padding=[pad, pad],
                     stride=[stride, stride], dilation=[1, 1],
                     compute_data_type=cudnn.data_type.INT32 if int8 else f32, name="conv")
    vec = dict(dim=[1, k, 1, 1], stride=[k, 1, k, k])
    if int8:
        y.set_data_type(f32)
        t["alpha"] = g.tensor(name="alpha", data_type=f32, **vec)
        y = g.mul(a=y, b=t["alpha"], compute_data_type=f32, name="scale")
        t["b"] = g.tensor(name="B", data_type=f32, **vec)
        y = g.add(a=y, b=t["b"], compute_data_type=f32, name="bias")
    else:
        t["b"] = g.tensor(name="B", data_type=io, **vec)
        y = g.bias(input=y, bias=t["b"], name="bias")
    if residual:
        t["z"] = g.tensor(name="Z", dim=[n, k, oh, oh], stride=_nhwc(n, k, oh, oh), data_type=io)
        z = t["z"]
        if int8:
            t["beta"] = g.tensor(name="beta", data_type=f32, **vec)
            z = g.mul(a=z, b=t["beta"], compute_data_type=f32, name="zscale")
        y = g.add(a=y, b=z, compute_data_type=f32, name="residual")
    y = g.relu(input=y, compute_data_type=f32, name="relu")
    y.set_output(True).set_dim([n, k, oh, oh]).set_stride(_nhwc(n, k, oh, oh)).set_data_type(io)
    t["y"] = y
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    return g, t, oh


def _time(torch, enqueue, repeats: int = 10) -> float:
    """Milliseconds per ``enqueue(stream)``: ``repeats`` calls captured in one CUDA graph, the median of 20
    replays (so the Python call's host time, ~20-50 us, is not measured; eager timing if capture fails)."""
    stream = torch.cuda.Stream()
    enqueue(stream.cuda_stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(repeats):
                enqueue(stream.cuda_stream)
        run = graph.replay
    except Exception:
        def run() -> None:
            with torch.cuda.stream(stream):
                for _ in range(repeats):
                    enqueue(stream.cuda_stream)
    from bench.engine import cuda_time

    return cuda_time(run, stream, warmup=1, iters=20) / repeats


def _cudnn_enqueue(cudnn, handle, g, pack, index, workspace):
    def enqueue(stream: int) -> None:
        cudnn.set_stream(handle, stream)
        g.execute_plan_at_index(pack, workspace, index, handle=handle)
    return enqueue


def _cublaslt(torch, batch: int, shape: tuple, tensors: dict, y) -> dict:
    """A 1x1 stride-1 layer as Kiln's int8-output cuBLASLt GEMM (Int8GemmRequant: NHWC x is [N*H*W, C]), timed
    and checked like the cuDNN graph."""
    from engine_core.backends.cuda.int8_gemm import Int8GemmRequant, Int8GemmRunner
    from engine_core.backends.cuda.lowering import Ref

    c, k, _, _, hw, residual, _ = shape
    refs = {Ref(name): t.data_ptr() for name, t in tensors.items()}
    op = Int8GemmRequant(Ref("x"), Ref("w"), Ref("lt_y"), batch * hw * hw, k, c, alpha=Ref("alpha"), bias=Ref("b"),
                         c=Ref("z") if residual else None, beta=0.25 if residual else 0.0, relu=True)
    out = torch.empty_like(y)
    refs[Ref("lt_y")] = out.data_ptr()
    runner = Int8GemmRunner()
    try:
        ms = _time(torch, lambda stream: runner.run(op, refs.__getitem__, stream))
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}
    torch.cuda.synchronize()
    return {"ms": ms, "differing_from_cudnn": int((out != y).sum())}


def _layer(cudnn, torch, handle, int8: bool, batch: int, shape: tuple, plans: int) -> dict:
    c0, k, r, stride, hw, residual, _ = shape
    c = -(-c0 // 4) * 4 if int8 else c0
    row: dict = {}
    try:
        g, t, oh = _graph(cudnn, handle, int8, batch, c, k, r, stride, hw, residual)
    except Exception as exc:  # cuDNN: no engine for this graph here
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    gen = torch.Generator(device="cuda").manual_seed(0)
    dev = "cuda"
    if int8:
        x = torch.randint(-20, 21, (batch, hw, hw, c), dtype=torch.int8, device=dev, generator=gen)
        x[..., c0:] = 0
        w = torch.randint(-127, 128, (k, r, r, c), dtype=torch.int8, device=dev, generator=gen)
        scale = 30.0 / ((r * r * c0) ** 0.5 * 12 * 73)  # accumulators' std ~ sqrt(RSC) * 12 * 73: outputs ~ +-30
        alpha = (torch.rand(k, device=dev, generator=gen) + 0.5) * scale
        bias = torch.randn(k, device=dev, generator=gen) * 4
        tensors = {"x": x, "w": w, "alpha": alpha, "b": bias}
        y = torch.empty((batch, oh, oh, k), dtype=torch.int8, device=dev)
        if residual:
            tensors["z"] = torch.randint(-127, 128, (batch, oh, oh, k), dtype=torch.int8, device=dev, generator=gen)
            tensors["beta"] = torch.full((k,), 0.25, device=dev)
    else:
        tensors = {"x": torch.randn(batch, hw, hw, c, device=dev, dtype=torch.half, generator=gen),
                   "w": torch.randn(k, r, r, c, device=dev, dtype=torch.half, generator=gen) * 0.05,
                   "b": torch.randn(k, device=dev, dtype=torch.half, generator=gen)}
        if residual:
            tensors["z"] = torch.randn(batch, oh, oh, k, device=dev, dtype=torch.half, generator=gen)
        y = torch.empty((batch, oh, oh, k), dtype=torch.half, device=dev)
    tensors["y"] = y
    pack = {t[name]: value.data_ptr() for name, value in tensors.items()}
    times: dict[int, float] = {}
    errors: dict[int, str] = {}
    for index in range(min(plans, int(g.get_execution_plan_count()))):
        try:
            g.build_plan_at_index(index)
            workspace = torch.empty(max(int(g.get_workspace_size_plan_at_index(index)), 1), dtype=torch.uint8,
                                    device=dev)
            times[index] = _time(torch, _cudnn_enqueue(cudnn, handle, g, pack, index, workspace.data_ptr()))
        except Exception as exc:
            errors[index] = f"{type(exc).__name__}: {exc}"[:200]
    row["plans"] = {str(i): round(ms, 4) for i, ms in times.items()}
    if errors:
        row["plan_errors"] = errors
    if not times:
        return {**row, "error": "no plan built"}
    best = min(times, key=times.__getitem__)
    row["ms"] = times[best]
    if int8:  # check the fastest plan's output against float64 with round-half-even
        workspace = torch.empty(max(int(g.get_workspace_size_plan_at_index(best)), 1), dtype=torch.uint8,
                                device=dev)
        g.execute_plan_at_index(pack, workspace.data_ptr(), best, handle=handle)
        torch.cuda.synchronize()
        xf = tensors["x"].permute(0, 3, 1, 2).double()
        wf = tensors["w"].permute(0, 3, 1, 2).double()
        acc = torch.nn.functional.conv2d(xf, wf, stride=stride, padding=r // 2)
        ref = acc * alpha.double()[None, :, None, None] + bias.double()[None, :, None, None]
        if residual:
            ref = ref + tensors["z"].permute(0, 3, 1, 2).double() * 0.25
        ref = torch.clamp(torch.round(torch.relu(ref)), -128, 127).permute(0, 2, 3, 1)
        diff = (y.double() - ref).abs()
        row["max_step_diff"] = float(diff.max())
        row["differing"] = int((diff > 0).sum())
        row["saturated"] = int((ref >= 127).sum())
        row["elements"] = int(ref.numel())
        if r == 1 and stride == 1:  # the same layer as one cuBLASLt int8-output GEMM
            row["cublaslt"] = _cublaslt(torch, batch, shape, tensors, y)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--plans", type=int, default=4)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    import cudnn
    import torch

    handle = cudnn.create_handle()
    rows, totals = [], {"fp16": 0.0, "int8": 0.0, "int8_best": 0.0}
    print(f"cuDNN {cudnn.backend_version()} on {torch.cuda.get_device_name()}, batch {args.batch}")
    print(f"{'C':>5} {'K':>5} {'RxS':>4} {'s':>2} {'HW':>4} {'res':>3} {'n':>2} {'fp16 ms':>8} {'int8 ms':>8} "
          f"{'x':>5} {'lt ms':>7}  check")
    for shape in RESNET50_CONVS:
        row = {"shape": dict(zip(("c", "k", "kernel", "stride", "hw", "residual", "count"), shape))}
        for name, int8 in (("fp16", False), ("int8", True)):
            row[name] = _layer(cudnn, torch, handle, int8, args.batch, shape, args.plans)
            if "ms" in row[name]:
                totals[name] += row[name]["ms"] * shape[-1]
        rows.append(row)
        fp16, int8 = row["fp16"].get("ms"), row["int8"].get("ms")
        check = (f"{row['int8']['differing']}/{row['int8']['elements']} differ, max {row['int8']['max_step_diff']}"
                 if "differing" in row["int8"] else row["int8"].get("error", "")[:80])
        ratio = f"{fp16 / int8:5.2f}" if fp16 and int8 else "    -"
        c, k, r, s, hw, res, count = shape
        lt = row["int8"].get("cublaslt", {}).get("ms")
        if lt:
            totals["int8_best"] += min(lt, int8) * count
        elif int8:
            totals["int8_best"] += int8 * count
        print(f"{c:>5} {k:>5} {r}x{r:<2} {s:>2} {hw:>4} {'y' if res else '':>3} {count:>2} "
              f"{fp16 or float('nan'):8.3f} {int8 or float('nan'):8.3f} {ratio} {lt or float('nan'):7.3f}  {check}")
    print(f"ResNet-50 convolutions, weighted by count: fp16 {totals['fp16']:.3f} ms, int8 cuDNN {totals['int8']:.3f} ms, "
          f"int8 with cuBLASLt where faster {totals['int8_best']:.3f} ms")
    write_results(args.out, "cudnn_int8", {"device": torch.cuda.get_device_name(), "cudnn": cudnn.backend_version(),
                                           "batch": args.batch, "totals_ms": totals, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
