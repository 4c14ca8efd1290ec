"""The import graph of `engine_core`: circles, upward imports, and CUDA driver imports outside the CUDA layer.

    python tools/import_graph.py            # the report; exit status 1 when a rule is broken
    python tools/import_graph.py --edges    # every module's imports first (F: inside a function or class body,
                                            # T: under `if TYPE_CHECKING`)

Every `import` statement counts, wherever it sits: at module level, inside a function (a function-level import is
still a dependency, only a later one) or under `if TYPE_CHECKING` (the module still knows the other one's types).
Relative imports are resolved. `from P import name` is an edge to the submodule `P.name` when there is one, else to
`P` itself (its `__init__`). Importing a submodule also runs its parent packages' `__init__`, but those implicit
edges are not counted: an aggregating `__init__` (engine_core, ops, passes) would otherwise tie each package into
one circle with its members.

Rules (tests/engine/test_import_graph.py runs this):

1. no circles: no strongly connected component of two or more modules, no module importing itself;
2. imports point down the layers of LAYERS; an upward import is allowed only when UPWARD lists it with its reason,
   and UPWARD holds at most two;
3. `engine_core` imports nothing from the packages that sit on top of it (ABOVE: the server, the load tests, ...);
4. only `engine_core/backends/cuda` and `engine_core/cuda` import the CUDA driver bindings (`cuda.bindings`, ...):
   everything else in DRIVER_SEARCH (the server included) goes through `engine_core.cuda`. Tests may call the
   driver themselves, to check the engine against it.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "engine_core"

#: Layers, bottom first. A module belongs to the first layer with a matching pattern (fnmatch on the dotted module
#: name; a package's `__init__` is the package's own name) and may import its own layer and those below.
#:   base     - errors, types, logging: no engine imports at all
#:   ir       - the graph
#:   cuda     - the driver, NVRTC and IPC wrappers: no graphs; everything that runs on a GPU builds on them
#:   ops      - the op registry and the ops; ops with bodies (control flow, fused chains) are handed what runs their
#:              bodies (the interpreter, shape inference) as arguments
#:   interpret - the reference interpreter (numpy) over the op registry: folding, shape inference, calibration, the
#:              CPU backend and the CUDA host fallback run layers with it
#:   config   - what a build is asked for: the network, the builder config, which backends exist, compatibility
#:   passes   - graph passes (they read the network and the config)
#:   onnx     - the ONNX importer (it bounds constants as constant folding does)
#:   plan     - the plan file and what reads it without running it: refittable weights, inspection, streaming
#:   backends - the CPU backend (a plan through the interpreter) and the CUDA backend (lowering, tactics, runner):
#:              turn plans into host or device work
#:   build    - the builder, what it records beside the passes (build_extras) and INT8 calibration: passes + backends
#:              -> plan
#:   runtime  - Runtime, CudaEngine, ExecutionContext (its batch path and helpers in runtime_batch, runtime_helpers)
#:   api      - the public package, the Refitter (it refits a runtime engine), the CLI and adapters
#:   generate - generative models on the public API: tokenizer, chat template, paged KV cache, continuous batching
LAYERS: list[tuple[str, list[str]]] = [
    ("base", ["engine_core.version", "engine_core.errors", "engine_core.types", "engine_core.logger",
              "engine_core.error_recorder"]),
    ("ir", ["engine_core.ir", "engine_core.ir.*"]),
    ("cuda", ["engine_core.cuda", "engine_core.cuda.*"]),
    ("ops", ["engine_core.ops", "engine_core.ops.*", "engine_core.plugins"]),
    ("interpret", ["engine_core.interpret", "engine_core.interpret.*"]),
    ("config", ["engine_core.backends.registry", "engine_core.compat", "engine_core.timing_cache",
                "engine_core.builder_config", "engine_core.network"]),
    ("passes", ["engine_core.passes", "engine_core.passes.*"]),
    ("onnx", ["engine_core.onnx", "engine_core.onnx.*"]),
    ("plan", ["engine_core.plan", "engine_core.refittable", "engine_core.inspector", "engine_core.weight_streaming",
              "engine_core.batching"]),
    ("backends", ["engine_core.backends", "engine_core.backends.*"]),
    ("build", ["engine_core.calibration", "engine_core.builder", "engine_core.build_extras"]),
    ("runtime", ["engine_core.runtime", "engine_core.runtime_batch", "engine_core.runtime_helpers"]),
    ("api", ["engine_core", "engine_core.refit", "engine_core.cli", "engine_core.conformance",
             "engine_core.onnx_backend"]),
    ("generate", ["engine_core.generate", "engine_core.generate.*"]),
]

#: Allowed upward imports, (importer, imported) -> why. At most two.
UPWARD: dict[tuple[str, str], str] = {
    ("engine_core.passes.fuse_pointwise_chain", "engine_core.backends.cuda.pointwise"):
        "a PointwiseChain holds only ops the CUDA pointwise generator compiles, and that op set is the generator's "
        "own tables (POINTWISE_OPS, MAX_INPUTS); read on the pass's first use, so loading the passes does not "
        "load the backend",
}

#: Top-level packages built on the engine: engine_core never imports them.
ABOVE = ("server", "load_tests", "kiln_cli", "tests", "tools", "bench", "examples")

#: The CUDA driver bindings (the cuda-bindings / cuda-python packages) and where they may be imported.
DRIVER_MODULES = ("cuda.bindings", "cuda.cuda", "cuda.cudart", "cuda.nvrtc", "cuda.ccuda", "cuda.ccudart")
DRIVER_OWNERS = ("engine_core/backends/cuda/", "engine_core/cuda/")
#: Trees searched for driver imports.
DRIVER_SEARCH = ("engine_core", "server", "load_tests", "bench", "tools", "examples", "cuda_kernels", "kiln_cli.py")


@dataclass(frozen=True)
class Import:
    target: str  # dotted module name
    line: int
    nested: bool  # inside a function or class body
    type_only: bool  # under `if TYPE_CHECKING`


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every module of `package`."""
    return {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}


