"""A decoder's LM head for the rows the generator reads, not for every position: the ``logits_rows`` input.

A decoder export computes ``logits`` [batch, sequence, vocab] for every new token, and a generator reads one row per
sequence (its last new token's). For decode that is all there is (one new token), but a prefill run of 4 prompts of
128 tokens computed 512 rows of a 128k-vocabulary head and wrote them as float32 (263 MB for the Llama-1B shape):
about a fifth of the prefill's arithmetic. ``select_logits_rows`` rewrites the ONNX graph before it is parsed:

    hidden [B, S, H] -> Flatten(axis=2) [B*S, H] -> Gather(logits_rows, axis=0) [R, H] -> Unsqueeze(1) [R, 1, H]
                     -> the head's MatMul (and the elementwise ops after it) -> logits [R, 1, vocab]

``logits_rows`` (int64 [R]) holds flat indices ``b * S + column``; the runner feeds one per batch row (pad rows read
row 0), so ``R`` is the run's batch and the logits stay [batch, 1, vocab]. Flatten and Unsqueeze are views on the
CUDA backend, Gather a copy of R rows.

The head is found by walking back from ``logits`` through elementwise ops with one non-constant input (a Cast to
float32, a bias Add, a scale) to a MatMul whose second input is a constant; a graph that ends otherwise is left as
it is (the runner then reads the rows out of the full logits, as before).
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

#: the input the rewrite adds: flat row indices (batch * sequence + column) whose logits the run computes
LOGITS_ROWS = "logits_rows"
#: ops between the head's MatMul and the ``logits`` output that act on each row alone
_ROW_WISE = frozenset({"Cast", "Add", "Mul", "Div", "Sub", "Tanh", "Identity"})


def _constant_names(graph: onnx.GraphProto) -> set[str]:
    return {t.name for t in graph.initializer} | {o for n in graph.node if n.op_type == "Constant" for o in n.output}


def _head(graph: onnx.GraphProto) -> onnx.NodeProto | None:
    """The MatMul that computes the logits (through row-wise ops), or None."""
    producers = {o: n for n in graph.node for o in n.output}
    constants = _constant_names(graph)
    node = producers.get("logits")
    while node is not None and node.op_type in _ROW_WISE:
        varying = [i for i in node.input if i and i not in constants]
        if len(varying) != 1:
            return None
        node = producers.get(varying[0])
    if node is None or node.op_type != "MatMul" or len(node.input) != 2 or node.input[1] not in constants:
        return None
    return node


def select_logits_rows(model: onnx.ModelProto) -> bool:
    """Rewrite ``model`` in place (module docstring); False, and nothing changed, when its head is not found or it
    has a ``logits_rows`` input already."""
    graph = model.graph
    if any(i.name == LOGITS_ROWS for i in graph.input):
        return False
    head = _head(graph)
    if head is None:
        return False
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13)
    flat, picked, rows = (f"{LOGITS_ROWS}/{part}" for part in ("flat", "picked", "rows"))
    nodes = [helper.make_node("Flatten", [head.input[0]], [flat], axis=2, name=f"{LOGITS_ROWS}/Flatten"),
             helper.make_node("Gather", [flat, LOGITS_ROWS], [picked], axis=0, name=f"{LOGITS_ROWS}/Gather")]
    if opset >= 13:
        axes = f"{LOGITS_ROWS}/axes"
        graph.initializer.append(helper.make_tensor(axes, TensorProto.INT64, [1], [1]))
        nodes.append(helper.make_node("Unsqueeze", [picked, axes], [rows], name=f"{LOGITS_ROWS}/Unsqueeze"))
    else:
        nodes.append(helper.make_node("Unsqueeze", [picked], [rows], axes=[1], name=f"{LOGITS_ROWS}/Unsqueeze"))
    at = list(graph.node).index(head)
    head.input[0] = rows
    for offset, node in enumerate(nodes):
        graph.node.insert(at + offset, node)
    graph.input.append(helper.make_tensor_value_info(LOGITS_ROWS, TensorProto.INT64, ["logits_rows_count"]))
    for output in graph.output:
        if output.name == "logits" and output.type.tensor_type.shape.dim:
            dims = output.type.tensor_type.shape.dim
            dims[0].Clear()
            dims[0].dim_param = "logits_rows_count"
            if len(dims) > 1:
                dims[1].Clear()
                dims[1].dim_value = 1
    return True
