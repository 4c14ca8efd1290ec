"""Control flow (If, Loop, Scan): bodies run as subgraphs with access to the enclosing scope.

Bodies are ``Graph`` attributes. The interpreter (engine_core.interpret) calls these implementations with
``scope=`` (the enclosing tensors), which each body run sees as its outer scope, so bodies may read any tensor of
the graphs around them, and with ``interpreter=`` (what runs a body); shape inference calls the infer rules with
``scope=`` and ``infer_graph=`` (itself). Values crossing a body boundary may be tensors, sequences (python lists)
or empty optionals (None); they pass through untouched.

Shapes: outputs are usually data-dependent (trip counts, branch choice). ``infer`` reports the
dtype the body declares and a shape only where it is static whatever happens at run time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from engine_core.errors import ExecutionError, KilnError
from engine_core.ir import Graph, Node, Value
from engine_core.ops.registry import (
    BodyRunner,
    GraphInference,
    Interpreter,
    ShapeInferenceError,
    TensorInfo,
    normalize_axis,
    register_op,
)

Scope = Mapping[str, Any] | None
Shape = tuple[int, ...]


# -- helpers ------------------------------------------------------------------------------------


def run_body(body: Graph, feeds: Mapping[str, Any], scope: Scope, runner: BodyRunner) -> list[Any]:
    """Run a body once with ``runner`` (from ``body_runner``: loops build it, and its liveness tables, once, not per
    iteration) and return its outputs in declared order."""
    results = runner.run(feeds, outer=scope)
    return [results[name] for name in body.output_names]


def body_runner(body: Graph, interpreter: Interpreter | None) -> BodyRunner:
    """The runner of ``body``, built by the interpreter the op was called with (it passes itself: the op registry
    sits below it, so ops do not import it)."""
    if interpreter is None:
        raise ExecutionError("an op with a body runs under the interpreter (engine_core.interpret), "
                             "which passes itself as interpreter=")
    return interpreter(body)


def static_shape(value: Value) -> Shape | None:
    """A declared shape when every dim is a known non-negative int, else None."""
    if value.shape is None or not all(isinstance(d, int) and d >= 0 for d in value.shape):
        return None
    return tuple(value.shape)


def declared_info(value: Value) -> TensorInfo:
    """What a body's declaration says about one of its outputs (dtype, static shape)."""
    return TensorInfo(value.dtype, static_shape(value))


def infer_body(body: Graph, inputs: Sequence[TensorInfo], scope: Mapping[str, TensorInfo] | None,
               infer_graph: GraphInference | None) -> list[TensorInfo] | None:
    """Infos of a body's outputs by shape inference over the body (``infer_graph``, passed by shape inference),
    with the enclosing graphs' infos as its outer scope; None when there is no scope or no ``infer_graph`` (a caller
    that passes none) or it fails.

    Bodies inlined from function expansions often declare no output types, so this is the only
    reliable source of their dtypes.
    """
    if scope is None or infer_graph is None:
        return None
    feeds = {**scope, **{v.name: info for v, info in zip(body.inputs, inputs)}}  # inner names shadow outer ones
    try:
        infos = infer_graph(body, feeds)
    except KilnError:
        return None
    found = [infos.get(name) for name in body.output_names]
    return None if any(f is None for f in found) else found


def loop_state(info: TensorInfo | None) -> TensorInfo:
    """A loop-carried value's info for inferring a body: dtype and shape, not the value (it changes)."""
    if info is None:
        return TensorInfo(np.dtype(object), None)
    return info if info.dtype == object else TensorInfo(info.dtype, info.shape)


def is_tensor(value: Any) -> bool:
    return value is not None and not isinstance(value, list)


def truth(cond: Any, what: str) -> bool:
    """A bool from a one-element condition tensor."""
    flat = np.asarray(cond).reshape(-1)
    if flat.size != 1:
        raise ExecutionError(f"{what} must have exactly one element, got shape {np.shape(cond)}")
    return bool(flat[0])


def empty_scan_output(value: Value) -> np.ndarray:
    """A zero-iteration scan output: (0, *per-iteration shape) when the body declares that shape."""
    shape = static_shape(value)
    dtype = value.dtype if value.dtype != object else np.dtype(np.float32)
    return np.zeros((0, *(shape or ())), dtype=dtype)