def _type_checking(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` or `if typing.TYPE_CHECKING:`."""
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _statements(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool, bool]]:
    """Every import statement, with whether it sits in a function or class body and under `if TYPE_CHECKING`."""
    work = [(tree, False, False)]
    while work:
        node, nested, type_only = work.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child, nested, type_only
            inner = nested or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda)
            work.append((child, inner, type_only or _type_checking(child)))


def imports_of(path: Path, name: str, known: set[str] = frozenset()) -> list[Import]:
    """The modules file `path` (module `name`) imports; `from P import x` is `P.x` when `known` has it."""
    is_package = path.name == "__init__.py"
    result = []
    for node, nested, type_only in _statements(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            result += [Import(alias.name, node.lineno, nested, type_only) for alias in node.names]
            continue
        base = node.module or ""
        if node.level:  # relative: from the package (a module's own, or an __init__'s), `level - 1` up
            anchor = name.split(".") if is_package else name.split(".")[:-1]
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            result.append(Import(sub if sub in known else base, node.lineno, nested, type_only))
    return sorted(result, key=lambda i: (i.line, i.target))


def build_graph(modules: dict[str, Path]) -> dict[str, list[Import]]:
    """Module -> its imports of other modules of the package, one per (target, line)."""
    known = set(modules)
    graph = {}
    for name, path in modules.items():
        found = {(i.target, i.line): i for i in imports_of(path, name, known) if i.target in known}
        graph[name] = list(found.values())
    return graph


def circles(graph: dict[str, list[Import]]) -> list[list[str]]:
    """Strongly connected components of two or more modules (or of one importing itself), largest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def targets(name: str) -> Iterator[str]:
        return iter(sorted({i.target for i in graph[name]}))

    for start in sorted(graph):  # Tarjan's algorithm, without recursion
        if start in index:
            continue
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        work = [(start, targets(start))]
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, targets(child)))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while not component or component[-1] != node:
                        component.append(stack.pop())
                        on_stack.discard(component[-1])
                    if len(component) > 1 or any(i.target == node for i in graph[node]):
                        found.append(sorted(component))
    return sorted(found, key=lambda c: (-len(c), c))


def layer_of(name: str) -> int:
    for level, (_, patterns) in enumerate(LAYERS):
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            return level
    raise LookupError(f"module {name} is in no layer: add it to LAYERS in tools/import_graph.py")


def upward_imports(graph: dict[str, list[Import]]) -> dict[tuple[str, str], list[int]]:
    """(importer, imported) -> lines, for every import of a module in a higher layer than the importer's."""
    found: dict[tuple[str, str], list[int]] = {}
    for name, imports in sorted(graph.items()):
        for i in imports:
            if layer_of(i.target) > layer_of(name):
                found.setdefault((name, i.target), []).append(i.line)
    return found


def imports_from_above(modules: dict[str, Path]) -> list[tuple[str, int, str]]:
    """(module, line, imported) for every import of an ABOVE package by the package."""
    return [(name, i.line, i.target) for name, path in sorted(modules.items()) for i in imports_of(path, name)
            if i.target.split(".")[0] in ABOVE]


def _is_driver(target: str) -> bool:
    return target == "cuda" or any(target == m or target.startswith(m + ".") for m in DRIVER_MODULES)


def driver_imports(root: Path = ROOT) -> list[tuple[str, int, str]]:
    """(path, line, module) of every driver-binding import outside DRIVER_OWNERS."""
    found = []
    for tree in DRIVER_SEARCH:
        top = root / tree
        paths = sorted(top.rglob("*.py")) if top.is_dir() else [top] if top.is_file() else []
        for path in paths:
            rel = path.relative_to(root).as_posix()
            if not rel.startswith(DRIVER_OWNERS):
                found += [(rel, i.line, i.target) for i in imports_of(path, module_name(path, root))
                          if _is_driver(i.target)]
    return found


def report(root: Path = ROOT, edges: bool = False, out: TextIO = sys.stdout) -> int:
    """Print the findings to `out`; returns how many rules are broken (0: clean)."""
    modules = package_modules(root)
    graph = build_graph(modules)
    problems = 0

    def layer(name: str) -> str:
        return LAYERS[layer_of(name)][0]

    if edges:
        for name, imports in sorted(graph.items()):
            marks: dict[str, set[str]] = {}
            for i in imports:
                marks.setdefault(i.target, set()).update({"F"} if i.nested else set(), {"T"} if i.type_only else set())
            listed = [t + (f" ({''.join(sorted(m))})" if m else "") for t, m in sorted(marks.items())]
            print(f"{name} [{layer(name)}]: {', '.join(listed)}", file=out)
        print(file=out)
    nested = sum(i.nested for imports in graph.values() for i in imports)
    type_only = sum(i.type_only for imports in graph.values() for i in imports)
    print(f"{len(modules)} modules, {sum(map(len, graph.values()))} imports between them ({nested} inside "
          f"functions or classes, {type_only} under TYPE_CHECKING)", file=out)

    found = circles(graph)
    print(f"circles: {len(found)}", file=out)
    for component in found:
        members = set(component)
        print(f"  {len(component)} modules: {', '.join(component)}", file=out)
        for name in component:
            for target in sorted({i.target for i in graph[name]} & members):
                lines = ", ".join(str(i.line) for i in graph[name] if i.target == target)
                print(f"    {name} -> {target} (line {lines})", file=out)
    problems += len(found)

    upward = upward_imports(graph)
    print(f"upward imports: {len(upward)} ({len(set(upward) & set(UPWARD))} allowed; at most 2 may be)", file=out)
    for (importer, target), lines in upward.items():
        why = UPWARD.get((importer, target))
        print(f"  {importer} [{layer(importer)}] -> {target} [{layer(target)}] (line {', '.join(map(str, lines))})"
              f": {'allowed: ' + why if why else 'NOT ALLOWED'}", file=out)
        problems += why is None
    if len(UPWARD) > 2:
        print(f"  UPWARD lists {len(UPWARD)} imports; at most 2 are allowed", file=out)
        problems += 1
    for importer, target in sorted(set(UPWARD) - set(upward)):
        print(f"  UPWARD lists {importer} -> {target}, which is gone: remove it", file=out)
        problems += 1

    above = imports_from_above(modules)
    print(f"imports of {', '.join(ABOVE)} by {PACKAGE}: {len(above)}", file=out)
    for name, line, target in above:
        print(f"  {name} (line {line}) -> {target}", file=out)
    problems += len(above)

    driver = driver_imports(root)
    print(f"CUDA driver imports outside {' and '.join(DRIVER_OWNERS)}: {len(driver)}", file=out)
    for rel, line, target in driver:
        print(f"  {rel}:{line}: {target}", file=out)
    problems += len(driver)
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--edges", action="store_true", help="print every module's imports first")
    args = parser.parse_args(argv)
    problems = report(edges=args.edges)
    print("clean" if not problems else f"{problems} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
