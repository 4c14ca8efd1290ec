"""Lowering: graph + concrete tensor infos -> device steps, tensor layouts/locations and the memory plan.

Pure Python (no GPU): the builder runs it at every profile's shapes to pick tactics, collect the
kernels to embed and size the arena; the runner runs it once per input-shape set and launches the
result. Each layer becomes one step: kernel launches, GEMMs, convolutions, copies, or ``Host`` (the
numpy implementation with explicit copies; reported as tactic "host", never silent).

Layouts: 4-D activations produced by convolutions live channels-last (NHWC) when cuDNN runs them —
tensor-core convolutions want it — and stay so through pointwise layers and pooling, which read any
layout through strides. Strict fp32 convolutions (no TF32) stay NCHW: cuDNN's fast FFMA engines are
NCHW kernels (``LoweringOptions.strict_fp32_nchw``). A layer that needs the logical (linear) layout gets
a visible reformat step in front of it, and graph outputs are always linear.

Strided views: a Split of an arena tensor writes nothing; each part is the input's bytes from its offset on, read
through the input's strides (layout "strided", ``LoweringContext.view``), and so are the views of such a part that
strides can describe (a decoder's head Reshape and Transpose of its q, k, v parts). Layers that read any strides
(STRIDED_READERS, pointwise kernels) take them as they are; others get a reformat, as for channels-last.

This module is the driver: it lowers each layer with the rule registered for its op type (``LOWERING_RULES``,
lowering_context.py), places the tensors and plans the arena. The rules live by family in lower_rules/ (pointwise,
movement, rows, norm, pool, gemm, attention, conv) and, for the INT8 layers, in int8_gemm.py and int8_conv.py; each
registers itself when its module is imported, which this module does for all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import numpy as np

# the rule modules: importing them registers their rules in LOWERING_RULES
from engine_core.backends.cuda import int8_conv as int8_conv
from engine_core.backends.cuda import int8_gemm as int8_gemm
from engine_core.backends.cuda.cudnn_attention import SdpaLaunch
from engine_core.backends.cuda.host_tail import split_host_tail
from engine_core.backends.cuda.lower_rules import attention as attention
from engine_core.backends.cuda.lower_rules import conv as conv
from engine_core.backends.cuda.lower_rules import fill as fill
from engine_core.backends.cuda.lower_rules import gemm as gemm
from engine_core.backends.cuda.lower_rules import movement as movement
from engine_core.backends.cuda.lower_rules import norm as norm
from engine_core.backends.cuda.lower_rules import pointwise as pointwise
from engine_core.backends.cuda.lower_rules import pool as pool
from engine_core.backends.cuda.lower_rules import rotary as rotary
from engine_core.backends.cuda.lower_rules import rows as rows
from engine_core.backends.cuda.lower_rules.attention import flash_shared_bytes as flash_shared_bytes  # lived here
from engine_core.backends.cuda.lower_rules.conv import conv_layout as conv_layout  # lived here
from engine_core.backends.cuda.lower_rules.gemm import GEMM_TACTICS as GEMM_TACTICS  # lived here
from engine_core.backends.cuda.lower_rules.movement import (
    STRIDED_READERS,
    VIEW_OPS,
    lower_view,
    view_source,
    view_strides,
)
from engine_core.backends.cuda.lower_rules.pointwise import lower_pointwise
from engine_core.backends.cuda.lowering_context import F16 as F16  # re-exported: lived here
from engine_core.backends.cuda.lowering_context import F32 as F32  # re-exported: lived here
from engine_core.backends.cuda.lowering_context import INT8 as INT8  # re-exported: lived here
from engine_core.backends.cuda.lowering_context import (
    LOWERING_RULES,
    Conv,
    Copy,
    Gemm,
    Host,
    Launch,
    Lowered,
    LoweringContext,
    LoweringOptions,
    Ref,
    Step,
)
from engine_core.backends.cuda.lowering_context import TensorMap as TensorMap  # re-exported: lived here
from engine_core.backends.cuda.lowering_context import nhwc_strides as nhwc_strides  # re-exported: lived here
from engine_core.backends.cuda.lowering_context import transform_weight as transform_weight  # re-exported: lived here
from engine_core.backends.cuda.memory import liveness, plan_memory
from engine_core.backends.cuda.pointwise import POINTWISE_OPS, Unsupported
from engine_core.ir import Graph, Node
from engine_core.ops import TensorInfo

#: ops that read and write any layout through strides (a channels-last input keeps its layout)
LAYOUT_AWARE = POINTWISE_OPS | {"Conv", "FusedConv", "PointwiseChain", "BatchNormalization", "MaxPool",
                                "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "Gelu", "QuantizeLinear",
                                "DequantizeLinear", "QConv", "Concat"}
#: op type -> lowering rule (the registry itself: every rule module is imported above)
_LOWER = LOWERING_RULES
_KILN_OPS = frozenset({"FusedMatMul", "FusedConv", "PointwiseChain", "QMatMul", "QConv", "SkipLayerNorm",
                       "AttentionQuantize", "Rotary"})


def _tactic(node: Node, ops: list) -> str:
    conv = next((o for o in ops if isinstance(o, Conv)), None)
    if conv is not None:
        return "conv:cudnn_int8" if conv.int8 else "conv:cudnn"
    gemm = next((o for o in ops if isinstance(o, Gemm)), None)
    if gemm is not None:
        return f"gemm:{gemm.tactic}"
    if node.op_type == "QMatMul" and ops:
        # cublaslt_int8 / cublaslt_fp8, or Kiln's sm_90 INT8 GEMM (one launch)
        return f"gemm:{ops[0].module}" if isinstance(ops[0], Launch) else f"gemm:{ops[0].tactic}"
    if node.op_type == "QConv" and ops:
        gemm = next(o for o in ops if hasattr(o, "acc_dtype"))  # the Int8Gemm step
        return f"conv:{gemm.tactic}" + ("" if gemm.tactic.endswith("requant") else "_im2col")
    if node.op_type in ("Attention", "AttentionQuantize"):
        launch = next((o for o in ops if isinstance(o, Launch) and o.module == "flash_attention"), None)
        if isinstance(launch, SdpaLaunch):  # cuDNN's SDPA; its flash launch runs where cuDNN declines
            return "attention:cudnn_sdpa"
        return f"kernel:{launch.function.rsplit('_', 2)[0]}" if launch else "kernel:attention_softmax"
    if node.op_type in POINTWISE_OPS or node.op_type in ("PointwiseChain", "Gelu", "BatchNormalization", "QuantizeLinear",
                                                         "DequantizeLinear"):
        launch = next((o for o in ops if isinstance(o, Launch)), None)
        return f"pointwise:{launch.function}" if launch else "pointwise:empty"
    return f"kernel:{node.op_type}"


def lower_node(node: Node, ctx: LoweringContext) -> tuple[str, list, Node]:
    """(tactic name, device ops, the node as lowered) for one layer; ("host", [Host], node) when it has no
    CUDA implementation. Inputs a layer cannot read channels-last are reformatted first (``ctx.pre_steps``)."""
    ctx.scratch = []
    ctx.renamed = {}
    try:
        domain_ok = node.domain in ("", "ai.onnx") or (node.domain == "kiln" and node.op_type in _KILN_OPS)
        if not domain_ok:
            raise Unsupported(f"domain {node.domain}")
        if len(node.outputs) != 1 and node.op_type not in ("LayerNormalization", "MaxPool", "Attention", "Split",
                                                           "SkipLayerNorm"):
            raise Unsupported("multi-output layer")
        for name in node.outputs:
            if name:
                ctx.info(name)
        node = _with_readable_inputs(node, ctx)
        view = view_source(node, ctx)
        if view is not None:
            return "view", lower_view(view, ctx), view
        if node.op_type == "Split" and node.inputs[0] in ctx.split_written:  # the GEMM wrote the parts
            return "fused:qgemm_split", [], replace(node, inputs=[], outputs=[])
        if node.op_type in POINTWISE_OPS or node.op_type == "Gelu":
            return _tactic(node, ops := lower_pointwise(node, ctx)), ops, node
        if node.op_type in _LOWER:
            ops = _LOWER[node.op_type](node, ctx)
            if ctx.renamed:
                node = replace(node, inputs=[ctx.renamed.get(n, n) for n in node.inputs])
            if node.outputs and node.outputs[0] in ctx.split_written:
                node = replace(node, outputs=list(ctx.split_readers[node.outputs[0]].outputs))
            if not ops and all(name in ctx.views for name in node.outputs if name):  # a Split into views
                return "view", ops, node
            return _tactic(node, ops), ops, node
        raise Unsupported(f"no CUDA implementation of {node.op_type}")
    except Unsupported:
        for name in node.outputs:
            ctx.layouts.pop(name, None)
            ctx.views.pop(name, None)
        ctx.scratch = []
        node = _with_linear_inputs(node, ctx)
        return "host", [Host(node)], node


def _with_readable_inputs(node: Node, ctx: LoweringContext) -> Node:
    """``node`` with each input in a layout its rule reads, others reformatted to linear first: channels-last for
    LAYOUT_AWARE layers (a view aliases bytes: linear only), a strided view for STRIDED_READERS and for views that
    can describe it by strides (``view_strides``; a Reshape that merges a Split part's rows cannot)."""
    channels_last = node.op_type in LAYOUT_AWARE and node.op_type not in VIEW_OPS
    strided = node.op_type in POINTWISE_OPS or node.op_type in STRIDED_READERS or (
        node.op_type in (*VIEW_OPS, "Expand") and ctx.layouts.get(node.inputs[0]) == "strided"
        and view_strides(node, ctx) is not None)
    return _reformatted(node, ctx, lambda layout: layout == "linear" or layout == "nhwc" and channels_last
                        or layout == "strided" and strided)


def _with_linear_inputs(node: Node, ctx: LoweringContext) -> Node:
    """``node`` with every input linear (a host layer reads numpy arrays)."""
    return _reformatted(node, ctx, lambda layout: layout == "linear")


def _reformatted(node: Node, ctx: LoweringContext, readable: Callable[[str], bool]) -> Node:
    """``node`` with each input whose layout is not ``readable`` reformatted to linear first."""
    if all(readable(ctx.layouts.get(n, "linear")) for n in node.inputs if n):
        return node
    return replace(node, inputs=[ctx.as_layout(n, "linear") if n and not readable(ctx.layouts.get(n, "linear"))
                                 else n for n in node.inputs])


# -- the whole graph --------------------------------------------------------------------------------


def lower_split(graph: Graph, infos: Mapping[str, TensorInfo], gemm_choice: Mapping[str, str] | None = None,
                options: LoweringOptions | None = None, values_given: bool = False) -> Lowered:
    """``lower_graph`` of the device part when some tensor's shape is unknown at ``infos``: the layers from the first
    data-dependent ones on are the host tail (``Lowered.tail``, host_tail.py). Raises Unsupported where a shape waits
    only for an input's value (unless ``values_given``: the inputs' values were part of ``infos``)."""
    tail = split_host_tail(graph, infos, values_given)
    if tail is None:
        return lower_graph(graph, infos, gemm_choice, options)
    return replace(lower_graph(tail.device, infos, gemm_choice, options), tail=tail)


def lower_graph(graph: Graph, infos: Mapping[str, TensorInfo], gemm_choice: Mapping[str, str] | None = None,
                options: LoweringOptions | None = None) -> Lowered:
    """Lower every layer that is not a pure shape computation, place tensors, plan the arena."""
    graph_outputs = frozenset(graph.output_names)
    ctx = LoweringContext(dict(infos), graph_outputs, gemm_choice or {}, options or LoweringOptions(), graph.constants,
                          graph_inputs=frozenset(graph.input_names))
    io = set(graph.input_names) | graph_outputs
    locations: dict[str, tuple[str, Any]] = {n: ("io", n) for n in io}
    for name in graph.constants:
        locations.setdefault(name, ("weight", name))
    ctx.split_readers = _qmatmul_splits(graph)
    alias = ctx.aliases  # tensor -> (the tensor whose bytes it is, byte offset into them)

    def alias_of(name: str, source: str, offset: int = 0) -> None:
        root, base = alias.get(source, (source, 0))
        alias[name] = (root, base + offset)

    steps: list[Step] = []
    for node in graph.nodes:
        if node.outputs and all(infos.get(o) is not None and infos[o].value is not None for o in node.outputs if o):
            continue  # shape computation: its value is known on the host
        tactic, ops, lowered_node = lower_node(node, ctx)
        for pre in ctx.pre_steps:  # reformats; a layout change that moves no bytes is an alias (as_layout)
            if pre.tactic == "view" and not pre.ops:
                alias_of(pre.node.outputs[0], pre.node.inputs[0])
        steps.extend(ctx.pre_steps)
        ctx.pre_steps = []
        for name in lowered_node.outputs:  # views a rule made (Split parts, views of strided views)
            if name in ctx.views:
                alias_of(name, *ctx.views[name])
        if tactic == "view" and not ops and lowered_node.outputs[0] not in alias:
            alias_of(lowered_node.outputs[0], lowered_node.inputs[0])
        steps.append(Step(lowered_node, tactic, ops, list(ctx.scratch)))
    for name in ctx.weight_transforms:
        locations[name] = ("weight", name)
    folded = {}
    for step in steps:
        for name in step.node.inputs + _refs_of(step):
            root = alias.get(name, (name, 0))[0]
            if root in ctx.folded_extra:
                folded[root] = ctx.folded_extra[root]
                locations[root] = ("folded", root)
            elif root and root not in locations and ctx.infos.get(root) is not None and ctx.infos[root].value is not None:
                folded[root] = np.ascontiguousarray(ctx.infos[root].value)
                locations[root] = ("folded", root)
    for name in graph.output_names:  # outputs that no step writes: copied from their source
        producer = next((s for s in steps if name in s.node.outputs), None)
        if producer is None and name in infos and infos[name].value is not None and name not in graph.input_names:
            folded.setdefault(f"{name}#value", np.ascontiguousarray(infos[name].value))
            locations[f"{name}#value"] = ("folded", f"{name}#value")
            steps.append(Step(_copy_node(name), "copy", [Copy(Ref(name), Ref(f"{name}#value"),
                                                               folded[f"{name}#value"].nbytes)]))
    sizes, sequence = {}, []
    for step in steps:
        ins = [alias.get(n, (n, 0))[0] for n in step.node.inputs if n]
        outs = [n for n in step.node.outputs if n and n not in alias] + step.scratch
        sequence.append((ins, outs))
        for name in outs:
            if name not in locations:
                info = ctx.info(name)
                sizes[name] = int(np.prod(info.shape, dtype=np.int64)) * info.dtype.itemsize
    memory = plan_memory(liveness(sequence, sizes))
    for name, offset in memory.offsets.items():
        locations[name] = ("arena", offset)
    for name, (root, offset) in alias.items():
        if name not in locations:
            kind, key = locations.get(root, ("arena", 0))
            if offset and kind != "arena":  # ctx.in_arena keeps views at an offset to arena tensors
                raise AssertionError(f"'{name}' views '{root}' ({kind}) at byte {offset}")
            locations[name] = (kind, key + offset) if offset else (kind, key)
    return Lowered(steps, locations, memory, folded, list(dict.fromkeys(ctx.kernels)), ctx.infos,
                   dict(ctx.weight_transforms), dict(ctx.layouts), dict(ctx.view_strides))


def _qmatmul_splits(graph: Graph) -> dict[str, Node]:
    """QMatMul output -> the Split along its last axis that is its only reader (merge_parallel_qmatmuls' pattern),
    where the output is no graph output."""
    from engine_core.passes.pattern import Uses

    uses = Uses(graph)
    found = {}
    for node in graph.nodes:
        split = uses.sole_reader(node.outputs[0]) if node.op_type == "QMatMul" else None
        if split is not None and split.op_type == "Split" and split.inputs[0] == node.outputs[0] \
                and split.attr("axis", 0) == -1:
            found[node.outputs[0]] = split
    return found


def _refs_of(step: Step) -> list[str]:
    """Tensors a step's launches read besides its node's inputs (folded per-step constants)."""
    names = []
    for op in step.ops:
        for launch in [op] if isinstance(op, Launch) else op.fallback + op.rest if isinstance(op, Conv) else []:
            names += [r.tensor for r in launch.refs()]
        if hasattr(op, "refs"):  # int8_gemm's steps (that module imports this one) and convolutions: their
            names += [r.tensor for r in op.refs()]  # folded scale vectors
    return names


def _copy_node(name: str) -> Node:
    return Node("Identity", [f"{name}#value"], [name], {}, f"copy_{name}", "", 1, [])
