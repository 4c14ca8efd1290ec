"""INT8 post-training calibration (IInt8Calibrator and friends) on the CPU backend.

The reference builder, given ``BuilderFlag.INT8`` and ``config.int8_calibrator`` on a network without
Q/DQ layers, (1) runs the float32 network over the calibrator's batches and records a histogram of
every activation tensor, (2) turns each histogram into a dynamic range ``amax`` (the calibration
table, which it hands to ``write_calibration_cache``), (3) builds the INT8 network from the table.
``read_calibration_cache`` returning a table skips steps 1-2. ``calibrate(graph, config)`` does
steps 1-2 here; ``passes/quantize_implicit.py`` does step 3.

Calibration runs before layer fusion (like IInt8EntropyCalibrator2 / IInt8MinMaxCalibrator), so a
cache names ONNX tensors and is portable between backends and builds.

Cache format (text, like the reference's): a header line ``KILN-<version>-<algorithm>``, then one
``<tensor>: <scale>`` line per tensor, the scale (``amax / 127``) as the 8 hex digits of its
big-endian float32 bits.
"""

from __future__ import annotations

import enum
import math
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from engine_core.errors import BuildError, KilnError
from engine_core.interpret import run_node, run_scoped
from engine_core.ir import Graph, has_subgraph, subgraph_reads
from engine_core.version import __version__

if TYPE_CHECKING:
    from engine_core.builder_config import BuilderConfig

#: int8 symmetric range used for implicit quantization: [-127, 127] (the reference's)
INT8_MAX = 127.0
#: histogram resolution of the entropy and percentile calibrators
HISTOGRAM_BINS = 2048


class CalibrationError(KilnError):
    """Calibration could not produce ranges: bad batches, a corrupt cache, no data."""


class CalibrationAlgoType(enum.IntEnum):
    """How a calibrator turns activation statistics into ranges (PERCENTILE is Kiln's)."""

    LEGACY_CALIBRATION = 0
    ENTROPY_CALIBRATION = 1
    ENTROPY_CALIBRATION_2 = 2
    MINMAX_CALIBRATION = 3
    PERCENTILE_CALIBRATION = 4


# -- statistics --------------------------------------------------------------------------------------


@dataclass
class TensorStats:
    """|x| statistics of one tensor over all calibration batches.

    The histogram covers [0, bins * width); when a larger value arrives the range doubles by merging
    neighbouring bins, so batches can stream in without a first pass to find the maximum.
    """

    bins: int = HISTOGRAM_BINS
    amax: float = 0.0
    width: float = 0.0
    counts: np.ndarray | None = None
    track_histogram: bool = True

    def add(self, x: np.ndarray) -> None:
        a = np.abs(np.asarray(x, dtype=np.float32)).ravel()
        a = a[np.isfinite(a)]
        if not a.size:
            return
        top = float(a.max())
        self.amax = max(self.amax, top)
        if not self.track_histogram:
            return
        if self.counts is None:
            self.width = (top if top > 0 else 1.0) / self.bins
            self.counts = np.zeros(self.bins, np.int64)
        while top >= self.width * self.bins:  # widen: merge bin pairs, double the bin width
            merged = self.counts.reshape(-1, 2).sum(axis=1)
            self.counts = np.concatenate([merged, np.zeros(self.bins - merged.size, np.int64)])
            self.width *= 2
        index = np.minimum((a / self.width).astype(np.int64), self.bins - 1)
        self.counts += np.bincount(index, minlength=self.bins)


def minmax_amax(stats: TensorStats) -> float:
    """The whole observed range: max |x| (IInt8MinMaxCalibrator)."""
    return stats.amax


def percentile_amax(stats: TensorStats, percentile: float) -> float:
    """The |x| value below which ``percentile`` % of the observed values lie (outliers clipped)."""
    if stats.counts is None or stats.counts.sum() == 0:
        return stats.amax
    cdf = np.cumsum(stats.counts) / stats.counts.sum()
    index = int(np.searchsorted(cdf, percentile / 100.0))
    return min(stats.amax, (index + 1) * stats.width)


