"""Inference BatchNormalization that no convolution absorbed -> Mul + Add by per-channel constants.

y = (x - mean) / sqrt(var + eps) * scale + bias = x * a + b,  a = scale / sqrt(var + eps),  b = bias - mean * a.

Why: fold_conv_batchnorm folds a BN into the convolution before it; a BN that comes first in a block
(DenseNet's BN -> ReLU -> Conv after each Concat, pre-activation ResNets) stays a layer of its own, and as one
it cannot join a pointwise chain, so the ReLU after it reads and writes the whole activation tensor again. As a
Mul and an Add it is pointwise: fuse_pointwise_chain (which runs after this pass) merges it with that ReLU into one
kernel, which reads any layout through strides like the BN did. a and b are computed in float64 from the
constant statistics and rounded once to x's type, as the CUDA lowering of the BN layer did.

Applies to inference BNs (one output, no training mode) whose four parameters are 1-D float constants, that a
pointwise chain can take in (the BN's only reader is a pointwise layer, or its input comes from one the BN alone
reads: else Mul + Add would be one kernel just like the BN, and the BN layer, with its name, might as well stay),
and whose input's rank and type shape inference knows (unknown input dims count as 1, as for reduce_precision: a
rank and a type do not depend on them). Runs with the fusions (after the precision pass), so at optimization
level 0 a BN stays one layer.
"""

from __future__ import annotations

import numpy as np

from engine_core.ir import Graph, Node
from engine_core.ops import TensorInfo
from engine_core.passes.fuse_pointwise_chain import chain_ops
from engine_core.passes.pattern import Match, Uses, fuse_matches, is_op
from engine_core.passes.shape_inference import stand_in_infos

#: input types the rewrite takes (numpy's floats and bfloat16, by name: ml_dtypes' type is no np.floating)
_FLOATS = frozenset({"float16", "float32", "float64", "bfloat16"})


def _inference_params(graph: Graph, bn: Node) -> list[np.ndarray] | None:
    """(scale, bias, mean, var) of an inference BN (opset 7 on) with one output and 1-D float constant parameters
    of one size, else None (training, statistics outputs, per-activation parameters, weights that are not
    constants). Before opset 14 the statistics outputs are what asks for training."""
    if bn.opset < 7:  # older Mul/Add broadcast only with their ``broadcast`` attribute
        return None
    if bn.attr("training_mode", 0) or len(bn.inputs) != 5 or any(bn.outputs[1:]) or bn.attr("spatial", 1) != 1:
        return None
    params = [graph.constants.get(name) for name in bn.inputs[1:]]
    if any(p is None or p.ndim != 1 or p.dtype.name not in _FLOATS for p in params):
        return None
    if len({p.size for p in params}) != 1:
        return None
    return params


def _joins_a_chain(uses: Uses, bn: Node) -> bool:
    """A pointwise layer reads the BN's output alone (not a graph output), or writes its input for the BN alone."""
    ops = chain_ops()[0]
    reader = uses.sole_reader(bn.outputs[0])
    producer = uses.producers.get(bn.inputs[0])
    return (is_op(reader, *ops) or is_op(producer, *ops) and uses.sole_reader(bn.inputs[0]) is bn)


def _affine(graph: Graph, bn: Node, params: list[np.ndarray], x: TensorInfo) -> Match | None:
    """Mul by a then Add of b (both [C, 1, ...] in x's type), the Add writing the BN's output under its name."""
    if x.shape is None or len(x.shape) < 2 or x.dtype.name not in _FLOATS:
        return None
    scale, bias, mean, var = (p.astype(np.float64) for p in params)
    a = scale / np.sqrt(var + float(bn.attr("epsilon", 1e-5)))
    b = bias - mean * a
    shape = (a.size,) + (1,) * (len(x.shape) - 2)
    a_name = graph.add_constant(f"{bn.name}_scale", a.reshape(shape).astype(x.dtype))
    b_name = graph.add_constant(f"{bn.name}_shift", b.reshape(shape).astype(x.dtype))
    scaled = graph.unique_name(f"{bn.outputs[0]}_scaled")
    # the Add carries the BN's origin, the Mul none: the chain they join then lists each ONNX node once
    mul = Node("Mul", [bn.inputs[0], a_name], [scaled], {}, f"{bn.name}_mul", "", bn.opset, [],
               bn.precision_constraint)
    add = Node("Add", [scaled, b_name], [bn.outputs[0]], {}, bn.name, "", bn.opset, list(bn.origin),
               bn.precision_constraint, dict(bn.output_type_constraints))
    return [mul, add], [bn]


def decompose_batchnorm(graph: Graph) -> int:
    """Rewrite every eligible BatchNormalization as Mul + Add; returns how many."""
    uses = Uses(graph)
    candidates = {id(n): params for n in graph.nodes if is_op(n, "BatchNormalization") and _joins_a_chain(uses, n)
                  and (params := _inference_params(graph, n)) is not None}
    if not candidates:
        return 0
    infos = stand_in_infos(graph)
    if infos is None:
        return 0

    def match(bn: Node, _: set[int]) -> Match | None:
        params = candidates.get(id(bn))
        x = infos.get(bn.inputs[0])
        return None if params is None or x is None else _affine(graph, bn, params, x)

    return fuse_matches(graph, ("BatchNormalization",), match)
