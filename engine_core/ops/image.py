"""Image / detection ops: Resize (and the deprecated Upsample), GridSample, AffineGrid, RoiAlign,
MaxRoiPool, NonMaxSuppression.

Resize is separable: each resized axis is one matrix product with an (out x in) interpolation
matrix whose rows hold the kernel taps of one output position (edge taps clamp, which is ONNX's
edge padding). Nearest mode is a gather instead, so integer images stay exact. Older forms
(Resize-10, Upsample-7/9, GridSample-16) are normalized at import into the current attribute set.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import ml_dtypes
import numpy as np

from engine_core.ir import Graph, Node
from engine_core.ops.registry import ShapeInferenceError, TensorInfo, register_op

# -- shared helpers ----------------------------------------------------------------------------------


def _present(value: np.ndarray | None) -> bool:
    """ONNX passes "no scales" / "no roi" either as an omitted input or as an empty tensor."""
    return value is not None and np.asarray(value).size > 0


def saturate_to(y: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """float64 result -> ``dtype``: integers are rounded half-to-even and clipped, floats clipped to
    the finite range (what the reference implementation does)."""
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return np.clip(np.rint(y), info.min, info.max).astype(dtype)
    if dtype == np.bool_:
        return y.astype(dtype)
    info = ml_dtypes.finfo(dtype) if dtype.kind == "V" else np.finfo(dtype)
    return np.clip(y, float(info.min), float(info.max)).astype(dtype)


def keys_cubic(d: np.ndarray, a: float) -> np.ndarray:
    """Keys' cubic convolution kernel at distances ``d`` (support [-2, 2])."""
    d = np.abs(d)
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    return np.where(d <= 1, near, np.where(d < 2, far, 0.0))


def triangle(d: np.ndarray) -> np.ndarray:
    """Linear interpolation kernel (support [-1, 1])."""
    return np.clip(1 - np.abs(d), 0, 1)


# -- Resize: geometry --------------------------------------------------------------------------------


def _resize_geometry(node: Node, shape: Sequence[int], roi: np.ndarray | None, scales: np.ndarray | None,
                     sizes: np.ndarray | None) -> tuple[list[float], list[int], list[float] | None]:
    """Per-axis scale, output size and (full-rank) roi, from whichever of scales/sizes is given."""
    rank = len(shape)
    axes = [a % rank if -rank <= a < rank else -1 for a in node.attr("axes", None) or range(rank)]
    if -1 in axes or len(set(axes)) != len(axes):
        raise ShapeInferenceError(f"Resize axes {node.attr('axes')} are invalid for rank {rank}")
    full_roi = None
    if _present(roi):
        roi = np.asarray(roi, dtype=np.float64).reshape(-1)
        if roi.size != 2 * len(axes):
            raise ShapeInferenceError(f"Resize roi has {roi.size} values, expected {2 * len(axes)}")
        full_roi = [0.0] * rank + [1.0] * rank
        for i, a in enumerate(axes):
            full_roi[a], full_roi[rank + a] = float(roi[i]), float(roi[len(axes) + i])
    if _present(scales) and _present(sizes):
        raise ShapeInferenceError("Resize takes scales or sizes, not both")
    if _present(scales):
        values = [float(s) for s in np.asarray(scales).reshape(-1)]
        if len(values) != len(axes) or any(s <= 0 for s in values):
            raise ShapeInferenceError(f"Resize scales {values} must be {len(axes)} positive values")
        factors = [1.0] * rank
        for a, s in zip(axes, values):
            factors[a] = s
        return factors, [int(f * d) for f, d in zip(factors, shape)], full_roi
    if not _present(sizes):
        raise ShapeInferenceError("Resize needs scales or sizes")
    wanted = [int(s) for s in np.asarray(sizes).reshape(-1)]
    if len(wanted) != len(axes):
        raise ShapeInferenceError(f"Resize sizes {wanted} must have {len(axes)} values")
    out = list(shape)
    for a, s in zip(axes, wanted):
        out[a] = s
    factors = [o / d if d else 1.0 for o, d in zip(out, shape)]
    policy = node.attr("keep_aspect_ratio_policy", "stretch")
    if policy != "stretch":
        if policy not in ("not_larger", "not_smaller"):
            raise ShapeInferenceError(f"unknown keep_aspect_ratio_policy {policy!r}")
        pick = min if policy == "not_larger" else max
        scale = pick(factors[a] for a in axes)
        factors = [scale if i in axes else 1.0 for i in range(rank)]
        out = [int(scale * d + 0.5) if i in axes else d for i, d in enumerate(shape)]
    return factors, out, full_roi


