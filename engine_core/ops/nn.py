"""Neural-network layers: matrix products, convolutions, the softmax family, Einsum, Dropout.

Convolutions run as matrix products (im2col): the input's windows are gathered into a column
matrix of shape (C*K, P) — one strided copy per kernel offset, never a loop over pixels — and one
batched matmul per group does the arithmetic in BLAS. Transposed convolutions run the other way
round: one matmul makes the columns, and ``col2im`` adds them into the output canvas, again one
strided add per kernel offset. ``Window`` (the sliding-window geometry: kernel, strides, dilations,
pads and output size, from the ONNX attributes incl. auto_pad and ceil_mode) is shared with
pooling.py.

Narrow floats (float16, bfloat16) compute in float32 and round once at the end — except the
softmax family, which rounds where its function body would (see ``_rounding``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from engine_core.ir import Node
from engine_core.ops.elementwise import NARROW_FLOATS, compute_dtype, quiet
from engine_core.ops.registry import (
    ShapeInferenceError,
    TensorInfo,
    broadcast_shapes,
    normalize_axis,
    register_op,
)

Shape = tuple[int, ...]


def work_dtype(dtype: np.dtype) -> np.dtype:
    """Float32 for narrow floats (numpy has no fast kernels for them), else the dtype itself."""
    return np.dtype(np.float32) if np.dtype(dtype) in NARROW_FLOATS else np.dtype(dtype)


# -- sliding-window geometry ----------------------------------------------------------------------


@dataclass(frozen=True)
class Window:
    """Where the windows of a convolution or pooling lie along each spatial dim.

    Window ``o`` along a dim starts at input coordinate ``o * stride - pad_begin`` and reads
    ``kernel`` taps spaced ``dilation`` apart. ``out`` is the number of windows.
    """

    kernel: Shape
    strides: Shape
    dilations: Shape
    pads_begin: Shape
    pads_end: Shape
    out: Shape

    @property
    def extent(self) -> Shape:
        """Span of one window in input coordinates, dilation included."""
        return tuple((k - 1) * d + 1 for k, d in zip(self.kernel, self.dilations))

    @property
    def size(self) -> int:
        return math.prod(self.kernel)

    def offsets(self) -> Iterator[tuple[int, ...]]:
        """Kernel offsets in row-major order (the order of the kernel's flattened layout)."""
        return itertools.product(*(range(k) for k in self.kernel))

    def taps(self, offset: Sequence[int], begin: Sequence[int] | None = None) -> tuple[slice, ...]:
        """Slices picking, for one kernel offset, the input element of every window from an array
        whose index 0 along each dim is input coordinate ``-begin`` (default: ``pads_begin``)."""
        begin = self.pads_begin if begin is None else begin
        starts = (k * d + b - p for k, d, b, p in zip(offset, self.dilations, begin, self.pads_begin))
        return tuple(slice(s, s + (o - 1) * st + 1, st) if o else slice(0, 0)
                     for s, o, st in zip(starts, self.out, self.strides))

    def span_end(self, spatial_in: Sequence[int]) -> Shape:
        """Padding needed after the input so that every window lies inside the padded array (more
        than ``pads_end`` in ceil_mode, less when the explicit end padding is never reached)."""
        return tuple(max(0, (o - 1) * s + e - i - b) if o > 0 else 0
                     for o, s, e, i, b in zip(self.out, self.strides, self.extent, spatial_in, self.pads_begin))

    @property
    def is_pointwise(self) -> bool:
        """A 1x1 kernel at stride 1 without padding: the input already is the column matrix."""
        return (all(k == 1 for k in self.kernel) and all(s == 1 for s in self.strides)
                and not any(self.pads_begin) and not any(self.pads_end))


def _ints_attr(node: Node, key: str, n: int, default: int) -> tuple[int, ...]:
    value = node.attr(key)
    if value is None or len(value) == 0:
        return (default,) * n
    if len(value) != n:
        raise ShapeInferenceError(f"{node.op_type} attribute {key}={list(value)} needs {n} values")
    return tuple(int(v) for v in value)


def window_geometry(node: Node, spatial_in: Sequence[int], kernel: Sequence[int], ceil_mode: bool = False) -> Window:
    """Window geometry from a Conv/pooling node's attributes (strides, dilations, pads, auto_pad).

    SAME_UPPER/SAME_LOWER give ceil(in / stride) windows, with the odd padding element at the end
    (UPPER) or the beginning (LOWER); VALID pads nothing. With explicit pads, ``ceil_mode`` rounds
    the window count up, dropping a last window that would start in the end padding.

    When the stride exceeds the kernel, SAME's padding formula goes negative; it is clamped to 0,
    as onnxruntime's and onnx's reference Conv (and TensorFlow) do. (onnxruntime's MaxPool rejects
    such padding, its AveragePool starts the windows inside the input.)
    """
    n = len(spatial_in)
    kernel = tuple(int(k) for k in kernel)
    if len(kernel) != n:
        raise ShapeInferenceError(f"{node.op_type} kernel {list(kernel)} does not fit {n} spatial dims")
    strides = _ints_attr(node, "strides", n, 1)
    dilations = _ints_attr(node, "dilations", n, 1)
    pads = node.attr("pads") or [0] * (2 * n)
    if len(pads) != 2 * n:
        raise ShapeInferenceError(f"{node.op_type} pads {list(pads)} needs {2 * n} values")
    if min(strides) < 1 or min(dilations) < 1 or min(kernel) < 1:
        raise ShapeInferenceError(f"{node.op_type}: kernel, strides and dilations must be positive")
    auto_pad = node.attr("auto_pad", "NOTSET") or "NOTSET"
    if auto_pad not in ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"):
        raise ShapeInferenceError(f"{node.op_type}: unknown auto_pad {auto_pad!r}")
    if min(pads) < 0:
        raise ShapeInferenceError(f"{node.op_type} pads {list(pads)} must not be negative")
    dims = []
    for i, (size, s, k, d) in enumerate(zip(spatial_in, strides, kernel, dilations)):
        b, e, o = _dim_geometry(auto_pad, int(size), s, (k - 1) * d + 1, int(pads[i]), int(pads[n + i]), ceil_mode)
        if o < 0:
            raise ShapeInferenceError(f"{node.op_type}: window {(k - 1) * d + 1} (kernel {k}, dilation {d}) "
                                      f"does not fit spatial dim {i} of size {size} with its padding")
        dims.append((b, e, o))
    begin, end, out = zip(*dims) if dims else ((), (), ())
    return Window(kernel, strides, dilations, tuple(begin), tuple(end), tuple(out))


def _dim_geometry(auto_pad: str, size: int, stride: int, extent: int, pad_begin: int, pad_end: int,
                  ceil_mode: bool) -> tuple[int, int, int]:
    """(pad begin, pad end, window count) along one spatial dim."""
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        count = -(-size // stride)
        total = max(0, (count - 1) * stride + extent - size)
        begin = total // 2 if auto_pad == "SAME_UPPER" else total - total // 2
        return begin, total - begin, count
    if auto_pad == "VALID":
        return 0, 0, (size - extent) // stride + 1
    span = size + pad_begin + pad_end - extent
    if not ceil_mode:
        return pad_begin, pad_end, span // stride + 1
    count = -(-span // stride) + 1
    if (count - 1) * stride >= size + pad_begin:  # the last window would start in the end padding
        count -= 1
    return pad_begin, pad_end, count


def pad_spatial(x: np.ndarray, begin: Sequence[int], end: Sequence[int], value: float | int = 0) -> np.ndarray:
    """``x`` with its trailing len(begin) dims padded by ``value`` (a view when nothing to pad)."""
    if not any(begin) and not any(end):
        return x
    lead = x.ndim - len(begin)
    shape = x.shape[:lead] + tuple(d + b + e for d, b, e in zip(x.shape[lead:], begin, end))
    padded = np.full(shape, value, dtype=x.dtype)
    padded[(Ellipsis, *(slice(b, b + d) for b, d in zip(begin, x.shape[lead:])))] = x
    return padded


def padded_input(x: np.ndarray, win: Window, value: float | int = 0) -> np.ndarray:
    """The input padded so that every window of ``win`` reads inside the array."""
    return pad_spatial(x, win.pads_begin, win.span_end(x.shape[2:]), value)


def im2col(xp: np.ndarray, win: Window) -> np.ndarray:
    """Columns (N, C, K, *out) of a padded input (N, C, *spatial): column k holds, for every
    window, the element under kernel offset k. One strided copy per kernel offset."""
    cols = np.empty((*xp.shape[:2], win.size, *win.out), dtype=xp.dtype)
    for index, offset in enumerate(win.offsets()):
        cols[:, :, index] = xp[(Ellipsis, *win.taps(offset))]
    return cols


def col2im(cols: np.ndarray, win: Window, spatial_out: Sequence[int]) -> np.ndarray:
    """The adjoint of im2col: add columns (N, C, K, *n) (n = window counts) into an image
    (N, C, *spatial_out) whose coordinate 0 lies ``win.pads_begin`` into the window grid.

    The windows are laid out on a canvas that also covers the output where it reaches beyond
    them (a negative begin pad, an output_shape larger than the windows), then cropped.
    """
    counts = cols.shape[3:]
    full = [(n - 1) * s + e if n else 0 for n, s, e in zip(counts, win.strides, win.extent)]
    lead = [max(0, -b) for b in win.pads_begin]  # canvas room before window coordinate 0
    size = [ld + max(f, b + o) for ld, f, b, o in zip(lead, full, win.pads_begin, spatial_out)]
    canvas = np.zeros((*cols.shape[:2], *size), dtype=cols.dtype)
    grid = Window(win.kernel, win.strides, win.dilations, (0,) * len(counts), (0,) * len(counts), tuple(counts))
    for index, offset in enumerate(grid.offsets()):
        canvas[(Ellipsis, *grid.taps(offset, begin=lead))] += cols[:, :, index]
    crop = tuple(slice(ld + b, ld + b + o) for ld, b, o in zip(lead, win.pads_begin, spatial_out))
    return canvas[(Ellipsis, *crop)]


# -- MatMul / Gemm --------------------------------------------------------------------------------


def _matmul_infer(node: Node, a: TensorInfo, b: TensorInfo) -> TensorInfo:
    if a.shape is None or b.shape is None:
        return TensorInfo(a.dtype, None)
    sa, sb = a.shape, b.shape
    if len(sa) == 0 or len(sb) == 0:
        raise ShapeInferenceError("MatMul inputs must have rank >= 1")
    ka = sa[-1]
    kb = sb[0] if len(sb) == 1 else sb[-2]
    if ka != kb:
        raise ShapeInferenceError(f"MatMul inner dimensions differ: {sa} x {sb}")
    batch = broadcast_shapes(sa[:-2], sb[:-2])
    rows = sa[-2:-1] if len(sa) > 1 else ()
    cols = sb[-1:] if len(sb) > 1 else ()
    return TensorInfo(a.dtype, (*batch, *rows, *cols))


def _matmul_cpu(node: Node, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    work = work_dtype(a.dtype)
    return np.matmul(a.astype(work, copy=False), b.astype(work, copy=False)).astype(a.dtype, copy=False)


register_op("MatMul", infer=_matmul_infer, cpu=_matmul_cpu)


def _gemm_infer(node: Node, a: TensorInfo, b: TensorInfo, c: TensorInfo | None = None) -> TensorInfo:
    if a.shape is None or b.shape is None:
        return TensorInfo(a.dtype, None)
    sa = a.shape[::-1] if node.attr("transA", 0) else a.shape
    sb = b.shape[::-1] if node.attr("transB", 0) else b.shape
    if len(sa) != 2 or len(sb) != 2 or sa[1] != sb[0]:
        raise ShapeInferenceError(f"Gemm needs 2-D operands with matching K, got {a.shape} and {b.shape}")
    out = (sa[0], sb[1])
    if c is not None and c.shape is not None and broadcast_shapes(out, c.shape) != out:
        raise ShapeInferenceError(f"Gemm C of shape {c.shape} does not broadcast to {out}")
    return TensorInfo(a.dtype, out)


def _gemm_cpu(node: Node, a: np.ndarray, b: np.ndarray, c: np.ndarray | None = None) -> np.ndarray:
    """alpha * A' B' + beta * C. (Opset < 7's ``broadcast`` flag needs no handling: opset 7+
    always broadcasts C, and Kiln imports opset 7 and later.)"""
    dtype, work = a.dtype, work_dtype(a.dtype)
    a, b = a.astype(work, copy=False), b.astype(work, copy=False)
    a = a.T if node.attr("transA", 0) else a
    b = b.T if node.attr("transB", 0) else b
    y = a @ b
    alpha = node.attr("alpha", 1.0)
    if alpha != 1.0:
        y = alpha * y
    if c is not None:
        beta = node.attr("beta", 1.0)
        c = c.astype(work, copy=False)
        y = y + (c if beta == 1.0 else beta * c)
    return y.astype(dtype, copy=False)


register_op("Gemm", infer=_gemm_infer, cpu=_gemm_cpu)


# -- Conv -------------------------------------------------------------------------------------------


def _conv_kernel(node: Node, w_shape: Shape) -> Shape:
    kernel = node.attr("kernel_shape")
    return tuple(int(k) for k in kernel) if kernel else tuple(w_shape[2:])


def _conv_infer(node: Node, x: TensorInfo, w: TensorInfo, b: TensorInfo | None = None, *rest) -> TensorInfo:
    dtype = np.int32 if node.op_type == "ConvInteger" else x.dtype
    if x.shape is None or w.shape is None:
        return TensorInfo(dtype, None)
    group = node.attr("group", 1)
    if len(x.shape) < 3 or len(w.shape) != len(x.shape):
        raise ShapeInferenceError(f"{node.op_type} needs X (N, C, *spatial) and W of equal rank, "
                                  f"got {x.shape} and {w.shape}")
    if x.shape[1] != w.shape[1] * group or w.shape[0] % group:
        raise ShapeInferenceError(f"{node.op_type} channels: X {x.shape}, W {w.shape}, group {group}")
    kernel = _conv_kernel(node, w.shape)
    if kernel != tuple(w.shape[2:]):
        raise ShapeInferenceError(f"{node.op_type} kernel_shape {list(kernel)} differs from W's {list(w.shape[2:])}")
    win = window_geometry(node, x.shape[2:], kernel)
    return TensorInfo(dtype, (x.shape[0], w.shape[0], *win.out))


#: Largest im2col buffer (bytes) built at once; bigger batches are convolved in slices of samples.
COLUMNS_LIMIT = 256 << 20


def conv(x: np.ndarray, w: np.ndarray, win: Window, group: int) -> np.ndarray:
    """Grouped N-d convolution of x (N, C, *spatial) with w (M, C/group, *kernel) -> (N, M, *out).

    Depthwise-like layers (one input channel per group) multiply-accumulate the K shifted input
    views directly; everything else is im2col + one batched matmul (G, Mg, Cg*K) @ (N, G, Cg*K, P).
    """
    per_sample = x.shape[1] * win.size * math.prod(win.out) * x.itemsize
    step = max(1, COLUMNS_LIMIT // max(per_sample, 1))
    if x.shape[0] > step:
        return np.concatenate([_conv_block(x[i:i + step], w, win, group) for i in range(0, x.shape[0], step)])
    return _conv_block(x, w, win, group)


def _conv_block(x: np.ndarray, w: np.ndarray, win: Window, group: int) -> np.ndarray:
    n, c = x.shape[:2]
    m = w.shape[0]
    cg, mg = c // group, m // group
    points = math.prod(win.out)
    if win.is_pointwise:
        y = np.matmul(w.reshape(group, mg, cg), x.reshape(n, group, cg, points))
        return y.reshape(n, m, *win.out)
    xp = padded_input(x, win)
    if cg == 1:
        wk = w.reshape(1, group, mg, win.size, *([1] * len(win.out)))
        y = np.zeros((n, group, mg, *win.out), dtype=x.dtype)
        for index, offset in enumerate(win.offsets()):
            y += xp[(Ellipsis, *win.taps(offset))][:, :, None] * wk[:, :, :, index]
        return y.reshape(n, m, *win.out)
    cols = im2col(xp, win).reshape(n, group, cg * win.size, points)
    y = np.matmul(w.reshape(group, mg, cg * win.size), cols)
    return y.reshape(n, m, *win.out)


def _add_bias(y: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    if b is not None:
        y += b.astype(y.dtype, copy=False).reshape(-1, *([1] * (y.ndim - 2)))
    return y


def _conv_cpu(node: Node, x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    work = work_dtype(x.dtype)
    win = window_geometry(node, x.shape[2:], _conv_kernel(node, w.shape))
    y = conv(x.astype(work, copy=False), w.astype(work, copy=False), win, node.attr("group", 1))
    return _add_bias(y, b).astype(x.dtype, copy=False)


register_op("Conv", infer=_conv_infer, cpu=_conv_cpu)


def _conv_integer_cpu(node: Node, x: np.ndarray, w: np.ndarray, x_zero: np.ndarray | None = None,
                      w_zero: np.ndarray | None = None) -> np.ndarray:
    """Integer convolution, exact: (x - x_zero) * (w - w_zero) sums stay far below 2**53, so the
    float64 BLAS product is exact. Padding is with x_zero (it contributes nothing)."""
    xf = x.astype(np.float64)
    if x_zero is not None:
        xf -= np.asarray(x_zero, dtype=np.float64).reshape(())
    wf = w.astype(np.float64)
    if w_zero is not None:
        wz = np.asarray(w_zero, dtype=np.float64)
        wf -= wz.reshape(-1, *([1] * (w.ndim - 1))) if wz.size > 1 else wz.reshape(())
    win = window_geometry(node, x.shape[2:], _conv_kernel(node, w.shape))
    return np.rint(conv(xf, wf, win, node.attr("group", 1))).astype(np.int32)


register_op("ConvInteger", infer=_conv_infer, cpu=_conv_integer_cpu, min_opset=10)


# -- ConvTranspose / Col2Im --------------------------------------------------------------------------


def conv_transpose_window(node: Node, spatial_in: Sequence[int], kernel: Sequence[int]) -> tuple[Window, Shape]:
    """(geometry of the windows that the input pixels scatter into, output spatial shape).

    The uncropped output of each dim is ``stride * (in - 1) + output_padding + extent``; explicit
    pads crop it. An output_shape (or SAME_*, whose output is in * stride) sets the output size
    instead and the crop is derived, split with the odd element at the beginning except for
    SAME_UPPER; an output larger than the uncropped one extends it with zeros at the end. That is
    the spec's rule, with onnxruntime's answer where the spec's would crop a negative amount.
    """
    n = len(spatial_in)
    strides = _ints_attr(node, "strides", n, 1)
    dilations = _ints_attr(node, "dilations", n, 1)
    out_pad = _ints_attr(node, "output_padding", n, 0)
    kernel = tuple(int(k) for k in kernel)
    full = [s * (i - 1) + op + (k - 1) * d + 1 for s, i, op, k, d in zip(strides, spatial_in, out_pad, kernel, dilations)]
    auto_pad = node.attr("auto_pad", "NOTSET") or "NOTSET"
    output_shape = node.attr("output_shape")
    pads = node.attr("pads") or [0] * (2 * n)
    if len(pads) != 2 * n:
        raise ShapeInferenceError(f"ConvTranspose pads {list(pads)} needs {2 * n} values")
    if output_shape or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        if output_shape:
            out = [int(v) for v in output_shape][-n:]
        else:
            out = [min(i * s, f) for i, s, f in zip(spatial_in, strides, full)]
        total = [max(0, f - o) for f, o in zip(full, out)]
        begin = [t // 2 if auto_pad == "SAME_UPPER" else t - t // 2 for t in total]
    elif auto_pad == "VALID":
        begin, out = [0] * n, full
    else:
        begin = [int(p) for p in pads[:n]]
        out = [f - b - int(e) for f, b, e in zip(full, begin, pads[n:])]
    if min(out, default=1) < 0:
        raise ShapeInferenceError(f"ConvTranspose output shape {out} is negative")
    end = [f - b - o for f, b, o in zip(full, begin, out)]
    return Window(kernel, strides, dilations, tuple(begin), tuple(end), tuple(spatial_in)), tuple(out)


def _conv_transpose_infer(node: Node, x: TensorInfo, w: TensorInfo, b: TensorInfo | None = None) -> TensorInfo:
    if x.shape is None or w.shape is None:
        return TensorInfo(x.dtype, None)
    group = node.attr("group", 1)
    if len(x.shape) < 3 or len(w.shape) != len(x.shape) or x.shape[1] != w.shape[0] or w.shape[0] % group:
        raise ShapeInferenceError(f"ConvTranspose needs X (N, C, *spatial) and W (C, M/group, *kernel), "
                                  f"got {x.shape} and {w.shape} with group {group}")
    _, out = conv_transpose_window(node, x.shape[2:], _conv_kernel(node, w.shape))
    return TensorInfo(x.dtype, (x.shape[0], w.shape[1] * group, *out))


def _conv_transpose_cpu(node: Node, x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    """One matmul gives every input pixel's contribution (M*K columns per pixel); col2im adds
    them into the output at stride/dilation spacing and crops the padding."""
    work = work_dtype(x.dtype)
    group = node.attr("group", 1)
    n, c = x.shape[:2]
    cg, mg = c // group, w.shape[1]
    win, out = conv_transpose_window(node, x.shape[2:], _conv_kernel(node, w.shape))
    k = win.size
    wt = w.astype(work, copy=False).reshape(group, cg, mg * k).transpose(0, 2, 1)
    cols = np.matmul(wt, x.astype(work, copy=False).reshape(n, group, cg, -1))
    y = col2im(cols.reshape(n, group * mg, k, *x.shape[2:]), win, out)
    return _add_bias(np.ascontiguousarray(y), b).astype(x.dtype, copy=False)


register_op("ConvTranspose", infer=_conv_transpose_infer, cpu=_conv_transpose_cpu)


def _col2im_infer(node: Node, x: TensorInfo, image: TensorInfo, block: TensorInfo) -> TensorInfo:
    if x.shape is None or image.value is None or block.value is None:
        return TensorInfo(x.dtype, None)
    image_shape = [int(v) for v in image.value]
    block_shape = [int(v) for v in block.value]
    k = math.prod(block_shape)
    if len(x.shape) != 3 or x.shape[1] % k:
        raise ShapeInferenceError(f"Col2Im input {x.shape} is not (N, C*{k}, L)")
    win = window_geometry(node, image_shape, block_shape)
    if math.prod(win.out) != x.shape[2]:
        raise ShapeInferenceError(f"Col2Im: {x.shape[2]} blocks given, geometry makes {math.prod(win.out)}")
    return TensorInfo(x.dtype, (x.shape[0], x.shape[1] // k, *image_shape))


def _col2im_cpu(node: Node, x: np.ndarray, image: np.ndarray, block: np.ndarray) -> np.ndarray:
    image_shape = [int(v) for v in image]
    block_shape = [int(v) for v in block]
    win = window_geometry(node, image_shape, block_shape)
    work = work_dtype(x.dtype)
    cols = x.astype(work, copy=False).reshape(x.shape[0], -1, win.size, *win.out)
    return np.ascontiguousarray(col2im(cols, win, image_shape)).astype(x.dtype, copy=False)


register_op("Col2Im", infer=_col2im_infer, cpu=_col2im_cpu, min_opset=18)


# -- DeformConv ---------------------------------------------------------------------------------------


def _deform_conv_infer(node: Node, x: TensorInfo, w: TensorInfo, offset: TensorInfo, *rest) -> TensorInfo:
    if x.shape is None or w.shape is None:
        return TensorInfo(x.dtype, None)
    return _conv_infer(node, x, w)


def _bilinear_columns(x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Sample x (N, OG, Cog, *spatial) at fractional positions (N, OG, nd, Q), multilinearly,
    reading zero outside the input; returns (N, OG, Cog, Q). Each of the 2**nd corners is one
    vectorized gather."""
    spatial = x.shape[3:]
    flat = x.reshape(*x.shape[:3], -1)
    low = np.floor(positions)
    frac = positions - low
    low = low.astype(np.int64)
    result = np.zeros((*x.shape[:3], positions.shape[-1]), dtype=x.dtype)
    strides = [math.prod(spatial[i + 1:]) for i in range(len(spatial))]
    for corner in itertools.product((0, 1), repeat=len(spatial)):
        weight = np.ones(positions.shape[:2] + positions.shape[3:], dtype=positions.dtype)
        index = np.zeros(weight.shape, dtype=np.int64)
        inside = np.ones(weight.shape, dtype=bool)
        for dim, step in enumerate(corner):
            coord = low[:, :, dim] + step
            weight *= frac[:, :, dim] if step else 1 - frac[:, :, dim]
            inside &= (coord >= 0) & (coord < spatial[dim])
            index += np.clip(coord, 0, spatial[dim] - 1) * strides[dim]
        values = np.take_along_axis(flat, index[:, :, None, :], axis=3)
        result += values * np.where(inside, weight, 0)[:, :, None, :]
    return result


def _deform_conv_cpu(node: Node, x: np.ndarray, w: np.ndarray, offset: np.ndarray, b: np.ndarray | None = None,
                     mask: np.ndarray | None = None) -> np.ndarray:
    """Convolution whose taps sit at learned fractional offsets: per (offset group, kernel tap,
    output pixel) a sampling position = regular tap position + offset; the input is sampled there
    bilinearly (zero outside), scaled by the mask, and the columns go through the grouped matmul."""
    work = work_dtype(x.dtype)
    group, og = node.attr("group", 1), node.attr("offset_group", 1)
    n, c = x.shape[:2]
    nd = x.ndim - 2
    win = window_geometry(node, x.shape[2:], _conv_kernel(node, w.shape))
    k, points = win.size, math.prod(win.out)
    grid = np.stack(np.meshgrid(*(np.arange(o) * s - p for o, s, p in zip(win.out, win.strides, win.pads_begin)),
                                indexing="ij")).reshape(nd, 1, points)
    taps = np.array(list(win.offsets()), dtype=np.float64).reshape(k, nd).T * np.array(win.dilations)[:, None]
    base = grid + taps[:, :, None]  # (nd, K, P)
    off = offset.astype(np.float64).reshape(n, og, k, nd, points).transpose(0, 1, 3, 2, 4)
    positions = (base + off).reshape(n, og, nd, k * points)
    xs = x.astype(work, copy=False).reshape(n, og, c // og, *x.shape[2:])
    cols = _bilinear_columns(xs, positions)
    if mask is not None:
        cols *= mask.astype(work, copy=False).reshape(n, og, 1, k * points)
    cols = cols.reshape(n, group, (c // group) * k, points)
    m = w.shape[0]
    y = np.matmul(w.astype(work, copy=False).reshape(group, m // group, -1), cols).reshape(n, m, *win.out)
    return _add_bias(y, b).astype(x.dtype, copy=False)


register_op("DeformConv", infer=_deform_conv_infer, cpu=_deform_conv_cpu, min_opset=19)


# -- Softmax / LogSoftmax / Hardmax -------------------------------------------------------------------


Rounding = Callable[[np.ndarray], np.ndarray]


def _softmax(x: np.ndarray, axis: int, rounded: Rounding) -> np.ndarray:
    shifted = rounded(x - np.max(x, axis=axis, keepdims=True))
    e = rounded(np.exp(shifted))
    return e / rounded(np.sum(e, axis=axis, keepdims=True))


def _log_softmax(x: np.ndarray, axis: int, rounded: Rounding) -> np.ndarray:
    shifted = rounded(x - np.max(x, axis=axis, keepdims=True))
    return shifted - rounded(np.log(rounded(np.sum(rounded(np.exp(shifted)), axis=axis, keepdims=True))))


def _hardmax(x: np.ndarray, axis: int, rounded: Rounding) -> np.ndarray:
    """1 at the first maximum along ``axis``, 0 elsewhere."""
    first = np.expand_dims(np.argmax(x, axis=axis), axis)
    y = np.zeros_like(x)
    np.put_along_axis(y, first, 1, axis=axis)
    return y


def _rounding(dtype: np.dtype) -> Rounding:
    """For narrow floats, intermediate results round to the storage type (sums still accumulate in
    float32): the numbers the op's function body gives when run op by op, which is how onnx's
    reference — and so its float16 test data — computes."""
    if dtype not in NARROW_FLOATS:
        return lambda a: a
    return lambda a: a.astype(dtype).astype(np.float32)


def _softmax_family(fn):
    """Opset >= 13: along one axis (default -1). Older opsets coerce the input to 2-D at ``axis``
    (default 1) and normalize each row over all trailing dims together."""

    @quiet
    def cpu(node: Node, x: np.ndarray) -> np.ndarray:
        legacy = node.opset < 13
        axis = normalize_axis(node.attr("axis", 1 if legacy else -1), x.ndim)
        if x.size == 0:
            return x.copy()
        work = x.astype(compute_dtype(x.dtype), copy=False)
        rounded = _rounding(x.dtype)
        if legacy:
            rows = math.prod(x.shape[:axis])
            return fn(work.reshape(rows, -1), 1, rounded).reshape(x.shape).astype(x.dtype, copy=False)
        return fn(work, axis, rounded).astype(x.dtype, copy=False)

    return cpu


def _axis_checked_infer(node: Node, x: TensorInfo) -> TensorInfo:
    if x.shape is not None:
        normalize_axis(node.attr("axis", 1 if node.opset < 13 else -1), len(x.shape))
    return TensorInfo(x.dtype, x.shape)


register_op("Softmax", infer=_axis_checked_infer, cpu=_softmax_family(_softmax))
register_op("LogSoftmax", infer=_axis_checked_infer, cpu=_softmax_family(_log_softmax))
register_op("Hardmax", infer=_axis_checked_infer, cpu=_softmax_family(_hardmax))


# -- Einsum ----------------------------------------------------------------------------------------------


def _einsum_terms(equation: str, count: int) -> tuple[list[str], str | None]:
    lhs, arrow, rhs = equation.replace(" ", "").partition("->")
    terms = lhs.split(",")
    if len(terms) != count:
        raise ShapeInferenceError(f"Einsum equation {equation!r} names {len(terms)} operands, got {count}")
    return terms, (rhs if arrow else None)


def einsum_shape(equation: str, shapes: Sequence[Shape]) -> Shape:
    """Output shape of an Einsum: letters take their operands' sizes (1 broadcasts), '...' the
    broadcast of the operands' ellipsis dims; implicit mode outputs '...' then the letters that
    occur once, in alphabetical order (numpy's rule, which the spec follows)."""
    terms, rhs = _einsum_terms(equation, len(shapes))
    sizes: dict[str, int] = {}
    ellipsis: Shape = ()
    counts: dict[str, int] = {}
    for term, shape in zip(terms, shapes):
        head, dots, tail = term.partition("...")
        letters = head + tail
        n_ell = len(shape) - len(letters)
        if (n_ell < 0) or (n_ell > 0 and not dots):
            raise ShapeInferenceError(f"Einsum term {term!r} does not fit operand of shape {shape}")
        dims = list(shape[:len(head)]) + list(shape[len(shape) - len(tail):] if tail else [])
        if dots:
            ellipsis = broadcast_shapes(ellipsis, tuple(shape[len(head):len(head) + n_ell]))
        for letter, dim in zip(letters, dims):
            counts[letter] = counts.get(letter, 0) + 1
            known = sizes.get(letter, 1)
            if known != 1 and dim not in (1, known):
                raise ShapeInferenceError(f"Einsum label {letter!r} has sizes {known} and {dim}")
            sizes[letter] = dim if known == 1 else known
    if rhs is None:
        rhs = "..." + "".join(sorted(c for c, k in counts.items() if k == 1))
    head, _, tail = rhs.partition("...")
    return (*(sizes[c] for c in head), *ellipsis, *(sizes[c] for c in tail))


def _einsum_infer(node: Node, *inputs: TensorInfo) -> TensorInfo:
    if any(i.shape is None for i in inputs):
        return TensorInfo(inputs[0].dtype, None)
    return TensorInfo(inputs[0].dtype, einsum_shape(node.attr("equation"), [i.shape for i in inputs]))


def _einsum_cpu(node: Node, *inputs: np.ndarray) -> np.ndarray:
    dtype = inputs[0].dtype
    work = work_dtype(dtype)
    equation = node.attr("equation").replace(" ", "")
    result = np.einsum(equation, *(x.astype(work, copy=False) for x in inputs), optimize=len(inputs) > 1)
    return np.asarray(result).astype(dtype, copy=False)


register_op("Einsum", infer=_einsum_infer, cpu=_einsum_cpu, min_opset=12)


# -- Dropout -------------------------------------------------------------------------------------------------


def _dropout_infer(node: Node, x: TensorInfo, *rest: TensorInfo | None) -> list[TensorInfo]:
    mask_dtype = np.bool_ if node.opset >= 10 else x.dtype
    return [TensorInfo(x.dtype, x.shape), TensorInfo(mask_dtype, x.shape)][: max(1, len(node.outputs))]


def _dropout_cpu(node: Node, x: np.ndarray, ratio: np.ndarray | None = None,
                 training_mode: np.ndarray | None = None) -> list[np.ndarray]:
    """Inference (the default): identity with an all-true mask. Training mode (opset 12 input)
    keeps each element with probability 1 - ratio and scales kept ones by 1 / (1 - ratio); the
    draw is numpy's RandomState(seed).uniform, the generator onnx's own tests used, so a seeded
    node reproduces them exactly."""
    mask_dtype = np.bool_ if node.opset >= 10 else x.dtype
    p = float(node.attr("ratio", 0.5)) if ratio is None else float(np.asarray(ratio))
    training = training_mode is not None and bool(np.asarray(training_mode))
    if not training or p == 0:
        y, mask = x, np.ones(x.shape, dtype=mask_dtype)
    else:
        seed = node.attr("seed")
        draw = np.random.RandomState(int(seed) if seed is not None else None).uniform(0, 1.0, x.shape)
        keep = draw >= p
        scale = 1.0 / (1.0 - p) if p < 1 else 0.0
        y = (keep * x * scale).astype(x.dtype, copy=False)
        mask = keep.astype(mask_dtype)
    return [y, mask][: max(1, len(node.outputs))]


register_op("Dropout", infer=_dropout_infer, cpu=_dropout_cpu, deterministic=False)


__all__ = [
    "Window",
    "col2im",
    "conv",
    "einsum_shape",
    "im2col",
    "pad_spatial",
    "padded_input",
    "window_geometry",
    "work_dtype",
]
