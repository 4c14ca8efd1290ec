"""ONNX node conformance: run onnx's own node test cases through Kiln and report pass rates.

``kiln conformance [--backend cpu] [--op Conv] [--case test_conv_] [-v] [--markdown docs/conformance.md]``

Each case is imported, built (a profile fixed at the test data's shapes), run, and compared with
the expected outputs using the case's own tolerances and exact dtypes, like onnx's backend runner.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

PASS, FAIL, UNSUPPORTED, ERROR = "pass", "fail", "unsupported", "error"


@dataclass
class CaseResult:
    name: str
    op: str
    status: str
    reason: str = ""
    seconds: float = 0.0


def collect_cases() -> list[Any]:
    """onnx's node test cases (1,884 in onnx 1.23), quietly: their generators warn a lot."""
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        return list(collect_testcases(None))


def case_op(case: Any, by_name: dict[str, Any]) -> str:
    """The operator a case tests: the op of its single node, or of its non-expanded twin."""
    name = case.name
    base = re.sub(r"_expanded(_ver\d+)?$", "", name)
    if base != name and base in by_name:
        case = by_name[base]
    nodes = case.model.graph.node
    return nodes[0].op_type if len(nodes) == 1 else (nodes[-1].op_type if nodes else "?")


def _compare(expected: Any, actual: Any, rtol: float, atol: float, path: str) -> str | None:
    """None if equal within tolerance (and of equal dtype), else a short reason."""
    if isinstance(expected, list):
        if not isinstance(actual, list) or len(actual) != len(expected):
            return f"{path}: expected a sequence of {len(expected)}, got {type(actual).__name__}"
        for i, (e, a) in enumerate(zip(expected, actual)):
            reason = _compare(e, a, rtol, atol, f"{path}[{i}]")
            if reason:
                return reason
        return None
    if expected is None:
        return None if actual is None else f"{path}: expected an empty optional"
    expected = np.asarray(expected)
    if actual is None:
        return f"{path}: missing"
    actual = np.asarray(actual)
    if expected.dtype != actual.dtype and not (expected.dtype.kind in "OSU" and actual.dtype.kind in "OSU"):
        return f"{path}: dtype {actual.dtype}, expected {expected.dtype}"
    if expected.shape != actual.shape:
        return f"{path}: shape {actual.shape}, expected {expected.shape}"
    if expected.dtype.kind in "OSU":
        if expected.tolist() != actual.tolist():
            return f"{path}: string values differ"
        return None
    try:
        e64 = expected.astype(np.float64) if expected.dtype.kind in "fcV" or expected.dtype.itemsize < 4 else expected
        a64 = actual.astype(np.float64) if actual.dtype.kind in "fcV" or actual.dtype.itemsize < 4 else actual
        np.testing.assert_allclose(a64, e64, rtol=rtol, atol=atol, equal_nan=True)
    except AssertionError as e:
        lines = [ln for ln in str(e).splitlines() if "Max absolute" in ln or "Mismatched" in ln]
        return f"{path}: values differ ({'; '.join(ln.strip() for ln in lines)})"
    except TypeError as e:
        return f"{path}: cannot compare: {e}"
    return None


def run_case(case: Any, backend: str = "cpu") -> CaseResult:
    """Import, build, run and check one test case."""
    from onnx import TensorProto, numpy_helper

    from engine_core import Builder, BuilderFlag, OnnxParser, Runtime
    from engine_core.errors import KilnError

    started = time.perf_counter()
    result = CaseResult(case.name, "", FAIL)

    def done(status: str, reason: str = "") -> CaseResult:
        result.status, result.reason = status, reason[:300]
        result.seconds = round(time.perf_counter() - started, 4)
        return result

    builder = Builder()
    network = builder.create_network()
    parser = OnnxParser(network)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if not parser.parse(case.model):
            reasons = "; ".join(str(e) for e in parser.errors)
            unsupported = all("unsupported operator" in e.desc for e in parser.errors)
            return done(UNSUPPORTED if unsupported else ERROR, reasons)
        graph_inputs = [v.name for v in network.graph.inputs]
        for inputs, expected in case.data_sets:
            # exotic dtypes (float8, int4, ...) are stored as TensorProto in the cases
            inputs = [numpy_helper.to_array(v) if isinstance(v, TensorProto) else v for v in inputs]
            expected = [numpy_helper.to_array(v) if isinstance(v, TensorProto) else v for v in expected]
            config = builder.create_builder_config()
            config.backend = backend
            config.clear_flag(BuilderFlag.TF32)  # the cases' expected outputs are fp32 math
            feeds = dict(zip(graph_inputs, inputs))
            profile = builder.create_optimization_profile()
            for name, value in feeds.items():
                if isinstance(value, np.ndarray):
                    profile.set_shape(name, value.shape, value.shape, value.shape)
            config.add_optimization_profile(profile)
            try:
                for v in network.graph.inputs:  # pin declared dims to the data so profiles validate
                    if v.name in feeds and isinstance(feeds[v.name], np.ndarray):
                        v.shape = tuple(feeds[v.name].shape)
                from engine_core.builder import build_plan

                plan = build_plan(network, config)
                context = Runtime().load(plan).create_execution_context()
                outputs = context.infer(feeds)
            except KilnError as e:
                return done(ERROR, f"{type(e).__name__}: {e}")
            except Exception as e:  # a crash is a finding, not a harness failure
                return done(ERROR, f"crash: {type(e).__name__}: {e}")
            output_names = [v.name for v in network.graph.outputs]
            for name, exp in zip(output_names, expected):
                reason = _compare(exp, outputs.get(name), case.rtol, case.atol, name)
                if reason:
                    return done(FAIL, reason)
    return done(PASS)


