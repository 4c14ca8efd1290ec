"""The example scripts under examples/ as modules: they are scripts, not a package, so tests load them by path."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_example(filename: str) -> ModuleType:
    """examples/<filename> imported as a module named after it."""
    spec = importlib.util.spec_from_file_location(Path(filename).stem, ROOT / "examples" / filename)
    assert spec is not None and spec.loader is not None, filename
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