def _source_coords(mode: str, out_size: int, scale: float, in_size: int,
                   roi: tuple[float, float] | None) -> tuple[np.ndarray, np.ndarray | None]:
    """Input coordinate of each output index (and, for tf_crop_and_resize, which fall outside)."""
    y = np.arange(out_size, dtype=np.float64)
    # onnx's reference (and its test data) divide by the fractional output width scale * in_size
    # for align_corners / tf_crop_and_resize; onnxruntime uses the integer size, so the two differ
    # for non-integer scales. Kiln follows the test data.
    out_width = scale * in_size
    if mode == "align_corners":
        return (np.zeros(out_size) if out_width == 1 else y * (in_size - 1) / (out_width - 1)), None
    if mode == "asymmetric":
        return y / scale, None
    if mode == "pytorch_half_pixel":  # the spec's rule (onnx's reference uses -0.5 for a width of 1.0)
        return (np.zeros(out_size) if out_size <= 1 else (y + 0.5) / scale - 0.5), None
    if mode == "half_pixel":
        return (y + 0.5) / scale - 0.5, None
    if mode == "half_pixel_symmetric":
        offset = in_size / 2 * (1 - out_size / out_width)
        return offset + (y + 0.5) / scale - 0.5, None
    if mode == "tf_crop_and_resize":
        start, end = roi if roi is not None else (0.0, 1.0)
        if out_width == 1:
            x = np.full(out_size, (end - start) * (in_size - 1) / 2)
        else:
            x = y * (end - start) * (in_size - 1) / (out_width - 1)
        x = x + start * (in_size - 1)
        return x, (x < 0) | (x > in_size - 1)
    raise ShapeInferenceError(f"unknown coordinate_transformation_mode {mode!r}")


def _nearest_index(x: np.ndarray, mode: str, scale: float, in_size: int) -> np.ndarray:
    """Nearest input index per ``nearest_mode``; "simple" is the pre-opset-11 rule (ceil when
    downsampling, truncate otherwise) that Resize-10 and Upsample follow."""
    if mode == "round_prefer_floor":
        index = np.ceil(x - 0.5)
    elif mode == "round_prefer_ceil":
        index = np.floor(x + 0.5)
    elif mode == "floor":
        index = np.floor(x)
    elif mode == "ceil":
        index = np.ceil(x)
    elif mode == "simple":
        index = np.ceil(x) if scale < 1 else np.trunc(x)
    else:
        raise ShapeInferenceError(f"unknown nearest_mode {mode!r}")
    return np.clip(index, 0, in_size - 1).astype(np.intp)


def _interp_matrix(x: np.ndarray, in_size: int, cubic: bool, scale: float, antialias: bool, a: float,
                   exclude_outside: bool) -> np.ndarray:
    """(out x in) weights of linear/cubic interpolation at source coordinates ``x``.

    Taps sit at integer offsets ``start..start+n-1`` from ``base`` (the pixel left of x; an exact
    integer counts as the right end of its left interval, as in the reference). With antialias the
    kernel is stretched by 1/scale when downsampling and its weights renormalized.
    """
    radius = 2 if cubic else 1
    stretch = min(scale, 1.0) if antialias else 1.0
    start = math.floor(-radius / stretch) + 1
    taps = np.arange(start, 2 - start)
    base = np.floor(x)
    base = np.where(base == x, x - 1, base)
    ratio = x - base
    dist = (taps[None, :] - ratio[:, None]) * stretch
    weights = keys_cubic(dist, a) if cubic else triangle(dist)
    if antialias:
        weights = weights / weights.sum(axis=1, keepdims=True)
    index = base.astype(np.int64)[:, None] + taps[None, :]
    if exclude_outside:
        weights = np.where((index < 0) | (index >= in_size), 0.0, weights)
        total = weights.sum(axis=1, keepdims=True)
        weights = weights / np.where(total == 0, 1.0, total)
    matrix = np.zeros((len(x), in_size))
    rows = np.broadcast_to(np.arange(len(x))[:, None], index.shape)
    np.add.at(matrix, (rows, np.clip(index, 0, in_size - 1)), weights)
    return matrix


