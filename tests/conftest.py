"""Suite-wide setup: GPU tests skip cleanly on machines without a usable CUDA device."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    from engine_core.cuda import is_available

    if is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (CUDA driver with a device)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