def run_cases(cases: Iterable[Any], backend: str = "cpu", progress: bool = False,
              trace: bool = False, checkpoint: str | None = None) -> list[CaseResult]:
    """Run ``cases``; with ``checkpoint`` the results so far are saved there (JSON) after every case, so
    a process that dies in native code keeps what it measured."""
    cases = list(cases)
    by_name = {c.name: c for c in cases}
    results = []
    for index, case in enumerate(cases):
        if trace:  # the last name printed names the case if the process dies (a crash in native code)
            print(f"case {case.name}", file=sys.stderr, flush=True)
        r = run_case(case, backend)
        r.op = case_op(case, by_name)
        results.append(r)
        if checkpoint:
            with open(checkpoint, "w") as f:
                json.dump({"summary": {}, "results": [asdict(x) for x in results]}, f)
        if progress and sys.stderr.isatty():
            print(f"\r[{index + 1}/{len(cases)}] {case.name[:60]:<60}", end="", file=sys.stderr)
    if progress and sys.stderr.isatty():
        print(file=sys.stderr)
    return results


def summarize(results: list[CaseResult]) -> dict[str, Any]:
    """Overall and per-op counts; 'supported' cases are those whose ops Kiln imports."""
    per_op: dict[str, dict[str, int]] = defaultdict(lambda: {PASS: 0, FAIL: 0, UNSUPPORTED: 0, ERROR: 0})
    for r in results:
        per_op[r.op][r.status] += 1
    total = len(results)
    passed = sum(r.status == PASS for r in results)
    supported = [r for r in results if r.status != UNSUPPORTED]
    return {
        "total": total,
        "passed": passed,
        "pass_rate": round(passed / total, 4) if total else 0.0,
        "supported_cases": len(supported),
        "supported_passed": passed,
        "supported_pass_rate": round(passed / len(supported), 4) if supported else 0.0,
        "per_op": dict(sorted(per_op.items())),
    }


def markdown_report(results: list[CaseResult], backend: str, path: str = "docs/conformance.md") -> str:
    s = summarize(results)
    lines = [
        f"# ONNX node conformance ({backend} backend)",
        "",
        f"Generated by `kiln conformance --backend {backend} --markdown {path}`.",
        "",
        f"- cases: {s['total']}, passed: {s['passed']} ({s['pass_rate']:.1%})",
        f"- cases of supported ops: {s['supported_cases']}, passed: {s['supported_passed']} "
        f"({s['supported_pass_rate']:.1%})",
        "",
        "| op | pass | fail | error | unsupported |",
        "|---|---:|---:|---:|---:|",
    ]
    for op, c in s["per_op"].items():
        lines.append(f"| {op} | {c[PASS]} | {c[FAIL]} | {c[ERROR]} | {c[UNSUPPORTED]} |")
    failing = [r for r in results if r.status in (FAIL, ERROR)]
    if failing:
        lines += ["", "## Failing cases", "", "| case | op | status | reason |", "|---|---|---|---|"]
        for r in failing:
            lines.append(f"| {r.name} | {r.op} | {r.status} | {r.reason.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kiln conformance", description=__doc__.splitlines()[0])
    add_arguments(ap)
    return run_from_args(ap.parse_args(argv))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--backend", default="cpu", help="backend to run the cases on (default: cpu)")
    ap.add_argument("--op", action="append", help="only cases of this op (repeatable)")
    ap.add_argument("--case", help="only cases whose name contains this text")
    ap.add_argument("-v", "--verbose", action="store_true", help="list every failing case with its reason")
    ap.add_argument("--markdown", help="write the per-op table to this markdown file")
    ap.add_argument("--json", help="write all results to this JSON file")
    ap.add_argument("--shard", help="run only shard K of N (K/N, 0-based): parallel runs, merged with --from-json")
    ap.add_argument("--trace", action="store_true", help="print each case's name before running it")
    ap.add_argument("--from-json", nargs="+", help="report on results saved by --json instead of running cases")


def _select(args: argparse.Namespace) -> list[CaseResult]:
    """Run the selected cases, or load results saved by earlier (sharded) runs."""
    if args.from_json:
        results = []
        for path in args.from_json:
            with open(path) as f:
                results += [CaseResult(**r) for r in json.load(f)["results"]]
        return results
    cases = collect_cases()
    by_name = {c.name: c for c in cases}
    if args.op:
        wanted = set(args.op)
        cases = [c for c in cases if case_op(c, by_name) in wanted]
    if args.case:
        cases = [c for c in cases if args.case in c.name]
    if args.shard:
        index, count = (int(part) for part in args.shard.split("/"))
        cases = cases[index::count]
    return run_cases(cases, args.backend, progress=True, trace=args.trace,
                     checkpoint=args.json if args.trace else None)


def run_from_args(args: argparse.Namespace) -> int:
    results = _select(args)
    s = summarize(results)
    if args.verbose:
        for r in results:
            if r.status != PASS:
                print(f"{r.status:<11} {r.name} [{r.op}]: {r.reason}")
    print(f"{'op':<32} {'pass':>5} {'fail':>5} {'error':>6} {'unsup':>6}")
    for op, c in s["per_op"].items():
        print(f"{op:<32} {c[PASS]:>5} {c[FAIL]:>5} {c[ERROR]:>6} {c[UNSUPPORTED]:>6}")
    print(f"\noverall: {s['passed']}/{s['total']} passed ({s['pass_rate']:.1%}); "
          f"supported ops: {s['supported_passed']}/{s['supported_cases']} ({s['supported_pass_rate']:.1%})")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown_report(results, args.backend, args.markdown))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": s, "results": [asdict(r) for r in results]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