def entropy_amax(stats: TensorStats, levels: int = 128, stride: int = 16) -> float:
    """The threshold whose 128-level quantization keeps the distribution closest in KL divergence
    to the original (IInt8EntropyCalibrator2): outliers folded into the last bin, then merged.
    Candidates are searched every ``stride`` bins, then bin by bin around the best (build time)."""
    counts = stats.counts
    if counts is None or not counts.any():
        return stats.amax
    last = int(np.flatnonzero(counts)[-1]) + 1
    if last <= levels:  # fewer occupied bins than levels: nothing to clip
        return stats.amax
    coarse = _best_threshold(counts, range(levels, last + 1, stride), levels)
    fine = range(max(levels, coarse - stride + 1), min(last, coarse + stride - 1) + 1)
    return min(stats.amax, _best_threshold(counts, fine, levels) * stats.width)


def _best_threshold(counts: np.ndarray, candidates: range, levels: int) -> int:
    best, best_kl = candidates[-1], math.inf
    for i in candidates:
        kl = _kl_divergence(counts, i, levels)
        if kl < best_kl:
            best, best_kl = i, kl
    return best


def _kl_divergence(counts: np.ndarray, i: int, levels: int) -> float:
    """KL(P || Q): P = the first ``i`` bins with the tail folded in, Q = P quantized to ``levels``."""
    p = counts[:i].astype(np.float64)
    p[-1] += counts[i:].sum()
    nonzero = counts[:i] != 0
    starts = (np.arange(levels) * i) // levels
    merged = np.add.reduceat(counts[:i].astype(np.float64), starts)
    occupied = np.add.reduceat(nonzero.astype(np.float64), starts)
    lengths = np.diff(np.append(starts, i))
    q = np.repeat(merged / np.maximum(occupied, 1), lengths) * nonzero
    p /= p.sum()
    q_sum = q.sum()
    if q_sum == 0:
        return math.inf
    q /= q_sum
    mask = p > 0
    if np.any(q[mask] == 0):
        return math.inf
    return float(np.sum(p[mask] * np.log(p[mask] / q[mask])))


# -- calibrators ------------------------------------------------------------------------------------


class IInt8Calibrator:
    """Supplies calibration batches and caches the resulting table (override the methods).

    ``get_batch(names)`` returns one host array per name (in that order; a dict by name is also
    accepted), or None when there are no more batches. Batches are ``get_batch_size()`` samples each.
    """

    algorithm = CalibrationAlgoType.ENTROPY_CALIBRATION_2

    def get_batch_size(self) -> int:
        return 1

    def get_batch(self, names: Sequence[str]) -> Sequence[np.ndarray] | Mapping[str, np.ndarray] | None:
        raise NotImplementedError("IInt8Calibrator.get_batch must be implemented")

    def get_algorithm(self) -> CalibrationAlgoType:
        return self.algorithm

    def read_calibration_cache(self) -> bytes | None:
        return None

    def write_calibration_cache(self, cache: bytes) -> None:
        return None

    # Kiln: whether ranges need histograms (min-max needs only the maximum), and the rule itself
    needs_histogram = True

    def compute_amax(self, stats: TensorStats) -> float:
        return entropy_amax(stats)


class IInt8EntropyCalibrator2(IInt8Calibrator):
    """KL-divergence threshold: suppresses outliers; the recommended calibrator for CNNs."""

    algorithm = CalibrationAlgoType.ENTROPY_CALIBRATION_2


class IInt8EntropyCalibrator(IInt8EntropyCalibrator2):
    """The original entropy calibrator (here the same threshold search, calibrated before fusion)."""

    algorithm = CalibrationAlgoType.ENTROPY_CALIBRATION


class IInt8MinMaxCalibrator(IInt8Calibrator):
    """The entire observed range: no clipping; works better for NLP (BERT) than entropy."""

    algorithm = CalibrationAlgoType.MINMAX_CALIBRATION
    needs_histogram = False

    def compute_amax(self, stats: TensorStats) -> float:
        return minmax_amax(stats)


