"""Recurrent layers (RNN, GRU, LSTM).

One driver serves all three: the input projections ``X @ W^T + Wb`` are computed for every time
step in one matmul, then a Python loop over time applies the op's cell (a few batched matmuls and
elementwise ops per step). ``sequence_lens`` is handled with a per-batch time permutation (reverse
runs each sequence backwards within its own length) and a mask that freezes a sequence's state
once it has ended, so Y is zero past each length and Y_h/Y_c hold the last valid step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from engine_core.ir import Node
from engine_core.ops.registry import ShapeInferenceError, TensorInfo, register_op

Activation = Callable[[np.ndarray], np.ndarray]
State = tuple[np.ndarray, ...]

# -- activation functions (the spec's list; names are matched case-insensitively) ----------------


def _sigmoid(x: np.ndarray, alpha: float, beta: float) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-x) overflowing to inf gives the right limit, 0
        return 1 / (1 + np.exp(-x))


def _softplus(x: np.ndarray, alpha: float, beta: float) -> np.ndarray:
    return np.logaddexp(0, x).astype(x.dtype, copy=False)


def _elu(x: np.ndarray, alpha: float, beta: float) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.where(x >= 0, x, alpha * (np.exp(x) - 1))


@dataclass(frozen=True)
class ActivationSpec:
    fn: Callable[[np.ndarray, float, float], np.ndarray]
    alpha: float | None = None  # default; None = the function takes no alpha
    beta: float | None = None


ACTIVATIONS: dict[str, ActivationSpec] = {
    "relu": ActivationSpec(lambda x, a, b: np.maximum(x, 0)),
    "tanh": ActivationSpec(lambda x, a, b: np.tanh(x)),
    "sigmoid": ActivationSpec(_sigmoid),
    "affine": ActivationSpec(lambda x, a, b: a * x + b, 1.0, 0.0),
    "leakyrelu": ActivationSpec(lambda x, a, b: np.where(x >= 0, x, a * x), 0.01),
    "thresholdedrelu": ActivationSpec(lambda x, a, b: np.where(x > a, x, 0), 1.0),
    "scaledtanh": ActivationSpec(lambda x, a, b: a * np.tanh(b * x), 1.0, 1.0),
    "hardsigmoid": ActivationSpec(lambda x, a, b: np.clip(a * x + b, 0, 1), 0.2, 0.5),
    "elu": ActivationSpec(_elu, 1.0),
    "softsign": ActivationSpec(lambda x, a, b: x / (1 + np.abs(x))),
    "softplus": ActivationSpec(_softplus),
}


def resolve_activations(node: Node, defaults: Sequence[str], directions: int) -> list[list[Activation]]:
    """The node's activation functions, one list per direction.

    ``activation_alpha``/``activation_beta`` are consumed in order by the functions that take
    them; a function finding its list exhausted uses its ONNX default.
    """
    names = list(node.attr("activations") or list(defaults) * directions)
    if len(names) != len(defaults) * directions:
        raise ShapeInferenceError(f"{node.op_type} needs {len(defaults) * directions} activations, got {names}")
    alphas, betas = iter(node.attr("activation_alpha") or []), iter(node.attr("activation_beta") or [])
    fns: list[Activation] = []
    for name in names:
        spec = ACTIVATIONS.get(str(name).lower())
        if spec is None:
            raise ShapeInferenceError(f"unknown activation function '{name}'")
        alpha = next(alphas, spec.alpha) if spec.alpha is not None else 0.0
        beta = next(betas, spec.beta) if spec.beta is not None else 0.0
        fns.append(_bind(spec.fn, alpha, beta))
    per = len(defaults)
    return [fns[d * per:(d + 1) * per] for d in range(directions)]


def _bind(fn: Callable[[np.ndarray, float, float], np.ndarray], alpha: float, beta: float) -> Activation:
    return lambda x: fn(x, alpha, beta)


# -- layer description ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RecurrentSpec:
    """What differs between RNN, GRU and LSTM for the shared driver."""

    gates: int
    activations: tuple[str, ...]
    states: int  # 1 (h) or 2 (h, c)


SPECS = {
    "RNN": RecurrentSpec(1, ("Tanh",), 1),
    "GRU": RecurrentSpec(3, ("Sigmoid", "Tanh"), 1),
    "LSTM": RecurrentSpec(4, ("Sigmoid", "Tanh", "Tanh"), 2),
}


def _directions(node: Node) -> int:
    direction = node.attr("direction", "forward")
    direction = direction.decode() if isinstance(direction, bytes) else direction
    if direction not in ("forward", "reverse", "bidirectional"):
        raise ShapeInferenceError(f"direction '{direction}' is not forward, reverse or bidirectional")
    return 2 if direction == "bidirectional" else 1


def _is_reverse(node: Node, index: int) -> bool:
    direction = node.attr("direction", "forward")
    direction = direction.decode() if isinstance(direction, bytes) else direction
    return direction == "reverse" or (direction == "bidirectional" and index == 1)


def _check_shapes(node: Node, x: tuple, w: tuple, r: tuple) -> tuple[int, int, int, int]:
    """(seq_length, batch, hidden, directions) after validating X/W/R shapes."""
    spec, dirs = SPECS[node.op_type], _directions(node)
    if len(x) != 3 or len(w) != 3 or len(r) != 3:
        raise ShapeInferenceError(f"{node.op_type} X, W, R must be 3-D, got {x}, {w}, {r}")
    seq, batch = (x[1], x[0]) if node.attr("layout", 0) else (x[0], x[1])
    hidden = r[2]
    if node.attr("hidden_size") not in (None, hidden):
        raise ShapeInferenceError(f"hidden_size {node.attr('hidden_size')} does not match R's {hidden}")
    if w[0] != dirs or r[0] != dirs:
        raise ShapeInferenceError(f"W/R have {w[0]}/{r[0]} directions, direction attribute needs {dirs}")
    if w[1] != spec.gates * hidden or r[1] != spec.gates * hidden or w[2] != x[2]:
        raise ShapeInferenceError(f"{node.op_type} W {w} / R {r} do not match input {x} and hidden size {hidden}")
    return seq, batch, hidden, dirs


def _recurrent_infer(node: Node, x: TensorInfo, w: TensorInfo, r: TensorInfo, *rest: TensorInfo | None):
    spec = SPECS[node.op_type]
    resolve_activations(node, spec.activations, _directions(node))
    if x.shape is None or w.shape is None or r.shape is None:
        return [TensorInfo(x.dtype, None)] * (1 + spec.states)
    seq, batch, hidden, dirs = _check_shapes(node, x.shape, w.shape, r.shape)
    if node.attr("layout", 0):
        y, state = (batch, seq, dirs, hidden), (batch, dirs, hidden)
    else:
        y, state = (seq, dirs, batch, hidden), (dirs, batch, hidden)
    return [TensorInfo(x.dtype, y)] + [TensorInfo(x.dtype, state)] * spec.states


# -- cells: one time step, all batch entries at once -------------------------------------------

Cell = Callable[[np.ndarray, State], State]


def _clipper(node: Node) -> Activation:
    clip = node.attr("clip")
    return (lambda x: x) if clip is None else (lambda x: np.clip(x, -clip, clip))


def rnn_cell(r: np.ndarray, rb: np.ndarray, fns: list[Activation], clip: Activation) -> Cell:
    """H = f(Xw + H R^T + Rb)."""
    (f,) = fns

    def step(xw: np.ndarray, state: State) -> State:
        return (f(clip(xw + state[0] @ r.T + rb)),)

    return step


def gru_cell(r: np.ndarray, rb: np.ndarray, fns: list[Activation], clip: Activation, linear_before_reset: bool) -> Cell:
    """Gates z, r, h; the reset gate applies before (default) or after the recurrent matmul."""
    f, g = fns
    hidden = r.shape[1]
    r_zr, r_h = r[: 2 * hidden].T, r[2 * hidden:].T
    rb_zr, rb_h = rb[: 2 * hidden], rb[2 * hidden:]

    def step(xw: np.ndarray, state: State) -> State:
        h = state[0]
        zr = f(clip(xw[:, : 2 * hidden] + h @ r_zr + rb_zr))
        z, reset = zr[:, :hidden], zr[:, hidden:]
        if linear_before_reset:
            candidate = g(clip(xw[:, 2 * hidden:] + reset * (h @ r_h + rb_h)))
        else:
            candidate = g(clip(xw[:, 2 * hidden:] + (reset * h) @ r_h + rb_h))
        return ((1 - z) * candidate + z * h,)

    return step


def lstm_cell(r: np.ndarray, rb: np.ndarray, p: np.ndarray, fns: list[Activation], clip: Activation,
              input_forget: bool) -> Cell:
    """Gates i, o, f, c with peepholes P = [Pi, Po, Pf]; input_forget couples f = 1 - i."""
    f, g, h_act = fns
    hidden = r.shape[1]
    p_i, p_o, p_f = p[:hidden], p[hidden: 2 * hidden], p[2 * hidden:]
    r_t = r.T

    def step(xw: np.ndarray, state: State) -> State:
        h, c = state
        gates = xw + h @ r_t + rb
        gi, go, gf, gc = (gates[:, k * hidden:(k + 1) * hidden] for k in range(4))
        i = f(clip(gi + p_i * c))
        forget = 1 - i if input_forget else f(clip(gf + p_f * c))
        c_new = forget * c + i * g(clip(gc))
        o = f(clip(go + p_o * c_new))
        return o * h_act(c_new), c_new

    return step


# -- the shared driver ---------------------------------------------------------------------------


def time_order(seq: int, lengths: np.ndarray, reverse: bool) -> np.ndarray:
    """(seq, batch) time index processed at each step: identity, or each sequence reversed
    within its own length (positions past the length map to themselves, so it is an involution)."""
    steps = np.arange(seq)[:, None]
    if not reverse:
        return np.broadcast_to(steps, (seq, len(lengths)))
    return np.where(steps < lengths[None, :], lengths[None, :] - 1 - steps, steps)


def scan(cell: Cell, xw: np.ndarray, state: State, active: np.ndarray | None) -> tuple[np.ndarray, State]:
    """Run ``cell`` over the (seq, batch, gates*hidden) projections; returns (hidden per step, final
    state). ``active`` (seq, batch, 1) freezes ended sequences and zeroes their outputs."""
    outputs = np.zeros((xw.shape[0], *state[0].shape), state[0].dtype)
    for t in range(xw.shape[0]):
        new = cell(xw[t], state)
        if active is None:
            state = new
            outputs[t] = new[0]
        else:
            state = tuple(np.where(active[t], n, s) for n, s in zip(new, state))
            outputs[t] = np.where(active[t], new[0], 0)
    return outputs, state


def _make_cell(node: Node, r: np.ndarray, rb: np.ndarray, p: np.ndarray | None,
               fns: list[Activation]) -> Cell:
    clip = _clipper(node)
    if node.op_type == "RNN":
        return rnn_cell(r, rb, fns, clip)
    if node.op_type == "GRU":
        return gru_cell(r, rb, fns, clip, bool(node.attr("linear_before_reset", 0)))
    return lstm_cell(r, rb, p, fns, clip, bool(node.attr("input_forget", 0)))


def _recurrent_cpu(node: Node, x: np.ndarray, w: np.ndarray, r: np.ndarray, b=None, sequence_lens=None,
                   initial_h=None, initial_c=None, p=None) -> list[np.ndarray]:
    spec = SPECS[node.op_type]
    seq, batch, hidden, dirs = _check_shapes(node, x.shape, w.shape, r.shape)
    layout = node.attr("layout", 0)
    out_dtype = x.dtype
    dtype = np.float32 if x.dtype.itemsize < 4 else x.dtype  # half types accumulate in float32
    if layout:
        x = x.swapaxes(0, 1)
        initial_h = None if initial_h is None else initial_h.swapaxes(0, 1)
        initial_c = None if initial_c is None else initial_c.swapaxes(0, 1)
    x, w, r = x.astype(dtype), w.astype(dtype), r.astype(dtype)
    gh = spec.gates * hidden
    b = np.zeros((dirs, 2 * gh), dtype) if b is None else b.astype(dtype)
    p = np.zeros((dirs, 3 * hidden), dtype) if p is None else p.astype(dtype)
    zeros = np.zeros((dirs, batch, hidden), dtype)
    h0 = zeros if initial_h is None else initial_h.astype(dtype)
    c0 = zeros if initial_c is None else initial_c.astype(dtype)
    lengths = np.full(batch, seq, np.int64) if sequence_lens is None else sequence_lens.astype(np.int64)
    if lengths.shape != (batch,) or np.any((lengths < 0) | (lengths > seq)):
        raise ShapeInferenceError(f"sequence_lens {lengths.tolist()} must be {batch} values in [0, {seq}]")
    active = None if np.all(lengths == seq) else (np.arange(seq)[:, None] < lengths)[..., None]
    activations = resolve_activations(node, spec.activations, dirs)
    columns = np.arange(batch)[None, :]

    ys, finals = [], []
    for d in range(dirs):
        order = time_order(seq, lengths, _is_reverse(node, d))
        xw = (x @ w[d].T + b[d, :gh])[order, columns]
        cell = _make_cell(node, r[d], b[d, gh:], p[d], activations[d])
        state = (h0[d], c0[d])[: spec.states]
        outputs, final = scan(cell, xw, state, active)
        ys.append(outputs[order, columns])
        finals.append(final)
    y = np.stack(ys, axis=1)  # (seq, dirs, batch, hidden)
    states = [np.stack([f[k] for f in finals]) for k in range(spec.states)]  # (dirs, batch, hidden)
    if layout:
        y = y.transpose(2, 0, 1, 3)
        states = [s.swapaxes(0, 1) for s in states]
    return [a.astype(out_dtype, copy=False) for a in [y, *states]]


for _op in SPECS:
    register_op(_op, infer=_recurrent_infer, cpu=_recurrent_cpu, min_opset=7,
                doc=f"{_op} layer (directions, sequence_lens, layout, activations, clip)")