def _fill_extrapolated(data: np.ndarray, mask: np.ndarray | None, axis: int, value: float) -> np.ndarray:
    if mask is None or not mask.any():
        return data
    shape = [1] * data.ndim
    shape[axis] = mask.size
    return np.where(mask.reshape(shape), np.asarray(value).astype(data.dtype), data)


# -- Resize: registration ----------------------------------------------------------------------------


def _resize_normalize(node: Node, graph: Graph) -> None:
    """Resize-10 and Upsample (X, scales) -> Resize-11+ inputs (X, roi, scales, sizes) with the old
    semantics spelled out as attributes; older "bilinear"/"trilinear" mode names become "linear"."""
    legacy = node.op_type == "Upsample" or node.opset < 11
    if legacy:
        if "scales" in node.attrs:  # Upsample-7 carried scales as an attribute
            scales = np.array(node.attrs.pop("scales"), dtype=np.float32)
            node.inputs = [node.inputs[0], graph.add_constant(f"{node.name}_scales", scales)]
        node.inputs = [node.inputs[0], "", node.inputs[1] if len(node.inputs) > 1 else "", ""]
        node.attrs["coordinate_transformation_mode"] = "asymmetric"
        node.attrs["nearest_mode"] = "simple"
    if node.attr("mode", "nearest") in ("bilinear", "trilinear"):
        node.attrs["mode"] = "linear"


def _resize_infer(node: Node, x: TensorInfo, roi: TensorInfo | None = None, scales: TensorInfo | None = None,
                  sizes: TensorInfo | None = None) -> TensorInfo:
    if node.attr("mode", "nearest") not in ("nearest", "linear", "cubic"):
        raise ShapeInferenceError(f"Resize mode {node.attr('mode')!r} is not nearest, linear or cubic")
    params = [scales, sizes]
    if x.shape is None or any(p is not None and p.value is None and p.shape != (0,) for p in params):
        return TensorInfo(x.dtype, None)
    value = [None if p is None else p.value for p in params]
    _, out, _ = _resize_geometry(node, x.shape, None, *value)
    return TensorInfo(x.dtype, tuple(out))


def _resize_cpu(node: Node, x: np.ndarray, roi: np.ndarray | None = None, scales: np.ndarray | None = None,
                sizes: np.ndarray | None = None) -> np.ndarray:
    factors, out, full_roi = _resize_geometry(node, x.shape, roi, scales, sizes)
    mode = node.attr("mode", "nearest")
    coord_mode = node.attr("coordinate_transformation_mode", "half_pixel")
    extrapolation = node.attr("extrapolation_value", 0.0)
    rank = x.ndim
    result = x if mode == "nearest" else x.astype(np.float64)
    for axis in range(rank):
        axis_roi = None if full_roi is None else (full_roi[axis], full_roi[rank + axis])
        if out[axis] == x.shape[axis] and factors[axis] == 1.0 and axis_roi in (None, (0.0, 1.0)):
            continue  # identity along this axis
        coords, outside = _source_coords(coord_mode, out[axis], factors[axis], x.shape[axis], axis_roi)
        if mode == "nearest":
            index = _nearest_index(coords, node.attr("nearest_mode", "round_prefer_floor"), factors[axis],
                                   x.shape[axis])
            result = np.take(result, index, axis=axis)
        else:
            matrix = _interp_matrix(coords, x.shape[axis], mode == "cubic", factors[axis],
                                    bool(node.attr("antialias", 0)), node.attr("cubic_coeff_a", -0.75),
                                    bool(node.attr("exclude_outside", 0)))
            result = np.moveaxis(np.tensordot(matrix, result, axes=(1, axis)), 0, axis)
        result = _fill_extrapolated(result, outside, axis, extrapolation)
    return result if mode == "nearest" else saturate_to(result, x.dtype)


