"""Plan files: round trip, and every kind of damage is refused with a message, never executed."""

from __future__ import annotations

import struct

import numpy as np
import pytest

import engine_core as kiln
from engine_core.plan import MAGIC, deserialize_plan, read_plan_metadata
from tests.engine import models
from tests.engine.util import build

SHAPES = {"a": ((1, 4), (2, 4), (8, 4)), "b": ((1, 4), (2, 4), (8, 4))}


@pytest.fixture(scope="module")
def plan() -> bytes:
    return build(models.add_sub(), SHAPES)


def test_round_trip_keeps_everything(plan):
    p = deserialize_plan(plan)
    assert plan.startswith(MAGIC)
    assert [t.name for t in p.io] == ["a", "b", "sum", "diff"]
    assert p.profiles[0]["a"] == ((1, 4), (2, 4), (8, 4))
    assert p.backend == "cpu" and p.engine_version == kiln.__version__
    assert kiln.Runtime().load(plan).serialize() == plan


def test_weights_are_aligned_and_exact(rng):
    model = models.mlp()
    plan = build(model, {"x": ((1, 16), (1, 16), (2, 16))})
    p = deserialize_plan(plan)
    from onnx import numpy_helper

    w2 = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "W2"))
    np.testing.assert_array_equal(p.graph.constants["W2"], w2)
    meta, _ = read_plan_metadata(plan)
    for const in meta["graph"]["constants"].values():
        if "offset" in const:
            assert const["offset"] % 64 == 0


@pytest.mark.parametrize("cut", [0, 10, 63, 64, 200, -1])
def test_truncated_plan_is_refused(plan, cut):
    data = plan[:cut] if cut >= 0 else plan[:-1]
    with pytest.raises(kiln.PlanFormatError):
        kiln.Runtime().load(data)
    assert kiln.Runtime().deserialize_cuda_engine(data) is None


def test_trailing_garbage_is_refused(plan):
    with pytest.raises(kiln.PlanFormatError, match="truncated or has trailing data"):
        kiln.Runtime().load(plan + b"x")


@pytest.mark.parametrize("offset", [70, 200, -5])
def test_flipped_byte_is_refused(plan, offset):
    data = bytearray(plan)
    data[offset] ^= 0x40
    with pytest.raises(kiln.PlanFormatError, match="checksum"):
        kiln.Runtime().load(bytes(data))


def test_bad_magic_and_version_are_named(plan):
    with pytest.raises(kiln.PlanFormatError, match="bad magic"):
        kiln.Runtime().load(b"NOTAPLAN" + plan[8:])
    data = bytearray(plan)
    struct.pack_into("<I", data, 8, 99)
    with pytest.raises(kiln.PlanFormatError, match="format version 99"):
        kiln.Runtime().load(bytes(data))


def test_random_bytes_are_refused(rng):
    for size in (0, 5, 64, 1000):
        with pytest.raises(kiln.PlanFormatError):
            kiln.Runtime().load(rng.integers(0, 256, size, dtype=np.uint8).tobytes())


def test_plan_from_another_engine_version_is_refused(plan, monkeypatch):
    import engine_core.plan as plan_module

    monkeypatch.setattr(plan_module, "__version__", "9.9.0")
    with pytest.raises(kiln.PlanFormatError, match="built by Kiln 0.1"):
        kiln.Runtime().load(plan)
