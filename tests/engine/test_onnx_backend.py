"""Kiln behind onnx.backend.base.Backend (prepare / run_model / run_node / supports_device)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import engine_core.onnx_backend as backend
from tests.engine import models


def test_run_model_and_rep_cache(rng):
    rep = backend.prepare(models.add_sub(), "CPU")
    a = rng.standard_normal((2, 4)).astype(np.float32)
    b = rng.standard_normal((2, 4)).astype(np.float32)
    total, diff = rep.run([a, b])
    np.testing.assert_array_equal(total, a + b)
    np.testing.assert_array_equal(diff, a - b)
    rep.run({"a": a[:1], "b": b[:1]})
    assert len(rep._contexts) == 2  # one build per distinct shape signature


def test_run_node():
    node = onnx.helper.make_node("Sub", ["x", "y"], ["z"])
    (z,) = backend.run_node(node, [np.array([3, 4], np.int64), np.array([1, 1], np.int64)])
    assert z.tolist() == [2, 3] and z.dtype == np.int64


def test_devices_and_bad_model():
    assert backend.supports_device("CPU")
    with pytest.raises(Exception, match="not a valid ONNX model"):
        backend.prepare(b"definitely not onnx")