register_op("Resize", infer=_resize_infer, cpu=_resize_cpu, normalize=_resize_normalize, min_opset=10,
            doc="Nearest/linear/cubic resize with every ONNX coordinate mode, antialias and axes.")
register_op("Upsample", infer=_resize_infer, cpu=_resize_cpu, normalize=_resize_normalize, min_opset=7,
            doc="Deprecated Resize form (asymmetric coordinates); runs as Resize.")


# -- GridSample --------------------------------------------------------------------------------------


def _gridsample_normalize(node: Node, graph: Graph) -> None:
    """GridSample-16 spelled the modes bilinear/bicubic; opset 20 made them linear/cubic (N-D)."""
    renamed = {"bilinear": "linear", "bicubic": "cubic"}
    mode = node.attr("mode", "bilinear" if node.opset < 20 else "linear")
    node.attrs["mode"] = renamed.get(mode, mode)


def _gridsample_infer(node: Node, x: TensorInfo, grid: TensorInfo) -> TensorInfo:
    if x.shape is None or grid.shape is None:
        return TensorInfo(x.dtype, None)
    spatial = len(x.shape) - 2
    if spatial < 1 or len(grid.shape) != spatial + 2 or grid.shape[-1] != spatial or grid.shape[0] != x.shape[0]:
        raise ShapeInferenceError(f"GridSample grid {grid.shape} does not match input {x.shape}")
    if node.attr("mode", "linear") not in ("nearest", "linear", "cubic"):
        raise ShapeInferenceError(f"GridSample mode {node.attr('mode')!r} is unknown")
    return TensorInfo(x.dtype, (x.shape[0], x.shape[1], *grid.shape[1:-1]))