# -- If -----------------------------------------------------------------------------------------


def _if_infer(node: Node, cond: TensorInfo, scope: Mapping[str, TensorInfo] | None = None,
              infer_graph: GraphInference | None = None) -> list[TensorInfo]:
    """A known condition gives the chosen branch's infos (values too); otherwise shapes on which
    both branches agree. Branch inference needs ``scope``; without it, the declarations speak."""
    then_b: Graph = node.attr("then_branch")
    else_b: Graph = node.attr("else_branch")
    if len(then_b.outputs) != len(else_b.outputs):
        raise ShapeInferenceError(f"If branches have {len(then_b.outputs)} and {len(else_b.outputs)} outputs")
    if cond.value is not None:
        chosen = then_b if truth(cond.value, "If condition") else else_b
        return infer_body(chosen, [], scope, infer_graph) or [declared_info(v) for v in chosen.outputs]
    then_i = infer_body(then_b, [], scope, infer_graph) or [declared_info(v) for v in then_b.outputs]
    else_i = infer_body(else_b, [], scope, infer_graph) or [declared_info(v) for v in else_b.outputs]
    return [TensorInfo(t.dtype, t.shape if t.shape == e.shape else None) for t, e in zip(then_i, else_i)]


def _if_cpu(node: Node, cond: np.ndarray, scope: Scope = None, interpreter: Interpreter | None = None) -> list[Any]:
    branch = node.attr("then_branch") if truth(cond, "If condition") else node.attr("else_branch")
    return run_body(branch, {}, scope, body_runner(branch, interpreter))


register_op("If", infer=_if_infer, cpu=_if_cpu, doc="runs then_branch or else_branch; both see the outer scope")


# -- Loop ---------------------------------------------------------------------------------------


def _loop_infer(node: Node, trip: TensorInfo | None, cond: TensorInfo | None, *carried: TensorInfo | None,
                scope: Mapping[str, TensorInfo] | None = None, infer_graph: GraphInference | None = None) -> list:
    """Carried values keep their shape when one body pass maps it to itself; scan outputs get
    (trip count, *per-iteration shape) only when the count is known and no condition can stop early."""
    body: Graph = node.attr("body")
    n = len(carried)
    states = [loop_state(c) for c in carried]
    inputs = [TensorInfo(np.int64, ()), TensorInfo(np.bool_, ()), *states]
    outs = infer_body(body, inputs, scope, infer_graph) or [declared_info(v) for v in body.outputs]
    infos: list[TensorInfo] = []
    for init, out in zip(carried, outs[1 : n + 1]):
        if init is None or init.dtype == object:  # optionals and sequences: what the body gives
            infos.append(out)
            continue
        infos.append(TensorInfo(init.dtype, init.shape if init.shape is not None and out.shape == init.shape else None))
    count = None
    if trip is not None and trip.value is not None and cond is None:
        count = int(np.asarray(trip.value).reshape(-1)[0])  # exactly M iterations unless the body stops it
        count = None if _may_stop(body) else count
    for out in outs[n + 1:]:
        infos.append(TensorInfo(out.dtype, None if count is None or out.shape is None else (count, *out.shape)))
    return infos


def _may_stop(body: Graph) -> bool:
    """Whether the body's condition output can be false: anything but a pass-through of its input."""
    cond_in, cond_out = body.inputs[1].name, body.outputs[0].name
    if cond_out == cond_in:
        return False
    producer = body.producers().get(cond_out)
    return not (producer is not None and producer.op_type == "Identity" and producer.inputs == [cond_in])