class IInt8PercentileCalibrator(IInt8Calibrator):
    """Clip at a percentile of |x| (99.99 % suits BERT, per the reference's legacy calibrator)."""

    algorithm = CalibrationAlgoType.PERCENTILE_CALIBRATION
    percentile = 99.99

    def compute_amax(self, stats: TensorStats) -> float:
        return percentile_amax(stats, self.percentile)


#: --calibrator names -> the calibrator class they select
CALIBRATORS: dict[str, type[IInt8Calibrator]] = {
    "entropy": IInt8EntropyCalibrator2,
    "minmax": IInt8MinMaxCalibrator,
    "percentile": IInt8PercentileCalibrator,
}


class _DataSource:
    """A calibrator over in-memory batches with an optional cache file (what `kiln build` uses)."""

    def __init__(self, batches: Iterable[Mapping[str, np.ndarray]], cache_file: str | None = None,
                 percentile: float | None = None) -> None:
        self.batches = list(batches)
        self.cache_file = cache_file
        self.cache_bytes: bytes | None = None  # the last table written (also without a cache file)
        self._next = 0
        if percentile is not None:
            if not 0 < percentile <= 100:
                raise ValueError(f"percentile must be in (0, 100], got {percentile}")
            self.percentile = percentile

    def get_batch_size(self) -> int:
        first = next(iter(self.batches[0].values()), None) if self.batches else None
        return int(first.shape[0]) if first is not None and first.ndim else 1

    def get_batch(self, names: Sequence[str]) -> list[np.ndarray] | None:
        if self._next >= len(self.batches):
            return None
        batch = self.batches[self._next]
        self._next += 1
        missing = [n for n in names if n not in batch]
        if missing:
            raise CalibrationError(f"calibration batch {self._next - 1} has no data for input(s) {missing}")
        return [batch[n] for n in names]

    def read_calibration_cache(self) -> bytes | None:
        if self.cache_file and os.path.exists(self.cache_file):
            with open(self.cache_file, "rb") as f:
                self.cache_bytes = f.read()
            return self.cache_bytes
        return None

    def write_calibration_cache(self, cache: bytes) -> None:
        self.cache_bytes = bytes(cache)
        if self.cache_file:
            with open(self.cache_file, "wb") as f:
                f.write(cache)


def make_calibrator(batches: Iterable[Mapping[str, np.ndarray]], algorithm: str = "entropy",
                    cache_file: str | None = None, percentile: float | None = None) -> IInt8Calibrator:
    """A ready calibrator of kind ``algorithm`` (entropy|minmax|percentile) over ``batches``."""
    if algorithm not in CALIBRATORS:
        raise ValueError(f"unknown calibrator '{algorithm}': choose one of {', '.join(CALIBRATORS)}")
    cls = type(f"Data{CALIBRATORS[algorithm].__name__}", (_DataSource, CALIBRATORS[algorithm]), {})
    return cls(batches, cache_file, percentile)  # type: ignore[return-value]


def load_calibration_data(directory: str, input_names: Sequence[str]) -> list[dict[str, np.ndarray]]:
    """Batches from a directory: each ``.npz`` is one batch (keys = input names); ``NAME.npy`` or
    ``NAME_<k>.npy`` is batch k of input NAME; with one input, every ``.npy`` is a batch of it."""
    if not os.path.isdir(directory):
        raise CalibrationError(f"calibration data directory '{directory}' does not exist")
    files = sorted(f for f in os.listdir(directory) if f.endswith((".npy", ".npz")))
    if not files:
        raise CalibrationError(f"calibration data directory '{directory}' has no .npy or .npz files")
    batches: list[dict[str, np.ndarray]] = []
    by_index: dict[int, dict[str, np.ndarray]] = {}
    for name in files:
        path = os.path.join(directory, name)
        try:
            if name.endswith(".npz"):
                with np.load(path, allow_pickle=False) as data:
                    batches.append({k: data[k] for k in data.files})
                continue
            array = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise CalibrationError(f"cannot read calibration file '{path}': {e}") from None
        if len(input_names) == 1:  # one input: every .npy file is one batch of it
            by_index[len(by_index)] = {input_names[0]: array}
            continue
        tensor, index = _npy_target(name[:-4], input_names)
        if tensor is None:
            raise CalibrationError(f"calibration file '{name}' names no network input (inputs: "
                                   f"{list(input_names)}; use NAME.npy, NAME_<k>.npy or .npz batches)")
        by_index.setdefault(index, {})[tensor] = array
    batches.extend(by_index[k] for k in sorted(by_index))
    for k, batch in enumerate(batches):
        missing = [n for n in input_names if n not in batch]
        if missing:
            raise CalibrationError(f"calibration batch {k} in '{directory}' has no data for input(s) {missing}")
    return batches


