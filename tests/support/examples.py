"""The example scripts under examples/ as modules, for the tests: the loader is load_tests/harness.py's, which the
load tests and benchmarks use too."""

from __future__ import annotations

from load_tests.harness import ROOT, load_example, load_file

__all__ = ["ROOT", "load_example", "load_file"]
