"""Plugins: custom ops for custom ONNX domains, written in Python (the reference's plugin registry).

A plugin is a name, a version, a domain (the reference's plugin namespace), a shape function and a
numpy CPU implementation — the op registry's ``infer``/``cpu`` contract, so the ONNX parser, shape
inference, constant folding and the CPU backend treat it like any built-in op — plus optional CUDA
C source, compiled with NVRTC for CUDA builds. Plans record the plugins they use (name, version,
domain) in ``Plan.build_info["plugins"]``; loading a plan whose plugins are not registered in this
process (or are registered at another version) fails with a PlanFormatError naming them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from engine_core.errors import PlanFormatError
from engine_core.ir import Graph
from engine_core.ops.registry import CpuFn, InferFn, OpDef, get_op, register_op

#: build_info key listing the plugins a plan uses.
BUILD_INFO_KEY = "plugins"


@dataclass(frozen=True)
class PluginDef:
    """One plugin (an IPluginCreator's identity plus its implementation)."""

    name: str
    version: str
    domain: str
    infer: InferFn
    cpu: CpuFn
    #: CUDA C source of the plugin's kernels (compiled only for CUDA builds)
    cuda_source: str | None = None
    deterministic: bool = True
    doc: str = ""

    @property
    def key(self) -> tuple[str, str]:
        return self.domain, self.name

    def compile_cuda(self, arch: str = "sm_90") -> bytes:
        """CUBIN of ``cuda_source`` for ``arch``; raises ValueError without source, CompileError on errors."""
        if not self.cuda_source:
            raise ValueError(f"plugin {self.domain}::{self.name} has no CUDA source")
        from engine_core.cuda.nvrtc import compile_cubin

        return compile_cubin(self.cuda_source, f"{self.domain}.{self.name}.cu", arch)


class PluginRegistry:
    """Registered plugins by (domain, name); registration also adds the op to the op registry."""

    def __init__(self) -> None:
        self._plugins: dict[tuple[str, str], PluginDef] = {}

    def register(self, plugin: PluginDef) -> OpDef:
        """Register ``plugin``; registering the very same definition again is a no-op."""
        if not plugin.domain or plugin.domain in ("ai.onnx", "ai.onnx.ml"):
            raise ValueError(f"plugin {plugin.name}: give it its own domain, not '{plugin.domain}'")
        known = self._plugins.get(plugin.key)
        op = get_op(plugin.name, plugin.domain)
        if known is not None and known == plugin and op is not None:
            return op
        if known is not None or op is not None:
            raise ValueError(f"op {plugin.domain}::{plugin.name} is already registered"
                             + (f" (plugin version {known.version})" if known else ""))
        op = register_op(plugin.name, infer=plugin.infer, cpu=plugin.cpu, domain=plugin.domain,
                         deterministic=plugin.deterministic, doc=plugin.doc or f"plugin version {plugin.version}")
        self._plugins[plugin.key] = plugin
        return op

    def get_plugin(self, name: str, version: str | None = None, domain: str = "") -> PluginDef | None:
        """The plugin ``domain::name`` (any domain when ``domain`` is empty), if ``version`` matches."""
        for plugin in self._plugins.values():
            if plugin.name == name and (not domain or plugin.domain == domain) and version in (None, plugin.version):
                return plugin
        return None

    get_creator = get_plugin

    @property
    def plugins(self) -> list[PluginDef]:
        return sorted(self._plugins.values(), key=lambda p: p.key)

    all_creators = plugins

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self._plugins


_REGISTRY = PluginRegistry()


def get_plugin_registry() -> PluginRegistry:
    """The process-wide plugin registry (the op registry is process-wide too)."""
    return _REGISTRY


def register_plugin(name: str, version: str, domain: str, infer: InferFn, cpu: CpuFn,
                    cuda_source: str | None = None, deterministic: bool = True, doc: str = "") -> PluginDef:
    """Define and register a plugin in one call; returns its definition."""
    plugin = PluginDef(name, version, domain, infer, cpu, cuda_source, deterministic, doc)
    _REGISTRY.register(plugin)
    return plugin


def _nodes(graph: Graph) -> Iterator[Any]:
    for node in graph.nodes:
        yield node
        for value in node.attrs.values():
            for sub in value if isinstance(value, list) else [value]:
                if isinstance(sub, Graph):
                    yield from _nodes(sub)


def plugins_used(graph: Graph) -> list[dict[str, str]]:
    """name/version/domain of every registered plugin the graph (or a subgraph) uses."""
    keys = {(n.domain, n.op_type) for n in _nodes(graph) if (n.domain, n.op_type) in _REGISTRY}
    return [{"name": p.name, "version": p.version, "domain": p.domain}
            for p in _REGISTRY.plugins if p.key in keys]


def check_plan_plugins(build_info: dict[str, Any]) -> None:
    """Refuse a plan whose plugins are missing here or registered at another version."""
    problems = []
    for need in build_info.get(BUILD_INFO_KEY, []):
        have = _REGISTRY._plugins.get((need["domain"], need["name"]))
        if have is None:
            problems.append(f"{need['domain']}::{need['name']} version {need['version']} is not registered")
        elif have.version != need["version"]:
            problems.append(f"{need['domain']}::{need['name']} is registered at version {have.version}, "
                            f"the plan needs version {need['version']}")
    if problems:
        raise PlanFormatError("plan uses plugins this process lacks: " + "; ".join(problems)
                              + " (import/register the plugin before loading the plan)")


def plugin_kernels(graph: Graph, backend: str, arch: str) -> dict[str, bytes]:
    """CUDA builds: the CUBIN of each used plugin that has CUDA source, stored in the plan's kernels."""
    if backend != "cuda":
        return {}
    used = {(p["domain"], p["name"]) for p in plugins_used(graph)}
    return {f"plugin:{p.domain}::{p.name}": p.compile_cuda(arch) for p in _REGISTRY.plugins
            if p.key in used and p.cuda_source}
