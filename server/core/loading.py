"""Loading a model's versions together: all of them, or none (those that loaded are closed again)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import TypeVar

from .model import ServedModel

Version = TypeVar("Version", bound=ServedModel)


async def load_together(loads: Iterable[Awaitable[Version]]) -> dict[int, Version]:
    """Every version by number once all loads are done; if one failed, the loaded ones are closed and the first
    error is raised (a model is served with all its selected versions or not at all)."""
    results = await asyncio.gather(*loads, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        for result in results:
            if isinstance(result, ServedModel):
                result.close()
        raise errors[0]
    return {v.version: v for v in results if isinstance(v, ServedModel)}  # type: ignore[misc]
