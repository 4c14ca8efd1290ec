"""ai.onnx.preview.training ops (Adagrad, Adam, Momentum) and loss functions."""

from __future__ import annotations
