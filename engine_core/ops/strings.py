"""String ops (StringConcat, StringNormalizer, StringSplit, RegexFullMatch).

String tensors are numpy object arrays of python ``str`` (the ONNX importer's form). Values may
also arrive as ``bytes`` (Constant nodes' string attributes), so inputs go through ``as_text``
first. Work is done on numpy unicode arrays (``np.strings``) where numpy has the operation, and
through ``np.frompyfunc`` (one ufunc call over the whole tensor) where only Python's ``str`` does.
Outputs are object arrays again, like the inputs.
"""

from __future__ import annotations

import itertools
import re
from typing import Any

import numpy as np

from engine_core.ir import Node
from engine_core.ops.registry import ShapeInferenceError, TensorInfo, broadcast_infer, register_op

OBJECT = np.dtype(object)


def _to_str(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


_decode = np.frompyfunc(_to_str, 1, 1)


def as_text(x: np.ndarray) -> np.ndarray:
    """A string tensor as a numpy unicode array (bytes decoded as UTF-8)."""
    x = np.asarray(x)
    if x.dtype.kind == "U":
        return x
    if x.size == 0:
        return np.zeros(x.shape, dtype=np.str_)
    return np.asarray(_decode(x)).astype(np.str_)


def as_objects(x: np.ndarray) -> np.ndarray:
    """Back to the object-array form string tensors have everywhere else in Kiln."""
    return np.asarray(x).astype(object)


def _require_strings(info: TensorInfo, op: str) -> None:
    if info.dtype.kind not in "OSU":
        raise ShapeInferenceError(f"{op} takes string tensors, got {info.dtype}")


# -- StringConcat -------------------------------------------------------------------------------


def _concat_infer(node: Node, x: TensorInfo, y: TensorInfo) -> TensorInfo:
    _require_strings(x, "StringConcat")
    _require_strings(y, "StringConcat")
    return broadcast_infer(OBJECT)(node, x, y)


register_op(
    "StringConcat",
    infer=_concat_infer,
    cpu=lambda node, x, y: as_objects(np.strings.add(as_text(x), as_text(y))),
    min_opset=20,
)


# -- StringNormalizer ---------------------------------------------------------------------------


def _normalizer_infer(node: Node, x: TensorInfo) -> TensorInfo:
    _require_strings(x, "StringNormalizer")
    if x.shape is not None and not (len(x.shape) == 1 or (len(x.shape) == 2 and x.shape[0] == 1)):
        raise ShapeInferenceError(f"StringNormalizer takes shape [C] or [1, C], got {list(x.shape)}")
    if node.attr("stopwords"):
        return TensorInfo(OBJECT, None)  # how many elements survive depends on the data
    return TensorInfo(OBJECT, x.shape)


def _change_case(text: np.ndarray, action: str) -> np.ndarray:
    if action == "LOWER":
        return np.strings.lower(text)
    if action == "UPPER":
        return np.strings.upper(text)
    if action != "NONE":
        raise ValueError(f"StringNormalizer case_change_action must be LOWER, UPPER or NONE, got {action!r}")
    return text


def _normalizer_cpu(node: Node, x: np.ndarray) -> np.ndarray:
    """Drop elements equal to a stopword (ignoring case unless is_case_sensitive), then change case.

    An input of [C] or [1, C] keeps its rank; when every element is dropped the result is one
    empty string, as the spec says.
    """
    text = as_text(x)
    row = text.reshape(-1)
    stopwords = np.array(node.attr("stopwords") or [], dtype=np.str_)
    if stopwords.size:
        if node.attr("is_case_sensitive", 0):
            row = row[~np.isin(row, stopwords)]
        else:
            row = row[~np.isin(np.strings.lower(row), np.strings.lower(stopwords))]
    row = _change_case(row, node.attr("case_change_action", "NONE"))
    if row.size == 0:
        row = np.array([""], dtype=np.str_)
    return as_objects(row.reshape(1, -1) if text.ndim == 2 else row)


register_op("StringNormalizer", infer=_normalizer_infer, cpu=_normalizer_cpu, min_opset=10)


# -- StringSplit --------------------------------------------------------------------------------


def _split_infer(node: Node, x: TensorInfo) -> list[TensorInfo]:
    _require_strings(x, "StringSplit")
    return [TensorInfo(OBJECT, None), TensorInfo(np.int64, x.shape)]


def _split_cpu(node: Node, x: np.ndarray) -> list[np.ndarray]:
    """Python's str.split semantics, which the spec follows: no (or an empty) delimiter splits on
    runs of whitespace; ``maxsplit`` caps the splits. Rows are padded with "" to the longest."""
    delimiter = node.attr("delimiter") or None
    maxsplit = node.attr("maxsplit")
    maxsplit = -1 if maxsplit is None else int(maxsplit)
    text = as_text(x)
    flat = text.reshape(-1)
    pieces = np.frompyfunc(lambda s: s.split(delimiter, maxsplit), 1, 1)(flat)
    lengths = np.frompyfunc(len, 1, 1)(pieces).astype(np.int64)
    width = int(lengths.max(initial=0))
    rows = np.repeat(np.arange(flat.size), lengths)
    cols = np.arange(rows.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    values = np.empty(rows.size, dtype=object)
    values[:] = list(itertools.chain.from_iterable(pieces))
    out = np.full((flat.size, width), "", dtype=object)
    out[rows, cols] = values
    return [out.reshape(*text.shape, width), lengths.reshape(text.shape)]


register_op("StringSplit", infer=_split_infer, cpu=_split_cpu, min_opset=20)


# -- RegexFullMatch -----------------------------------------------------------------------------


def _regex_infer(node: Node, x: TensorInfo) -> TensorInfo:
    _require_strings(x, "RegexFullMatch")
    try:
        re.compile(node.attr("pattern", ""))
    except re.error as e:
        raise ShapeInferenceError(f"RegexFullMatch pattern {node.attr('pattern')!r} is invalid: {e}") from None
    return TensorInfo(np.bool_, x.shape)


def _regex_cpu(node: Node, x: np.ndarray) -> np.ndarray:
    """The spec names RE2 syntax; Python's ``re`` accepts a superset of the forms models use."""
    pattern = re.compile(node.attr("pattern", ""))
    text = as_text(x)
    if text.size == 0:
        return np.zeros(text.shape, dtype=np.bool_)
    return np.asarray(np.frompyfunc(lambda s: pattern.fullmatch(s) is not None, 1, 1)(text)).astype(np.bool_)


register_op("RegexFullMatch", infer=_regex_infer, cpu=_regex_cpu, min_opset=20)
