"""How long binding a model's batch buckets takes, bucket by bucket, and where that time goes.

    python -m bench.bind_time --plan resnet.plan --max-batch 32 [--profile 25] [--out DIR]
    python -m bench.bind_time --build-resnet50 resnet.plan        (builds the plan first: fp16, batch 1..32)

A server binds every bucket of a CUDA model before it reports ready, and a reloaded model serves nothing meanwhile
(#35: ResNet-50 fp16's 10 buckets took ~11 s on an H200, BERT-base's 14 took 2 s). This loads the plan in a fresh
process, creates one execution context and warms each bucket up as the server does (largest first), printing the
seconds each took and one replayed run's milliseconds at that bucket (a faster binding must not pick slower kernels).
`--profile N` runs the binding under cProfile and prints the N functions with the most time of their own (cuDNN's
heuristics, support checks and plan builds show as its frontend's methods). Run it once per setting to compare
(e.g. KILN_CUDNN_KERNEL_CACHE=1); results as JSON in --out.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def build_resnet50(path: Path, max_batch: int) -> None:
    """ResNet-50 (tools/make_models.py) fp16 with one profile over batch 1..max_batch, as the server builds it."""
    import engine_core as kiln

    sys.path.insert(0, str(ROOT / "tools"))
    import make_models

    model = make_models.resnet50(image_size=224)
    builder = kiln.Builder()
    network = builder.create_network()
    if not kiln.OnnxParser(network).parse(model.SerializeToString()):
        raise SystemExit("Kiln could not parse the ResNet-50 export")
    config = builder.create_builder_config()
    config.set_flag(kiln.BuilderFlag.FP16)
    profile = builder.create_optimization_profile()
    name = model.graph.input[0].name
    profile.set_shape(name, (1, 3, 224, 224), (max_batch, 3, 224, 224), (max_batch, 3, 224, 224))
    config.add_optimization_profile(profile)
    started = time.perf_counter()
    path.write_bytes(kiln.build_plan(network, config))
    print(f"built {path} in {time.perf_counter() - started:.1f} s", flush=True)


def bind(plan: bytes, max_batch: int, profile_top: int) -> dict:
    """Bucket by bucket: (seconds to bind and capture, ms of one replayed run)."""
    import engine_core as kiln
    from server.core.execution import batch_buckets

    started = time.perf_counter()
    engine = kiln.Runtime().load(plan)
    context = engine.create_execution_context()
    loaded_s = time.perf_counter() - started
    inputs = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)
              if engine.get_tensor_mode(engine.get_tensor_name(i)) == kiln.TensorIOMode.INPUT]
    tails = {name: tuple(engine.get_tensor_shape(name))[1:] for name in inputs}
    rows = []
    profiler = cProfile.Profile() if profile_top else None
    for bucket in reversed(batch_buckets(max_batch)):  # largest first, as server/core/warmup.py
        shapes = {name: (bucket, *tail) for name, tail in tails.items()}
        began = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        context.warm_up(shapes)
        if profiler is not None:
            profiler.disable()
        bound_s = time.perf_counter() - began
        feeds = {name: np.zeros(shape, kiln.nptype(engine.get_tensor_dtype(name))) for name, shape in shapes.items()}
        context.infer(feeds)
        began = time.perf_counter()
        context.infer(feeds)
        run_ms = (time.perf_counter() - began) * 1e3
        rows.append({"bucket": bucket, "bind_s": round(bound_s, 3), "run_ms": round(run_ms, 3)})
        print(f"bucket {bucket:4d}: bound in {bound_s:6.2f} s, a run {run_ms:7.2f} ms", flush=True)
    result = {"load_s": round(loaded_s, 3), "buckets": rows, "bind_total_s": round(sum(r["bind_s"] for r in rows), 2),
              "kernel_cache": os.environ.get("KILN_CUDNN_KERNEL_CACHE", "")}
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(profile_top)
        result["profile"] = text.getvalue()
        print(result["profile"], flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", type=Path, help="a plan file to bind")
    parser.add_argument("--build-resnet50", type=Path, help="build ResNet-50 fp16 to this plan file and stop")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--profile", type=int, default=0, help="cProfile: print this many functions (0: off)")
    parser.add_argument("--out", type=Path, help="write bind_time_<label>.json here")
    parser.add_argument("--label", default="default")
    args = parser.parse_args(argv)
    if args.build_resnet50:
        build_resnet50(args.build_resnet50, args.max_batch)
        return 0
    if args.plan is None:
        parser.error("--plan or --build-resnet50")
    result = bind(args.plan.read_bytes(), args.max_batch, args.profile)
    print(f"load {result['load_s']:.2f} s, every bucket bound in {result['bind_total_s']:.2f} s", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"bind_time_{args.label}.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
