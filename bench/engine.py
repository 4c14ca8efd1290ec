"""Kiln CUDA engine vs torch (eager and torch.compile) on real models, same weights, same run.

    python -m bench.engine [--models resnet50,bert_base] [--precisions fp32,tf32,fp16]
                           [--batches 1,8,32,128] [--peers eager,reduce-overhead] [--out bench/results]

Each model is a real torch ``nn.Module`` (torchvision ResNet-50, transformers BERT-base) with seeded
random weights, exported to ONNX once; Kiln builds that ONNX file, torch runs the module itself, so both
sides compute with identical weights. Precisions: ``fp32`` (TF32 off on both sides), ``tf32`` (Kiln
BuilderFlag.TF32, torch allow_tf32), ``fp16`` (Kiln BuilderFlag.FP16 with fp32 I/O, torch ``.half()``).
Kiln runs ``execute_async_v3`` with CUDA graph replay on a torch stream with device pointers from torch
tensors. Times are CUDA-event medians in milliseconds. Peers: ``eager``, and torch.compile modes
(``reduce-overhead``, ``max-autotune-no-cudagraphs``, ``default``), compiled once per (model,
precision) and measured at ``--compile-batches`` (compiling costs minutes per shape). Prints a table and
writes JSON (figures, device, versions) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SEQ = 128


# -- models: torch modules and their ONNX exports ----------------------------------------------------------


def torch_model(name: str):
    """(module in eval mode on the GPU, input names, example-input factory(batch, dtype))."""
    import torch

    torch.manual_seed(0)
    if name == "resnet50":
        import torchvision

        module = torchvision.models.resnet50(weights=None).eval().cuda()

        def inputs(batch: int, dtype=torch.float32):
            g = torch.Generator(device="cuda").manual_seed(batch)
            return (torch.randn(batch, 3, 224, 224, device="cuda", generator=g).to(dtype),)

        return module, ["input"], inputs
    if name == "bert_base":
        from transformers import BertConfig, BertModel

        config = BertConfig(attn_implementation="eager")
        module = BertModel(config, add_pooling_layer=False).eval().cuda()

        def inputs(batch: int, dtype=torch.float32):
            g = torch.Generator(device="cuda").manual_seed(batch)
            ids = torch.randint(0, config.vocab_size, (batch, SEQ), device="cuda", generator=g)
            return ids, torch.ones_like(ids), torch.zeros_like(ids)

        return module, ["input_ids", "attention_mask", "token_type_ids"], inputs
    raise ValueError(f"unknown model {name}")


def single_output(module):
    """``module`` returning one tensor (BERT returns a ModelOutput)."""
    import torch

    class SingleOutput(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = module

        def forward(self, *args):
            out = self.inner(*args)
            return out if isinstance(out, torch.Tensor) else out[0]

    return SingleOutput().eval()


def export_onnx(module, names: list[str], example: tuple, path: Path, output_axes: dict[int, str] | None = None) -> Path:
    """ONNX export with a dynamic batch dimension (opset 17); ``output_axes`` names the output's dynamic dims
    when they are not the batch (a detector's selected rows)."""
    import torch

    dynamic = {n: {0: "batch"} for n in names} | {"output": output_axes or {0: "batch"}}
    with torch.no_grad():
        try:
            torch.onnx.export(module, example, str(path), input_names=names, output_names=["output"],
                              dynamic_axes=dynamic, opset_version=17, dynamo=False)
        except TypeError:  # an exporter without the dynamo switch
            torch.onnx.export(module, example, str(path), input_names=names, output_names=["output"],
                              dynamic_axes=dynamic, opset_version=17)
    return path


def write_results(out: str | Path, prefix: str, payload: dict) -> Path:
    """``payload`` as ``<out>/<prefix>_<time>.json`` (the name every bench script writes); prints and returns it."""
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{prefix}_{time.strftime('%Y%m%dT%H%M%S')}.json"
    path.write_text(json.dumps(payload, indent=1))
    print(f"wrote {path}")
    return path


# -- timing -----------------------------------------------------------------------------------------------


def cuda_time(fn, stream, warmup: int = 5, iters: int = 30) -> float:
    """Median milliseconds of ``fn()`` measured with events on ``stream`` (a torch stream)."""
    import torch

    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            fn()
            stop.record(stream)
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def kernel_profile(fn, stream, runs: int = 5, top: int = 25) -> list[dict]:
    """GPU time per kernel name over ``runs`` calls of ``fn()`` on ``stream``, from CUPTI (torch.profiler): every
    kernel launched in the process, cuDNN's and cuBLASLt's and those inside replayed CUDA graphs included, with
    no host gaps. Why: per-layer CUDA events include the host's enqueue time, which hides what the kernels
    themselves cost. The ``top`` kernels by time: name, ms per run, launches per run."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with torch.cuda.stream(stream):
            for _ in range(runs):
                fn()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time > 0:
            entry = totals.setdefault(event.name, [0.0, 0])
            entry[0] += event.device_time / 1000.0
            entry[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"kernel": name[:160], "ms": round(ms / runs, 4), "launches": count // runs} for name, (ms, count) in ranked]


def kernel_us(fn, stream, calls: int = 20) -> tuple[float, list[dict]]:
    """(GPU microseconds per call of ``fn`` summed over its kernels, the kernels) from ``kernel_profile``."""
    kernels = kernel_profile(fn, stream, runs=calls, top=8)
    return sum(k["ms"] for k in kernels) * 1000, kernels


def layer_engine(model, shape: tuple[int, ...] | dict[str, tuple[int, ...]], fp16: bool = False):
    """A Kiln engine of a one-layer model (onnx.helper) whose one input "x" has a fixed ``shape`` (or whose inputs
    have the fixed shapes of a name -> shape dict): what the per-layer benchmarks (bench.pointwise, bench.qgemm,
    bench.attention) time."""
    import engine_core as kiln

    builder = kiln.Builder()
    net = builder.create_network()
    if not kiln.OnnxParser(net).parse(model):
        raise RuntimeError("Kiln could not parse the case")
    config = builder.create_builder_config()
    if fp16:
        config.set_flag(kiln.BuilderFlag.FP16)
    else:  # strict fp32, as the torch side computes it
        config.clear_flag(kiln.BuilderFlag.TF32)
    profile = builder.create_optimization_profile()
    for name, fixed in (shape if isinstance(shape, dict) else {"x": shape}).items():
        profile.set_shape(name, fixed, fixed, fixed)
    config.add_optimization_profile(profile)
    return kiln.Runtime().load(kiln.build_plan(net, config))


def build_kiln(onnx_path: Path, names: list[str], precision: str, batches: list[int], sample: tuple):
    """(engine, build seconds, warm-cache rebuild seconds) for one profile covering ``batches``."""
    import engine_core as kiln

    def build(cache):
        builder = kiln.Builder()
        net = builder.create_network()
        if not kiln.OnnxParser(net).parse_from_file(str(onnx_path)):
            raise RuntimeError(f"Kiln could not parse {onnx_path}")
        cfg = builder.create_builder_config()
        if precision == "fp32":  # strict: a new config allows TF32, as the reference's does
            cfg.clear_flag(kiln.BuilderFlag.TF32)
        if precision in ("fp16", "bf16"):
            cfg.set_flag(kiln.BuilderFlag.FP16 if precision == "fp16" else kiln.BuilderFlag.BF16)
            cfg.set_flag(kiln.BuilderFlag.TF32)
        cfg.set_timing_cache(cache)
        prof = builder.create_optimization_profile()
        lo, hi = min(batches), max(batches)
        opt = batches[len(batches) // 2]
        for n, t in zip(names, sample):
            rest = tuple(t.shape[1:])
            prof.set_shape(n, (lo, *rest), (opt, *rest), (hi, *rest))
        cfg.add_optimization_profile(prof)
        started = time.perf_counter()
        plan = kiln.build_plan(net, cfg)
        return plan, time.perf_counter() - started

    cache = kiln.Builder().create_builder_config().create_timing_cache(b"")
    plan, cold = build(cache)
    _, warm = build(cache)
    return kiln.Runtime().load(plan), cold, warm


def kiln_runner(engine, names: list[str], inputs: tuple):
    """A zero-argument launcher of the engine on torch tensors, and its output tensor."""
    import torch

    ctx = engine.create_execution_context()
    for n, t in zip(names, inputs):
        ctx.set_input_shape(n, tuple(t.shape))
        ctx.set_tensor_address(n, t.data_ptr())
    out = next(t for t in engine.plan.io if t.mode.name == "OUTPUT")
    dtype = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16}[np.dtype(out.dtype)]
    y = torch.empty(ctx.get_tensor_shape(out.name), dtype=dtype, device="cuda")
    ctx.set_tensor_address(out.name, y.data_ptr())
    return (lambda: ctx.execute_async_v3(torch.cuda.current_stream().cuda_stream)), y, ctx


def set_torch_precision(precision: str) -> None:
    import torch

    tf32 = precision != "fp32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = True  # the peer at its best: cuDNN's algorithms timed per shape, as Kiln's are


def profile_by_op(engine, ctx) -> dict[str, float]:
    """One profiled run (CUDA events per layer), summed by layer type, largest first."""
    import torch

    import engine_core as kiln

    types = {layer["name"]: layer["type"] for layer in engine.plan.layers}

    class ByOp(kiln.IProfiler):
        def __init__(self) -> None:
            self.ms: dict[str, float] = {}

        def report_layer_time(self, layer_name: str, ms: float) -> None:
            op = types.get(layer_name, "Reformat" if layer_name.startswith("reformat") else "?")
            self.ms[op] = self.ms.get(op, 0.0) + ms

    ctx.profiler = ByOp()
    ctx.execute_async_v3(torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    result = dict(sorted(((k, round(v, 4)) for k, v in ctx.profiler.ms.items()), key=lambda kv: -kv[1]))
    ctx.profiler = None
    return result


def bench_model(name: str, precisions: list[str], batches: list[int], peers: list[str],
                compile_batches: list[int], workdir: Path, profile: bool, on_row=None) -> list[dict]:
    import torch

    module, names, make_inputs = torch_model(name)
    wrapped = single_output(module)
    onnx_path = export_onnx(wrapped, names, make_inputs(2), workdir / f"{name}.onnx")
    rows = []
    for precision in precisions:
        set_torch_precision(precision)
        engine, build_s, warm_s = build_kiln(onnx_path, names, precision, batches, make_inputs(1))
        half = precision == "fp16"
        peer_module = single_output(torch_model(name)[0].half() if half else torch_model(name)[0])
        compiled = {mode: torch.compile(peer_module, mode=None if mode == "default" else mode, dynamic=False)
                    for mode in peers if mode != "eager"}
        stream = torch.cuda.Stream()
        for batch in batches:
            inputs = make_inputs(batch)
            torch_inputs = tuple(t.half() if half and t.is_floating_point() else t for t in inputs)
            with torch.cuda.stream(stream):
                run, y, ctx = kiln_runner(engine, names, inputs)
            row = {"model": name, "precision": precision, "batch": batch, "build_s": round(build_s, 2),
                   "warm_cache_build_s": round(warm_s, 2), "device_memory_size": engine.device_memory_size,
                   "activation_bytes_unshared": engine.plan.build_info["cuda"]["activation_bytes_unshared"],
                   "host_layers": engine.plan.build_info["cuda"]["host_layers"]}
            row["kiln_ms"] = round(cuda_time(run, stream), 4)
            with torch.no_grad():
                ref = peer_module(*torch_inputs).float()
                torch.cuda.synchronize()
                row["max_abs_diff"] = float((y.float() - ref).abs().max())
                row["ref_max_abs"] = float(ref.abs().max())
                if name == "resnet50":
                    row["top1_agreement"] = float((y.float().argmax(-1) == ref.argmax(-1)).float().mean())
                for mode in peers:
                    if mode != "eager" and batch not in compile_batches:
                        continue
                    fn = peer_module if mode == "eager" else compiled[mode]
                    try:
                        if mode != "eager":  # the first call compiles (max-autotune: minutes): worth reporting
                            start = time.perf_counter()
                            fn(*torch_inputs)
                            torch.cuda.synchronize()
                            row[f"torch_{mode}_compile_s"] = round(time.perf_counter() - start, 1)
                        row[f"torch_{mode}_ms"] = round(cuda_time(lambda f=fn, x=torch_inputs: f(*x), stream), 4)
                    except Exception as e:  # a compile failure is a result, not a crash
                        row[f"torch_{mode}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            torch_times = [v for k, v in row.items() if k.startswith("torch_") and k.endswith("_ms")]
            if torch_times:
                row["best_torch_ms"] = min(torch_times)
                row["speedup_vs_best_torch"] = round(min(torch_times) / row["kiln_ms"], 3)
            row["kiln_items_per_s"] = round(batch / row["kiln_ms"] * 1000, 1)
            if profile and batch in (min(batches), max(batches)):
                row["ms_by_layer_type"] = profile_by_op(engine, ctx)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "ms_by_layer_type"}), flush=True)
            if on_row is not None:
                on_row(row)
        del compiled
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="resnet50,bert_base")
    parser.add_argument("--precisions", default="fp32,tf32,fp16")
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--peers", default="eager,reduce-overhead")
    parser.add_argument("--compile-batches", default="1,128", help="batch sizes measured with compiled peers")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--profile", action="store_true", help="per-layer-type times at the smallest/largest batch")
    args = parser.parse_args(argv)
    import torch

    sys.path.insert(0, str(ROOT))
    rows: list[dict] = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"engine_{time.strftime('%Y%m%dT%H%M%S')}.json"

    def save(row: dict) -> None:  # after every row: a run cut short keeps what it measured
        rows.append(row)
        path.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "python": platform.python_version(), "argv": sys.argv[1:], "rows": rows},
                                   indent=1))

    with tempfile.TemporaryDirectory() as work:
        for name in args.models.split(","):
            batches = [int(b) for b in args.batches.split(",")]
            if name == "bert_base":
                batches = [b for b in batches if b <= 64] or [1]
            bench_model(name, args.precisions.split(","), batches, args.peers.split(","),
                        [int(b) for b in args.compile_batches.split(",")], Path(work), args.profile, on_row=save)
    print(f"\n{'model':<10}{'prec':>6}{'batch':>6}{'kiln ms':>10}{'eager ms':>10}{'compile ms':>11}{'x best':>8}"
          f"{'items/s':>10}{'max|d|':>10}")
    for r in rows:
        compiled = min((v for k, v in r.items() if k.startswith("torch_") and k.endswith("_ms")
                        and k != "torch_eager_ms"), default=float("nan"))
        print(f"{r['model']:<10}{r['precision']:>6}{r['batch']:>6}{r['kiln_ms']:>10.3f}"
              f"{r.get('torch_eager_ms', float('nan')):>10.3f}{compiled:>11.3f}"
              f"{r.get('speedup_vs_best_torch', float('nan')):>8.2f}{r['kiln_items_per_s']:>10.1f}"
              f"{r['max_abs_diff']:>10.2e}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
