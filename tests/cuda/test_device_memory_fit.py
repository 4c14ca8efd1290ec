"""An engine whose weights cannot fit the device's free memory is refused before any upload, with the numbers
(issue #35: "a model larger than free device memory fails its load with a message naming the bytes needed and
free"), instead of a bare CUDA_ERROR_OUT_OF_MEMORY halfway through the upload."""

from __future__ import annotations

import pytest

import engine_core as kiln
from engine_core.backends.cuda import runner
from engine_core.backends.cuda.runner import check_fits_device
from tests.engine import models
from tests.engine.util import build


def test_weights_over_the_free_memory_are_refused_with_both_numbers():
    with pytest.raises(kiln.DeviceMemoryError, match=r"need 2,000,000,000 bytes .* 1,000,000,000 are free"):
        check_fits_device(2_000_000_000, 300, 1_000_000_000)


def test_activations_alone_never_refuse():
    """The activations are allocated per binding: a model whose largest shapes would not fit may serve smaller."""
    check_fits_device(100, 10**12, 1_000)


@pytest.mark.gpu
def test_loading_an_engine_that_does_not_fit_fails_before_uploading(monkeypatch):
    pytest.importorskip("cuda.bindings")
    if "cuda" not in kiln.available_backends():
        pytest.skip("no CUDA device")
    plan = build(models.mlp(), {"x": ((1, 16), (4, 16), (8, 16))}, backend="cuda")
    uploads = []
    monkeypatch.setattr(runner, "memory_info", lambda ordinal=0: (16, 1 << 30))
    monkeypatch.setattr(runner.DeviceBuffer, "from_array", staticmethod(lambda array: uploads.append(array)))
    with pytest.raises(kiln.DeviceMemoryError, match=r"16 are free"):
        kiln.Runtime().load(plan)
    assert uploads == []
    recorder = kiln.ErrorRecorder()
    runtime = kiln.Runtime()
    runtime.error_recorder = recorder
    assert runtime.deserialize_cuda_engine(plan) is None
    assert recorder.num_errors() == 1 and recorder.get_error_code(0) == kiln.ErrorCode.FAILED_ALLOCATION
    assert uploads == []
