"""Kiln CUDA engine vs torch eager, same ONNX weights, same process, on the device.

    python -m bench.engine [--models mlp,bert_small,bert_base] [--batches 1,8] [--out bench/results]

Torch eager runs the same ONNX graph node by node with torch ops (``TorchGraph``), so both sides
use identical weights and math. Kiln runs ``execute_async_v3`` on its own stream with device
pointers from torch tensors. Times are CUDA-event medians in milliseconds, Kiln
with CUDA graph replay ("kiln ms") and with layer-by-layer launches ("no-graph"). Prints a table and writes
JSON (figures + device + versions) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))


# -- models -----------------------------------------------------------------------------------------


def make_model(name: str) -> tuple[onnx.ModelProto, str]:
    """(model, kind): kind "bert" models take ids/mask/types, "mlp" models take x."""
    from make_models import bert

    from tests.cuda.models import mlp

    if name == "mlp":
        return mlp(din=1024, hidden=4096, dout=1024), "mlp"
    if name == "bert_small":
        return bert(layers=2, hidden=64, heads=4, ffn=128, vocab=1000, max_positions=128), "bert"
    if name == "bert_base":
        return bert(layers=12, hidden=768, heads=12, ffn=3072, vocab=30522, max_positions=512), "bert"
    raise ValueError(f"unknown model {name}")


def make_feeds(kind: str, batch: int, seq: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    if kind == "mlp":
        return {"x": rng.standard_normal((batch, 1024)).astype(np.float32)}
    ids = rng.integers(0, 1000, (batch, seq)).astype(np.int64)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}


# -- torch eager over the same graph ----------------------------------------------------------------


class TorchGraph:
    """The ONNX graph evaluated node by node with torch ops on the GPU (eager mode)."""

    def __init__(self, model: onnx.ModelProto) -> None:
        import torch

        self.torch = torch
        self.graph = model.graph
        self.consts = {t.name: torch.from_numpy(numpy_helper.to_array(t).copy()).cuda() for t in model.graph.initializer}
        for node in model.graph.node:
            if node.op_type == "Constant":
                self.consts[node.output[0]] = torch.from_numpy(
                    numpy_helper.to_array(node.attribute[0].t).copy()).cuda()

    def __call__(self, feeds: dict) -> list:
        torch = self.torch
        env = dict(self.consts)
        env.update(feeds)
        for node in self.graph.node:
            if node.op_type == "Constant":
                continue
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            args = [env[i] if i else None for i in node.input]
            env[node.output[0]] = self._op(torch, node.op_type, args, attrs)
        return [env[o.name] for o in self.graph.output]

    @staticmethod
    def _op(torch, op: str, x: list, attrs: dict):
        simple = {"Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Div": torch.div, "MatMul": torch.matmul,
                  "Erf": torch.erf, "Tanh": torch.tanh, "Relu": torch.relu, "Sigmoid": torch.sigmoid,
                  "Pow": torch.pow, "Sqrt": torch.sqrt}
        if op in simple:
            return simple[op](*x)
        if op == "Identity":
            return x[0]
        if op == "Gather":
            axis = attrs.get("axis", 0) % x[0].dim()
            picked = torch.index_select(x[0], axis, x[1].reshape(-1))
            return picked.reshape((*x[0].shape[:axis], *x[1].shape, *x[0].shape[axis + 1:]))
        if op == "LayerNormalization":
            return torch.nn.functional.layer_norm(x[0], x[0].shape[-1:], x[1], x[2], attrs.get("epsilon", 1e-5))
        if op == "Softmax":
            return torch.softmax(x[0], attrs.get("axis", -1))
        if op == "Transpose":
            return x[0].permute(*attrs["perm"])
        if op == "Reshape":
            shape = [int(s) if int(s) != 0 else x[0].shape[i] for i, s in enumerate(x[1].tolist())]
            return x[0].reshape(shape)
        if op == "Unsqueeze":
            out = x[0]
            for axis in sorted(int(a) for a in x[1].tolist()):
                out = out.unsqueeze(axis)
            return out
        if op == "Squeeze":
            return x[0].reshape([d for i, d in enumerate(x[0].shape) if i not in x[1].tolist()])
        if op == "Shape":
            return torch.tensor(list(x[0].shape), dtype=torch.int64, device=x[0].device)
        if op == "Range":
            return torch.arange(int(x[0]), int(x[1]), int(x[2]), device=x[0].device)
        if op == "Cast":
            return x[0].to(torch.float32)
        if op == "Gemm":
            a = x[0].t() if attrs.get("transA") else x[0]
            b = x[1].t() if attrs.get("transB") else x[1]
            return torch.addmm(x[2], a, b) if len(x) > 2 else a @ b
        raise NotImplementedError(op)


# -- timing -----------------------------------------------------------------------------------------


def cuda_time(fn, stream, warmup: int = 5, iters: int = 30) -> float:
    """Median milliseconds of ``fn()`` measured with events on ``stream`` (a torch stream)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        fn()
        stop.record(stream)
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def _count(items) -> dict[str, int]:
    counts: dict[str, int] = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return counts


