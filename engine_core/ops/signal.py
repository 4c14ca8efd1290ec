"""Signal processing (DFT, STFT, window functions, MelWeightMatrix) and Det.

ONNX carries complex tensors as real ones with a trailing dimension of 2 (real, imaginary); a
trailing 1 means a real signal. ``to_complex``/``from_complex`` convert at the op boundary so the
math itself is numpy's FFT in the input's precision, cast back to the input's type at the end.
"""

from __future__ import annotations

import numpy as np

from engine_core.ir import Graph, Node
from engine_core.ops.registry import ShapeInferenceError, TensorInfo, normalize_axis, register_op
from engine_core.types import onnx_to_np

# -- complex <-> ONNX's [..., 2] layout -------------------------------------------------------------


def to_complex(x: np.ndarray) -> np.ndarray:
    """[..., 1] (real) or [..., 2] (real, imag) -> a real or complex array without the last axis.

    Precision follows the input (complex64 for float32), and real signals stay real: numpy's FFT
    then rounds exactly like the reference implementation, whose outputs the test data records.
    """
    real_dtype = np.float64 if x.dtype == np.float64 else np.float32
    if x.shape[-1] == 1:
        return x[..., 0].astype(real_dtype)
    if x.shape[-1] == 2:
        return x[..., 0].astype(real_dtype) + 1j * x[..., 1].astype(real_dtype)
    raise ShapeInferenceError(f"the last dimension of a signal must be 1 (real) or 2 (complex), got {x.shape}")