def _npy_target(stem: str, input_names: Sequence[str]) -> tuple[str | None, int]:
    """Which input and batch index a .npy file stem (NAME or NAME_<k>) is for."""
    if stem in input_names:
        return stem, 0
    base, _, suffix = stem.rpartition("_")
    if base in input_names and suffix.isdigit():
        return base, int(suffix)
    return None, 0


# -- the calibration cache --------------------------------------------------------------------------


def serialize_cache(ranges: Mapping[str, float], algorithm: CalibrationAlgoType) -> bytes:
    """The calibration table as cache bytes (scale = amax / 127 per tensor)."""
    lines = [f"KILN-{__version__}-{_algo_label(algorithm)}"]
    for name, amax in ranges.items():
        scale = np.float32(amax / INT8_MAX)
        lines.append(f"{name}: {struct.pack('>f', scale).hex()}")
    return ("\n".join(lines) + "\n").encode()


def parse_cache(data: bytes) -> dict[str, float]:
    """Ranges (amax per tensor) from cache bytes; CalibrationError says what is wrong."""
    try:
        text = bytes(data).decode()
    except UnicodeDecodeError:
        raise CalibrationError("calibration cache is not text: not a Kiln calibration cache") from None
    lines = text.splitlines()
    if not lines or not (lines[0].startswith("KILN-") or lines[0].startswith("TRT-")):
        raise CalibrationError("calibration cache has no 'KILN-<version>-<algorithm>' header line")
    ranges: dict[str, float] = {}
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        name, sep, value = line.rpartition(":")
        try:
            if not sep or not name:
                raise ValueError
            scale = struct.unpack(">f", bytes.fromhex(value.strip()))[0]
        except (ValueError, struct.error):
            raise CalibrationError(f"calibration cache line {number} is not '<tensor>: <8 hex digits>': "
                                   f"{line[:80]!r}") from None
        if not math.isfinite(scale) or scale < 0:
            raise CalibrationError(f"calibration cache line {number}: tensor '{name}' has invalid scale {scale}")
        ranges[name] = float(scale) * INT8_MAX
    return ranges


def _algo_label(algorithm: CalibrationAlgoType) -> str:
    return {CalibrationAlgoType.ENTROPY_CALIBRATION_2: "EntropyCalibration2",
            CalibrationAlgoType.ENTROPY_CALIBRATION: "EntropyCalibration",
            CalibrationAlgoType.MINMAX_CALIBRATION: "MinMaxCalibration",
            CalibrationAlgoType.PERCENTILE_CALIBRATION: "PercentileCalibration"}.get(
                CalibrationAlgoType(algorithm), "LegacyCalibration")


# -- running the float network ---------------------------------------------------------------------


def run_observed(graph: Graph, feeds: Mapping[str, np.ndarray],
                 observe: Any) -> dict[str, np.ndarray]:
    """Run ``graph`` on the CPU backend, calling ``observe(name, array)`` for every float tensor
    (inputs and layer outputs) as it appears; intermediates are freed after their last reader."""
    env: dict[str, Any] = dict(graph.constants)
    env.update(feeds)
    env[""] = None
    keep = set(graph.output_names)
    last_use: dict[str, int] = {}
    for index, node in enumerate(graph.nodes):
        for name in (*node.inputs, *subgraph_reads(node)):
            last_use[name] = index
    for name, value in feeds.items():
        _observe_float(observe, name, value)
    for index, node in enumerate(graph.nodes):
        args = [env[name] for name in node.inputs]
        try:
            results = run_scoped(node, args, env) if has_subgraph(node) else run_node(node, args)
        except KilnError as e:
            raise CalibrationError(f"calibration run failed at layer {node}: {e}") from e
        except Exception as e:
            raise CalibrationError(f"calibration run failed at layer {node}: {type(e).__name__}: {e}") from e
        for name, value in zip(node.outputs, results):
            if name:
                env[name] = value
                _observe_float(observe, name, value)
        for name in node.inputs:
            if name and last_use.get(name) == index and name not in keep and name not in graph.constants:
                env.pop(name, None)
    return {name: env[name] for name in graph.output_names}