def reflect(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Fold coordinates outside [lo, hi] back inside by mirroring at the borders."""
    span = hi - lo
    if span <= 0:
        return np.full_like(x, lo)
    below, above = x < lo, x > hi
    dist = np.where(below, lo - x, np.where(above, x - hi, 0.0))
    flips = np.trunc(dist / span)
    rest = dist - flips * span
    even = flips % 2 == 0
    from_low = np.where(even, lo + rest, hi - rest)
    from_high = np.where(even, hi - rest, lo + rest)
    return np.where(below, from_low, np.where(above, from_high, x))


def _grid_taps(x: np.ndarray, mode: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """(integer index, weight) per interpolation tap along one axis."""
    if mode == "nearest":
        return [(x.astype(np.int64), np.ones(x.shape))]
    base = np.floor(x)
    t = (x - base).astype(np.float64)
    base = base.astype(np.int64)
    if mode == "linear":
        return [(base, 1 - t), (base + 1, t)]
    return [(base + k, keys_cubic(t - k, -0.75)) for k in (-1, 0, 1, 2)]


def _gridsample_cpu(node: Node, x: np.ndarray, grid: np.ndarray) -> np.ndarray:
    mode, padding = node.attr("mode", "linear"), node.attr("padding_mode", "zeros")
    align = bool(node.attr("align_corners", 0))
    dims = x.shape[2:]
    n_batch, channels = x.shape[:2]
    out_spatial = grid.shape[1:-1]
    per_axis = []
    for i, size in enumerate(dims):
        g = grid[..., len(dims) - 1 - i]  # the grid lists coordinates innermost axis first
        coord = (g + 1) / 2.0 * (size - 1) if align else ((g + 1) * size - 1) / 2.0
        if mode == "nearest":
            coord = np.rint(coord)
        lo, hi = (0.0, size - 1.0) if align else (-0.5, size - 0.5)
        if padding == "border":
            coord = np.where((coord < lo) | (coord > hi), np.clip(coord, 0, size - 1), coord)
        elif padding == "reflection":
            coord = reflect(coord.astype(np.float64), lo, hi).astype(coord.dtype)
        taps = []
        for index, weight in _grid_taps(coord, mode):
            if padding == "zeros":
                weight = np.where((index < 0) | (index >= size), 0.0, weight)
                index = np.clip(index, 0, size - 1)
            elif padding == "border":
                index = np.clip(index, 0, size - 1)
            else:
                index = reflect(index.astype(np.float64), lo, hi).astype(np.int64)
                index = np.clip(index, 0, size - 1)
            taps.append((index, weight))
        per_axis.append(taps)
    batch = np.arange(n_batch).reshape(-1, *([1] * len(out_spatial)))
    result = np.zeros((n_batch, *out_spatial, channels))
    source = np.moveaxis(x, 1, -1)  # N, *dims, C: gathers below then yield N, *out, C
    for combo in np.ndindex(*[len(t) for t in per_axis]):
        picks = [per_axis[a][k] for a, k in enumerate(combo)]
        weight = np.prod([w for _, w in picks], axis=0)
        result += weight[..., None] * source[(batch, *[i for i, _ in picks])]
    return np.moveaxis(result, -1, 1).astype(x.dtype)


register_op("GridSample", infer=_gridsample_infer, cpu=_gridsample_cpu, normalize=_gridsample_normalize,
            min_opset=16, doc="Sample the input at normalized grid positions (nearest/linear/cubic).")


# -- AffineGrid --------------------------------------------------------------------------------------


def _affine_infer(node: Node, theta: TensorInfo, size: TensorInfo) -> TensorInfo:
    if size.value is None:
        return TensorInfo(theta.dtype, None)
    dims = [int(v) for v in size.value.reshape(-1)]
    if len(dims) not in (4, 5):
        raise ShapeInferenceError(f"AffineGrid size must be [N, C, H, W] or [N, C, D, H, W], got {dims}")
    spatial = len(dims) - 2
    if theta.shape is not None and tuple(theta.shape[1:]) != (spatial, spatial + 1):
        raise ShapeInferenceError(f"AffineGrid theta {theta.shape} does not fit {spatial}-D size {dims}")
    return TensorInfo(theta.dtype, (dims[0], *dims[2:], spatial))


def _base_coords(size: int, align: bool) -> np.ndarray:
    """Normalized [-1, 1] positions of ``size`` pixels (centers, or corners when aligned)."""
    if align:
        return np.linspace(-1.0, 1.0, size) if size > 1 else np.array([-1.0])
    return (2 * np.arange(size) + 1) / size - 1


def _affine_cpu(node: Node, theta: np.ndarray, size: np.ndarray) -> np.ndarray:
    dims = [int(v) for v in size.reshape(-1)[2:]]
    align = bool(node.attr("align_corners", 0))
    axes = [_base_coords(d, align) for d in dims]
    mesh = np.meshgrid(*axes, indexing="ij")  # per spatial axis, outermost first
    homogeneous = np.stack([*mesh[::-1], np.ones(dims)], axis=-1)  # x (innermost) first, then 1
    grid = np.einsum("nij,...j->n...i", theta.astype(np.float64), homogeneous)
    return grid.astype(theta.dtype)


register_op("AffineGrid", infer=_affine_infer, cpu=_affine_cpu, min_opset=20,
            doc="Sampling grid of an affine transform, for GridSample.")


# -- RoiAlign ----------------------------------------------------------------------------------------


def _roialign_normalize(node: Node, graph: Graph) -> None:
    """RoiAlign-10 had no coordinate_transformation_mode: it behaved as output_half_pixel."""
    if node.opset < 16:
        node.attrs.setdefault("coordinate_transformation_mode", "output_half_pixel")


def _roialign_infer(node: Node, x: TensorInfo, rois: TensorInfo, batch_indices: TensorInfo) -> TensorInfo:
    if x.shape is None or rois.shape is None:
        return TensorInfo(x.dtype, None)
    if len(x.shape) != 4 or len(rois.shape) != 2 or rois.shape[1] != 4:
        raise ShapeInferenceError(f"RoiAlign needs X [N, C, H, W] and rois [R, 4], got {x.shape}, {rois.shape}")
    return TensorInfo(x.dtype, (rois.shape[0], x.shape[1], node.attr("output_height", 1), node.attr("output_width", 1)))


def _roi_samples(start: float, bin_size: float, bins: int, grid: int, size: int) -> tuple[np.ndarray, ...]:
    """Bilinear taps of the sample points along one axis of one roi: (low, high, w_low, w_high,
    valid), each [bins, grid]; points beyond [-1, size] contribute nothing."""
    pos = start + np.arange(bins)[:, None] * bin_size + (np.arange(grid)[None, :] + 0.5) * bin_size / grid
    valid = (pos >= -1.0) & (pos <= size)
    pos = np.maximum(pos, 0)
    low = pos.astype(np.int64)
    at_edge = low >= size - 1
    low = np.where(at_edge, size - 1, low)
    high = np.where(at_edge, size - 1, low + 1)
    pos = np.where(at_edge, low, pos)
    frac = pos - low
    return low, high, (1 - frac) * valid, frac * valid


def _roialign_cpu(node: Node, x: np.ndarray, rois: np.ndarray, batch_indices: np.ndarray) -> np.ndarray:
    """Average: out = Wy @ X @ Wx^T per roi, the sampling weights summed per pixel; max keeps the
    largest weighted corner of any sample (the reference/ORT definition)."""
    out_h, out_w = node.attr("output_height", 1), node.attr("output_width", 1)
    ratio, scale = node.attr("sampling_ratio", 0), node.attr("spatial_scale", 1.0)
    half_pixel = node.attr("coordinate_transformation_mode", "half_pixel") == "half_pixel"
    use_max = node.attr("mode", "avg") == "max"
    height, width = x.shape[2:]
    result = np.zeros((rois.shape[0], x.shape[1], out_h, out_w))
    boxes = rois.astype(np.float64) * scale - (0.5 if half_pixel else 0.0)
    for r, (x0, y0, x1, y1) in enumerate(boxes):  # one roi at a time: its arrays are vectorized
        roi_w, roi_h = x1 - x0, y1 - y0
        if not half_pixel:
            roi_w, roi_h = max(roi_w, 1.0), max(roi_h, 1.0)
        grid_h = ratio if ratio > 0 else int(np.ceil(roi_h / out_h))
        grid_w = ratio if ratio > 0 else int(np.ceil(roi_w / out_w))
        if grid_h <= 0 or grid_w <= 0:
            continue
        ylo, yhi, wylo, wyhi = _roi_samples(y0, roi_h / out_h, out_h, grid_h, height)
        xlo, xhi, wxlo, wxhi = _roi_samples(x0, roi_w / out_w, out_w, grid_w, width)
        image = x[int(batch_indices[r])].astype(np.float64)
        if use_max:
            ys, wy = np.stack([ylo, yhi], -1), np.stack([wylo, wyhi], -1)  # [out_h, grid_h, 2]
            xs, wx = np.stack([xlo, xhi], -1), np.stack([wxlo, wxhi], -1)
            values = image[:, ys[:, :, :, None, None, None], xs[None, None, None]]  # C,oh,gh,2,ow,gw,2
            weighted = values * (wy[:, :, :, None, None, None] * wx[None, None, None])
            result[r] = weighted.max(axis=(2, 3, 5, 6))
        else:
            wy_matrix = np.zeros((out_h, height))
            wx_matrix = np.zeros((out_w, width))
            rows_h = np.broadcast_to(np.arange(out_h)[:, None], ylo.shape)
            rows_w = np.broadcast_to(np.arange(out_w)[:, None], xlo.shape)
            np.add.at(wy_matrix, (rows_h, ylo), wylo)
            np.add.at(wy_matrix, (rows_h, yhi), wyhi)
            np.add.at(wx_matrix, (rows_w, xlo), wxlo)
            np.add.at(wx_matrix, (rows_w, xhi), wxhi)
            result[r] = wy_matrix @ image @ wx_matrix.T / max(grid_h * grid_w, 1)
    return result.astype(x.dtype)


register_op("RoiAlign", infer=_roialign_infer, cpu=_roialign_cpu, normalize=_roialign_normalize, min_opset=10,
            doc="Bilinear-sampled average/max pooling of regions of interest.")


# -- MaxRoiPool --------------------------------------------------------------------------------------


def _maxroipool_infer(node: Node, x: TensorInfo, rois: TensorInfo) -> TensorInfo:
    pooled = node.attr("pooled_shape")
    if not pooled or len(pooled) != 2:
        raise ShapeInferenceError("MaxRoiPool needs pooled_shape [height, width]")
    if x.shape is None or rois.shape is None:
        return TensorInfo(x.dtype, None)
    if len(x.shape) != 4 or len(rois.shape) != 2 or rois.shape[1] != 5:
        raise ShapeInferenceError(f"MaxRoiPool needs X [N, C, H, W] and rois [R, 5], got {x.shape}, {rois.shape}")
    return TensorInfo(x.dtype, (rois.shape[0], x.shape[1], *pooled))


def _roi_bins(start: int, end: int, bins: int, size: int) -> np.ndarray:
    """[bins, size] mask of the pixels each pooling bin covers (Caffe's rounding)."""
    extent = max(end - start + 1, 1)
    step = extent / bins
    k = np.arange(bins)
    lo = np.clip(np.floor(k * step).astype(np.int64) + start, 0, size)
    hi = np.clip(np.ceil((k + 1) * step).astype(np.int64) + start, 0, size)
    pixels = np.arange(size)
    return (pixels[None, :] >= lo[:, None]) & (pixels[None, :] < hi[:, None])


def _maxroipool_cpu(node: Node, x: np.ndarray, rois: np.ndarray) -> np.ndarray:
    pooled_h, pooled_w = node.attr("pooled_shape")
    scale = node.attr("spatial_scale", 1.0)
    height, width = x.shape[2:]
    result = np.zeros((rois.shape[0], x.shape[1], pooled_h, pooled_w), dtype=x.dtype)
    lowest = np.array(-np.inf, dtype=np.float64)
    for r, roi in enumerate(rois):  # one roi at a time: its arrays are vectorized
        x0, y0, x1, y1 = (int(np.round(v * scale)) for v in roi[1:])
        rows, cols = _roi_bins(y0, y1, pooled_h, height), _roi_bins(x0, x1, pooled_w, width)
        image = x[int(roi[0])].astype(np.float64)  # C, H, W
        per_col = np.where(cols[None, None], image[:, :, None, :], lowest).max(axis=-1)  # C, H, pw
        pooled = np.where(rows[None, :, :, None], per_col[:, None], lowest).max(axis=2)  # C, ph, pw
        result[r] = np.where(np.isneginf(pooled), 0, pooled).astype(x.dtype)
    return result


register_op("MaxRoiPool", infer=_maxroipool_infer, cpu=_maxroipool_cpu,
            doc="Max pooling of regions of interest into a fixed grid (Fast R-CNN).")


# -- NonMaxSuppression -------------------------------------------------------------------------------


def _nms_infer(node: Node, boxes: TensorInfo, scores: TensorInfo, *thresholds: TensorInfo | None) -> TensorInfo:
    if boxes.shape is not None and (len(boxes.shape) != 3 or boxes.shape[2] != 4):
        raise ShapeInferenceError(f"NonMaxSuppression boxes must be [batch, boxes, 4], got {boxes.shape}")
    if scores.shape is not None and len(scores.shape) != 3:
        raise ShapeInferenceError(f"NonMaxSuppression scores must be [batch, classes, boxes], got {scores.shape}")
    return TensorInfo(np.int64, None)  # how many boxes survive depends on the data


def _corners(boxes: np.ndarray, center_point_box: int) -> tuple[np.ndarray, ...]:
    """(x_min, y_min, x_max, y_max) from [y1, x1, y2, x2] (any corner order) or [xc, yc, w, h]."""
    if center_point_box:
        xc, yc, w, h = boxes.T
        return xc - w / 2, yc - h / 2, xc + w / 2, yc + h / 2
    y1, x1, y2, x2 = boxes.T
    return np.minimum(x1, x2), np.minimum(y1, y2), np.maximum(x1, x2), np.maximum(y1, y2)


def pairwise_iou(boxes: np.ndarray, center_point_box: int) -> np.ndarray:
    """IoU of every pair of boxes; 0 where boxes do not overlap or have no area."""
    x0, y0, x1, y1 = _corners(boxes.astype(np.float64), center_point_box)
    inter_w = np.minimum(x1[:, None], x1[None]) - np.maximum(x0[:, None], x0[None])
    inter_h = np.minimum(y1[:, None], y1[None]) - np.maximum(y0[:, None], y0[None])
    inter = np.where((inter_w > 0) & (inter_h > 0), inter_w * inter_h, 0.0)
    area = (x1 - x0) * (y1 - y0)
    union = area[:, None] + area[None] - inter
    ok = (inter > 0) & (area[:, None] > 0) & (area[None] > 0) & (union > 0)
    return np.where(ok, inter / np.where(ok, union, 1.0), 0.0)


def _select(scores: np.ndarray, iou: np.ndarray, limit: int, iou_threshold: float,
            score_threshold: float | None) -> list[int]:
    """Greedy NMS of one (batch, class): best score first (ties: lower index), skipping boxes that
    overlap an already selected one by more than the threshold."""
    candidates = np.lexsort((np.arange(scores.size), -scores.astype(np.float64)))
    if score_threshold is not None:
        candidates = candidates[scores[candidates] > score_threshold]
    suppressed = np.zeros(scores.size, dtype=bool)
    selected: list[int] = []
    for box in candidates:  # sequential by nature: each pick depends on the previous ones
        if len(selected) >= limit:
            break
        if suppressed[box]:
            continue
        selected.append(int(box))
        suppressed |= iou[box] > iou_threshold
    return selected


def _nms_cpu(node: Node, boxes: np.ndarray, scores: np.ndarray, max_output: np.ndarray | None = None,
             iou_threshold: np.ndarray | None = None, score_threshold: np.ndarray | None = None) -> np.ndarray:
    limit = max(int(np.asarray(max_output).reshape(-1)[0]), 0) if _present(max_output) else 0
    iou_limit = float(np.asarray(iou_threshold).reshape(-1)[0]) if _present(iou_threshold) else 0.0
    score_limit = float(np.asarray(score_threshold).reshape(-1)[0]) if _present(score_threshold) else None
    center = node.attr("center_point_box", 0)
    rows: list[tuple[int, int, int]] = []
    for b in range(boxes.shape[0] if limit else 0):
        classes, keep = _candidates(scores[b], score_limit)
        if not classes.size:
            continue
        iou = pairwise_iou(boxes[b, keep], center)  # only boxes some class may select: a detector's 1500 boxes
        for c in classes:                            # would be 1500^2 pairs, of which a few hundred boxes matter
            picked = _select(scores[b, c, keep], iou, limit, iou_limit, score_limit)
            rows.extend((b, int(c), int(keep[i])) for i in picked)
    return np.array(rows, dtype=np.int64).reshape(-1, 3)


def _candidates(scores: np.ndarray, score_threshold: float | None) -> tuple[np.ndarray, np.ndarray]:
    """(classes with a box above the threshold, boxes above it in some class) of one batch's [classes, boxes]
    scores; every class and box without a threshold. Restricting a class's greedy pass to these boxes selects
    the same ones in the same order (IoU is per pair; ties keep the lower index)."""
    if score_threshold is None:
        return np.arange(scores.shape[0]), np.arange(scores.shape[1])
    passing = scores > score_threshold
    return np.flatnonzero(passing.any(axis=1)), np.flatnonzero(passing.any(axis=0))


register_op("NonMaxSuppression", infer=_nms_infer, cpu=_nms_cpu, min_opset=10,
            doc="Greedy per-class non-maximum suppression; output size depends on the data.")
