"""ai.onnx.preview.training ops (Adagrad, Adam, Momentum) and loss functions.

Losses (default domain): NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss, which is
LogSoftmax over the class axis followed by the same NLL. Targets equal to ``ignore_index`` weigh 0
(and may lie outside [0, C)); 'mean' divides by the total weight of the counted targets, as the
spec's function bodies do.
"""

from __future__ import annotations

import numpy as np

from engine_core.ir import Node
from engine_core.ops.elementwise import compute_dtype, quiet
from engine_core.ops.registry import ShapeInferenceError, TensorInfo, register_op

# -- losses ------------------------------------------------------------------------------------------------


def _reduction(node: Node) -> str:
    reduction = node.attr("reduction", "mean")
    if reduction not in ("none", "sum", "mean"):
        raise ShapeInferenceError(f"{node.op_type}: reduction must be none, sum or mean, got {reduction!r}")
    return reduction


def negative_log_likelihood(log_prob: np.ndarray, target: np.ndarray, weight: np.ndarray | None,
                            reduction: str, ignore_index: int | None) -> np.ndarray:
    """-log_prob[n, target[n, d...], d...] * weight[target], reduced ('none', 'sum' or 'mean').

    log_prob is (N, C, d...), target (N, d...)."""
    target = target.astype(np.int64, copy=False)
    ignored = target == ignore_index if ignore_index is not None else np.zeros(target.shape, dtype=bool)
    safe = np.where(ignored, 0, target)
    loss = -np.take_along_axis(log_prob, safe[:, None], axis=1)[:, 0]
    weighted = weight is not None or ignore_index is not None
    if weighted:
        w = np.ones(target.shape, dtype=log_prob.dtype) if weight is None else weight.astype(log_prob.dtype)[safe]
        w = np.where(ignored, 0, w)
        loss = loss * w
    if reduction == "none":
        return loss
    if reduction == "sum":
        return np.sum(loss)
    return np.sum(loss) / np.sum(w) if weighted else np.mean(loss)


def _loss_infer(node: Node, scores: TensorInfo, target: TensorInfo, weight: TensorInfo | None = None) -> list[TensorInfo]:
    if scores.shape is not None and len(scores.shape) < 2:
        raise ShapeInferenceError(f"{node.op_type} needs an input (N, C, ...), got shape {scores.shape}")
    loss_shape = target.shape if _reduction(node) == "none" else ()
    outputs = [TensorInfo(scores.dtype, loss_shape)]
    if len(node.outputs) > 1:
        outputs.append(TensorInfo(scores.dtype, scores.shape))
    return outputs


@quiet
def _nll_cpu(node: Node, x: np.ndarray, target: np.ndarray, weight: np.ndarray | None = None) -> np.ndarray:
    work = compute_dtype(x.dtype)
    loss = negative_log_likelihood(x.astype(work, copy=False), target, weight, _reduction(node),
                                   node.attr("ignore_index"))
    return np.asarray(loss).astype(x.dtype)


@quiet
def _softmax_cross_entropy_cpu(node: Node, scores: np.ndarray, labels: np.ndarray,
                               weight: np.ndarray | None = None) -> list[np.ndarray]:
    """Loss and (optional second output) the log-probabilities, log_softmax over axis 1."""
    work = compute_dtype(scores.dtype)
    s = scores.astype(work, copy=False)
    shifted = s - np.max(s, axis=1, keepdims=True)
    log_prob = shifted - np.log(np.sum(np.exp(shifted), axis=1, keepdims=True))
    loss = negative_log_likelihood(log_prob, labels, weight, _reduction(node), node.attr("ignore_index"))
    outputs = [np.asarray(loss).astype(scores.dtype), log_prob.astype(scores.dtype, copy=False)]
    return outputs[: len(node.outputs)]


register_op("NegativeLogLikelihoodLoss", infer=_loss_infer, cpu=_nll_cpu, min_opset=12)
register_op("SoftmaxCrossEntropyLoss", infer=_loss_infer, cpu=_softmax_cross_entropy_cpu, min_opset=12)


# -- optimizers: Adagrad, Adam, Momentum (ai.onnx.preview.training) -----------------------------------
# Inputs are R (learning rate), T (update count), then equal-length groups X, G, [V], [H]: one entry
# per optimized tensor. Outputs are the new X, then the new V / H (never G). Math runs in float64 and
# each result is cast back to the dtype of the tensor it replaces.

TRAINING_DOMAIN = "ai.onnx.preview.training"