def _observe_float(observe: Any, name: str, value: Any) -> None:
    if isinstance(value, np.ndarray) and value.size and value.dtype.kind == "f":
        observe(name, value)


@dataclass
class _Collector:
    """Per-tensor statistics over all batches."""

    histogram: bool
    stats: dict[str, TensorStats] = field(default_factory=dict)

    def __call__(self, name: str, value: np.ndarray) -> None:
        if name not in self.stats:
            self.stats[name] = TensorStats(track_histogram=self.histogram)
        self.stats[name].add(value)


def calibrate(graph: Graph, config: BuilderConfig) -> dict[str, float]:
    """Dynamic range (amax) of every float tensor of ``graph``, from ``config.int8_calibrator``.

    A cache hit (``read_calibration_cache``) skips running; otherwise the float32 graph runs on the
    CPU backend over every batch and the table goes to ``write_calibration_cache``. ``graph`` is not
    modified. Raises BuildError naming the problem (no calibrator, bad batch, no batches, bad cache).
    """
    calibrator = getattr(config, "int8_calibrator", None)
    if calibrator is None:
        raise BuildError("BuilderFlag.INT8 on a network without Q/DQ layers needs config.int8_calibrator")
    try:
        cached = calibrator.read_calibration_cache()
        if cached:
            return parse_cache(cached)
        ranges = _run_calibration(graph, calibrator)
        calibrator.write_calibration_cache(serialize_cache(ranges, calibrator.get_algorithm()))
    except CalibrationError as e:
        raise BuildError(f"INT8 calibration: {e}") from None
    except KilnError:
        raise
    except Exception as e:  # the user's calibrator code failed: a build error, not a crash
        raise BuildError(f"INT8 calibration: the calibrator raised {type(e).__name__}: {e}") from e
    return ranges


def _run_calibration(graph: Graph, calibrator: IInt8Calibrator) -> dict[str, float]:
    inputs = [v for v in graph.inputs if v.is_tensor]
    names = [v.name for v in inputs]
    batch_size = int(calibrator.get_batch_size())
    collector = _Collector(histogram=getattr(calibrator, "needs_histogram", True))
    count = 0
    while True:
        batch = calibrator.get_batch(names)
        if batch is None:
            break
        feeds = _batch_feeds(batch, inputs, batch_size, count)
        run_observed(graph, feeds, collector)
        count += 1
    if count == 0:
        raise CalibrationError("the calibrator returned no batches (get_batch gave None at once)")
    return {name: float(calibrator.compute_amax(stats)) for name, stats in collector.stats.items()}


def _batch_feeds(batch: Sequence[np.ndarray] | Mapping[str, np.ndarray], inputs: list, batch_size: int,
                 index: int) -> dict[str, np.ndarray]:
    """Validated feeds for one batch: one array per input, right dtype kind, rank and batch size."""
    names = [v.name for v in inputs]
    if isinstance(batch, Mapping):
        missing = [n for n in names if n not in batch]
        if missing:
            raise CalibrationError(f"batch {index} has no data for input(s) {missing}")
        arrays = [batch[n] for n in names]
    else:
        arrays = list(batch)
        if len(arrays) != len(names):
            raise CalibrationError(f"batch {index}: get_batch returned {len(arrays)} arrays for {len(names)} "
                                   f"inputs {names}")
    feeds = {}
    for v, array in zip(inputs, arrays):
        array = np.asarray(array)
        if array.dtype != v.dtype:
            if array.dtype.kind == "f" and v.dtype.kind == "f":
                array = array.astype(v.dtype)
            else:
                raise CalibrationError(f"batch {index}: input '{v.name}' is {array.dtype}, the network "
                                       f"expects {v.dtype}")
        if v.shape is not None:
            if array.ndim != len(v.shape) or any(isinstance(d, int) and d >= 0 and d != s
                                                 for d, s in zip(v.shape, array.shape)):
                raise CalibrationError(f"batch {index}: input '{v.name}' has shape {list(array.shape)}, the "
                                       f"network declares {[d if isinstance(d, int) else '?' for d in v.shape]}")
        if array.ndim and array.shape[0] != batch_size:
            raise CalibrationError(f"batch {index}: input '{v.name}' holds {array.shape[0]} samples, "
                                   f"get_batch_size() says {batch_size}")
        feeds[v.name] = array
    return feeds