def _loop_cpu(node: Node, trip: np.ndarray | None, cond: np.ndarray | None, *carried: Any,
              scope: Scope = None, interpreter: Interpreter | None = None) -> list[Any]:
    """ONNX Loop: ``for i in range(M) while cond``; M and cond are each optional.

    Like onnxruntime (and the onnx reference), the body's condition output ends the loop even when
    the node has no condition input.
    """
    body: Graph = node.attr("body")
    n = len(carried)
    if len(body.inputs) != n + 2 or len(body.outputs) < n + 1:
        raise ExecutionError(f"Loop body takes {len(body.inputs)} inputs and gives {len(body.outputs)} outputs; "
                             f"with {n} loop-carried values it must take {n + 2} and give at least {n + 1}")
    limit = None if trip is None else int(np.asarray(trip).reshape(-1)[0])
    keep_going = True if cond is None else truth(cond, "Loop condition")
    runner = body_runner(body, interpreter)
    names = body.input_names
    values = list(carried)
    scans: list[list[Any]] = [[] for _ in body.outputs[n + 1:]]
    i = 0
    while keep_going and (limit is None or i < limit):
        feeds = {names[0]: np.array(i, dtype=np.int64), names[1]: np.array(keep_going), **dict(zip(names[2:], values))}
        outputs = run_body(body, feeds, scope, runner)
        keep_going = truth(outputs[0], "Loop body condition output")
        values = outputs[1 : n + 1]
        for acc, value in zip(scans, outputs[n + 1:]):
            acc.append(value)
        i += 1
    stacked = [np.stack([np.asarray(v) for v in acc]) if acc else empty_scan_output(decl)
               for acc, decl in zip(scans, body.outputs[n + 1:])]
    return [*values, *stacked]


register_op("Loop", infer=_loop_infer, cpu=_loop_cpu, doc="loop-carried values may be tensors, sequences or optionals")


# -- Scan ---------------------------------------------------------------------------------------


def _ints_attr(node: Node, key: str, count: int, default: int = 0) -> list[int]:
    values = list(node.attr(key) or [])
    if values and len(values) != count:
        raise ShapeInferenceError(f"Scan attribute {key} has {len(values)} entries, expected {count}")
    return [int(v) for v in values] or [default] * count