def from_complex(z: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return np.stack([z.real, z.imag], axis=-1).astype(dtype)


def _scalar(value: np.ndarray | None, default: int | None) -> int | None:
    return default if value is None else int(np.asarray(value).reshape(-1)[0])


# -- DFT ---------------------------------------------------------------------------------------------


def _dft_normalize(node: Node, graph: Graph) -> None:
    """Opset < 20 had ``axis`` as an attribute (default 1); make it input 2 like opset 20."""
    if node.opset >= 20:
        return
    axis = node.attrs.pop("axis", 1)
    while len(node.inputs) < 3:
        node.inputs.append("")
    node.inputs[2] = graph.add_constant(f"{node.name}_axis", np.array(axis, dtype=np.int64))


def _dft_params(node: Node, shape: tuple[int, ...], length: int | None, axis: int | None) -> tuple[int, int, bool, bool]:
    """(axis, dft_length, inverse, onesided) with ONNX's defaults applied and the axis checked."""
    rank = len(shape)
    axis = normalize_axis(-2 if axis is None else axis, rank)
    if axis == rank - 1:
        raise ShapeInferenceError("DFT axis cannot be the last (real/imaginary) dimension")
    inverse, onesided = bool(node.attr("inverse", 0)), bool(node.attr("onesided", 0))
    if length is None:
        length = 2 * (shape[axis] - 1) if inverse and onesided else shape[axis]
    if length < 1:
        raise ShapeInferenceError(f"DFT length must be positive, got {length}")
    return axis, length, inverse, onesided


def _dft_out_shape(node: Node, shape: tuple[int, ...], length: int | None, axis: int | None) -> tuple[int, ...]:
    axis, length, inverse, onesided = _dft_params(node, shape, length, axis)
    out = list(shape)
    out[axis] = length // 2 + 1 if onesided and not inverse else length
    out[-1] = 1 if onesided and inverse else 2
    return tuple(out)


def _dft_infer(node: Node, x: TensorInfo, length: TensorInfo | None = None, axis: TensorInfo | None = None) -> TensorInfo:
    values = [None if t is None else t.value for t in (length, axis)]
    if x.shape is None or any(t is not None and v is None for t, v in zip((length, axis), values)):
        return TensorInfo(x.dtype, None)
    return TensorInfo(x.dtype, _dft_out_shape(node, x.shape, _scalar(values[0], None), _scalar(values[1], None)))


def _dft_cpu(node: Node, x: np.ndarray, length: np.ndarray | None = None, axis: np.ndarray | None = None) -> np.ndarray:
    axis_, n, inverse, onesided = _dft_params(node, x.shape, _scalar(length, None), _scalar(axis, None))
    signal = to_complex(x)
    if inverse and onesided:  # IRFFT: one-sided spectrum -> real signal
        return np.fft.irfft(signal, n=n, axis=axis_)[..., None].astype(x.dtype)
    spectrum = (np.fft.ifft if inverse else np.fft.fft)(signal, n=n, axis=axis_)
    if onesided:
        spectrum = np.take(spectrum, np.arange(n // 2 + 1), axis=axis_)
    return from_complex(spectrum, x.dtype)


register_op("DFT", infer=_dft_infer, cpu=_dft_cpu, normalize=_dft_normalize, min_opset=17,
            doc="Discrete Fourier transform along one axis (forward, inverse, one-sided).")


# -- STFT --------------------------------------------------------------------------------------------


def _stft_geometry(shape: tuple[int, ...], step: int, window: tuple[int, ...] | None,
                   frame_length: int | None) -> tuple[int, int]:
    """(frame_length, number of frames), checking the constraints the spec lists."""
    if len(shape) != 3:
        raise ShapeInferenceError(f"STFT signal must be [batch, length, 1|2], got {shape}")
    if window is not None:
        if len(window) != 1:
            raise ShapeInferenceError(f"STFT window must be 1-D, got shape {window}")
        if frame_length is not None and frame_length != window[0]:
            raise ShapeInferenceError(f"STFT window length {window[0]} differs from frame_length {frame_length}")
        frame_length = window[0]
    frame_length = shape[1] if frame_length is None else frame_length
    if step < 1 or not 0 < frame_length <= shape[1]:
        raise ShapeInferenceError(f"STFT needs frame_step >= 1 and 0 < frame_length <= {shape[1]}")
    return frame_length, 1 + (shape[1] - frame_length) // step


def _stft_infer(node: Node, x: TensorInfo, step: TensorInfo, window: TensorInfo | None = None,
                frame_length: TensorInfo | None = None) -> TensorInfo:
    if x.shape is None or step.value is None or (frame_length is not None and frame_length.value is None) or (
            window is not None and window.shape is None):
        return TensorInfo(x.dtype, None)
    length, frames = _stft_geometry(x.shape, _scalar(step.value, 1), None if window is None else window.shape,
                                    _scalar(None if frame_length is None else frame_length.value, None))
    bins = length // 2 + 1 if node.attr("onesided", 1) else length
    return TensorInfo(x.dtype, (x.shape[0], frames, bins, 2))


def _stft_cpu(node: Node, x: np.ndarray, step: np.ndarray, window: np.ndarray | None = None,
              frame_length: np.ndarray | None = None) -> np.ndarray:
    hop = _scalar(step, 1)
    length, frames = _stft_geometry(x.shape, hop, None if window is None else window.shape,
                                    _scalar(frame_length, None))
    signal = to_complex(x)  # batch, samples
    framed = np.lib.stride_tricks.sliding_window_view(signal, length, axis=1)[:, ::hop][:, :frames]
    if window is not None:
        framed = framed * window.astype(framed.real.dtype)
    spectrum = np.fft.fft(framed, axis=-1)
    if node.attr("onesided", 1):
        spectrum = spectrum[..., : length // 2 + 1]
    return from_complex(spectrum, x.dtype)


register_op("STFT", infer=_stft_infer, cpu=_stft_cpu, min_opset=17,
            doc="Short-time Fourier transform: windowed DFT of strided frames.")


# -- window functions --------------------------------------------------------------------------------


def _window_positions(node: Node, size: int) -> tuple[np.ndarray, int]:
    """n = 0..size-1 and the period N (size for periodic windows, size - 1 for symmetric ones)."""
    return np.arange(size, dtype=np.float64), size if node.attr("periodic", 1) else size - 1


def _register_window(op_type: str, cosines: tuple[float, ...], doc: str) -> None:
    """Generalized cosine window: w[n] = sum_k (-1)^k a_k cos(2 pi k n / N)."""

    def infer(node: Node, size: TensorInfo) -> TensorInfo:
        dtype = onnx_to_np(node.attr("output_datatype", 1))
        if size.value is None:
            return TensorInfo(dtype, None)
        return TensorInfo(dtype, (max(0, _scalar(size.value, 0)),))

    def cpu(node: Node, size: np.ndarray) -> np.ndarray:
        n, period = _window_positions(node, max(0, _scalar(size, 0)))
        phase = 2 * np.pi * n / period if period else np.zeros_like(n)
        window = sum((-1) ** k * a * np.cos(k * phase) for k, a in enumerate(cosines))
        return np.asarray(window, dtype=np.float64).astype(onnx_to_np(node.attr("output_datatype", 1)))

    register_op(op_type, infer=infer, cpu=cpu, min_opset=17, doc=doc)


_register_window("HannWindow", (0.5, 0.5), "Hann window (sin^2).")
_register_window("HammingWindow", (25 / 46, 21 / 46), "Hamming window (alpha = 25/46).")
_register_window("BlackmanWindow", (0.42, 0.5, 0.08), "Blackman window.")


# -- MelWeightMatrix ---------------------------------------------------------------------------------


def _mel_infer(node: Node, num_mel_bins: TensorInfo, dft_length: TensorInfo, *rest: TensorInfo) -> TensorInfo:
    dtype = onnx_to_np(node.attr("output_datatype", 1))
    if num_mel_bins.value is None or dft_length.value is None:
        return TensorInfo(dtype, None)
    return TensorInfo(dtype, (_scalar(dft_length.value, 0) // 2 + 1, _scalar(num_mel_bins.value, 0)))


def _mel_edges(num_mel_bins: int, dft_length: int, sample_rate: np.ndarray, lower_hz: np.ndarray,
               upper_hz: np.ndarray) -> np.ndarray:
    """Spectrogram bin index of each triangle's edges: num_mel_bins + 2 points spaced evenly in mel."""
    low_mel = 2595 * np.log1p(lower_hz / 700) / np.log(10)
    high_mel = 2595 * np.log1p(upper_hz / 700) / np.log(10)
    points = np.arange(num_mel_bins + 2)
    mels = points * ((high_mel - low_mel) / (num_mel_bins + 2)) + low_mel
    hertz = 700 * np.expm1(mels / 2595 * np.log(10))
    return (((dft_length + 1) * hertz) // sample_rate).astype(np.int64)


def _mel_cpu(node: Node, num_mel_bins: np.ndarray, dft_length: np.ndarray, sample_rate: np.ndarray,
             lower_hz: np.ndarray, upper_hz: np.ndarray) -> np.ndarray:
    """Triangular filters: rising from the left edge to 1 at the center, falling to the right edge."""
    mel_bins, length = _scalar(num_mel_bins, 0), _scalar(dft_length, 0)
    edges = _mel_edges(mel_bins, length, sample_rate, lower_hz, upper_hz)
    left, center, right = edges[:-2], edges[1:-1], edges[2:]
    j = np.arange(length // 2 + 1)[:, None]
    rising = np.where(center > left, (j - left) / np.maximum(center - left, 1), (j == center).astype(np.float64))
    falling = (right - j) / np.maximum(right - center, 1)
    weights = np.where((j >= center) & (j < right), falling, np.where((j >= left) & (j <= center), rising, 0.0))
    return weights.astype(onnx_to_np(node.attr("output_datatype", 1)))


register_op("MelWeightMatrix", infer=_mel_infer, cpu=_mel_cpu, min_opset=17,
            doc="Matrix mapping linear-frequency spectrogram bins to mel bins.")


# -- Det ---------------------------------------------------------------------------------------------


def _det_infer(node: Node, x: TensorInfo) -> TensorInfo:
    if x.shape is None:
        return TensorInfo(x.dtype, None)
    if len(x.shape) < 2 or x.shape[-1] != x.shape[-2]:
        raise ShapeInferenceError(f"Det needs [..., M, M] input, got {x.shape}")
    return TensorInfo(x.dtype, x.shape[:-2])


def _det_cpu(node: Node, x: np.ndarray) -> np.ndarray:
    wide = x if x.dtype in (np.float32, np.float64) else x.astype(np.float32)
    return np.asarray(np.linalg.det(wide)).astype(x.dtype)


register_op("Det", infer=_det_infer, cpu=_det_cpu, min_opset=11, doc="Determinant of (batches of) square matrices.")