# -- the quantization report ------------------------------------------------------------------------


@dataclass
class LayerError:
    """How far one quantized layer's output is from the float32 network's, on one batch."""

    layer: str
    op_type: str
    tensor: str
    max_abs_error: float
    mean_abs_error: float
    #: max |error| / max |fp32 output|
    relative_error: float


def quantization_report(graph: Graph, feeds: Mapping[str, np.ndarray],
                        ranges: Mapping[str, float] | None = None) -> list[LayerError]:
    """Per-layer error of INT8 vs float32 on ``feeds``, at the network's own layers (before fusion).

    Implicit quantization (``ranges`` given): the float graph vs the graph quantize_implicit makes
    from it. Explicit Q/DQ model (no ``ranges``): the model vs the model with its activation
    Q -> DQ pairs bypassed (weights stay as the model quantized them). Layers reported: those that
    read a dequantized tensor.
    """
    import copy

    from engine_core.passes.quantize_implicit import quantize_implicit

    quantized = copy.deepcopy(graph)
    if ranges is not None:
        reference = graph
        quantize_implicit(quantized, ranges)
    else:
        reference = _bypass_activation_qdq(copy.deepcopy(graph))
    producers = quantized.producers()
    layers = [n for n in quantized.nodes if n.op_type not in ("QuantizeLinear", "DequantizeLinear")
              and any(producers.get(i) is not None and producers[i].op_type == "DequantizeLinear" for i in n.inputs)]
    watched = {n.outputs[0]: n for n in layers if n.outputs and n.outputs[0]}
    if not watched:
        return []
    expected: dict[str, np.ndarray] = {}
    actual: dict[str, np.ndarray] = {}
    run_observed(reference, feeds, lambda name, value: expected.__setitem__(name, value) if name in watched else None)
    run_observed(quantized, feeds, lambda name, value: actual.__setitem__(name, value) if name in watched else None)
    rows = []
    for tensor, node in watched.items():
        if tensor not in expected or tensor not in actual:
            continue
        ref = expected[tensor].astype(np.float64)
        diff = np.abs(actual[tensor].astype(np.float64) - ref)
        scale = float(np.abs(ref).max()) if ref.size else 0.0
        rows.append(LayerError(node.name, node.op_type, tensor, float(diff.max()), float(diff.mean()),
                               float(diff.max()) / scale if scale > 0 else 0.0))
    return rows


def _bypass_activation_qdq(graph: Graph) -> Graph:
    """Readers of DQ(Q(x)) read x instead: the float network a Q/DQ model simulates."""
    producers = graph.producers()
    for node in graph.nodes:
        for k, name in enumerate(node.inputs):
            dq = producers.get(name)
            if dq is None or dq.op_type != "DequantizeLinear" or dq.domain:
                continue
            q = producers.get(dq.inputs[0])
            if q is not None and q.op_type == "QuantizeLinear" and not q.domain:
                node.inputs[k] = q.inputs[0]
    for out in graph.outputs:  # a graph output written by a DQ keeps its name: feed it the float value
        dq = producers.get(out.name)
        q = producers.get(dq.inputs[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
        if q is not None and q.op_type == "QuantizeLinear":
            dq.op_type, dq.inputs, dq.attrs = "Identity", [q.inputs[0]], {}
    return graph