def profile_by_op(engine, ctx, stream: int) -> dict[str, float]:
    """One profiled run (CUDA events per layer), summed by op type, largest first."""
    import engine_core as kiln

    class ByOp(kiln.IProfiler):
        def __init__(self) -> None:
            self.types = {layer["name"]: layer["type"] for layer in engine.plan.layers}
            self.ms: dict[str, float] = {}

        def report_layer_time(self, layer_name: str, ms: float) -> None:
            op = self.types.get(layer_name, "?")
            self.ms[op] = self.ms.get(op, 0.0) + ms

    ctx.profiler = ByOp()
    ctx.execute_async_v3(stream)
    result = dict(sorted(((k, round(v, 4)) for k, v in ctx.profiler.ms.items()), key=lambda kv: -kv[1]))
    ctx.profiler = None
    return result


def bench_one(name: str, batches: list[int], seq: int, profile: bool = False) -> list[dict]:
    import torch

    import engine_core as kiln

    model, kind = make_model(name)
    builder = kiln.Builder()
    net = builder.create_network()
    kiln.OnnxParser(net).parse(model)
    cfg = builder.create_builder_config()
    prof = builder.create_optimization_profile()
    hi = max(batches)
    opt = batches[len(batches) // 2]
    if kind == "mlp":
        prof.set_shape("x", (1, 1024), (opt, 1024), (hi, 1024))
    else:
        for n in ("input_ids", "attention_mask", "token_type_ids"):
            prof.set_shape(n, (1, 1), (opt, seq), (hi, seq))
    cfg.add_optimization_profile(prof)
    started = time.perf_counter()
    plan_bytes = kiln.build_plan(net, cfg)
    build_s = time.perf_counter() - started
    engine = kiln.Runtime().load(plan_bytes)
    ctx = engine.create_execution_context()
    eager = TorchGraph(model)
    stream = torch.cuda.Stream()
    rows = []
    for batch in batches:
        feeds = make_feeds(kind, batch, seq)
        tin = {k: torch.from_numpy(v).cuda() for k, v in feeds.items()}
        outs = {}
        for k, v in tin.items():
            ctx.set_input_shape(k, tuple(v.shape))
            ctx.set_tensor_address(k, v.data_ptr())
        for t in engine.plan.io:
            if t.mode.name == "OUTPUT":
                outs[t.name] = torch.empty(ctx.get_tensor_shape(t.name), dtype=torch.float32, device="cuda")
                ctx.set_tensor_address(t.name, outs[t.name].data_ptr())
        handle = stream.cuda_stream
        ctx._cuda.use_graphs = False  # layer-by-layer launches first, then with CUDA graph replay
        eager_launch_ms = cuda_time(lambda h=handle: ctx.execute_async_v3(h), stream)
        ctx._cuda.use_graphs = True
        kiln_ms = cuda_time(lambda h=handle: ctx.execute_async_v3(h), stream)
        with torch.cuda.stream(stream), torch.no_grad():
            torch_ms = cuda_time(lambda t=tin: eager(t), stream)
            ref = eager(tin)
        torch.cuda.synchronize()
        breakdown = profile_by_op(engine, ctx, handle) if profile else {}
        err = max(float((outs[o.name] - r).abs().max()) for o, r in zip(model.graph.output, ref))
        rows.append({"model": name, "batch": batch, "seq": seq if kind == "bert" else None,
                     "kiln_cuda_ms": round(kiln_ms, 4), "kiln_cuda_no_graph_ms": round(eager_launch_ms, 4),
                     "torch_eager_ms": round(torch_ms, 4),
                     "speedup_vs_eager": round(torch_ms / kiln_ms, 3), "max_abs_diff": err,
                     "build_s": round(build_s, 2), "device_memory_size": engine.device_memory_size,
                     "activation_bytes_unshared": engine.plan.build_info["cuda"]["activation_bytes_unshared"],
                     "host_layers": engine.plan.build_info["cuda"]["host_layers"],
                     "gemm_tactics": _count(layer["tactic"] for layer in engine.plan.layers
                                            if layer["tactic"].startswith("gemm:")),
                     "ms_by_op_type": breakdown})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mlp,bert_small,bert_base")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--profile", action="store_true", help="add per-op-type layer times (one profiled run)")
    args = parser.parse_args(argv)
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 on both sides (Kiln v0 is pure fp32)
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for name in args.models.split(","):
        rows += bench_one(name, batches, args.seq, args.profile)
    header = (f"{'model':<11}{'batch':>6}{'seq':>5}{'kiln ms':>10}{'no-graph':>10}{'eager ms':>10}{'x eager':>9}"
              f"{'max|d|':>10}{'build s':>9}")
    print(header)
    for r in rows:
        print(f"{r['model']:<11}{r['batch']:>6}{str(r['seq'] or '-'):>5}{r['kiln_cuda_ms']:>10.3f}"
              f"{r['kiln_cuda_no_graph_ms']:>10.3f}"
              f"{r['torch_eager_ms']:>10.3f}{r['speedup_vs_eager']:>9.2f}{r['max_abs_diff']:>10.2e}{r['build_s']:>9.2f}")
    for r in rows:
        if r["ms_by_op_type"]:
            top = ", ".join(f"{k} {v:.3f}" for k, v in list(r["ms_by_op_type"].items())[:6])
            print(f"profile {r['model']} b{r['batch']}: {top}; gemm tactics {r['gemm_tactics']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"engine_{time.strftime('%Y%m%dT%H%M%S')}.json"
    path.write_text(json.dumps({"command": "python3 -m bench.engine " + " ".join(sys.argv[1:] if argv is None else argv),
                                "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                "python": platform.python_version(), "tf32": False, "rows": rows}, indent=2))
    print(f"wrote {path}")
    return 0 if all(math.isfinite(r["max_abs_diff"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
