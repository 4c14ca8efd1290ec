"""System shared-memory regions in the core: inputs are read in place, and a region can go while a request still
holds its bytes."""

from __future__ import annotations

from multiprocessing import shared_memory

import numpy as np

from server.core.shared_memory import SharedMemory
from server.core.tensors import from_raw


def test_inputs_are_views_and_unregistering_a_region_in_use_is_safe() -> None:
    block = shared_memory.SharedMemory(create=True, size=4096)
    try:
        block.buf[:64] = np.arange(16, dtype=np.float32).tobytes()
        regions = SharedMemory()
        regions.register("in", "/" + block.name, 0, 4096)
        view = regions.read("in", 0, 64)
        array = from_raw(view, "FP32", (1, 16))
        assert not array.flags.writeable  # the engine must never write into a client's input region
        block.buf[:4] = np.float32(7).tobytes()  # no copy was taken: the array sees the region
        assert array[0, 0] == 7 and array[0, 15] == 15
        regions.unregister("in")  # a request still holds `array`: no error, the mapping stays until it goes
        assert regions.status() == []
        assert array[0, 1] == 1
        regions.register("in", "/" + block.name, 0, 4096)  # the name is free again
        regions.close()
        del array, view
    finally:
        block.close()
        block.unlink()
