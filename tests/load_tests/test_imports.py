"""Every load_tests module imports: a benchmark nobody runs in CI must not rot into an ImportError unnoticed
(serving_profile imported a helper that a refactor had removed)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

MODULES = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "load_tests").glob("*.py")
                 if p.stem not in ("__init__", "__main__", "locustfile"))


@pytest.mark.parametrize("name", MODULES)
def test_module_imports(name: str) -> None:
    module = importlib.import_module(f"load_tests.{name}")
    assert module.__doc__, f"load_tests/{name}.py has no module docstring saying what it measures"
