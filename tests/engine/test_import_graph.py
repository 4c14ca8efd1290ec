"""tools/import_graph.py: engine_core's imports have no circles and point down its layers, the engine imports
nothing from the server or the load tests, and only the CUDA layer imports the driver bindings (issue #32)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tools import import_graph

ROOT = Path(__file__).resolve().parents[2]


def test_the_repository_is_clean():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "import_graph.py")], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.rstrip().endswith("clean")


def test_every_module_has_a_layer():
    for name in import_graph.package_modules():
        import_graph.layer_of(name)  # raises LookupError for a module no layer names


def _package(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return import_graph.package_modules(root, "pkg")


def test_function_level_relative_and_type_checking_imports_count(tmp_path):
    modules = _package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg import b\n",
        "pkg/b.py": "def f():\n    from .c import g\n",
        "pkg/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import x\n",
        "pkg/d.py": "import numpy\nfrom . import a\n",
        "pkg/sub/__init__.py": "from ..d import y\n",
    })
    graph = import_graph.build_graph(modules)
    assert {i.target for i in graph["pkg.a"]} == {"pkg.b"}
    (b_to_c,) = graph["pkg.b"]
    assert (b_to_c.target, b_to_c.nested) == ("pkg.c", True)
    (c_to_a,) = graph["pkg.c"]
    assert (c_to_a.target, c_to_a.type_only) == ("pkg.a", True)
    assert {i.target for i in graph["pkg.d"]} == {"pkg.a"}  # numpy is not a module of the package
    assert {i.target for i in graph["pkg.sub"]} == {"pkg.d"}
    assert import_graph.circles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_self_import_is_a_circle_and_a_chain_is_not(tmp_path):
    modules = _package(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "import pkg.a\n", "pkg/b.py": "import pkg.a\n"})
    assert import_graph.circles(import_graph.build_graph(modules)) == [["pkg.a"]]


def test_driver_imports_are_found_outside_the_cuda_layer(tmp_path):
    _package(tmp_path, {
        "server/x.py": "def f():\n    from cuda.bindings import driver\n",
        "server/y.py": "from cuda import cuda\nimport cuda_kernels\n",
        "engine_core/cuda/driver.py": "from cuda.bindings import driver\n",
    })
    assert import_graph.driver_imports(tmp_path) == [("server/x.py", 2, "cuda.bindings"), ("server/y.py", 1, "cuda")]
