"""The `kiln` command: a thin layer over the public Python API (every feature is scriptable too).

    kiln build model.onnx -o model.plan [--fp16] [--no-tf32] [--int8 --calib-data DIR [--calib-cache FILE] [--quant-report]] [--refit] [--profiling-verbosity detailed] [--dump-layer-info]
               [--hardware-compatibility-level ampere_plus] [--version-compatible] [--weight-streaming]
               [--shapes x:1x3x224x224] [--min-shapes/--opt-shapes/--max-shapes ...]
    kiln run model.plan [--input x=x.npy] [--iterations 10] [--profile] [--save-outputs DIR]
             [--weight-streaming-budget BYTES|auto]
    kiln inspect model.plan [--json]     # also what the plan needs: backend, arch, compat level, Kiln versions
    kiln conformance [--backend cpu] [--op Conv] [-v] [--markdown docs/conformance.md]

`kiln serve` and `kiln perf` belong to the server and the load tests, which build on the engine: the `kiln`
console script (kiln_cli.py) hands them to ``main`` as extra commands, so the engine never imports them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import engine_core as kiln
from engine_core.compat import check_plan_compatibility, device_arch
from engine_core.errors import KilnError
from engine_core.inspector import add_build_arguments, apply_build_arguments, engine_summary
from engine_core.plan import deserialize_plan
from engine_core.runtime import LayerTimes

PRECISION_FLAGS = {
    "fp16": kiln.BuilderFlag.FP16,
    "bf16": kiln.BuilderFlag.BF16,
    "tf32": kiln.BuilderFlag.TF32,
    "int8": kiln.BuilderFlag.INT8,
    "fp8": kiln.BuilderFlag.FP8,
}


def parse_shape_specs(specs: Sequence[str] | None) -> dict[str, tuple[int, ...]]:
    """Parse trtexec-style shape specs: ``name:1x3x224x224`` (comma-separated or repeated)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for spec in specs or ():
        for item in spec.split(","):
            name, sep, dims = item.rpartition(":")
            if not sep or not name:
                raise ValueError(f"bad shape spec '{item}': expected name:DIMS, e.g. x:1x3x224x224")
            try:
                shapes[name] = tuple(int(d) for d in dims.split("x")) if dims else ()
            except ValueError:
                raise ValueError(f"bad shape spec '{item}': dims must be integers joined by 'x'") from None
    return shapes


def profile_shapes(args: argparse.Namespace) -> dict[str, tuple[tuple[int, ...], ...]]:
    """min/opt/max per input from --shapes (all three) and --min/--opt/--max-shapes."""
    fixed = parse_shape_specs(args.shapes)
    mins, opts, maxs = (parse_shape_specs(getattr(args, k)) for k in ("min_shapes", "opt_shapes", "max_shapes"))
    result = {name: (s, s, s) for name, s in fixed.items()}
    for name in set(mins) | set(opts) | set(maxs):
        if not (name in mins and name in maxs):
            raise ValueError(f"input '{name}': give both --min-shapes and --max-shapes (and optionally --opt-shapes)")
        lo, hi = mins[name], maxs[name]
        result[name] = (lo, opts.get(name, hi), hi)
    return result


class ConsoleProgress:
    """Build progress on stderr: one line per phase, with a step counter."""

    def __init__(self, stream=sys.stderr) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.steps: dict[str, int] = {}
        self.started: dict[str, float] = {}

    def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
        self.steps[phase_name] = num_steps
        self.started[phase_name] = time.perf_counter()

    def step_complete(self, phase_name: str, step: int) -> bool:
        if self.tty:
            print(f"\r  {phase_name}: {step + 1}/{self.steps[phase_name]}", end="", file=self.stream, flush=True)
        return True

    def phase_finish(self, phase_name: str) -> None:
        ms = (time.perf_counter() - self.started[phase_name]) * 1e3
        print(f"\r  {phase_name}: done ({ms:.0f} ms)" + " " * 10, file=self.stream)


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*map(str, r)) for r in rows]
    return "\n".join(lines)


def layer_table(summary: dict) -> str:
    rows = [[str(i), layer["name"], layer["type"], layer["tactic"], ",".join(layer["origin"])]
            for i, layer in enumerate(summary["layers"])]
    return _table(rows, ["#", "layer", "type", "tactic", "onnx nodes"])


