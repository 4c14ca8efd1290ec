"""ai.onnx.ml domain ops (LabelEncoder, TreeEnsemble, Binarizer, ArrayFeatureExtractor), and
TfIdfVectorizer (default domain, but the same family of text-feature models).

Table lookups (LabelEncoder, TfIdfVectorizer's n-gram pool) are sorted once per call and matched
with ``searchsorted``/``np.unique``; trees are walked level by level for all samples and trees at
once, so the Python loops run over tree depth, never over samples.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine_core.errors import ExecutionError
from engine_core.ir import Node
from engine_core.ops.registry import ShapeInferenceError, TensorInfo, register_op, same_as_input
from engine_core.ops.strings import as_objects, as_text

ML = "ai.onnx.ml"
OBJECT = np.dtype(object)


# -- Binarizer / ArrayFeatureExtractor ----------------------------------------------------------


def _binarizer_cpu(node: Node, x: np.ndarray) -> np.ndarray:
    return (x > node.attr("threshold", 0.0)).astype(x.dtype)


register_op("Binarizer", domain=ML, infer=same_as_input(), cpu=_binarizer_cpu)


def _extractor_shape(x_shape: tuple[int, ...], count: int) -> tuple[int, ...]:
    """Like onnxruntime: the last axis is replaced by the selected columns; a vector becomes [1, n]."""
    return (1, count) if len(x_shape) == 1 else (*x_shape[:-1], count)


def _extractor_infer(node: Node, x: TensorInfo, indices: TensorInfo) -> TensorInfo:
    if x.shape is None or indices.shape is None:
        return TensorInfo(x.dtype, None)
    return TensorInfo(x.dtype, _extractor_shape(x.shape, int(np.prod(indices.shape))))


def _extractor_cpu(node: Node, x: np.ndarray, indices: np.ndarray) -> np.ndarray:
    columns = np.asarray(indices, dtype=np.int64).reshape(-1)
    last = x.shape[-1]
    if columns.size and (columns.min() < 0 or columns.max() >= last):
        raise ExecutionError(f"ArrayFeatureExtractor indices {columns.tolist()} are out of range for {last} columns")
    return x[..., columns].reshape(_extractor_shape(x.shape, columns.size))


register_op("ArrayFeatureExtractor", domain=ML, infer=_extractor_infer, cpu=_extractor_cpu)


# -- LabelEncoder -------------------------------------------------------------------------------


#: Per-kind defaults of LabelEncoder's default_* attributes (string, integer, float values).
_LABEL_DEFAULTS = {"O": "_Unused", "i": -1, "u": 0, "f": -0.0}


def _label_table(node: Node) -> tuple[np.ndarray, np.ndarray, Any]:
    """(keys, values, default) from whichever attribute form the node uses (opset 1-4)."""
    key_forms = (("keys_tensor", None), ("keys_strings", OBJECT), ("keys_int64s", np.int64), ("keys_floats", np.float32))
    keys = next((np.asarray(node.attr(k), dtype=d).reshape(-1) for k, d in key_forms if node.attr(k) is not None),
                np.array([], dtype=np.float32))
    value_forms = (("values_tensor", None, "default_tensor"), ("values_strings", OBJECT, "default_string"),
                   ("values_int64s", np.int64, "default_int64"), ("values_floats", np.float32, "default_float"))
    for values_key, dtype, default_key in value_forms:
        if node.attr(values_key) is None:
            continue
        values = np.asarray(node.attr(values_key), dtype=dtype).reshape(-1)
        default = node.attr(default_key)
        if default is None:
            default = _LABEL_DEFAULTS.get(values.dtype.kind, 0)
        elif isinstance(default, np.ndarray):
            default = default.reshape(-1)[0]
        return keys, values, default
    raise ShapeInferenceError("LabelEncoder has no values_* attribute")


def _label_infer(node: Node, x: TensorInfo) -> TensorInfo:
    keys, values, _ = _label_table(node)
    if len(keys) != len(values):
        raise ShapeInferenceError(f"LabelEncoder has {len(keys)} keys but {len(values)} values")
    return TensorInfo(values.dtype, x.shape)


def _label_cpu(node: Node, x: np.ndarray) -> np.ndarray:
    """Sort the keys once, binary-search every input, and keep hits; NaN keys match NaN inputs."""
    keys, values, default = _label_table(node)
    if keys.dtype.kind in "OSU":
        keys, x = as_text(keys), as_text(x)
    out_dtype = values.dtype
    if keys.size == 0:
        return np.full(x.shape, default, dtype=out_dtype)
    order = np.argsort(keys, kind="stable")
    keys, values = keys[order], values[order]
    slot = np.clip(np.searchsorted(keys, x), 0, keys.size - 1)
    hit = keys[slot] == x
    if keys.dtype.kind == "f":
        hit |= np.isnan(keys[slot]) & np.isnan(x)
    out = np.where(hit, values[slot], np.array(default, dtype=out_dtype))
    return as_objects(out) if out_dtype.kind == "O" else out.astype(out_dtype)


register_op("LabelEncoder", domain=ML, infer=_label_infer, cpu=_label_cpu)


# -- TreeEnsemble (ai.onnx.ml opset 5) ------------------------------------------------------------

#: nodes_modes values: BRANCH_LEQ, LT, GTE, GT, EQ, NEQ, MEMBER.
LEQ, LT, GTE, GT, EQ, NEQ, MEMBER = range(7)


def _branch_taken(mode: np.ndarray, x: np.ndarray, split: np.ndarray) -> np.ndarray:
    """Whether each (sample, node) pair takes the true branch, for the comparison modes."""
    return np.select(
        [mode == LEQ, mode == LT, mode == GTE, mode == GT, mode == EQ, mode == NEQ],
        [x <= split, x < split, x >= split, x > split, x == split, x != split],
        default=False,
    )


def _member_sets(modes: np.ndarray, members: np.ndarray | None) -> dict[int, np.ndarray]:
    """MEMBER node index -> its set; ``membership_values`` lists the sets in node order, NaN-separated."""
    member_nodes = np.flatnonzero(modes == MEMBER)
    if member_nodes.size == 0:
        return {}
    if members is None:
        raise ShapeInferenceError("TreeEnsemble has MEMBER nodes but no membership_values")
    members = np.asarray(members, dtype=np.float64)
    groups = np.split(members, np.flatnonzero(np.isnan(members)) + 1)
    groups = [g[~np.isnan(g)] for g in groups][: member_nodes.size]
    if len(groups) != member_nodes.size:
        raise ShapeInferenceError(f"membership_values holds {len(groups)} sets for {member_nodes.size} MEMBER nodes")
    return dict(zip(member_nodes.tolist(), groups))


def walk_trees(x: np.ndarray, roots: np.ndarray, root_is_leaf: np.ndarray, tree: dict[str, np.ndarray],
               members: dict[int, np.ndarray]) -> np.ndarray:
    """Leaf index reached by every (sample, tree): all samples and trees advance one level per step."""
    samples = x.shape[0]
    node = np.broadcast_to(roots, (samples, roots.size)).copy()
    at_leaf = np.broadcast_to(root_is_leaf, (samples, roots.size)).copy()
    sample = np.broadcast_to(np.arange(samples)[:, None], node.shape)
    for _ in range(len(tree["modes"]) + 1):
        active = ~at_leaf
        if not active.any():
            return node
        n, s = node[active], sample[active]
        value = x[s, tree["features"][n]].astype(np.float64)
        taken = _branch_taken(tree["modes"][n], value, tree["splits"][n])
        for member, values in members.items():
            here = n == member
            taken[here] = np.isin(value[here], values)
        taken |= tree["missing_true"][n] & np.isnan(value)
        node[active] = np.where(taken, tree["true_ids"][n], tree["false_ids"][n])
        at_leaf[active] = np.where(taken, tree["true_leaf"][n], tree["false_leaf"][n])
    raise ExecutionError("TreeEnsemble trees contain a cycle")


def post_transform(scores: np.ndarray, kind: int | str) -> np.ndarray:
    """NONE, SOFTMAX, LOGISTIC, SOFTMAX_ZERO or PROBIT over the last axis, numbered as the spec
    numbers them (0-4; onnxruntime 1.32's TreeEnsemble swaps 1 and 2)."""
    kind = {"NONE": 0, "SOFTMAX": 1, "LOGISTIC": 2, "SOFTMAX_ZERO": 3, "PROBIT": 4}.get(kind, kind)
    if kind == 1:
        e = np.exp(scores - scores.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)
    if kind == 2:
        return 1.0 / (1.0 + np.exp(-scores))
    if kind == 3:  # softmax over the non-zero scores; zeros stay zero
        nonzero = scores != 0
        e = np.where(nonzero, np.exp(scores - np.where(nonzero, scores, -np.inf).max(axis=-1, keepdims=True)), 0.0)
        total = e.sum(axis=-1, keepdims=True)
        return np.divide(e, total, out=np.zeros_like(e), where=total > 0)
    if kind == 4:
        return np.sqrt(2.0) * erfinv(2.0 * scores - 1.0)
    return scores


def erfinv(x: np.ndarray) -> np.ndarray:
    """Inverse error function, by the closed-form approximation onnxruntime's PROBIT uses."""
    a = 0.147
    log = np.log((1.0 - x) * (1.0 + x))
    v = 2.0 / (np.pi * a) + 0.5 * log
    return np.sign(x) * np.sqrt(np.sqrt(v * v - log / a) - v)


def aggregate(values: np.ndarray, targets: np.ndarray, n_targets: int, how: int, trees: int) -> np.ndarray:
    """Combine per-(sample, tree) leaf values into [samples, n_targets]: SUM, AVERAGE, MIN, MAX."""
    samples = values.shape[0]
    flat = (np.arange(samples)[:, None] * n_targets + targets).reshape(-1)
    if how in (0, 1):  # AVERAGE, SUM
        total = np.bincount(flat, weights=values.reshape(-1), minlength=samples * n_targets)
        return total.reshape(samples, n_targets) / (trees if how == 0 else 1)
    ufunc, start = (np.minimum, np.inf) if how == 2 else (np.maximum, -np.inf)
    out = np.full(samples * n_targets, start)
    ufunc.at(out, flat, values.reshape(-1))
    reached = np.bincount(flat, minlength=samples * n_targets) > 0
    return np.where(reached, out, 0.0).reshape(samples, n_targets)  # onnxruntime's 0 for unreached targets


def _tree_arrays(node: Node) -> dict[str, np.ndarray]:
    def ints(key: str) -> np.ndarray:
        return np.asarray(node.attr(key), dtype=np.int64).reshape(-1)

    modes = np.asarray(node.attr("nodes_modes"), dtype=np.int64).reshape(-1)
    missing = node.attr("nodes_missing_value_tracks_true")
    return {
        "modes": modes,
        "features": ints("nodes_featureids"),
        "splits": np.asarray(node.attr("nodes_splits"), dtype=np.float64).reshape(-1),
        "true_ids": ints("nodes_truenodeids"),
        "false_ids": ints("nodes_falsenodeids"),
        "true_leaf": ints("nodes_trueleafs").astype(bool),
        "false_leaf": ints("nodes_falseleafs").astype(bool),
        "missing_true": (np.zeros(modes.size, bool) if missing is None else np.asarray(missing, dtype=bool)),
    }


def _tree_ensemble_infer(node: Node, x: TensorInfo) -> TensorInfo:
    rows = None if x.shape is None else x.shape[0]
    return TensorInfo(x.dtype, None if rows is None else (rows, int(node.attr("n_targets"))))


def _tree_ensemble_cpu(node: Node, x: np.ndarray) -> np.ndarray:
    tree = _tree_arrays(node)
    members = _member_sets(tree["modes"], node.attr("membership_values"))
    roots = np.asarray(node.attr("tree_roots"), dtype=np.int64)
    root_is_leaf = tree["true_leaf"][roots] & tree["false_leaf"][roots] & (
        tree["true_ids"][roots] == tree["false_ids"][roots])
    samples = x.reshape(x.shape[0], -1) if x.ndim != 2 else x
    leaves = walk_trees(samples, roots, root_is_leaf, tree, members)
    weights = np.asarray(node.attr("leaf_weights"), dtype=np.float64).reshape(-1)[leaves]
    targets = np.asarray(node.attr("leaf_targetids"), dtype=np.int64)[leaves]
    n_targets = int(node.attr("n_targets"))
    scores = aggregate(weights, targets, n_targets, int(node.attr("aggregate_function", 1)), roots.size)
    return post_transform(scores, int(node.attr("post_transform", 0))).astype(x.dtype)


register_op("TreeEnsemble", domain=ML, infer=_tree_ensemble_infer, cpu=_tree_ensemble_cpu, min_opset=5)


# -- TfIdfVectorizer (default domain) -------------------------------------------------------------


def _pool_ngrams(node: Node) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """(n, pool n-grams [count, n], their output columns) for each n in [min, max]_gram_length.

    The pool lists all 1-grams, then all 2-grams, ...; ``ngram_counts[i]`` is where the
    (i+1)-grams start, and n-grams are numbered across all sizes for ``ngram_indexes``.
    """
    pool = _pool(node)
    starts = [int(s) for s in node.attr("ngram_counts")]
    ends = starts[1:] + [len(pool)]
    columns = np.asarray(node.attr("ngram_indexes"), dtype=np.int64)
    lo, hi = int(node.attr("min_gram_length")), int(node.attr("max_gram_length"))
    result, first_id = [], 0
    for n, (start, end) in enumerate(zip(starts, ends), start=1):
        count = (end - start) // n
        if lo <= n <= hi and count:
            result.append((n, pool[start : start + count * n].reshape(count, n), columns[first_id : first_id + count]))
        first_id += count
    return result


def _pool(node: Node) -> np.ndarray:
    strings = node.attr("pool_strings")
    return as_text(np.array(strings, dtype=object)) if strings is not None else np.asarray(node.attr("pool_int64s"), np.int64)


def token_ids(values: np.ndarray, vocabulary: np.ndarray) -> np.ndarray:
    """Position of each value in the sorted ``vocabulary``, -1 for values not in it."""
    if vocabulary.size == 0:
        return np.full(values.shape, -1, dtype=np.int64)
    slot = np.clip(np.searchsorted(vocabulary, values), 0, vocabulary.size - 1)
    return np.where(vocabulary[slot] == values, slot, -1)


def _match_rows(table: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Index in ``table`` of each row of ``rows`` (both [*, n]), or -1 where it is absent."""
    both = np.concatenate([table, rows])
    _, inverse = np.unique(both, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    lookup = np.full(inverse.max() + 1, -1, dtype=np.int64)
    lookup[inverse[: len(table)]] = np.arange(len(table))
    return lookup[inverse[len(table):]]


def _output_size(node: Node) -> int:
    columns = node.attr("ngram_indexes")
    return int(max(columns)) + 1 if columns else 0


def _tfidf_infer(node: Node, x: TensorInfo) -> TensorInfo:
    if x.shape is not None and len(x.shape) > 2:
        raise ShapeInferenceError(f"TfIdfVectorizer takes [C] or [B, C], got {list(x.shape)}")
    size = _output_size(node)
    if x.shape is None:
        return TensorInfo(np.float32, None)
    return TensorInfo(np.float32, (x.shape[0], size) if len(x.shape) == 2 else (size,))


def _tfidf_counts(node: Node, tokens: np.ndarray, size: int) -> np.ndarray:
    """N-gram counts [rows, size]: every window of n tokens spaced ``skip + 1`` apart is one hit;
    1-grams are counted once (the spacing does not apply to them)."""
    rows, length = tokens.shape
    counts = np.zeros(rows * size, dtype=np.int64)
    max_skip = int(node.attr("max_skip_count", 0))
    vocabulary = np.unique(_pool(node))
    tokens = token_ids(tokens, vocabulary)
    for n, table, columns in _pool_ngrams(node):
        table = token_ids(table, vocabulary)
        for step in range(1, (max_skip + 2) if n > 1 else 2):
            span = step * (n - 1)
            if span >= length:
                break
            offsets = np.arange(length - span)[:, None] + step * np.arange(n)
            windows = tokens[:, offsets].reshape(-1, n)
            found = _match_rows(table, windows)
            row_of = np.repeat(np.arange(rows), len(offsets))
            hit = found >= 0
            np.add.at(counts, row_of[hit] * size + columns[found[hit]], 1)
    return counts.reshape(rows, size)


def _tfidf_cpu(node: Node, x: np.ndarray) -> np.ndarray:
    size = _output_size(node)
    tokens = np.asarray(x)
    vector = tokens.ndim < 2
    tokens = tokens.reshape(1, -1) if vector else tokens
    if node.attr("pool_strings") is not None:
        tokens = as_text(tokens)
    else:
        tokens = tokens.astype(np.int64)
    counts = _tfidf_counts(node, tokens, size) if tokens.size else np.zeros((tokens.shape[0], size), np.int64)
    weights = node.attr("weights")
    if weights:  # weights[i] belongs to the i-th pool n-gram, which lands in column ngram_indexes[i]
        columns = np.asarray(node.attr("ngram_indexes"), dtype=np.int64)
        weights_by_column = np.zeros(size, dtype=np.float32)
        weights_by_column[columns] = np.asarray(weights, dtype=np.float32)[: columns.size]
        weights = weights_by_column
    else:
        weights = None
    mode = node.attr("mode")
    if mode == "TF":
        out = counts.astype(np.float32)
    elif mode == "IDF":
        out = (counts > 0).astype(np.float32) * (weights if weights is not None else 1.0)
    elif mode == "TFIDF":
        out = counts.astype(np.float32) * (weights if weights is not None else 1.0)
    else:
        raise ExecutionError(f"TfIdfVectorizer mode must be TF, IDF or TFIDF, got {mode!r}")
    return out.reshape(size) if vector else out


register_op("TfIdfVectorizer", infer=_tfidf_infer, cpu=_tfidf_cpu, min_opset=9)
