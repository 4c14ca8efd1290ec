"""ONNX node conformance on the CPU backend must not fall below the floor recorded in the repo.

Raise the floor in tests/conformance_floor.json when the pass count goes up (`make conformance`
rewrites docs/conformance.md with the per-op table).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine_core.conformance import PASS, collect_cases, run_cases, summarize

FLOOR = json.loads((Path(__file__).parent / "conformance_floor.json").read_text())


@pytest.fixture(scope="module")
def results():
    return run_cases(collect_cases(), "cpu")


def test_overall_pass_count_does_not_regress(results):
    summary = summarize(results)
    assert summary["passed"] >= FLOOR["passed"], (
        f"conformance fell to {summary['passed']}/{summary['total']} (floor {FLOOR['passed']}); failing: "
        + ", ".join(r.name for r in results if r.status != PASS)[:2000]
    )


def test_supported_ops_pass_rate(results):
    assert summarize(results)["supported_pass_rate"] >= FLOOR["supported_pass_rate"]


def test_no_case_crashes_the_harness(results):
    crashes = [f"{r.name}: {r.reason}" for r in results if r.reason.startswith("crash:")]
    assert len(crashes) <= FLOOR["max_crashes"], "\n".join(crashes[:50])