def io_table(summary: dict) -> str:
    rows = [[t["mode"].lower(), t["name"], t["dtype"], str(t["shape"]), t.get("format", "LINEAR")]
            for t in summary["io"]]
    return _table(rows, ["mode", "tensor", "dtype", "shape", "format"])


def host_layers(summary: dict) -> list[dict]:
    """The layers of a CUDA plan that run on the host (numpy, with copies each way): the slow path a build must
    name, never take silently. A CPU plan has none by definition."""
    if summary["backend"] != "cuda":
        return []
    return [layer for layer in summary["layers"] if layer["tactic"] == "host"]


def host_layers_line(summary: dict) -> str | None:
    """One line naming every host layer of a CUDA plan (and, for a host tail, where and why the plan is cut)."""
    host = host_layers(summary)
    if not host:
        return None
    names = ", ".join(f"{layer['name']} ({layer['type']})" for layer in host)
    line = f"{len(host)} of {len(summary['layers'])} layers run on the host: {names}"
    tail = (summary.get("build_info") or {}).get("cuda", {}).get("host_tail")
    return f"{line}; they run after the device part: {tail['reason']}" if tail else line


def dump_layer_info(plan: bytes) -> str:
    """What `kiln build --dump-layer-info` prints: the inspector's JSON engine information."""
    engine = kiln.Runtime().load(plan)
    return engine.create_engine_inspector().get_engine_information(kiln.LayerInformationFormat.JSON)


# -- commands -------------------------------------------------------------------------------------