def _scan_layout(node: Node, n_scan_in: int, n_scan_out: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """(input axes, input directions, output axes, output directions); opset 8 knows only
    ``directions`` for its inputs (axes are fixed by its batch layout)."""
    if node.opset < 9:
        return [0] * n_scan_in, _ints_attr(node, "directions", n_scan_in), [0] * n_scan_out, [0] * n_scan_out
    return (
        _ints_attr(node, "scan_input_axes", n_scan_in),
        _ints_attr(node, "scan_input_directions", n_scan_in),
        _ints_attr(node, "scan_output_axes", n_scan_out),
        _ints_attr(node, "scan_output_directions", n_scan_out),
    )


def scan_steps(body: Graph, states: list[Any], scans: list[np.ndarray], layout: tuple[list[int], ...],
               scope: Scope, runner: BodyRunner) -> list[Any]:
    """One Scan over its scan inputs (no batch axis): final states, then stacked scan outputs."""
    in_axes, in_dirs, out_axes, out_dirs = layout
    slices = []
    for x, axis, direction in zip(scans, in_axes, in_dirs):
        x = np.moveaxis(x, normalize_axis(axis, x.ndim), 0)
        slices.append(x[::-1] if direction else x)
    lengths = {len(s) for s in slices}
    if len(lengths) != 1:
        raise ExecutionError(f"Scan inputs have different sequence lengths {sorted(lengths)}")
    n = len(states)
    outputs_per_step: list[list[Any]] = [[] for _ in body.outputs[n:]]
    for t in range(lengths.pop()):
        feeds = dict(zip(body.input_names, [*states, *(s[t] for s in slices)]))
        outputs = run_body(body, feeds, scope, runner)
        states = outputs[:n]
        for acc, value in zip(outputs_per_step, outputs[n:]):
            acc.append(np.asarray(value))
    results = list(states)
    for acc, decl, axis, direction in zip(outputs_per_step, body.outputs[n:], out_axes, out_dirs):
        stacked = np.stack(acc) if acc else empty_scan_output(decl)
        if direction:
            stacked = stacked[::-1]
        results.append(np.moveaxis(stacked, 0, normalize_axis(axis, stacked.ndim)))
    return results


def _scan9_cpu(node: Node, args: Sequence[Any], scope: Scope, interpreter: Interpreter | None) -> list[Any]:
    body: Graph = node.attr("body")
    n_scan_in = int(node.attr("num_scan_inputs"))
    n_state = len(args) - n_scan_in
    layout = _scan_layout(node, n_scan_in, len(body.outputs) - n_state)
    return scan_steps(body, list(args[:n_state]), list(args[n_state:]), layout, scope,
                      body_runner(body, interpreter))


def _scan8_cpu(node: Node, lens: np.ndarray | None, args: Sequence[Any], scope: Scope,
               interpreter: Interpreter | None) -> list[Any]:
    """Opset 8: every input has a batch axis 0 (scan inputs iterate over axis 1); each batch entry
    runs separately over its first ``sequence_lens[b]`` steps, and scan outputs are zero-padded."""
    body: Graph = node.attr("body")
    n_scan_in = int(node.attr("num_scan_inputs"))
    n_state = len(args) - n_scan_in
    layout = _scan_layout(node, n_scan_in, len(body.outputs) - n_state)
    batch = np.shape(args[0])[0]
    full = np.shape(args[n_state])[1]
    steps = np.full(batch, full, dtype=np.int64) if lens is None else np.asarray(lens, dtype=np.int64).reshape(-1)
    runner = body_runner(body, interpreter)
    per_batch = []
    for b in range(batch):
        scans = [x[b, : steps[b]] for x in args[n_state:]]
        per_batch.append(scan_steps(body, [s[b] for s in args[:n_state]], scans, layout, scope, runner))
    results = [np.stack([r[k] for r in per_batch]) for k in range(n_state)]
    for k in range(n_state, len(body.outputs)):
        items = [r[k] for r in per_batch]
        padded = [np.pad(x, [(0, full - len(x))] + [(0, 0)] * (x.ndim - 1)) for x in items]
        results.append(np.stack(padded))
    return results


def _scan_cpu(node: Node, *args: Any, scope: Scope = None, interpreter: Interpreter | None = None) -> list[Any]:
    if node.opset < 9:
        return _scan8_cpu(node, args[0], args[1:], scope, interpreter)
    return _scan9_cpu(node, args, scope, interpreter)


def _scan_slice(info: TensorInfo | None, axis: int, batched: bool) -> TensorInfo:
    """The info of one step of a scan input: the scan axis (and opset 8's batch axis) removed."""
    if info is None or info.shape is None:
        return TensorInfo(np.float32 if info is None else info.dtype, None)
    if batched:
        return TensorInfo(info.dtype, info.shape[2:])
    axis = normalize_axis(axis, len(info.shape))
    return TensorInfo(info.dtype, info.shape[:axis] + info.shape[axis + 1:])


def _scan_infer(node: Node, *args: TensorInfo | None, scope: Mapping[str, TensorInfo] | None = None,
                infer_graph: GraphInference | None = None) -> list[TensorInfo]:
    body: Graph = node.attr("body")
    n_scan_in = int(node.attr("num_scan_inputs"))
    batched = node.opset < 9
    if batched:
        args = args[1:]
    n_state = len(args) - n_scan_in
    in_axes, _, out_axes, _ = _scan_layout(node, n_scan_in, len(body.outputs) - n_state)
    states = [loop_state(a) for a in args[:n_state]]
    steps = [_scan_slice(a, axis, batched) for a, axis in zip(args[n_state:], in_axes)]
    body_states = [TensorInfo(s.dtype, s.shape[1:] if batched and s.shape else s.shape) for s in states]
    outs = infer_body(body, [*body_states, *steps], scope, infer_graph) or [declared_info(v) for v in body.outputs]
    first = args[n_state]
    length = batch = None
    if first is not None and first.shape is not None:
        length = first.shape[1] if batched else first.shape[normalize_axis(in_axes[0], len(first.shape))]
        batch = first.shape[0] if batched else None
    infos = [TensorInfo(out.dtype, init.shape) for init, out in zip(states, outs[:n_state])]
    for out, axis in zip(outs[n_state:], out_axes):
        if out.shape is None or length is None:
            infos.append(TensorInfo(out.dtype, None))
        elif batched:
            infos.append(TensorInfo(out.dtype, (batch, length, *out.shape)))
        else:
            at = normalize_axis(axis, len(out.shape) + 1)
            infos.append(TensorInfo(out.dtype, (*out.shape[:at], length, *out.shape[at:])))
    return infos


register_op("Scan", infer=_scan_infer, cpu=_scan_cpu, min_opset=8,
            doc="opset 8 (batched, sequence_lens) and 9+ (scan axes and directions)")
