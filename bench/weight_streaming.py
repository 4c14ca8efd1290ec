"""Weight streaming on the device: throughput vs budget for an MLP with large weights.

    python -m bench.weight_streaming [--layers 4] [--dim 8192] [--batch 256] [--iters 20]
                                     [--fractions 1,0.75,0.5,0.25,0] [--out bench/results]

The model is ``layers`` x (MatMul with a dim x dim fp16 weight -> Relu), 128 MiB per weight at the
defaults (512 MiB in all), built once with BuilderFlag.WEIGHT_STREAMING. For each budget (a fraction of
the streamable size, plus the automatic budget) a fresh context runs ``execute_async_v3`` on its own
stream with device pointers: one eager run, one captured, then ``iters`` graph replays, each timed with
CUDA events (median reported). Every budget's output is compared bit for bit with the fully resident
run. Prints a table and writes JSON (figures, device, versions) to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20


def mlp_model(layers: int, dim: int, seed: int = 0) -> bytes:
    """The ONNX bytes of x[B, dim] fp16 -> (MatMul W_i -> Relu) x layers -> y."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes, inits, prev = [], [], "x"
    for i in range(layers):
        weight = (rng.standard_normal((dim, dim), np.float32) / np.sqrt(dim)).astype(np.float16)
        inits.append(numpy_helper.from_array(weight, f"W{i}"))
        out = "y" if i == layers - 1 else f"r{i}"
        nodes += [helper.make_node("MatMul", [prev, f"W{i}"], [f"m{i}"], name=f"fc{i}"),
                  helper.make_node("Relu", [f"m{i}"], [out], name=f"relu{i}")]
        prev = out
    graph = helper.make_graph(nodes, "streaming_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["B", dim])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["B", dim])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def build_engine(model: bytes, dim: int, batch: int) -> Any:
    import engine_core as kiln
    from engine_core.types import BuilderFlag

    builder = kiln.Builder()
    network = builder.create_network()
    if not kiln.OnnxParser(network).parse(model):
        raise SystemExit("the benchmark model did not parse")
    config = builder.create_builder_config()
    config.backend = "cuda"
    config.set_flag(BuilderFlag.WEIGHT_STREAMING)
    profile = builder.create_optimization_profile()
    profile.set_shape("x", (1, dim), (batch, dim), (batch, dim))
    config.add_optimization_profile(profile)
    return kiln.Runtime().load(kiln.build_plan(network, config))


def measure(engine: Any, budget: int, x: np.ndarray, iters: int) -> tuple[dict[str, Any], np.ndarray]:
    """One budget: a fresh context, eager + captured runs, then ``iters`` timed replays."""
    from engine_core.cuda.driver import DeviceBuffer, EventTimer, Stream

    engine.weight_streaming_budget_v2 = budget
    plan = engine.weight_streaming_plan
    started = time.perf_counter()
    context = engine.create_execution_context()
    placed_s = time.perf_counter() - started
    owned_stream = Stream(non_blocking=True)
    stream = owned_stream.handle
    dx, dy = DeviceBuffer.from_array(x), DeviceBuffer(x.nbytes)
    context.set_input_shape("x", x.shape)
    context.set_tensor_address("x", dx.ptr)
    context.set_tensor_address("y", dy.ptr)
    timer = EventTimer(stream)
    for _ in range(2):  # eager, then captured into a CUDA graph (uploads included)
        assert context.execute_async_v3(stream)
    owned_stream.synchronize()
    times = []
    for _ in range(iters):
        timer.start()
        assert context.execute_async_v3(stream)
        times.append(timer.stop())
    out = dy.to_array(x.dtype, x.shape)
    ms = statistics.median(times)
    streamed = plan.streamed_bytes_per_run
    row = {"budget_bytes": budget, "resident_bytes": plan.resident_bytes, "streamed_bytes_per_run": streamed,
           "scratch_bytes": plan.scratch_bytes, "median_ms": ms, "min_ms": min(times),
           "inferences_per_s": x.shape[0] * 1000.0 / ms, "upload_gb_per_s": streamed / ms / 1e6 if streamed else None,
           "context_setup_s": placed_s, "replayed": any(b.graphs for b in context._backend_context._bindings.values())}
    del timer, owned_stream, context
    gc.collect()
    return row, out


def device_info() -> dict[str, Any]:
    from engine_core.cuda.driver import device_name, memory_info

    free, total = memory_info()
    return {"name": device_name(), "free_bytes": free, "total_bytes": total}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--fractions", default="1,0.75,0.5,0.25,0",
                        help="budgets as fractions of the streamable weight size (1 = no streaming)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args(argv)

    import engine_core as kiln

    began = time.perf_counter()
    engine = build_engine(mlp_model(args.layers, args.dim), args.dim, args.batch)
    build_s = time.perf_counter() - began
    total = engine.streamable_weights_size
    x = (np.random.default_rng(1).standard_normal((args.batch, args.dim), np.float32)).astype(np.float16)
    budgets = [("resident" if f >= 1 else f"{f:g} x weights", int(total * f)) for f in map(float, args.fractions.split(","))]
    budgets.append(("automatic", engine.get_weight_streaming_automatic_budget()))
    resident_row, want = measure(engine, total, x, args.iters)
    rows = []
    for label, budget in budgets:
        row, out = (resident_row, want) if budget >= total and label == "resident" else measure(engine, budget, x, args.iters)
        row.update(label=label, matches_resident=bool(np.array_equal(out, want)))
        rows.append(row)

    header = (f"{'budget':>16} {'resident MiB':>12} {'streamed MiB/run':>16} {'scratch MiB':>11} {'median ms':>10} "
              f"{'infer/s':>10} {'upload GB/s':>11} {'== resident':>11}")
    print(f"weight streaming: {args.layers} x {args.dim}x{args.dim} fp16 ({total / MIB:.0f} MiB), batch {args.batch}, "
          f"{args.iters} replays per budget (build {build_s:.1f} s)")
    print(header)
    for r in rows:
        gbps = f"{r['upload_gb_per_s']:.1f}" if r["upload_gb_per_s"] else "-"
        print(f"{r['label']:>16} {r['resident_bytes'] / MIB:>12.0f} {r['streamed_bytes_per_run'] / MIB:>16.0f} "
              f"{r['scratch_bytes'] / MIB:>11.0f} {r['median_ms']:>10.3f} {r['inferences_per_s']:>10.0f} {gbps:>11} "
              f"{str(r['matches_resident']):>11}")
    doc = {"benchmark": "weight_streaming", "layers": args.layers, "dim": args.dim, "dtype": "float16",
           "batch": args.batch, "iters": args.iters, "streamable_bytes": total, "build_s": build_s, "results": rows,
           "device": device_info(), "kiln_version": kiln.__version__, "python": platform.python_version(),
           "numpy": np.__version__}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"weight_streaming_{time.strftime('%Y%m%dT%H%M%S')}.json"
    path.write_text(json.dumps(doc, indent=2))
    print(f"wrote {path}")
    return 0 if all(r["matches_resident"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