def cmd_build(args: argparse.Namespace) -> int:
    logger = kiln.Logger(kiln.Severity.VERBOSE if args.verbose else kiln.Severity.WARNING)
    builder = kiln.Builder(logger)
    network = builder.create_network()
    parser = kiln.OnnxParser(network, logger)
    if not parser.parse_from_file(args.model):
        for error in parser.errors:
            print(f"error: {error}", file=sys.stderr)
        return 1
    config = builder.create_builder_config()
    if args.backend:
        config.backend = args.backend
    for name, flag in PRECISION_FLAGS.items():
        if getattr(args, name):
            config.set_flag(flag)
    if args.tf32 is False:
        config.clear_flag(kiln.BuilderFlag.TF32)
    if args.workspace is not None:
        config.set_memory_pool_limit(kiln.MemoryPoolType.WORKSPACE, int(args.workspace * (1 << 20)))
    apply_build_arguments(config, args)  # --profiling-verbosity, --refit
    try:
        calibrator = _int8_calibrator(args, network)
    except (ValueError, KilnError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if calibrator is not None:
        config.int8_calibrator = calibrator
    try:
        shapes = profile_shapes(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if shapes:
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in shapes.items():
            try:
                profile.set_shape(name, lo, opt, hi)
            except ValueError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
        config.add_optimization_profile(profile)
    config.progress_monitor = ConsoleProgress()
    print(f"Building {args.model} for the {config.backend} backend", file=sys.stderr)
    started = time.perf_counter()
    try:
        plan = kiln.build_plan(network, config, logger)
    except KilnError as e:
        print(f"error: build failed: {e}", file=sys.stderr)
        if "dynamic shapes" in str(e):
            print("hint: pass --shapes NAME:DIMS, or --min-shapes/--opt-shapes/--max-shapes", file=sys.stderr)
        return 1
    summary = engine_summary(deserialize_plan(plan))
    host_line = host_layers_line(summary)
    if host_line and args.strict:
        print(f"error: --strict: {host_line}; no plan written", file=sys.stderr)
        return 1
    output = args.output or os.path.splitext(args.model)[0] + ".plan"
    with open(output, "wb") as f:
        f.write(plan)
    if args.dump_layer_info:
        print(dump_layer_info(plan))
    print(layer_table(summary))
    print()
    print(io_table(summary))
    if host_line:
        print(f"\nwarning: {host_line}", file=sys.stderr)
    print(f"\nwrote {output}: {len(plan)} bytes, {len(summary['layers'])} layers, "
          f"activation memory {summary['device_memory_size']} bytes, built in {time.perf_counter() - started:.2f} s")
    if args.quant_report:
        return _print_quant_report(network, config, calibrator, plan, logger)
    return 0


def _int8_calibrator(args: argparse.Namespace, network: kiln.NetworkDefinition):
    """The calibrator --calib-data/--calib-cache/--calibrator ask for (None: no calibration flags)."""
    from engine_core.calibration import load_calibration_data, make_calibrator

    if not (args.calib_data or args.calib_cache):
        if args.quant_report and args.int8:
            raise ValueError("--quant-report needs --calib-data DIR (it measures errors on the first batch)")
        return None
    if not args.int8:
        raise ValueError("--calib-data/--calib-cache calibrate for INT8: add --int8")
    if args.quant_report and not args.calib_data:
        raise ValueError("--quant-report needs --calib-data DIR (it measures errors on the first batch)")
    names = [v.name for v in network.graph.inputs if v.is_tensor]
    batches = load_calibration_data(args.calib_data, names) if args.calib_data else []
    if not batches and not os.path.exists(args.calib_cache):
        raise ValueError(f"calibration cache '{args.calib_cache}' does not exist: give --calib-data DIR to create it")
    return make_calibrator(batches, args.calibrator, args.calib_cache, args.percentile)


def _print_quant_report(network: kiln.NetworkDefinition, config, calibrator, plan: bytes, logger) -> int:
    """Per-layer INT8 error on the first calibration batch, and the whole plan vs a float32 build."""
    from engine_core.calibration import parse_cache, quantization_report
    from engine_core.passes.quantize_implicit import has_qdq

    if calibrator is None:
        print("error: --quant-report needs --int8 and --calib-data DIR", file=sys.stderr)
        return 2
    feeds = calibrator.batches[0]
    ranges = None if has_qdq(network.graph) else parse_cache(calibrator.cache_bytes or b"")
    rows = quantization_report(network.graph, feeds, ranges)
    print(f"\nINT8 quantization error per layer (first calibration batch, vs float32; {len(rows)} layers)")
    print(_table([[r.layer, r.op_type, f"{r.max_abs_error:.4g}", f"{r.mean_abs_error:.4g}",
                   f"{100 * r.relative_error:.2f}%"] for r in rows],
                 ["layer", "type", "max abs err", "mean abs err", "max rel err"]))
    config.clear_flag(kiln.BuilderFlag.INT8)
    try:
        reference = kiln.build_plan(network, config, logger) if ranges is not None else None
    except KilnError as e:
        print(f"error: float32 reference build failed: {e}", file=sys.stderr)
        return 1
    if reference is not None:
        int8_out = kiln.Runtime().load(plan).create_execution_context().infer(feeds)
        fp32_out = kiln.Runtime().load(reference).create_execution_context().infer(feeds)
        for name, ref in fp32_out.items():
            if ref.dtype.kind != "f":
                continue
            diff = np.abs(int8_out[name].astype(np.float64) - ref)
            agree = (f", top-1 agreement {np.mean(int8_out[name].argmax(-1) == ref.argmax(-1)) * 100:.1f}%"
                     if ref.ndim == 2 else "")
            print(f"output '{name}': INT8 plan vs float32 plan max abs err {diff.max():.4g}, "
                  f"mean abs err {diff.mean():.4g}{agree}")
    return 0


def _load_engine(path: str) -> kiln.CudaEngine:
    with open(path, "rb") as f:
        return kiln.Runtime().load(f.read())


def _random_input(engine: kiln.CudaEngine, name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    dtype = np.dtype(kiln.nptype(engine.get_tensor_dtype(name)))
    if dtype.kind == "f" or dtype.kind == "V":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(dtype)
    if dtype.kind in "iu":
        return rng.integers(0, 10, shape).astype(dtype)
    raise ValueError(f"cannot make random data for input '{name}' of dtype {dtype}: pass --input {name}=FILE.npy")


def cmd_run(args: argparse.Namespace) -> int:
    try:
        engine = _load_engine(args.plan)
    except (OSError, KilnError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.weight_streaming_budget is not None:
        try:
            spec = args.weight_streaming_budget
            engine.weight_streaming_budget_v2 = (engine.get_weight_streaming_automatic_budget() if spec == "auto"
                                                 else int(spec))
        except ValueError as e:
            print(f"error: --weight-streaming-budget: {e}", file=sys.stderr)
            return 2
        print(f"weight streaming: budget {engine.weight_streaming_budget_v2} of {engine.streamable_weights_size} "
              f"bytes resident, scratch {engine.weight_streaming_scratch_memory_size} bytes", file=sys.stderr)
    context = engine.create_execution_context()
    shapes = parse_shape_specs(args.shapes)
    rng = np.random.default_rng(args.seed)
    feeds: dict[str, np.ndarray] = {}
    for spec in args.input or ():
        name, sep, path = spec.partition("=")
        if not sep:
            print(f"error: bad --input '{spec}': expected NAME=FILE.npy", file=sys.stderr)
            return 2
        feeds[name] = np.load(path, allow_pickle=False)
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        if engine.get_tensor_mode(name) != kiln.TensorIOMode.INPUT or name in feeds:
            continue
        shape = shapes.get(name) or engine.get_tensor_profile_shape(name, 0)[1]
        feeds[name] = _random_input(engine, name, tuple(shape), rng)

    profiler = LayerTimes() if args.profile else None
    context.profiler = profiler
    timings = []
    try:
        for _ in range(max(1, args.iterations)):
            start = time.perf_counter()
            outputs = context.infer(feeds)
            timings.append((time.perf_counter() - start) * 1e3)
    except (KilnError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for name, value in outputs.items():
        preview = np.array2string(np.asarray(value).reshape(-1)[:8], precision=5, separator=", ")
        print(f"{name}: dtype={value.dtype} shape={list(value.shape)} first={preview}")
        if args.save_outputs:
            os.makedirs(args.save_outputs, exist_ok=True)
            np.save(os.path.join(args.save_outputs, f"{name}.npy"), value)
    t = np.array(timings)
    print(f"latency over {len(t)} runs: mean {t.mean():.3f} ms, median {np.median(t):.3f} ms, min {t.min():.3f} ms")
    if profiler is not None:
        rows = sorted(((n, float(np.mean(v))) for n, v in profiler.times.items()), key=lambda r: -r[1])
        total = sum(ms for _, ms in rows) or 1.0
        print(_table([[n, f"{ms:.3f}", f"{100 * ms / total:.1f}%"] for n, ms in rows], ["layer", "mean ms", "share"]))
    return 0


def _plan_meta(summary: dict) -> dict:
    """What `check_plan_compatibility` reads of a plan, from its summary."""
    return {k: summary[k] for k in ("engine_version", "backend", "arch", "build_info")}


def runs_here(summary: dict) -> str | None:
    """Why this Kiln on this machine would refuse the plan (None: it would run it)."""
    if summary["backend"] not in ("cpu", "cuda"):
        return f"plan was built for the '{summary['backend']}' backend, which this machine lacks"
    return check_plan_compatibility(_plan_meta(summary), device_arch() if summary["backend"] == "cuda" else None,
                                    kiln.__version__)


def devices_here(summary: dict) -> list[dict]:
    """Each GPU this process sees (CUDA_VISIBLE_DEVICES applies) and whether a CUDA plan can be placed on it: what
    a server's instance_group gpus may list for it. Empty for CPU plans and machines without a GPU."""
    if summary["backend"] != "cuda" or "cuda" not in kiln.available_backends():
        return []
    from engine_core.cuda import device_count
    from engine_core.cuda.driver import device_name

    found = []
    for ordinal in range(device_count()):
        arch = device_arch(ordinal)
        refusal = check_plan_compatibility(_plan_meta(summary), arch, kiln.__version__)
        found.append({"gpu": ordinal, "name": device_name(ordinal), "arch": arch, "ok": refusal is None,
                      "reason": refusal})
    return found


def cmd_inspect(args: argparse.Namespace) -> int:
    try:
        with open(args.plan, "rb") as f:
            plan = deserialize_plan(f.read(), check_version=False)  # show what a plan from another version needs
    except (OSError, KilnError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    summary = engine_summary(plan)
    refusal = runs_here(summary)
    summary["runs_here"] = {"ok": refusal is None, "reason": refusal}
    summary["gpus_here"] = devices_here(summary)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    needs = summary["requirements"]
    print(f"plan '{summary['name']}': Kiln {summary['engine_version']}, backend {summary['backend']}, "
          f"arch {summary['arch']}, activation memory {summary['device_memory_size']} bytes")
    if "error" in needs:
        print(f"needs: unreadable compatibility record: {needs['error']}")
    else:
        print(f"needs: Kiln {needs['kiln_versions']} (version_compatible={needs['version_compatible']}); "
              f"{needs['devices']}; hardware compatibility level {needs['hardware_compatibility_level']}")
    print(f"runs here (Kiln {kiln.__version__}): " + ("yes" if refusal is None else f"no: {refusal}"))
    for gpu in summary["gpus_here"]:  # where a server may place its instances (instance_group gpus)
        print(f"GPU {gpu['gpu']} ({gpu['name']}, {gpu['arch']}): " + ("can run it" if gpu["ok"] else
                                                                     f"cannot: {gpu['reason']}"))
    print(io_table(summary))
    for index, profile in enumerate(summary["profiles"]):
        for name, s in profile.items():
            print(f"profile {index}: {name} min {s['min']} opt {s['opt']} max {s['max']}")
    print()
    print(layer_table(summary))
    host_line = host_layers_line(summary)
    if host_line:
        print(f"\n{host_line}")
    return 0


def cmd_conformance(args: argparse.Namespace) -> int:
    from engine_core.conformance import run_from_args

    return run_from_args(args)


def _add_shape_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", action="append", help="fixed input shapes, e.g. x:1x3x224x224 (min=opt=max)")
    p.add_argument("--min-shapes", action="append", help="profile minimum shapes, e.g. x:1x3x224x224")
    p.add_argument("--opt-shapes", action="append", help="profile optimum shapes")
    p.add_argument("--max-shapes", action="append", help="profile maximum shapes")


def make_parser(commands: Sequence[Callable[[Any], None]] = ()) -> argparse.ArgumentParser:
    """The `kiln` parser: build, run, inspect, then ``commands`` (each adds its subparsers to the one it is given,
    with ``func`` as the default that runs it), then conformance."""
    ap = argparse.ArgumentParser(prog="kiln", description="Kiln inference engine and server")
    ap.add_argument("--version", action="version", version=f"kiln {kiln.__version__}")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("build", help="build an ONNX model into a plan file")
    p.add_argument("model", help="path to model.onnx")
    p.add_argument("-o", "--output", help="plan file to write (default: model name + .plan)")
    p.add_argument("--backend", choices=["cpu", "cuda"], help="default: cuda when a GPU is present, else cpu")
    for name in PRECISION_FLAGS:
        if name == "tf32":  # set by default, as in the reference: --no-tf32 asks for strict fp32 math
            p.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=None,
                           help="allow TF32 tensor cores for fp32 math (the default; --no-tf32: strict fp32)")
        else:
            p.add_argument(f"--{name}", action="store_true", help=f"allow {name.upper()} precision")
    p.add_argument("--workspace", type=float, help="workspace memory limit in MiB")
    p.add_argument("--calib-data", metavar="DIR", help="INT8 calibration batches: .npz files (keys = input "
                   "names), NAME.npy / NAME_<k>.npy, or any .npy for a one-input model (needs --int8)")
    p.add_argument("--calib-cache", metavar="FILE", help="calibration cache: read when it exists (no calibration "
                   "run), else written after calibrating")
    p.add_argument("--calibrator", choices=["entropy", "minmax", "percentile"], default="entropy",
                   help="how ranges come from activation statistics (default: entropy, as IInt8EntropyCalibrator2)")
    p.add_argument("--percentile", type=float, help="percentile of |x| for --calibrator percentile (default 99.99)")
    p.add_argument("--quant-report", action="store_true", help="print per-layer INT8 error vs float32 on the "
                   "first calibration batch")
    p.add_argument("--strict", action="store_true", help="fail (no plan written) when a layer of a CUDA build would "
                   "run on the host")
    p.add_argument("-v", "--verbose", action="store_true")
    add_build_arguments(p)
    _add_shape_args(p)
    p.set_defaults(func=cmd_build)

    p = sub.add_parser("run", help="run a plan on given or random inputs")
    p.add_argument("plan")
    p.add_argument("--input", action="append", help="NAME=FILE.npy (others get random data)")
    p.add_argument("--shapes", action="append", help="shapes for random inputs, e.g. x:4x3x224x224 (default: opt)")
    p.add_argument("--iterations", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="print per-layer times")
    p.add_argument("--save-outputs", help="directory to save outputs as NAME.npy")
    p.add_argument("--weight-streaming-budget", help="bytes of weights kept on the device, or 'auto' "
                   "(plans built with --weight-streaming)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("inspect", help="describe a plan: I/O, profiles, layers")
    p.add_argument("plan")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_inspect)

    for add_command in commands:  # e.g. `serve` and `perf` (kiln_cli.py)
        add_command(sub)

    p = sub.add_parser("conformance", help="run onnx's node test cases and report pass rates")
    from engine_core.conformance import add_arguments

    add_arguments(p)
    p.set_defaults(func=cmd_conformance)
    return ap


def main(argv: list[str] | None = None, commands: Sequence[Callable[[Any], None]] = ()) -> int:
    """Run the command ``argv`` names; ``commands`` add commands from outside the engine (see make_parser)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = make_parser(commands).parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