def optimizer_groups(node: Node, tensors: tuple, groups: int) -> list[list]:
    """Split the inputs after R and T into ``groups`` lists of equal length (X, G, V, H, ...)."""
    if not tensors or len(tensors) % groups:
        raise ShapeInferenceError(f"{node.op_type} needs {groups} equal groups of tensors after R and T, "
                                  f"got {len(tensors)} tensors")
    n = len(tensors) // groups
    return [list(tensors[i * n : (i + 1) * n]) for i in range(groups)]


def _optimizer_infer(groups: int):
    """Outputs mirror every input group except the gradients G (group 1)."""

    def infer(node: Node, r: TensorInfo, t: TensorInfo, *tensors: TensorInfo) -> list[TensorInfo]:
        parts = optimizer_groups(node, tensors, groups)
        return [TensorInfo(i.dtype, i.shape) for part in (parts[0], *parts[2:]) for i in part]

    return infer


def _f64(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _adagrad_cpu(node: Node, r: np.ndarray, t: np.ndarray, *tensors: np.ndarray) -> list[np.ndarray]:
    xs, gs, hs = optimizer_groups(node, tensors, 3)
    rate = float(r) / (1.0 + float(t) * node.attr("decay_factor", 0.0))
    norm, eps = node.attr("norm_coefficient", 0.0), node.attr("epsilon", 1e-6)
    new_x, new_h = [], []
    for x, g, h in zip(xs, gs, hs):
        g_reg = norm * _f64(x) + _f64(g)
        h_new = _f64(h) + g_reg * g_reg
        new_x.append((_f64(x) - rate * g_reg / (np.sqrt(h_new) + eps)).astype(x.dtype))
        new_h.append(h_new.astype(h.dtype))
    return [*new_x, *new_h]


register_op("Adagrad", domain=TRAINING_DOMAIN, infer=_optimizer_infer(3), cpu=_adagrad_cpu)


def _adam_cpu(node: Node, r: np.ndarray, t: np.ndarray, *tensors: np.ndarray) -> list[np.ndarray]:
    """Adam with bias correction folded into the rate (only once T > 0) and an optional final decay."""
    xs, gs, vs, hs = optimizer_groups(node, tensors, 4)
    alpha, beta = node.attr("alpha", 0.9), node.attr("beta", 0.999)
    norm, post, eps = node.attr("norm_coefficient", 0.0), node.attr("norm_coefficient_post", 0.0), node.attr("epsilon", 1e-6)
    step = float(t)
    rate = float(r) * np.sqrt(1 - beta**step) / (1 - alpha**step) if step > 0 else float(r)
    new_x, new_v, new_h = [], [], []
    for x, g, v, h in zip(xs, gs, vs, hs):
        g_reg = norm * _f64(x) + _f64(g)
        v_new = alpha * _f64(v) + (1 - alpha) * g_reg
        h_new = beta * _f64(h) + (1 - beta) * g_reg * g_reg
        x_new = _f64(x) - rate * v_new / (np.sqrt(h_new) + eps)
        new_x.append(((1 - post) * x_new).astype(x.dtype))
        new_v.append(v_new.astype(v.dtype))
        new_h.append(h_new.astype(h.dtype))
    return [*new_x, *new_v, *new_h]


register_op("Adam", domain=TRAINING_DOMAIN, infer=_optimizer_infer(4), cpu=_adam_cpu)


def _momentum_cpu(node: Node, r: np.ndarray, t: np.ndarray, *tensors: np.ndarray) -> list[np.ndarray]:
    """Standard or Nesterov momentum; the gradient's coefficient is 1 on the first update (T == 0)."""
    xs, gs, vs = optimizer_groups(node, tensors, 3)
    alpha, norm = node.attr("alpha"), node.attr("norm_coefficient")
    beta = node.attr("beta") if float(t) > 0 else 1.0
    mode = node.attr("mode")
    if mode not in ("standard", "nesterov"):
        raise ShapeInferenceError(f"Momentum mode must be 'standard' or 'nesterov', got {mode!r}")
    new_x, new_v = [], []
    for x, g, v in zip(xs, gs, vs):
        g_reg = norm * _f64(x) + _f64(g)
        v_new = alpha * _f64(v) + beta * g_reg
        step = v_new if mode == "standard" else g_reg + alpha * v_new
        new_x.append((_f64(x) - float(r) * step).astype(x.dtype))
        new_v.append(v_new.astype(v.dtype))
    return [*new_x, *new_v]


register_op("Momentum", domain=TRAINING_DOMAIN, infer=_optimizer_infer(3), cpu=_momentum_cpu)
