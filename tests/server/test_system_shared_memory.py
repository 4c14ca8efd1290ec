"""System shared-memory regions in the core: inputs are read in place, and a region can go while a request still
holds its bytes."""

from __future__ import annotations

from multiprocessing import shared_memory

import numpy as np
import pytest

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


def test_a_name_registered_while_another_registration_mapped_it_is_refused_and_nothing_is_kept(monkeypatch) -> None:
    """Mapping (and page-locking) runs outside the registry's lock; the name is checked again when the region goes
    in, and the loser's mapping is closed."""
    from server.core import shared_memory as module
    from server.core.errors import ServerError

    block = shared_memory.SharedMemory(create=True, size=4096)
    try:
        regions = SharedMemory()
        real_map, mappings = module._map, []

        def map_and_race(name, key, offset, byte_size, keep_fd=False):
            mapping, fd = real_map(name, key, offset, byte_size, keep_fd)
            mappings.append(mapping)
            if len(mappings) == 1:  # while the first registration maps, a second one of the same name completes
                regions.register(name, key, offset, byte_size)
            return mapping, fd

        monkeypatch.setattr(module, "_map", map_and_race)
        with pytest.raises(ServerError, match="already in manager"):
            regions.register("raced", "/" + block.name, 0, 4096)
        assert mappings[0].closed and not mappings[1].closed  # the winner's region is the one kept
        assert [r["name"] for r in regions.status()] == ["raced"]
        regions.close()
    finally:
        block.close()
        block.unlink()
